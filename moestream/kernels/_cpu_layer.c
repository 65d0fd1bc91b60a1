/* moestream native CPU kernels, part 3 (#included at the end of _cpu.c, one translation unit): the attention half
 * of a GQA decoder layer for one decode token in one call, so that a warm decode step's layer costs two native
 * calls (this one and the grouped experts) instead of some fifteen small ones with Python between them.
 * Built from the same pieces, in the same order, as the separate calls (rms_rows, the bf16 GEMV rows through the
 * pool, rms_rows + rope_heads on q and the new key, the softmax-weighted V sum, softmax_topk_row), so its results
 * equal theirs bit for bit. */

/* the static operands of one layer (ms_gqa_decode_block's cfg): int64 sizes and addresses, 0 for "none" */
enum {
    DL_H, DL_HQ, DL_HKV, DL_D, DL_DV, DL_IN_NORM, DL_IN_BF16, DL_WQ, DL_WK, DL_WV, DL_WO, DL_QN, DL_KN, DL_QK_BF16,
    DL_INV_FREQ, DL_WINDOW, DL_POST_NORM, DL_POST_BF16, DL_ROUTER, DL_E, DL_TOPK, DL_RENORM, DL_BLOCK,
    DL_MIN_ROWS, DL_INTER, DL_ACT, DL_PREFETCH, DL_COUNT
};
enum { DLF_EPS, DLF_FACTOR, DLF_SCALE, DLF_BETA, DLF_LBETA, DLF_COUNT };

/* Optional clocks of ms_gqa_decode_block's phases (ms_layer_times; bench/decode_split.py): wall ns per phase, summed
 * over calls, while enabled. For measurement only: one set of counters, not meant for concurrent callers. */
enum { DLT_PREP, DLT_QKV, DLT_ATTN, DLT_O, DLT_ROUTER, DLT_EXPERTS, DLT_POST, DLT_CALLS, DLT_COUNT };
static int dl_timing = 0;
static int64_t dl_ns[DLT_COUNT], dl_last;

#ifndef DL_MARK
#define DL_MARK(phase) dl_mark(phase)
#endif
INLINE void dl_mark(int phase) {
    if (!dl_timing) return;
    const int64_t t = now_ns();
    if (phase > 0) dl_ns[phase - 1] += t - dl_last;
    else dl_ns[DLT_CALLS]++;
    dl_last = t;
}

/* copies the counters into out[DLT_COUNT] (when not NULL), zeroes them when reset, and turns the clocks on or off */
void ms_layer_times(int enable, int reset, int64_t *out) {
    if (out) memcpy(out, dl_ns, sizeof(dl_ns));
    if (reset) memset(dl_ns, 0, sizeof(dl_ns));
    dl_timing = enable;
}

#define ATTN_SPLIT_BYTES (256 << 10) /* below this much K+V the attention runs on the calling thread alone */

typedef struct {
    int64_t T, Hq, Hkv, D, Dv, start, length, window, block;
    const int64_t *kb, *vb;
    const float *q; /* [T, Hq, D] */
    float *out, *scores; /* out [T, Hq, Dv]; scores: per part, length floats */
    float scale;
} dl_attn_job;

/* the (query, head) pairs [i0, i1) of part `part`: ms_gqa_attend's loops for query t of T (position length - T + t,
 * causal, the last `window` positions when window > 0, none before the cache's first row `start`), keys read from
 * the cache's blocks: a decode token's attention (T = 1) and a prompt chunk's */
