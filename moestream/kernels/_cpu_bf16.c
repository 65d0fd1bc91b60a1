/* moestream native CPU kernels, part 3 (#included at the end of _cpu.c, one translation unit): the opt-in bf16
 * compute path for many rows (EngineOptions.compute_dtype == "bf16"): bf16 weights times bf16-rounded activations
 * with fp32 accumulation, fp32 results. Used for prefill chunks and batch steps only; nothing here runs in fp32 mode.
 *
 * Tokens are the vector lanes, as in _cpu_panel.c, but the activations are rounded to bf16 (round to nearest even)
 * and kept in pairs: a panel holds BP tokens, laid out [K/2][BP] 32-bit words, word (p, t) = the bf16 pair
 * (x[t][2p], x[t][2p+1]). A weight's pair (w[n][2p], w[n][2p+1]) is read in place from the stored bf16 row (no
 * packing, no widening) and broadcast to every lane. With AVX-512 BF16 (-march=native on a CPU that has it) one
 * vdpbf16ps adds both products of a pair into each lane's fp32 sum; elsewhere the pair is widened (bf16 is the top
 * half of fp32) and added with two fp32 FMAs (the portable path: the same inputs, fp32 rounding of the sums may
 * differ in the last bit). Every output is one lane's sum over k in order: it does not depend on how tokens are
 * grouped into panels or calls, nor on the thread count. K (and the GLU's intermediate width) must be even.
 * The grouped GLU runs an expert routed fewer than 16 rows of a call on a row kernel instead (weights in the lanes,
 * brk_rows below): its tokens' sums do not depend on the other tokens or the threads either, but differ in order
 * from a panel's, so a token's result depends on which side of 16 its expert's rows fall.
 * With AVX-512 the parts around the tiles (packing x, the SiLU-GLU activation and bf16 rounding of h, the weighted
 * scatter of the outputs) run in vector code that gives the scalar code's bits (MS_GLU_VEC below). */

#if MS_AVX512 && defined(__AVX512BF16__)
#define MS_BF16DP 1
#else
#define MS_BF16DP 0
#endif

/* register tile: BPR weight rows (BPR even: the GLU writes h in pairs) x BNV vectors of tokens */
#if MS_BF16DP
#ifndef BNV
#define BNV 4
#endif
#ifndef BPR
#define BPR 6 /* 24 accumulators: measured a little ahead of 8 x 2 (16) and well ahead of 12 x 2 (spills) */
#endif
#elif MS_SIMD == 2
#define BNV 2
#define BPR 8
#else
#define BNV 2
#define BPR 4       /* AVX2 has 16 vector registers */
#endif
#define BP (BNV * VW) /* tokens per bf16 panel */
#ifndef BP_PF
#define BP_PF 1 /* 1: prefetch the next row block of the weight while a tile runs */
#endif

int ms_bf16dp(void) { return MS_BF16DP; }
int ms_bf16_panel(void) { return BP; }

/* f32_bf16 (round to nearest even, as torch converts): _cpu_paged.c */

INLINE uint32_t load_pair(const uint16_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static int64_t bp_count(int64_t T) { return (T + BP - 1) / BP; }

/* MS_GLU_VEC 0 (-DMS_GLU_VEC=0) keeps the scalar code of those parts on AVX-512 too (the tests compare the two) */
#ifndef MS_GLU_VEC
#define MS_GLU_VEC MS_AVX512
#endif

#if MS_AVX512
/* ---- AVX-512 helpers of the scalar-looking parts (packing, the GLU activation, the output scatter); each computes
 * exactly what the scalar code below them computes, bit for bit */

/* 16 x 16 transpose of 32-bit lanes: r[i] lane j -> r[j] lane i */
INLINE void tr16(__m512i r[16]) {
    __m512i a[16], b[16];
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) { /* b[4k + c], 128-bit lane L: column 4L + c of rows 4k..4k+3 */
        b[4 * k] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
        b[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
        b[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
        b[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        const __m512i s0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88), s1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xDD);
        const __m512i s2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88);
        const __m512i s3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xDD);
        r[c] = _mm512_shuffle_i32x4(s0, s2, 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
        r[4 + c] = _mm512_shuffle_i32x4(s1, s3, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
    }
}

/* f32_bf16 of every lane, left in the high 16 bits of the lane (the low bits are junk) */
INLINE __m512i vbf16_hi(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                           _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000)); /* quiet NaN: (u >> 16) | 0x40 */
}

