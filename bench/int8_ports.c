/* Register-only throughput of the x86 multiply instructions int8 kernels can use, against
 * fp32 FMA (what numpy/OpenBLAS runs), in MACs per nanosecond of thread CPU time, and the
 * core's clock as it runs them. Built and run by bench/bench_kernels.py with -mavx2 -mfma
 * (x86-64 with AVX2). Prints one line per measurement: "<name> <MACs per instruction> <ns per
 * instruction>"; the first is "cycle 0 <ns>": the clock, from 50 dependent integer adds per
 * loop (1 cycle each on every x86-64 core), because /proc/cpuinfo's MHz is the base or a
 * momentary figure (2,600 MHz reported on a core measured at 3.49 GHz).
 *
 * Saturating the ports: every single-instruction row runs its instruction on as many
 * independent accumulators as the register file holds beside the two operands -- 14 ymm
 * chains, 24 zmm chains -- in one asm block with hand-allocated registers (in C, GCC kept an
 * array of accumulators in memory). With 10 chains, vfmadd231ps ymm and vpdpbusd ymm came out
 * 5-6 % slow on a Zen 4 (4-5 cycles latency x 2 per cycle is 8-10 in flight, and the loop
 * needs a few more); 10 was what printed "met" for a 60 % target that was not. Best of 15 runs.
 *
 * The VNNI loops (vpdpbusd ymm, vpdpbusd zmm, vpdpwssd zmm; and vfmadd231ps zmm, the fp32
 * reference on AVX-512 CPUs) live in functions with their own
 * target attributes, so an -mavx2 -mfma build still compiles them, and they RUN only when
 * __builtin_cpu_supports says this CPU (and OS) has the extension; their lines are absent
 * otherwise. -DPORTS_NO_VNNI (or a compiler too old for the targets) leaves them out entirely. */
#include <immintrin.h>
#include <stdio.h>
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

static const long n = 2000000;
static volatile int sink; /* keeps the chains live */
#define REPS 15

/* op on operands ymm14/ymm15 (zmm30/zmm31) into accumulator i: "op src2, src1, dst" */
#define Y(op, i) op " %%ymm15, %%ymm14, %%ymm" #i "\n\t"
#define Y14(op) Y(op, 0) Y(op, 1) Y(op, 2) Y(op, 3) Y(op, 4) Y(op, 5) Y(op, 6) Y(op, 7) Y(op, 8) Y(op, 9) \
                Y(op, 10) Y(op, 11) Y(op, 12) Y(op, 13)
#define Z(op, i) op " %%zmm31, %%zmm30, %%zmm" #i "\n\t"
#define Z24(op) Z(op, 0) Z(op, 1) Z(op, 2) Z(op, 3) Z(op, 4) Z(op, 5) Z(op, 6) Z(op, 7) Z(op, 8) Z(op, 9) \
                Z(op, 10) Z(op, 11) Z(op, 12) Z(op, 13) Z(op, 14) Z(op, 15) Z(op, 16) Z(op, 17) Z(op, 18) \
                Z(op, 19) Z(op, 20) Z(op, 21) Z(op, 22) Z(op, 23)
/* the exact u8 x s8 step: vpmaddubsw + vpmaddwd per 32 MACs, 7 pairs */
#define PAIR(c, d) "vpmaddubsw %%ymm15, %%ymm14, %%ymm" #c "\n\tvpmaddwd %%ymm15, %%ymm14, %%ymm" #d "\n\t"
#define PAIRS7 PAIR(0, 1) PAIR(2, 3) PAIR(4, 5) PAIR(6, 7) PAIR(8, 9) PAIR(10, 11) PAIR(12, 13)
#define YSETUP "vpbroadcastd %0, %%ymm14\n\tvmovdqa %%ymm14, %%ymm15\n\t"
#define ZSETUP "vpbroadcastd %0, %%zmm30\n\tvmovdqa64 %%zmm30, %%zmm31\n\t"
#define YMM_REGS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                 "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"
#define ZMM_REGS YMM_REGS, "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm30", "xmm31"
/* seconds per instruction (per `per` of them: one loop iteration runs `body`), best of REPS.
 * 64 in each byte, 3.0039 as a float: no saturation worth a slow path, no denormals. */
#define TIMED(fname, target_str, setup, body, per, regs)                                            \
    __attribute__((target(target_str), noinline)) static double fname(void) {                      \
        static const int operand = 0x40404040;                                                      \
        double best = 1e9;                                                                          \
        for (int rep = 0; rep < REPS; rep++) {                                                      \
            double t = now();                                                                       \
            __asm__ volatile(setup "mov %1, %%rax\n1:\n\t" body "dec %%rax\n\tjnz 1b"           \
                             : : "m"(operand), "r"(n) : "rax", regs);                                 \
            t = now() - t; if (t < best) best = t;                                                  \
        }                                                                                           \
        return best / n / (per);                                                                    \
    }
