/* moestream native CPU kernels, part 1b (#included by _cpu.c before _cpu_step.c): bf16 weights times many tokens
 * as an outer-product GEMM (the register tiling of BLIS-style kernels), for the batched GLU experts.
 *
 * The dot-product tiles of _cpu.c (weight rows x token tiles, a horizontal sum per output) reached 35-42 GFLOP/s on
 * one core of this Zen 3 at 16-64 tokens, half the FMA peak. Here the tokens are the vector lanes instead:
 *   - x is packed once per expert into panels of PANEL tokens, each [K][PANEL] fp32 (zero padded tokens);
 *   - PR weight rows at a time are widened to fp32 once (bf16 is the top half of fp32) into a block that stays in
 *     L1/L2, and every panel runs over it;
 *   - the register tile is PR rows x PANEL tokens (12 accumulators with AVX2): per k, PANEL/VW vector loads of x and
 *     PR broadcasts of a weight, PR * PANEL/VW FMAs, no horizontal sums, no shuffles.
 * The result is a PR x PANEL tile of y^T; callers scatter it (the GLU writes h straight into the panel layout the
 * down projection reads). Every output is one fp32 sum over k in order, the same for any thread count. */

#define PANEL (2 * VW)  /* tokens per panel */
#define PR 6            /* weight rows per register tile */
#ifndef PANEL_MIN_T
#define PANEL_MIN_T 16  /* an expert with at least this many tokens takes the panel kernel */
#endif

#if MS_SIMD == 2
INLINE vf vbcast(const float *p) { return _mm512_set1_ps(*p); }
#elif MS_SIMD == 1
INLINE vf vbcast(const float *p) { return _mm256_broadcast_ss(p); }
#else
INLINE vf vbcast(const float *p) { return *p; }
#endif

/* panels needed for T tokens, and the floats they take for K inputs */
static int64_t panel_count(int64_t T) { return (T + PANEL - 1) / PANEL; }
static int64_t panel_floats(int64_t T, int64_t K) { return panel_count(T) * PANEL * K; }

/* panel p of tokens rows[0..T) of x [*, K] (row stride K) into xp + p * PANEL * K (panel_floats(T, K) in all) */
static void panel_pack_x(const float *x, int64_t K, const int64_t *rows, int64_t T, int64_t p, float *xp) {
    float *dst = xp + p * PANEL * K;
    const int64_t w = T - p * PANEL < PANEL ? T - p * PANEL : PANEL;
    if (w < PANEL) memset(dst, 0, sizeof(float) * (size_t)(PANEL * K));
    for (int64_t t = 0; t < w; t++) {
        const float *src = x + rows[p * PANEL + t] * K;
        for (int64_t k = 0; k < K; k++) dst[k * PANEL + t] = src[k];
    }
}

/* rows [n, n + rr) of w [*, K] bf16 widened into pw [PR][K] fp32; rows rr..PR are zero */
static void panel_pack_w(const uint16_t *w, int64_t K, int64_t n, int rr, float *pw) {
    for (int r = 0; r < PR; r++) {
        float *dst = pw + r * K;
        if (r >= rr) {
            memset(dst, 0, sizeof(float) * (size_t)K);
            continue;
        }
        const uint16_t *row = w + (n + r) * K;
        int64_t k = 0;
#if MS_SIMD == 1
        for (; k + 8 <= K; k += 8)
            _mm256_storeu_ps(dst + k, _mm256_castsi256_ps(_mm256_slli_epi32(
                                          _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + k))), 16)));
#elif MS_SIMD == 2
        for (; k + 16 <= K; k += 16)
            _mm512_storeu_ps(dst + k, _mm512_castsi512_ps(_mm512_slli_epi32(
                                          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + k))), 16)));
#endif
        for (; k < K; k++) dst[k] = bits_f32((uint32_t)row[k] << 16);
    }
}

/* c[r * PANEL + t] = sum_k pw[r * K + k] * xp[k * PANEL + t] for the PR rows and NV * VW tokens of one panel */
INLINE void panel_tile(const float *pw, const float *xp, int64_t K, float *c, const int NV) {
    vf acc[PR][2];
#pragma GCC unroll 6
    for (int r = 0; r < PR; r++) acc[r][0] = acc[r][1] = vzero();
    for (int64_t k = 0; k < K; k++) {
        const vf x0 = vloadf(xp + k * PANEL), x1 = NV > 1 ? vloadf(xp + k * PANEL + VW) : vzero();
#pragma GCC unroll 6
        for (int r = 0; r < PR; r++) {
            const vf b = vbcast(pw + r * K + k);
            acc[r][0] = vfma(b, x0, acc[r][0]);
            if (NV > 1) acc[r][1] = vfma(b, x1, acc[r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < PR; r++) {
        vstoref(c + r * PANEL, acc[r][0]);
        if (NV > 1) vstoref(c + r * PANEL + VW, acc[r][1]);
    }
}

/* the tile for a panel holding `w` real tokens: half the accumulators when they all fit one vector */
static void panel_run(const float *pw, const float *xp, int64_t K, float *c, int64_t w) {
    if (w > VW) panel_tile(pw, xp, K, c, 2);
    else panel_tile(pw, xp, K, c, 1);
}
