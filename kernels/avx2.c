/* x86-64 AVX2 variant: vpmaddwd + vpaddd (16 exact int8 MACs per pair of instructions). */
#if !defined(__x86_64__) || !defined(__AVX2__)
#error "avx2.c needs an x86-64 compiler with -mavx2"
#endif
#define EA_X86_MR8 8
#define EA_X86_MR16 4
#define EA_X86_DOT(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#define EA_X86_VARIANT ea_variant_avx2
#define EA_X86_NAME "avx2"
#define EA_X86_FEATURES "avx2"
#include "x86_common.h"
