/* ARM kernels shared by the NEON (aarch64 and armv7) and NEON+SDOT variants; each variant
 * file sets the multiply-accumulate (EA_ARM_DOT), its name and features, then includes this.
 *
 * GEMM layout: B panel = [K/16][4 columns][16 k] raw int8. Each output element owns an
 * int32x4 accumulator fed 16 k at a time (vmull_s8 + vpadalq_s16: exact, products fit
 * int16; or SDOT), reduced horizontally once per tile.
 * Only intrinsics that exist on both AArch32 and AArch64 are used, so one source serves
 * the Pi 2/3/4 on a 32-bit OS and the Pi 3/4/5 on a 64-bit one.
 */
#ifndef EA_ARM_COMMON_H
#define EA_ARM_COMMON_H

#include <arm_neon.h>

#include "internal.h"

#define NR 4
#define KC 16
#if defined(__aarch64__)
#define MR 4 /* 16 accumulators + 4 A + B of 32 q registers */
#else
#define MR 2 /* AArch32 has 16 q registers: 8 accumulators + 2 A + B + products */
#endif

/* MultiplyByQuantizedMultiplier + zero point + clamp on 4 lanes. vqrdmulh is exactly
 * SaturatingRoundingDoublingHighMul; RoundingDivideByPOT is the reference formula. */
static inline int32x4_t arm_requant(int32x4_t acc, int32x4_t mult, int32x4_t shift,
                                    int32x4_t zp, int32x4_t lo, int32x4_t hi) {
    const int32x4_t zero = vdupq_n_s32(0), one = vdupq_n_s32(1);
    const int32x4_t left = vmaxq_s32(shift, zero);
    const int32x4_t right = vmaxq_s32(vnegq_s32(shift), zero);
    const int32x4_t x = vqrdmulhq_s32(vshlq_s32(acc, left), mult);
    const int32x4_t mask = vsubq_s32(vshlq_s32(one, right), one);
    const int32x4_t rem = vandq_s32(x, mask);
    const int32x4_t thr = vsubq_s32(vshrq_n_s32(mask, 1), vshrq_n_s32(x, 31));
    int32x4_t r = vshlq_s32(x, vnegq_s32(right)); /* negative count: arithmetic shift right */
    r = vsubq_s32(r, vreinterpretq_s32_u32(vcgtq_s32(rem, thr)));
    r = vaddq_s32(r, zp);
    return vminq_s32(vmaxq_s32(r, lo), hi);
}

static inline void arm_store_s8(int8_t *dst, int32x4_t a, int32x4_t b, size_t n) {
    const int16x8_t h = vcombine_s16(vqmovn_s32(a), vqmovn_s32(b));
    const int8x8_t v = vqmovn_s16(h);
    if (n == 8) {
        vst1_s8(dst, v);
    } else {
        int8_t tmp[8];
        vst1_s8(tmp, v);
        memcpy(dst, tmp, n);
    }
}

/* [sum(a), sum(b), sum(c), sum(d)] */
static inline int32x4_t arm_reduce4(int32x4_t a, int32x4_t b, int32x4_t c, int32x4_t d) {
#if defined(__aarch64__)
    return vpaddq_s32(vpaddq_s32(a, b), vpaddq_s32(c, d));
#else
    const int32x2_t ab = vpadd_s32(vpadd_s32(vget_low_s32(a), vget_high_s32(a)),
                                   vpadd_s32(vget_low_s32(b), vget_high_s32(b)));
    const int32x2_t cd = vpadd_s32(vpadd_s32(vget_low_s32(c), vget_high_s32(c)),
                                   vpadd_s32(vget_low_s32(d), vget_high_s32(d)));
    return vcombine_s32(ab, cd);
#endif
}

