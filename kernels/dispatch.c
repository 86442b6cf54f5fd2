/* Variant table and the drivers shared by every variant: B packing, GEMM / conv blocking
 * (im2col rows built per block, never for the whole tensor), depthwise tap gathering.
 * Compiled with baseline flags: it only loops and calls the variant's micro-kernels.
 */
#include <stdlib.h>

#include "internal.h"

#if defined(__linux__) && (defined(__aarch64__) || defined(__arm__))
#include <sys/auxv.h>
#endif

static const ea_variant *const VARIANTS[] = {
/* Preference order: the first runnable variant is the fastest. */
#ifdef EA_HAVE_AVX512VNNI
    &ea_variant_avx512vnni,
#endif
#ifdef EA_HAVE_AVXVNNI
    &ea_variant_avxvnni,
#endif
#ifdef EA_HAVE_AVX2
    &ea_variant_avx2,
#endif
#ifdef EA_HAVE_NEON_DOT
    &ea_variant_neon_dot,
#endif
#ifdef EA_HAVE_NEON
    &ea_variant_neon,
#endif
    &ea_variant_portable,
};
#define N_VARIANTS ((int)(sizeof(VARIANTS) / sizeof(VARIANTS[0])))

/* Largest K: |(a - za)(b - zb)| <= 255 * 256 < 2^16, so int32 sums stay exact below 2^15. */
#define EA_MAX_K (INT64_C(1) << 15)

#ifndef EA_BUILD_INFO
#define EA_BUILD_INFO "built without setup.py"
#endif

int ea_abi_version(void) { return EA_ABI_VERSION; }
const char *ea_build_info(void) { return EA_BUILD_INFO; }
int ea_variant_count(void) { return N_VARIANTS; }

const ea_variant *ea_variant_at(int index) {
    return (index >= 0 && index < N_VARIANTS) ? VARIANTS[index] : NULL;
}

const char *ea_variant_name(const ea_variant *v) { return v ? v->name : ""; }
const char *ea_variant_features(const ea_variant *v) { return v ? v->features : ""; }

static int quad_runnable(const ea_variant *v);

static int has_feature(const char *features, const char *word) {
    const size_t len = strlen(word);
    for (const char *p = features; (p = strstr(p, word)) != NULL; p += len) {
        const int starts = p == features || p[-1] == ' ';
        const int ends = p[len] == '\0' || p[len] == ' ';
        if (starts && ends) return 1;
    }
    return 0;
}

int ea_variant_runnable(const ea_variant *v) {
    if (!v) return 0;
    const char *f = v->features;
#if defined(__x86_64__) || defined(__i386__)
    /* libgcc's cpu model also checks XGETBV, i.e. that the OS saves the vector state. */
    __builtin_cpu_init();
    if (has_feature(f, "avx2") && !__builtin_cpu_supports("avx2")) return 0;
    if (has_feature(f, "avx_vnni") && !__builtin_cpu_supports("avxvnni")) return 0;
    if (has_feature(f, "avx512f") && !__builtin_cpu_supports("avx512f")) return 0;
    if (has_feature(f, "avx512bw") && !__builtin_cpu_supports("avx512bw")) return 0;
    if (has_feature(f, "avx512vl") && !__builtin_cpu_supports("avx512vl")) return 0;
    if (has_feature(f, "avx512_vnni") && !__builtin_cpu_supports("avx512vnni")) return 0;
    return 1;
#elif defined(__linux__) && defined(__aarch64__)
    const unsigned long hw = getauxval(AT_HWCAP);
    if (has_feature(f, "asimd") && !(hw & (1UL << 1))) return 0;     /* HWCAP_ASIMD */
    if (has_feature(f, "asimddp") && !(hw & (1UL << 20))) return 0;  /* HWCAP_ASIMDDP */
    return 1;
#elif defined(__linux__) && defined(__arm__)
    const unsigned long hw = getauxval(AT_HWCAP);
    if (has_feature(f, "neon") && !(hw & (1UL << 12))) return 0;     /* HWCAP_NEON */
    return 1;
#else
    return f[0] == '\0';
#endif
}

/* ------------------------------------------------------------------ packing B */

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Packed B starts with this header: the layout is chosen per matrix, because the u8 x s8
 * kernels are exact only for a B without -128 (see x86_common.h). */
#define EA_PACK_MAGIC 0x42504145u /* "EAPB" */
#define EA_PACK_HEADER 64
#define EA_LAYOUT_NATIVE 1 /* the variant's own kc / b_elem */
#define EA_LAYOUT_QUAD 2   /* int8 [K/4][nr][4] for qgemm / qgemm2 */

typedef struct pack_header {
    uint32_t magic, layout;
    int64_t n, k;
} pack_header;

typedef struct layout {
    int64_t kc, b_elem, a_elem;
    uint32_t mr, mr2;
    ea_gemm_ukernel gemm, gemm2;
    int64_t panels2;   /* panels a gemm2 tile covers */
    int32_t b_offset;  /* stored B = b + b_offset (as uint8 when 128) */
} layout;

static layout layout_of(const ea_variant *v, uint32_t kind) {
    layout l;
    if (kind == EA_LAYOUT_QUAD) {
        l.kc = v->qkc, l.b_elem = 1, l.a_elem = 1, l.mr = v->qmr, l.mr2 = v->qmr2;
        l.gemm = v->qgemm, l.gemm2 = v->qgemm2;
        l.panels2 = v->qpanels2 ? v->qpanels2 : 2, l.b_offset = v->qb_offset;
    } else {
        l.kc = v->kc, l.b_elem = v->b_elem, l.a_elem = v->a_elem, l.mr = v->mr, l.mr2 = v->mr2;
        l.gemm = v->gemm, l.gemm2 = v->gemm2;
        l.panels2 = 2, l.b_offset = 0;
    }
    return l;
}

