/* moestream native CPU kernels, part 9 (#included at the end of _cpu.c, one translation unit): quantised weights
 * read as stored, times fp32 inputs: block-FP8 (float8_e4m3fn codes with one float32 scale_inv per block of BR x BC
 * values: DeepSeek-V3 / Kimi K2's dense weights and DeepSeek-V3's experts) and, below, int4 (Kimi K2's experts).
 * One byte (half a byte) a weight streams from memory instead of the fp32 rows the torch paths decode a chunk at a
 * time (kernels/quant.py).
 *
 * Each code is widened to fp32 exactly: its 7 magnitude bits moved to bit 20 and its sign to bit 31 make an fp32
 * whose value is the code's times 2^-120 (e4m3's bias is 7, fp32's 127; e4m3 subnormals land on fp32 subnormals,
 * the same factor), and one multiply by 2^120 makes it the code's value. That multiply reads subnormal inputs, so
 * each thread clears the DAZ bit of its MXCSR for the call (restored after). The NaN codes 0x7F / 0xFF come out as
 * +-480, as in quant.py's chunked path (checkpoints hold none).
 * Sums: per row and token, each column block's products in four accumulators (consecutive groups of 16 values in
 * turn), the block's sum times its scale added into the row's total; the order depends only on K and BC, not on
 * the token count, the threads or the rows a call holds. */

#ifndef FP8_PF
#define FP8_PF 2048 /* bytes ahead of a row's read that each 64-byte step prefetches */
#endif
#ifndef FP8_PF_ONE
/* one token: prefetch this far ahead into L2 instead (x, up to 28 KiB a 7168-wide row, keeps L1): in alternated
 * builds over 350 MB of DeepSeek-V3-shaped weights, 2 threads (bench/ab_builds.py fp8), 4 KiB into L2 ran 1.11x,
 * 1.25x and 1.18x (12 rounds) the 2 KiB into L1, 2 KiB into L2 1.06x, 4 KiB into L3 1.22x; at 2 tokens the same, at
 * 4 tokens 0.92x (so calls of 2+ tokens keep L1). int4 rows (bench/ab_builds.py int4) gained nothing from it. */
#define FP8_PF_ONE 4096
#endif
#ifndef FP8_ONE_HINT
#define FP8_ONE_HINT _MM_HINT_T1
#endif
#define FP8_TT 4    /* tokens a pass over a row */
#ifndef FP8_PAIR_X
/* two rows a pass (x read once for both) for one or two tokens whose x takes more than this many bytes, about
 * L1: in alternated builds over 350-470 MB of DeepSeek-V3-shaped weights, 2 threads, pairs ran 1.26-1.28x as fast
 * at K = 16384 (1-2 tokens), 1.14x at K = 7168 and 2 tokens, 0.97x at 1 token, 0.72-0.86x at K = 2048 */
#define FP8_PAIR_X (32 << 10)
#endif

#if MS_SIMD != 2
/* the value of e4m3fn code b, exactly (portable path) */
static float fp8_value(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const float v = e ? ldexpf((float)(8 + m), e - 10) : ldexpf((float)m, -9);
    return (b & 0x80) ? -v : v;
}

static float fp8_lut[256]; /* every code's value, filled once (fp8_lut_fill) */
static pthread_once_t fp8_lut_once = PTHREAD_ONCE_INIT;
static void fp8_lut_fill(void) {
    for (int b = 0; b < 256; b++) fp8_lut[b] = fp8_value((uint8_t)b);
}
#endif

#if MS_SIMD == 2
/* 16 codes at p as fp32 */
INLINE __m512 fp8_16(const uint8_t *p) {
    const __m512i d = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i b = _mm512_and_si512(_mm512_slli_epi32(d, 20), _mm512_set1_epi32((int)0x87F00000u));
    return _mm512_mul_ps(_mm512_castsi512_ps(b), _mm512_set1_ps(0x1p120f));
}