/* 16 words (lo | hi << 16) = (f32_bf16(lo lane), f32_bf16(hi lane)) */
INLINE __m512i vbf16_pair(__m512 lo, __m512 hi) {
    return _mm512_or_si512(_mm512_srli_epi32(vbf16_hi(lo), 16),
                           _mm512_and_si512(vbf16_hi(hi), _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* the 32 fp32 values at src rounded to bf16 (f32_bf16's bits), in order: one vector of 32 bf16 (16 pairs) */
INLINE __m512i vbf16_row32(const float *src) {
    const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25,
                                         23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_permutex2var_epi16(vbf16_hi(_mm512_loadu_ps(src)), odd, vbf16_hi(_mm512_loadu_ps(src + 16)));
}

INLINE __mmask16 lanes(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1u); }

#endif

/* exp_f32 / vexp_f32: _cpu_exp.c */

/* exp_f32 (vector code where MS_GLU_VEC) of x[0..n) into y, for the tests */
void ms_glu_exp(const float *x, float *y, int64_t n) {
    int64_t i = 0;
#if MS_GLU_VEC
    for (; i < n; i += 16)
        _mm512_mask_storeu_ps(y + i, lanes(n - i), vexp_f32(_mm512_maskz_loadu_ps(lanes(n - i), x + i)));
#endif
    for (; i < n; i++) y[i] = exp_f32(x[i]);
}

/* panel of tokens rows[0..w) (rows NULL: t0 + 0..w) of fp32 x [*, K] (row stride K) into dst [K/2][BP] words,
 * pairs [pa, pb) only, tokens w..BP zero */
static void bp_pack(const float *x, int64_t K, const int64_t *rows, int64_t t0, int64_t w, uint32_t *dst, int64_t pa,
                    int64_t pb) {
    if (w < BP) memset(dst + pa * BP, 0, sizeof(uint32_t) * (size_t)((pb - pa) * BP));
    int64_t pv = pa;
#if MS_GLU_VEC
    for (int64_t tb = 0; tb < w; tb += 16) {
        const int64_t nt = w - tb < 16 ? w - tb : 16;
        const float *src[16];
        for (int i = 0; i < nt; i++) src[i] = x + (rows ? rows[tb + i] : t0 + tb + i) * K;
        for (pv = pa; pv + 16 <= pb; pv += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = i < nt ? vbf16_row32(src[i] + 2 * pv) : _mm512_setzero_si512();
            tr16(r);
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) _mm512_storeu_si512((void *)(dst + (pv + j) * BP + tb), r[j]);
        }
    }
#endif
    for (int64_t t = 0; t < w; t++) {
        const float *src = x + (rows ? rows[t] : t0 + t) * K;
        for (int64_t p = pv; p < pb; p++)
            dst[p * BP + t] = (uint32_t)f32_bf16(src[2 * p]) | (uint32_t)f32_bf16(src[2 * p + 1]) << 16;
    }
}

#define BP_SLICE 128 /* pairs of inputs per packing task (a panel's packing is split over the threads) */

static int64_t bp_slices(int64_t K) { return (K / 2 + BP_SLICE - 1) / BP_SLICE; }

/* c[r * BP + t] = sum_k w_r[k] * xp[k][t] for BPR weight rows wr[r] (bf16, K = 2 * K2) and the first NV * VW
 * tokens of one panel (NV <= BNV) */
INLINE void bp_tile(const uint16_t *const *wr, const uint32_t *xp, int64_t K2, float *c, const int NV) {
#if MS_BF16DP
    __m512 acc[BPR][BNV];
#pragma GCC unroll 8
    for (int r = 0; r < BPR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < BNV; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < K2; p++) {
#if BP_PF
        if ((p & 15) == 0) /* the same line of the next block's rows (a weight's rows are K apart) */
#pragma GCC unroll 8
            for (int r = 0; r < BPR; r++) _mm_prefetch((const char *)(wr[r] + BPR * 2 * K2 + 2 * p), _MM_HINT_T0);
#endif
        __m512i xv[BNV];
#pragma GCC unroll 4
        for (int v = 0; v < BNV; v++)
            xv[v] = v < NV ? _mm512_loadu_si512((const void *)(xp + p * BP + v * VW)) : _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int r = 0; r < BPR; r++) {
            const __m512i b = _mm512_set1_epi32((int)load_pair(wr[r] + 2 * p));
#pragma GCC unroll 4
            for (int v = 0; v < BNV; v++)
                if (v < NV) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)xv[v], (__m512bh)b);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < BPR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(c + r * BP + v * VW, acc[r][v]);
#else
    vf acc[BPR][2];
#pragma GCC unroll 8
    for (int r = 0; r < BPR; r++) acc[r][0] = acc[r][1] = vzero();
    for (int64_t p = 0; p < K2; p++) {
        const vw_t x0 = vloadw((const uint16_t *)(xp + p * BP));
        const vf e0 = veven(x0), o0 = vodd(x0);
        vf e1 = vzero(), o1 = vzero();
        if (NV > 1) {
            const vw_t x1 = vloadw((const uint16_t *)(xp + p * BP + VW));
            e1 = veven(x1), o1 = vodd(x1);
        }
#pragma GCC unroll 8
        for (int r = 0; r < BPR; r++) {
            const uint32_t v = load_pair(wr[r] + 2 * p);
            const float we = bits_f32(v << 16), wo = bits_f32(v & 0xFFFF0000u);
            const vf be = vbcast(&we), bo = vbcast(&wo);
            acc[r][0] = vfma(bo, o0, vfma(be, e0, acc[r][0]));
            if (NV > 1) acc[r][1] = vfma(bo, o1, vfma(be, e1, acc[r][1]));
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < BPR; r++) {
        vstoref(c + r * BP, acc[r][0]);
        if (NV > 1) vstoref(c + r * BP + VW, acc[r][1]);
    }
#endif
}

/* the tile for a panel holding `tokens` real tokens (only the vectors they fill); rows rr..BPR of the tile repeat
 * row rr - 1 (computed, not used) */
static void bp_run(const uint16_t *w, int64_t K, int64_t n, int rr, const uint32_t *xp, float *c, int64_t tokens) {
    const uint16_t *wr[BPR];
    for (int r = 0; r < BPR; r++) wr[r] = w + (n + (r < rr ? r : rr - 1)) * K;
#if BNV == 4
    if (tokens > 3 * VW) bp_tile(wr, xp, K / 2, c, 4);
    else if (tokens > 2 * VW) bp_tile(wr, xp, K / 2, c, 3);
    else
#endif
    if (tokens > VW) bp_tile(wr, xp, K / 2, c, 2);
    else bp_tile(wr, xp, K / 2, c, 1);
}

/* ---- experts routed fewer than BRK_T rows: the weights in the lanes instead of the tokens. A panel tile gives each
 * token a lane, so an expert of 2 rows left 15 of 16 lanes idle (39 GFLOP/s against 68 for fp32 at a 16-row step,
 * blocks.BF16_GLU_MIN_ROWS). Here a weight row's 32 values fill a vector, each of the expert's tokens (its x or h
 * rounded to bf16, a row of K values) is multiplied into its own accumulators by vdpbf16ps (both products of a pair
 * into a lane's fp32 sum), and the lanes are added at the end of the row: each weight line is loaded once for all
 * the tokens, and a b12-coded row is decoded in registers (b12_block) instead of into scratch. A token's sums then
 * run in another order than on a panel, so its result depends on whether its expert took fewer than BRK_T rows of
 * the call (as the fp32 kernels' choice between GEMV, tiles and panels does). K and I multiples of 64. */
#if MS_BF16DP && MS_SIMD == 2
#define BRK 1
#else
#define BRK 0
#endif
#ifndef BRK_T
#define BRK_T 16 /* experts of fewer rows take the row kernel; PANEL_MIN_T's counterpart */
#endif
#define BRK_G 8    /* tokens a pass over a weight row (16 accumulators) */
#ifndef BRK_PF
#define BRK_PF 4096 /* bytes ahead of a bf16 row's read (b12 rows: B12_PF) */
#endif

#if BRK
/* y[g * ldy] = sum_k w[k] * xb[g * ldb + k] for the G tokens g < G: one weight row, bf16 at wrow or (wrow NULL) the
 * b12 slot s with its table. Two accumulators a token (the block's first and second 32 values), added at the end:
 * with one (both halves in turn) the chain of dependent vdpbf16ps ran 0.8-1.0x as fast from memory at 1-15 rows. */
INLINE void brk_row(const uint16_t *wrow, const uint8_t *s, __m512i table, int64_t K, const uint16_t *xb, int64_t ldb,
                    float *y, int64_t ldy, const int G) {
    __m512 a0[BRK_G], a1[BRK_G];
#pragma GCC unroll 8
    for (int g = 0; g < G; g++) a0[g] = a1[g] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 64) {
        __m512i w0, w1;
        if (wrow) {
            _mm_prefetch((const char *)(wrow + k) + BRK_PF, _MM_HINT_T0);
            _mm_prefetch((const char *)(wrow + k) + BRK_PF + 64, _MM_HINT_T0);
            w0 = _mm512_loadu_si512((const void *)(wrow + k));
            w1 = _mm512_loadu_si512((const void *)(wrow + k + 32));
        } else {
            b12_block(s + k / 64 * 96, table, &w0, &w1);
        }
#pragma GCC unroll 8
        for (int g = 0; g < G; g++) {
            a0[g] = _mm512_dpbf16_ps(a0[g], (__m512bh)w0, (__m512bh)_mm512_loadu_si512((const void *)(xb + g * ldb + k)));
            a1[g] = _mm512_dpbf16_ps(a1[g], (__m512bh)w1,
                                     (__m512bh)_mm512_loadu_si512((const void *)(xb + g * ldb + k + 32)));
        }
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; g++) y[g * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(a0[g], a1[g]));
}

/* one weight row (bf16 at wrow, or the b12 slot s with its table) times the T tokens' bf16 rows, BRK_G a pass */
INLINE void brk_tokens(const uint16_t *wrow, const uint8_t *s, __m512i table, int64_t K, const uint16_t *xb,
                       int64_t ldb, int64_t T, float *y, int64_t ldy) {
    for (int64_t t0 = 0; t0 < T; t0 += BRK_G) {
        const uint16_t *xo = xb + t0 * ldb;
        float *yo = y + t0 * ldy;
        switch (T - t0 < BRK_G ? T - t0 : BRK_G) {
        case 1: brk_row(wrow, s, table, K, xo, ldb, yo, ldy, 1); break;
        case 2: brk_row(wrow, s, table, K, xo, ldb, yo, ldy, 2); break;
        case 3: brk_row(wrow, s, table, K, xo, ldb, yo, ldy, 3); break;
        case 4: brk_row(wrow, s, table, K, xo, ldb, yo, ldy, 4); break;
        case 5: brk_row(wrow, s, table, K, xo, ldb, yo, ldy, 5); break;
        case 6: brk_row(wrow, s, table, K, xo, ldb, yo, ldy, 6); break;
        case 7: brk_row(wrow, s, table, K, xo, ldb, yo, ldy, 7); break;
        default: brk_row(wrow, s, table, K, xo, ldb, yo, ldy, 8); break;
        }
    }
}

/* a coded row with exceptions (pack codes no expert so: a checked file may still hold one), decoded into a stack
 * row first; out of line, so that brk_rows carries no such buffer */
__attribute__((noinline)) static void brk_row_exc(const uint8_t *m, int64_t N, int64_t K, int64_t n, const uint16_t *xb,
                                                  int64_t ldb, int64_t T, float *y, int64_t ldy) {
    uint16_t xrow[B12_MAX_XK];
    b12_decode_row(m, N, K, n, xrow);
    brk_tokens(xrow, NULL, _mm512_setzero_si512(), K, xb, ldb, T, y, ldy);
}

/* y[t * ldy + n - n0] = row n of w [N, K] (bf16, or b12 at a tagged address) times token t's bf16 row xb + t * ldb,
 * for rows [n0, n1) and tokens t < T, BRK_G tokens a pass over the row (a row of two weight rows a pass, so that each
 * load of x served both, ran slower from memory: 15.8 against 22.1 GB/s at one row an expert) */
static void brk_rows(const uint16_t *w, int64_t N, int64_t K, int64_t n0, int64_t n1, const uint16_t *xb, int64_t ldb,
                     int64_t T, float *y, int64_t ldy) {
    const int coded = b12_tagged(w);
    const uint8_t *m = b12_addr(w);
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *wrow = coded ? NULL : w + n * K;
        const uint8_t *s = NULL;
        __m512i table = _mm512_setzero_si512();
        if (coded) {
            const int base = m[N * b12_slot(K) + n];
            if (base == B12_RAW) {
                wrow = b12_raw_row(m, K, n);
            } else if (!b12_plain(base)) {
                brk_row_exc(m, N, K, n, xb, ldb, T, y + (n - n0), ldy);
                continue;
            } else {
                s = m + n * b12_slot(K);
                table = b12_table(base);
            }
        }
        brk_tokens(wrow, s, table, K, xb, ldb, T, y + (n - n0), ldy);
    }
}
#endif

