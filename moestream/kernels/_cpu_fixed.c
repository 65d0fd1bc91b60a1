/* moestream native CPU kernels, part 5 (#included at the end of _cpu.c, after _cpu_panel.c): the batch-invariant
 * dense product (EngineOptions.batch_invariant, kernels/invariant.py).
 *
 * The other dense kernels pick their arithmetic by the number of rows (a GEMV, token tiles, a GEMM; torch's own
 * blocking past MAX_TOKENS_BF16), so one row's result moves in its last bits with the rows beside it. Here every
 * row count takes _cpu_panel.c's outer-product tile, tokens as vector lanes: each output is one fp32 sum over k in
 * order (an FMA per k into its own lane, from zero), whatever the number of rows, the lane or panel a row lands in,
 * the block it is computed in or the thread count. A row alone pays for a whole panel's lanes (as many FMAs as a
 * panel of PANEL rows); from a few dozen rows on the tile runs near the FMA peak. */

#define FIXED_ROWS (8 * PR)       /* weight rows per chunk of work */
#define FIXED_PANEL_BYTES (512 << 10) /* packed x per chunk: the token panels stay in L2 while the rows stream */

typedef struct {
    const float *xp; int64_t T, K, N, P, pb, rblocks; const void *w; int wbf16; float *out; float *pack;
} fixed_job;

/* rows [n, n + rr) of w [*, K] (bf16 when wbf16, else fp32) as fp32 into pw [PR][K]; rows rr..PR zero */
static void fixed_pack_w(const void *w, int wbf16, int64_t K, int64_t n, int rr, float *pw) {
    if (wbf16) {
        panel_pack_w((const uint16_t *)w, K, n, rr, pw);
        return;
    }
    for (int r = 0; r < PR; r++) {
        if (r < rr) memcpy(pw + r * K, (const float *)w + (n + r) * K, sizeof(float) * (size_t)K);
        else memset(pw + r * K, 0, sizeof(float) * (size_t)K);
    }
}

/* chunk = (token block, row block): its outputs, each a whole sum over K */
static void fixed_chunk(void *arg, int64_t chunk, int64_t chunks, int slot) {
    const fixed_job *j = arg;
    (void)chunks;
    const int64_t K = j->K, N = j->N, T = j->T;
    const int64_t rb = chunk % j->rblocks, tb = chunk / j->rblocks;
    const int64_t n0 = rb * FIXED_ROWS, n1 = n0 + FIXED_ROWS < N ? n0 + FIXED_ROWS : N;
    const int64_t p0 = tb * j->pb, p1 = p0 + j->pb < j->P ? p0 + j->pb : j->P;
    float *pw = j->pack + (int64_t)slot * (PR * K + PR * PANEL), *c = pw + PR * K;
    for (int64_t n = n0; n < n1; n += PR) {
        const int rr = (int)(n1 - n < PR ? n1 - n : PR);
        fixed_pack_w(j->w, j->wbf16, K, n, rr, pw);
        for (int64_t p = p0; p < p1; p++) {
            const int64_t w = T - p * PANEL < PANEL ? T - p * PANEL : PANEL;
            panel_run(pw, j->xp + p * PANEL * K, K, c, w);
            for (int64_t t = 0; t < w; t++) {
                float *o = j->out + (p * PANEL + t) * N + n;
                for (int r = 0; r < rr; r++) o[r] = c[r * PANEL + t];
            }
        }
    }
}

/* out[T, N] = x[T, K] (contiguous fp32) @ w[N, K]^T (contiguous, bf16 when wbf16 else fp32), each output one fp32
 * sum over k in order: bit-identical for a row whatever rows share the call. Returns 0, or -1 when out of memory. */
int ms_linear_fixed(const float *x, int64_t T, int64_t K, const void *w, int wbf16, int64_t N, float *out) {
    if (T <= 0 || N <= 0) return 0;
    if (K <= 0) {
        memset(out, 0, sizeof(float) * (size_t)(T * N));
        return 0;
    }
    const int64_t P = panel_count(T);
    int64_t pb = FIXED_PANEL_BYTES / (int64_t)(sizeof(float) * PANEL * K);
    if (pb < 1) pb = 1;
    const int64_t rblocks = (N + FIXED_ROWS - 1) / FIXED_ROWS, chunks = rblocks * ((P + pb - 1) / pb);
    int parts = pool_parts;
    if (parts > chunks) parts = (int)chunks;
    float *mem = malloc(sizeof(float) * (size_t)(P * PANEL * K + parts * (PR * K + PR * PANEL)) + 64);
    if (!mem) return -1;
    float *xp = (float *)(((uintptr_t)mem + 63) & ~(uintptr_t)63), *pack = xp + P * PANEL * K;
    for (int64_t p = 0; p < P; p++) {
        float *dst = xp + p * PANEL * K;
        const int64_t n = T - p * PANEL < PANEL ? T - p * PANEL : PANEL;
        if (n < PANEL) memset(dst, 0, sizeof(float) * (size_t)(PANEL * K));
        for (int64_t t = 0; t < n; t++) {
            const float *src = x + (p * PANEL + t) * K;
            for (int64_t k = 0; k < K; k++) dst[k * PANEL + t] = src[k];
        }
    }
    fixed_job j = {xp, T, K, N, P, pb, rblocks, w, wbf16, out, pack};
    if (parts <= 1)
        for (int64_t c = 0; c < chunks; c++) fixed_chunk(&j, c, chunks, 0);
    else
        pool_run_chunks(fixed_chunk, &j, chunks, parts);
    free(mem);
    return 0;
}

/* softmax over each of T rows of E logits (in place, fp32) and its k largest, best first, into ids / wts (divided
 * by their sum when renorm): the router's selection one row at a time, the same for any T. Returns 0, or -1 when
 * out of memory. */
int ms_softmax_topk(float *logits, int64_t T, int64_t E, int64_t k, int renorm, int64_t *ids, float *wts) {
    if (T <= 0 || E <= 0 || k <= 0 || k > E) return 0;
    char *taken = malloc((size_t)E);
    if (!taken) return -1;
    for (int64_t t = 0; t < T; t++) softmax_topk_row(logits + t * E, E, k, renorm, taken, ids + t * k, wts + t * k);
    free(taken);
    return 0;
}

/* out[t, :] = sum_j w[t, j] * pairs[t, j, :] over the k slots in order (slot 0 first; each product rounded, then
 * added, never fused: the same bits as invariant.combine's torch ops), fp32: a MoE layer's per-slot expert outputs
 * combined by the row's own slots alone. pairs [T, k, D], w [T, k], out [T, D], contiguous. */
__attribute__((optimize("fp-contract=off"))) void ms_combine_slots(const float *pairs, int64_t T, int64_t k, int64_t D, const float *w, float *out) {
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * D;
        const float *y = pairs + t * k * D, *wt = w + t * k;
        for (int64_t d = 0; d < D; d++) {
            float acc = wt[0] * y[d];
            for (int64_t j = 1; j < k; j++) {
                const float p = wt[j] * y[j * D + d];
                acc = acc + p;
            }
            o[d] = acc;
        }
    }
}
