/* AVX512-VNNI u8 x s8 GEMM tiles on 512-bit registers, over the quad layout of x86_common.h
 * (B panels [K/4][8 columns][4 k] stored as b + 128, so vpdpbusd takes B as its unsigned
 * operand and the broadcast A quad as the signed one; the driver subtracts 128 * rowsum_a).
 *
 * A zmm holds 16 int32 lanes, twice a panel's 8 columns, so:
 * - one panel (N <= 8, common in MobileNet's projections): a zmm holds two ROWS of the
 *   panel; B is the panel's 32 bytes in both halves, A row i's quad in the low half and row
 *   i+1's in the high one. The epilogue then requantises 16 outputs per instruction too.
 * - wide tiles: two adjacent panels side by side per zmm, up to four panels (32 columns) per
 *   call (qpanels2 4; the packer pads B to whole tiles).
 * The epilogue is the 256-bit x86_mbqm on 16 lanes; the clamp is done in int32 around the
 * zero point (clamp(v, lo - zp, hi - zp) + zp == clamp(v + zp, lo, hi), without overflow).
 */
#ifndef EA_X86_GEMM512_H
#define EA_X86_GEMM512_H

#include "x86_common.h"

typedef struct {
    __m512i bias, mult_even, mult_odd, left, right, mask, half, lo, hi, zp;
    int any_left;
} z_rq;

static inline z_rq z_rq_make(__m512i bias, __m512i mult, __m512i shift, const ea_epilogue *ep) {
    const __m512i zero = _mm512_setzero_si512(), one = _mm512_set1_epi32(1);
    z_rq q;
    q.bias = bias;
    q.mult_even = mult;
    q.mult_odd = _mm512_srli_epi64(mult, 32);
    q.left = _mm512_max_epi32(shift, zero);
    q.right = _mm512_max_epi32(_mm512_sub_epi32(zero, shift), zero);
    q.mask = _mm512_sub_epi32(_mm512_sllv_epi32(one, q.right), one);
    q.half = _mm512_srai_epi32(q.mask, 1);
    q.zp = _mm512_set1_epi32(ep->out_zp);
    q.lo = _mm512_set1_epi32(ep->act_min - ep->out_zp);
    q.hi = _mm512_set1_epi32(ep->act_max - ep->out_zp);
    q.any_left = _mm512_test_epi32_mask(q.left, q.left) != 0;
    return q;
}

/* Per-column constants for 16 columns: `pair` repeats 8 columns in both halves. */
static inline __m512i z_cols(const int32_t *p, int pair) {
    if (pair) return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_loadu_si512((const void *)p);
}

static inline z_rq z_rq_load(const ea_epilogue *ep, size_t col, int pair) {
    static const int32_t zero16[16] = {0};
    const int32_t *mult = ep->out_int32 ? zero16 : ep->mult + col;
    const int32_t *shift = ep->out_int32 ? zero16 : ep->shift + col;
    return z_rq_make(z_cols(ep->bias + col, pair), z_cols(mult, pair), z_cols(shift, pair), ep);
}

/* MultiplyByQuantizedMultiplier on 16 lanes, bit-exact (see x86_mbqm). */
static inline __m512i z_mbqm(__m512i x, const z_rq *q) {
    const __m512i nudge = _mm512_set1_epi64(INT64_C(1) << 30);
    if (q->any_left) x = _mm512_sllv_epi32(x, q->left);
    __m512i even = _mm512_add_epi64(_mm512_mul_epi32(x, q->mult_even), nudge);
    __m512i odd = _mm512_add_epi64(_mm512_mul_epi32(_mm512_srli_epi64(x, 32), q->mult_odd), nudge);
    even = _mm512_srli_epi64(even, 31);
    odd = _mm512_slli_epi64(odd, 1);
    const __m512i h = _mm512_mask_blend_epi32(0xAAAA, even, odd);
    const __m512i rem = _mm512_and_si512(h, q->mask);
    const __m512i thr = _mm512_sub_epi32(q->half, _mm512_srai_epi32(h, 31));
    const __m512i r = _mm512_srav_epi32(h, q->right);
    return _mm512_mask_add_epi32(r, _mm512_cmpgt_epi32_mask(rem, thr), r, _mm512_set1_epi32(1));
}

/* acc (+ bias already added) -> the 16 values to store: int32 as is, or requantised. */
static inline __m512i z_final(__m512i acc, const z_rq *q, const ea_epilogue *ep) {
    if (ep->out_int32) return acc;
    const __m512i v = z_mbqm(acc, q);
    return _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(v, q->lo), q->hi), q->zp);
}

/* Lanes under `keep` to dst, lane l at dst[l - lane0] (int8 or int32 elements); masked-off
 * lanes are not accessed. */
static inline void z_store(void *dst, size_t lane0, __mmask16 keep, __m512i v, const ea_epilogue *ep) {
    if (ep->out_int32)
        _mm512_mask_storeu_epi32((int32_t *)dst - lane0, keep, v);
    else
        _mm_mask_storeu_epi8((int8_t *)dst - lane0, keep, _mm512_cvtepi32_epi8(v));
}