void ea_variant_geometry(const ea_variant *v, int32_t out[3]) {
    if (v->qgemm && quad_runnable(v)) { /* the kernels weights use (see ea_pack_b) */
        out[0] = (int32_t)(v->qmr2 > v->qmr ? v->qmr2 : v->qmr);
        out[1] = (int32_t)(v->qgemm2 ? layout_of(v, EA_LAYOUT_QUAD).panels2 * v->nr : v->nr);
        out[2] = (int32_t)v->qkc;
        return;
    }
    out[0] = (int32_t)(v->mr2 > v->mr ? v->mr2 : v->mr);
    out[1] = (int32_t)(v->gemm2 ? 2 * v->nr : v->nr);
    out[2] = (int32_t)v->kc;
}

/* Panels stored: a multiple of panels2, so a wide tile may read all of its panels even
 * where fewer columns are left (the extra ones are zero and their results dropped). */
static int64_t stored_panels(const layout *l, int64_t nr, int64_t n) {
    return ceil_div(ceil_div(n, nr), l->panels2) * l->panels2;
}

static size_t layout_bytes(const layout *l, int64_t nr, int64_t n, int64_t k) {
    return (size_t)(stored_panels(l, nr, n) * nr * ceil_div(k, l->kc) * l->kc * l->b_elem);
}

/* The quad kernels' own CPU needs beyond the variant's (AArch64 i8mm: HWCAP2_I8MM). */
static int quad_runnable(const ea_variant *v) {
    if (!(v->qflags & EA_Q_I8MM)) return 1;
#if defined(__linux__) && defined(__aarch64__)
    return (getauxval(AT_HWCAP2) & (1UL << 13)) != 0;
#else
    return 0;
#endif
}

size_t ea_packed_b_size(const ea_variant *v, int64_t n, int64_t k) {
    if (!v || n <= 0 || k <= 0) return 0;
    const layout native = layout_of(v, EA_LAYOUT_NATIVE), quad = layout_of(v, EA_LAYOUT_QUAD);
    size_t bytes = layout_bytes(&native, v->nr, n, k);
    if (v->qgemm && layout_bytes(&quad, v->nr, n, k) > bytes) bytes = layout_bytes(&quad, v->nr, n, k);
    return EA_PACK_HEADER + bytes;
}

int ea_pack_b(const ea_variant *v, int64_t n, int64_t k, const int8_t *b, int64_t stride_n,
              int64_t stride_k, void *packed, int32_t *colsum) {
    if (!v || !b || !packed || !colsum || n <= 0 || k <= 0 || k > EA_MAX_K) return EA_EINVAL;
    int has_min = 0;
    for (int64_t col = 0; col < n; col++) {
        int32_t s = 0;
        for (int64_t kx = 0; kx < k; kx++) {
            const int8_t val = b[col * stride_n + kx * stride_k];
            s += val;
            has_min |= val == -128;
        }
        colsum[col] = s;
    }
    /* EDGE_AGENT_NATIVE_LAYOUT=int16 | u8s8 overrides the variant's choice by K (benchmarks
     * compare the two; tests run the u8 x s8 path at every K, as the VNNI variants do). */
    const char *force = getenv("EDGE_AGENT_NATIVE_LAYOUT");
    const int want_int16 = force && strcmp(force, "int16") == 0;
    const int want_quad = force && strcmp(force, "u8s8") == 0;
    const int by_k = v->qmax_k == 0 || k <= (int64_t)v->qmax_k;
    const int quad_ok = v->qgemm && quad_runnable(v) && !(has_min && (v->qflags & EA_Q_NO_MIN)) &&
                        !want_int16 && (by_k || want_quad);
    const uint32_t kind = quad_ok ? EA_LAYOUT_QUAD : EA_LAYOUT_NATIVE;
    const layout l = layout_of(v, kind);
    pack_header h = {EA_PACK_MAGIC, kind, n, k};
    memset(packed, 0, EA_PACK_HEADER);
    memcpy(packed, &h, sizeof(h));
    unsigned char *dst = (unsigned char *)packed + EA_PACK_HEADER;
    const int64_t nr = v->nr, kc = l.kc, kpad = ceil_div(k, kc) * kc;
    const int64_t panels = stored_panels(&l, nr, n);
    size_t idx = 0;
    for (int64_t p = 0; p < panels; p++) {
        for (int64_t q = 0; q < kpad; q += kc) {
            for (int64_t j = 0; j < nr; j++) {
                const int64_t col = p * nr + j;
                for (int64_t kk = 0; kk < kc; kk++, idx++) {
                    const int64_t kx = q + kk;
                    const int8_t val = (col < n && kx < k) ? b[col * stride_n + kx * stride_k] : 0;
                    if (l.b_elem == 2)
                        ((int16_t *)dst)[idx] = val;
                    else if (l.b_offset)
                        dst[idx] = (unsigned char)(val + l.b_offset); /* 0..255 */
                    else
                        ((int8_t *)dst)[idx] = val;
                }
            }
        }
    }
    return EA_OK;
}

/* ------------------------------------------------------------------ GEMM driver */

typedef struct a_source {
    int conv; /* 0: strided matrix A; 1: im2col rows of a convolution input */
    const int8_t *a;
    int64_t sm, sk;
    const ea_conv_params *cp;
} a_source;

static int valid_requant(int64_t n, const int32_t *mult, const int32_t *shift, int32_t zp,
                         int32_t lo, int32_t hi) {
    if (!mult || !shift) return 0;
    if (zp < -128 || zp > 127 || lo < -128 || hi > 127 || lo > hi) return 0;
    for (int64_t i = 0; i < n; i++) {
        /* TFLite's QuantizeMultiplier yields shift in [-31, 30]; INT32_MIN never occurs. */
        if (shift[i] < -31 || shift[i] > 30 || mult[i] == INT32_MIN) return 0;
    }
    return 1;
}