/* R rows from w [R, K] (K % 64 == 0, bc % 64 == 0; row r's column blocks' scales at srow[r]) times TT tokens (x,
 * stride ldx) -> out[t * ldo + r]. Two rows a pass read x once for both (one token's x of a 7168-wide row is 28
 * KiB, about L1); each (row, token) sums in the same order for any R. */
INLINE void fp8_rows(const float *x, int64_t ldx, const uint8_t *w, int64_t K, int64_t bc, const float *const *srow,
                     float *out, int64_t ldo, const int R, const int TT, const int ONE) {
    __m512 tot[2][FP8_TT];
#pragma GCC unroll 2
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < TT; t++) tot[r][t] = _mm512_setzero_ps();
    for (int64_t k0 = 0, b = 0; k0 < K; k0 += bc, b++) {
        const int64_t k1 = k0 + bc < K ? k0 + bc : K;
        __m512 acc[4][2][FP8_TT];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
#pragma GCC unroll 2
            for (int r = 0; r < R; r++)
#pragma GCC unroll 4
                for (int t = 0; t < TT; t++) acc[j][r][t] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; k += 64) {
#pragma GCC unroll 2
            for (int r = 0; r < R; r++) {
                if (ONE) _mm_prefetch((const char *)(w + r * K + k) + FP8_PF_ONE, FP8_ONE_HINT);
                else _mm_prefetch((const char *)(w + r * K + k) + FP8_PF, _MM_HINT_T0);
            }
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                __m512 wv[2];
#pragma GCC unroll 2
                for (int r = 0; r < R; r++) wv[r] = fp8_16(w + r * K + k + 16 * j);
#pragma GCC unroll 4
                for (int t = 0; t < TT; t++) {
                    const __m512 xv = _mm512_loadu_ps(x + t * ldx + k + 16 * j);
#pragma GCC unroll 2
                    for (int r = 0; r < R; r++) acc[j][r][t] = _mm512_fmadd_ps(wv[r], xv, acc[j][r][t]);
                }
            }
        }
#pragma GCC unroll 2
        for (int r = 0; r < R; r++) {
            const __m512 sc = _mm512_set1_ps(srow[r][b]);
#pragma GCC unroll 4
            for (int t = 0; t < TT; t++)
                tot[r][t] = _mm512_fmadd_ps(_mm512_add_ps(_mm512_add_ps(acc[0][r][t], acc[1][r][t]),
                                                          _mm512_add_ps(acc[2][r][t], acc[3][r][t])), sc, tot[r][t]);
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < TT; t++) out[t * ldo + r] = _mm512_reduce_add_ps(tot[r][t]);
}
#endif

typedef struct {
    int64_t E, K, N, br, bc, sk; /* entries; every entry's weight N x K in blocks br x bc (sk blocks a row) */
    const float *const *x; const int64_t *T; const uint8_t *const *w; const float *const *s; float *const *out;
} fp8_job;

/* rows [r0, r1) of the part over all entries' rows laid end to end (entry e's row n is row e * N + n): every token
 * of the entry, FP8_TT at a time */