static void dl_attn_part(void *arg, int part, int parts) {
    const dl_attn_job *j = arg;
    const int64_t items = j->T * j->Hq, i0 = items * part / parts, i1 = items * (part + 1) / parts;
    const int64_t G = j->Hq / j->Hkv, pos0 = j->length - j->T;
    float *p = j->scores + (int64_t)part * j->length;
    for (int64_t it = i0; it < i1; it++) {
        const int64_t t = it / j->Hq, h = it % j->Hq, g = h / G, n = pos0 + t + 1;
        const int64_t w0 = j->window > 0 && n > j->window ? n - j->window : 0, j0 = w0 > j->start ? w0 : j->start;
        const float *qh = j->q + it * j->D;
        float m = -INFINITY;
        for (int64_t i = j0; i < n; i++) {
            const int64_t r = i - j->start;
            const float *kj = (const float *)(intptr_t)j->kb[r / j->block] + ((r % j->block) * j->Hkv + g) * j->D;
            p[i] = dot_lanes(qh, kj, j->D) * j->scale;
            if (p[i] > m) m = p[i];
        }
        const float sum = softmax_exps(p + j0, n - j0, m);
        float *oh = j->out + it * j->Dv;
        for (int64_t d = 0; d < j->Dv; d++) oh[d] = 0.0f;
        for (int64_t i = j0; i < n; i++) {
            const int64_t r = i - j->start;
            const float w = p[i] / sum;
            const float *vj = (const float *)(intptr_t)j->vb[r / j->block] + ((r % j->block) * j->Hkv + g) * j->Dv;
            for (int64_t d = 0; d < j->Dv; d++) oh[d] += w * vj[d];
        }
    }
}

static int dl_parts(int64_t rows, int64_t min_rows) {
    int parts = pool_parts;
    while (parts > 1 && rows / parts < min_rows) parts--;
    return parts;
}

/* The MoE half of ms_gqa_decode_block (T = 1) and ms_gqa_rows_block: every routed expert of the T rows in the table
 * (else 0, nothing done), then h += the routed experts' weighted sum, from one ms_moe_glu_bf16 call over the step's
 * experts in ascending id order into zeroed rows and one add (what the runner's grouped call, when its scratch fits
 * one call, and the layer's residual add compute). 1 when done, -1 when out of memory. */
static int dl_experts(const int64_t *cfg, const float *fcfg, const int64_t *table, int64_t T, float *h,
                      const float *x2, const int64_t *ids, const float *wts) {
    const int64_t H = cfg[DL_H], k = cfg[DL_TOPK], E = cfg[DL_E];
    if (k <= 0 || E <= 0) return 0;
    char *seen = calloc((size_t)E, 1);
    if (!seen) return -1;
    int64_t n = 0;
    for (int64_t i = 0; i < T * k; i++) {
        const int64_t e = ids[i];
        if (e < 0 || e >= E || !table[3 * e]) {
            free(seen);
            return 0;
        }
        n += !seen[e];
        seen[e] = 1;
    }
    int64_t *lists = malloc(sizeof(int64_t) * (size_t)(4 * n));
    float *y = calloc((size_t)(T * H), sizeof(float));
    int code = lists && y ? 1 : -1;
    if (code == 1) {
        int64_t *sorted = lists, *gates = lists + n, *ups = gates + n, *downs = ups + n, j = 0;
        for (int64_t e = 0; e < E; e++)
            if (seen[e]) {
                sorted[j] = e;
                gates[j] = table[3 * e];
                ups[j] = table[3 * e + 1];
                downs[j++] = table[3 * e + 2];
            }
        if (ms_moe_glu_bf16(n, sorted, gates, ups, downs, cfg[DL_INTER], H, H, x2, T, ids, wts, k, y, (int)cfg[DL_ACT],
                            fcfg[DLF_BETA], fcfg[DLF_LBETA]))
            code = -1;
        else
            for (int64_t c = 0; c < T * H; c++) h[c] += y[c];
    }
    free(y);
    free(lists);
    free(seen);
    return code;
}

/* x2 [T, H] = rms_norm(h) * post_norm and, with a router, its softmax top-k into ids / wts [T, k] (xp: T prepared
 * rows of scratch, logits T x E floats, taken E bytes): the separate calls' ms_rms_norm and ms_router_softmax_topk */