/* experts of fewer rows than brk_limit take the row kernel (0: none; a build without it keeps 0) */
static int brk_limit = BRK ? BRK_T : 0;
int ms_bf16dot_row_limit(void) { return brk_limit; }

/* sets the limit (clamped to [0, BRK_T]; benchmarks and tests compare the two kernels) and returns it */
int ms_bf16dot_set_row_limit(int rows) {
    brk_limit = BRK ? (rows < 0 ? 0 : rows > BRK_T ? BRK_T : rows) : 0;
    return brk_limit;
}

#if BRK
/* fp32 x [K] (K % 32 == 0) rounded to bf16 (f32_bf16's bits) into dst [K] */
static void brk_round_row(const float *x, int64_t K, uint16_t *dst) {
    for (int64_t k = 0; k < K; k += 32) _mm512_storeu_si512((void *)(dst + k), vbf16_row32(x + k));
}
#endif

/* ------------------------------------------------------------------------------------ y = x @ W^T, many W */

typedef struct {
    const float *x;
    int64_t T, K, P, nw;
    const int64_t *ws, *Ns, *outs, *ustart; /* ustart[i]: weight i's first unit (BPR rows each) */
    uint32_t *xp;                            /* P panels [K/2][BP] */
    uint16_t *dec; /* b12-coded weights (tagged addresses): per thread BPR rows of K bf16 values, a unit's decoded */
} bpl_job;

static void bpl_pack_part(void *arg, int64_t part, int64_t parts, int slot) {
    const bpl_job *j = arg;
    (void)parts, (void)slot;
    const int64_t S = bp_slices(j->K), p = part / S, pa = part % S * BP_SLICE;
    const int64_t pb = pa + BP_SLICE < j->K / 2 ? pa + BP_SLICE : j->K / 2;
    const int64_t w = j->T - p * BP < BP ? j->T - p * BP : BP;
    bp_pack(j->x, j->K, NULL, p * BP, w, j->xp + p * BP * (j->K / 2), pa, pb);
}

#define BPL_UNITS 2 /* row blocks of BPR per chunk */

