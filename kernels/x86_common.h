/* x86 kernels shared by the AVX2, AVX-VNNI and AVX512-VNNI variants; each variant file sets
 * the multiply-accumulate (EA_X86_DOT), the tile heights (EA_X86_MR8 for 8 columns,
 * EA_X86_MR16 for 16) and its name, then includes this file. Only the MAC instruction and
 * the tile heights differ, so the VNNI variants (which no emulator here can run) share
 * every other line with the AVX2 variant.
 *
 * GEMM, outer-product layout: A rows are widened to int16 once per row block; B panels are
 * [K/2][8 columns][2 k] int16. Per k-pair, the pair (a[m][k], a[m][k+1]) is broadcast to
 * all 8 lanes (one vpbroadcastd from memory) and vpmaddwd / vpdpwssd against the panel
 * gives each column's a_k*b_k + a_k1*b_k1 exactly in int32 (|a*b| <= 2^14, no int16
 * saturation anywhere). Accumulators are column vectors: no horizontal sums, and the
 * requantisation constants are per column, so they are prepared once per tile.
 */
#ifndef EA_X86_COMMON_H
#define EA_X86_COMMON_H

#include <immintrin.h>

#include "internal.h"

#define NR 8
#define KC 2
#ifndef EA_X86_WIDEN_BY_MADD
#define EA_X86_WIDEN_BY_MADD 0 /* 1: EA_X86_DOT4 widens with vpmaddwd against widen16 (1 or 2) */
#endif
#ifndef EA_X86_QB_OFFSET
#define EA_X86_QB_OFFSET 0 /* 128: the quad layout stores b + 128 for vpdpbusd (VNNI) */
#endif

/* Per-column requantisation constants for 8 columns (see internal.h for the rules). */
typedef struct {
    __m256i bias, mult_even, mult_odd, left, right, half;
    int any_left; /* some channel has a left shift (scale > 1): rare, so usually skipped */
} x86_rq;

static inline x86_rq x86_rq_load(const int32_t *bias, const int32_t *mult, const int32_t *shift) {
    const __m256i zero = _mm256_setzero_si256(), one = _mm256_set1_epi32(1);
    const __m256i s = _mm256_loadu_si256((const __m256i *)shift);
    x86_rq q;
    q.bias = _mm256_loadu_si256((const __m256i *)bias);
    q.mult_even = _mm256_loadu_si256((const __m256i *)mult);
    q.mult_odd = _mm256_srli_epi64(q.mult_even, 32);
    q.left = _mm256_max_epi32(s, zero);
    q.right = _mm256_max_epi32(_mm256_sub_epi32(zero, s), zero);
    q.half = _mm256_srli_epi32(_mm256_sllv_epi32(one, q.right), 1); /* 2^(right - 1), 0 if right 0 */
    q.any_left = !_mm256_testz_si256(q.left, q.left);
    return q;
}

/* MultiplyByQuantizedMultiplier on 8 lanes, bit-exact: the left shift (any_left: some channel
 * has scale > 1, rare), then SaturatingRoundingDoublingHighMul = floor((x*m + 2^30) / 2^31)
 * from two 64-bit products (even and odd lanes). Its saturation case needs m == INT32_MIN,
 * which the driver rejects. RoundingDivideByPOT (round half away from zero) as
 * sign(h) * ((|h| + 2^(r-1)) >> r): four instructions instead of the reference's six.
 * |h| <= |x| * (2^31 - 1) / 2^31 + 1/2, so |h| <= 2^31 - 1 (vpabsd is exact) and
 * |h| + 2^(r-1) < 2^32: an unsigned shift (vpsrlvd) cannot overflow; h = 0 gives 0 (vpsignd)
 * as the reference does. The common tiles take x86_mbqm_x2 instead (below). */
static inline __m256i x86_mbqm(__m256i x, const x86_rq *q) {
    if (q->any_left) x = _mm256_sllv_epi32(x, q->left);
    const __m256i nudge = _mm256_set1_epi64x(INT64_C(1) << 30);
    __m256i even = _mm256_add_epi64(_mm256_mul_epi32(x, q->mult_even), nudge);
    __m256i odd = _mm256_add_epi64(_mm256_mul_epi32(_mm256_srli_epi64(x, 32), q->mult_odd), nudge);
    even = _mm256_srli_epi64(even, 31); /* bits 31..62 -> low half of each 64-bit lane */
    odd = _mm256_slli_epi64(odd, 1);    /* bits 31..62 -> high half */
    const __m256i h = _mm256_blend_epi32(even, odd, 0xAA);
    const __m256i r = _mm256_srlv_epi32(_mm256_add_epi32(_mm256_abs_epi32(h), q->half), q->right);
    return _mm256_sign_epi32(r, h);
}

/* Output zero point and clamp, applied after packing: saturating int32->int16, +zp with
 * int16 saturation, saturating int16->int8, then [act_min, act_max] in int8. Exact: a value
 * that saturates anywhere is beyond [-128, 127] + zp and ends at the clamp bound either way. */
typedef struct {
    __m256i zp16;
    __m128i lo8, hi8;
} x86_out;

static inline x86_out x86_out_make(int32_t zp, int32_t lo, int32_t hi) {
    x86_out o;
    o.zp16 = _mm256_set1_epi16((int16_t)zp);
    o.lo8 = _mm_set1_epi8((int8_t)lo);
    o.hi8 = _mm_set1_epi8((int8_t)hi);
    return o;
}