static void dl_route(const int64_t *cfg, const float *fcfg, int64_t T, const float *h, float *x2, float *xp,
                     float *logits, char *taken, int64_t *ids, float *wts) {
    const int64_t H = cfg[DL_H], E = cfg[DL_E], k = cfg[DL_TOPK];
    memcpy(x2, h, sizeof(float) * (size_t)(T * H));
    rms_rows(x2, T, H, (const void *)(intptr_t)cfg[DL_POST_NORM], (int)cfg[DL_POST_BF16], fcfg[DLF_EPS]);
    if (!cfg[DL_ROUTER] || E <= 0) return;
    bf16_prepare(x2, T, H, xp);
    bf16_rows(xp, bf16_stride(H), T, H, (const uint16_t *)(intptr_t)cfg[DL_ROUTER], 0, E, logits, E);
    for (int64_t t = 0; t < T; t++)
        softmax_topk_row(logits + t * E, E, k, (int)cfg[DL_RENORM], taken, ids + t * k, wts + t * k);
}

/* The attention half of one decode token's layer, h fp32 [H] updated in place:
 *   x = rms_norm(h) * in_norm;  q, k, v = x Wq^T, x Wk^T, x Wv^T (k, v written straight into the cache row of
 *   position length - 1, which the caller has appended); per-head q/k rms_norm and rotate-half rope at that
 *   position; softmax(q k^T scale) v over the held keys [start, length) (the last `window` positions when
 *   window > 0); h += o Wo^T;
 * then x2 = rms_norm(h) * post_norm and, with a router, the softmax top-k of x2 Wr^T into ids / wts.
 * The cache is in blocks of cfg[DL_BLOCK] rows at the addresses kb[i], vb[i] (fp32 [block, Hkv, D] / [.., Dv]),
 * blocks[0] starting at absolute row `start`.
 * With a router and an expert table (E rows of gate, up, down addresses of bf16 GLU experts [inter, H], [inter, H],
 * [H, inter]; 0 for an expert that is not resident) holding every expert the token routed to, the MoE half too:
 * h += sum_j wts[j] * down act(gate x2, up x2) over the routed experts in ascending id order (ms_moe_glu_bf16 into
 * a zeroed row, then one add: what the runner's grouped call and the layer's residual add compute), and returns 1.
 * Returns 0 when it stopped after the router, -1 when out of memory. The pool's workers read o_proj's weights ahead
 * during the attention, and the regions at cfg[DL_PREFETCH] (the next layer's weights) after the call. */
