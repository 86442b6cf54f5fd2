/* x86-64 AVX512-VNNI variant (Ice Lake, Zen 4 and later).
 *
 * u8 x s8 (the weights' usual layout): 512-bit vpdpbusd tiles on b + 128 (unsigned, packed
 * so once) and a, 64 MACs per instruction, exact for any B (x86_gemm512.h); depthwise on
 * 512-bit vpdpbusd too (x86_dw512.h). The int16 layout (B = -128 forced by
 * EDGE_AGENT_NATIVE_LAYOUT) keeps the EVEX vpdpwssd on 256-bit registers with 32 of them,
 * so taller 12-row tiles. */
#if !defined(__x86_64__) || !defined(__AVX512VNNI__) || !defined(__AVX512VL__)
#error "avx512vnni.c needs an x86-64 compiler with -mavx512vnni -mavx512vl"
#endif
#define EA_X86_MR8 12
#define EA_X86_MR16 12
#define EA_X86_DOT(acc, a, b) _mm256_dpwssd_epi32((acc), (a), (b))
#define EA_X86_VARIANT ea_variant_avx512vnni
#define EA_X86_NAME "avx512_vnni"
#define EA_X86_FEATURES "avx2 avx512f avx512bw avx512vl avx512_vnni"
#define EA_X86_QMAXK 0 /* one vpdpbusd per 32 MACs: always worth it */
#define EA_X86_QB_OFFSET 128
#define EA_X86_DOT4(acc, ua, sb) _mm256_dpbusd_epi32((acc), (ua), (sb))
#define EA_X86_OWN_VARIANT
#include "x86_common.h"
#include "x86_dw512.h"
#include "x86_gemm512.h"

const ea_variant EA_X86_VARIANT = {
    EA_X86_NAME, EA_X86_FEATURES, EA_X86_MR8, NR, KC, 2, 2, x86_gemm8, EA_X86_MR16, x86_gemm16,
    x86_widen, x86_dw512, x86_requant_n, x86_add, 0, 4, 2 * Z_PAIRS, z_qgemm_pair, 16,
    z_qgemm_wide, EA_X86_QMAXK, EA_X86_QB_OFFSET, 4, x86_rowsums, 32,
};
