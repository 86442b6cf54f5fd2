/* float32 depthwise convolution, forward and backward: for training a small tail on the
 * device (edge_agent/train/numpy_tail.py) and for the float prefix's passes over a device's
 * images (int8/float_ops.py: normalisation statistics, calibration). numpy can only write it
 * as one shifted whole-array multiply-add per kernel tap -- 3-6x slower than this loop on a
 * MobileNetV2's maps (bench/bench_float_depthwise.py), a third of a tail job's training time.
 *
 * Plain C the compiler vectorises over channels (NHWC: channels are contiguous); one thread,
 * a fixed summation order and no fused multiply-add, so the same inputs give the same bits on
 * every CPU. The forward pass adds the taps in the order numpy's fallbacks do, so it gives
 * their bits too. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <string.h>

#include "ea_kernels.h"

static int dw_params_ok(const ea_conv_params *p) {
    return p && p->batch > 0 && p->in_h > 0 && p->in_w > 0 && p->in_c > 0 && p->out_h > 0 && p->out_w > 0 &&
           p->out_c == p->in_c && p->k_h > 0 && p->k_w > 0 && p->stride_h > 0 && p->stride_w > 0 &&
           p->dilation_h > 0 && p->dilation_w > 0 && p->pad_top >= 0 && p->pad_left >= 0 &&
           p->depth_multiplier == 1 && (int64_t)(p->out_h - 1) * p->stride_h - p->pad_top < p->in_h &&
           (int64_t)(p->out_w - 1) * p->stride_w - p->pad_left < p->in_w;
}

static void fma_row(float *restrict acc, const float *restrict a, const float *restrict b, int32_t c) {
    for (int32_t k = 0; k < c; k++) acc[k] += a[k] * b[k];
}

/* Every (output pixel, tap inside the input) pair, in the forward pass's order: with `out`,
 * out = sum of x * w over the taps (each pixel zeroed first); else the backward pass's sums
 * into gw_taps and/or gx (zeroed by the caller). */
static void dw_walk(const ea_conv_params *p, const float *x, const float *w_taps, float *out, const float *g,
                    float *gx, float *gw_taps) {
    const int32_t c = p->in_c;
    for (int32_t b = 0; b < p->batch; b++)
        for (int32_t oy = 0; oy < p->out_h; oy++)
            for (int32_t ox = 0; ox < p->out_w; ox++) {
                const size_t pixel = (((size_t)b * p->out_h + oy) * p->out_w + ox) * c;
                if (out) memset(out + pixel, 0, sizeof(float) * (size_t)c);
                for (int32_t i = 0; i < p->k_h; i++) {
                    const int32_t iy = oy * p->stride_h + i * p->dilation_h - p->pad_top;
                    if (iy < 0 || iy >= p->in_h) continue;
                    for (int32_t j = 0; j < p->k_w; j++) {
                        const int32_t ix = ox * p->stride_w + j * p->dilation_w - p->pad_left;
                        if (ix < 0 || ix >= p->in_w) continue;
                        const size_t at = (((size_t)b * p->in_h + iy) * p->in_w + ix) * c;
                        const size_t tap = (size_t)(i * p->k_w + j) * c;
                        if (out) fma_row(out + pixel, x + at, w_taps + tap, c);
                        if (gw_taps) fma_row(gw_taps + tap, x + at, g + pixel, c);
                        if (gx) fma_row(gx + at, g + pixel, w_taps + tap, c);
                    }
                }
            }
}

EA_API int ea_f32_depthwise_fwd(const ea_conv_params *p, const float *x, const float *w_taps, float *out) {
    if (!dw_params_ok(p) || !x || !w_taps || !out) return EA_EINVAL;
    dw_walk(p, x, w_taps, out, NULL, NULL, NULL);
    return EA_OK;
}

EA_API int ea_f32_depthwise_bwd(const ea_conv_params *p, const float *x, const float *w_taps, const float *g,
                                float *gx, float *gw_taps) {
    if (!dw_params_ok(p) || !x || !w_taps || !g || (!gx && !gw_taps)) return EA_EINVAL;
    if (gx) memset(gx, 0, sizeof(float) * (size_t)p->batch * p->in_h * p->in_w * p->in_c);
    if (gw_taps) memset(gw_taps, 0, sizeof(float) * (size_t)p->k_h * p->k_w * p->in_c);
    dw_walk(p, x, w_taps, NULL, g, gx, gw_taps);
    return EA_OK;
}