static inline __m512i z_bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* Row i's quad in the low 8 lanes, row i+1's in the high 8. */
static inline __m512i z_bcast4_pair(const int8_t *p0, const int8_t *p1) {
    int32_t v0, v1;
    memcpy(&v0, p0, 4);
    memcpy(&v1, p1, 4);
    return _mm512_mask_set1_epi32(_mm512_set1_epi32(v0), 0xFF00, v1);
}

#define Z_ROWS4(X) X(0) X(1) X(2) X(3)
#define Z_ROWS8(X) Z_ROWS4(X) X(4) X(5) X(6) X(7)
#define Z_ROWS12(X) Z_ROWS8(X) X(8) X(9) X(10) X(11)
#define Z_ROWS16(X) Z_ROWS12(X) X(12) X(13) X(14) X(15)

/* Short rows (K <= qrowsum_max_k, ep->rowsum_zb set): the kernel sums each row itself with
 * one more vpdpbusd per quad against bytes of 1 (cheaper than a pass over A when a row's
 * quads are few), and subtracts rowsum_zb * rowsum; otherwise the driver's row_add. */
static inline __m512i z_row_corr(__m512i rs, const ea_epilogue *ep) {
    if (ep->rowsum_zb == 128) /* weights without a zero point: a shift, not a vpmulld */
        return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(rs, 7));
    return _mm512_mullo_epi32(rs, _mm512_set1_epi32(-ep->rowsum_zb));
}

/* ---- one panel, two rows per zmm: strips of 2 * Z_PAIRS rows */
#define Z_PAIRS 8
#define ZP_ZERO(i) __m512i c##i = _mm512_setzero_si512(), rs##i = c##i;
#define ZP_MAC(i)                                                                             \
    {                                                                                         \
        const __m512i av = z_bcast4_pair(a[2 * i] + k, a[2 * i + 1] + k);                     \
        c##i = _mm512_dpbusd_epi32(c##i, bv, av);                                             \
        if (RS) rs##i = _mm512_dpbusd_epi32(rs##i, ones, av);                                   \
    }
#define ZP_OUT(i)                                                                             \
    if (2 * i < mr) {                                                                         \
        const size_t r0 = s + 2 * i, two = 2 * i + 1 < mr;                                   \
        __m512i acc = _mm512_add_epi32(c##i, q.bias);                                         \
        if (RS)                                                                               \
            acc = _mm512_add_epi32(acc, z_row_corr(rs##i, ep));                                \
        else if (ep->row_add)                                                                 \
            acc = _mm512_add_epi32(acc, _mm512_mask_set1_epi32(_mm512_set1_epi32(ep->row_add[r0]), \
                                                               0xFF00, ep->row_add[r0 + two])); \
        const __m512i v = z_final(acc, &q, ep);                                               \
        char *d0 = (char *)c + r0 * ldc * elem;                                               \
        if (two && ldc == 8) {                                                                \
            z_store(d0, 0, both, v, ep); /* rows r0, r0 + 1 are adjacent */                  \
        } else {                                                                              \
            z_store(d0, 0, lo8, v, ep);                                                       \
            if (two) z_store(d0 + ldc * elem, 8, hi8, v, ep); /* lanes 8.. on row r0 + 1 */   \
        }                                                                                     \
    }

#define ZP_KERNEL(FN, RS_)                                                                    \
    static void FN(size_t m, size_t nr, size_t kpad, const void *const *rows,                 \
                   const void *b_panel, const ea_epilogue *ep, void *c, size_t ldc) {         \
        enum { RS = RS_ };                                                                    \
        const z_rq q = z_rq_load(ep, 0, 1);                                                   \
        const size_t elem = ep->out_int32 ? 4 : 1;                                            \
        const __mmask16 lo8 = (__mmask16)((1u << nr) - 1), hi8 = (__mmask16)(lo8 << 8);     \
        const __mmask16 both = (__mmask16)(lo8 | hi8);                                        \
        const __m512i ones = _mm512_set1_epi8(1);                                             \
        (void)ones;                                                                           \
        const int8_t *b0 = (const int8_t *)b_panel;                                           \
        for (size_t s = 0; s < m; s += 2 * Z_PAIRS) {                                         \
            const int8_t *const *a = (const int8_t *const *)rows + s;                        \
            const size_t mr = m - s < 2 * Z_PAIRS ? m - s : 2 * Z_PAIRS;                      \
            Z_ROWS8(ZP_ZERO)                                                                  \
            for (size_t k = 0; k < kpad; k += 4) {                                            \
                const __m512i bv =                                                            \
                    _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b0 + k * NR))); \
                Z_ROWS8(ZP_MAC)                                                               \
            }                                                                                 \
            Z_ROWS8(ZP_OUT)                                                                   \
        }                                                                                     \
    }

ZP_KERNEL(z_qgemm_pair_rd, 0)
ZP_KERNEL(z_qgemm_pair_rs, 1)

