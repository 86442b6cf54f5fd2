/* x86-64 AVX2 variant. Weights without -128 (all of TFLite's symmetric ones) take the u8 x s8
 * path: vpabsb + vpsignb + vpmaddubsw + vpmaddwd (against 1s, or 2s for the fast epilogue) +
 * vpaddd per 32 MACs, exact (x86_common.h); others the int16 path: vpmaddwd + vpaddd per 16
 * MACs. Both need the same multiply-port slots per MAC, but the u8 path reads A as int8 in
 * place (no widening pass) and halves B's bytes -- and it is the data path the VNNI variants
 * run, which no machine or emulator here can execute, tested here one instruction short.
 * The u8 path at every K: on Zen 3 (EPYC, bench/int8_ports.c: vpmaddubsw and vpmaddwd 2 per
 * cycle) it is faster than the int16 one at every K measured, 1024^3 included (23.5 vs 26.3 ms,
 * same run): with B panels twice as large the int16 kernel waits on L2. On Zen 2 (one multiply
 * port) the int16 path was ahead above K = 64 (38 vs 32 GOP/s on 1024^3), which is what
 * EA_X86_QMAXK 64 encoded -- mostly the 6-row tile's register spills (below): with 4-row tiles
 * past K 64 the two are level there (93.5 vs 95.5 GOP/s, same run). EDGE_AGENT_NATIVE_LAYOUT=int16
 * still selects the int16 path. */
#if !defined(__x86_64__) || !defined(__AVX2__)
#error "avx2.c needs an x86-64 compiler with -mavx2"
#endif
#define EA_X86_MR8 8
#define EA_X86_MR16 4
#define EA_X86_DOT(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#define EA_X86_VARIANT ea_variant_avx2
#define EA_X86_NAME "avx2"
#define EA_X86_FEATURES "avx2"
#define EA_X86_QMR8 8
#define EA_X86_QMR16 6 /* 12 accumulators: 2-4 % faster than 4 rows over MobileNet's shapes (Zen 3) */
/* ...but the 6-row tile needs 18 vector registers (12 accumulators, 2 B vectors, A, |A|, a
 * product, the widening constant) of 16, and GCC spills two accumulators inside the K loop.
 * Short K hides it; on Zen 2 it made K = 576 7 % and K >= 2176 1.5x slower than 4-row tiles
 * (and erratic with the row-block size), while 4 rows were within 1 % of 6 from K = 96 up and
 * 1-5 % behind only at K <= 56 (MobileNetV2 0.35's GEMM shapes, same run). So 4 rows past K 64. */
#define EA_X86_QDEEP_K 64
#define EA_X86_QMR16_DEEP 4
#define EA_X86_QMAXK 0 /* u8 x s8 whenever exact (B without -128) */
#define EA_X86_WIDEN_BY_MADD 1 /* vpmaddwd against 2 doubles the sums for the fast epilogue */
#define EA_X86_DOT4(acc, ua, sb) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((ua), (sb)), widen16))
#include "x86_common.h"