static int dl_block(const int64_t *cfg, const float *fcfg, float *h, const int64_t *kb, const int64_t *vb,
                    int64_t start, int64_t length, float *x2, int64_t *ids, float *wts, const int64_t *table,
                    int prefetch) {
    const int64_t H = cfg[DL_H], Hq = cfg[DL_HQ], Hkv = cfg[DL_HKV], D = cfg[DL_D], Dv = cfg[DL_DV];
    const int64_t block = cfg[DL_BLOCK], window = cfg[DL_WINDOW], E = cfg[DL_E], min_rows = cfg[DL_MIN_ROWS];
    const float eps = fcfg[DLF_EPS];
    const int64_t nq = Hq * D, nk = Hkv * D, nv = Hkv * Dv, na = Hq * Dv, ldx = bf16_stride(H), lda = bf16_stride(na);
    const int64_t row = length - 1 - start;
    DL_MARK(0);
    if (length <= start || H <= 0 || Hkv <= 0 || Hq % Hkv) return -2;
    const int64_t j0 = window > 0 && length > window ? length - window : 0, first = j0 > start ? j0 : start;
    const int attn_parts = (length - first) * nk * 8 < ATTN_SPLIT_BYTES ? 1 : dl_parts(Hq, 1);
    float *mem = malloc(sizeof(float) * (size_t)(2 * ldx + H + nq + na + lda + H + attn_parts * length + E) +
                        (size_t)E + 64);
    if (!mem) return -1;
    float *xp = (float *)(((uintptr_t)mem + 63) & ~(uintptr_t)63), *x = xp + ldx, *q = x + H, *att = q + nq;
    float *ap = att + na, *y = ap + lda, *scores = y + H, *logits = scores + attn_parts * length;
    char *taken = (char *)(logits + E);

    memcpy(x, h, sizeof(float) * (size_t)H);
    rms_rows(x, 1, H, (const void *)(intptr_t)cfg[DL_IN_NORM], (int)cfg[DL_IN_BF16], eps);
    bf16_prepare_row(x, H, xp);
    float *kout = (float *)(intptr_t)kb[row / block] + (row % block) * nk;
    float *vout = (float *)(intptr_t)vb[row / block] + (row % block) * nv;
    const int64_t ws[3] = {cfg[DL_WQ], cfg[DL_WK], cfg[DL_WV]}, Ns[3] = {nq, nk, nv};
    const int64_t outs[3] = {(int64_t)(intptr_t)q, (int64_t)(intptr_t)kout, (int64_t)(intptr_t)vout};
    bf16_job qkv = {xp, ldx, 1, H, 3, nq + nk + nv, ws, Ns, outs, 0};
    DL_MARK(1); /* phases: 1 prep, 2 q/k/v, 3 q/k norm + rope + attention, 4 o_proj, 5 post norm + router, 6 experts,
                 * 7 the prefetch posted */
    bf16_run(&qkv, dl_parts(nq + nk + nv, min_rows));
    DL_MARK(2);
    /* the workers read o_proj's weights ahead while this thread normalises, ropes and attends alone */
    const void *wo_w = (const void *)(intptr_t)cfg[DL_WO];
    const int64_t wo_bytes = b12_tagged(wo_w) ? H * b12_slot(na) : H * na * 2; /* the rows (a coded one's slots) */
    const int64_t wo_region[3] = {1, (int64_t)(intptr_t)b12_addr(wo_w), wo_bytes};
    pool_prefetch(wo_region);

    const void *qn = (const void *)(intptr_t)cfg[DL_QN], *kn = (const void *)(intptr_t)cfg[DL_KN];
    const float *inv_freq = (const float *)(intptr_t)cfg[DL_INV_FREQ];
    if (qn) rms_rows(q, Hq, D, qn, (int)cfg[DL_QK_BF16], eps);
    if (kn) rms_rows(kout, Hkv, D, kn, (int)cfg[DL_QK_BF16], eps);
    if (inv_freq) {
        rope_heads(q, Hq, D, length - 1, inv_freq, fcfg[DLF_FACTOR]);
        rope_heads(kout, Hkv, D, length - 1, inv_freq, fcfg[DLF_FACTOR]);
    }
    dl_attn_job aj = {1, Hq, Hkv, D, Dv, start, length, window, block, kb, vb, q, att, scores, fcfg[DLF_SCALE]};
    pool_run(dl_attn_part, &aj, attn_parts);

    DL_MARK(3);
    bf16_prepare_row(att, na, ap);
    const int64_t wo = cfg[DL_WO], yo = (int64_t)(intptr_t)y;
    bf16_job oj = {ap, lda, 1, na, 1, H, &wo, &H, &yo, 0};
    bf16_run(&oj, dl_parts(H, min_rows));
    for (int64_t c = 0; c < H; c++) h[c] += y[c];
    DL_MARK(4);

    dl_route(cfg, fcfg, 1, h, x2, xp, logits, taken, ids, wts);
    free(mem);
    DL_MARK(5);
    const int done = table && cfg[DL_ROUTER] && E > 0 ? dl_experts(cfg, fcfg, table, 1, h, x2, ids, wts) : 0;
    /* the next layer's dense weights (cfg[DL_PREFETCH]: pool_prefetch's regions, 0 for none) are read ahead by the
     * workers while the caller's Python runs between this call and the next */
    DL_MARK(6);
    if (prefetch) pool_prefetch((const int64_t *)(intptr_t)cfg[DL_PREFETCH]);
    DL_MARK(7);
    return done;
}

int ms_gqa_decode_block(const int64_t *cfg, const float *fcfg, float *h, const int64_t *kb, const int64_t *vb,
                        int64_t start, int64_t length, float *x2, int64_t *ids, float *wts, const int64_t *table) {
    return dl_block(cfg, fcfg, h, kb, vb, start, length, x2, ids, wts, table, 1);
}