/* 8 MBQM results -> n int8 at dst. */
static inline void x86_store_s8(int8_t *dst, __m256i v, const x86_out *o, size_t n) {
    __m128i p = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    p = _mm_adds_epi16(p, _mm256_castsi256_si128(o->zp16));
    p = _mm_packs_epi16(p, p);
    p = _mm_min_epi8(_mm_max_epi8(p, o->lo8), o->hi8);
    if (n == 8) {
        _mm_storel_epi64((__m128i *)dst, p);
    } else {
        int8_t tmp[16];
        _mm_storeu_si128((__m128i *)tmp, p);
        memcpy(dst, tmp, n);
    }
}

/* 16 MBQM results (two vectors) -> n int8 at dst. */
static inline void x86_store_s8x2(int8_t *dst, __m256i v0, __m256i v1, const x86_out *o, size_t n) {
    __m256i p16 = _mm256_adds_epi16(_mm256_packs_epi32(v0, v1), o->zp16);
    p16 = _mm256_permute4x64_epi64(p16, 0xD8);
    __m128i p8 = _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1));
    p8 = _mm_min_epi8(_mm_max_epi8(p8, o->lo8), o->hi8);
    if (n == 16) {
        _mm_storeu_si128((__m128i *)dst, p8);
    } else {
        int8_t tmp[16];
        _mm_storeu_si128((__m128i *)tmp, p8);
        memcpy(dst, tmp, n);
    }
}

static inline void x86_store_s32(int32_t *dst, __m256i v, size_t n) {
    if (n == 8) {
        _mm256_storeu_si256((__m256i *)dst, v);
    } else {
        int32_t tmp[8];
        _mm256_storeu_si256((__m256i *)tmp, v);
        memcpy(dst, tmp, n * sizeof(int32_t));
    }
}

static inline __m256i x86_bcast_pair(const int16_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Epilogue of one row: acc (started at the bias, see X86_ZERO) + row_add -> int8 or int32 at
 * row i of c. */
static inline __attribute__((always_inline)) void x86_row_out(
    const int NV, __m256i acc0, __m256i acc1, size_t i, size_t nr, const ea_epilogue *ep,
    const x86_rq *q0, const x86_rq *q1, const x86_out *o, void *c, size_t ldc) {
    if (ep->row_add) {
        const __m256i radd = _mm256_set1_epi32(ep->row_add[i]);
        acc0 = _mm256_add_epi32(acc0, radd);
        if (NV > 1) acc1 = _mm256_add_epi32(acc1, radd);
    }
    const size_t n0 = nr < NR ? nr : NR, n1 = nr > NR ? nr - NR : 0;
    if (ep->out_int32) {
        int32_t *dst = (int32_t *)c + i * ldc;
        x86_store_s32(dst, acc0, n0);
        if (NV > 1 && n1) x86_store_s32(dst + NR, acc1, n1);
        return;
    }
    int8_t *dst = (int8_t *)c + i * ldc;
    const __m256i v0 = x86_mbqm(acc0, q0);
    if (NV > 1)
        x86_store_s8x2(dst, v0, x86_mbqm(acc1, q1), o, nr);
    else
        x86_store_s8(dst, v0, o, n0);
}

/* acc (which started at the bias) + row_add of row i, then MBQM. */
static inline __attribute__((always_inline)) __m256i x86_acc_rq(__m256i acc, size_t i,
                                                               const ea_epilogue *ep, const x86_rq *q) {
    if (ep->row_add) acc = _mm256_add_epi32(acc, _mm256_set1_epi32(ep->row_add[i]));
    return x86_mbqm(acc, q);
}

/* The epilogue of several whole int8 rows at once: rows of 16 columns two at a time, rows of 8
 * four at a time, so the int32 -> int8 packing runs on full registers (one vpackssdw per 16
 * outputs, one vpacksswb + vpermd + clamp per 32) instead of half-empty ones per row.
 * Dwords after vpackssdw(x, y) and vpacksswb are [x0-3 y0-3 z0-3 w0-3 | x4-7 y4-7 z4-7 w4-7]
 * (4 int8 each); vpermd (0 4 1 5 2 6 3 7) puts each row's 8 or 16 bytes in order. */
/* add_zp 0: the values already carry the output zero point (the fast epilogue's). */
static inline __attribute__((always_inline)) __m256i x86_pack4(__m256i v0, __m256i v1, __m256i v2,
                                                               __m256i v3, const x86_out *o, const int add_zp) {
    __m256i p01 = _mm256_packs_epi32(v0, v1), p23 = _mm256_packs_epi32(v2, v3);
    if (add_zp) p01 = _mm256_adds_epi16(p01, o->zp16), p23 = _mm256_adds_epi16(p23, o->zp16);
    __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23),
                                            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    p = _mm256_max_epi8(p, _mm256_broadcastsi128_si256(o->lo8));
    return _mm256_min_epi8(p, _mm256_broadcastsi128_si256(o->hi8));
}

/* x86_pack4's 32 bytes as two rows of 16 / four rows of 8 at dst, dst + ldc, ... */
static inline __attribute__((always_inline)) void x86_store_rows2(__m256i p, int8_t *dst, size_t ldc) {
    _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(p));
    _mm_storeu_si128((__m128i *)(dst + ldc), _mm256_extracti128_si256(p, 1));
}

static inline __attribute__((always_inline)) void x86_store_rows4(__m256i p, int8_t *dst, size_t ldc) {
    const __m128i lo = _mm256_castsi256_si128(p), hi = _mm256_extracti128_si256(p, 1);
    _mm_storel_epi64((__m128i *)dst, lo);
    _mm_storeh_pi((__m64 *)(dst + ldc), _mm_castsi128_ps(lo));
    _mm_storel_epi64((__m128i *)(dst + 2 * ldc), hi);
    _mm_storeh_pi((__m64 *)(dst + 3 * ldc), _mm_castsi128_ps(hi));
}

