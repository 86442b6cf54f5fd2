/* edge-agent native int8 kernels: the public C API (loaded from Python with ctypes).
 *
 * Semantics are TFLite's int8 integer rules (tflite-runtime 2.14, double rounding):
 *   acc[m][n] = sum_k (A[m][k] - a_zp) * (B[n][k] - b_zp) + bias[n]          (int32)
 *   out[m][n] = clamp(MultiplyByQuantizedMultiplier(acc, mult[n], shift[n]) + out_zp,
 *                     act_min, act_max)                                         (int8)
 * B is always given as [N][K] (weights OHWI / FC [out][in]); any strides are allowed, so
 * A.B, A^T.B and A.B^T are all the same call with different strides.
 *
 * Every kernel exists once per CPU variant (portable C, AVX2, AVX-VNNI, AVX512-VNNI,
 * NEON, NEON+SDOT); the caller picks a variant handle and passes it to every call.
 * Functions return 0 on success and a negative EA_E* code on bad arguments / no memory.
 */
#ifndef EA_KERNELS_H
#define EA_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EA_ABI_VERSION 7

#define EA_OK 0
#define EA_EINVAL (-1) /* bad argument (sizes, strides, shift out of range, NULL) */
#define EA_ENOMEM (-2)

#if defined(_WIN32)
#define EA_API __declspec(dllexport)
#else
#define EA_API __attribute__((visibility("default")))
#endif

typedef struct ea_variant ea_variant;

/* Geometry of CONV_2D / DEPTHWISE_CONV_2D on NHWC int8 tensors. */
typedef struct ea_conv_params {
    int32_t batch, in_h, in_w, in_c;
    int32_t out_h, out_w, out_c;
    int32_t k_h, k_w, stride_h, stride_w, dilation_h, dilation_w;
    int32_t pad_top, pad_left;   /* leading padding; trailing padding is implied by out_h/out_w */
    int32_t depth_multiplier;    /* depthwise only: out_c == in_c * depth_multiplier */
    int32_t in_zp, out_zp, act_min, act_max;
} ea_conv_params;

/* A GEMM: C[M][N] = requant((A - a_zp) . (B - b_zp)^T + bias). */
typedef struct ea_gemm_params {
    int64_t m, n, k;
    int64_t a_stride_m, a_stride_k; /* in elements; A[m][k] = a[m * a_stride_m + k * a_stride_k] */
    int64_t c_stride_m;             /* in elements; C columns are contiguous */
    int32_t a_zp, b_zp;
    int32_t out_zp, act_min, act_max;
    int32_t out_int32;              /* 1: C is int32 = acc + bias (no requantisation) */
} ea_gemm_params;

EA_API int ea_abi_version(void);
/* How the library was built: compiler and the variants the compiler refused. */
EA_API const char *ea_build_info(void);
EA_API int ea_variant_count(void);
EA_API const ea_variant *ea_variant_at(int index);
EA_API const char *ea_variant_name(const ea_variant *v);
/* CPU features the variant needs, as Linux /proc/cpuinfo spells them, space separated. */
EA_API const char *ea_variant_features(const ea_variant *v);
/* 1 if this process's CPU can execute the variant (cpuid / hwcaps), else 0. */
EA_API int ea_variant_runnable(const ea_variant *v);
/* Micro-tile geometry, for reports: rows, columns, K chunk. */
EA_API void ea_variant_geometry(const ea_variant *v, int32_t out[3]);

/* Weights [N][K] (strided, int8) -> the variant's packed panels + per-row sums of B
 * (colsum[n] = sum_k B[n][k]). Packed size in bytes from ea_packed_b_size. */
EA_API size_t ea_packed_b_size(const ea_variant *v, int64_t n, int64_t k);
EA_API int ea_pack_b(const ea_variant *v, int64_t n, int64_t k, const int8_t *b, int64_t stride_n,
                     int64_t stride_k, void *packed, int32_t *colsum);

/* GEMM with packed B. bias may be NULL; mult/shift unused when out_int32. */
EA_API int ea_gemm(const ea_variant *v, const ea_gemm_params *p, const int8_t *a, const void *packed_b,
                   const int32_t *colsum, const int32_t *bias, const int32_t *mult,
                   const int32_t *shift, void *c);

/* A GEMM prepared once per packed B (validation, per-column epilogue constants), then run on
 * A matrices of p->m rows: what a caller repeating one GEMM pays per call is the work. The
 * plan is read-only while it runs (several threads may run one plan); p's strides of A are
 * ignored (ea_gemm_plan_run takes them), everything it points to must outlive the plan. */
typedef struct ea_gemm_plan ea_gemm_plan;
EA_API int ea_gemm_plan_new(const ea_variant *v, const ea_gemm_params *p, const void *packed_b,
                            const int32_t *colsum, const int32_t *bias, const int32_t *mult,
                            const int32_t *shift, ea_gemm_plan **out);
EA_API int ea_gemm_plan_run(const ea_gemm_plan *plan, const int8_t *a, int64_t a_stride_m,
                            int64_t a_stride_k, void *c);
EA_API void ea_gemm_plan_free(ea_gemm_plan *plan);

/* CONV_2D over output rows [m_begin, m_end) of the flattened (batch, out_h, out_w) grid,
 * so callers can split one convolution across threads. packed_w is ea_pack_b of the OHWI
 * filter viewed as [out_c][k_h * k_w * in_c]. */
EA_API int ea_conv2d(const ea_variant *v, const ea_conv_params *p, const int8_t *input,
                     const void *packed_w, const int32_t *colsum, const int32_t *bias,
                     const int32_t *mult, const int32_t *shift, int8_t *output, int64_t m_begin,
                     int64_t m_end);

