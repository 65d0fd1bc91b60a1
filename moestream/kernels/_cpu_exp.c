/* The native kernels' own exponential (included by _cpu.c before the kernels that use it), for the bf16 path's SiLU
 * and every native attention's softmax (libm's expf stays in the other fp32 kernels): exp(x) = 2^k e^r with k the
 * nearest integer to x / ln2 and r = x - k ln2 (ln2 split in two floats, fused), e^r by its Taylor polynomial
 * to degree 7 (Horner, fused), then times 2^k in two steps (2^(k >> 1), 2^(k - (k >> 1))) so that results near the
 * overflow and in the subnormal range are rounded once. x is clamped to [-104, 89] first: above ~88.72 the result
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