TIMED(fma_ymm, "avx2,fma", YSETUP, Y14("vfmadd231ps"), 14, YMM_REGS)
TIMED(maddwd_ymm, "avx2,fma", YSETUP, Y14("vpmaddwd"), 14, YMM_REGS)
TIMED(maddubsw_ymm, "avx2,fma", YSETUP, Y14("vpmaddubsw"), 14, YMM_REGS)
TIMED(exact_pair, "avx2,fma", YSETUP, PAIRS7, 7, YMM_REGS)

/* ns per cycle: 50 dependent adds per iteration (the loop's own dec/jnz is another chain) */
__attribute__((noinline)) static double cycle(void) {
    double best = 1e9;
    for (int rep = 0; rep < REPS; rep++) {
        long x = 0;
        double t = now();
        for (long i = 0; i < n; i++) __asm__ volatile(".rept 50\n\tadd $1, %0\n\t.endr" : "+r"(x));
        t = now() - t; if (t < best) best = t;
        sink = (int)x;
    }
    return best / n / 50;
}

/* Exact u8 x s8 steps that widen vpmaddubsw's int16 pair sums WITHOUT a second multiply, so
 * only one instruction of the step needs the multiply port (32 MACs each), 5 chains:
 * SHIFTW: lo = (t << 16) >> 16 and hi = t >> 16 (arithmetic), both added to the int32 lane.
 * SHUFW: t ^ 0x80008000 makes both words non-negative (x + 32768, exact in int16 range); vpand
 * keeps the low word, vpshufb moves the high one down (zero-filled); both are added (the
 * 2 x 32768 per step is taken off once at the end). Each loop in its own function, so its
 * registers (at most 16 ymm) are not spilled around the asm statements. */
#define SHIFTW(c) __asm__ volatile("vpmaddubsw %3,%4,%1\n\tvpsrad $16,%1,%2\n\tvpslld $16,%1,%1\n\t"  \
                                   "vpsrad $16,%1,%1\n\tvpaddd %1,%0,%0\n\tvpaddd %2,%0,%0"          \
                                   : "+x"(c), "=&x"(t1), "=&x"(t2) : "x"(a), "x"(b));
#define SHUFW(c) __asm__ volatile("vpmaddubsw %3,%4,%1\n\tvpxor %5,%1,%1\n\tvpshufb %6,%1,%2\n\t"      \
                                  "vpand %7,%1,%1\n\tvpaddd %1,%0,%0\n\tvpaddd %2,%0,%0"              \
                                  : "+x"(c), "=&x"(t1), "=&x"(t2) : "x"(a), "x"(b), "x"(bias), "x"(hi), "x"(lo));
#define WIDEN_LOOP(fname, STEP)                                                                 \
    __attribute__((noinline)) static double fname(void) {                                      \
        const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5);                         \
        const __m256i bias = _mm256_set1_epi32((int)0x80008000u), lo = _mm256_set1_epi32(0xFFFF); \
        const __m256i hi = _mm256_setr_epi8(2, 3, -1, -1, 6, 7, -1, -1, 10, 11, -1, -1, 14, 15, -1, -1, \
                                            2, 3, -1, -1, 6, 7, -1, -1, 10, 11, -1, -1, 14, 15, -1, -1); \
        (void)bias, (void)lo, (void)hi;                                                         \
        __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, t1, t2;        \
        double best = 1e9;                                                                      \
        for (int rep = 0; rep < REPS; rep++) {                                                  \
            double t = now();                                                                   \
            for (long i = 0; i < n; i++) { STEP(c0) STEP(c1) STEP(c2) STEP(c3) STEP(c4) }      \
            t = now() - t; if (t < best) best = t;                                              \
        }                                                                                       \
        int x[8];                                                                               \
        _mm256_storeu_si256((__m256i *)x, _mm256_add_epi32(_mm256_add_epi32(c0, c1),           \
                                                           _mm256_add_epi32(_mm256_add_epi32(c2, c3), c4))); \
        sink = x[0];                                                                            \
        return best / n / 5;                                                                    \
    }
WIDEN_LOOP(shift_widening, SHIFTW)
WIDEN_LOOP(shuffle_widening, SHUFW)

/* The hybrid the second FMA pipe allows: int8 products are exact in fp32 while |sum| < 2^24,
 * so FMAs could take rows the multiply port cannot. 4 exact pairs (ymm0-7) + 6 fp32 FMA chains
 * (ymm8-13) on the operands in ymm14 and ymm15, all in one asm block: written in C, GCC spilled
 * two of the 18 values and reloaded the float operands inside the loop. */