static void bpl_part(void *arg, int64_t chunk, int64_t chunks, int slot) {
    const bpl_job *j = arg;
    (void)chunks;
    float c[BPR * BP];
    int64_t i = 0;
    for (int64_t u = chunk * BPL_UNITS; u < (chunk + 1) * BPL_UNITS && u < j->ustart[j->nw]; u++) {
        while (u >= j->ustart[i + 1]) i++;
        const int64_t N = j->Ns[i], n = (u - j->ustart[i]) * BPR;
        const int rr = (int)(N - n < BPR ? N - n : BPR);
        const uint16_t *w = (const uint16_t *)(intptr_t)j->ws[i];
        int64_t wn = n;
        if (b12_tagged(w)) { /* the unit's rows decoded once for all panels: the bf16 rows' values, the same sums */
            uint16_t *d = j->dec + (int64_t)slot * BPR * j->K;
            for (int r = 0; r < rr; r++) b12_decode_row(b12_addr(w), N, j->K, n + r, d + r * j->K);
            w = d;
            wn = 0;
        }
        float *out = (float *)(intptr_t)j->outs[i];
        for (int64_t p = 0; p < j->P; p++) {
            const int64_t tw = j->T - p * BP < BP ? j->T - p * BP : BP;
            bp_run(w, j->K, wn, rr, j->xp + p * BP * (j->K / 2), c, tw);
            for (int64_t t = 0; t < tw; t++) {
                float *o = out + (p * BP + t) * N + n;
                for (int r = 0; r < rr; r++) o[r] = c[r * BP + t];
            }
        }
    }
}

/* For i < nw: out_i[T, N[i]] = bf16(x)[T, K] @ w_i[N[i], K]^T, fp32 sums, x contiguous fp32, w_i contiguous bf16
 * or b12-coded (a tagged address: each row block decoded into a thread's BPR rows, then the same tile and sums as
 * the bf16 rows'), K even; w_i and out_i at the addresses ws[i], outs[i]. x is rounded into panels once, in `scratch` when its
 * `scratch_bytes` hold them (the caller's buffer, kept across calls so that its pages are faulted in once: with the
 * engine's 64 KiB mmap threshold every malloc of the panels is a fresh mapping), else in memory of the call's own.
 * The same values either way. Returns 0, or -1 when out of memory (the panels: T rounded up to BP, times K, bf16;
 * ms_bf16dot_linear_scratch). */
int64_t ms_bf16dot_linear_scratch(int64_t T, int64_t K) {
    return (int64_t)((sizeof(uint32_t) * (size_t)(bp_count(T) * BP * (K / 2)) + 63) / 64 * 64);
}

int ms_bf16dot_linear_ws(const float *x, int64_t T, int64_t K, int64_t nw, const int64_t *ws, const int64_t *Ns,
                         const int64_t *outs, void *scratch, int64_t scratch_bytes) {
    if (T <= 0 || nw <= 0) return 0;
    if (K <= 0 || K % 2) {
        if (K > 0) return -2;
        for (int64_t i = 0; i < nw; i++) memset((void *)(intptr_t)outs[i], 0, sizeof(float) * (size_t)(T * Ns[i]));
        return 0;
    }
    const int64_t P = bp_count(T);
    const int64_t need = ms_bf16dot_linear_scratch(T, K);
    const int own_xp = !scratch || ((uintptr_t)scratch & 63) || scratch_bytes < need;
    int coded = 0;
    for (int64_t i = 0; i < nw; i++) coded |= b12_tagged((const void *)(intptr_t)ws[i]);
    const int slots = pool_parts > 1 ? pool_parts : 1;
    int64_t *ustart = malloc(sizeof(int64_t) * (size_t)(nw + 1));
    uint32_t *xp = own_xp ? aligned_alloc(64, (size_t)need) : (uint32_t *)scratch;
    uint16_t *dec = coded ? malloc(sizeof(uint16_t) * (size_t)(slots * BPR * K)) : NULL;
    if (!ustart || !xp || (coded && !dec)) {
        free(ustart);
        free(dec);
        if (own_xp) free(xp);
        return -1;
    }
    ustart[0] = 0;
    for (int64_t i = 0; i < nw; i++) ustart[i + 1] = ustart[i] + (Ns[i] + BPR - 1) / BPR;
    bpl_job j = {x, T, K, P, nw, ws, Ns, outs, ustart, xp, dec};
    const int64_t chunks = (ustart[nw] + BPL_UNITS - 1) / BPL_UNITS;
    if (pool_parts <= 1) {
        for (int64_t p = 0; p < P * bp_slices(K); p++) bpl_pack_part(&j, p, P * bp_slices(K), 0);
        for (int64_t c = 0; c < chunks; c++) bpl_part(&j, c, chunks, 0);
    } else {
        pool_run_chunks(bpl_pack_part, &j, P * bp_slices(K), pool_parts);
        pool_run_chunks(bpl_part, &j, chunks, pool_parts);
    }
    if (own_xp) free(xp);
    free(dec);
    free(ustart);
    return 0;
}

/* ms_bf16dot_linear_ws with panels of the call's own */
int ms_bf16dot_linear(const float *x, int64_t T, int64_t K, int64_t nw, const int64_t *ws, const int64_t *Ns,
                      const int64_t *outs) {
    return ms_bf16dot_linear_ws(x, T, K, nw, ws, Ns, outs, NULL, 0);
}

/* ------------------------------------------------------------------------- grouped GLU experts in bf16 */

typedef struct {
    int64_t E, I, K, D;
    const uint16_t *const *gate, *const *up, *const *down;
    const int64_t *start, *count, *row, *poff, *ustart; /* poff[e]: expert e's first panel; ustart[e]: first unit */
    const float *wt, *x;
    uint32_t *xp, *hp; /* panels: x [K/2][BP] and h [I/2][BP] words each */
    float *out;
    int act;
    float beta, lbeta;
    uint16_t *dec; /* b12-coded experts (_cpu_b12.c): per part dec_len bf16 values to decode a unit's rows into */
    int64_t dec_len;
    /* experts on the row kernel (brk_rows): roff[e] >= 0 their first row in xr [., K] and hr [., I] (bf16 x and h
     * rows, one per pair in the expert's order), -1 for experts on panels */
    const int64_t *roff;
    uint16_t *xr, *hr;
} bpg_job;

static void bpg_pack_part(void *arg, int64_t task, int64_t tasks, int slot) {
    const bpg_job *j = arg;
    (void)tasks, (void)slot;
    const int64_t S = bp_slices(j->K), part = task / S, pa = task % S * BP_SLICE;
    const int64_t pb = pa + BP_SLICE < j->K / 2 ? pa + BP_SLICE : j->K / 2;
    int64_t e = 0;
    while (e + 1 < j->E && part >= j->poff[e + 1]) e++;
    const int64_t p = part - j->poff[e], a = j->start[e] + p * BP;
    const int64_t w = j->count[e] - p * BP < BP ? j->count[e] - p * BP : BP;
    bp_pack(j->x, j->K, j->row + a, 0, w, j->xp + part * BP * (j->K / 2), pa, pb);
}

