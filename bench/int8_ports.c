/* Register-only throughput of the x86 multiply instructions int8 kernels can use, against
 * fp32 FMA (what numpy/OpenBLAS runs), in MACs per nanosecond of thread CPU time.
 * 10 independent accumulator chains per instruction hide latency; best of 15 runs.
 * Built and run by bench/bench_kernels.py with -mavx2 -mfma (x86-64 with AVX2). Prints one line
 * per instruction: "<name> <MACs per instruction> <ns per instruction>".
 *
 * The VNNI loops (vpdpbusd ymm, vpdpbusd zmm, vpdpwssd zmm; and vfmadd231ps zmm, the fp32
 * reference on AVX-512 CPUs) live in functions with their own
 * target attributes, so an -mavx2 -mfma build still compiles them, and they RUN only when
 * __builtin_cpu_supports says this CPU (and OS) has the extension; their lines are absent
 * otherwise. -DPORTS_NO_VNNI (or a compiler too old for the targets) leaves them out entirely. */
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#if !defined(PORTS_NO_VNNI) && ((defined(__clang__) && __clang_major__ >= 12) || \
                                (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define PORTS_VNNI 1
#else
#define PORTS_VNNI 0
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define R(op, c) __asm__ volatile(op " %1,%2,%0" : "+x"(c) : "x"(a), "x"(b));
#define R10(op) R(op, c0) R(op, c1) R(op, c2) R(op, c3) R(op, c4) R(op, c5) R(op, c6) R(op, c7) R(op, c8) R(op, c9)
#define PAIR(c, d) R("vpmaddubsw", c) R("vpmaddwd", d)

static const long n = 5000000;
static volatile int sink; /* keeps the chains live */

#if PORTS_VNNI
/* One timing function per VNNI instruction: 10 chains of `op` on `type` registers, best of 15
 * runs, seconds per instruction. */
#define VNNI_LOOP(fname, target_str, type, set1, op)                                      \
    __attribute__((target(target_str), noinline)) static double fname(void) {           \
        type a = set1(3), b = set1(5);                                                  \
        type c0 = set1(0), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, \
             c8 = c0, c9 = c0;                                                          \
        double best = 1e9;                                                              \
        for (int rep = 0; rep < 15; rep++) {                                            \
            double t = now();                                                           \
            for (long i = 0; i < n; i++) { R10(op) }                                    \
            t = now() - t; if (t < best) best = t;                                      \
        }                                                                               \
        type s[10] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9};                          \
        int x = 0, v;                                                                   \
        for (int j = 0; j < 10; j++) { memcpy(&v, &s[j], sizeof v); x += v; }           \
        sink = x;                                                                       \
        return best / n / 10;                                                           \
    }
/* "{vex}" ("%{vex%}" in inline asm) forces the AVX-VNNI (VEX) encoding; without it the assembler picks the EVEX
 * (AVX512-VNNI + AVX512VL) one, which faults on AVX-VNNI-only CPUs. */
VNNI_LOOP(dpbusd_ymm_vex, "avx2,avxvnni", __m256i, _mm256_set1_epi8, "%{vex%} vpdpbusd")
VNNI_LOOP(dpbusd_ymm_evex, "avx512f,avx512vnni,avx512vl", __m256i, _mm256_set1_epi8, "vpdpbusd")
VNNI_LOOP(dpbusd_zmm, "avx512f,avx512vnni", __m512i, _mm512_set1_epi8, "vpdpbusd")
VNNI_LOOP(dpwssd_zmm, "avx512f,avx512vnni", __m512i, _mm512_set1_epi8, "vpdpwssd")
VNNI_LOOP(fma_zmm, "avx512f", __m512i, _mm512_set1_epi8, "vfmadd231ps") /* what a 512-bit fp32 BLAS runs */
#endif

int main(void) {
    __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5);
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0,
            c8 = c0, c9 = c0;
    double best[4] = {1e9, 1e9, 1e9, 1e9};
    for (int rep = 0; rep < 15; rep++) {
        double t = now();
        for (long i = 0; i < n; i++) { R10("vfmadd231ps") }
        t = now() - t; if (t < best[0]) best[0] = t;
        t = now();
        for (long i = 0; i < n; i++) { R10("vpmaddwd") }
        t = now() - t; if (t < best[1]) best[1] = t;
        t = now();
        for (long i = 0; i < n; i++) { R10("vpmaddubsw") }
        t = now() - t; if (t < best[2]) best[2] = t;
        t = now(); /* the exact u8 x s8 step: vpmaddubsw + vpmaddwd per 32 MACs (5 pairs) */
        for (long i = 0; i < n; i++) { PAIR(c0, c1) PAIR(c2, c3) PAIR(c4, c5) PAIR(c6, c7) PAIR(c8, c9) }
        t = now() - t; if (t < best[3]) best[3] = t;
    }
    printf("vfmadd231ps 8 %.4f\n", best[0] / n / 10 * 1e9);
    printf("vpmaddwd 16 %.4f\n", best[1] / n / 10 * 1e9);
    printf("vpmaddubsw 32 %.4f\n", best[2] / n / 10 * 1e9);
    printf("vpmaddubsw+vpmaddwd 32 %.4f\n", best[3] / n / 5 * 1e9);
#if PORTS_VNNI
    __builtin_cpu_init();
    int avx512vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni");
    /* the exact u8 x s8 step in one instruction: 4 u8*s8 products summed into each int32 lane */
    if (__builtin_cpu_supports("avxvnni"))
        printf("vpdpbusd_ymm 32 %.4f\n", dpbusd_ymm_vex() * 1e9);
    else if (avx512vnni && __builtin_cpu_supports("avx512vl"))
        printf("vpdpbusd_ymm 32 %.4f\n", dpbusd_ymm_evex() * 1e9);
    if (__builtin_cpu_supports("avx512f"))
        printf("vfmadd231ps_zmm 16 %.4f\n", fma_zmm() * 1e9);
    if (avx512vnni) {
        printf("vpdpbusd_zmm 64 %.4f\n", dpbusd_zmm() * 1e9);
        printf("vpdpwssd_zmm 32 %.4f\n", dpwssd_zmm() * 1e9); /* int16 pairs into int32 */
    }
#endif
    int x[8];
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
                                 _mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(c6, c7)));
    _mm256_storeu_si256((__m256i *)x, _mm256_add_epi32(s, _mm256_add_epi32(c8, c9)));
    return x[0] == 42 + sink; /* keeps the chains live */
}
