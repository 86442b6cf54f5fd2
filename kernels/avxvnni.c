/* x86-64 AVX-VNNI variant (Alder Lake and later): vpdpwssd fuses vpmaddwd + vpaddd. */
#if !defined(__x86_64__) || !defined(__AVXVNNI__)
#error "avxvnni.c needs an x86-64 compiler with -mavxvnni"
#endif
#define EA_X86_MR8 8
#define EA_X86_MR16 6
#define EA_X86_DOT(acc, a, b) _mm256_dpwssd_avx_epi32((acc), (a), (b))
#define EA_X86_VARIANT ea_variant_avxvnni
#define EA_X86_NAME "avx_vnni"
#define EA_X86_FEATURES "avx2 avx_vnni"
#include "x86_common.h"