/* Rows i and i + 1 of a 16-column tile. */
static inline __attribute__((always_inline)) void x86_rows2_out(
    __m256i a0, __m256i a1, __m256i b0, __m256i b1, size_t i, size_t mr, size_t nr,
    const ea_epilogue *ep, const x86_rq *q0, const x86_rq *q1, const x86_out *o, void *c,
    size_t ldc, size_t s) {
    if (ep->out_int32 || nr != 2 * NR || i + 1 >= mr) {
        if (i < mr) x86_row_out(2, a0, a1, s + i, nr, ep, q0, q1, o, c, ldc);
        if (i + 1 < mr) x86_row_out(2, b0, b1, s + i + 1, nr, ep, q0, q1, o, c, ldc);
        return;
    }
    x86_store_rows2(x86_pack4(x86_acc_rq(a0, s + i, ep, q0), x86_acc_rq(a1, s + i, ep, q1),
                              x86_acc_rq(b0, s + i + 1, ep, q0), x86_acc_rq(b1, s + i + 1, ep, q1), o, 1),
                    (int8_t *)c + (s + i) * ldc, ldc);
}

/* The fast epilogue, for calls whose accumulators the driver bounded (ep->acc_bounded) and
 * whose channels have no left shift: MBQM, rounding divide and output zero point in 9
 * operations per 8 lanes instead of 11 + the zero point's share of the packing. It takes
 * x2 = 2x (the AVX2 tiles widen with vpmaddwd by 2 instead of 1, so the doubling is free;
 * VNNI tiles add x to itself). Then for each 64-bit lane
 *     (x2 * m + 2^31 + (half + zp * 2^r) * 2^32) >> 32 = h + half + zp * 2^r
 * exactly (h = floor((x*m + 2^30) / 2^31), TFLite's doubling high multiply), so the high
 * dwords of the even and odd products are the results, no shifts to line them up beyond one.
 * RoundingDivideByPOT(h) + zp = (h + half + zp * 2^r - [h < 0]) >> r (arithmetic), and
 * h < 0 exactly when that sum is below thr = half + zp * 2^r (INT32_MIN for r = 0: no
 * correction). The driver's bound keeps 2x and the sum inside int32. */
typedef struct {
    __m256i mult_even, mult_odd, nudge_even, nudge_odd, thr, right;
} x86_rqf;

static inline x86_rqf x86_rqf_make(const x86_rq *q, int32_t zp) {
    const __m256i lo32 = _mm256_set1_epi64x(0xFFFFFFFF), nudge = _mm256_set1_epi64x(INT64_C(1) << 31);
    /* half + zp * 2^r per lane (zp * 2^r as a left shift of zp; fits by the driver's bound) */
    const __m256i add = _mm256_add_epi32(q->half, _mm256_sllv_epi32(_mm256_set1_epi32(zp), q->right));
    x86_rqf f;
    f.mult_even = q->mult_even, f.mult_odd = q->mult_odd, f.right = q->right;
    f.nudge_even = _mm256_add_epi64(_mm256_slli_epi64(add, 32), nudge); /* even lane's add, high dword */
    f.nudge_odd = _mm256_add_epi64(_mm256_andnot_si256(lo32, add), nudge);
    f.thr = _mm256_blendv_epi8(_mm256_set1_epi32(INT32_MIN), add,
                               _mm256_cmpgt_epi32(q->right, _mm256_setzero_si256()));
    return f;
}

static inline __attribute__((always_inline)) __m256i x86_mbqm_x2(__m256i x2, const x86_rqf *q) {
    const __m256i even = _mm256_add_epi64(_mm256_mul_epi32(x2, q->mult_even), q->nudge_even);
    const __m256i odd = _mm256_add_epi64(_mm256_mul_epi32(_mm256_srli_epi64(x2, 32), q->mult_odd), q->nudge_odd);
    const __m256i hh = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
    return _mm256_srav_epi32(_mm256_add_epi32(hh, _mm256_cmpgt_epi32(q->thr, hh)), q->right);
}

/* Rows i, i + 1 of a full 16-column int8 tile through the fast epilogue. */
static inline __attribute__((always_inline)) void x86_rows2_fast(
    __m256i a0, __m256i a1, __m256i b0, __m256i b1, const x86_rqf *q0, const x86_rqf *q1,
    const x86_out *o, int8_t *dst, size_t ldc) {
    x86_store_rows2(x86_pack4(x86_mbqm_x2(a0, q0), x86_mbqm_x2(a1, q1), x86_mbqm_x2(b0, q0),
                              x86_mbqm_x2(b1, q1), o, 0), dst, ldc);
}

/* Rows i .. i + 3 of a full 8-column int8 tile through the fast epilogue. */
static inline __attribute__((always_inline)) void x86_rows4_fast(
    __m256i a, __m256i b, __m256i cc, __m256i d, const x86_rqf *q, const x86_out *o, int8_t *dst,
    size_t ldc) {
    x86_store_rows4(x86_pack4(x86_mbqm_x2(a, q), x86_mbqm_x2(b, q), x86_mbqm_x2(cc, q),
                              x86_mbqm_x2(d, q), o, 0), dst, ldc);
}