#ifndef BPG_ROWS
#define BPG_ROWS (4 * BPR) /* gate/up rows per unit of pass 1 */
#endif

/* pass 1, unit u: gate/up rows of one expert, h = bf16(act(gate x, up x)) into its h panels */
static void bpg_up_part(void *arg, int64_t chunk, int64_t chunks, int slot) {
    const bpg_job *j = arg;
    (void)chunks;
    float cg[BPR * BP] __attribute__((aligned(64))), cu[BPR * BP] __attribute__((aligned(64)));
#if MS_GLU_VEC
    const int vec = j->act == ACT_SILU;
#endif
    int64_t e = 0;
    while (chunk >= j->ustart[e + 1]) e++;
    const int64_t T = j->count[e], P = bp_count(T), I2 = j->I / 2;
    const int64_t n0 = (chunk - j->ustart[e]) * BPG_ROWS, n1 = n0 + BPG_ROWS < j->I ? n0 + BPG_ROWS : j->I;
#if BRK
    if (j->roff[e] >= 0) { /* h = bf16(act(gate x, up x)) into the expert's h rows */
        float g[BRK_T * BPG_ROWS], u[BRK_T * BPG_ROWS];
        const int64_t r0 = j->roff[e];
        brk_rows(j->gate[e], j->I, j->K, n0, n1, j->xr + r0 * j->K, j->K, T, g, BPG_ROWS);
        brk_rows(j->up[e], j->I, j->K, n0, n1, j->xr + r0 * j->K, j->K, T, u, BPG_ROWS);
        for (int64_t t = 0; t < T; t++) {
            uint16_t *h = j->hr + (r0 + t) * j->I;
            const float *gt = g + t * BPG_ROWS, *ut = u + t * BPG_ROWS;
            if (j->act == ACT_SILU)
                for (int64_t n = n0; n < n1; n++) h[n] = f32_bf16(silu_glu(gt[n - n0], ut[n - n0]));
            else
                for (int64_t n = n0; n < n1; n++) h[n] = f32_bf16(glu_act(j->act, gt[n - n0], ut[n - n0], j->beta, j->lbeta));
        }
        return;
    }
#endif
    /* the unit's rows as bf16: the matrices themselves (from row 0), or a coded expert's rows decoded once */
    const uint16_t *gw = j->gate[e], *uw = j->up[e];
    int64_t base = 0;
    if (b12_tagged(gw) || b12_tagged(uw)) {
        uint16_t *dec = j->dec + (int64_t)slot * j->dec_len;
        gw = w_bf16_rows(gw, j->I, j->K, n0, n1 - n0, dec);
        uw = w_bf16_rows(uw, j->I, j->K, n0, n1 - n0, dec + BPG_ROWS * j->K);
        base = n0;
    }
    /* panels outer: each row block of the unit reads the panel while it is in L2 (rows outer would re-read every
     * panel per row block, from L3 once they outgrow L2; measured about even at 64-512 rows of 1024 inputs) */
    for (int64_t p = 0; p < P; p++) {
        const int64_t w = T - p * BP < BP ? T - p * BP : BP;
        const uint32_t *xp = j->xp + (j->poff[e] + p) * BP * (j->K / 2);
        for (int64_t n = n0; n < n1; n += BPR) {
            const int rr = (int)(n1 - n < BPR ? n1 - n : BPR);
            bp_run(gw, j->K, n - base, rr, xp, cg, w);
            bp_run(uw, j->K, n - base, rr, xp, cu, w);
#if MS_GLU_VEC
            if (vec) { /* rr is even (n and I are): rows n + r, n + r + 1 make one row of words */
                uint32_t *h32 = j->hp + (j->poff[e] + p) * BP * I2 + n / 2 * BP;
                for (int r = 0; r < rr; r += 2)
                    for (int64_t t = 0; t < w; t += 16) {
                        __m512 hv[2];
#pragma GCC unroll 2
                        for (int i = 0; i < 2; i++) { /* silu_glu: g / (1 + exp_f32(-g)) * u */
                            const __m512 g = _mm512_loadu_ps(cg + (r + i) * BP + t);
                            const __m512 ex = vexp_f32(_mm512_castsi512_ps(
                                _mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32((int)0x80000000u))));
                            hv[i] = _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), ex)),
                                                  _mm512_loadu_ps(cu + (r + i) * BP + t));
                        }
                        _mm512_mask_storeu_epi32(h32 + r / 2 * BP + t, lanes(w - t), vbf16_pair(hv[0], hv[1]));
                    }
                continue;
            }
#endif
            uint16_t *h = (uint16_t *)(j->hp + (j->poff[e] + p) * BP * I2);
            for (int r = 0; r < rr; r++) {
                const int64_t q = (n + r) / 2 * BP * 2 + ((n + r) & 1);
                if (j->act == ACT_SILU)
                    for (int64_t t = 0; t < w; t++) h[q + 2 * t] = f32_bf16(silu_glu(cg[r * BP + t], cu[r * BP + t]));
                else
                    for (int64_t t = 0; t < w; t++)
                        h[q + 2 * t] = f32_bf16(glu_act(j->act, cg[r * BP + t], cu[r * BP + t], j->beta, j->lbeta));
            }
        }
    }
}

#define BPG_COLS (4 * BPR) /* output columns per chunk of pass 2 */

/* pass 2, chunk c: output columns [c0, c1) of every expert, added into out in the experts' order (each output
 * gets one fused multiply-add per expert routed its token) */
