/* x86-64 AVX-VNNI variant (Alder Lake and later): vpdpwssd fuses vpmaddwd + vpaddd.
 *
 * u8 x s8: vpdpbusd on b + 128 (unsigned, packed so once) and a, one instruction per 32
 * MACs where AVX2 needs vpabsb, vpsignb, vpmaddubsw, vpmaddwd and vpaddd; exact for any B
 * (x86_common.h). */
#if !defined(__x86_64__) || !defined(__AVXVNNI__)
#error "avxvnni.c needs an x86-64 compiler with -mavxvnni"
#endif
#define EA_X86_MR8 8
#define EA_X86_MR16 6
#define EA_X86_DOT(acc, a, b) _mm256_dpwssd_avx_epi32((acc), (a), (b))
#define EA_X86_VARIANT ea_variant_avxvnni
#define EA_X86_NAME "avx_vnni"
#define EA_X86_FEATURES "avx2 avx_vnni"
#define EA_X86_QMR8 8
#define EA_X86_QMR16 6
#define EA_X86_QMAXK 0 /* one vpdpbusd per 32 MACs: always worth it */
#define EA_X86_QB_OFFSET 128
#define EA_X86_DOT4(acc, ua, sb) _mm256_dpbusd_avx_epi32((acc), (ua), (sb))
#include "x86_common.h"