/* Rows i .. i + 3 of an 8-column tile. */
static inline __attribute__((always_inline)) void x86_rows4_out(
    __m256i a, __m256i b, __m256i cc, __m256i d, size_t i, size_t mr, size_t nr,
    const ea_epilogue *ep, const x86_rq *q, const x86_out *o, void *c, size_t ldc, size_t s) {
    if (ep->out_int32 || nr != NR || i + 3 >= mr) {
        if (i < mr) x86_row_out(1, a, a, s + i, nr, ep, q, q, o, c, ldc);
        if (i + 1 < mr) x86_row_out(1, b, b, s + i + 1, nr, ep, q, q, o, c, ldc);
        if (i + 2 < mr) x86_row_out(1, cc, cc, s + i + 2, nr, ep, q, q, o, c, ldc);
        if (i + 3 < mr) x86_row_out(1, d, d, s + i + 3, nr, ep, q, q, o, c, ldc);
        return;
    }
    x86_store_rows4(x86_pack4(x86_acc_rq(a, s + i, ep, q), x86_acc_rq(b, s + i + 1, ep, q),
                              x86_acc_rq(cc, s + i + 2, ep, q), x86_acc_rq(d, s + i + 3, ep, q), o, 1),
                    (int8_t *)c + (s + i) * ldc, ldc);
}

/* Tiles with explicitly named accumulators: gcc keeps these in registers, whereas arrays
 * of __m256i made it spill to the stack inside the K loop. ROWS(X) expands X(i) per row. */
/* Accumulators start at the columns' bias (int32 sums wrap the same either way), which saves
 * the epilogue an add per vector; bias0 / bias1 are the tile's (doubled in u8 x s8 tiles that
 * take the fast epilogue: X86_QTILE). */
#define X86_ZERO(i) __m256i c##i##a = bias0, c##i##b = bias1;
/* The fast epilogue takes 2x: free where vpmaddwd widens (EA_X86_WIDEN_BY_MADD: the tile
 * widened by 2), one add elsewhere; tiles that widened by 2 but leave through the general
 * epilogue (the last, shorter strip) halve again, exactly (the sums are even). */
#if EA_X86_WIDEN_BY_MADD
#define X86_X2(i)
#else
#define X86_X2(i) c##i##a = _mm256_add_epi32(c##i##a, c##i##a), c##i##b = _mm256_add_epi32(c##i##b, c##i##b);
#endif
#define X86_HALVE(i) c##i##a = _mm256_srai_epi32(c##i##a, 1), c##i##b = _mm256_srai_epi32(c##i##b, 1);
#define X86_MAC1(i)                                                     \
    {                                                                   \
        const __m256i av = x86_bcast_pair(a[i] + k);                    \
        c##i##a = EA_X86_DOT(c##i##a, av, bv0);                         \
    }
#define X86_MAC2(i)                                                     \
    {                                                                   \
        const __m256i av = x86_bcast_pair(a[i] + k);                    \
        c##i##a = EA_X86_DOT(c##i##a, av, bv0);                         \
        c##i##b = EA_X86_DOT(c##i##b, av, bv1);                         \
    }