static void bpg_down_part(void *arg, int64_t chunk, int64_t chunks, int slot) {
    const bpg_job *j = arg;
    (void)chunks;
    float c[BPG_COLS * BP] __attribute__((aligned(64))); /* [column - c0][token of the panel] */
    memset(c, 0, sizeof(c));
    const int64_t c0 = chunk * BPG_COLS, c1 = c0 + BPG_COLS < j->D ? c0 + BPG_COLS : j->D, I2 = j->I / 2;
    const int64_t nc = c1 - c0;
    for (int64_t e = 0; e < j->E; e++) {
        const int64_t T = j->count[e], P = bp_count(T), a0 = j->start[e];
        const uint16_t *dw = j->down[e];
        int64_t base = 0;
#if BRK
        if (T > 0 && j->roff[e] >= 0) { /* columns c0..c1 of the expert's tokens, added in its order */
            float y[BRK_T * BPG_COLS];
            brk_rows(dw, j->D, j->I, c0, c1, j->hr + j->roff[e] * j->I, j->I, T, y, BPG_COLS);
            for (int64_t t = 0; t < T; t++) {
                float *o = j->out + j->row[a0 + t] * j->D + c0;
                const float wt = j->wt[a0 + t];
                for (int64_t r = 0; r < nc; r++) o[r] += wt * y[t * BPG_COLS + r];
            }
            continue;
        }
#endif
        if (T > 0 && b12_tagged(dw)) { /* a coded expert's rows c0..c1 decoded once for all its panels */
            dw = w_bf16_rows(dw, j->D, j->I, c0, nc, j->dec + (int64_t)slot * j->dec_len);
            base = c0;
        }
        for (int64_t p = 0; p < P; p++) {
            const int64_t w = T - p * BP < BP ? T - p * BP : BP;
            const uint32_t *hp = j->hp + (j->poff[e] + p) * BP * I2;
            const float *wts = j->wt + a0 + p * BP;
            const int64_t *rows = j->row + a0 + p * BP;
            for (int64_t t = 0; t < w; t++) { /* the output rows' lines, fetched while the tiles run */
                const char *o = (const char *)(j->out + rows[t] * j->D + c0);
                for (int64_t b = 0; b < nc * 4; b += 64) __builtin_prefetch(o + b, 1, 3);
                __builtin_prefetch(o + nc * 4 - 1, 1, 3);
            }
            for (int64_t n = c0; n < c1; n += BPR)
                bp_run(dw, j->I, n - base, (int)(c1 - n < BPR ? c1 - n : BPR), hp, c + (n - c0) * BP, w);
#if MS_GLU_VEC && BPG_COLS <= 32
            for (int64_t tb = 0; tb < w; tb += 16) {
                __m512i lo[16], hi[16];
                for (int i = 0; i < 16; i++) lo[i] = _mm512_load_si512((const void *)(c + i * BP + tb));
                tr16(lo);
                if (nc > 16) {
                    for (int i = 0; i < 16; i++)
                        hi[i] = i < BPG_COLS - 16 ? _mm512_load_si512((const void *)(c + (16 + i) * BP + tb))
                                                  : _mm512_setzero_si512();
                    tr16(hi);
                }
                const __mmask16 mlo = lanes(nc), mhi = lanes(nc - 16);
                for (int64_t i = 0; i < 16 && tb + i < w; i++) {
                    const __m512 wt = _mm512_set1_ps(wts[tb + i]);
                    float *o = j->out + rows[tb + i] * j->D + c0;
                    _mm512_mask_storeu_ps(o, mlo, _mm512_fmadd_ps(wt, _mm512_castsi512_ps(lo[i]), _mm512_maskz_loadu_ps(mlo, o)));
                    if (nc > 16)
                        _mm512_mask_storeu_ps(o + 16, mhi, _mm512_fmadd_ps(wt, _mm512_castsi512_ps(hi[i]),
                                                                           _mm512_maskz_loadu_ps(mhi, o + 16)));
                }
            }
#else
            for (int64_t t = 0; t < w; t++) {
                float *o = j->out + rows[t] * j->D + c0;
                for (int64_t r = 0; r < nc; r++) o[r] += wts[t] * c[r * BP + t];
            }
#endif
        }
    }
}

/* ms_moe_glu_bf16's contract (experts, their bf16 gate [I, K], up [I, K], down [D, I], routing ids / wts or every
 * token through every expert, out fp32 [T, D] added into) computed in bf16: x and the activations h rounded to bf16,
 * products summed in fp32. K and I even. ws (ws_bytes): the caller's scratch, used when it holds this call's
 * (routing entries, then the x and h panels 64-byte aligned; fused.glu_call_scratch bounds it), else the call
 * mallocs its own: a caller making several calls in a row passes one buffer, so its pages are faulted in once
 * instead of once a call (with the engine's 64 KiB mmap threshold every malloc of the panels is a fresh mapping).
 * The same values either way. Returns 0, -1 when out of memory, -2 for an odd K or I. */
int ms_bf16dot_glu_ws(int64_t E, const int64_t *experts, const int64_t *gates, const int64_t *ups, const int64_t *downs,
                      int64_t I, int64_t K, int64_t D, const float *x, int64_t T, const int64_t *ids, const float *wts,
                      int64_t k, float *out, int act, float beta, float lbeta, void *ws, int64_t ws_bytes) {
    if (E <= 0 || T <= 0 || D <= 0) return 0;
    if (K % 2 || I % 2 || K <= 0 || I <= 0) return -2;
    const int64_t A = glu_pairs(E, experts, T, ids, k);
    if (A == 0) return 0;
    const size_t mem_bytes = sizeof(int64_t) * (size_t)(5 * E + 2 + A) + sizeof(float) * (size_t)A;
    const size_t mem_room = (mem_bytes + 63) / 64 * 64;
    const int own_mem = !ws || (int64_t)mem_room > ws_bytes;
    char *mem = own_mem ? malloc(mem_bytes) : (char *)ws;
    if (!mem) return -1;
    int64_t *start = (int64_t *)mem, *count = start + E, *poff = count + E, *ustart = poff + E + 1;
    int64_t *roff = ustart + E + 1, *row = roff + E;
    float *wt = (float *)(row + A);
    glu_group(E, experts, T, ids, wts, k, start, count, row, wt, NULL);
    poff[0] = ustart[0] = 0;
    int64_t R = 0; /* rows of the experts on the row kernel */
    for (int64_t e = 0; e < E; e++) {
        const int rows = count[e] > 0 && count[e] < brk_limit && K % 64 == 0 && I % 64 == 0; /* brk_limit 0: no BRK */
        roff[e] = rows ? R : -1;
        R += rows ? count[e] : 0;
        poff[e + 1] = poff[e] + (rows ? 0 : bp_count(count[e]));
        ustart[e + 1] = ustart[e] + (count[e] ? (I + BPG_ROWS - 1) / BPG_ROWS : 0);
    }
    const int64_t P = poff[E];
    /* x and h panels, then the row experts' bf16 x and h rows (as many bytes a pair as its panel words) */
    const size_t xp_bytes = (sizeof(uint32_t) * (size_t)(P * BP * (K / 2 + I / 2)) + sizeof(uint16_t) * (size_t)(R * (K + I)) +
                             63) / 64 * 64;
    /* the panels after the routing entries in ws, at a 64-byte boundary of the address */
    char *room = own_mem ? NULL : (char *)(((uintptr_t)ws + mem_room + 63) / 64 * 64);
    const int own_xp = own_mem || room + xp_bytes > (char *)ws + ws_bytes;
    uint32_t *xp = own_xp ? aligned_alloc(64, xp_bytes) : (uint32_t *)room;
    if (!xp) {
        if (own_mem) free(mem);
        return -1;
    }
    uint32_t *hp = xp + P * BP * (K / 2);
    memset(hp, 0, sizeof(uint32_t) * (size_t)(P * BP * (I / 2))); /* padded tokens' h stay zero */
    uint16_t *xr = (uint16_t *)(hp + P * BP * (I / 2)), *hr = xr + R * K;
#if BRK
    for (int64_t e = 0; e < E; e++)
        if (roff[e] >= 0)
            for (int64_t t = 0; t < count[e]; t++) brk_round_row(x + row[start[e] + t] * K, K, xr + (roff[e] + t) * K);
#endif
    int coded = 0; /* b12 experts on panels: each part decodes a unit's gate and up rows, or a chunk's down rows */
    for (int64_t e = 0; e < E; e++)
        if (roff[e] < 0)
            coded |= b12_tagged((const void *)gates[e]) | b12_tagged((const void *)ups[e]) | b12_tagged((const void *)downs[e]);
    const int64_t dec_len = coded ? (2 * BPG_ROWS * K > BPG_COLS * I ? 2 * BPG_ROWS * K : BPG_COLS * I) + 32 : 0;
    uint16_t *dec = coded ? aligned_alloc(64, (size_t)((pool_parts * dec_len * 2 + 63) / 64 * 64)) : NULL;
    if (coded && !dec) {
        if (own_xp) free(xp);
        if (own_mem) free(mem);
        return -1;
    }
    bpg_job j = {E, I, K, D, (const uint16_t *const *)gates, (const uint16_t *const *)ups,
                 (const uint16_t *const *)downs, start, count, row, poff, ustart, wt, x, xp, hp, out, act, beta, lbeta,
                 dec, dec_len, roff, xr, hr};
    const int64_t cols = (D + BPG_COLS - 1) / BPG_COLS;
    if (pool_parts <= 1) {
        for (int64_t p = 0; p < P * bp_slices(K); p++) bpg_pack_part(&j, p, P * bp_slices(K), 0);
        for (int64_t u = 0; u < ustart[E]; u++) bpg_up_part(&j, u, ustart[E], 0);
        for (int64_t c = 0; c < cols; c++) bpg_down_part(&j, c, cols, 0);
    } else {
        pool_run_chunks(bpg_pack_part, &j, P * bp_slices(K), pool_parts);
        pool_run_chunks(bpg_up_part, &j, ustart[E], pool_parts);
        pool_run_chunks(bpg_down_part, &j, cols, pool_parts);
    }
    free(dec);
    if (own_xp) free(xp);
    if (own_mem) free(mem);
    return 0;
}

