/* The native kernels' own exponential (included by _cpu.c before the kernels that use it), for the bf16 path's SiLU,
 * K3's SiTU-GLU (its tanh and sigmoid: ms_situ_glu) and every native attention's softmax (libm's expf stays in the
 * other fp32 kernels): exp(x) = 2^k e^r with k the nearest integer to x / ln2 and r = x - k ln2 (ln2 split in two
 * floats, fused), e^r by its Taylor polynomial to degree 7 (Horner, fused), then times 2^k in two steps
 * (2^(k >> 1), 2^(k - (k >> 1))) so that results near the overflow and in the subnormal range are rounded once. x is clamped to [-104, 89] first: above ~88.72 the result
 * is inf, below ~-103.97 it is 0 (subnormal results are kept, not flushed); NaN gives NaN (quieted). Within 1 ulp of
 * exp (0.94 measured over every float; tests/test_compute_dtype.py checks it). exp_f32 (scalar) and vexp_f32
 * (AVX-512, 16 lanes) do the same operations in the same order, so they give the same bits. */
#define EXP_HI 89.0f
#define EXP_LO (-104.0f)
#define EXP_SHIFT 0x1.8p23f                /* adding it rounds |v| < 2^22 to an integer */
#define EXP_INV_LN2 0x1.715476p+0f
#define EXP_LN2_HI 0x1.62e43p-1f           /* ln2 rounded to float ... */
#define EXP_LN2_LO (-0x1.05c610p-29f)      /* ... and what it leaves: ln2 - EXP_LN2_HI, rounded */
#define EXP_C7 (1.0f / 5040.0f)
#define EXP_C6 (1.0f / 720.0f)
#define EXP_C5 (1.0f / 120.0f)
#define EXP_C4 (1.0f / 24.0f)
#define EXP_C3 (1.0f / 6.0f)
#define EXP_C2 0.5f

/* keeps a rounded product from being fused into the caller's next add (gcc contracts a * b + c by default): the
 * scalar and vector code must round the same operations */
#if defined(__GNUC__) && defined(__x86_64__)
#define FP_KEEP(v) __asm__("" : "+x"(v))
#define FP_KEEPV(v) __asm__("" : "+v"(v))
#elif defined(__GNUC__) && defined(__aarch64__)
#define FP_KEEP(v) __asm__("" : "+w"(v))
#else
#define FP_KEEP(v) ((void)0)
#endif
#ifndef FP_KEEPV
#define FP_KEEPV(v) ((void)0)
#endif

INLINE float exp_f32(float x) {
    float xc = x > EXP_LO ? x : EXP_LO; /* NaN: EXP_LO, fixed below */
    xc = xc < EXP_HI ? xc : EXP_HI;
    const float kf = fmaf(xc, EXP_INV_LN2, EXP_SHIFT) - EXP_SHIFT;
    float r = fmaf(-kf, EXP_LN2_HI, xc); /* exact */
    r = fmaf(-kf, EXP_LN2_LO, r);
    float p = fmaf(EXP_C7, r, EXP_C6);
    p = fmaf(p, r, EXP_C5);
    p = fmaf(p, r, EXP_C4);
    p = fmaf(p, r, EXP_C3);
    p = fmaf(p, r, EXP_C2);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    const int32_t k = (int32_t)kf, k1 = k >> 1, k2 = k - k1; /* k in [-150, 128] */
    float y = p * bits_f32((uint32_t)(k1 + 127) << 23) * bits_f32((uint32_t)(k2 + 127) << 23);
    if (x != x) y = x + x;
    FP_KEEP(y);
    return y;
}

/* the SiLU-GLU of this path: g / (1 + exp(-g)) * u */
INLINE float silu_glu(float g, float u) { return g / (1.0f + exp_f32(-g)) * u; }

#if MS_AVX512
INLINE __m512 vexp_f32(__m512 x) {
    __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(EXP_LO));
    xc = _mm512_min_ps(xc, _mm512_set1_ps(EXP_HI));
    const __m512 kf = _mm512_sub_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(EXP_INV_LN2), _mm512_set1_ps(EXP_SHIFT)),
                                    _mm512_set1_ps(EXP_SHIFT));
    __m512 r = _mm512_fnmadd_ps(kf, _mm512_set1_ps(EXP_LN2_HI), xc);
    r = _mm512_fnmadd_ps(kf, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(EXP_C7), r, _mm512_set1_ps(EXP_C6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i k = _mm512_cvttps_epi32(kf), k1 = _mm512_srai_epi32(k, 1), k2 = _mm512_sub_epi32(k, k1);
    const __m512i bias = _mm512_set1_epi32(127);
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k1, bias), 23))),
                             _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k2, bias), 23)));
    y = _mm512_mask_add_ps(y, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x, x);
    FP_KEEPV(y);
    return y;
}
#endif