static void fp8_part(void *arg, int part, int parts) {
    const fp8_job *j = arg;
    int64_t r0, r1;
    split(j->E * j->N, part, parts, &r0, &r1);
#if MS_SIMD == 2
    const unsigned csr = _mm_getcsr();
    if (csr & 0x0040u) _mm_setcsr(csr & ~0x0040u); /* DAZ off: fp8_16's multiply reads subnormals */
    /* each row (or row pair) is read once for all the token tiles */
    for (int64_t r = r0; r < r1;) {
        const int64_t e = r / j->N, n = r % j->N, T = j->T[e];
        const int pair = T <= 2 && T * j->K * (int64_t)sizeof(float) > FP8_PAIR_X;
        const int R = pair && r + 1 < r1 && n + 1 < j->N ? 2 : 1;
        const float *srow[2] = {j->s[e] + (n / j->br) * j->sk, j->s[e] + ((n + R - 1) / j->br) * j->sk};
        const uint8_t *w = j->w[e] + n * j->K;
        for (int64_t t0 = 0; t0 < T; t0 += FP8_TT) {
            const int tt = (int)(T - t0 < FP8_TT ? T - t0 : FP8_TT);
            const float *x = j->x[e] + t0 * j->K;
            float *o = j->out[e] + t0 * j->N + n;
#define FP8_CASE(RR, TT) fp8_rows(x, j->K, w, j->K, j->bc, srow, o, j->N, RR, TT, 0)
#define FP8_ONE(RR) fp8_rows(x, j->K, w, j->K, j->bc, srow, o, j->N, RR, 1, 1) /* the entry's one token */
            if (R == 2) {
                if (T == 1) FP8_ONE(2); else if (tt == 1) FP8_CASE(2, 1); else FP8_CASE(2, 2);
            } else {
                switch (tt) {
                    case 1: if (T == 1) FP8_ONE(1); else FP8_CASE(1, 1); break;
                    case 2: FP8_CASE(1, 2); break;
                    case 3: FP8_CASE(1, 3); break;
                    default: FP8_CASE(1, 4); break;
                }
            }
#undef FP8_CASE
#undef FP8_ONE
        }
        r += R;
    }
    if (csr & 0x0040u) _mm_setcsr(csr);
#else
    pthread_once(&fp8_lut_once, fp8_lut_fill);
    const float *lut = fp8_lut;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t e = r / j->N, n = r % j->N;
        const uint8_t *w = j->w[e] + n * j->K;
        const float *srow = j->s[e] + (n / j->br) * j->sk;
        for (int64_t t = 0; t < j->T[e]; t++) {
            const float *x = j->x[e] + t * j->K;
            float tot = 0.0f;
            for (int64_t k0 = 0, b = 0; k0 < j->K; k0 += j->bc, b++) {
                const int64_t k1 = k0 + j->bc < j->K ? k0 + j->bc : j->K;
                float acc[4][16] = {{0}};
                for (int64_t k = k0; k < k1; k += 64)
                    for (int q = 0; q < 4; q++)
                        for (int l = 0; l < 16; l++) acc[q][l] += lut[w[k + 16 * q + l]] * x[k + 16 * q + l];
                float lane[16];
                for (int l = 0; l < 16; l++) lane[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
                float blk = 0.0f;
                for (int l = 0; l < 16; l++) blk += lane[l];
                tot += blk * srow[b];
            }
            j->out[e][t * j->N + n] = tot;
        }
    }
#endif
}

static int fp8_bad(int64_t K, int64_t br, int64_t bc) { return K % 64 || bc <= 0 || bc % 64 || br <= 0; }

/* For each entry e < E: outs[e] [Ts[e], N] = xs[e] [Ts[e], K] (contiguous fp32) @ W_e^T, W_e the N x K
 * float8_e4m3fn codes ws[e] (rows of K bytes) with scale_inv ss[e] [ceil(N / br), ceil(K / bc)] (floats):
 * W_e[n, k] = code * ss[e][(n / br) * sk + k / bc], sk = ceil(K / bc). K and bc multiples of 64. All entries' rows
 * split over the threads together (when there are at least `min_rows_per_thread` a thread); a (row, token)'s sum
 * is the same bits whatever the other entries, tokens or threads. Returns 0, or -2 when K or bc is not a multiple
 * of 64 (nothing computed). */
int ms_linear_fp8_ptrs(int64_t E, const int64_t *xs, const int64_t *Ts, const int64_t *ws, const int64_t *ss,
                       const int64_t *outs, int64_t N, int64_t K, int64_t br, int64_t bc, int64_t min_rows_per_thread) {
    if (fp8_bad(K, br, bc)) return -2;
    if (E <= 0 || N <= 0) return 0;
    fp8_job j = {E, K, N, br, bc, (K + bc - 1) / bc, (const float *const *)xs, Ts, (const uint8_t *const *)ws,
                 (const float *const *)ss, (float *const *)outs};
    int parts = pool_parts;
    while (parts > 1 && E * N / parts < min_rows_per_thread) parts--;
    pool_run(fp8_part, &j, parts);
    return 0;
}

