/* AVX512-VNNI depthwise: 64 byte lanes per vector, four taps per vpdpbusd.
 *
 * Taps are taken four at a time: the four int8 tap vectors are interleaved (vpunpck{l,h}bw,
 * then {l,h}wd) into quads (x_t0, x_t1, x_t2, x_t3) per channel, flipped to u8 (x + 128),
 * and one vpdpbusd against the call's weight quads (s8, interleaved the same way once per
 * call and channel block) adds four products per int32 lane: 9 taps are 3 quads, 12
 * vpdpbusd per 64 channels. Exact: sum (x - zp) w = sum (x + 128) w - (zp + 128) sum w, and
 * the second term is a per-call constant folded into the bias, so no per-tap subtraction.
 * The in-lane interleave leaves quad vector k holding channels 16L + 4k + i (128-bit lane L,
 * dword i); the bias and requantisation constants are permuted into that order once, and
 * vpackssdw / vpacksswb undo it for free: packing q0..q3 gives channels in natural order.
 *
 * Small channel counts waste no lanes: a vector holds P = 64 / W pixels of W (16, 32 or 64)
 * channels, loaded and stored with per-pixel byte masks (masked-off bytes never fault).
 *
 * Requantisation in 64-bit lanes, bit-exact with ea_requant1: with a = x*m (|a| < 2^62),
 * SRDHM is h = floor((a + 2^30) / 2^31) and RoundingDivideByPOT(h, e) is
 * floor((h + 2^(e-1) - [h < 0]) / 2^e) for e >= 1 (h itself for e = 0); nested floors by
 * powers of two merge, so the result is (a + 2^30 + C + zp * 2^(31+e)) >> (31 + e) with
 * C = 2^(30+e) - 2^31 * [a < -2^30] (0 for e = 0), and the output zero point comes free.
 * This needs e <= 23 to stay within int64 (always so in practice); other blocks, weights
 * outside int8 and taps beyond DW5_MAXT go to the 256-bit x86_dw. */
#ifndef EA_X86_DW512_H
#define EA_X86_DW512_H

#define DW5_MAXT 64 /* taps held as weight quads on the stack (8x8 kernels) */
#define DW5_MAXE 23

typedef struct {
    __m512i init[4];          /* bias - (in_zp + 128) * sum_t w, quad order */
    __m512i me[4], mo[4];     /* multiplier of even / odd lanes, in each qword's low dword */
    __m512i ke[4], ko[4];     /* 2^30 + rounding + out_zp << s (int64) */
    __m512i de[4], dd[4];     /* 2^31 where e >= 1: negatives round half away from zero */
    __m512i se[4], so[4];     /* s = 31 + e (int64) */
    __m512i left[4];
    int any_left;
} dw5_rq;

/* Four vectors of 16 int32 (positions 16j..16j+15) -> quad order (a 4x4 transpose of
 * 128-bit chunks: vector k takes chunk k of each). */
static inline void dw5_perm(__m512i b[4]) {
    const __m512i t0 = _mm512_shuffle_i32x4(b[0], b[1], 0x44), t1 = _mm512_shuffle_i32x4(b[0], b[1], 0xEE);
    const __m512i t2 = _mm512_shuffle_i32x4(b[2], b[3], 0x44), t3 = _mm512_shuffle_i32x4(b[2], b[3], 0xEE);
    b[0] = _mm512_shuffle_i32x4(t0, t2, 0x88);
    b[1] = _mm512_shuffle_i32x4(t0, t2, 0xDD);
    b[2] = _mm512_shuffle_i32x4(t1, t3, 0x88);
    b[3] = _mm512_shuffle_i32x4(t1, t3, 0xDD);
}