#define X86_OUT(i, NV) \
    if (i < mr) x86_row_out(NV, c##i##a, c##i##b, s + i, nr, ep, &q0, &q1, &o, c, ldc);
#define X86_OUT1(i) X86_OUT(i, 1)
#define X86_OUT2(i) X86_OUT(i, 2)
/* Grouped epilogues: OUTP(i, j) rows i, i + 1 of 16 columns; OUTQ(i, j, k, l) four of 8. */
#define X86_OUTPF(i, j) x86_rows2_fast(c##i##a, c##i##b, c##j##a, c##j##b, &f0, &f1, &o, (int8_t *)c + (s + i) * ldc, ldc);
#define X86_OUTQF(i, j, k, l) \
    x86_rows4_fast(c##i##a, c##j##a, c##k##a, c##l##a, &f0, &o, (int8_t *)c + (s + i) * ldc, ldc);
#define X86_OUTP(i, j) x86_rows2_out(c##i##a, c##i##b, c##j##a, c##j##b, i, mr, nr, ep, &q0, &q1, &o, c, ldc, s);
#define X86_OUTQ(i, j, k, l)                                                                    \
    (void)c##i##b, (void)c##j##b, (void)c##k##b, (void)c##l##b, (void)q1; /* one vector a row */ \
    x86_rows4_out(c##i##a, c##j##a, c##k##a, c##l##a, i, mr, nr, ep, &q0, &o, c, ldc, s);
#define X86_PAIRS4(X) X(0, 1) X(2, 3)
#define X86_PAIRS6(X) X86_PAIRS4(X) X(4, 5)
#define X86_PAIRS8(X) X86_PAIRS6(X) X(6, 7)
#define X86_PAIRS12(X) X86_PAIRS8(X) X(8, 9) X(10, 11)
#define X86_QUADS4(X) X(0, 1, 2, 3)
#define X86_QUADS8(X) X86_QUADS4(X) X(4, 5, 6, 7)
#define X86_QUADS12(X) X86_QUADS8(X) X(8, 9, 10, 11)
#define X86_PAIRS_(n) X86_PAIRS##n
#define X86_PAIRS(n) X86_PAIRS_(n)
#define X86_QUADS_(n) X86_QUADS##n
#define X86_QUADS(n) X86_QUADS_(n)

#define X86_TILE(FN, MR_, ROWS, NV, MAC, OUT)                                                   \
    static void FN(size_t m, size_t nr, size_t kpad, const void *const *rows,                   \
                   const void *b_panel, const ea_epilogue *ep, void *c, size_t ldc) {           \
        static const int32_t zero8[16] = {0};                                                   \
        const int32_t *mult = ep->out_int32 ? zero8 : ep->mult;                                 \
        const int32_t *shift = ep->out_int32 ? zero8 : ep->shift;                               \
        const x86_rq q0 = x86_rq_load(ep->bias, mult, shift);                                   \
        const x86_rq q1 = NV > 1 ? x86_rq_load(ep->bias + NR, mult + NR, shift + NR) : q0;      \
        const x86_out o = x86_out_make(ep->out_zp, ep->act_min, ep->act_max);                  \
        const __m256i bias0 = q0.bias, bias1 = q1.bias;                                         \
        const int16_t *b0 = (const int16_t *)b_panel;                                          \
        const int16_t *b1 = b0 + kpad * NR; /* the next panel */                               \
        for (size_t s = 0; s < m; s += MR_) {                                                   \
            const int16_t *const *a = (const int16_t *const *)rows + s;                        \
            const size_t mr = m - s < MR_ ? m - s : MR_;                                        \
            ROWS(X86_ZERO)                                                                      \
            for (size_t k = 0; k < kpad; k += KC) {                                             \
                const __m256i bv0 = _mm256_loadu_si256((const __m256i *)(b0 + k * NR));        \
                const __m256i bv1 =                                                             \
                    NV > 1 ? _mm256_loadu_si256((const __m256i *)(b1 + k * NR)) : bv0;          \
                (void)bv1;                                                                      \
                ROWS(MAC)                                                                       \
            }                                                                                   \
            OUT                                                                                 \
        }                                                                                       \
    }

#define X86_ROWS4(X) X(0) X(1) X(2) X(3)
#define X86_ROWS6(X) X86_ROWS4(X) X(4) X(5)
#define X86_ROWS8(X) X86_ROWS6(X) X(6) X(7)
#define X86_ROWS12(X) X86_ROWS8(X) X(8) X(9) X(10) X(11)
#define X86_ROWS_(n) X86_ROWS##n
#define X86_ROWS(n) X86_ROWS_(n)

X86_TILE(x86_gemm8, EA_X86_MR8, X86_ROWS(EA_X86_MR8), 1, X86_MAC1, X86_QUADS(EA_X86_MR8)(X86_OUTQ))
X86_TILE(x86_gemm16, EA_X86_MR16, X86_ROWS(EA_X86_MR16), 2, X86_MAC2, X86_PAIRS(EA_X86_MR16)(X86_OUTP))

/* ---- u8 x s8 GEMM ("quad" layout): B panels [K/4][8 columns][4 k] int8, A rows read in
 * place as int8. Per k-quad the 4 bytes a[m][k..k+3] are broadcast; vpmaddubsw multiplies
 * unsigned by signed bytes, so the sign goes onto B: |a| (u8, at most 128) times
 * sign(a) * b (s8, vpsignb). Exact because the packer uses this layout only for B without
 * -128 (TFLite's symmetric weights are in [-127, 127]): then sign(a) * b is in [-127, 127]
 * and each int16 pair sum is at most 2 * 128 * 127 = 32512 < 2^15, so vpmaddubsw never
 * saturates; EA_X86_DOT4 (vpmaddwd against widen16 + vpaddd) sums the quad into the int32
 * lane (times 2 in tiles that leave through the fast epilogue: x86_mbqm_x2).
 * VNNI variants (EA_X86_QB_OFFSET 128) instead store b + 128 and need neither trick. */
static inline __m256i x86_bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* EA_X86_QDOT(acc, b, a): acc + the quad products of B panel bytes b and broadcast A bytes a.
 * VNNI: B is stored as b + 128 (u8) and A is the signed operand, so one vpdpbusd per 32
 * MACs and nothing else; |a * (b + 128)| <= 128 * 255 and vpdpbusd sums the four products
 * in int32 without saturating, so it is exact for any B. The driver takes 128 * rowsum_a
 * off (internal.h, qb_offset). AVX2: |a| times sign(a) * b, as above. */
#if EA_X86_QB_OFFSET
#define EA_X86_QDOT(acc, b, a) EA_X86_DOT4((acc), (b), (a))
#else
#define EA_X86_QDOT(acc, b, a) EA_X86_DOT4((acc), _mm256_abs_epi8(a), _mm256_sign_epi8((b), (a)))
#endif
#define X86_QMAC1(i)                                                    \
    {                                                                   \
        const __m256i av = x86_bcast4(a[i] + k);                        \
        c##i##a = EA_X86_QDOT(c##i##a, bv0, av);                        \
    }
#define X86_QMAC2(i)                                                    \
    {                                                                   \
        const __m256i av = x86_bcast4(a[i] + k);                        \
        c##i##a = EA_X86_QDOT(c##i##a, bv0, av);                        \
        c##i##b = EA_X86_QDOT(c##i##b, bv1, av);                        \
    }

#define X86_QTILE(FN, MR_, ROWS, NV, MAC, OUT, FAST)                                            \
    static void FN(size_t m, size_t nr, size_t kpad, const void *const *rows,                   \
                   const void *b_panel, const ea_epilogue *ep, void *c, size_t ldc) {           \
        static const int32_t zero8[16] = {0};                                                   \
        const int32_t *mult = ep->out_int32 ? zero8 : ep->mult;                                 \
        const int32_t *shift = ep->out_int32 ? zero8 : ep->shift;                               \
        const x86_rq q0 = x86_rq_load(ep->bias, mult, shift);                                   \
        const x86_rq q1 = NV > 1 ? x86_rq_load(ep->bias + NR, mult + NR, shift + NR) : q0;      \
        const x86_out o = x86_out_make(ep->out_zp, ep->act_min, ep->act_max);                  \
        /* the common epilogue (x86_rows2_fast / x86_rows4_fast), decided once per call */      \
        const int fast = !ep->out_int32 && !ep->row_add && nr == NV * NR && ep->acc_bounded &&  \
                         !q0.any_left && !q1.any_left;                                          \
        const int doubled = fast && EA_X86_WIDEN_BY_MADD;                                       \
        const __m256i widen16 = _mm256_set1_epi16(doubled ? 2 : 1);                             \
        (void)widen16;                                                                          \
        const __m256i bias0 = doubled ? _mm256_add_epi32(q0.bias, q0.bias) : q0.bias;          \
        const __m256i bias1 = doubled ? _mm256_add_epi32(q1.bias, q1.bias) : q1.bias;          \
        const x86_rqf f0 = x86_rqf_make(&q0, ep->out_zp), f1 = x86_rqf_make(&q1, ep->out_zp);   \
        (void)f0, (void)f1;                                                                     \
        const int8_t *b0 = (const int8_t *)b_panel;                                            \
        const int8_t *b1 = b0 + kpad * NR; /* the next panel */                                \
        for (size_t s = 0; s < m; s += MR_) {                                                   \
            const int8_t *const *a = (const int8_t *const *)rows + s;                          \
            const size_t mr = m - s < MR_ ? m - s : MR_;                                        \
            ROWS(X86_ZERO)                                                                      \
            for (size_t k = 0; k < kpad; k += 4) {                                              \
                const __m256i bv0 = _mm256_loadu_si256((const __m256i *)(b0 + k * NR));        \
                const __m256i bv1 =                                                             \
                    NV > 1 ? _mm256_loadu_si256((const __m256i *)(b1 + k * NR)) : bv0;          \
                (void)bv1;                                                                      \
                ROWS(MAC)                                                                       \
            }                                                                                   \
            if (fast && mr == MR_) {                                                            \
                ROWS(X86_X2)                                                                    \
                FAST                                                                            \
            } else {                                                                            \
                if (doubled) { ROWS(X86_HALVE) }                                                \
                OUT                                                                             \
            }                                                                                   \
        }                                                                                       \
    }

#ifndef EA_X86_OWN_VARIANT /* the AVX512-VNNI variant has 512-bit u8 x s8 tiles instead */
X86_QTILE(x86_qgemm8, EA_X86_QMR8, X86_ROWS(EA_X86_QMR8), 1, X86_QMAC1, X86_QUADS(EA_X86_QMR8)(X86_OUTQ),
          X86_QUADS(EA_X86_QMR8)(X86_OUTQF))
X86_QTILE(x86_qgemm16, EA_X86_QMR16, X86_ROWS(EA_X86_QMR16), 2, X86_QMAC2, X86_PAIRS(EA_X86_QMR16)(X86_OUTP),
          X86_PAIRS(EA_X86_QMR16)(X86_OUTPF))
#ifdef EA_X86_QDEEP_K
X86_QTILE(x86_qgemm16_deep, EA_X86_QMR16_DEEP, X86_ROWS(EA_X86_QMR16_DEEP), 2, X86_QMAC2,
          X86_PAIRS(EA_X86_QMR16_DEEP)(X86_OUTP), X86_PAIRS(EA_X86_QMR16_DEEP)(X86_OUTPF))
#define X86_QDEEP EA_X86_QDEEP_K, EA_X86_QMR16_DEEP, x86_qgemm16_deep
#else
#define X86_QDEEP 0, 0, NULL
#endif
#endif

/* Sum of n int8: flipped to u8 (x + 128) and summed by vpsadbw against zero. */
static inline int32_t x86_rowsum(const int8_t *a, size_t n) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), zero = _mm256_setzero_si256();
    __m256i acc = zero;
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        acc = _mm256_add_epi64(
            acc, _mm256_sad_epu8(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(a + i)), flip), zero));
    __m128i s = _mm_add_epi64(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    if (i + 16 <= n) {
        s = _mm_add_epi64(s, _mm_sad_epu8(_mm_xor_si128(_mm_loadu_si128((const __m128i *)(a + i)),
                                                        _mm256_castsi256_si128(flip)),
                                          _mm256_castsi256_si128(zero)));
        i += 16;
    }
    if (i + 8 <= n) { /* the upper 8 bytes load as 0, flip to 128: keep the low sum only */
        s = _mm_add_epi64(s, _mm_move_epi64(_mm_sad_epu8(
                                 _mm_xor_si128(_mm_loadl_epi64((const __m128i *)(a + i)),
                                               _mm256_castsi256_si128(flip)),
                                 _mm256_castsi256_si128(zero))));
        i += 8;
    }
    int64_t total = _mm_cvtsi128_si64(s) + _mm_extract_epi64(s, 1) - 128 * (int64_t)i;
    for (; i < n; i++) total += a[i];
    return (int32_t)total;
}