/* For h < H: out[h] [T, N] = x[h] [T, K] (contiguous fp32) @ W_h^T, W_h the N x K codes at w + h * wh with its
 * scale_inv rows at s + h * sh (floats): ms_linear_fp8_ptrs over the H heads (MLA's per-head products). Returns
 * 0, -1 when out of memory, -2 as ms_linear_fp8_ptrs. */
int ms_linear_fp8_heads(const float *x, int64_t H, int64_t T, int64_t K, const uint8_t *w, int64_t wh, int64_t N,
                        const float *s, int64_t sh, int64_t br, int64_t bc, float *out, int64_t min_rows_per_thread) {
    if (H <= 0 || T <= 0) return fp8_bad(K, br, bc) ? -2 : 0;
    int64_t *a = malloc(sizeof(int64_t) * (size_t)(5 * H));
    if (!a) return -1;
    for (int64_t h = 0; h < H; h++) {
        a[h] = (int64_t)(x + h * T * K);
        a[H + h] = T;
        a[2 * H + h] = (int64_t)(w + h * wh);
        a[3 * H + h] = (int64_t)(s + h * sh);
        a[4 * H + h] = (int64_t)(out + h * T * N);
    }
    const int r = ms_linear_fp8_ptrs(H, a, a + H, a + 2 * H, a + 3 * H, a + 4 * H, N, K, br, bc, min_rows_per_thread);
    free(a);
    return r;
}

/* out[T, N] = x[T, K] @ W^T, W the N x K codes w with scale_inv s [ceil(N / br), ceil(K / bc)]: one entry */
int ms_linear_fp8(const float *x, int64_t T, int64_t K, const uint8_t *w, int64_t N, const float *s, int64_t br,
                  int64_t bc, float *out, int64_t min_rows_per_thread) {
    if (T <= 0) return fp8_bad(K, br, bc) ? -2 : 0;
    const int64_t a[5] = {(int64_t)x, T, (int64_t)w, (int64_t)s, (int64_t)out};
    return ms_linear_fp8_ptrs(1, a, a + 1, a + 2, a + 3, a + 4, N, K, br, bc, min_rows_per_thread);
}

/* ------------------------------------------------------------------------------------------------ int4 */
/* compressed-tensors int4 "pack-quantized" weights (Kimi K2's experts): a row's element 2j in the low nibble of its
 * byte j, 2j + 1 in the high one, each stored as value + 8 (values -8..7), one scale (bf16 or fp32) per group of 32
 * consecutive elements. Decoded in registers: a group's 16 bytes widened to 32-bit lanes, the low nibbles looked
 * up in a 16-entry table of -8..7 (vpermps reads only an index's low 4 bits), the high nibbles after a 4-bit shift;
 * x is prepared per call with each group's even elements first, then its odd ones (the order the lookups give).
 * Sums: per row and token, each group's products (the odd half fused onto the even half's) times the group's scale
 * into four totals in turn (group g into total g % 4), added pairwise at the end: the order depends only on K. */

/* group g's scale of a row: bf16 (its bits shifted into an fp32) or fp32 */
INLINE float int4_scale(const void *sc, int64_t g, const int BF) {
    if (BF) {
        const uint32_t b = (uint32_t)((const uint16_t *)sc)[g] << 16;
        float f;
        memcpy(&f, &b, sizeof f);
        return f;
    }
    return ((const float *)sc)[g];
}

/* x [T, K] -> xp [T, K]: each group of 32 as its 16 even elements, then its 16 odd ones */
static void int4_prepare(const float *x, int64_t T, int64_t K, float *xp) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < K; g += 32)
            for (int i = 0; i < 16; i++) {
                xp[t * K + g + i] = x[t * K + g + 2 * i];
                xp[t * K + g + 16 + i] = x[t * K + g + 2 * i + 1];
            }
}

