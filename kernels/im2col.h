/* im2col rows for the GEMM driver (dispatch.c): one output pixel's receptive field as one
 * row of K int8 values, the input zero point outside the image. Included once, by dispatch.c
 * (baseline flags). */
#ifndef EA_IM2COL_H
#define EA_IM2COL_H

#include "internal.h"

/* Copy n bytes; MobileNet's stem copies 3..9 bytes at a time, where a libc call costs more
 * than the copy. */
static inline void copy_small(int8_t *dst, const int8_t *src, int64_t n) {
    if (n <= 16) {
        for (int64_t i = 0; i < n; i++) dst[i] = src[i];
    } else {
        memcpy(dst, src, (size_t)n);
    }
}

/* Set n bytes to v; the zero-point runs at an image border are a few bytes long. */
static inline void fill_small(int8_t *dst, int8_t v, int64_t n) {
    if (n <= 16) {
        for (int64_t i = 0; i < n; i++) dst[i] = v;
    } else {
        memset(dst, v, (size_t)n);
    }
}

/* Fill one im2col row of `kpad` bytes for output pixel px (input zero point outside). */
static void im2col_row(const ea_conv_params *cp, const int8_t *in, pixel px, int64_t kpad,
                       int8_t *dst) {
    const int64_t c = cp->in_c, kw = cp->k_w, kwc = kw * c;
    const int8_t zp = (int8_t)cp->in_zp;
    const int64_t ix0 = px.ox * cp->stride_w - cp->pad_left;
    /* with dilation 1 a kernel row's taps inside the image, [kx_lo, kx_hi), are one
     * contiguous run of input pixels */
    int64_t kx_lo = 0, kx_hi = 0;
    if (cp->dilation_w == 1) {
        kx_lo = ix0 < 0 ? -ix0 : 0;
        kx_hi = cp->in_w - ix0 < kw ? cp->in_w - ix0 : kw;
        if (kx_lo > kw) kx_lo = kw;
        if (kx_hi < kx_lo) kx_hi = kx_lo;
    }
    int8_t *d = dst;
    for (int32_t ky = 0; ky < cp->k_h; ky++, d += kwc) {
        const int64_t iy = px.oy * cp->stride_h - cp->pad_top + (int64_t)ky * cp->dilation_h;
        if (iy < 0 || iy >= cp->in_h) {
            fill_small(d, zp, kwc);
            continue;
        }
        const int8_t *src_row = in + ((px.nb * cp->in_h + iy) * cp->in_w) * c;
        if (cp->dilation_w == 1) {
            fill_small(d, zp, kx_lo * c);
            if (kx_hi > kx_lo) copy_small(d + kx_lo * c, src_row + (ix0 + kx_lo) * c, (kx_hi - kx_lo) * c);
            fill_small(d + kx_hi * c, zp, (kw - kx_hi) * c);
        } else {
            for (int64_t kx = 0; kx < kw; kx++) {
                const int64_t ix = ix0 + kx * cp->dilation_w;
                if (ix < 0 || ix >= cp->in_w)
                    fill_small(d + kx * c, zp, c);
                else
                    copy_small(d + kx * c, src_row + ix * c, c);
            }
        }
    }
    fill_small(d, 0, kpad - (d - dst));
}

/* Kernel heights up to this take im2col_rows' fast path (larger ones go row by row). */
#define EA_IM2COL_MAX_KH 16

/* `n` rows (kpad apart from d) of pixels whose taps are all inside the image horizontally:
 * kernel row ky of the first pixel starts at rowp[ky] (NULL: that input row is outside the
 * image, so the zero point), and each pixel moves `step` bytes on. kwc = k_w * in_c bytes
 * per kernel row, contiguous (dilation_w 1). in_end: the end of the input tensor. */