static void x86_rowsums(const void *const *rows, size_t count, size_t k, int32_t zb, int32_t *out) {
    for (size_t r = 0; r < count; r++)
        out[r] = (int32_t)(uint32_t)(uint64_t)(-(int64_t)zb * x86_rowsum((const int8_t *)rows[r], k));
}

static void x86_widen(const int8_t *src, int16_t *dst, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(src + i))));
    if (i + 8 <= n) {
        _mm_storeu_si128((__m128i *)(dst + i), _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(src + i))));
        i += 8;
    }
    for (; i < n; i++) dst[i] = src[i];
}

/* Depthwise: per tap, (x - zp) * w fits int16 exactly (|x - zp| <= 255, |w| <= 128), so
 * one vpmullw per 16 channels, widened into two int32 accumulators. Channel blocks are the
 * outer loop so their requantisation constants are prepared once for all npix pixels. */
/* 16 channels of depthwise with vpmaddwd on tap pairs: x_t and x_t+1 (int8 sign-extended, the
 * zero point NOT subtracted) interleaved per channel against (w_t, w_t+1), so one vpmaddwd gives
 * two taps of 8 channels in int32 (|x * w| <= 2^14, exact). The zero point is folded into the
 * bias once per block: bias - in_zp * sum_t w_t (the same int32 sum modulo 2^32). vpunpck{l,h}wd
 * work per 128-bit lane, so the two accumulators hold channels (0-3, 8-11) and (4-7, 12-15):
 * the constants are loaded in that order, and vpackssdw of the two results is then already
 * in channel order. An odd last tap pairs with zero weights. */