#if MS_SIMD == 2
/* group g of a row (bytes p, scales sc) times TT tokens of prepared x into totals tot[t] */
#define INT4_GROUP(g, tot)                                                                                        \
    do {                                                                                                      \
        const __m512i d_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * (g))));           \
        const __m512 lo_ = _mm512_permutexvar_ps(d_, table);                                                  \
        const __m512 hi_ = _mm512_permutexvar_ps(_mm512_srli_epi32(d_, 4), table);                            \
        const __m512 s_ = _mm512_set1_ps(int4_scale(sc, (g), BF));                                            \
        _Pragma("GCC unroll 4") for (int t = 0; t < TT; t++) {                                                \
            const float *xt_ = x + t * ldx + 32 * (g);                                                        \
            const __m512 part_ = _mm512_fmadd_ps(hi_, _mm512_loadu_ps(xt_ + 16),                              \
                                                 _mm512_mul_ps(lo_, _mm512_loadu_ps(xt_)));                   \
            tot[t] = _mm512_fmadd_ps(part_, s_, tot[t]);                                                      \
        }                                                                                                     \
    } while (0)

/* one row (bytes p [K/2], group scales sc [K/32]) times TT tokens of prepared x (stride ldx) -> out[t * ldo] */
INLINE void int4_row(const float *x, int64_t ldx, const uint8_t *p, const void *sc, int64_t K, float *out,
                     int64_t ldo, const int TT, const int BF) {
    const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512 t0[FP8_TT], t1[FP8_TT], t2[FP8_TT], t3[FP8_TT];
#pragma GCC unroll 4
    for (int t = 0; t < TT; t++) t0[t] = t1[t] = t2[t] = t3[t] = _mm512_setzero_ps();
    const int64_t G = K / 32;
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) {
        _mm_prefetch((const char *)(p + 16 * g) + FP8_PF, _MM_HINT_T0);
        INT4_GROUP(g, t0);
        INT4_GROUP(g + 1, t1);
        INT4_GROUP(g + 2, t2);
        INT4_GROUP(g + 3, t3);
    }
    if (g < G) INT4_GROUP(g, t0);
    if (g + 1 < G) INT4_GROUP(g + 1, t1);
    if (g + 2 < G) INT4_GROUP(g + 2, t2);
#pragma GCC unroll 4
    for (int t = 0; t < TT; t++)
        out[t * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(t0[t], t1[t]), _mm512_add_ps(t2[t], t3[t])));
}
#undef INT4_GROUP
#endif

typedef struct {
    int64_t E, K, N; int bf; /* entries; every entry's weight N x K, scales bf16 when bf */
    const float *const *x; const int64_t *T; const uint8_t *const *p; const uint8_t *const *s; float *const *out;
} int4_job;