/* tanh by the same exponential: for |a| >= TANH_SMALL, (1 - e) / (1 + e) with e = exp(-2 |a|) (no cancellation:
 * e <= 0.33); below it the odd Taylor series to a^19 (Horner in a^2, fused; the next term is under 1e-9 of the
 * result there); the sign of a put back. NaN gives NaN, +-inf +-1. tanh_f32 (scalar) and vtanh_f32 (AVX-512) do the
 * same operations in the same order, so they give the same bits. */
#define TANH_SMALL 0.55f
#define TANH_C3 (-0x1.555556p-2f)   /* -1/3 */
#define TANH_C5 0x1.111112p-3f      /* 2/15 */
#define TANH_C7 (-0x1.ba1ba2p-5f)   /* -17/315 */
#define TANH_C9 0x1.664f48p-6f      /* 62/2835 */
#define TANH_C11 (-0x1.226e36p-7f)  /* -1382/155925 */
#define TANH_C13 0x1.d6d3dp-9f     /* 21844/6081075 */
#define TANH_C15 (-0x1.7da364p-10f) /* -929569/638512875 */
#define TANH_C17 0x1.355824p-11f    /* 6404582/10854718875 */
#define TANH_C19 (-0x1.f57d78p-13f) /* -443861162/1856156927625 */

INLINE float tanh_f32(float a) {
    const float ax = fabsf(a);
    float t;
    if (ax < TANH_SMALL) {
        const float a2 = ax * ax;
        float p = fmaf(TANH_C19, a2, TANH_C17);
        p = fmaf(p, a2, TANH_C15);
        p = fmaf(p, a2, TANH_C13);
        p = fmaf(p, a2, TANH_C11);
        p = fmaf(p, a2, TANH_C9);
        p = fmaf(p, a2, TANH_C7);
        p = fmaf(p, a2, TANH_C5);
        p = fmaf(p, a2, TANH_C3);
        float a3 = a2 * ax;
        FP_KEEP(a3);
        t = fmaf(p, a3, ax);
    } else {
        const float e = exp_f32(-2.0f * ax);
        t = (1.0f - e) / (1.0f + e);
    }
    return copysignf(t, a);
}

/* Kimi K3's SiTU-GLU, as models/blocks.situ_glu computes it: (beta tanh(g / beta) sigmoid(g)) (lb tanh(u / lb)) */
INLINE float situ_glu_f32(float g, float u, float beta, float lbeta) {
    float a = beta * tanh_f32(g / beta);
    FP_KEEP(a);
    a = a * (1.0f / (1.0f + exp_f32(-g)));
    FP_KEEP(a);
    float b = lbeta * tanh_f32(u / lbeta);
    FP_KEEP(b);
    return a * b;
}

#if MS_AVX512
INLINE __m512 vtanh_f32(__m512 a) {
    const __m512 ax = _mm512_abs_ps(a), one = _mm512_set1_ps(1.0f);
    const __m512 a2 = _mm512_mul_ps(ax, ax);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(TANH_C19), a2, _mm512_set1_ps(TANH_C17));
    p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(TANH_C15));
    p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(TANH_C13));
    p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(TANH_C11));
    p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(TANH_C9));
    p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(TANH_C7));
    p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(TANH_C5));
    p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(TANH_C3));
    __m512 a3 = _mm512_mul_ps(a2, ax);
    FP_KEEPV(a3);
    const __m512 small = _mm512_fmadd_ps(p, a3, ax);
    const __m512 e = vexp_f32(_mm512_mul_ps(_mm512_set1_ps(-2.0f), ax));
    const __m512 big = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __m512 t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ax, _mm512_set1_ps(TANH_SMALL), _CMP_LT_OQ), big, small);
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int)0x80000000u));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
}

INLINE __m512 vsitu_glu_f32(__m512 g, __m512 u, float beta, float lbeta) {
    const __m512 vb = _mm512_set1_ps(beta), vl = _mm512_set1_ps(lbeta), one = _mm512_set1_ps(1.0f);
    __m512 a = _mm512_mul_ps(vb, vtanh_f32(_mm512_div_ps(g, vb)));
    FP_KEEPV(a);
    a = _mm512_mul_ps(a, _mm512_div_ps(one, _mm512_add_ps(one, vexp_f32(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
    FP_KEEPV(a);
    __m512 b = _mm512_mul_ps(vl, vtanh_f32(_mm512_div_ps(u, vl)));
    FP_KEEPV(b);
    return _mm512_mul_ps(a, b);
}
#endif

/* p[0..n) = exp_f32(p - m) (16 lanes at a time where AVX-512), returning their sum taken in index order: a softmax's
 * numerators and denominator. Every native attention kernel (ms_gqa_attend, the paged batch decode, the fused
 * decode layer) takes its softmax from here, so the one-at-a-time and batched paths give the same bits. */
static inline float softmax_exps(float *p, int64_t n, float m) {
    int64_t i = 0;
#if MS_AVX512
    const __m512 vm = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(p + i, vexp_f32(_mm512_sub_ps(_mm512_loadu_ps(p + i), vm)));
#endif
    for (; i < n; i++) p[i] = exp_f32(p[i] - m);
    float sum = 0.0f;
    for (i = 0; i < n; i++) sum += p[i];
    return sum;
}