static void z_qgemm_pair(size_t m, size_t nr, size_t kpad, const void *const *rows,
                         const void *b_panel, const ea_epilogue *ep, void *c, size_t ldc) {
    (ep->rowsum_zb ? z_qgemm_pair_rs : z_qgemm_pair_rd)(m, nr, kpad, rows, b_panel, ep, c, ldc);
}

/* ---- two to four panels: up to 32 columns, one or two zmm per row */
static inline __m512i z_panels(const int8_t *p0, const int8_t *p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p0)),
                              _mm256_loadu_si256((const __m256i *)p1), 1);
}

#define ZW_ZERO(i) __m512i c##i##a = _mm512_setzero_si512(), c##i##b = c##i##a, rs##i = c##i##a;
#define ZW_MAC(i)                                                                             \
    {                                                                                         \
        const __m512i av = z_bcast4(a[i] + k);                                                \
        c##i##a = _mm512_dpbusd_epi32(c##i##a, bv0, av);                                      \
        if (NV > 1) c##i##b = _mm512_dpbusd_epi32(c##i##b, bv1, av);                         \
        if (RS) rs##i = _mm512_dpbusd_epi32(rs##i, ones, av);                                   \
    }
#define ZW_OUT(i)                                                                             \
    if (i < mr) {                                                                             \
        const size_t r = s + i;                                                               \
        const __m512i radd = RS ? z_row_corr(rs##i, ep)                                        \
                             : ep->row_add ? _mm512_set1_epi32(ep->row_add[r]) : _mm512_setzero_si512(); \
        char *d = (char *)c + r * ldc * elem;                                                 \
        z_store(d, 0, keep0, z_final(_mm512_add_epi32(_mm512_add_epi32(c##i##a, q0.bias), radd), &q0, ep), ep); \
        if (NV > 1)                                                                           \
            z_store(d + 16 * elem, 0, keep1,                                                  \
                    z_final(_mm512_add_epi32(_mm512_add_epi32(c##i##b, q1.bias), radd), &q1, ep), ep); \
    }

#define ZW_TILE(FN, MR_, ROWS, NV_, RS_)                                                      \
    static void FN(size_t m, size_t nr, size_t kpad, const void *const *rows,                 \
                   const void *b_panel, const ea_epilogue *ep, void *c, size_t ldc) {         \
        enum { NV = NV_, RS = RS_ };                                                          \
        const size_t elem = ep->out_int32 ? 4 : 1;                                            \
        const z_rq q0 = z_rq_load(ep, 0, 0);                                                  \
        const z_rq q1 = NV > 1 ? z_rq_load(ep, 16, 0) : q0;                                   \
        const __mmask16 keep0 = nr >= 16 ? 0xFFFF : (__mmask16)((1u << nr) - 1);             \
        const __mmask16 keep1 = nr >= 32 ? 0xFFFF : nr > 16 ? (__mmask16)((1u << (nr - 16)) - 1) : 0; \
        const __m512i ones = _mm512_set1_epi8(1);                                             \
        (void)keep1, (void)ones;                                                              \
        const int8_t *b = (const int8_t *)b_panel;                                            \
        const size_t ps = kpad * NR; /* bytes per panel */                                   \
        for (size_t s = 0; s < m; s += MR_) {                                                 \
            const int8_t *const *a = (const int8_t *const *)rows + s;                        \
            const size_t mr = m - s < MR_ ? m - s : MR_;                                      \
            ROWS(ZW_ZERO)                                                                     \
            for (size_t k = 0; k < kpad; k += 4) {                                            \
                const int8_t *bk = b + k * NR;                                                \
                const __m512i bv0 = z_panels(bk, bk + ps);                                    \
                const __m512i bv1 = NV > 1 ? z_panels(bk + 2 * ps, bk + 3 * ps) : bv0;        \
                (void)bv1;                                                                    \
                ROWS(ZW_MAC)                                                                  \
            }                                                                                 \
            ROWS(ZW_OUT)                                                                      \
        }                                                                                     \
    }

/* Registers: 16 rows x 1 accumulator, 12 x 2; with row sums 12 x 2 and 8 x 3 (of 32). */
ZW_TILE(z_qgemm16_rd, 16, Z_ROWS16, 1, 0)
ZW_TILE(z_qgemm32_rd, 12, Z_ROWS12, 2, 0)
ZW_TILE(z_qgemm16_rs, 12, Z_ROWS12, 1, 1)
ZW_TILE(z_qgemm32_rs, 8, Z_ROWS8, 2, 1)

/* The wide entry (qgemm2, qpanels2 4): 9..16 columns on two panels, else four. */
static void z_qgemm_wide(size_t m, size_t nr, size_t kpad, const void *const *rows,
                         const void *b_panel, const ea_epilogue *ep, void *c, size_t ldc) {
    const ea_gemm_ukernel fn = nr <= 16 ? (ep->rowsum_zb ? z_qgemm16_rs : z_qgemm16_rd)
                                        : (ep->rowsum_zb ? z_qgemm32_rs : z_qgemm32_rd);
    fn(m, nr, kpad, rows, b_panel, ep, c, ldc);
}

#endif
