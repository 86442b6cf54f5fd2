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

/* Fill one im2col row of `kpad` bytes for output pixel px (input zero point outside). */
static void im2col_row(const ea_conv_params *cp, const int8_t *in, pixel px, int64_t kpad,
                       int8_t *dst) {
    const int64_t c = cp->in_c, kw = cp->k_w;
    const int64_t ix0 = px.ox * cp->stride_w - cp->pad_left;
    const int64_t ix1 = ix0 + (kw - 1) * cp->dilation_w;
    /* with dilation 1 a kernel row's taps are one contiguous run of input pixels */
    const int row_inside = cp->dilation_w == 1 && ix0 >= 0 && ix1 < cp->in_w;
    int8_t *d = dst;
    for (int32_t ky = 0; ky < cp->k_h; ky++) {
        const int64_t iy = px.oy * cp->stride_h - cp->pad_top + (int64_t)ky * cp->dilation_h;
        if (iy < 0 || iy >= cp->in_h) {
            memset(d, (int8_t)cp->in_zp, (size_t)(kw * c));
            d += kw * c;
            continue;
        }
        const int8_t *src_row = in + ((px.nb * cp->in_h + iy) * cp->in_w) * c;
        if (row_inside) {
            copy_small(d, src_row + ix0 * c, kw * c);
            d += kw * c;
        } else {
            for (int64_t kx = 0; kx < kw; kx++, d += c) {
                const int64_t ix = ix0 + kx * cp->dilation_w;
                if (ix < 0 || ix >= cp->in_w)
                    memset(d, (int8_t)cp->in_zp, (size_t)c);
                else
                    copy_small(d, src_row + ix * c, c);
            }
        }
    }
    memset(d, 0, (size_t)(kpad - (d - dst)));
}

/* For a 1x1 unpadded conv, row m is the input pixel under output pixel px. */
static const int8_t *conv_direct_row(const ea_conv_params *cp, const int8_t *in, pixel px) {
    const int64_t iy = px.oy * cp->stride_h, ix = px.ox * cp->stride_w;
    return in + ((px.nb * cp->in_h + iy) * cp->in_w + ix) * cp->in_c;
}

#endif