#define X86_DW_MAXTAPS 64

/* 16 per-channel values -> channels (0-3, 8-11) and (4-7, 12-15). */
static inline void x86_dw_lanes(int32_t dst[2][8], const int32_t *src) {
    const __m256i lo = _mm256_loadu_si256((const __m256i *)src);
    const __m256i hi = _mm256_loadu_si256((const __m256i *)(src + 8));
    _mm256_storeu_si256((__m256i *)dst[0], _mm256_permute2x128_si256(lo, hi, 0x20));
    _mm256_storeu_si256((__m256i *)dst[1], _mm256_permute2x128_si256(lo, hi, 0x31));
}

static void x86_dw16_pairs(size_t ch, size_t nrows, size_t npix, size_t ntaps,
                           const int8_t *const *x, size_t x_step, size_t x_row_step,
                           const int16_t *const *w, int32_t in_zp, const ea_epilogue *ep,
                           const x86_out *o, int8_t *out, size_t out_step, size_t out_row_step) {
    __m256i wp[X86_DW_MAXTAPS + 2];
    const __m256i zero = _mm256_setzero_si256();
    const size_t npairs = (ntaps + 1) / 2;
    for (size_t pr = 0; pr < npairs; pr++) {
        const size_t t = 2 * pr;
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w[t] + ch));
        const __m256i w1 = t + 1 < ntaps ? _mm256_loadu_si256((const __m256i *)(w[t + 1] + ch)) : zero;
        wp[2 * pr] = _mm256_unpacklo_epi16(w0, w1);
        wp[2 * pr + 1] = _mm256_unpackhi_epi16(w0, w1);
    }
    /* sum_t w_t per channel in the accumulators' order: vpmaddwd of the pairs with ones */
    const __m256i ones = _mm256_set1_epi16(1), zp = _mm256_set1_epi32(in_zp);
    __m256i sw0 = zero, sw1 = zero;
    for (size_t pr = 0; pr < npairs; pr++) {
        sw0 = _mm256_add_epi32(sw0, _mm256_madd_epi16(wp[2 * pr], ones));
        sw1 = _mm256_add_epi32(sw1, _mm256_madd_epi16(wp[2 * pr + 1], ones));
    }
    int32_t b[2][8], mu[2][8], sh[2][8];
    x86_dw_lanes(b, ep->bias + ch);
    x86_dw_lanes(mu, ep->mult + ch);
    x86_dw_lanes(sh, ep->shift + ch);
    _mm256_storeu_si256((__m256i *)b[0], _mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)b[0]),
                                                          _mm256_mullo_epi32(zp, sw0)));
    _mm256_storeu_si256((__m256i *)b[1], _mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)b[1]),
                                                          _mm256_mullo_epi32(zp, sw1)));
    const x86_rq q0 = x86_rq_load(b[0], mu[0], sh[0]), q1 = x86_rq_load(b[1], mu[1], sh[1]);
    for (size_t r = 0; r < nrows; r++)
        for (size_t p = 0; p < npix; p++) {
            const size_t off = (r * x_row_step + p * x_step) + ch;
            __m256i acc0 = q0.bias, acc1 = q1.bias;
            size_t t = 0;
            for (; t + 1 < ntaps; t += 2) {
                const __m256i x0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x[t] + off)));
                const __m256i x1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x[t + 1] + off)));
                acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(_mm256_unpacklo_epi16(x0, x1), wp[t]));
                acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(_mm256_unpackhi_epi16(x0, x1), wp[t + 1]));
            }
            if (t < ntaps) { /* wp[t + 1] pairs tap t with zeros */
                const __m256i x0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x[t] + off)));
                acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(_mm256_unpacklo_epi16(x0, zero), wp[t]));
                acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(_mm256_unpackhi_epi16(x0, zero), wp[t + 1]));
            }
            const __m256i p16 = _mm256_adds_epi16(
                _mm256_packs_epi32(x86_mbqm(acc0, &q0), x86_mbqm(acc1, &q1)), o->zp16);
            __m128i p8 = _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1));
            p8 = _mm_min_epi8(_mm_max_epi8(p8, o->lo8), o->hi8);
            _mm_storeu_si128((__m128i *)(out + (r * out_row_step + p * out_step) + ch), p8);
        }
}