static inline __mmask16 dw5_m16(size_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

/* Per-channel int32 array over the 64 positions (position v is channel v mod W, n valid),
 * in quad order. */
static inline void dw5_load32(const int32_t *p, size_t W, size_t n, __m512i b[4]) {
    for (size_t j = 0; j < 4; j++) {
        const size_t c0 = 16 * (j % (W / 16));
        b[j] = _mm512_maskz_loadu_epi32(dw5_m16(n > c0 ? n - c0 : 0), p + c0);
    }
    dw5_perm(b);
}

/* One tap's weights as 64 int8 positions; sets *bad if one is outside int8. */
static inline __m512i dw5_load_w(const int16_t *w, size_t W, size_t n, __mmask32 *bad) {
    const __m512i lo = _mm512_set1_epi16(-128), hi = _mm512_set1_epi16(127);
    const __mmask32 m0 = n >= 32 ? ~(__mmask32)0 : (__mmask32)((UINT64_C(1) << n) - 1);
    const __m512i v0 = _mm512_maskz_loadu_epi16(m0, w);
    *bad |= _mm512_cmplt_epi16_mask(v0, lo) | _mm512_cmpgt_epi16_mask(v0, hi);
    const __m256i b0 = _mm512_cvtepi16_epi8(v0);
    if (W == 16) return _mm512_broadcast_i32x4(_mm256_castsi256_si128(b0));
    if (W == 32) return _mm512_broadcast_i64x4(b0);
    const __mmask32 m1 = n >= 64 ? ~(__mmask32)0 : n > 32 ? (__mmask32)((UINT64_C(1) << (n - 32)) - 1) : 0;
    const __m512i v1 = _mm512_maskz_loadu_epi16(m1, w + 32);
    *bad |= _mm512_cmplt_epi16_mask(v1, lo) | _mm512_cmpgt_epi16_mask(v1, hi);
    return _mm512_inserti64x4(_mm512_castsi256_si512(b0), _mm512_cvtepi16_epi8(v1), 1);
}

/* (a, b, c, d) bytes per position -> four quad vectors. */
static inline void dw5_quads(__m512i a, __m512i b, __m512i c, __m512i d, __m512i q[4]) {
    const __m512i ab0 = _mm512_unpacklo_epi8(a, b), ab1 = _mm512_unpackhi_epi8(a, b);
    const __m512i cd0 = _mm512_unpacklo_epi8(c, d), cd1 = _mm512_unpackhi_epi8(c, d);
    q[0] = _mm512_unpacklo_epi16(ab0, cd0);
    q[1] = _mm512_unpackhi_epi16(ab0, cd0);
    q[2] = _mm512_unpacklo_epi16(ab1, cd1);
    q[3] = _mm512_unpackhi_epi16(ab1, cd1);
}

/* Requantisation constants of one block; returns 0 if some e exceeds DW5_MAXE. */
static inline int dw5_rq_make(dw5_rq *q, const ea_epilogue *ep, size_t ch, size_t W, size_t n) {
    __m512i m[4], s[4];
    dw5_load32(ep->mult + ch, W, n, m);
    dw5_load32(ep->shift + ch, W, n, s);
    const __m512i zero = _mm512_setzero_si512(), lo32 = _mm512_set1_epi64(0xFFFFFFFF);
    const __m512i one = _mm512_set1_epi64(1), c31 = _mm512_set1_epi64(31);
    const __m512i base = _mm512_set1_epi64(INT64_C(1) << 30), zp = _mm512_set1_epi64(ep->out_zp);
    const __m512i d31 = _mm512_set1_epi64(INT64_C(1) << 31);
    __mmask16 big = 0, left = 0;
    for (int k = 0; k < 4; k++) {
        const __m512i e = _mm512_max_epi32(_mm512_sub_epi32(zero, s[k]), zero);
        q->left[k] = _mm512_max_epi32(s[k], zero);
        left |= _mm512_test_epi32_mask(q->left[k], q->left[k]);
        big |= _mm512_cmpgt_epi32_mask(e, _mm512_set1_epi32(DW5_MAXE));
        const __m512i s32 = _mm512_add_epi32(e, _mm512_set1_epi32(31));
        q->me[k] = m[k];
        q->mo[k] = _mm512_srli_epi64(m[k], 32);
        q->se[k] = _mm512_and_si512(s32, lo32);
        q->so[k] = _mm512_srli_epi64(s32, 32);
        const __m512i *sv[2] = {&q->se[k], &q->so[k]};
        __m512i *kv[2] = {&q->ke[k], &q->ko[k]}, *dv[2] = {&q->de[k], &q->dd[k]};
        for (int h = 0; h < 2; h++) {
            const __mmask8 pos = _mm512_cmpgt_epi64_mask(*sv[h], c31); /* e >= 1 */
            const __m512i c = _mm512_maskz_sllv_epi64(pos, one, _mm512_sub_epi64(*sv[h], one));
            *kv[h] = _mm512_add_epi64(_mm512_add_epi64(base, c), _mm512_sllv_epi64(zp, *sv[h]));
            *dv[h] = _mm512_maskz_mov_epi64(pos, d31);
        }
    }
    q->any_left = left != 0;
    return big == 0;
}

static inline __m512i dw5_rq1(__m512i acc, const dw5_rq *q, int k) {
    const __m512i thr = _mm512_set1_epi64(-(INT64_C(1) << 30));
    if (q->any_left) acc = _mm512_sllv_epi32(acc, q->left[k]);
    __m512i pe = _mm512_mul_epi32(acc, q->me[k]);
    __m512i po = _mm512_mul_epi32(_mm512_srli_epi64(acc, 32), q->mo[k]);
    const __mmask8 ne = _mm512_cmplt_epi64_mask(pe, thr), no = _mm512_cmplt_epi64_mask(po, thr);
    pe = _mm512_add_epi64(pe, q->ke[k]);
    po = _mm512_add_epi64(po, q->ko[k]);
    pe = _mm512_srav_epi64(_mm512_mask_sub_epi64(pe, ne, pe, q->de[k]), q->se[k]);
    po = _mm512_srav_epi64(_mm512_mask_sub_epi64(po, no, po, q->dd[k]), q->so[k]);
    return _mm512_mask_blend_epi32(0xAAAA, pe, _mm512_slli_epi64(po, 32));
}

/* Bytes of pixel slot j (of np) from b + j * (x_step) at lanes jW..jW+n: one load when the
 * pixels are contiguous; masked-off bytes of the other loads never fault. */
static inline __attribute__((always_inline)) __m512i dw5_ld(const size_t P, const int8_t *b, int contig,
                                                            __mmask64 mall, __mmask64 mslot,
                                                            size_t np, ptrdiff_t adv) {
    if (P == 1 || contig) return _mm512_maskz_loadu_epi8(mall, b);
    __m512i v = _mm512_maskz_loadu_epi8(mslot, b);
    for (size_t j = 1; j < np; j++)
        v = _mm512_mask_loadu_epi8(v, mslot << (j * (64 / P)), b + (ptrdiff_t)j * adv);
    return v;
}

/* The weight quads and constants of one block; returns 0 if dw5 cannot take it exactly. */
static inline int dw5_prep(size_t W, size_t ch, size_t n, size_t ntaps, const int16_t *const *w,
                           int32_t in_zp, const ea_epilogue *ep, dw5_rq *q, __m512i (*wq)[4]) {
    const size_t nq = (ntaps + 3) / 4;
    if (!dw5_rq_make(q, ep, ch, W, n)) return 0;
    __mmask32 bad = 0;
    const __m512i zero = _mm512_setzero_si512(), zp128 = _mm512_set1_epi8((char)(in_zp + 128));
    __m512i sw[4] = {zero, zero, zero, zero};
    for (size_t g = 0; g < nq; g++) {
        __m512i t[4];
        for (size_t j = 0; j < 4; j++)
            t[j] = 4 * g + j < ntaps ? dw5_load_w(w[4 * g + j] + ch, W, n, &bad) : zero;
        dw5_quads(t[0], t[1], t[2], t[3], wq[g]);
        for (int k = 0; k < 4; k++) sw[k] = _mm512_dpbusd_epi32(sw[k], zp128, wq[g][k]);
    }
    if (bad) return 0;
    dw5_load32(ep->bias + ch, W, n, q->init);
    for (int k = 0; k < 4; k++) q->init[k] = _mm512_sub_epi32(q->init[k], sw[k]);
    return 1;
}

/* A block's preparation kept in the caller's cache (calls of one op, ntaps <= DW5_CT). */
#define DW5_CT 12
typedef struct {
    __m512i wq[DW5_CT / 4][4];
    dw5_rq q;
} dw5_slot;
_Static_assert(sizeof(dw5_slot) <= EA_DW_CACHE_SLOT, "dw5_slot exceeds EA_DW_CACHE_SLOT");

/* One block of n <= W channels at ch, P = 64 / W pixels per vector. */
static inline __attribute__((always_inline)) int dw5_block(
    const size_t P, size_t ch, size_t n, size_t nrows, size_t npix, size_t ntaps,
    const int8_t *const *x, size_t x_step, size_t x_row_step, const int16_t *const *w,
    int32_t in_zp, const ea_epilogue *ep, int8_t *out, size_t out_step, size_t out_row_step,
    uint8_t *tag, dw5_slot *slot) {
    const size_t W = 64 / P, nq = (ntaps + 3) / 4;
    __m512i wql[DW5_MAXT / 4][4];
    dw5_rq ql;
    /* locals, not the slot, in the pixel loop: int8 stores may alias the slot's memory */
    __m512i(*wq)[4] = wql;
    dw5_rq *qp = &ql;
    if (tag && (*tag & 7) == P) {
        if (!(*tag & 8)) return 0;
        ql = slot->q;
        for (size_t g = 0; g < nq; g++)
            for (int k = 0; k < 4; k++) wql[g][k] = slot->wq[g][k];
    } else {
        const int ok = dw5_prep(W, ch, n, ntaps, w, in_zp, ep, qp, wq);
        if (tag) {
            *tag = (uint8_t)(P + 8 * ok);
            slot->q = ql;
            for (size_t g = 0; g < nq; g++)
                for (int k = 0; k < 4; k++) slot->wq[g][k] = wql[g][k];
        }
        if (!ok) return 0;
    }
    const __m512i zero = _mm512_setzero_si512();
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i lo8 = _mm512_set1_epi8((char)ep->act_min), hi8 = _mm512_set1_epi8((char)ep->act_max);
    const __mmask64 mslot = n >= 64 ? ~(__mmask64)0 : ((UINT64_C(1) << n) - 1);
    const int xcontig = x_step == W && n == W, ocontig = out_step == W && n == W;
    const ptrdiff_t xadv = (ptrdiff_t)x_step - (ptrdiff_t)W, oadv = (ptrdiff_t)out_step - (ptrdiff_t)W;
    for (size_t row = 0; row < nrows; row++) for (size_t p = 0; p < npix; p += P) {
        const size_t np = npix - p < P ? npix - p : P;
        /* bytes of pixel slot j come from px + (p + j) * step at lanes jW..jW+W */
        const __mmask64 mall = P == 1 ? mslot : np == P ? ~(__mmask64)0 : (UINT64_C(1) << (np * W)) - 1;
        const size_t off = row * x_row_step + p * x_step + ch;
        __m512i acc0 = qp->init[0], acc1 = qp->init[1], acc2 = qp->init[2], acc3 = qp->init[3];
        for (size_t g = 0; g < nq; g++) {
            const size_t t0 = 4 * g;
            const __m512i a = _mm512_xor_si512(dw5_ld(P, x[t0] + off, xcontig, mall, mslot, np, xadv), flip);
            const __m512i b = t0 + 1 < ntaps ? _mm512_xor_si512(dw5_ld(P, x[t0 + 1] + off, xcontig, mall, mslot, np, xadv), flip) : zero;
            const __m512i c = t0 + 2 < ntaps ? _mm512_xor_si512(dw5_ld(P, x[t0 + 2] + off, xcontig, mall, mslot, np, xadv), flip) : zero;
            const __m512i d = t0 + 3 < ntaps ? _mm512_xor_si512(dw5_ld(P, x[t0 + 3] + off, xcontig, mall, mslot, np, xadv), flip) : zero;
            __m512i qv[4];
            dw5_quads(a, b, c, d, qv);
            acc0 = _mm512_dpbusd_epi32(acc0, qv[0], wq[g][0]);
            acc1 = _mm512_dpbusd_epi32(acc1, qv[1], wq[g][1]);
            acc2 = _mm512_dpbusd_epi32(acc2, qv[2], wq[g][2]);
            acc3 = _mm512_dpbusd_epi32(acc3, qv[3], wq[g][3]);
        }
        const __m512i r01 = _mm512_packs_epi32(dw5_rq1(acc0, qp, 0), dw5_rq1(acc1, qp, 1));
        const __m512i r23 = _mm512_packs_epi32(dw5_rq1(acc2, qp, 2), dw5_rq1(acc3, qp, 3));
        const __m512i r = _mm512_min_epi8(_mm512_max_epi8(_mm512_packs_epi16(r01, r23), lo8), hi8);
        int8_t *o = out + row * out_row_step + p * out_step + ch;
        if (P == 1 || ocontig) {
            _mm512_mask_storeu_epi8(o, mall, r);
        } else {
            for (size_t j = 0; j < np; j++) _mm512_mask_storeu_epi8(o + (ptrdiff_t)j * oadv, mslot << (j * W), r);
        }
    }
    return 1;
}

/* MultiplyByQuantizedMultiplier on 16 lanes in natural order (x86_mbqm's steps). */
static inline __m512i dw5_mbqm(__m512i x, const int32_t *mult, const int32_t *shift, __mmask16 m) {
    const __m512i zero = _mm512_setzero_si512(), one = _mm512_set1_epi32(1);
    const __m512i nudge = _mm512_set1_epi64(INT64_C(1) << 30);
    const __m512i mv = _mm512_maskz_loadu_epi32(m, mult), s = _mm512_maskz_loadu_epi32(m, shift);
    const __m512i left = _mm512_max_epi32(s, zero), right = _mm512_max_epi32(_mm512_sub_epi32(zero, s), zero);
    x = _mm512_sllv_epi32(x, left);
    __m512i even = _mm512_add_epi64(_mm512_mul_epi32(x, mv), nudge);
    __m512i odd = _mm512_add_epi64(_mm512_mul_epi32(_mm512_srli_epi64(x, 32), _mm512_srli_epi64(mv, 32)), nudge);
    const __m512i h = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 31), _mm512_slli_epi64(odd, 1));
    const __m512i mask = _mm512_sub_epi32(_mm512_sllv_epi32(one, right), one);
    const __m512i thr = _mm512_sub_epi32(_mm512_srai_epi32(mask, 1), _mm512_srai_epi32(h, 31));
    const __m512i r = _mm512_srav_epi32(h, right);
    return _mm512_mask_add_epi32(r, _mm512_cmpgt_epi32_mask(_mm512_and_si512(h, mask), thr), r, one);
}