/* Output pixel (image, row, column) of a flattened output row index, advanced
 * incrementally: a division per row costs as much as a small GEMM row. */
typedef struct {
    int64_t nb, oy, ox;
} pixel;

static pixel pixel_of(const ea_conv_params *cp, int64_t m) {
    const int64_t ohw = (int64_t)cp->out_h * cp->out_w, rem = m % ohw;
    pixel px = {m / ohw, rem / cp->out_w, rem % cp->out_w};
    return px;
}

static void pixel_next(const ea_conv_params *cp, pixel *px) {
    if (++px->ox == cp->out_w) {
        px->ox = 0;
        if (++px->oy == cp->out_h) {
            px->oy = 0;
            px->nb++;
        }
    }
}

#include "im2col.h"

/* What a GEMM against one packed B needs beyond A and C, computed once: the layout, the
 * per-column epilogue constants (bias with the zero points folded in, multipliers, shifts)
 * and the row-block size. Read-only after plan_init, so one plan may run in several threads. */
struct ea_gemm_plan {
    const ea_variant *v;
    layout lay;
    uint32_t kind;
    const void *panels_b; /* packed B past its header */
    int64_t n, k, kpad, panels, mc, zb, m, ldc;
    int32_t out_zp, act_min, act_max, out_int32;
    int kernel_rowsums, batch_rowsums, row_sums;
    int32_t *bias_eff, *mult_p, *shift_p; /* stored panels * nr each, in colbuf */
    int32_t *panel_bounded;               /* per stored panel (ea_epilogue.acc_bounded), in colbuf */
    int32_t *colbuf;
};

static int plan_init(ea_gemm_plan *pl, const ea_variant *v, int64_t n, int64_t k, int32_t a_zp,
                     int32_t b_zp, const void *packed_b, const int32_t *colsum,
                     const int32_t *bias, const int32_t *mult, const int32_t *shift,
                     int32_t out_zp, int32_t act_min, int32_t act_max, int out_int32) {
    pack_header h;
    memcpy(&h, packed_b, sizeof(h));
    if (h.magic != EA_PACK_MAGIC || h.n != n || h.k != k) return EA_EINVAL;
    layout lay = layout_of(v, h.layout);
    if (!lay.gemm) return EA_EINVAL;
    if (h.layout == EA_LAYOUT_QUAD && v->qgemm2_deep && ceil_div(k, lay.kc) * lay.kc > (int64_t)v->qdeep_k)
        lay.gemm2 = v->qgemm2_deep, lay.mr2 = v->qmr2_deep;
    pl->v = v, pl->lay = lay, pl->kind = h.layout, pl->n = n, pl->k = k;
    pl->panels_b = (const unsigned char *)packed_b + EA_PACK_HEADER;
    const int64_t nr = v->nr, kc = lay.kc, ae = lay.a_elem;
    const int64_t kpad = ceil_div(k, kc) * kc;
    pl->kpad = kpad, pl->panels = ceil_div(n, nr);
    /* B stored as b + off: sum a(b - zb) = sum a(b + off) - (zb + off) * rowsum_a, i.e. the
     * kernels see a weight zero point zb + off and column sums colsum + off * K. */
    const int64_t off = lay.b_offset, zb = b_zp + off;
    pl->zb = zb;
    /* Row sums: in the kernels for short rows (qrowsum_max_k), else one call per row block
     * (rows[] holds the int8 rows when a_elem is 1), else per row here. */
    pl->kernel_rowsums = zb != 0 && h.layout == EA_LAYOUT_QUAD && kpad <= (int64_t)v->qrowsum_max_k;
    pl->batch_rowsums = !pl->kernel_rowsums && v->rowsums != NULL && ae == 1;
    pl->row_sums = zb != 0 && !pl->kernel_rowsums;
    pl->out_zp = out_zp, pl->act_min = act_min, pl->act_max = act_max, pl->out_int32 = out_int32;
    /* Block of rows whose A data (~32 KiB) stays in cache while every B panel passes over it. */
    const int64_t mr_max = lay.mr2 > lay.mr ? lay.mr2 : lay.mr;
    int64_t mc = (32768 / (kpad * ae)) / mr_max * mr_max;
    if (mc < mr_max) mc = mr_max;
    if (mc > EA_MAX_MC) mc = EA_MAX_MC / mr_max * mr_max;
    pl->mc = mc;
    const size_t cols = (size_t)(stored_panels(&lay, nr, n) * nr); /* wide tiles read whole panels */
    const size_t npanels = (size_t)stored_panels(&lay, nr, n);
    int32_t *colbuf = (int32_t *)malloc((cols * 3 + npanels) * sizeof(int32_t));
    if (!colbuf) return EA_ENOMEM;
    pl->colbuf = colbuf;
    pl->bias_eff = colbuf, pl->mult_p = colbuf + cols, pl->shift_p = colbuf + 2 * cols;
    pl->panel_bounded = colbuf + 3 * cols;
    for (size_t j = 0; j < cols; j++) {
        int64_t b = 0;
        if ((int64_t)j < n) {
            b = (bias ? bias[j] : 0) - (int64_t)a_zp * (colsum[j] + off * k) + k * (int64_t)a_zp * zb;
        }
        pl->bias_eff[j] = (int32_t)(uint32_t)(uint64_t)b; /* wraps like the int32 accumulator */
        pl->mult_p[j] = (!out_int32 && (int64_t)j < n) ? mult[j] : 0;
        pl->shift_p[j] = (!out_int32 && (int64_t)j < n) ? shift[j] : 0;
    }
    /* |x| <= |bias| + K * 255 * 255 (|a - za|, |b - zb| <= 255), x being the true sum the
     * int32 accumulator holds when it cannot wrap. The fast x86 epilogue needs 2|x| inside
     * int32 and, for h + half + zp * 2^r (|h| <= |x|, |zp| <= 128), |x| + 2^(r-1) + 128 * 2^r.
     * Per panel, so one channel with an extreme scale slows its own panel only. */
    for (size_t p = 0; p < npanels; p++) {
        int ok = !out_int32;
        for (int64_t j = (int64_t)p * nr; j < ((int64_t)p + 1) * nr && j < n && ok; j++) {
            const int64_t right = shift[j] < 0 ? -(int64_t)shift[j] : 0;
            const int64_t half = right ? INT64_C(1) << (right - 1) : 0;
            const int64_t b = bias ? (bias[j] < 0 ? -(int64_t)bias[j] : bias[j]) : 0;
            const int64_t x = b + k * INT64_C(65025), limit = INT64_C(2147483647);
            ok = 2 * x < limit && x + half + (INT64_C(128) << right) < limit;
        }
        pl->panel_bounded[p] = ok;
    }
    return EA_OK;
}