/* one layer's operands in ms_gqa_decode_layers' records (int64 each): its cfg and fcfg, its cache's block
 * addresses (keys, values), the cache's start and length, its expert table */
enum { DS_CFG, DS_FCFG, DS_KB, DS_VB, DS_START, DS_LENGTH, DS_TABLE, DS_COUNT };

/* One decode token through n consecutive layers, each what ms_gqa_decode_block computes with an expert table
 * (attention half, router, routed experts), h fp32 [H] updated in place from layer to layer; layer l's operands at
 * rec[l * DS_COUNT ...], its post-norm x2 at x2s + l * H, its ids and weights at ids + l * top_k, wts + l * top_k.
 * Only after the last layer do the workers read its cfg[DL_PREFETCH] regions ahead (between layers nothing runs
 * that they could overlap). Returns the number of layers done whole; a return l < n means layer l routed to an
 * expert its table lacks: its attention half and router are done (h, x2s[l], ids[l], wts[l]) and its experts are
 * left to the caller. -1 when out of memory, -2 for bad cache rows. */
int64_t ms_gqa_decode_layers(int64_t n, const int64_t *rec, float *h, float *x2s, int64_t *ids, float *wts) {
    for (int64_t l = 0; l < n; l++) {
        const int64_t *r = rec + l * DS_COUNT;
        const int64_t *cfg = (const int64_t *)(intptr_t)r[DS_CFG], k = cfg[DL_TOPK];
        const int code = dl_block(cfg, (const float *)(intptr_t)r[DS_FCFG], h, (const int64_t *)(intptr_t)r[DS_KB],
                                  (const int64_t *)(intptr_t)r[DS_VB], r[DS_START], r[DS_LENGTH], x2s + l * cfg[DL_H],
                                  ids + l * k, wts + l * k, (const int64_t *)(intptr_t)r[DS_TABLE], l + 1 == n);
        if (code < 0) return code;
        if (code == 0) return l;
    }
    return n;
}

/* ms_gqa_decode_block's attention half and router for T new tokens of one sequence (a short prompt chunk), h fp32
 * [T, H] updated in place; the caller has appended the T rows [length - T, length) to the cache (their contents are
 * written here). The same pieces in the same order as the separate calls of that step (ms_rms_norm,
 * ms_linear_bf16_many for q/k/v, ms_gqa_attend's norms, rope and causal attention per query, ms_linear_bf16 for
 * o_proj, the residual add, ms_rms_norm, ms_router_softmax_topk), so the same values bit for bit: x2 [T, H] the
 * post-norm rows, with a router ids [T, k] and wts [T, k]. With a router and an expert table (as
 * ms_gqa_decode_block's) holding every expert the rows routed to, the MoE half too (dl_experts) and returns 1; the
 * caller must know that the runner's grouped call would make one native call of these rows. The cache must hold
 * every key the first query sees (blocks[0] starts at or before it). Returns 0 when it stopped after the router, -1
 * when out of memory, -2 for bad cache rows. */