/* A single pixel (calls of one or two pixels): each weight is used once, so interleaving
 * them would cost more than it saves. Per tap and 16 channels: x - zp sign-extended to int32
 * is the int16 pair (x - zp, sign), the weight zero-extended is (w, 0), so vpdpwssd adds
 * exactly (x - zp) * w. */
static void dw5_pixel(size_t c, size_t ntaps, const int8_t *const *x, const int16_t *const *w,
                      int32_t in_zp, const ea_epilogue *ep, int8_t *out) {
    const __m512i zp = _mm512_set1_epi32(in_zp), ozp = _mm512_set1_epi32(ep->out_zp);
    const __m128i lo8 = _mm_set1_epi8((char)ep->act_min), hi8 = _mm_set1_epi8((char)ep->act_max);
    for (size_t ch = 0; ch < c; ch += 16) {
        const __mmask16 m = dw5_m16(c - ch);
        __m512i acc = _mm512_maskz_loadu_epi32(m, ep->bias + ch);
        for (size_t t = 0; t < ntaps; t++) {
            const __m512i xv = _mm512_sub_epi32(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, x[t] + ch)), zp);
            const __m512i wv = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, w[t] + ch));
            acc = _mm512_dpwssd_epi32(acc, xv, wv);
        }
        const __m512i v = _mm512_add_epi32(dw5_mbqm(acc, ep->mult + ch, ep->shift + ch, m), ozp);
        const __m128i r = _mm_min_epi8(_mm_max_epi8(_mm512_cvtsepi32_epi8(v), lo8), hi8);
        _mm_mask_storeu_epi8(out + ch, m, r);
    }
}