static int plan_run(const ea_gemm_plan *pl, const a_source *src, int64_t m_begin, int64_t m_end,
                    void *c, int64_t ldc) {
    if (m_end <= m_begin) return EA_OK;
    const ea_variant *v = pl->v;
    const layout *lay = &pl->lay;
    const int64_t nr = v->nr, ae = lay->a_elem, k = pl->k, kpad = pl->kpad, n = pl->n;
    const int64_t panels = pl->panels, mc = pl->mc, zb = pl->zb;
    const int kernel_rowsums = pl->kernel_rowsums, batch_rowsums = pl->batch_rowsums;
    const int row_sums = pl->row_sums;
    const size_t elem = pl->out_int32 ? 4 : 1;

    /* A 1x1 unpadded convolution reads its rows straight from the input pixels. */
    int conv_inplace = 0;
    if (src->conv) {
        const ea_conv_params *cp = src->cp;
        conv_inplace = cp->k_h == 1 && cp->k_w == 1 && cp->pad_top == 0 && cp->pad_left == 0 &&
                       (int64_t)(cp->out_h - 1) * cp->stride_h < cp->in_h &&
                       (int64_t)(cp->out_w - 1) * cp->stride_w < cp->in_w;
    }
    /* A plain A with K not a multiple of kc, for kernels that ignore A where B is K padding
     * (EA_Q_PAD_READS): each row is read in place up to kpad, the bytes past k being the next
     * row's (in the array: sm + k >= kpad); only the block's last row, whose next bytes may lie
     * past the array, is copied with a zero tail. */
    const int tail_reads = ae == 1 && kpad != k && !src->conv && src->sk == 1 && src->sm >= k &&
                           src->sm + k >= kpad && pl->kind == EA_LAYOUT_QUAD &&
                           (v->qflags & EA_Q_PAD_READS) && !kernel_rowsums &&
                           (!row_sums || batch_rowsums); /* rows[] then is the strided walk */
    /* int8 kernels can even use those rows without a copy when K needs no padding. */
    const int direct = ae == 1 && (kpad == k || tail_reads) && (src->conv ? conv_inplace : src->sk == 1);
    const void *rows_buf[EA_MAX_MC + EA_MAX_MR];
    int32_t row_add[EA_MAX_MC];
    const void **rows = rows_buf;
    unsigned char *rowbuf = direct ? NULL : (unsigned char *)malloc((size_t)(mc * kpad * ae) + 64);
    int8_t *tmp8 = (ae == 2) ? (int8_t *)malloc((size_t)kpad + 64) : NULL;
    int8_t last[64 + 64];
    int8_t *last_row = tail_reads ? (kpad <= 64 ? last : (int8_t *)malloc((size_t)kpad)) : NULL;
    if ((!direct && !rowbuf) || (ae == 2 && !tmp8) || (tail_reads && !last_row)) {
        free(rowbuf);
        free(tmp8);
        if (last_row != last) free(last_row);
        return EA_ENOMEM;
    }

    pixel px = {0, 0, 0};
    if (src->conv) px = pixel_of(src->cp, m_begin);
    /* Rows read in place at a fixed stride (a plain A, or a 1x1 stride-1 convolution whose
     * output pixel m is input pixel m): rows[] is a strided walk, no per-row pixel work. */
    int64_t direct_step = 0;
    if (direct && ae == 1 && (!row_sums || batch_rowsums)) {
        const ea_conv_params *cp = src->cp;
        if (!src->conv)
            direct_step = src->sm;
        else if (cp->stride_h == 1 && cp->stride_w == 1 && cp->out_h == cp->in_h && cp->out_w == cp->in_w)
            direct_step = cp->in_c;
    }
    if (tail_reads) {
        const int8_t *row = src->a + (m_end - 1) * src->sm;
        memcpy(last_row, row, (size_t)k);
        memset(last_row + k, 0, (size_t)(kpad - k));
    }
    for (int64_t m0 = m_begin; m0 < m_end; m0 += mc) {
        const int64_t rows_here = (m_end - m0) < mc ? (m_end - m0) : mc;
        if (direct_step) {
            const int8_t *row = src->a + m0 * direct_step;
            for (int64_t r = 0; r < rows_here; r++, row += direct_step) rows[r] = row;
            if (tail_reads && m0 + rows_here == m_end) rows[rows_here - 1] = last_row;
        }
        /* px: the pixel of the next row to build. int8 im2col rows: the whole block in one call
         * (interior pixels without per-tap checks); int16 variants widen row by row. */
        const int block_im2col = src->conv && !conv_inplace && ae == 1;
        if (block_im2col) im2col_rows(src->cp, src->a, &px, rows_here, kpad, (int8_t *)rowbuf);
        const int built = direct_step || (block_im2col && (!row_sums || batch_rowsums)); /* no per-row work left */
        if (built && !direct_step)
            for (int64_t r = 0; r < rows_here; r++) rows[r] = rowbuf + r * kpad;
        for (int64_t r = built ? rows_here : 0; r < rows_here; r++) {
            const int64_t m = m0 + r;
            /* row8: k readable int8 values of row m (in place, or gathered into scratch). */
            int8_t *scratch = ae == 1 ? (int8_t *)(rowbuf ? rowbuf + r * kpad : NULL) : tmp8;
            const int8_t *row8;
            int padded = 0; /* row8 already carries kpad values with a zero tail */
            if (block_im2col) {
                row8 = scratch;
                padded = 1;
            } else if (src->conv && !conv_inplace) {
                im2col_row(src->cp, src->a, px, kpad, scratch);
                pixel_next(src->cp, &px);
                row8 = scratch;
                padded = 1;
            } else if (src->conv) {
                row8 = conv_direct_row(src->cp, src->a, px);
                pixel_next(src->cp, &px);
            } else if (src->sk == 1) {
                row8 = src->a + m * src->sm;
            } else {
                const int8_t *row = src->a + m * src->sm;
                for (int64_t kx = 0; kx < k; kx++) scratch[kx] = row[kx * src->sk];
                memset(scratch + k, 0, (size_t)(kpad - k));
                row8 = scratch;
                padded = 1;
            }
            if (row_sums && !batch_rowsums) {
                int32_t s = 0;
                for (int64_t kx = 0; kx < k; kx++) s += row8[kx];
                row_add[r] = (int32_t)(uint32_t)(uint64_t)(-zb * s);
            }
            if (ae == 2) {
                int16_t *dst16 = (int16_t *)(rowbuf + r * kpad * 2);
                v->widen(row8, dst16, (size_t)k);
                for (int64_t kx = k; kx < kpad; kx++) dst16[kx] = 0;
                rows[r] = dst16;
            } else if (direct || padded) {
                rows[r] = row8;
            } else {
                memcpy(scratch, row8, (size_t)k);
                memset(scratch + k, 0, (size_t)(kpad - k));
                rows[r] = scratch;
            }
        }
        if (row_sums && batch_rowsums) v->rowsums(rows, (size_t)rows_here, (size_t)k, (int32_t)zb, row_add);
        for (int64_t i = rows_here; i < rows_here + EA_MAX_MR; i++) rows[i] = rows[rows_here - 1];
        for (int64_t p = 0; p < panels;) {
            const int wide = lay->gemm2 != NULL && p + 1 < panels;
            const int64_t width = wide ? lay->panels2 * nr : nr;
            const ea_gemm_ukernel kernel = wide ? lay->gemm2 : lay->gemm;
            const int64_t ncols = (n - p * nr) < width ? (n - p * nr) : width;
            const void *bp = (const unsigned char *)pl->panels_b + (size_t)(p * nr * kpad) * lay->b_elem;
            ea_epilogue ep = {pl->bias_eff + p * nr, pl->mult_p + p * nr, pl->shift_p + p * nr,
                              row_sums ? row_add : NULL, pl->out_zp, pl->act_min, pl->act_max,
                              pl->out_int32,
                              kernel_rowsums ? (int32_t)zb : 0, pl->panel_bounded[p]};
            for (int64_t q = 1; wide && q < lay->panels2; q++) ep.acc_bounded &= pl->panel_bounded[p + q];
            char *cp = (char *)c + (size_t)(m0 * ldc + p * nr) * elem;
            kernel((size_t)rows_here, (size_t)ncols, (size_t)kpad, rows, bp, &ep, cp, (size_t)ldc);
            p += wide ? lay->panels2 : 1;
        }
    }
    free(rowbuf);
    free(tmp8);
    if (last_row != last) free(last_row);
    return EA_OK;
}

