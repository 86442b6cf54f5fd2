/* Portable C variant: runs on any CPU; the ground truth the SIMD variants are tested against
 * (besides the numpy reference). Small 4x4 tiles so the compiler can keep sums in registers. */
#include "internal.h"

#define MR 4
#define NR 4
#define KC 4

static void tile_portable(size_t mr, size_t nr, size_t kpad, const int8_t *const *a,
                          const void *b_panel, const ea_epilogue *ep, void *c, size_t ldc) {
    int32_t acc[MR][NR] = {{0}};
    const int8_t *b = (const int8_t *)b_panel;
    for (size_t k = 0; k < kpad; k += KC, b += NR * KC) {
        for (size_t i = 0; i < MR; i++) {
            const int8_t *ai = a[i] + k;
            for (size_t j = 0; j < NR; j++) {
                int32_t s = 0;
                for (size_t kk = 0; kk < KC; kk++) s += (int32_t)ai[kk] * b[j * KC + kk];
                acc[i][j] += s;
            }
        }
    }
    ea_store_tile_scalar(mr, nr, &acc[0][0], NR, ep, c, ldc);
}

static void gemm_portable(size_t m, size_t nr, size_t kpad, const void *const *rows,
                          const void *b_panel, const ea_epilogue *ep, void *c, size_t ldc) {
    const size_t elem = ep->out_int32 ? 4 : 1;
    for (size_t s = 0; s < m; s += MR) {
        ea_epilogue e = *ep;
        if (ep->row_add) e.row_add = ep->row_add + s;
        tile_portable(m - s < MR ? m - s : MR, nr, kpad, (const int8_t *const *)rows + s, b_panel, &e,
                      (char *)c + s * ldc * elem, ldc);
    }
}

static void dw_portable(size_t c, size_t nrows, size_t npix, size_t ntaps, const int8_t *const *x,
                        size_t x_step, size_t x_row_step, const int16_t *const *w, int32_t in_zp,
                        const ea_epilogue *ep, int8_t *out, size_t out_step, size_t out_row_step,
                        void *cache) {
    (void)cache;
    int32_t acc[64];
    for (size_t r = 0; r < nrows; r++) for (size_t p = 0; p < npix; p++) {
        for (size_t c0 = 0; c0 < c; c0 += 64) {
            const size_t cn = (c - c0) < 64 ? (c - c0) : 64;
            for (size_t ch = 0; ch < cn; ch++) acc[ch] = ep->bias[c0 + ch];
            for (size_t t = 0; t < ntaps; t++) {
                const int8_t *xt = x[t] + (r * x_row_step + p * x_step) + c0;
                const int16_t *wt = w[t] + c0;
                for (size_t ch = 0; ch < cn; ch++) acc[ch] += ((int32_t)xt[ch] - in_zp) * wt[ch];
            }
            for (size_t ch = 0; ch < cn; ch++)
                out[(r * out_row_step + p * out_step) + c0 + ch] =
                    ea_requant1(acc[ch], ep->mult[c0 + ch], ep->shift[c0 + ch], ep->out_zp,
                                ep->act_min, ep->act_max);
        }
    }
}

static void add_portable(size_t n, const int8_t *x1, const int8_t *x2, const ea_add_params *p,
                         int8_t *out) {
    for (size_t i = 0; i < n; i++) out[i] = ea_add1(x1[i], x2[i], p);
}

static void requant_portable(size_t n, const int32_t *acc, const ea_epilogue *ep, int8_t *out) {
    for (size_t i = 0; i < n; i++)
        out[i] = ea_requant1(acc[i], ep->mult[i], ep->shift[i], ep->out_zp, ep->act_min,
                             ep->act_max);
}

const ea_variant ea_variant_portable = {
    "portable", "", MR, NR, KC, 1, 1, gemm_portable, 0, NULL, NULL, dw_portable, requant_portable,
    add_portable,
};