int ms_gqa_rows_block(const int64_t *cfg, const float *fcfg, int64_t T, float *h, const int64_t *kb,
                      const int64_t *vb, int64_t start, int64_t length, float *x2, int64_t *ids, float *wts,
                      const int64_t *table) {
    const int64_t H = cfg[DL_H], Hq = cfg[DL_HQ], Hkv = cfg[DL_HKV], D = cfg[DL_D], Dv = cfg[DL_DV];
    const int64_t block = cfg[DL_BLOCK], window = cfg[DL_WINDOW], E = cfg[DL_E], min_rows = cfg[DL_MIN_ROWS];
    const float eps = fcfg[DLF_EPS];
    const int64_t nq = Hq * D, nk = Hkv * D, nv = Hkv * Dv, na = Hq * Dv, ldx = bf16_stride(H), lda = bf16_stride(na);
    const int64_t pos0 = length - T, seen = window > 0 && pos0 + 1 > window ? pos0 + 1 - window : 0;
    if (T <= 0 || pos0 < start || start > seen || H <= 0 || Hkv <= 0 || Hq % Hkv) return -2;
    const int attn_parts = T * (length - seen) * nk * 8 < ATTN_SPLIT_BYTES ? 1 : dl_parts(T * Hq, 1);
    const int64_t router = cfg[DL_ROUTER] && E > 0;
    const size_t floats = (size_t)(T * (ldx + H + nq + nk + nv + na + lda + H) + attn_parts * length
                                   + (router ? T * E : 0));
    float *mem = malloc(sizeof(float) * floats + (size_t)E + 64);
    if (!mem) return -1;
    float *xp = (float *)(((uintptr_t)mem + 63) & ~(uintptr_t)63), *x = xp + T * ldx, *q = x + T * H;
    float *k = q + T * nq, *v = k + T * nk, *att = v + T * nv, *ap = att + T * na, *y = ap + T * lda;
    float *scores = y + T * H, *logits = scores + attn_parts * length;
    char *taken = (char *)(logits + (router ? T * E : 0));

    memcpy(x, h, sizeof(float) * (size_t)(T * H));
    rms_rows(x, T, H, (const void *)(intptr_t)cfg[DL_IN_NORM], (int)cfg[DL_IN_BF16], eps);
    bf16_prepare(x, T, H, xp);
    const int64_t ws[3] = {cfg[DL_WQ], cfg[DL_WK], cfg[DL_WV]}, Ns[3] = {nq, nk, nv};
    const int64_t outs[3] = {(int64_t)(intptr_t)q, (int64_t)(intptr_t)k, (int64_t)(intptr_t)v};
    bf16_job qkv = {xp, ldx, T, H, 3, nq + nk + nv, ws, Ns, outs, 0};
    bf16_run(&qkv, dl_parts(nq + nk + nv, min_rows));

    const void *qn = (const void *)(intptr_t)cfg[DL_QN], *kn = (const void *)(intptr_t)cfg[DL_KN];
    const float *inv_freq = (const float *)(intptr_t)cfg[DL_INV_FREQ];
    for (int64_t t = 0; t < T; t++) { /* the new rows into the cache, then ms_gqa_attend's norms and rope */
        const int64_t r = pos0 + t - start;
        float *kout = (float *)(intptr_t)kb[r / block] + (r % block) * nk;
        float *vout = (float *)(intptr_t)vb[r / block] + (r % block) * nv;
        float *qt = q + t * nq;
        memcpy(kout, k + t * nk, sizeof(float) * (size_t)nk);
        memcpy(vout, v + t * nv, sizeof(float) * (size_t)nv);
        if (qn) rms_rows(qt, Hq, D, qn, (int)cfg[DL_QK_BF16], eps);
        if (kn) rms_rows(kout, Hkv, D, kn, (int)cfg[DL_QK_BF16], eps);
        if (inv_freq) {
            rope_heads(qt, Hq, D, pos0 + t, inv_freq, fcfg[DLF_FACTOR]);
            rope_heads(kout, Hkv, D, pos0 + t, inv_freq, fcfg[DLF_FACTOR]);
        }
    }
    dl_attn_job aj = {T, Hq, Hkv, D, Dv, start, length, window, block, kb, vb, q, att, scores, fcfg[DLF_SCALE]};
    pool_run(dl_attn_part, &aj, attn_parts);

    bf16_prepare(att, T, na, ap);
    const int64_t wo = cfg[DL_WO], yo = (int64_t)(intptr_t)y;
    bf16_job oj = {ap, lda, T, na, 1, H, &wo, &H, &yo, 0};
    bf16_run(&oj, dl_parts(H, min_rows));
    for (int64_t c = 0; c < T * H; c++) h[c] += y[c];

    dl_route(cfg, fcfg, T, h, x2, xp, logits, taken, ids, wts);
    free(mem);
    if (atomic_load(&qkv.failed) || atomic_load(&oj.failed)) return -1;
    return table && router ? dl_experts(cfg, fcfg, table, T, h, x2, ids, wts) : 0;
}