static int gemm_core(const ea_variant *v, const a_source *src, int64_t m_begin, int64_t m_end,
                     int64_t n, int64_t k, int32_t a_zp, int32_t b_zp, const void *packed_b,
                     const int32_t *colsum, const int32_t *bias, const int32_t *mult,
                     const int32_t *shift, int32_t out_zp, int32_t act_min, int32_t act_max,
                     int out_int32, void *c, int64_t ldc) {
    if (m_end <= m_begin) return EA_OK;
    ea_gemm_plan pl;
    int rc = plan_init(&pl, v, n, k, a_zp, b_zp, packed_b, colsum, bias, mult, shift, out_zp,
                       act_min, act_max, out_int32);
    if (rc != EA_OK) return rc;
    rc = plan_run(&pl, src, m_begin, m_end, c, ldc);
    free(pl.colbuf);
    return rc;
}

static int valid_gemm(const ea_variant *v, const ea_gemm_params *p, const void *packed_b,
                      const int32_t *colsum, const int32_t *mult, const int32_t *shift) {
    if (!v || !p || !packed_b || !colsum) return 0;
    if (p->m < 0 || p->n <= 0 || p->k <= 0 || p->k > EA_MAX_K || p->c_stride_m < p->n) return 0;
    if (p->a_zp < -128 || p->a_zp > 127 || p->b_zp < -128 || p->b_zp > 127) return 0;
    return p->out_int32 || valid_requant(p->n, mult, shift, p->out_zp, p->act_min, p->act_max);
}

int ea_gemm(const ea_variant *v, const ea_gemm_params *p, const int8_t *a, const void *packed_b,
            const int32_t *colsum, const int32_t *bias, const int32_t *mult,
            const int32_t *shift, void *c) {
    if (!a || !c || !valid_gemm(v, p, packed_b, colsum, mult, shift)) return EA_EINVAL;
    a_source src = {0, a, p->a_stride_m, p->a_stride_k, NULL};
    return gemm_core(v, &src, 0, p->m, p->n, p->k, p->a_zp, p->b_zp, packed_b, colsum, bias, mult,
                     shift, p->out_zp, p->act_min, p->act_max, p->out_int32, c, p->c_stride_m);
}