/* ms_bf16dot_glu_ws with its own scratch */
int ms_bf16dot_glu(int64_t E, const int64_t *experts, const int64_t *gates, const int64_t *ups, const int64_t *downs,
                   int64_t I, int64_t K, int64_t D, const float *x, int64_t T, const int64_t *ids, const float *wts,
                   int64_t k, float *out, int act, float beta, float lbeta) {
    return ms_bf16dot_glu_ws(E, experts, gates, ups, downs, I, K, D, x, T, ids, wts, k, out, act, beta, lbeta, NULL, 0);
}

/* ---------------------------------------------- MXFP4 weights times bf16-rounded activations (compute "bf16") */
/* ms_linear_mxfp4_bf16 computes what ms_linear_mxfp4 computes with every x rounded to bf16 (f32_bf16), fp32 sums:
 * the bf16 compute path's precision for MXFP4 products, one-token decode included (models/blocks.py).
 * With AVX-512 BF16 a group of four blocks runs as two halves of two blocks: their 32 packed bytes widen to 32
 * words (vpmovzxbw), vpermw through a 32-entry table of the E2M1 values' bf16 bits (exact) gives the low nibbles'
 * weights (the index's bit 4, the high nibble's low bit, selects the table's second copy), a 4-bit shift the high
 * nibbles'; vdpbf16ps multiplies each pair of weights by the prepared pair of x and sums them per fp32 lane (lanes
 * 0-7 the first block, 8-15 the second); one FMA a half applies the two blocks' scales (2^(s-127), exact) to those
 * sums. A token's sums take the same instructions whatever the other tokens of its call, its tile or the threads.
 * Elsewhere x is rounded into a copy and the fp32 kernel runs on it (the same inputs, sums in another order). */
#if MS_BF16DP
#define MXB_GROUP 128 /* prepared bf16 words of x per four blocks */
#ifndef MXB_PF
#define MXB_PF 1024   /* software prefetch distance of the packed rows (measured: 1-2 KiB best, none 0.6x) */
#endif
#ifndef MXB_PF_FEW
/* tiles of 1-4 tokens: prefetch this far into L2 instead (bench/ab_builds.py mxfp4_bf16, K3's experts, 2 threads,
 * against 1 KiB into L1: 4 KiB into L2 1.09x / 1.12x at one token, 1.05x at 4; tiles of 8 at 16 rows 0.95x, so they
 * keep L1) */
#define MXB_PF_FEW 4096
#endif
#ifndef MXB_FEW_HINT
#define MXB_FEW_HINT _MM_HINT_T1
#endif
#define MXB_CHUNK 64  /* blocks whose scales are converted at a time */

static int64_t mxb_stride(int64_t K) { return (K / 32 + 3) / 4 * MXB_GROUP; }

/* x [T, K] rounded to bf16 in the order the tiles read: per group of four blocks, words [low nibbles of blocks 0-1,
 * their high nibbles, low nibbles of blocks 2-3, their high nibbles], word j of a run of 32 = byte j of the two
 * blocks' 32 packed bytes; zeros past the last block */
static void mxb_prepare(const float *x, int64_t T, int64_t K, int layout, uint16_t *xp) {
    const int64_t nb = K / 32, ld = mxb_stride(K);
    for (int64_t t = 0; t < T; t++)
        for (int64_t b = 0; b < nb; b += 4) {
            uint16_t *g = xp + t * ld + b / 4 * MXB_GROUP;
            for (int run = 0; run < 4; run++) /* run = 2 * half + hi */
                for (int j = 0; j < 32; j++) {
                    const int64_t blk = b + 2 * (run >> 1) + j / 16;
                    g[run * 32 + j] = blk < nb ? f32_bf16(x[t * K + blk * 32 + mx_input(layout, j % 16, run & 1)]) : 0;
                }
        }
}

static void mxb_prep(const float *x, int64_t T, int64_t K, int layout, void *xp) { mxb_prepare(x, T, K, layout, xp); }

