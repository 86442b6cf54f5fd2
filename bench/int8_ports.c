/* Register-only throughput of the x86 multiply instructions int8 kernels can use, against
 * fp32 FMA (what numpy/OpenBLAS runs), in MACs per nanosecond of thread CPU time.
 * 10 independent accumulator chains per instruction hide latency; best of 15 runs.
 * Built and run by bench/bench_kernels.py (x86-64 with AVX2 only). Prints one line per
 * instruction: "<name> <MACs per instruction> <ns per instruction>". */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define R(op, c) __asm__ volatile(op " %1,%2,%0" : "+x"(c) : "x"(a), "x"(b));
#define R10(op) R(op, c0) R(op, c1) R(op, c2) R(op, c3) R(op, c4) R(op, c5) R(op, c6) R(op, c7) R(op, c8) R(op, c9)
#define PAIR(c, d) R("vpmaddubsw", c) R("vpmaddwd", d)

int main(void) {
    __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5);
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0,
            c8 = c0, c9 = c0;
    const long n = 5000000;
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
    int x[8];
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
                                 _mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(c6, c7)));
    _mm256_storeu_si256((__m256i *)x, _mm256_add_epi32(s, _mm256_add_epi32(c8, c9)));
    return x[0] == 42; /* keeps the chains live */
}