int ea_gemm_plan_new(const ea_variant *v, const ea_gemm_params *p, const void *packed_b,
                     const int32_t *colsum, const int32_t *bias, const int32_t *mult,
                     const int32_t *shift, ea_gemm_plan **out) {
    if (!out) return EA_EINVAL;
    *out = NULL;
    if (!valid_gemm(v, p, packed_b, colsum, mult, shift)) return EA_EINVAL;
    ea_gemm_plan *pl = (ea_gemm_plan *)malloc(sizeof(*pl));
    if (!pl) return EA_ENOMEM;
    const int rc = plan_init(pl, v, p->n, p->k, p->a_zp, p->b_zp, packed_b, colsum, bias, mult,
                             shift, p->out_zp, p->act_min, p->act_max, p->out_int32);
    if (rc != EA_OK) {
        free(pl);
        return rc;
    }
    pl->m = p->m, pl->ldc = p->c_stride_m;
    *out = pl;
    return EA_OK;
}

int ea_gemm_plan_run(const ea_gemm_plan *pl, const int8_t *a, int64_t a_stride_m,
                     int64_t a_stride_k, void *c) {
    if (!pl || !a || !c) return EA_EINVAL;
    a_source src = {0, a, a_stride_m, a_stride_k, NULL};
    return plan_run(pl, &src, 0, pl->m, c, pl->ldc);
}

void ea_gemm_plan_free(ea_gemm_plan *pl) {
    if (!pl) return;
    free(pl->colbuf);
    free(pl);
}

/* ------------------------------------------------------------------ convolutions */

static int valid_conv(const ea_conv_params *p, int64_t m_begin, int64_t m_end) {
    if (!p) return 0;
    if (p->batch < 1 || p->in_h < 1 || p->in_w < 1 || p->in_c < 1 || p->out_h < 1 ||
        p->out_w < 1 || p->out_c < 1 || p->k_h < 1 || p->k_w < 1)
        return 0;
    if (p->stride_h < 1 || p->stride_w < 1 || p->dilation_h < 1 || p->dilation_w < 1 ||
        p->pad_top < 0 || p->pad_left < 0)
        return 0;
    if (p->in_zp < -128 || p->in_zp > 127) return 0;
    const int64_t total = (int64_t)p->batch * p->out_h * p->out_w;
    return m_begin >= 0 && m_begin <= m_end && m_end <= total;
}

int ea_conv2d(const ea_variant *v, const ea_conv_params *p, const int8_t *input,
              const void *packed_w, const int32_t *colsum, const int32_t *bias,
              const int32_t *mult, const int32_t *shift, int8_t *output, int64_t m_begin,
              int64_t m_end) {
    if (!v || !input || !packed_w || !colsum || !output || !valid_conv(p, m_begin, m_end))
        return EA_EINVAL;
    const int64_t k = (int64_t)p->k_h * p->k_w * p->in_c;
    if (k > EA_MAX_K || !valid_requant(p->out_c, mult, shift, p->out_zp, p->act_min, p->act_max))
        return EA_EINVAL;
    a_source src = {1, input, 0, 0, p};
    return gemm_core(v, &src, m_begin, m_end, p->out_c, k, p->in_zp, 0, packed_w, colsum, bias,
                     mult, shift, p->out_zp, p->act_min, p->act_max, 0, output, p->out_c);
}

