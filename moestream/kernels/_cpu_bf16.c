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
 * grouped into panels or calls, nor on the thread count. K (and the GLU's intermediate width) must be even. */

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

/* panel of tokens rows[0..w) (rows NULL: t0 + 0..w) of fp32 x [*, K] (row stride K) into dst [K/2][BP] words,
 * tokens w..BP zero */
static void bp_pack(const float *x, int64_t K, const int64_t *rows, int64_t t0, int64_t w, uint32_t *dst) {
    const int64_t K2 = K / 2;
    if (w < BP) memset(dst, 0, sizeof(uint32_t) * (size_t)(K2 * BP));
    for (int64_t t = 0; t < w; t++) {
        const float *src = x + (rows ? rows[t] : t0 + t) * K;
        for (int64_t p = 0; p < K2; p++)
            dst[p * BP + t] = (uint32_t)f32_bf16(src[2 * p]) | (uint32_t)f32_bf16(src[2 * p + 1]) << 16;
    }
}

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

/* ------------------------------------------------------------------------------------ y = x @ W^T, many W */

typedef struct {
    const float *x;
    int64_t T, K, P, nw;
    const int64_t *ws, *Ns, *outs, *ustart; /* ustart[i]: weight i's first unit (BPR rows each) */
    uint32_t *xp;                            /* P panels [K/2][BP] */
} bpl_job;

static void bpl_pack_part(void *arg, int64_t p, int64_t parts, int slot) {
    const bpl_job *j = arg;
    (void)parts, (void)slot;
    const int64_t w = j->T - p * BP < BP ? j->T - p * BP : BP;
    bp_pack(j->x, j->K, NULL, p * BP, w, j->xp + p * BP * (j->K / 2));
}

#define BPL_UNITS 2 /* row blocks of BPR per chunk */

static void bpl_part(void *arg, int64_t chunk, int64_t chunks, int slot) {
    const bpl_job *j = arg;
    (void)chunks, (void)slot;
    float c[BPR * BP];
    int64_t i = 0;
    for (int64_t u = chunk * BPL_UNITS; u < (chunk + 1) * BPL_UNITS && u < j->ustart[j->nw]; u++) {
        while (u >= j->ustart[i + 1]) i++;
        const int64_t N = j->Ns[i], n = (u - j->ustart[i]) * BPR;
        const int rr = (int)(N - n < BPR ? N - n : BPR);
        const uint16_t *w = (const uint16_t *)(intptr_t)j->ws[i];
        float *out = (float *)(intptr_t)j->outs[i];
        for (int64_t p = 0; p < j->P; p++) {
            const int64_t tw = j->T - p * BP < BP ? j->T - p * BP : BP;
            bp_run(w, j->K, n, rr, j->xp + p * BP * (j->K / 2), c, tw);
            for (int64_t t = 0; t < tw; t++) {
                float *o = out + (p * BP + t) * N + n;
                for (int r = 0; r < rr; r++) o[r] = c[r * BP + t];
            }
        }
    }
}

/* For i < nw: out_i[T, N[i]] = bf16(x)[T, K] @ w_i[N[i], K]^T, fp32 sums, x contiguous fp32, w_i contiguous bf16,
 * K even; w_i and out_i at the addresses ws[i], outs[i]. x is rounded into panels once. Returns 0, or -1 when out
 * of memory (the panels: T rounded up to BP, times K, bf16). */
int ms_bf16dot_linear(const float *x, int64_t T, int64_t K, int64_t nw, const int64_t *ws, const int64_t *Ns,
                      const int64_t *outs) {
    if (T <= 0 || nw <= 0) return 0;
    if (K <= 0 || K % 2) {
        if (K > 0) return -2;
        for (int64_t i = 0; i < nw; i++) memset((void *)(intptr_t)outs[i], 0, sizeof(float) * (size_t)(T * Ns[i]));
        return 0;
    }
    const int64_t P = bp_count(T);
    int64_t *ustart = malloc(sizeof(int64_t) * (size_t)(nw + 1));
    uint32_t *xp = aligned_alloc(64, (sizeof(uint32_t) * (size_t)(P * BP * (K / 2)) + 63) / 64 * 64);
    if (!ustart || !xp) {
        free(ustart);
        free(xp);
        return -1;
    }
    ustart[0] = 0;
    for (int64_t i = 0; i < nw; i++) ustart[i + 1] = ustart[i] + (Ns[i] + BPR - 1) / BPR;
    bpl_job j = {x, T, K, P, nw, ws, Ns, outs, ustart, xp};
    const int64_t chunks = (ustart[nw] + BPL_UNITS - 1) / BPL_UNITS;
    if (pool_parts <= 1) {
        for (int64_t p = 0; p < P; p++) bpl_pack_part(&j, p, P, 0);
        for (int64_t c = 0; c < chunks; c++) bpl_part(&j, c, chunks, 0);
    } else {
        pool_run_chunks(bpl_pack_part, &j, P, pool_parts);
        pool_run_chunks(bpl_part, &j, chunks, pool_parts);
    }
    free(xp);
    free(ustart);
    return 0;
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
} bpg_job;

static void bpg_pack_part(void *arg, int64_t part, int64_t parts, int slot) {
    const bpg_job *j = arg;
    (void)parts, (void)slot;
    int64_t e = 0;
    while (e + 1 < j->E && part >= j->poff[e + 1]) e++;
    const int64_t p = part - j->poff[e], a = j->start[e] + p * BP;
    const int64_t w = j->count[e] - p * BP < BP ? j->count[e] - p * BP : BP;
    bp_pack(j->x, j->K, j->row + a, 0, w, j->xp + part * BP * (j->K / 2));
}

#define BPG_ROWS (4 * BPR) /* gate/up rows per unit of pass 1 */

/* pass 1, unit u: gate/up rows of one expert, h = bf16(act(gate x, up x)) into its h panels */
static void bpg_up_part(void *arg, int64_t chunk, int64_t chunks, int slot) {
    const bpg_job *j = arg;
    (void)chunks, (void)slot;
    float cg[BPR * BP], cu[BPR * BP];
    int64_t e = 0;
    while (chunk >= j->ustart[e + 1]) e++;
    const int64_t T = j->count[e], P = bp_count(T), I2 = j->I / 2;
    const int64_t n0 = (chunk - j->ustart[e]) * BPG_ROWS, n1 = n0 + BPG_ROWS < j->I ? n0 + BPG_ROWS : j->I;
    for (int64_t n = n0; n < n1; n += BPR) {
        const int rr = (int)(n1 - n < BPR ? n1 - n : BPR);
        for (int64_t p = 0; p < P; p++) {
            const int64_t w = T - p * BP < BP ? T - p * BP : BP;
            const uint32_t *xp = j->xp + (j->poff[e] + p) * BP * (j->K / 2);
            bp_run(j->gate[e], j->K, n, rr, xp, cg, w);
            bp_run(j->up[e], j->K, n, rr, xp, cu, w);
            uint16_t *h = (uint16_t *)(j->hp + (j->poff[e] + p) * BP * I2);
            for (int r = 0; r < rr; r++) {
                const int64_t q = (n + r) / 2 * BP * 2 + ((n + r) & 1);
                for (int64_t t = 0; t < w; t++)
                    h[q + 2 * t] = f32_bf16(glu_act(j->act, cg[r * BP + t], cu[r * BP + t], j->beta, j->lbeta));
            }
        }
    }
}

#define BPG_COLS (4 * BPR) /* output columns per chunk of pass 2 */

/* pass 2, chunk c: output columns [c0, c1) of every expert, added into out in the experts' order */
static void bpg_down_part(void *arg, int64_t chunk, int64_t chunks, int slot) {
    const bpg_job *j = arg;
    (void)chunks, (void)slot;
    float c[BPR * BP];
    const int64_t c0 = chunk * BPG_COLS, c1 = c0 + BPG_COLS < j->D ? c0 + BPG_COLS : j->D, I2 = j->I / 2;
    for (int64_t e = 0; e < j->E; e++) {
        const int64_t T = j->count[e], P = bp_count(T), a0 = j->start[e];
        for (int64_t n = c0; n < c1; n += BPR) {
            const int rr = (int)(c1 - n < BPR ? c1 - n : BPR);
            for (int64_t p = 0; p < P; p++) {
                const int64_t w = T - p * BP < BP ? T - p * BP : BP;
                bp_run(j->down[e], j->I, n, rr, j->hp + (j->poff[e] + p) * BP * I2, c, w);
                for (int64_t t = 0; t < w; t++) {
                    const float wt = j->wt[a0 + p * BP + t];
                    float *o = j->out + j->row[a0 + p * BP + t] * j->D + n;
                    for (int r = 0; r < rr; r++) o[r] += wt * c[r * BP + t];
                }
            }
        }
    }
}

/* ms_moe_glu_bf16's contract (experts, their bf16 gate [I, K], up [I, K], down [D, I], routing ids / wts or every
 * token through every expert, out fp32 [T, D] added into) computed in bf16: x and the activations h rounded to bf16,
 * products summed in fp32. K and I even. Returns 0, -1 when out of memory, -2 for an odd K or I. */
int ms_bf16dot_glu(int64_t E, const int64_t *experts, const int64_t *gates, const int64_t *ups, const int64_t *downs,
                   int64_t I, int64_t K, int64_t D, const float *x, int64_t T, const int64_t *ids, const float *wts,
                   int64_t k, float *out, int act, float beta, float lbeta) {
    if (E <= 0 || T <= 0 || D <= 0) return 0;
    if (K % 2 || I % 2 || K <= 0 || I <= 0) return -2;
    const int64_t A = glu_pairs(E, experts, T, ids, k);
    if (A == 0) return 0;
    char *mem = malloc(sizeof(int64_t) * (size_t)(4 * E + 2 + A) + sizeof(float) * (size_t)A);
    if (!mem) return -1;
    int64_t *start = (int64_t *)mem, *count = start + E, *poff = count + E, *ustart = poff + E + 1;
    int64_t *row = ustart + E + 1;
    float *wt = (float *)(row + A);
    glu_group(E, experts, T, ids, wts, k, start, count, row, wt);
    poff[0] = ustart[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        poff[e + 1] = poff[e] + bp_count(count[e]);
        ustart[e + 1] = ustart[e] + (count[e] ? (I + BPG_ROWS - 1) / BPG_ROWS : 0);
    }
    const int64_t P = poff[E];
    uint32_t *xp = aligned_alloc(64, (sizeof(uint32_t) * (size_t)(P * BP * (K / 2 + I / 2)) + 63) / 64 * 64);
    if (!xp) {
        free(mem);
        return -1;
    }
    uint32_t *hp = xp + P * BP * (K / 2);
    memset(hp, 0, sizeof(uint32_t) * (size_t)(P * BP * (I / 2))); /* padded tokens' h stay zero */
    bpg_job j = {E, I, K, D, (const uint16_t *const *)gates, (const uint16_t *const *)ups,
                 (const uint16_t *const *)downs, start, count, row, poff, ustart, wt, x, xp, hp, out, act, beta, lbeta};
    const int64_t cols = (D + BPG_COLS - 1) / BPG_COLS;
    if (pool_parts <= 1) {
        for (int64_t p = 0; p < P; p++) bpg_pack_part(&j, p, P, 0);
        for (int64_t u = 0; u < ustart[E]; u++) bpg_up_part(&j, u, ustart[E], 0);
        for (int64_t c = 0; c < cols; c++) bpg_down_part(&j, c, cols, 0);
    } else {
        pool_run_chunks(bpg_pack_part, &j, P, pool_parts);
        pool_run_chunks(bpg_up_part, &j, ustart[E], pool_parts);
        pool_run_chunks(bpg_down_part, &j, cols, pool_parts);
    }
    free(xp);
    free(mem);
    return 0;
}
