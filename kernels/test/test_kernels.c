/* Agreement test for every compiled variant, runnable natively or under qemu-user.
 *
 * Usage: test_kernels CASES_FILE
 * The file (written by tests/unit/test_kernels_cross.py from the numpy reference) holds
 *   "EAKT" u32 count, then per case: u32 kind, u32 nparams, i64 params[nparams],
 *   u32 narrays, then per array: u64 nbytes, bytes. The last array is the expected output.
 * Kinds: 1 GEMM, 2 CONV_2D, 3 DEPTHWISE_CONV_2D, 4 requantise, 5 ADD, 6 MEAN over H, W,
 * 7 QUANTIZE float32 NCHW -> int8 NHWC.
 * Every runnable variant runs every case; convolutions are split into two row ranges to
 * exercise the threading entry points, and run again as a one-op graph through ea_run_ops
 * on 3 threads (the library's pool), as are ADDs on 2: the pool's hand-off is checked on
 * every target, qemu's emulated ones included. Prints one line per variant; exit 0 iff all
 * agree.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../ea_kernels.h"

typedef struct {
    uint64_t n;
    unsigned char *p;
} blob;

typedef struct {
    uint32_t kind, nparams, narrays;
    int64_t params[32];
    blob arrays[8];
} tcase;

static int read_exact(FILE *f, void *dst, size_t n) { return fread(dst, 1, n, f) == n; }

static int read_case(FILE *f, tcase *c) {
    memset(c, 0, sizeof(*c));
    if (!read_exact(f, &c->kind, 4) || !read_exact(f, &c->nparams, 4) || c->nparams > 32) return 0;
    if (!read_exact(f, c->params, 8 * (size_t)c->nparams)) return 0;
    if (!read_exact(f, &c->narrays, 4) || c->narrays > 8 || c->narrays < 1) return 0;
    for (uint32_t i = 0; i < c->narrays; i++) {
        if (!read_exact(f, &c->arrays[i].n, 8) || c->arrays[i].n > (1u << 28)) return 0;
        c->arrays[i].p = (unsigned char *)malloc(c->arrays[i].n ? c->arrays[i].n : 1); /* exact: ASan sees over-reads */
        if (!c->arrays[i].p || !read_exact(f, c->arrays[i].p, c->arrays[i].n)) return 0;
    }
    return 1;
}

static void free_case(tcase *c) {
    for (uint32_t i = 0; i < c->narrays; i++) free(c->arrays[i].p);
}

static const int32_t *opt_i32(const blob *b) { return b->n ? (const int32_t *)b->p : NULL; }

static void conv_from(const int64_t *q, ea_conv_params *p) {
    int32_t *f = (int32_t *)p;
    for (int i = 0; i < (int)(sizeof(*p) / sizeof(int32_t)); i++) f[i] = (int32_t)q[i];
}

/* op as a one-op graph on `threads` threads: slot 0 input, 1 output, 2 second input. */
static int run_graph1(const ea_variant *v, ea_op *op, const void *in0, const void *in1, void *out,
                      int threads) {
    void *slots[3] = {(void *)in0, out, (void *)in1};
    op->in0 = 0, op->out = 1, op->in1 = 2;
    return ea_run_ops(v, op, 1, slots, threads);
}