int ea_depthwise_conv2d(const ea_variant *v, const ea_conv_params *p, const int8_t *input,
                        const int16_t *w16, const int32_t *bias, const int32_t *mult,
                        const int32_t *shift, int8_t *output, int64_t m_begin, int64_t m_end) {
    if (!v || !input || !w16 || !output || !valid_conv(p, m_begin, m_end)) return EA_EINVAL;
    const int64_t dm = p->depth_multiplier, oc = p->out_c, ic = p->in_c;
    if (dm < 1 || oc != ic * dm) return EA_EINVAL;
    if (!valid_requant(oc, mult, shift, p->out_zp, p->act_min, p->act_max)) return EA_EINVAL;
    const int64_t taps = (int64_t)p->k_h * p->k_w;
    if (taps > EA_MAX_K) return EA_EINVAL;
    if (m_begin == m_end) return EA_OK;

    /* Every call gets all taps with a valid source, so one kernel call covers whole output
     * rows (of one image) and the kernel's per-call preparation (weight quads, requantisation
     * constants) is paid once per row block instead of once per border pixel or short run.
     * Without padding (and multiplier 1) the taps read the input in place; otherwise the rows
     * this call needs are copied once into a window with in_zp borders ((zp - zp) * w = 0
     * exactly) and, for dm > 1, each input channel repeated dm times (multiplier 1 lanes). */
    const int64_t sh = p->stride_h, sw = p->stride_w, dh = p->dilation_h, dw = p->dilation_w;
    const int64_t span_h = (int64_t)(p->k_h - 1) * dh, span_w = (int64_t)(p->k_w - 1) * dw;
    const int64_t win_w = (p->out_w - 1) * sw + span_w + 1; /* input columns -pad_left.. */
    const int64_t win_h = (p->out_h - 1) * sh + span_h + 1;
    const int direct = dm == 1 && p->pad_left == 0 && p->pad_top == 0 && win_w <= p->in_w &&
                       win_h <= p->in_h;
    const int8_t **xp = (const int8_t **)malloc((size_t)taps * sizeof(*xp));
    const int16_t **wp = (const int16_t **)malloc((size_t)taps * sizeof(*wp));
    int32_t *zeros = bias ? NULL : (int32_t *)calloc((size_t)oc, sizeof(int32_t));
    int8_t *win = direct ? NULL : (int8_t *)malloc((size_t)(win_h * win_w * oc));
    void *cache = malloc(EA_DW_CACHE_BYTES(oc)); /* the kernel's per-block preparation */
    int rc = EA_OK;
    if (!xp || !wp || (!bias && !zeros) || (!direct && !win) || !cache) {
        rc = EA_ENOMEM;
        goto done;
    }
    memset(cache, 0, EA_DW_CACHE_TAGS(oc));
    for (int32_t ky = 0; ky < p->k_h; ky++)
        for (int32_t kx = 0; kx < p->k_w; kx++)
            wp[ky * p->k_w + kx] = w16 + ((int64_t)ky * p->k_w + kx) * oc;
    const ea_epilogue ep = {bias ? bias : zeros, mult, shift, NULL, p->out_zp, p->act_min,
                            p->act_max, 0};
    const int64_t ohw = (int64_t)p->out_h * p->out_w;
    const int64_t rs = (direct ? p->in_w : win_w) * oc; /* bytes per source row */
    const size_t ors = (size_t)(p->out_w * oc);
    for (int64_t m = m_begin; m < m_end;) {
        const int64_t nb = m / ohw, img_end = (nb + 1) * ohw < m_end ? (nb + 1) * ohw : m_end;
        const int64_t oy_a = (m % ohw) / p->out_w, oy_b = (img_end - 1 - nb * ohw) / p->out_w;
        const int8_t *base; /* source row of output row oy_a's first tap row */
        if (direct) {
            base = input + (nb * p->in_h + oy_a * sh) * rs;
        } else {
            const int64_t iy0 = oy_a * sh - p->pad_top, rows = (oy_b - oy_a) * sh + span_h + 1;
            const int64_t lpad = p->pad_left < win_w ? p->pad_left : win_w;
            const int64_t mid = p->in_w < win_w - lpad ? p->in_w : win_w - lpad; /* 0..in_w-1 */
            for (int64_t r = 0; r < rows; r++) {
                int8_t *d = win + r * rs;
                const int64_t iy = iy0 + r;
                if (iy < 0 || iy >= p->in_h) {
                    memset(d, p->in_zp, (size_t)rs);
                    continue;
                }
                const int8_t *s = input + (nb * p->in_h + iy) * p->in_w * ic;
                memset(d, p->in_zp, (size_t)(lpad * oc));
                if (dm == 1) {
                    memcpy(d + lpad * oc, s, (size_t)(mid * oc));
                } else {
                    for (int64_t i = 0; i < mid; i++)
                        for (int64_t ch = 0; ch < ic; ch++)
                            memset(d + (lpad + i) * oc + ch * dm, s[i * ic + ch], (size_t)dm);
                }
                memset(d + (lpad + mid) * oc, p->in_zp, (size_t)((win_w - lpad - mid) * oc));
            }
            base = win;
        }
        /* output rows oy_a..oy_b of image nb: a partial first row, whole rows, a partial last */
        while (m < img_end) {
            const int64_t oy = (m % ohw) / p->out_w, ox = m % p->out_w;
            const int64_t row_end = m - ox + p->out_w;
            int64_t nrows = 1, npix = (row_end < img_end ? row_end : img_end) - m;
            if (ox == 0 && npix == p->out_w) {
                nrows = (img_end - m) / p->out_w;
                npix = p->out_w;
            }
            for (int32_t ky = 0; ky < p->k_h; ky++)
                for (int32_t kx = 0; kx < p->k_w; kx++)
                    xp[ky * p->k_w + kx] =
                        base + ((oy - oy_a) * sh + ky * dh) * rs + (ox * sw + kx * dw) * oc;
            v->dw((size_t)oc, (size_t)nrows, (size_t)npix, (size_t)taps, xp, (size_t)(sw * oc),
                  (size_t)(sh * rs), wp, p->in_zp, &ep, output + m * oc, (size_t)oc, ors, cache);
            m += nrows * npix;
        }
    }
done:
    free(xp);
    free(wp);
    free(zeros);
    free(win);
    free(cache);
    return rc;
}

int ea_add(const ea_variant *v, int64_t n, const int8_t *x1, const int8_t *x2,
           const ea_add_params *p, int8_t *out) {
    if (!v || !p || n < 0 || (n > 0 && (!x1 || !x2 || !out))) return EA_EINVAL;
    const int32_t zps[3] = {p->zp1, p->zp2, p->out_zp};
    for (int i = 0; i < 3; i++)
        if (zps[i] < -128 || zps[i] > 127) return EA_EINVAL;
    /* MultiplyByQuantizedMultiplierSmallerThanOneExp: right shifts only, multipliers >= 0. */
    const int32_t shifts[3] = {p->shift1, p->shift2, p->out_shift};
    const int32_t mults[3] = {p->mult1, p->mult2, p->out_mult};
    for (int i = 0; i < 3; i++)
        if (shifts[i] > 0 || shifts[i] < -31 || mults[i] < 0) return EA_EINVAL;
    if (p->act_min < -128 || p->act_max > 127 || p->act_min > p->act_max) return EA_EINVAL;
    v->add((size_t)n, x1, x2, p, out);
    return EA_OK;
}