static void im2col_interior(int8_t *d, const int8_t *const *rowp, int64_t kh, int64_t kwc,
                            int64_t step, int64_t n, int64_t kpad, int8_t zp,
                            const int8_t *in_end) {
    const int64_t used = kh * kwc, tail = kpad - used;
    /* The zero tail as one fixed-size store ahead of the copies, which overwrite its head. */
    const int tail16 = tail <= 16 && kpad >= 16;
    int all_rows = 1;
    for (int64_t ky = 0; ky < kh; ky++) all_rows &= rowp[ky] != NULL;
    if (all_rows && kh == 3 && kwc == 9 && kpad >= 27 && kpad <= 35 &&
        in_end - rowp[2] >= (n - 1) * step + 16) {
        /* the 3x3 stem on RGB, where every 16-byte load stays inside the input: each kernel
         * row as one 16-byte copy over the head of the next, the tail as one 8-byte store;
         * up to 8 bytes land past the row, in the next row (written after it) or the slack */
        const int8_t *s0 = rowp[0], *s1 = rowp[1], *s2 = rowp[2];
        for (int64_t i = 0; i < n; i++, d += kpad, s0 += step, s1 += step, s2 += step) {
            memcpy(d, s0, 16);
            memcpy(d + 9, s1, 16);
            memcpy(d + 18, s2, 16);
            memset(d + 27, 0, 8);
        }
        return;
    }
    if (all_rows && kh == 3 && kwc == 9 && tail16) { /* the same with exact copies */
        const int8_t *s0 = rowp[0], *s1 = rowp[1], *s2 = rowp[2];
        for (int64_t i = 0; i < n; i++, d += kpad, s0 += step, s1 += step, s2 += step) {
            memset(d + kpad - 16, 0, 16);
            memcpy(d, s0, 9);
            memcpy(d + 9, s1, 9);
            memcpy(d + 18, s2, 9);
        }
        return;
    }
    for (int64_t i = 0; i < n; i++, d += kpad) {
        if (tail16) memset(d + kpad - 16, 0, 16);
        int8_t *o = d;
        for (int64_t ky = 0; ky < kh; ky++, o += kwc) {
            if (rowp[ky])
                copy_small(o, rowp[ky] + i * step, kwc);
            else
                fill_small(o, zp, kwc);
        }
        if (!tail16) fill_small(o, 0, tail);
    }
}

/* Fill `count` consecutive im2col rows (kpad bytes each, contiguous from dst) for the output
 * pixels from *px on, and advance *px past them. dst needs 8 bytes of slack after the last
 * row (the stem's copies may write that far past it). Pixels of one output row whose
 * horizontal taps all lie inside the image share per-kernel-row source pointers and take
 * im2col_interior; the border pixels go through im2col_row. */
static void im2col_rows(const ea_conv_params *cp, const int8_t *in, pixel *px, int64_t count,
                        int64_t kpad, int8_t *dst) {
    const int64_t c = cp->in_c, kh = cp->k_h, kwc = (int64_t)cp->k_w * c, sw = cp->stride_w;
    const int64_t pl = cp->pad_left;
    const int8_t *in_end = in + (int64_t)cp->batch * cp->in_h * cp->in_w * c;
    const int fast = cp->dilation_w == 1 && kh <= EA_IM2COL_MAX_KH && pl >= 0 && sw > 0;
    /* interior output columns [ox_lo, ox_hi): ox * sw - pl >= 0 and ox * sw - pl + k_w <= in_w */
    int64_t ox_lo = 0, ox_hi = 0;
    if (fast) {
        const int64_t last = (int64_t)cp->in_w - cp->k_w + pl;
        ox_lo = (pl + sw - 1) / sw;
        ox_hi = last < 0 ? 0 : last / sw + 1;
        if (ox_hi > cp->out_w) ox_hi = cp->out_w;
        if (ox_lo > ox_hi) ox_lo = ox_hi;
    }
    while (count > 0) {
        const int64_t ox0 = px->ox;
        const int64_t ox1 = (cp->out_w - ox0) < count ? cp->out_w : ox0 + count;
        const int64_t a = ox0 > ox_lo ? ox0 : ox_lo, b = ox1 < ox_hi ? ox1 : ox_hi;
        pixel p = *px;
        for (p.ox = ox0; p.ox < ox1 && p.ox < a; p.ox++, dst += kpad) im2col_row(cp, in, p, kpad, dst);
        if (a < b) {
            const int8_t *rowp[EA_IM2COL_MAX_KH];
            for (int64_t ky = 0; ky < kh; ky++) {
                const int64_t iy = px->oy * cp->stride_h - cp->pad_top + ky * cp->dilation_h;
                rowp[ky] = (iy < 0 || iy >= cp->in_h)
                               ? NULL
                               : in + ((px->nb * cp->in_h + iy) * cp->in_w + a * sw - pl) * c;
            }
            im2col_interior(dst, rowp, kh, kwc, sw * c, b - a, kpad, (int8_t)cp->in_zp, in_end);
            dst += (b - a) * kpad;
            p.ox = b;
        }
        for (; p.ox < ox1; p.ox++, dst += kpad) im2col_row(cp, in, p, kpad, dst);
        count -= ox1 - ox0;
        px->ox = ox1;
        if (px->ox == cp->out_w) {
            px->ox = 0;
            if (++px->oy == cp->out_h) {
                px->oy = 0;
                px->nb++;
            }
        }
    }
}

/* For a 1x1 unpadded conv, row m is the input pixel under output pixel px. */
static const int8_t *conv_direct_row(const ea_conv_params *cp, const int8_t *in, pixel px) {
    const int64_t iy = px.oy * cp->stride_h, ix = px.ox * cp->stride_w;
    return in + ((px.nb * cp->in_h + iy) * cp->in_w + ix) * cp->in_c;
}

#endif
