/* Internal contract between the driver (dispatch.c) and the per-ISA variant files.
 *
 * GEMM micro-kernels get MR row pointers into A (each readable for kpad elements) and one
 * packed B panel. Only B (the weights) is packed, once, as
 * [panel of NR columns][K chunk of KC][NR][KC] in int8 or int16. A rows are either read in
 * place (a_elem 1: raw int8) or widened to int16 once per row block by the variant's
 * `widen` (a_elem 2), which costs O(M*K) against the GEMM's O(M*N*K).
 * Two layouts exist: "dot" (ARM, portable: each output owns a vector accumulator along K,
 * reduced at the end) and "outer product" (x86: an A pair (k, k+1) is broadcast against
 * 8 columns, so accumulators are already column vectors -- no reductions, which matters
 * for MobileNet's many K = 8..48 layers).
 *
 * Kernels multiply *raw* int8 values. The zero points are folded in by the driver:
 *   sum (a - za)(b - zb) = sum ab - za*colsum_b - zb*rowsum_a + K*za*zb
 * so padding rows/columns with zeros (K tail) or with a_zp (conv borders) stays exact.
 */
#ifndef EA_INTERNAL_H
#define EA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "ea_kernels.h"

#define EA_MAX_MR 16
#define EA_Q_NO_MIN 1u
#define EA_Q_I8MM 2u
/* The quad kernels' products with B's zero K padding are 0 whatever A holds there (x86 u8 x s8
 * with B stored as is: |a| * (sign(a) * 0)), so the driver may let them read A rows in place
 * up to kpad where those bytes are readable. Not with qb_offset (padding stored as 128). */
#define EA_Q_PAD_READS 4u
/* Most rows of one block (the driver's rows[] and row_add live on its stack). */
#define EA_MAX_MC 240

/* Epilogue of one tile, pointers already offset to the tile's first column / row. */
typedef struct ea_epilogue {
    const int32_t *bias;    /* per column: bias - za*colsum + K*za*zb (padded to NR) */
    const int32_t *mult;    /* per column (padded to NR) */
    const int32_t *shift;   /* per column (padded to NR) */
    const int32_t *row_add; /* per row of the tile (-zb*rowsum_a), or NULL */
    int32_t out_zp, act_min, act_max;
    int32_t out_int32;      /* store acc + bias (+ row_add) as int32, no requantisation */
    int32_t rowsum_zb;      /* nonzero (row_add NULL): the kernel adds -rowsum_zb * rowsum_a
                               itself (variants with qrowsum_max_k, for short rows) */
    int32_t acc_bounded;    /* the driver's bound on every column's true accumulator x
                               (|bias| + K * 255^2): 2|x| and |x| + 2^(r - 1) + 128 * 2^r
                               (r: the right shift) stay inside int32, so x86 may requantise
                               2x with the rounding half and the output zero point folded
                               into the 64-bit products (x86_mbqm_x2) */
} ea_epilogue;

/* Computes m rows x nr columns (nr <= NR; for gemm2 nr <= qpanels2 * NR over that many
 * panels, zero-padded) of raw dot products over kpad (a multiple of KC), MR rows at a time, applies the epilogue and stores row i at
 * c + i * ldc (elements of int8 or int32). rows[] holds m pointers plus padding up to a
 * multiple of MR (repeats of a valid row), so the last strip can always read MR rows.
 * ep->row_add, when set, has m entries. One call covers every strip of a row block, so the
 * per-column epilogue constants are prepared once per panel, not once per tile. */
typedef void (*ea_gemm_ukernel)(size_t mr, size_t nr, size_t kpad, const void *const *a,
                                const void *b_panel, const ea_epilogue *ep, void *c, size_t ldc);

/* Sign-extends n int8 values to int16 (A rows for a_elem == 2 variants). */
typedef void (*ea_widen_fn)(const int8_t *src, int16_t *dst, size_t n);

/* nrows x npix depthwise output pixels over c channels. Pixel p of row r reads tap t at
 * x[t] + r * x_row_step + p * x_step (the driver gives every tap a valid source, padding
 * included, so one call can cover whole output rows and per-call preparation is amortised):
 * acc = bias + sum_t (x - in_zp) * w[t][ch], requantised into out + r * out_row_step +
 * p * out_step (ep arrays per channel). cache is NULL or EA_DW_CACHE_BYTES(c) bytes, the first
 * EA_DW_CACHE_TAGS(c) of them zero, owned by one caller and passed only to calls of the same
 * c, ntaps, w, in_zp and ep (one op): a kernel may keep its per-block preparation there. */