static void arm_tile(size_t mr, size_t nr, size_t kpad, const int8_t *const *a,
                     const void *b_panel, const ea_epilogue *ep, void *c, size_t ldc) {
    int32x4_t acc[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = vdupq_n_s32(0);
    const int8_t *b = (const int8_t *)b_panel;
    for (size_t k = 0; k < kpad; k += KC, b += NR * KC) {
        int8x16_t av[MR];
        for (int i = 0; i < MR; i++) av[i] = vld1q_s8(a[i] + k);
        for (int j = 0; j < NR; j++) {
            const int8x16_t bv = vld1q_s8(b + j * KC);
            for (int i = 0; i < MR; i++) acc[i][j] = EA_ARM_DOT(acc[i][j], av[i], bv);
        }
    }
    const int32x4_t bias = vld1q_s32(ep->bias), mult = vld1q_s32(ep->mult);
    const int32x4_t shift = vld1q_s32(ep->shift), zp = vdupq_n_s32(ep->out_zp);
    const int32x4_t lo = vdupq_n_s32(ep->act_min), hi = vdupq_n_s32(ep->act_max);
    for (size_t i = 0; i < mr; i++) {
        int32x4_t s = vaddq_s32(arm_reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), bias);
        if (ep->row_add) s = vaddq_s32(s, vdupq_n_s32(ep->row_add[i]));
        if (ep->out_int32) {
            int32_t tmp[4];
            vst1q_s32(tmp, s);
            memcpy((int32_t *)c + i * ldc, tmp, nr * sizeof(int32_t));
        } else {
            const int32x4_t q = arm_requant(s, mult, shift, zp, lo, hi);
            arm_store_s8((int8_t *)c + i * ldc, q, q, nr);
        }
    }
}

static void arm_gemm(size_t m, size_t nr, size_t kpad, const void *const *rows,
                     const void *b_panel, const ea_epilogue *ep, void *c, size_t ldc) {
    const size_t elem = ep->out_int32 ? 4 : 1;
    for (size_t s = 0; s < m; s += MR) {
        ea_epilogue e = *ep;
        if (ep->row_add) e.row_add = ep->row_add + s;
        arm_tile(m - s < MR ? m - s : MR, nr, kpad, (const int8_t *const *)rows + s, b_panel, &e,
                 (char *)c + s * ldc * elem, ldc);
    }
}