static void x86_dw(size_t c, size_t nrows, size_t npix, size_t ntaps, const int8_t *const *x,
                   size_t x_step, size_t x_row_step, const int16_t *const *w, int32_t in_zp,
                   const ea_epilogue *ep, int8_t *out, size_t out_step, size_t out_row_step,
                   void *cache) {
    (void)cache;
    const __m256i zp16 = _mm256_set1_epi16((int16_t)in_zp);
    const x86_out o = x86_out_make(ep->out_zp, ep->act_min, ep->act_max);
    size_t ch = 0;
    if (ntaps <= X86_DW_MAXTAPS)
        for (; ch + 16 <= c; ch += 16)
            x86_dw16_pairs(ch, nrows, npix, ntaps, x, x_step, x_row_step, w, in_zp, ep, &o, out,
                           out_step, out_row_step);
    for (; ch + 16 <= c; ch += 16) {
        const x86_rq q0 = x86_rq_load(ep->bias + ch, ep->mult + ch, ep->shift + ch);
        const x86_rq q1 = x86_rq_load(ep->bias + ch + 8, ep->mult + ch + 8, ep->shift + ch + 8);
        for (size_t r = 0; r < nrows; r++) for (size_t p = 0; p < npix; p++) {
            const size_t off = (r * x_row_step + p * x_step) + ch;
            __m256i acc0 = q0.bias, acc1 = q1.bias;
            for (size_t t = 0; t < ntaps; t++) {
                const __m256i xv = _mm256_sub_epi16(
                    _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x[t] + off))), zp16);
                const __m256i pr =
                    _mm256_mullo_epi16(xv, _mm256_loadu_si256((const __m256i *)(w[t] + ch)));
                acc0 = _mm256_add_epi32(acc0, _mm256_cvtepi16_epi32(_mm256_castsi256_si128(pr)));
                acc1 = _mm256_add_epi32(acc1, _mm256_cvtepi16_epi32(_mm256_extracti128_si256(pr, 1)));
            }
            x86_store_s8x2(out + (r * out_row_step + p * out_step) + ch, x86_mbqm(acc0, &q0), x86_mbqm(acc1, &q1), &o, 16);
        }
    }
    for (; ch + 8 <= c; ch += 8) {
        const x86_rq q = x86_rq_load(ep->bias + ch, ep->mult + ch, ep->shift + ch);
        for (size_t r = 0; r < nrows; r++) for (size_t p = 0; p < npix; p++) {
            const size_t off = (r * x_row_step + p * x_step) + ch;
            __m256i acc = q.bias;
            for (size_t t = 0; t < ntaps; t++) {
                const __m128i xv = _mm_sub_epi16(
                    _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(x[t] + off))),
                    _mm256_castsi256_si128(zp16));
                const __m128i pr = _mm_mullo_epi16(xv, _mm_loadu_si128((const __m128i *)(w[t] + ch)));
                acc = _mm256_add_epi32(acc, _mm256_cvtepi16_epi32(pr));
            }
            x86_store_s8(out + (r * out_row_step + p * out_step) + ch, x86_mbqm(acc, &q), &o, 8);
        }
    }
    for (; ch < c; ch++) {
        for (size_t r = 0; r < nrows; r++) for (size_t p = 0; p < npix; p++) {
            int32_t acc = ep->bias[ch];
            for (size_t t = 0; t < ntaps; t++)
                acc += ((int32_t)x[t][(r * x_row_step + p * x_step) + ch] - in_zp) * w[t][ch];
            out[(r * out_row_step + p * out_step) + ch] = ea_requant1(acc, ep->mult[ch], ep->shift[ch], ep->out_zp,
                                                 ep->act_min, ep->act_max);
        }
    }
}

static inline x86_rq x86_rq_set1(int32_t mult, int32_t shift) {
    const int32_t m[8] = {mult, mult, mult, mult, mult, mult, mult, mult};
    const int32_t s[8] = {shift, shift, shift, shift, shift, shift, shift, shift};
    static const int32_t zero8[8] = {0};
    return x86_rq_load(zero8, m, s);
}

static void x86_add(size_t n, const int8_t *x1, const int8_t *x2, const ea_add_params *p,
                    int8_t *out) {
    const x86_rq q1 = x86_rq_set1(p->mult1, p->shift1), q2 = x86_rq_set1(p->mult2, p->shift2);
    const x86_rq qo = x86_rq_set1(p->out_mult, p->out_shift);
    const __m256i z1 = _mm256_set1_epi32(p->zp1), z2 = _mm256_set1_epi32(p->zp2);
    const x86_out o = x86_out_make(p->out_zp, p->act_min, p->act_max);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i a = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(x1 + i)));
        const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(x2 + i)));
        const __m256i v1 = x86_mbqm(_mm256_slli_epi32(_mm256_sub_epi32(a, z1), 20), &q1);
        const __m256i v2 = x86_mbqm(_mm256_slli_epi32(_mm256_sub_epi32(b, z2), 20), &q2);
        x86_store_s8(out + i, x86_mbqm(_mm256_add_epi32(v1, v2), &qo), &o, 8);
    }
    for (; i < n; i++) out[i] = ea_add1(x1[i], x2[i], p);
}

static void x86_requant_n(size_t n, const int32_t *acc, const ea_epilogue *ep, int8_t *out) {
    static const int32_t zero8[8] = {0};
    const x86_out o = x86_out_make(ep->out_zp, ep->act_min, ep->act_max);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(acc + i));
        const x86_rq q = x86_rq_load(zero8, ep->mult + i, ep->shift + i);
        x86_store_s8(out + i, x86_mbqm(v, &q), &o, 8);
    }
    for (; i < n; i++)
        out[i] = ea_requant1(acc[i], ep->mult[i], ep->shift[i], ep->out_zp, ep->act_min,
                             ep->act_max);
}

/* A variant with kernels of its own (AVX512-VNNI: 512-bit depthwise and GEMM) defines
 * EA_X86_OWN_VARIANT and its ea_variant after including this file and those kernels. */
#ifndef EA_X86_OWN_VARIANT
const ea_variant EA_X86_VARIANT = {
    EA_X86_NAME, EA_X86_FEATURES, EA_X86_MR8, NR, KC, 2, 2, x86_gemm8, EA_X86_MR16, x86_gemm16,
    x86_widen, x86_dw, x86_requant_n, x86_add, EA_X86_QB_OFFSET ? 0 : EA_Q_NO_MIN | EA_Q_PAD_READS, 4, EA_X86_QMR8,
    x86_qgemm8, EA_X86_QMR16, x86_qgemm16, EA_X86_QMAXK, EA_X86_QB_OFFSET, 2, x86_rowsums, 0, X86_QDEEP,
};
#endif

#endif