#define HYB_PAIR(c, d) "vpmaddubsw %%ymm15, %%ymm14, %%ymm" c "\n\tvpmaddwd %%ymm15, %%ymm14, %%ymm" d "\n\t"
#define HYB_FMA(f) "vfmadd231ps %%ymm15, %%ymm14, %%ymm" f "\n\t"
__attribute__((noinline)) static double hybrid(void) {
    static const int operand = 0x40404040; /* 64 in each byte, 3.0039 as a float: no denormals */
    double best = 1e9;
    for (int rep = 0; rep < REPS; rep++) {
        double t = now();
        __asm__ volatile("vpbroadcastd %1, %%ymm14\n\tvmovdqa %%ymm14, %%ymm15\n\t"
                         "vxorps %%xmm8, %%xmm8, %%xmm8\n\tvxorps %%xmm9, %%xmm9, %%xmm9\n\t"
                         "vxorps %%xmm10, %%xmm10, %%xmm10\n\tvxorps %%xmm11, %%xmm11, %%xmm11\n\t"
                         "vxorps %%xmm12, %%xmm12, %%xmm12\n\tvxorps %%xmm13, %%xmm13, %%xmm13\n\t"
                         "mov %2, %%rax\n"
                         "1:\n\t" HYB_PAIR("0", "1") HYB_PAIR("2", "3") HYB_PAIR("4", "5") HYB_PAIR("6", "7")
                         HYB_FMA("8") HYB_FMA("9") HYB_FMA("10") HYB_FMA("11") HYB_FMA("12") HYB_FMA("13")
                         "dec %%rax\n\tjnz 1b\n\tvmovd %%xmm8, %0"
                         : "=r"(sink) : "m"(operand), "r"(n)
                         : "rax", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                           "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
        t = now() - t; if (t < best) best = t;
    }
    return best / n;
}

#if PORTS_VNNI
/* "{vex}" ("%{vex%}" in inline asm) forces the AVX-VNNI (VEX) encoding; without it the assembler picks the EVEX
 * (AVX512-VNNI + AVX512VL) one, which faults on AVX-VNNI-only CPUs. */
TIMED(dpbusd_ymm_vex, "avx2,avxvnni", YSETUP, Y14("%{vex%} vpdpbusd"), 14, YMM_REGS)
TIMED(dpbusd_ymm_evex, "avx512f,avx512vnni,avx512vl", YSETUP, Y14("vpdpbusd"), 14, YMM_REGS)
TIMED(dpbusd_zmm, "avx512f,avx512vnni", ZSETUP, Z24("vpdpbusd"), 24, ZMM_REGS)
TIMED(dpwssd_zmm, "avx512f,avx512vnni", ZSETUP, Z24("vpdpwssd"), 24, ZMM_REGS)
TIMED(fma_zmm, "avx512f", ZSETUP, Z24("vfmadd231ps"), 24, ZMM_REGS) /* what a 512-bit fp32 BLAS runs */
#endif

/* The same question in a GEMM tile: 16 columns, K = 256, operands loaded from L1 (B int16 pairs
 * 8 KiB, B fp32 16 KiB, A rows) into hand-allocated registers (written in C, GCC spilled 4
 * accumulators of the hybrid).
 * 6 int16 rows (vpmaddwd: 12 accumulators, 2 B, broadcast A, product) against 4 int16 rows + 2
 * fp32 rows (FMA with B from memory, broadcast A). Seconds per k pair (192 MACs). The arrays stay
 * zero: these instructions take the same time whatever the values. */
#define TK 256
static int16_t tile_bi[TK / 2][16][2] __attribute__((aligned(64)));
static float tile_bf[TK][16] __attribute__((aligned(64)));
static int16_t tile_ai[6][TK] __attribute__((aligned(64)));
static float tile_af[2][TK] __attribute__((aligned(64)));
#define XSTR_(x) #x
#define XSTR(x) XSTR_(x)
/* int16 row at byte offset off of A: two vpmaddwd + vpaddd into a0, a1 */
#define TI(off, a0, a1) "vpbroadcastd " off "(%%rsi), %%ymm14\n\tvpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"    \
                        "vpaddd %%ymm15, " a0 ", " a0 "\n\tvpmaddwd %%ymm13, %%ymm14, %%ymm15\n\t"           \
                        "vpaddd %%ymm15, " a1 ", " a1 "\n\t"
/* fp32 row: A at aoff, B row at boff */
#define TF(aoff, boff, f0, f1) "vbroadcastss " aoff "(%%rcx), %%ymm14\n\tvfmadd231ps " boff "(%%rdx), %%ymm14, " \
                               f0 "\n\tvfmadd231ps " boff "+32(%%rdx), %%ymm14, " f1 "\n\t"
#define TZERO "vpxor %%xmm0, %%xmm0, %%xmm0\n\t" "vpxor %%xmm1, %%xmm1, %%xmm1\n\t" "vpxor %%xmm2, %%xmm2, %%xmm2\n\t" \
              "vpxor %%xmm3, %%xmm3, %%xmm3\n\t" "vpxor %%xmm4, %%xmm4, %%xmm4\n\t" "vpxor %%xmm5, %%xmm5, %%xmm5\n\t" \
              "vpxor %%xmm6, %%xmm6, %%xmm6\n\t" "vpxor %%xmm7, %%xmm7, %%xmm7\n\t" "vpxor %%xmm8, %%xmm8, %%xmm8\n\t" \
              "vpxor %%xmm9, %%xmm9, %%xmm9\n\t" "vpxor %%xmm10, %%xmm10, %%xmm10\n\t" "vpxor %%xmm11, %%xmm11, %%xmm11\n\t"
#define TCLOBBER "rsi", "rcx", "rax", "rdx", "r8", "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", \
                 "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"

static void tile_int16(void) {
    __asm__ volatile(TZERO "mov %1, %%rsi\n\tmov %2, %%rax\n\tmov $" XSTR(TK / 2) ", %%r8\n"
                     "1:\n\tvmovdqa (%%rax), %%ymm12\n\tvmovdqa 32(%%rax), %%ymm13\n\t"
                     TI("0", "%%ymm0", "%%ymm1") TI("512", "%%ymm2", "%%ymm3") TI("1024", "%%ymm4", "%%ymm5")
                     TI("1536", "%%ymm6", "%%ymm7") TI("2048", "%%ymm8", "%%ymm9") TI("2560", "%%ymm10", "%%ymm11")
                     "add $4, %%rsi\n\tadd $64, %%rax\n\tdec %%r8\n\tjnz 1b\n\t"
                     "vmovd %%xmm0, %%ecx\n\tmov %%ecx, %0"
                     : "=m"(sink) : "r"(&tile_ai[0][0]), "r"(&tile_bi[0][0][0]) : TCLOBBER);
}

static void tile_hybrid(void) {
    __asm__ volatile(TZERO "mov %1, %%rsi\n\tmov %2, %%rcx\n\tmov %3, %%rax\n\tmov %4, %%rdx\n\t"
                     "mov $" XSTR(TK / 2) ", %%r8\n"
                     "1:\n\tvmovdqa (%%rax), %%ymm12\n\tvmovdqa 32(%%rax), %%ymm13\n\t"
                     TI("0", "%%ymm0", "%%ymm1") TI("512", "%%ymm2", "%%ymm3")
                     TF("0", "0", "%%ymm8", "%%ymm9") TF("1024", "0", "%%ymm10", "%%ymm11")
                     TI("1024", "%%ymm4", "%%ymm5") TI("1536", "%%ymm6", "%%ymm7")
                     TF("4", "64", "%%ymm8", "%%ymm9") TF("1028", "64", "%%ymm10", "%%ymm11")
                     "add $4, %%rsi\n\tadd $8, %%rcx\n\tadd $64, %%rax\n\tadd $128, %%rdx\n\tdec %%r8\n\tjnz 1b\n\t"
                     "vmovd %%xmm0, %%ecx\n\tmov %%ecx, %0"
                     : "=m"(sink)
                     : "r"(&tile_ai[0][0]), "r"(&tile_af[0][0]), "r"(&tile_bi[0][0][0]), "r"(&tile_bf[0][0])
                     : TCLOBBER);
}

static double time_tile(void (*tile)(void)) {
    double best = 1e9;
    for (int rep = 0; rep < 7; rep++) {
        double t = now();
        for (long i = 0; i < 100000; i++) tile();
        t = now() - t; if (t < best) best = t;
    }
    return best / 100000 / (TK / 2);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0); /* a line per row as it is measured: a run cut short keeps them */
    printf("cycle 0 %.4f\n", cycle() * 1e9);
    printf("vfmadd231ps 8 %.4f\n", fma_ymm() * 1e9);
    printf("vpmaddwd 16 %.4f\n", maddwd_ymm() * 1e9);
    printf("vpmaddubsw 32 %.4f\n", maddubsw_ymm() * 1e9);
    printf("vpmaddubsw+vpmaddwd 32 %.4f\n", exact_pair() * 1e9);
    printf("vpmaddubsw+shift_widening 32 %.4f\n", shift_widening() * 1e9);
    printf("vpmaddubsw+shuffle_widening 32 %.4f\n", shuffle_widening() * 1e9);
    printf("4_pairs+6_fp32_FMAs 176 %.4f\n", hybrid() * 1e9);
    printf("tile:_6_int16_rows 192 %.4f\n", time_tile(tile_int16) * 1e9);
    printf("tile:_4_int16_+_2_fp32_rows 192 %.4f\n", time_tile(tile_hybrid) * 1e9);
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
    return sink == 42; /* keeps the results live */
}