int ea_mean_hw(int64_t batch, int64_t hw, int64_t c, const int8_t *in, int32_t in_zp,
               int32_t mult, int32_t shift, int32_t out_zp, int8_t *out) {
    if (batch < 0 || hw < 1 || c < 1 || (batch > 0 && (!in || !out))) return EA_EINVAL;
    if (in_zp < -128 || in_zp > 127 || out_zp < -128 || out_zp > 127) return EA_EINVAL;
    if (shift < -31 || shift > 30 || mult < 0) return EA_EINVAL;
    uint32_t *acc = (uint32_t *)malloc((size_t)c * sizeof(uint32_t));
    if (!acc) return EA_ENOMEM;
    for (int64_t b = 0; b < batch; b++) {
        const int8_t *x = in + b * hw * c;
        for (int64_t ch = 0; ch < c; ch++) acc[ch] = 0;
        /* pixels outer, channels inner: contiguous, so the compiler vectorises the sums;
         * uint32 arithmetic wraps like TFLite's int32 accumulator instead of being UB */
        for (int64_t i = 0; i < hw; i++)
            for (int64_t ch = 0; ch < c; ch++) acc[ch] += (uint32_t)((int32_t)x[i * c + ch] - in_zp);
        for (int64_t ch = 0; ch < c; ch++) {
            const int32_t v = ea_mbqm((int32_t)acc[ch], mult, shift) + out_zp;
            out[b * c + ch] = (int8_t)(v < -128 ? -128 : v > 127 ? 127 : v);
        }
    }
    free(acc);
    return EA_OK;
}

/* QUANTIZE of n contiguous floats: q = clamp(round(x / scale) + zp) with round half away from
 * zero, NaN -> -128 (quant_math.quantize). Branch-free and without libm (the static test
 * binaries link no -lm) so that compilers vectorise it: the scalar form with a branch on the
 * dropped fraction mispredicted half the time and cost ~19 ms per batch of 32 96x96 RGB images,
 * half the native engine's time on a MobileNetV2 0.35 (now ~3.3 ms; the selects vectorise
 * because the library is built with -fno-trapping-math). |v| <= 2^24 (clamped first: beyond it
 * float32 holds only integers) keeps the int32 casts and the subtraction exact. */
#if defined(__aarch64__)
#include <arm_neon.h>
/* AArch64 (NEON is baseline there): GCC 12 leaves quantize_run's loop scalar ("control flow
 * in loop"), so 8 values at a time by hand. FCVTAS (vcvtaq_s32_f32) rounds to nearest with
 * ties away from zero, the rounding wanted, exactly for |v| <= 2^24; the two saturating
 * narrows are the clamp to [-128, 127]; NaN becomes the low bound, hence -128. The same
 * division as the scalar loop, so the same results. */
static inline int16x4_t quantize4_neon(const float *src, float32x4_t scale, int32x4_t zp) {
    const float32x4_t lo = vdupq_n_f32(-16777216.0f), hi = vdupq_n_f32(16777216.0f);
    float32x4_t v = vdivq_f32(vld1q_f32(src), scale);
    v = vminq_f32(vmaxq_f32(vbslq_f32(vceqq_f32(v, v), v, lo), lo), hi);
    return vqmovn_s32(vaddq_s32(vcvtaq_s32_f32(v), zp));
}

/* Whole groups of 8; returns how many values it did (the scalar loop takes the rest). */
static int64_t quantize_neon(const float *src, int64_t n, float scale, int32_t zp, int8_t *dst) {
    const float32x4_t s = vdupq_n_f32(scale);
    const int32x4_t z = vdupq_n_s32(zp);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        vst1_s8(dst + i, vqmovn_s16(vcombine_s16(quantize4_neon(src + i, s, z), quantize4_neon(src + i + 4, s, z))));
    return i;
}
#endif

static void quantize_run(const float *src, int64_t n, float scale, int32_t zp, int8_t *dst) {
    int64_t i = 0;
#if defined(__aarch64__)
    i = quantize_neon(src, n, scale, zp, dst);
#endif
    for (; i < n; i++) {
        float v = src[i] / scale;
        const int nan = v != v;
        v = nan ? 0.0f : v;
        v = v > 16777216.0f ? 16777216.0f : v;
        v = v < -16777216.0f ? -16777216.0f : v;
        const float a = v < 0 ? -v : v;
        float r = (float)(int32_t)a;
        r = a - r >= 0.5f ? r + 1.0f : r;
        int32_t q = (int32_t)(v < 0 ? -r : r) + zp;
        q = q < -128 ? -128 : q > 127 ? 127 : q;
        dst[i] = (int8_t)(nan ? -128 : q);
    }
}

#define EA_QUANT_BLOCK 4096 /* pixels of one channel quantised before they are interleaved */

int ea_quantize_nchw(int64_t batch, int64_t c, int64_t hw, const float *x, float scale,
                     int32_t zp, int8_t *out) {
    if (batch < 0 || c < 1 || hw < 1 || (batch > 0 && (!x || !out))) return EA_EINVAL;
    if (!(scale > 0) || zp < -128 || zp > 127) return EA_EINVAL;
    if (c == 1 || hw == 1) { /* NCHW and NHWC are the same bytes */
        quantize_run(x, batch * c * hw, scale, zp, out);
        return EA_OK;
    }
    int8_t tmp[EA_QUANT_BLOCK];
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t ch = 0; ch < c; ch++) {
            for (int64_t i0 = 0; i0 < hw; i0 += EA_QUANT_BLOCK) {
                const int64_t len = hw - i0 < EA_QUANT_BLOCK ? hw - i0 : EA_QUANT_BLOCK;
                quantize_run(x + (b * c + ch) * hw + i0, len, scale, zp, tmp);
                int8_t *dst = out + (b * hw + i0) * c + ch;
                for (int64_t i = 0; i < len; i++) dst[i * c] = tmp[i];
            }
        }
    }
    return EA_OK;
}

int ea_requantize(const ea_variant *v, int64_t n, const int32_t *acc, const int32_t *mult,
                  const int32_t *shift, int32_t out_zp, int32_t act_min, int32_t act_max,
                  int8_t *out) {
    if (!v || !acc || !out || n < 0 || !valid_requant(n, mult, shift, out_zp, act_min, act_max))
        return EA_EINVAL;
    const ea_epilogue ep = {NULL, mult, shift, NULL, out_zp, act_min, act_max, 0};
    v->requant((size_t)n, acc, &ep, out);
    return EA_OK;
}