#define EA_DW_CACHE_SLOT 3584
#define EA_DW_CACHE_TAGS(c) ((size_t)(c) / 16 + 1)
#define EA_DW_CACHE_BYTES(c) (EA_DW_CACHE_TAGS(c) + 64 + ((size_t)(c) / 16 + 1) * EA_DW_CACHE_SLOT)
typedef void (*ea_dw_ukernel)(size_t c, size_t nrows, size_t npix, size_t ntaps,
                              const int8_t *const *x, size_t x_step, size_t x_row_step,
                              const int16_t *const *w, int32_t in_zp, const ea_epilogue *ep,
                              int8_t *out, size_t out_step, size_t out_row_step, void *cache);

/* out[r] = -zb * (sum of the k int8 at rows[r]), wrapped to int32, for r < count: the
 * row_add of a row block, in one call (MobileNet's K = 8..16 rows cost a call each). */
typedef void (*ea_rowsums_fn)(const void *const *rows, size_t count, size_t k, int32_t zb, int32_t *out);

/* Elementwise int8 ADD (see ea_add_params). */
typedef void (*ea_add_fn)(size_t n, const int8_t *x1, const int8_t *x2, const ea_add_params *p,
                          int8_t *out);

/* Requantise n values with per-element parameters: out = clamp(MBQM(acc + bias)...). */
typedef void (*ea_requant_fn)(size_t n, const int32_t *acc, const ea_epilogue *ep, int8_t *out);

struct ea_variant {
    const char *name;
    const char *features; /* /proc/cpuinfo names, space separated */
    uint32_t mr, nr, kc;  /* micro-tile rows, columns; K chunk */
    uint32_t b_elem;      /* bytes per packed B element: 1 (int8) or 2 (int16) */
    uint32_t a_elem;      /* bytes per A element the kernels read: 1 (in place) or 2 (widen) */
    ea_gemm_ukernel gemm; /* mr x nr tiles */
    uint32_t mr2;         /* rows of gemm2's tiles */
    ea_gemm_ukernel gemm2; /* optional: mr2 x 2nr tiles over two adjacent panels */
    ea_widen_fn widen;    /* required when a_elem == 2 */
    ea_dw_ukernel dw;
    ea_requant_fn requant;
    ea_add_fn add;
    /* Optional second GEMM path over int8 B packed [K/qkc][nr][qkc] (the "quad" layout): x86's
     * u8 x s8 kernels (qkc 4, exact for a B without -128), AArch64's SMMLA ones (qkc 8, needs
     * i8mm at run time). ea_pack_b decides per matrix and records the layout in the packed
     * header, so one variant serves CPUs with and without the extension. */
    uint32_t qflags; /* EA_Q_NO_MIN: B must not hold -128; EA_Q_I8MM: CPU must have i8mm;
                        EA_Q_PAD_READS: see above */
    uint32_t qkc;
    uint32_t qmr;
    ea_gemm_ukernel qgemm;
    uint32_t qmr2;
    ea_gemm_ukernel qgemm2; /* qmr2 x 2nr tiles over two adjacent panels */
    uint32_t qmax_k;        /* 0: the u8 x s8 layout whenever it is exact; else only up to this K */
    /* VNNI's vpdpbusd takes B as its unsigned operand: the quad layout then stores b + 128
     * (any B, -128 included) and the driver subtracts 128 * rowsum_a per row. 0: B as is. */
    int32_t qb_offset;
    uint32_t qpanels2;      /* panels qgemm2 covers (its tiles are qpanels2 * nr wide); 0: 2 */
    ea_rowsums_fn rowsums;  /* optional SIMD row sums for row_add (a_elem 1); NULL: scalar */
    uint32_t qrowsum_max_k; /* quad kernels sum rows themselves up to this kpad (rowsum_zb) */
    /* Optional: qgemm2's tiles for kpad > qdeep_k, qmr2_deep rows high (AVX2: see avx2.c).
     * 0 / NULL: qgemm2 at every K. */
    uint32_t qdeep_k;
    uint32_t qmr2_deep;
    ea_gemm_ukernel qgemm2_deep;
};