/* Runs one case on one variant; returns 1 if the output equals the expected bytes. */
static int run_case(const ea_variant *v, const tcase *c, int index) {
    const blob *exp = &c->arrays[c->narrays - 1];
    unsigned char *out = (unsigned char *)calloc(exp->n ? exp->n : 1, 1);
    unsigned char *out2 = NULL; /* the same op through ea_run_ops, where the case has one */
    ea_op op;
    memset(&op, 0, sizeof(op));
    int rc = -100;
    if (c->kind == 1) {
        const int64_t *q = c->params;
        ea_gemm_params g = {q[0], q[1], q[2], q[3], q[4], q[1], (int32_t)q[5], (int32_t)q[6],
                            (int32_t)q[7], (int32_t)q[8], (int32_t)q[9], (int32_t)q[10]};
        size_t sz = ea_packed_b_size(v, g.n, g.k);
        void *packed = malloc(sz);
        int32_t *colsum = (int32_t *)malloc((size_t)g.n * 4);
        rc = ea_pack_b(v, g.n, g.k, (const int8_t *)c->arrays[1].p, q[11], q[12], packed, colsum);
        if (rc == 0)
            rc = ea_gemm(v, &g, (const int8_t *)c->arrays[0].p, packed, colsum,
                         opt_i32(&c->arrays[2]), opt_i32(&c->arrays[3]), opt_i32(&c->arrays[4]),
                         out);
        free(packed);
        free(colsum);
    } else if (c->kind == 2 || c->kind == 3) {
        ea_conv_params p;
        conv_from(c->params, &p);
        const int64_t total = (int64_t)p.batch * p.out_h * p.out_w, half = total / 2;
        const int32_t *bias = opt_i32(&c->arrays[2]);
        const int32_t *mult = opt_i32(&c->arrays[3]), *shift = opt_i32(&c->arrays[4]);
        if (c->kind == 2) {
            const int64_t k = (int64_t)p.k_h * p.k_w * p.in_c;
            void *packed = malloc(ea_packed_b_size(v, p.out_c, k));
            int32_t *colsum = (int32_t *)malloc((size_t)p.out_c * 4);
            rc = ea_pack_b(v, p.out_c, k, (const int8_t *)c->arrays[1].p, k, 1, packed, colsum);
            if (rc == 0)
                rc = ea_conv2d(v, &p, (const int8_t *)c->arrays[0].p, packed, colsum, bias, mult,
                               shift, (int8_t *)out, 0, half);
            if (rc == 0)
                rc = ea_conv2d(v, &p, (const int8_t *)c->arrays[0].p, packed, colsum, bias, mult,
                               shift, (int8_t *)out, half, total);
            if (rc == 0) {
                op.kind = EA_OP_CONV, op.conv = p, op.w = packed, op.colsum = colsum;
                op.bias = bias, op.mult = mult, op.shift = shift;
                out2 = (unsigned char *)calloc(exp->n ? exp->n : 1, 1);
                rc = run_graph1(v, &op, c->arrays[0].p, NULL, out2, 3);
            }
            free(packed);
            free(colsum);
        } else {
            const size_t nw = c->arrays[1].n;
            int16_t *w16 = (int16_t *)malloc(nw * 2);
            for (size_t i = 0; i < nw; i++) w16[i] = ((const int8_t *)c->arrays[1].p)[i];
            rc = ea_depthwise_conv2d(v, &p, (const int8_t *)c->arrays[0].p, w16, bias, mult,
                                     shift, (int8_t *)out, 0, half);
            if (rc == 0)
                rc = ea_depthwise_conv2d(v, &p, (const int8_t *)c->arrays[0].p, w16, bias, mult,
                                         shift, (int8_t *)out, half, total);
            if (rc == 0) {
                op.kind = EA_OP_DEPTHWISE, op.conv = p, op.w = w16;
                op.bias = bias, op.mult = mult, op.shift = shift;
                out2 = (unsigned char *)calloc(exp->n ? exp->n : 1, 1);
                rc = run_graph1(v, &op, c->arrays[0].p, NULL, out2, 3);
            }
            free(w16);
        }
    } else if (c->kind == 4) {
        const int64_t *q = c->params;
        rc = ea_requantize(v, q[0], (const int32_t *)c->arrays[0].p, opt_i32(&c->arrays[1]),
                           opt_i32(&c->arrays[2]), (int32_t)q[1], (int32_t)q[2], (int32_t)q[3],
                           (int8_t *)out);
    } else if (c->kind == 5) {
        const int64_t *q = c->params;
        ea_add_params p = {(int32_t)q[1], (int32_t)q[2], (int32_t)q[3], (int32_t)q[4],
                           (int32_t)q[5], (int32_t)q[6], (int32_t)q[7], (int32_t)q[8],
                           (int32_t)q[9], (int32_t)q[10], (int32_t)q[11]};
        rc = ea_add(v, q[0], (const int8_t *)c->arrays[0].p, (const int8_t *)c->arrays[1].p, &p,
                    (int8_t *)out);
        if (rc == 0) {
            op.kind = EA_OP_ADD, op.add = p, op.n[0] = q[0];
            out2 = (unsigned char *)calloc(exp->n ? exp->n : 1, 1);
            rc = run_graph1(v, &op, c->arrays[0].p, c->arrays[1].p, out2, 2);
        }
    } else if (c->kind == 6) {
        const int64_t *q = c->params;
        rc = ea_mean_hw(q[0], q[1], q[2], (const int8_t *)c->arrays[0].p, (int32_t)q[3],
                        (int32_t)q[4], (int32_t)q[5], (int32_t)q[6], (int8_t *)out);
    } else if (c->kind == 7) {
        const int64_t *q = c->params;
        float scale;
        memcpy(&scale, c->arrays[1].p, sizeof(float));
        rc = ea_quantize_nchw(q[0], q[1], q[2], (const float *)c->arrays[0].p, scale, (int32_t)q[3],
                              (int8_t *)out);
    }
    int ok = rc == 0 && memcmp(out, exp->p, exp->n) == 0 && (!out2 || memcmp(out2, exp->p, exp->n) == 0);
    if (!ok) {
        size_t at = 0;
        while (rc == 0 && at < exp->n && out[at] == exp->p[at]) at++;
        printf("FAIL variant=%s case=%d kind=%u rc=%d first_diff_byte=%zu\n", ea_variant_name(v),
               index, c->kind, rc, at);
    }
    free(out);
    free(out2);
    return ok;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s CASES_FILE\n", argv[0]);
        return 2;
    }
    if (ea_abi_version() != EA_ABI_VERSION) return 2;
    FILE *f = fopen(argv[1], "rb");
    char magic[4];
    uint32_t count = 0;
    if (!f || !read_exact(f, magic, 4) || memcmp(magic, "EAKT", 4) || !read_exact(f, &count, 4)) {
        fprintf(stderr, "cannot read %s\n", argv[1]);
        return 2;
    }
    tcase *cases = (tcase *)calloc(count, sizeof(tcase));
    for (uint32_t i = 0; i < count; i++) {
        if (!read_case(f, &cases[i])) {
            fprintf(stderr, "truncated case %u\n", i);
            return 2;
        }
    }
    fclose(f);
    int failures = 0;
    for (int vi = 0; vi < ea_variant_count(); vi++) {
        const ea_variant *v = ea_variant_at(vi);
        if (!ea_variant_runnable(v)) {
            printf("variant %s skipped (CPU lacks: %s)\n", ea_variant_name(v), ea_variant_features(v));
            continue;
        }
        int32_t geo[3];
        ea_variant_geometry(v, geo); /* K step 8 on neon_dot: the SMMLA (i8mm) kernels run */
        printf("geometry %s %d %d %d\n", ea_variant_name(v), geo[0], geo[1], geo[2]);
        int bad = 0;
        for (uint32_t i = 0; i < count; i++) bad += !run_case(v, &cases[i], (int)i);
        printf("variant %s cases %u failures %d\n", ea_variant_name(v), count, bad);
        failures += bad;
    }
    for (uint32_t i = 0; i < count; i++) free_case(&cases[i]);
    free(cases);
    return failures ? 1 : 0;
}