static void x86_dw512(size_t c, size_t nrows, size_t npix, size_t ntaps, const int8_t *const *x,
                      size_t x_step, size_t x_row_step, const int16_t *const *w, int32_t in_zp,
                      const ea_epilogue *ep, int8_t *out, size_t out_step, size_t out_row_step,
                      void *cache) {
    if (ntaps > DW5_MAXT || ntaps == 0) {
        x86_dw(c, nrows, npix, ntaps, x, x_step, x_row_step, w, in_zp, ep, out, out_step, out_row_step,
               NULL);
        return;
    }
    if (nrows * npix <= 2) { /* too few pixels to repay the weight preparation */
        const int8_t *xs[DW5_MAXT];
        for (size_t r = 0; r < nrows; r++)
            for (size_t p = 0; p < npix; p++) {
                for (size_t t = 0; t < ntaps; t++) xs[t] = x[t] + r * x_row_step + p * x_step;
                dw5_pixel(c, ntaps, xs, w, in_zp, ep, out + r * out_row_step + p * out_step);
            }
        return;
    }
    uint8_t *tags = cache && ntaps <= DW5_CT ? (uint8_t *)cache : NULL;
    dw5_slot *slots = tags ? (dw5_slot *)(((uintptr_t)(tags + EA_DW_CACHE_TAGS(c)) + 63) & ~(uintptr_t)63) : NULL;
    for (size_t ch = 0; ch < c;) {
        const size_t rem = c - ch;
        /* a tail of <= 16 (32) channels packs 4 (2) pixels per vector, if there are pixels */
        const size_t P = rem > 32 ? 1 : rem > 16 || npix == 2 ? 2 : 4;
        const size_t n = rem < 64 / P ? rem : 64 / P;
#define DW5_B(P_) dw5_block(P_, ch, n, nrows, npix, ntaps, x, x_step, x_row_step, w, in_zp, ep, out, \
                         out_step, out_row_step, tags ? tags + ch / 16 : NULL, slots ? slots + ch / 16 : NULL)
        int ok = P == 1 ? DW5_B(1) : P == 2 ? DW5_B(2) : DW5_B(4);
#undef DW5_B
        if (!ok) { /* the rare block dw5 cannot take exactly: the 256-bit kernel */
            const int8_t *xs[DW5_MAXT];
            const int16_t *ws[DW5_MAXT];
            for (size_t t = 0; t < ntaps; t++) xs[t] = x[t] + ch, ws[t] = w[t] + ch;
            const ea_epilogue e = {ep->bias + ch, ep->mult + ch, ep->shift + ch, NULL, ep->out_zp,
                                   ep->act_min, ep->act_max, 0};
            x86_dw(n, nrows, npix, ntaps, xs, x_step, x_row_step, ws, in_zp, &e, out + ch, out_step,
                   out_row_step, NULL);
        }
        ch += n;
    }
}

#endif