INLINE void mxb_tile(const uint16_t *xp, int64_t ldx, const uint8_t *p, const uint8_t *s, int64_t K, float *out,
                     int64_t ldo, const int TT) {
    static const uint16_t table[32] = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                                       0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,
                                       0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                                       0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};
    const __m512i tab = _mm512_loadu_si512(table);
    const __m512i first = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i second = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
    const int64_t nb = K / 32;
    float sc[MXB_CHUNK + 4];
    __m512 acc[TILE_T][2];
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += MXB_CHUNK) {
        const int64_t n = nb - b0 < MXB_CHUNK ? nb - b0 : MXB_CHUNK;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(s + b0 + i)));
            _mm512_storeu_si512(sc + i, _mm512_max_epi32(_mm512_slli_epi32(e, 23), _mm512_set1_epi32(1 << 22)));
        }
        for (; i < n; i++) sc[i] = e8m0(s[b0 + i]);
        for (; i < n + 4; i++) sc[i] = 0.0f; /* a last group's missing blocks: zero weights, zero x */
        for (i = 0; i < n; i += 4) {
            const int64_t b = b0 + i, rem = nb - b;
            const uint8_t *q = p + b * 16;
            __m256i qa, qc;
            if (TT <= 4) _mm_prefetch((const char *)(q + MXB_PF_FEW), MXB_FEW_HINT);
            else _mm_prefetch((const char *)(q + MXB_PF), _MM_HINT_T0);
            if (rem >= 4) {
                qa = _mm256_loadu_si256((const __m256i *)q);
                qc = _mm256_loadu_si256((const __m256i *)(q + 32));
            } else { /* never read past the row's last block */
                qa = _mm256_maskz_loadu_epi8(rem >= 2 ? 0xFFFFFFFFu : 0xFFFFu, q);
                qc = _mm256_maskz_loadu_epi8(rem == 3 ? 0xFFFFu : 0u, q + 32);
            }
            const __m512i a = _mm512_cvtepu8_epi16(qa), c = _mm512_cvtepu8_epi16(qc);
            const __m512bh la = (__m512bh)_mm512_permutexvar_epi16(a, tab);
            const __m512bh ha = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(a, 4), tab);
            const __m512bh lc = (__m512bh)_mm512_permutexvar_epi16(c, tab);
            const __m512bh hc = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(c, 4), tab);
            const __m512 s4 = _mm512_castps128_ps512(_mm_loadu_ps(sc + i));
            const __m512 sa = _mm512_permutexvar_ps(first, s4), sc2 = _mm512_permutexvar_ps(second, s4);
#pragma GCC unroll 8
            for (int t = 0; t < TT; t++) {
                const uint16_t *xg = xp + t * ldx + b / 4 * MXB_GROUP;
                __m512 pa = _mm512_dpbf16_ps(_mm512_setzero_ps(), la, (__m512bh)_mm512_loadu_si512(xg));
                __m512 pc = _mm512_dpbf16_ps(_mm512_setzero_ps(), lc, (__m512bh)_mm512_loadu_si512(xg + 64));
                pa = _mm512_dpbf16_ps(pa, ha, (__m512bh)_mm512_loadu_si512(xg + 32));
                pc = _mm512_dpbf16_ps(pc, hc, (__m512bh)_mm512_loadu_si512(xg + 96));
                acc[t][0] = _mm512_fmadd_ps(pa, sa, acc[t][0]);
                acc[t][1] = _mm512_fmadd_ps(pc, sc2, acc[t][1]);
            }
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) out[t * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]));
}

#define MXB_CASE(TT) \
    case TT: mxb_tile(xp, ldx, p, s, K, out, ldo, TT); break;

static void mxb_part(void *arg, int part, int parts) {
    mx_job *j = arg;
    int64_t n0, n1;
    split(j->N, part, parts, &n0, &n1);
    const int64_t K = j->K, half = K / 2, nb = K / 32, ldx = j->ldx;
    for (int64_t e = 0; e < j->E; e++)
        for (int64_t n = n0; n < n1 && j->T[e] > 0; n++)
            for (int64_t t0 = 0; t0 < j->T[e]; t0 += TILE_T) {
                const int tt = (int)(j->T[e] - t0 < TILE_T ? j->T[e] - t0 : TILE_T);
                const uint16_t *xp = (const uint16_t *)j->x[e] + t0 * ldx;
                const uint8_t *p = j->p[e] + n * half, *s = j->s[e] + n * nb;
                float *out = j->out[e] + t0 * j->N + n;
                const int64_t ldo = j->N;
                switch (tt) {
                    MXB_CASE(1) MXB_CASE(2) MXB_CASE(3) MXB_CASE(4) MXB_CASE(5) MXB_CASE(6) MXB_CASE(7) MXB_CASE(8)
                }
            }
}
#endif

/* ms_linear_mxfp4's contract (entries, 0xFF scale check, return codes) with x rounded to bf16 */
int ms_linear_mxfp4_bf16(int64_t E, const int64_t *xs, const int64_t *Ts, const int64_t *ps, const int64_t *ss,
                         const int64_t *outs, int64_t N, int64_t K, int layout, int64_t min_rows_per_thread,
                         int check255) {
    if (E <= 0 || N <= 0) return 0;
    const int bad = check255 ? mx_find255(E, ss, N, K) : 0;
    if (bad) return bad;
    if (K <= 0) return ms_linear_mxfp4(E, xs, Ts, ps, ss, outs, N, K, layout, min_rows_per_thread, 0); /* zeros */
#if MS_BF16DP
    const int64_t ldx = mxb_stride(K);
    void **x = mx_inputs(E, xs, Ts, K, layout, ldx, sizeof(uint16_t), mxb_prep);
    if (!x) return -1;
    mx_job j = {E, N, K, ldx, x, Ts, (const uint8_t **)ps, (const uint8_t **)ss, (float **)outs};
    int parts = pool_parts;
    while (parts > 1 && N / parts < min_rows_per_thread) parts--;
    pool_run(mxb_part, &j, parts);
    free(x);
    return 0;
#else
    int64_t total = 0;
    for (int64_t e = 0; e < E; e++) total += Ts[e] > 0 ? Ts[e] : 0;
    void *mem = malloc((size_t)E * sizeof(int64_t) + sizeof(float) * (size_t)(total * K));
    if (!mem) return -1;
    int64_t *rounded = mem;
    float *xr = (float *)(rounded + E);
    for (int64_t e = 0; e < E; e++) {
        if (e > 0 && xs[e] == xs[e - 1] && Ts[e] == Ts[e - 1]) { /* rounded once (and prepared once) */
            rounded[e] = rounded[e - 1];
            continue;
        }
        const float *src = (const float *)(intptr_t)xs[e];
        const int64_t n = (Ts[e] > 0 ? Ts[e] : 0) * K;
        for (int64_t i = 0; i < n; i++) xr[i] = bits_f32((uint32_t)f32_bf16(src[i]) << 16);
        rounded[e] = (int64_t)(intptr_t)xr;
        xr += n;
    }
    const int r = ms_linear_mxfp4(E, rounded, Ts, ps, ss, outs, N, K, layout, min_rows_per_thread, 0);
    free(mem);
    return r;
#endif
}