/* ---- TFLite / gemmlowp fixed-point rules, scalar (the ground truth of every variant) ---- */

static inline int32_t ea_srdhm(int32_t a, int32_t b) {
    /* SaturatingRoundingDoublingHighMul: (a*b + nudge) / 2^31 with C truncating division.
     * That equals floor((a*b + 2^30) / 2^31) for every product, which is what the SIMD
     * versions compute (and what NEON's vqrdmulh computes, saturation included). */
    if (a == INT32_MIN && b == INT32_MIN) return INT32_MAX;
    int64_t ab = (int64_t)a * (int64_t)b;
    int64_t nudge = ab >= 0 ? (1 << 30) : (1 - (1 << 30));
    return (int32_t)((ab + nudge) / (INT64_C(1) << 31));
}

static inline int32_t ea_rdbypot(int32_t x, int exponent) {
    /* RoundingDivideByPOT: round half away from zero of x / 2^exponent, 0 <= exponent <= 31. */
    const int32_t mask = (int32_t)((INT64_C(1) << exponent) - 1);
    const int32_t remainder = x & mask;
    const int32_t threshold = (mask >> 1) + (x < 0 ? 1 : 0);
    return (x >> exponent) + (remainder > threshold ? 1 : 0);
}

static inline int32_t ea_mbqm(int32_t x, int32_t mult, int32_t shift) {
    /* MultiplyByQuantizedMultiplier, double rounding; x << left wraps like int32 hardware. */
    const int left = shift > 0 ? shift : 0;
    const int right = shift > 0 ? 0 : -shift;
    return ea_rdbypot(ea_srdhm((int32_t)((uint32_t)x << left), mult), right);
}

static inline int8_t ea_requant1(int32_t acc, int32_t mult, int32_t shift, int32_t zp,
                                 int32_t lo, int32_t hi) {
    int32_t v = ea_mbqm(acc, mult, shift) + zp;
    v = v < lo ? lo : v;
    v = v > hi ? hi : v;
    return (int8_t)v;
}

static inline int8_t ea_add1(int8_t a, int8_t b, const ea_add_params *p) {
    /* (x - zp) << 20 fits int32: |x - zp| <= 255 < 2^11. */
    const int32_t v1 = ea_mbqm((int32_t)((uint32_t)((int32_t)a - p->zp1) << 20), p->mult1, p->shift1);
    const int32_t v2 = ea_mbqm((int32_t)((uint32_t)((int32_t)b - p->zp2) << 20), p->mult2, p->shift2);
    int32_t o = ea_mbqm(v1 + v2, p->out_mult, p->out_shift) + p->out_zp;
    o = o < p->act_min ? p->act_min : o;
    o = o > p->act_max ? p->act_max : o;
    return (int8_t)o;
}

/* Scalar epilogue of a tile held in acc[MR][nr_stride]; used by variants for odd tails. */
static inline void ea_store_tile_scalar(size_t mr, size_t nr, const int32_t *acc,
                                        size_t acc_stride, const ea_epilogue *ep, void *c,
                                        size_t ldc) {
    for (size_t i = 0; i < mr; i++) {
        const int32_t radd = ep->row_add ? ep->row_add[i] : 0;
        for (size_t j = 0; j < nr; j++) {
            /* int32 wrap-around like TFLite's accumulator (uint32 to avoid C UB). */
            int32_t v = (int32_t)((uint32_t)acc[i * acc_stride + j] + (uint32_t)ep->bias[j] +
                                  (uint32_t)radd);
            if (ep->out_int32)
                ((int32_t *)c)[i * ldc + j] = v;
            else
                ((int8_t *)c)[i * ldc + j] = ea_requant1(v, ep->mult[j], ep->shift[j], ep->out_zp,
                                                         ep->act_min, ep->act_max);
        }
    }
}

/* The variants compiled into this library (defined in their own files). */
extern const ea_variant ea_variant_portable;
extern const ea_variant ea_variant_avx2;
extern const ea_variant ea_variant_avxvnni;
extern const ea_variant ea_variant_avx512vnni;
extern const ea_variant ea_variant_neon;
extern const ea_variant ea_variant_neon_dot;

#endif