/* DEPTHWISE_CONV_2D (direct, any kernel size / stride / dilation / depth multiplier).
 * w16 is the 1HWC filter as int16 [k_h * k_w][out_c]. */
EA_API int ea_depthwise_conv2d(const ea_variant *v, const ea_conv_params *p, const int8_t *input,
                               const int16_t *w16, const int32_t *bias, const int32_t *mult,
                               const int32_t *shift, int8_t *output, int64_t m_begin,
                               int64_t m_end);

/* ADD of two int8 tensors of the same shape (TFLite's int8 AddElementwise, left_shift 20):
 *   v_i = MBQM((x_i - zp_i) << 20, mult_i, shift_i);  out = clamp(MBQM(v_1 + v_2, out_mult,
 *   out_shift) + out_zp, act_min, act_max); all three shifts <= 0 (multipliers < 1). */
typedef struct ea_add_params {
    int32_t zp1, mult1, shift1, zp2, mult2, shift2;
    int32_t out_mult, out_shift, out_zp, act_min, act_max;
} ea_add_params;

EA_API int ea_add(const ea_variant *v, int64_t n, const int8_t *x1, const int8_t *x2,
                  const ea_add_params *p, int8_t *out);

/* MEAN over H and W of an NHWC int8 tensor (TFLite 2.14's QuantizedMeanOrSum):
 * out = clamp(MBQM(sum over the hw pixels of (x - in_zp), mult, shift) + out_zp, -128, 127)
 * where mult/shift already include the division by hw (m' = (m << k) / hw, s' = s - k).
 * in is [batch][hw][c], out is [batch][c]. */
EA_API int ea_mean_hw(int64_t batch, int64_t hw, int64_t c, const int8_t *in, int32_t in_zp,
                      int32_t mult, int32_t shift, int32_t out_zp, int8_t *out);

/* QUANTIZE float32 -> int8 fused with NCHW -> NHWC (the model's input edge):
 * out[b][p][ch] = clamp(round_half_away(x[b][ch][p] / scale) + zp, -128, 127), the division
 * in float32 as TFLite's AffineQuantize does; NaN becomes -128 (what numpy gives on x86).
 * hw = 1 keeps a 2-D [batch][c] layout. */
EA_API int ea_quantize_nchw(int64_t batch, int64_t c, int64_t hw, const float *x, float scale,
                            int32_t zp, int8_t *out);

/* Elementwise requantisation with per-element multiplier/shift (the epilogue on its own). */
EA_API int ea_requantize(const ea_variant *v, int64_t n, const int32_t *acc, const int32_t *mult,
                         const int32_t *shift, int32_t out_zp, int32_t act_min, int32_t act_max,
                         int8_t *out);

/* ---- whole-graph execution (graph.c) ----------------------------------------------------
 * A run of int8 ops executed in one call, each op's rows split across a small thread pool of
 * the library's own (`threads` includes the caller). Tensors live in caller-owned buffers
 * named by slot index: slots[i] is a pointer the caller sets before each run (the input and
 * output of the batch change, the intermediate buffers are reused). Ops run in order with a
 * barrier between them; the first failing op stops the run and its error code is returned.
 * Weights and requantisation arrays are read in place, so they must outlive the run. */
#define EA_OP_CONV 1      /* conv params, w = packed filter, colsum, bias, mult, shift */
#define EA_OP_DEPTHWISE 2 /* conv params, w = int16 taps, bias, mult, shift */
#define EA_OP_GEMM 3      /* gemm params (m rows of in0, c_stride_m = n), w = packed B, ... */
#define EA_OP_ADD 4       /* add params, n[0] elements of in0 + in1 */
#define EA_OP_MEAN 5      /* n = batch, hw, c; q = in_zp, mult, shift, out_zp */
#define EA_OP_QUANTIZE 6  /* float32 NCHW in0 -> int8 NHWC; n = batch, c, hw; q[0] = zp; scale */
#define EA_OP_COPY 7      /* n[0] bytes (RESHAPE) */

typedef struct ea_op {
    int32_t kind;
    int32_t in0, in1, out; /* slot indices (in1: ADD only) */
    ea_conv_params conv;
    ea_gemm_params gemm;
    ea_add_params add;
    int64_t n[3];
    int32_t q[4];
    float scale;
    const void *w;
    const int32_t *colsum, *bias, *mult, *shift;
} ea_op;

EA_API int ea_run_ops(const ea_variant *v, const ea_op *ops, int32_t n_ops, void *const *slots,
                      int32_t threads);
/* Worker threads the pool holds (started on first use, kept for the process's life). */
EA_API int ea_pool_size(void);
/* sizeof(ea_op), so a binding can check its mirror of the struct. */
EA_API int ea_op_size(void);

/* ---- float32 kernels (float_depthwise.c) ----------------------------------------------------
 * DEPTHWISE convolution of NHWC float32 tensors (the numpy tail trainer, the float prefix's
 * passes): p's geometry fields only (in_c == out_c, depth_multiplier 1; zero points unused;
 * padding before from pad_top/pad_left, after implied by out_h/out_w); the filter is
 * tap-major [k_h * k_w][c]; no bias. The backward pass writes gx [batch][in_h][in_w][c] and/or
 * gw_taps [k_h * k_w][c] (either may be NULL, not both), overwriting them. */
EA_API int ea_f32_depthwise_fwd(const ea_conv_params *p, const float *x, const float *w_taps, float *out);
EA_API int ea_f32_depthwise_bwd(const ea_conv_params *p, const float *x, const float *w_taps, const float *g,
                                float *gx, float *gw_taps);

#ifdef __cplusplus
}
#endif
#endif