/* Depthwise: (x - zp) fits int16; vmlal_s16 widens the products into int32 lanes. */
static void arm_dw(size_t c, size_t nrows, size_t npix, size_t ntaps, const int8_t *const *x,
                   size_t x_step, size_t x_row_step, const int16_t *const *w, int32_t in_zp,
                   const ea_epilogue *ep, int8_t *out, size_t out_step, size_t out_row_step,
                   void *cache) {
    (void)cache;
    const int16x8_t zp16 = vdupq_n_s16((int16_t)in_zp);
    const int32x4_t ozp = vdupq_n_s32(ep->out_zp);
    const int32x4_t lo = vdupq_n_s32(ep->act_min), hi = vdupq_n_s32(ep->act_max);
    size_t ch = 0;
    for (; ch + 8 <= c; ch += 8) {
        const int32x4_t b0 = vld1q_s32(ep->bias + ch), b1 = vld1q_s32(ep->bias + ch + 4);
        const int32x4_t m0 = vld1q_s32(ep->mult + ch), m1 = vld1q_s32(ep->mult + ch + 4);
        const int32x4_t s0 = vld1q_s32(ep->shift + ch), s1 = vld1q_s32(ep->shift + ch + 4);
        for (size_t r = 0; r < nrows; r++) for (size_t p = 0; p < npix; p++) {
            const size_t off = (r * x_row_step + p * x_step) + ch;
            int32x4_t acc0 = b0, acc1 = b1;
            for (size_t t = 0; t < ntaps; t++) {
                const int16x8_t xv = vsubq_s16(vmovl_s8(vld1_s8(x[t] + off)), zp16);
                const int16x8_t wv = vld1q_s16(w[t] + ch);
                acc0 = vmlal_s16(acc0, vget_low_s16(xv), vget_low_s16(wv));
                acc1 = vmlal_s16(acc1, vget_high_s16(xv), vget_high_s16(wv));
            }
            arm_store_s8(out + (r * out_row_step + p * out_step) + ch, arm_requant(acc0, m0, s0, ozp, lo, hi),
                         arm_requant(acc1, m1, s1, ozp, lo, hi), 8);
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

static void arm_add(size_t n, const int8_t *x1, const int8_t *x2, const ea_add_params *p,
                    int8_t *out) {
    const int32x4_t m1 = vdupq_n_s32(p->mult1), s1 = vdupq_n_s32(p->shift1);
    const int32x4_t m2 = vdupq_n_s32(p->mult2), s2 = vdupq_n_s32(p->shift2);
    const int32x4_t mo = vdupq_n_s32(p->out_mult), so = vdupq_n_s32(p->out_shift);
    const int32x4_t z1 = vdupq_n_s32(p->zp1), z2 = vdupq_n_s32(p->zp2), zero = vdupq_n_s32(0);
    const int32x4_t ozp = vdupq_n_s32(p->out_zp);
    const int32x4_t lo = vdupq_n_s32(p->act_min), hi = vdupq_n_s32(p->act_max);
    const int32x4_t full_lo = vdupq_n_s32(INT32_MIN), full_hi = vdupq_n_s32(INT32_MAX);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const int16x8_t a = vmovl_s8(vld1_s8(x1 + i)), b = vmovl_s8(vld1_s8(x2 + i));
        int32x4_t r[2];
        for (int h = 0; h < 2; h++) {
            const int32x4_t a32 = vmovl_s16(h ? vget_high_s16(a) : vget_low_s16(a));
            const int32x4_t b32 = vmovl_s16(h ? vget_high_s16(b) : vget_low_s16(b));
            /* arm_requant with zero point 0 and no clamp is exactly MBQM. */
            const int32x4_t v1 = arm_requant(vshlq_n_s32(vsubq_s32(a32, z1), 20), m1, s1, zero, full_lo, full_hi);
            const int32x4_t v2 = arm_requant(vshlq_n_s32(vsubq_s32(b32, z2), 20), m2, s2, zero, full_lo, full_hi);
            r[h] = arm_requant(vaddq_s32(v1, v2), mo, so, ozp, lo, hi);
        }
        arm_store_s8(out + i, r[0], r[1], 8);
    }
    for (; i < n; i++) out[i] = ea_add1(x1[i], x2[i], p);
}

static void arm_requant_n(size_t n, const int32_t *acc, const ea_epilogue *ep, int8_t *out) {
    const int32x4_t ozp = vdupq_n_s32(ep->out_zp);
    const int32x4_t lo = vdupq_n_s32(ep->act_min), hi = vdupq_n_s32(ep->act_max);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const int32x4_t r0 = arm_requant(vld1q_s32(acc + i), vld1q_s32(ep->mult + i),
                                         vld1q_s32(ep->shift + i), ozp, lo, hi);
        const int32x4_t r1 = arm_requant(vld1q_s32(acc + i + 4), vld1q_s32(ep->mult + i + 4),
                                         vld1q_s32(ep->shift + i + 4), ozp, lo, hi);
        arm_store_s8(out + i, r0, r1, 8);
    }
    for (; i < n; i++)
        out[i] = ea_requant1(acc[i], ep->mult[i], ep->shift[i], ep->out_zp, ep->act_min,
                             ep->act_max);
}

#if defined(EA_ARM_MMLA)
/* SMMLA (i8mm: Neoverse N2/V1, Cortex-A710 and later; not the Pi 5's A76): one instruction
 * multiplies a 2x8 block of A by an 8x2 block of B into a 2x2 int32 block, 32 exact MACs.
 * B packed [K/8][4 columns][8 k], so 16 bytes are the column pairs (0,1) and (2,3); A rows
 * are paired per 8 k. Compiled for i8mm here only; ea_pack_b picks this layout only on a
 * CPU whose HWCAP2 says i8mm. */
#define MMLA_TARGET __attribute__((target("arch=armv8.2-a+dotprod+i8mm")))
MMLA_TARGET static void arm_mmla_tile(size_t mr, size_t nr, size_t kpad, const int8_t *const *a,
                                      const void *b_panel, const ea_epilogue *ep, void *c,
                                      size_t ldc) {
    int32x4_t c00 = vdupq_n_s32(0), c01 = c00, c10 = c00, c11 = c00; /* row pair, column pair */
    const int8_t *b = (const int8_t *)b_panel;
    for (size_t k = 0; k < kpad; k += 8, b += 32) {
        const int8x16_t a01 = vcombine_s8(vld1_s8(a[0] + k), vld1_s8(a[1] + k));
        const int8x16_t a23 = vcombine_s8(vld1_s8(a[2] + k), vld1_s8(a[3] + k));
        const int8x16_t b01 = vld1q_s8(b), b23 = vld1q_s8(b + 16);
        c00 = vmmlaq_s32(c00, a01, b01);
        c01 = vmmlaq_s32(c01, a01, b23);
        c10 = vmmlaq_s32(c10, a23, b01);
        c11 = vmmlaq_s32(c11, a23, b23);
    }
    /* c00 = [r0c0 r0c1 r1c0 r1c1], c01 = [r0c2 r0c3 r1c2 r1c3]: one int32x4 per row */
    const int32x4_t rows[4] = {vcombine_s32(vget_low_s32(c00), vget_low_s32(c01)),
                               vcombine_s32(vget_high_s32(c00), vget_high_s32(c01)),
                               vcombine_s32(vget_low_s32(c10), vget_low_s32(c11)),
                               vcombine_s32(vget_high_s32(c10), vget_high_s32(c11))};
    const int32x4_t bias = vld1q_s32(ep->bias), mult = vld1q_s32(ep->mult);
    const int32x4_t shift = vld1q_s32(ep->shift), zp = vdupq_n_s32(ep->out_zp);
    const int32x4_t lo = vdupq_n_s32(ep->act_min), hi = vdupq_n_s32(ep->act_max);
    for (size_t i = 0; i < mr; i++) {
        int32x4_t s = vaddq_s32(rows[i], bias);
        if (ep->row_add) s = vaddq_s32(s, vdupq_n_s32(ep->row_add[i]));
        if (ep->out_int32) {
            int32_t tmp[4];
            vst1q_s32(tmp, s);
            memcpy((int32_t *)c + i * ldc, tmp, nr * sizeof(int32_t));
        } else {
            const int32x4_t q = arm_requant(s, mult, shift, zp, lo, hi);
            arm_store_s8((int8_t *)c + i * ldc, q, q, nr);
        }
    }
}

MMLA_TARGET static void arm_mmla_gemm(size_t m, size_t nr, size_t kpad, const void *const *rows,
                                      const void *b_panel, const ea_epilogue *ep, void *c,
                                      size_t ldc) {
    const size_t elem = ep->out_int32 ? 4 : 1;
    for (size_t s = 0; s < m; s += 4) {
        ea_epilogue e = *ep;
        if (ep->row_add) e.row_add = ep->row_add + s;
        arm_mmla_tile(m - s < 4 ? m - s : 4, nr, kpad, (const int8_t *const *)rows + s, b_panel, &e,
                      (char *)c + s * ldc * elem, ldc);
    }
}
#define EA_ARM_QUAD EA_Q_I8MM, 8, 4, arm_mmla_gemm, 0, NULL, 0
#else
#define EA_ARM_QUAD 0, 0, 0, NULL, 0, NULL, 0
#endif

const ea_variant EA_ARM_VARIANT = {
    EA_ARM_NAME, EA_ARM_FEATURES, MR, NR, KC, 1, 1, arm_gemm, 0, NULL, NULL, arm_dw, arm_requant_n, arm_add,
    EA_ARM_QUAD,
};

#endif