/* rows [r0, r1) of all entries' rows laid end to end (entry e's row n is row e * N + n), every token of the entry */
static void int4_part(void *arg, int part, int parts) {
    const int4_job *j = arg;
    int64_t r0, r1;
    split(j->E * j->N, part, parts, &r0, &r1);
    const int64_t sb = (j->K / 32) * (j->bf ? 2 : 4); /* a row's scale bytes */
    for (int64_t r = r0; r < r1; r++) {
        const int64_t e = r / j->N, n = r % j->N, T = j->T[e];
        const uint8_t *p = j->p[e] + n * (j->K / 2);
        const void *sc = j->s[e] + n * sb;
#if MS_SIMD == 2
        for (int64_t t0 = 0; t0 < T; t0 += FP8_TT) {
            const float *x = j->x[e] + t0 * j->K;
            float *o = j->out[e] + t0 * j->N + n;
            const int tt = (int)(T - t0 < FP8_TT ? T - t0 : FP8_TT);
#define INT4_CASE(TT) (j->bf ? int4_row(x, j->K, p, sc, j->K, o, j->N, TT, 1) : int4_row(x, j->K, p, sc, j->K, o, j->N, TT, 0))
            switch (tt) {
                case 1: INT4_CASE(1); break;
                case 2: INT4_CASE(2); break;
                case 3: INT4_CASE(3); break;
                default: INT4_CASE(4); break;
            }
#undef INT4_CASE
        }
#else
        for (int64_t t = 0; t < T; t++) {
            const float *x = j->x[e] + t * j->K;
            float tot[4][16] = {{0}};
            for (int64_t g = 0; g < j->K / 32; g++) {
                const float s = j->bf ? int4_scale(sc, g, 1) : int4_scale(sc, g, 0);
                for (int l = 0; l < 16; l++) {
                    const uint8_t b = p[16 * g + l];
                    const float part = (float)((b >> 4) - 8) * x[32 * g + 16 + l] + (float)((b & 15) - 8) * x[32 * g + l];
                    tot[g & 3][l] += part * s;
                }
            }
            float sum = 0.0f;
            for (int l = 0; l < 16; l++) sum += (tot[0][l] + tot[1][l]) + (tot[2][l] + tot[3][l]);
            j->out[e][t * j->N + n] = sum;
        }
#endif
    }
}

/* For each entry e < E: outs[e] [Ts[e], N] = xs[e] [Ts[e], K] (contiguous fp32) @ W_e^T, W_e the int4
 * pack-quantized rows ps[e] [N, K/2] (bytes of the int32 words, little-endian) with one scale per 32 elements ss[e]
 * [N, K/32] (bf16 when bf, else fp32); K % 32 == 0. All entries' rows split over the threads together; a (row,
 * token)'s sum is the same bits whatever the other entries, tokens or threads. Returns 0, -1 when out of memory, -2
 * when K is not a multiple of 32 (nothing computed). */
int ms_linear_int4_ptrs(int64_t E, const int64_t *xs, const int64_t *Ts, const int64_t *ps, const int64_t *ss, int bf,
                        const int64_t *outs, int64_t N, int64_t K, int64_t min_rows_per_thread) {
    if (K % 32) return -2;
    if (E <= 0 || N <= 0) return 0;
    int64_t total = 0;
    for (int64_t e = 0; e < E; e++) total += Ts[e];
    /* the prepared inputs' addresses, then the inputs; consecutive entries of one x (an expert's gate and up) share
     * one preparation */
    const float **xe = malloc(sizeof(float *) * (size_t)E + sizeof(float) * (size_t)(total * K + 1));
    if (!xe) return -1;
    float *xp = (float *)(xe + E);
    for (int64_t e = 0, at = 0; e < E; e++) {
        if (e > 0 && xs[e] == xs[e - 1] && Ts[e] == Ts[e - 1]) {
            xe[e] = xe[e - 1];
            continue;
        }
        int4_prepare((const float *)xs[e], Ts[e], K, xp + at);
        xe[e] = xp + at;
        at += Ts[e] * K;
    }
    int4_job j = {E, K, N, bf, xe, Ts, (const uint8_t *const *)ps, (const uint8_t *const *)ss, (float *const *)outs};
    int parts = pool_parts;
    while (parts > 1 && E * N / parts < min_rows_per_thread) parts--;
    pool_run(int4_part, &j, parts);
    free(xe);
    return 0;
}

/* out[T, N] = x[T, K] @ W^T for one int4 weight (p [N, K/2], s [N, K/32]): one entry of ms_linear_int4_ptrs */
int ms_linear_int4(const float *x, int64_t T, int64_t K, const uint8_t *p, const uint8_t *s, int bf, int64_t N,
                   float *out, int64_t min_rows_per_thread) {
    if (T <= 0) return K % 32 ? -2 : 0;
    const int64_t a[5] = {(int64_t)x, T, (int64_t)p, (int64_t)s, (int64_t)out};
    return ms_linear_int4_ptrs(1, a, a + 1, a + 2, a + 3, (int)bf, a + 4, N, K, min_rows_per_thread);
}
