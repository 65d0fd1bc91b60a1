/* moestream native CPU kernels, part 2 (#included at the end of _cpu.c, one translation unit): the pieces of a
 * decode step beyond plain matmuls: the grouped fused GLU experts of a layer step, rms_norm, rope and GQA
 * attention, and the KDA decode step. Uses _cpu.c's bf16 rows, thread pool and split. */

/* ------------------------------------------------------------------------ grouped GLU experts (bf16 weights) */
/* Every expert of a layer step in one call, in two passes over the threads:
 *   pass 1 (rows of gate and up, all experts' row blocks split over the threads): h_a = act(gate_e x, up_e x),
 *          written straight into the prepared layout the down projection reads;
 *   pass 2 (output columns split over the threads): out[token] += weight_a * down_e h_a for each assignment a.
 * Each thread owns whole output columns in pass 2 and adds the experts in their given order, so the result does
 * not depend on the thread count. */
#ifndef GLU_ROWS
#define GLU_ROWS 16   /* gate/up rows per unit of pass 1 */
#endif
#define MIN_BYTES_PER_PART (128 << 10)
#define DOWN_ROWS 32  /* down rows per block of pass 2 (the same scratch: 2 * GLU_ROWS floats per token) */
#ifndef DOWN_CHUNK
#define DOWN_CHUNK 64 /* output columns per chunk of pass 2 handed out to a thread */
#endif
/* A call whose experts take few rows each (a decode token's layer step: one; a 16-token prompt's: about two) streams
 * its weights in longer runs: pass-1 units of GLU_ROWS_FEW gate/up rows and pass-2 chunks of DOWN_CHUNK_FEW output
 * columns. Each thread then reads long contiguous stretches of each matrix instead of switching matrices every
 * 24-48 KiB (each switch starts a stream the software prefetch has not run ahead of). In one process alternating
 * builds (bench/ab_builds.py glu: 8 b12 experts of the peer's shape a call, a pool past the LLC, 2 threads),
 * 256 / 512 against 16 / 64 read 1.20x the bytes a second at one row in one run and 1.03-1.05x in five later
 * ones; 1.24 / 1.07 / 1.05 / 1.09x at 2 / 4 / 8 / 15 rows an expert (bf16 experts at 2 rows: 1.29x); the same
 * bits (docs/performance.md). From GEMM_MIN_T rows an expert (16) a coded expert's rows may be decoded into
 * scratch, which stays at GLU_ROWS rows. */
#ifndef GLU_ROWS_FEW
#define GLU_ROWS_FEW 256
#endif
#ifndef DOWN_CHUNK_FEW
#define DOWN_CHUNK_FEW 512
#endif
#ifndef GLU_FEW_MAX_T
#define GLU_FEW_MAX_T (GEMM_MIN_T - 1) /* the most rows an expert of such a call takes */
#endif

enum { ACT_SILU = 0, ACT_SITU = 1 };

#define PANEL_ROWS (4 * PR) /* gate/up rows per unit of pass 1 for an expert on the panel kernel */

typedef struct {
    int64_t E, I, K, D, ldx, ldh, maxcount, ldo;
    const uint16_t *const *gate, *const *up, *const *down;
    const int64_t *start, *count; /* expert e's assignments: [start[e], start[e] + count[e]) */
    const int64_t *row;           /* each assignment's token */
    const float *wt;              /* ... and its weight */
    const float *xa;              /* prepared x per assignment [A, ldx] (experts on the row kernels) */
    float *h;                     /* prepared activations per assignment [A, ldh] (experts on the row kernels) */
    float *scratch;               /* per part: 2 * urows * maxcount floats */
    float *out;
    int act;
    float beta, lbeta;
    /* experts with PANEL_MIN_T+ assignments (_cpu_panel.c): x and h in panels, poff[e] >= 0 their offset in
     * panel floats per input (x at xp + poff[e] * K, h at hp + poff[e] * I); -1 for the others */
    const float *x;               /* the caller's x [T, K] */
    const int64_t *poff, *ustart; /* ustart[e]: expert e's first unit of pass 1 (ustart[E]: all units) */
    float *xp, *hp;
    float *pack;                  /* per part: pack_floats floats */
    int64_t pack_floats;
    /* the batch-invariant form (ms_moe_glu_bf16_pairs): each assignment's unweighted output stored at
     * pairs + pair[a] * D (pair[a] = t * k + j) instead of added into out; NULL otherwise */
    const int64_t *pair;
    float *pairs;
    /* one pass instead of two (glu_step_part): the first up_chunks chunks are pass 1's, the rest pass 2's, and
     * left[e] counts expert e's pass-1 units not yet finished; NULL for two passes */
    int64_t up_chunks;
    _Atomic int64_t *left;
    /* b12-coded experts (_cpu_b12.c: tagged addresses): per part dec_len bf16 values to decode rows into */
    uint16_t *dec;
    int64_t dec_len;
    int64_t urows; /* gate/up rows per pass-1 unit of an expert on the row kernels (GLU_ROWS, or GLU_ROWS_FEW) */
} glu_job;

INLINE float glu_act(int act, float g, float u, float beta, float lbeta) {
    if (act == ACT_SITU) /* Kimi K3's SiTU-GLU */
        return (beta * tanhf(g / beta) / (1.0f + expf(-g))) * (lbeta * tanhf(u / lbeta));
    return g / (1.0f + expf(-g)) * u; /* SiLU-GLU */
}

/* gate/up rows [n0, n1) of a panel expert: h = act(gate x, up x) into its panels */
static void glu_up_panel(const glu_job *j, int64_t e, int64_t n0, int64_t n1, int slot) {
    const int64_t K = j->K, I = j->I, T = j->count[e], P = panel_count(T);
    float *pg = j->pack + (int64_t)slot * j->pack_floats, *pu = pg + PR * K, *cg = pu + PR * K, *cu = cg + PR * PANEL;
    const float *xp = j->xp + j->poff[e] * K;
    float *hp = j->hp + j->poff[e] * I;
    for (int64_t n = n0; n < n1; n += PR) {
        const int rr = (int)(n1 - n < PR ? n1 - n : PR);
        uint16_t *dec = j->dec + (int64_t)slot * j->dec_len;
        panel_pack_w(w_bf16_rows(j->gate[e], I, K, n, rr, dec), K, 0, rr, pg);
        panel_pack_w(w_bf16_rows(j->up[e], I, K, n, rr, dec), K, 0, rr, pu);
        for (int64_t p = 0; p < P; p++) {
            const int64_t w = T - p * PANEL < PANEL ? T - p * PANEL : PANEL;
            panel_run(pg, xp + p * PANEL * K, K, cg, w);
            panel_run(pu, xp + p * PANEL * K, K, cu, w);
            float *hb = hp + p * PANEL * I + n * PANEL; /* padded tokens' h stay zero */
            for (int r = 0; r < rr; r++)
                for (int64_t t = 0; t < w; t++)
                    hb[r * PANEL + t] = glu_act(j->act, cg[r * PANEL + t], cu[r * PANEL + t], j->beta, j->lbeta);
        }
    }
}

/* down rows [c0, c1) of a panel expert: out[token] += weight * down h, its tokens in order */
static void glu_down_panel(const glu_job *j, int64_t e, int64_t c0, int64_t c1, int slot) {
    const int64_t I = j->I, T = j->count[e], P = panel_count(T), a0 = j->start[e];
    float *pd = j->pack + (int64_t)slot * j->pack_floats, *c = pd + 2 * PR * (I > j->K ? I : j->K);
    const float *hp = j->hp + j->poff[e] * I;
    for (int64_t n = c0; n < c1; n += PR) {
        const int rr = (int)(c1 - n < PR ? c1 - n : PR);
        panel_pack_w(w_bf16_rows(j->down[e], j->D, I, n, rr, j->dec + (int64_t)slot * j->dec_len), I, 0, rr, pd);
        for (int64_t p = 0; p < P; p++) {
            const int64_t w = T - p * PANEL < PANEL ? T - p * PANEL : PANEL;
            panel_run(pd, hp + p * PANEL * I, I, c, w);
            for (int64_t t = 0; t < w; t++) {
                if (j->pairs) {
                    float *o = j->pairs + j->pair[a0 + p * PANEL + t] * j->ldo + n;
                    for (int r = 0; r < rr; r++) o[r] = c[r * PANEL + t];
                    continue;
                }
                const float wt = j->wt[a0 + p * PANEL + t];
                float *o = j->out + j->row[a0 + p * PANEL + t] * j->ldo + n;
                for (int r = 0; r < rr; r++) o[r] += wt * c[r * PANEL + t];
            }
        }
    }
}

/* panel `part` of all panel experts' x panels laid end to end (one chunk each: a single expert's are split too) */
static void glu_pack_part(void *arg, int64_t part, int64_t parts, int slot) {
    const glu_job *j = arg;
    (void)parts, (void)slot;
    for (int64_t e = 0; e < j->E; e++) {
        if (j->poff[e] < 0) continue;
        const int64_t p = part - j->poff[e] / PANEL;
        if (p >= 0 && p < panel_count(j->count[e])) {
            panel_pack_x(j->x, j->K, j->row + j->start[e], j->count[e], p, j->xp + j->poff[e] * j->K);
            return;
        }
    }
}

/* chunk `part` of `parts` of the (expert, row block) units; `slot` picks the thread's scratch */
static void glu_up_part(void *arg, int64_t part, int64_t parts, int slot) {
    const glu_job *j = arg;
    const int64_t units = j->ustart[j->E];
    const int64_t ur = j->urows;
    float *g = j->scratch + (int64_t)slot * 2 * ur * j->maxcount, *u = g + ur * j->maxcount;
    int64_t e = 0;
    for (int64_t unit = units * part / parts; unit < units * (part + 1) / parts; unit++) {
        while (unit >= j->ustart[e + 1]) e++;
        const int64_t rows = j->poff[e] >= 0 ? PANEL_ROWS : ur, T = j->count[e];
        const int64_t n0 = (unit - j->ustart[e]) * rows, n1 = n0 + rows < j->I ? n0 + rows : j->I;
        if (T <= 0) continue;
        if (j->poff[e] >= 0) {
            glu_up_panel(j, e, n0, n1, slot);
            continue;
        }
        const float *x = j->xa + j->start[e] * j->ldx;
        uint16_t *dec = j->dec + (int64_t)slot * j->dec_len;
        w_rows(x, j->ldx, T, j->K, j->gate[e], j->I, n0, n1, g, ur, dec);
        w_rows(x, j->ldx, T, j->K, j->up[e], j->I, n0, n1, u, ur, dec);
        for (int64_t t = 0; t < T; t++) {
            float *h = j->h + (j->start[e] + t) * j->ldh;
            for (int64_t n = n0; n < n1; n++)
                h[bf16_pos(n)] = glu_act(j->act, g[t * ur + n - n0], u[t * ur + n - n0], j->beta, j->lbeta);
        }
    }
}


/* waits until every pass-1 unit of an expert has finished (its h complete): polls, yielding the CPU now and then
 * so that a thread still computing those units gets it if both share one CPU */
static void glu_wait(_Atomic int64_t *left) {
    for (int spins = 1; atomic_load_explicit(left, memory_order_acquire) > 0; spins++) {
        cpu_relax();
        if ((spins & 255) == 0) sched_yield();
    }
}

/* output columns of chunk `part` of `parts` (each column's experts added in their given order) */
static void glu_down_part(void *arg, int64_t part, int64_t parts, int slot) {
    const glu_job *j = arg;
    int64_t c0, c1;
    split(j->D, (int)part, (int)parts, &c0, &c1);
    float *y = j->scratch + (int64_t)slot * 2 * j->urows * j->maxcount; /* DOWN_ROWS <= 2 * urows */
    for (int64_t e = 0; e < j->E; e++) {
        const int64_t T = j->count[e], a0 = j->start[e];
        if (T <= 0) continue;
        if (j->left) glu_wait(&j->left[e]);
        if (j->poff[e] >= 0) {
            glu_down_panel(j, e, c0, c1, slot);
            continue;
        }
        for (int64_t n0 = c0; n0 < c1; n0 += DOWN_ROWS) {
            const int64_t nn = c1 - n0 < DOWN_ROWS ? c1 - n0 : DOWN_ROWS;
            w_rows(j->h + a0 * j->ldh, j->ldh, T, j->I, j->down[e], j->D, n0, n0 + nn, y, DOWN_ROWS,
                   j->dec + (int64_t)slot * j->dec_len);
            for (int64_t t = 0; t < T; t++) {
                if (j->pairs) {
                    float *o = j->pairs + j->pair[a0 + t] * j->ldo + n0;
                    for (int64_t n = 0; n < nn; n++) o[n] = y[t * DOWN_ROWS + n];
                    continue;
                }
                const float w = j->wt[a0 + t];
                float *o = j->out + j->row[a0 + t] * j->ldo + n0;
                for (int64_t n = 0; n < nn; n++) o[n] += w * y[t * DOWN_ROWS + n];
            }
        }
    }
}

/* Both passes as one list of chunks (experts on the row kernels only): chunks below up_chunks are pass 1's, the
 * rest pass 2's. Chunks are handed out in order, so every pass-1 chunk is taken (and being computed) before the
 * first pass-2 chunk is; a pass-2 chunk waits for each expert's h just before it reads it (glu_down_part), so the
 * thread that finishes pass 1 first starts on the down projections at once instead of waiting at a barrier for
 * the other's last chunk. Each value is computed by the same code as in two passes, in the same order. */
static void glu_step_part(void *arg, int64_t chunk, int64_t chunks, int slot) {
    const glu_job *j = arg;
    if (chunk >= j->up_chunks) {
        glu_down_part(arg, chunk - j->up_chunks, chunks - j->up_chunks, slot);
        return;
    }
    glu_up_part(arg, chunk, j->up_chunks, slot);
    const int64_t units = j->ustart[j->E], u0 = units * chunk / j->up_chunks, u1 = units * (chunk + 1) / j->up_chunks;
    for (int64_t e = 0; e < j->E; e++) { /* this chunk's units of each expert are done */
        const int64_t lo = u0 > j->ustart[e] ? u0 : j->ustart[e], hi = u1 < j->ustart[e + 1] ? u1 : j->ustart[e + 1];
        if (lo < hi) atomic_fetch_sub_explicit(&j->left[e], hi - lo, memory_order_release);
    }
}

/* (token, slot) pairs routed to the E experts (every token through every expert without ids) */
static int64_t glu_pairs(int64_t E, const int64_t *experts, int64_t T, const int64_t *ids, int64_t k) {
    if (ids == NULL) return E * T;
    int64_t A = 0;
    for (int64_t e = 0; e < E; e++)
        for (int64_t i = 0; i < T * k; i++) A += ids[i] == experts[e];
    return A;
}

/* The pairs expert-major: expert e's are row / wt[start[e] .. start[e] + count[e]), tokens ascending (weight 1
 * without ids), and each one's index t * k + j into `pair` when not NULL (t without ids). Returns the largest count. */
static int64_t glu_group(int64_t E, const int64_t *experts, int64_t T, const int64_t *ids, const float *wts,
                         int64_t k, int64_t *start, int64_t *count, int64_t *row, float *wt, int64_t *pair) {
    int64_t a = 0, maxcount = 0;
    for (int64_t e = 0; e < E; e++) {
        start[e] = a;
        for (int64_t t = 0; t < T; t++) {
            if (ids == NULL) {
                if (pair) pair[a] = t;
                row[a] = t;
                wt[a++] = 1.0f;
                continue;
            }
            for (int64_t i = 0; i < k; i++)
                if (ids[t * k + i] == experts[e]) {
                    if (pair) pair[a] = t * k + i;
                    row[a] = t;
                    wt[a++] = wts[t * k + i];
                }
        }
        count[e] = a - start[e];
        if (count[e] > maxcount) maxcount = count[e];
    }
    return maxcount;
}

/* For each of E experts (ids experts[e]; bf16 weights gate [I, K], up [I, K], down [D, I] at the addresses
 * gates[e], ups[e], downs[e]): out[t] += w * down act(gate x[t], up x[t]) for every (t, j) with
 * ids[t * k + j] == experts[e], w = wts[t * k + j]. With ids NULL every token goes through every expert with weight
 * 1. x fp32 [T, K], out fp32 [T, D], both contiguous. act: 0 SiLU-GLU, 1 SiTU-GLU(beta, lbeta). Returns 0, or -1
 * when out of memory. */
static int moe_glu(int64_t E, const int64_t *experts, const int64_t *gates, const int64_t *ups,
                   const int64_t *downs, int64_t I, int64_t K, int64_t D, const float *x, int64_t T,
                   const int64_t *ids, const float *wts, int64_t k, float *out, int act, float beta, float lbeta,
                   int64_t panel_min, float *pairs) {
    if (E <= 0 || T <= 0 || D <= 0) return 0;
    const int64_t A = glu_pairs(E, experts, T, ids, k);
    if (A == 0) return 0;
    const int64_t ldx = bf16_stride(K), ldh = bf16_stride(I);
    int parts = pool_parts; /* a thread's wake-up costs about as much as streaming 100-200 KB */
    while (parts > 1 && E * (2 * I * K + D * I) * 2 / parts < MIN_BYTES_PER_PART) parts--;
    const size_t meta = sizeof(int64_t) * (size_t)(2 * E + 2 * A) + sizeof(float) * (size_t)A;
    char *mem = malloc(meta + 64 + sizeof(float) * (size_t)(A * (ldx + ldh)));
    if (!mem) return -1;
    int64_t *start = (int64_t *)mem, *count = start + E, *row = count + E, *pair = row + A;
    float *wt = (float *)(pair + A);
    float *xa = (float *)(((uintptr_t)(mem + meta) + 63) & ~(uintptr_t)63), *h = xa + A * ldx;
    const int64_t maxcount = glu_group(E, experts, T, ids, wts, k, start, count, row, wt, pair);
    /* experts with many tokens run on the panel kernel (_cpu_panel.c): their panel offsets and pass-1 units */
    int64_t *poff = malloc(sizeof(int64_t) * (size_t)(2 * E + 1)), *ustart = poff + E, pfl = 0;
    if (!poff) {
        free(mem);
        return -1;
    }
    int coded = 0; /* b12 experts: each part decodes up to urows / DOWN_ROWS / PR rows at a time */
    for (int64_t e = 0; e < E; e++) coded |= b12_tagged((const void *)gates[e]) | b12_tagged((const void *)ups[e]) |
                                             b12_tagged((const void *)downs[e]);
    /* few rows an expert: the long units, except where a coded row would be decoded into scratch first (no
     * AVX-512, or a build with B12_FEW_OFF for 2+ rows: w_rows decodes each unit's rows, and the scratch stays at
     * GLU_ROWS rows) */
    const int few = maxcount <= GLU_FEW_MAX_T && (!coded || (MS_SIMD == 2 && (maxcount == 1 || !B12_FEW_OFF)));
    const int64_t urows = few ? GLU_ROWS_FEW : GLU_ROWS, down_chunk = few ? DOWN_CHUNK_FEW : DOWN_CHUNK;
    ustart[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        const int use = count[e] >= panel_min;
        poff[e] = use ? pfl : -1;
        pfl += use ? panel_count(count[e]) * PANEL : 0;
        const int64_t rows = use ? PANEL_ROWS : urows;
        ustart[e + 1] = ustart[e] + (I + rows - 1) / rows;
    }
    const int64_t pack_floats = 2 * PR * (I > K ? I : K) + 2 * PR * PANEL;
    int64_t dec_len = 0;
    if (coded) { /* (with the long units, rows decode in registers: GLU_ROWS rows stay the bound) */
        const int64_t most = GLU_ROWS > PR ? GLU_ROWS : PR, down_most = DOWN_ROWS > PR ? DOWN_ROWS : PR;
        dec_len = (most * K > down_most * I ? most * K : down_most * I) + 32;
    }
    const int64_t dec_floats = (parts * dec_len + 1) / 2;
    float *scratch = malloc(sizeof(float) * (size_t)(parts * 2 * urows * maxcount + 16 + dec_floats + 16 +
                                                     (pfl ? parts * pack_floats + pfl * (K + I) : 0)));
    if (!scratch) {
        free(poff);
        free(mem);
        return -1;
    }
    uint16_t *dec = (uint16_t *)(((uintptr_t)(scratch + parts * 2 * urows * maxcount) + 63) & ~(uintptr_t)63);
    float *pk = (float *)(((uintptr_t)((float *)dec + dec_floats) + 63) & ~(uintptr_t)63);
    float *xp = pk + parts * pack_floats, *hp = xp + pfl * K;
    /* only the rows some expert takes (a batch step hands every expert of a layer the whole step's x) */
    for (int64_t e = 0; e < E; e++)
        if (poff[e] < 0)
            for (int64_t a = start[e]; a < start[e] + count[e]; a++)
                bf16_prepare_row(x + row[a] * K, K, xa + a * ldx);
    memset(h, 0, sizeof(float) * (size_t)(A * ldh)); /* the padding of each row stays zero */
    if (pfl) memset(hp, 0, sizeof(float) * (size_t)(pfl * I)); /* ... and the padded tokens of each panel */
    glu_job j = {E, I, K, D, ldx, ldh, maxcount, D, (const uint16_t *const *)gates, (const uint16_t *const *)ups,
                 (const uint16_t *const *)downs, start, count, row, wt, xa, h, scratch, out, act, beta, lbeta,
                 x, poff, ustart, xp, hp, pk, pack_floats, pair, pairs, 0, NULL, dec, dec_len, urows};
    if (parts <= 1) {
        for (int64_t p = 0; p < pfl / PANEL; p++) glu_pack_part(&j, p, pfl / PANEL, 0);
        glu_up_part(&j, 0, 1, 0);
        glu_down_part(&j, 0, 1, 0);
    } else { /* chunks handed out dynamically: about 8 expert row blocks, or 64 output columns, each */
        if (pfl) pool_run_chunks(glu_pack_part, &j, pfl / PANEL, parts);
        /* panel units are 4 register tiles of rows each: hand them out one by one, so that a thread the OS
         * delays for a moment does not hold up the pass */
        const int64_t per = pfl ? 1 : 8;
        const int64_t up_chunks = ustart[E] / per > parts ? ustart[E] / per : parts;
        const int64_t columns = (D + down_chunk - 1) / down_chunk, down_chunks = columns > parts ? columns : parts;
        _Atomic int64_t *left = pfl ? NULL : malloc(sizeof(*left) * (size_t)E);
        if (left) { /* row kernels only (a decode step's experts): one pass, no barrier between the two */
            for (int64_t e = 0; e < E; e++) atomic_init(&left[e], ustart[e + 1] - ustart[e]);
            j.up_chunks = up_chunks;
            j.left = left;
            pool_run_chunks(glu_step_part, &j, up_chunks + down_chunks, parts);
            free(left);
        } else {
            pool_run_chunks(glu_up_part, &j, up_chunks, parts);
            pool_run_chunks(glu_down_part, &j, down_chunks, parts);
        }
    }
    free(scratch);
    free(poff);
    free(mem);
    return 0;
}

int ms_moe_glu_bf16(int64_t E, const int64_t *experts, const int64_t *gates, const int64_t *ups,
                    const int64_t *downs, int64_t I, int64_t K, int64_t D, const float *x, int64_t T,
                    const int64_t *ids, const float *wts, int64_t k, float *out, int act, float beta, float lbeta) {
    return moe_glu(E, experts, gates, ups, downs, I, K, D, x, T, ids, wts, k, out, act, beta, lbeta, PANEL_MIN_T,
                   NULL);
}

/* The batch-invariant form of ms_moe_glu_bf16 (ids required): every expert on the panel kernel whatever its row
 * count (each output one fp32 sum over its inputs in order, the same bits for an expert of 1 row or of 500), and
 * each (t, j) pair's unweighted expert output stored at pairs[(t * k + j) * D ..] (fp32 [T, k, D]) instead of
 * added into out, so that the caller sums a row's experts in slot order whatever order the experts ran in.
 * Returns 0, or -1 when out of memory. */
int ms_moe_glu_bf16_pairs(int64_t E, const int64_t *experts, const int64_t *gates, const int64_t *ups,
                          const int64_t *downs, int64_t I, int64_t K, int64_t D, const float *x, int64_t T,
                          const int64_t *ids, const float *wts, int64_t k, float *pairs, int act, float beta,
                          float lbeta) {
    if (ids == NULL) return -2;
    return moe_glu(E, experts, gates, ups, downs, I, K, D, x, T, ids, wts, k, NULL, act, beta, lbeta, 1, pairs);
}

/* an MXFP4 call's entries: x[e] the prepared inputs (fp32 here, bf16 bits for _cpu_bf16.c's mxb_part) */
typedef struct {
    int64_t E, N, K, ldx;
    void *const *x; const int64_t *T; const uint8_t **p; const uint8_t **s; float **out;
} mx_job;

static void mx_part(void *arg, int part, int parts) {
    mx_job *j = arg;
    int64_t n0, n1;
    split(j->N, part, parts, &n0, &n1);
    for (int64_t e = 0; e < j->E; e++)
        if (j->T[e] > 0)
            mx_rows((const float *)j->x[e], j->ldx, j->T[e], j->K, j->p[e], j->s[e], n0, n1, j->out[e], j->N);
}

typedef void (*mx_prep)(const float *x, int64_t T, int64_t K, int layout, void *xp);

static void mx_prep_f32(const float *x, int64_t T, int64_t K, int layout, void *xp) { mx_prepare(x, T, K, layout, xp); }

/* The inputs of an MXFP4 call prepared by `prep`, each into T rows of `ld` elements of `esize` bytes (consecutive
 * entries passing the same x and token count share one): one malloc'd block (the caller frees it) whose first E
 * pointers are the entries' prepared inputs (NULL for an entry of no tokens); NULL when out of memory. */
static void **mx_inputs(int64_t E, const int64_t *xs, const int64_t *Ts, int64_t K, int layout, int64_t ld,
                        size_t esize, mx_prep prep) {
    int64_t total = 0;
    for (int64_t e = 0; e < E; e++) total += Ts[e] > 0 ? Ts[e] : 0;
    void **x = malloc((size_t)E * sizeof(void *) + esize * (size_t)(total * ld) + 64);
    if (!x) return NULL;
    char *xp = (char *)(((uintptr_t)(x + E) + 63) & ~(uintptr_t)63);
    for (int64_t e = 0; e < E; e++) {
        if (Ts[e] <= 0) {
            x[e] = NULL;
        } else if (e > 0 && xs[e] == xs[e - 1] && Ts[e] == Ts[e - 1]) {
            x[e] = x[e - 1]; /* the same input for several weights: prepared once */
        } else {
            prep((const float *)(intptr_t)xs[e], Ts[e], K, layout, xp);
            x[e] = xp;
            xp += esize * (size_t)(Ts[e] * ld);
        }
    }
    return x;
}

/* ---- MXFP4 times fp32 activations for one token, in integers (AVX-512 VNNI). A decode token's product with an
 * MXFP4 weight is bound by the CPU on two cores, not by the memory bus: the fp32 tiles decode each code to fp32 and
 * scale it, ~34 vector instructions per four blocks (K3's routed experts ran at 0.54 of the bus in a warm decode).
 * Here every 8 inputs that one 32-bit lane sums (4 code bytes' low and high nibbles of one block) share a
 * fixed-point exponent E, 2^(E - 1) <= their largest |x| < 2^E, each held as the integer X = round(x 2^(22 - E))
 * split into three signed bytes q0 2^16 + q1 2^8 + q2; each code is looked up as the unsigned byte 2 w + 12 (2 w
 * an integer in [-12, 12]) and vpdpbusd sums the exact integer products of four codes at a time, the 12 sum X
 * taken off; each lane's integer sum is converted and scaled by 2^(e - 127) 2^(E - 23) once per group of four
 * blocks. The products and a lane's sums are exact: beyond fp32 summation the only rounding is x's own, each x to
 * within 2^-23 of its lane's largest |x| (measured: 2-4x the fp32 tiles' error against float64, both within a few
 * units of 2^-24 of sum |w x|). A token holding a non-finite value or an extreme magnitude (a lane exponent
 * outside [-100, 100]) takes the fp32 tiles instead. -DMXV_OFF=1 builds without it. */
#if MS_AVX512 && defined(__AVX512VNNI__) && !defined(MXV_OFF)
#define MXV 1
#define MXV_GROUP 512 /* prepared bytes per group of four blocks: q0, q1, q2 for the low and the high nibbles (6 x 64),
                       * each lane's correction -12 sum X (16 int32), each lane's input scale 2^(E - 23) (16 fp32) */
#ifndef MXV_PF
#define MXV_PF 4096   /* software prefetch distance of the weight rows */
#endif
static int64_t mxv_stride(int64_t K) { return (K / 32 + 3) / 4 * MXV_GROUP; }

/* x [K] into the prepared groups; 0 when x cannot be held so (a non-finite value, an extreme exponent). Each
 * 32-bit lane of a group sums the products of 8 inputs of one block (4 bytes' low and high nibbles): they share
 * one fixed-point exponent E, 2^(E - 1) <= their largest |x| < 2^E (E = 0 and scale 0 when all are 0). A block at a
 * time: its inputs in the order the codes come (low nibbles of bytes 0-15, then high), each lane's largest |x|
 * spread over its four elements by two in-lane swaps. */
static int mxv_prepare(const float *x, int64_t K, int layout, int8_t *xp) {
    const int64_t nb = K / 32;
    memset(xp, 0, (size_t)mxv_stride(K));
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t b = 0; b < nb; b++) {
        const __m512 a0 = _mm512_loadu_ps(x + b * 32), a1 = _mm512_loadu_ps(x + b * 32 + 16);
        /* mx_input: low_first holds inputs 2j, 2j + 1 in byte j's nibbles; gguf j, j + 16 */
        const __m512 lo = layout == 0 ? _mm512_permutex2var_ps(a0, even, a1) : a0;
        const __m512 hi = layout == 0 ? _mm512_permutex2var_ps(a0, odd, a1) : a1;
        if (_mm512_fpclass_ps_mask(lo, 0x99) | _mm512_fpclass_ps_mask(hi, 0x99)) return 0; /* NaN or infinity */
        __m512 m = _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi));
        m = _mm512_max_ps(m, _mm512_permute_ps(m, 0xB1));
        m = _mm512_max_ps(m, _mm512_permute_ps(m, 0x4E)); /* each lane's largest |x|, in its four elements */
        const __mmask16 live = _mm512_cmp_ps_mask(m, _mm512_setzero_ps(), _CMP_GT_OQ);
        const __m512 E = _mm512_maskz_add_ps(live, _mm512_getexp_ps(m), one); /* floor(log2 m) + 1 */
        if (_mm512_mask_cmp_ps_mask(live, E, _mm512_set1_ps(-100.0f), _CMP_LT_OQ) |
            _mm512_mask_cmp_ps_mask(live, E, _mm512_set1_ps(100.0f), _CMP_GT_OQ))
            return 0;
        const __m512 f = _mm512_maskz_scalef_ps(live, one, _mm512_sub_ps(_mm512_set1_ps(22.0f), E));
        /* x f is exact (a power of two, |x f| <= 2^22); rounded to nearest, even */
        const __m512i X[2] = {_mm512_cvtps_epi32(_mm512_mul_ps(lo, f)), _mm512_cvtps_epi32(_mm512_mul_ps(hi, f))};
        int8_t *g = xp + (b / 4) * MXV_GROUP;
        const int bl = (int)(b % 4);
        for (int h = 0; h < 2; h++) { /* X = q0 2^16 + q1 2^8 + q2, each a signed byte (|q0| <= 64) */
            const __m512i q2 = _mm512_srai_epi32(_mm512_slli_epi32(X[h], 24), 24);
            const __m512i X1 = _mm512_srai_epi32(_mm512_sub_epi32(X[h], q2), 8);
            const __m512i q1 = _mm512_srai_epi32(_mm512_slli_epi32(X1, 24), 24);
            const __m512i q0 = _mm512_srai_epi32(_mm512_sub_epi32(X1, q1), 8);
            _mm_storeu_si128((__m128i *)(void *)(g + h * 64 + 16 * bl), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(void *)(g + 128 + h * 64 + 16 * bl), _mm512_cvtepi32_epi8(q1));
            _mm_storeu_si128((__m128i *)(void *)(g + 256 + h * 64 + 16 * bl), _mm512_cvtepi32_epi8(q2));
        }
        __m512i sum = _mm512_add_epi32(X[0], X[1]);
        sum = _mm512_add_epi32(sum, _mm512_shuffle_epi32(sum, (_MM_PERM_ENUM)0xB1));
        sum = _mm512_add_epi32(sum, _mm512_shuffle_epi32(sum, (_MM_PERM_ENUM)0x4E)); /* each lane's sum of X */
        const __m512i corr = _mm512_mullo_epi32(_mm512_maskz_compress_epi32(0x1111, sum), _mm512_set1_epi32(-12));
        const __m512 xs = _mm512_maskz_compress_ps(0x1111, _mm512_maskz_scalef_ps(live, one,
                                                                     _mm512_sub_ps(E, _mm512_set1_ps(23.0f))));
        _mm_storeu_si128((__m128i *)(void *)(g + 384 + 16 * bl), _mm512_castsi512_si128(corr));
        _mm_storeu_ps((float *)(void *)(g + 448 + 16 * bl), _mm512_castps512_ps128(xs));
    }
    return 1;
}

/* one row of N: sum_k w_k x_k from the prepared token */
INLINE float mxv_row(const int8_t *xp, const uint8_t *p, const uint8_t *s, int64_t K) {
    /* 2 w + 12 for the 16 codes: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives */
    const __m512i tab = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24,
                                                             12, 11, 10, 9, 8, 6, 4, 0));
    const __m512i nib = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    const __m512i lane_byte = MX_LANE_BYTE;
    const __m512i tiny = _mm512_set1_epi32(1 << 22); /* scale byte 0: 2^-127, a subnormal */
    const int64_t nb = K / 32;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0, g = 0; b < nb; b += 4, g += MXV_GROUP) {
        __m512i v;
        uint32_t sc = 0;
        MX_GROUP_LOAD(p, s, b, nb, v, sc);
        _mm_prefetch((const char *)(p + b * 16 + MXV_PF), _MM_HINT_T0);
        const __m512i wl = _mm512_shuffle_epi8(tab, _mm512_and_si512(v, nib));
        const __m512i wh = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));
        const int8_t *xg = xp + g;
        __m512i d0 = _mm512_dpbusd_epi32(zero, wl, _mm512_load_si512((const void *)xg));
        __m512i d1 = _mm512_dpbusd_epi32(zero, wl, _mm512_load_si512((const void *)(xg + 128)));
        __m512i d2 = _mm512_dpbusd_epi32(zero, wl, _mm512_load_si512((const void *)(xg + 256)));
        d0 = _mm512_dpbusd_epi32(d0, wh, _mm512_load_si512((const void *)(xg + 64)));
        d1 = _mm512_dpbusd_epi32(d1, wh, _mm512_load_si512((const void *)(xg + 192)));
        d2 = _mm512_dpbusd_epi32(d2, wh, _mm512_load_si512((const void *)(xg + 320)));
        /* the lanes' corrections -12 sum X (starting d2 from them instead ran 0.86x here) */
        d2 = _mm512_add_epi32(d2, _mm512_load_si512((const void *)(xg + 384)));
        const __m512i t = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(d0, 16), _mm512_slli_epi32(d1, 8)), d2);
        const __m512i bits = _mm512_slli_epi32(_mm512_shuffle_epi8(_mm512_set1_epi32((int)sc), lane_byte), 23);
        const __m512 scale = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_max_epi32(bits, tiny)),
                                           _mm512_load_ps((const float *)(const void *)(xg + 448)));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), scale, acc);
    }
    return _mm512_reduce_add_ps(acc);
}

#ifndef MXV_ROWS
#define MXV_ROWS 256 /* rows per chunk of a dynamically split call (~0.5 MB of a K3 expert's codes; against an even
                      * split of each weight's rows: 1.06x, bench/ab_builds.py mxfp4 on two threads) */
#endif
/* chunk c: rows [r MXV_ROWS, (r + 1) MXV_ROWS) of entry c / per (per = chunks of an entry), handed out in order */
static void mxv_chunk(void *arg, int64_t c, int64_t chunks, int slot) {
    mx_job *j = arg;
    (void)chunks;
    (void)slot;
    const int64_t per = (j->N + MXV_ROWS - 1) / MXV_ROWS, e = c / per, n0 = c % per * MXV_ROWS;
    const int64_t n1 = n0 + MXV_ROWS < j->N ? n0 + MXV_ROWS : j->N, half = j->K / 2, nb = j->K / 32;
    if (j->T[e] > 0)
        for (int64_t n = n0; n < n1; n++)
            j->out[e][n] = mxv_row((const int8_t *)j->x[e], j->p[e] + n * half, j->s[e] + n * nb, j->K);
}

/* the one-token entries' inputs prepared for mxv_row (as mx_inputs does for the fp32 tiles); NULL when out of
 * memory, and *ok = 0 (nothing to free) when some token's x cannot be held in 23 bits */
static void **mxv_inputs(int64_t E, const int64_t *xs, const int64_t *Ts, int64_t K, int layout, int *ok) {
    const int64_t ld = mxv_stride(K);
    void **x = malloc((size_t)E * sizeof(void *) + (size_t)(E * ld) + 64);
    *ok = 1;
    if (!x) return NULL;
    int8_t *xp = (int8_t *)(((uintptr_t)(x + E) + 63) & ~(uintptr_t)63);
    for (int64_t e = 0; e < E; e++) {
        if (Ts[e] <= 0) {
            x[e] = NULL;
        } else if (e > 0 && Ts[e - 1] > 0 && (xs[e] == xs[e - 1] || !memcmp((const void *)(intptr_t)xs[e],
                                                                          (const void *)(intptr_t)xs[e - 1],
                                                                          sizeof(float) * (size_t)K))) {
            x[e] = x[e - 1]; /* the same token for several weights (a routed group's copies of one row) */
        } else {
            if (!mxv_prepare((const float *)(intptr_t)xs[e], K, layout, xp)) {
                free(x);
                *ok = 0;
                return NULL;
            }
            x[e] = xp;
            xp += ld;
        }
    }
    return x;
}
#endif

/* ---- SiTU-GLU of gate and up rows (Kimi K3's experts between their two products: a routed group's [R, I], a
 * shared expert's or the dense MLP's [1, I]) in one call instead of eight small torch ops, each of which cost tens
 * of microseconds between the native calls of a decode step (their threads woken, their inputs out of cache). */
typedef struct {
    const float *g, *u;
    float *out;
    int64_t n;
    float beta, lbeta;
} situ_job;

static void situ_part(void *arg, int part, int parts) {
    const situ_job *j = arg;
    const int64_t blocks = (j->n + 15) / 16, i0 = blocks * part / parts * 16;
    const int64_t i1 = blocks * (part + 1) / parts * 16 < j->n ? blocks * (part + 1) / parts * 16 : j->n;
    int64_t i = i0;
#if MS_AVX512
    for (; i + 16 <= i1; i += 16)
        _mm512_storeu_ps(j->out + i, vsitu_glu_f32(_mm512_loadu_ps(j->g + i), _mm512_loadu_ps(j->u + i), j->beta,
                                                   j->lbeta));
#endif
    for (; i < i1; i++) j->out[i] = situ_glu_f32(j->g[i], j->u[i], j->beta, j->lbeta);
}

#define SITU_MIN_PART 8192 /* values per thread below which one thread does it all */

/* out[i] = SiTU-GLU(g[i], u[i]) for i < n (fp32, contiguous; out may be g or u) */
void ms_situ_glu(const float *g, const float *u, int64_t n, float beta, float lbeta, float *out) {
    if (n <= 0) return;
    situ_job j = {g, u, out, n, beta, lbeta};
    int parts = pool_parts;
    while (parts > 1 && n / parts < SITU_MIN_PART) parts--;
    pool_run(situ_part, &j, parts);
}

/* whether one-token MXFP4 products go through the integer path (mxv_row) */
int ms_mxfp4_int(void) {
#ifdef MXV
    return 1;
#else
    return 0;
#endif
}

/* 1 + the first entry whose N x K/32 scale bytes hold a 0xFF (NaN in E8M0), or 0 */
static int mx_find255(int64_t E, const int64_t *ss, int64_t N, int64_t K) {
    for (int64_t e = 0; e < E; e++)
        if ((e == 0 || ss[e] != ss[e - 1]) && ms_find_byte((const uint8_t *)(intptr_t)ss[e], N * (K / 32), 255) >= 0)
            return (int)(1 + e);
    return 0;
}

/* For e < E: out[e][T[e], N] = x[e][T[e], K] @ W_e^T, W_e the MXFP4 weight (p[e], s[e]) of N rows; K % 32 == 0.
 * All pointer arrays are int64 addresses. With check255, first looks for a 0xFF scale byte (NaN in E8M0) in every
 * entry's scales and returns 1 + the first such entry without computing anything. Returns 0, or -1 when out of
 * memory. */
int ms_linear_mxfp4(int64_t E, const int64_t *xs, const int64_t *Ts, const int64_t *ps, const int64_t *ss,
                    const int64_t *outs, int64_t N, int64_t K, int layout, int64_t min_rows_per_thread,
                    int check255) {
    if (E <= 0 || N <= 0) return 0;
    const int bad = check255 ? mx_find255(E, ss, N, K) : 0;
    if (bad) return bad;
    if (K <= 0) {
        for (int64_t e = 0; e < E; e++)
            if (Ts[e] > 0) memset((void *)(intptr_t)outs[e], 0, sizeof(float) * (size_t)(Ts[e] * N));
        return 0;
    }
    int parts = pool_parts;
    while (parts > 1 && N / parts < min_rows_per_thread) parts--;
#ifdef MXV
    int one = 1; /* every entry one token (or none): a decode step's products, in integers */
    for (int64_t e = 0; e < E && one; e++) one = Ts[e] <= 1;
    if (one) {
        int ok;
        void **xv = mxv_inputs(E, xs, Ts, K, layout, &ok);
        if (ok && !xv) return -1;
        if (xv) {
            mx_job j = {E, N, K, mxv_stride(K), xv, Ts, (const uint8_t **)ps, (const uint8_t **)ss, (float **)outs};
            pool_run_chunks(mxv_chunk, &j, E * ((N + MXV_ROWS - 1) / MXV_ROWS), parts);
            free(xv);
            return 0;
        }
    }
#endif
    const int64_t ldx = mx_stride(K);
    void **x = mx_inputs(E, xs, Ts, K, layout, ldx, sizeof(float), mx_prep_f32);
    if (!x) return -1;
    mx_job j = {E, N, K, ldx, x, Ts, (const uint8_t **)ps, (const uint8_t **)ss, (float **)outs};
    pool_run(mx_part, &j, parts);
    free(x);
    return 0;
}

/* out[d] += y[e][d] w[e] for e in order, each product rounded before its sum (as torch adds y * w rows with
 * index_add_): never contracted into a fused multiply-add */
__attribute__((noinline, optimize("fp-contract=off"))) static void add_weighted_rows(float *out, const float *y,
                                                                                  const float *w, int64_t E,
                                                                                  int64_t L) {
    for (int64_t e = 0; e < E; e++) {
        const float we = w[e], *ye = y + e * L;
        for (int64_t d = 0; d < L; d++) {
            const float t = ye[d] * we;
            out[d] = out[d] + t;
        }
    }
}

/* A decode step's routed group of MXFP4 SiTU-GLU experts for one token (Kimi K3's latent MoE) in one call instead
 * of two product calls, an activation call and torch's gather and weighted add between them: gate and up of every
 * expert (p13 / s13: w1 and w3 of expert e at 2e and 2e + 1), SiTU-GLU, each expert's down product (p2 / s2), then
 * out [L] += w[e] y_e in entry order. Products as ms_linear_mxfp4 computes them (x prepared once), the activation
 * as ms_situ_glu, the sum as add_weighted_rows: the same bits as those calls. scratch holds 2 E I + E L floats.
 * Returns 0; 1 + i for the first weight whose scales hold a 0xFF (i < 2E: p13's entry i, else p2's entry i - 2E),
 * nothing computed; -1 when out of memory. */
int ms_mxfp4_situ_group1(int64_t E, const float *x, const int64_t *p13, const int64_t *s13, const int64_t *p2,
                         const int64_t *s2, const float *w, int64_t I, int64_t L, int layout, float beta, float lbeta,
                         int64_t min_rows_per_thread, float *scratch, float *out) {
    if (E <= 0) return 0;
    int bad = mx_find255(2 * E, s13, I, L);
    if (bad) return bad;
    bad = mx_find255(E, s2, L, I);
    if (bad) return (int)(2 * E) + bad;
    int64_t *a = malloc(sizeof(int64_t) * (size_t)(8 * E));
    if (!a) return -1;
    int64_t *xs = a, *ts = a + 2 * E, *outs = a + 4 * E, *hs = a + 6 * E, *ys = a + 7 * E;
    float *gate = scratch, *up = scratch + E * I, *y = scratch + 2 * E * I;
    for (int64_t e = 0; e < E; e++) {
        xs[2 * e] = xs[2 * e + 1] = (int64_t)(intptr_t)x;
        ts[2 * e] = ts[2 * e + 1] = 1;
        outs[2 * e] = (int64_t)(intptr_t)(gate + e * I);
        outs[2 * e + 1] = (int64_t)(intptr_t)(up + e * I);
        hs[e] = (int64_t)(intptr_t)(gate + e * I); /* the activation overwrites the gate rows */
        ys[e] = (int64_t)(intptr_t)(y + e * L);
    }
    int code = ms_linear_mxfp4(2 * E, xs, ts, p13, s13, outs, I, L, layout, min_rows_per_thread, 0);
    if (code == 0) {
        ms_situ_glu(gate, up, E * I, beta, lbeta, gate);
        code = ms_linear_mxfp4(E, hs, ts, p2, s2, ys, L, I, layout, min_rows_per_thread, 0);
    }
    if (code == 0) add_weighted_rows(out, y, w, E, L);
    free(a);
    return code;
}

/* ------------------------------------------------------------------------------------ softmax top-k router */
/* softmax over one row of E router logits (in place, fp32), then the k largest (best first) into ids / wts,
 * divided by their sum when renorm; `taken` is E bytes of scratch */
static void softmax_topk_row(float *p, int64_t E, int64_t k, int renorm, char *taken, int64_t *ids, float *wts) {
    float m = -INFINITY, sum = 0.0f;
    for (int64_t e = 0; e < E; e++) m = p[e] > m ? p[e] : m;
    for (int64_t e = 0; e < E; e++) sum += (p[e] = expf(p[e] - m));
    for (int64_t e = 0; e < E; e++) p[e] /= sum;
    float picked = 0.0f;
    memset(taken, 0, (size_t)E);
    for (int64_t j = 0; j < k; j++) { /* selection: k passes over E (k = 8 of 64-512 experts); a NaN ranks first,
                                       * as in torch.topk, and an index is always chosen */
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || p[e] > p[best] || (isnan(p[e]) && !isnan(p[best])))) best = e;
        taken[best] = 1;
        ids[j] = best;
        wts[j] = p[best];
        picked += p[best];
    }
    if (renorm)
        for (int64_t j = 0; j < k; j++) wts[j] /= picked;
}

/* For T tokens: logits = x[t] @ w^T (bf16 w [E, K]), probs = softmax(logits) in fp32, the k largest (best first)
 * into ids[t * k ..] and their probabilities into wts (divided by their sum when renorm). One call instead of a
 * GEMV and four small torch ops per MoE layer of a decode step. Returns 0, or -1 when out of memory. */
int ms_router_softmax_topk(const float *x, int64_t T, int64_t K, const uint16_t *w, int64_t E, int64_t k, int renorm,
                           int64_t *ids, float *wts) {
    if (T <= 0 || E <= 0 || k <= 0 || k > E) return 0;
    const int64_t ldx = bf16_stride(K);
    float *mem = malloc(sizeof(float) * (size_t)(T * ldx + T * E) + (size_t)E);
    if (!mem) return -1;
    float *xp = mem, *logits = mem + T * ldx;
    char *taken = (char *)(logits + T * E);
    bf16_prepare(x, T, K, xp);
    bf16_rows(xp, ldx, T, K, w, 0, E, logits, E);
    for (int64_t t = 0; t < T; t++) softmax_topk_row(logits + t * E, E, k, renorm, taken, ids + t * k, wts + t * k);
    free(mem);
    return 0;
}

/* --------------------------------------------------------------------------- norms, rope, GQA attention */
#define DOT_LANES 16 /* independent partial sums (one AVX-512 register): the compiler keeps a serial sum serial */

/* a . b over n floats in DOT_LANES partial sums folded pairwise: the norms' sum of squares and the attention
 * kernels' q.k (ms_gqa_attend, the decode block's and the paged batch call all use it, so their results stay
 * bit-identical to one another) */
static inline float dot_lanes(const float *a, const float *b, int64_t n) {
    float lane[DOT_LANES] = {0};
    int64_t c = 0;
    for (; c + DOT_LANES <= n; c += DOT_LANES)
        for (int l = 0; l < DOT_LANES; l++) lane[l] += a[c + l] * b[c + l];
    for (int w = DOT_LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    float s = lane[0];
    for (; c < n; c++) s += a[c] * b[c];
    return s;
}

/* rms-normalise n rows of width H in place: x * rsqrt(mean(x^2) + eps) * w, w fp32 (wbf16 0) or bf16 (1), or
 * NULL for none */
static void rms_rows(float *x, int64_t n, int64_t H, const void *w, int wbf16, float eps) {
    for (int64_t i = 0; i < n; i++) {
        float *r = x + i * H;
        const float ss = dot_lanes(r, r, H);
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        if (!w)
            for (int64_t c = 0; c < H; c++) r[c] *= inv;
        else if (wbf16)
            for (int64_t c = 0; c < H; c++) r[c] = r[c] * inv * bits_f32((uint32_t)((const uint16_t *)w)[c] << 16);
        else
            for (int64_t c = 0; c < H; c++) r[c] = r[c] * inv * ((const float *)w)[c];
    }
}

typedef struct {
    const float *x; float *out; int64_t T, H; const void *w; int wbf16; float eps;
} rms_job;

static void rms_part(void *arg, int64_t chunk, int64_t chunks, int slot) {
    const rms_job *j = arg;
    (void)slot;
    const int64_t r0 = j->T * chunk / chunks, r1 = j->T * (chunk + 1) / chunks;
    if (j->out != j->x) memcpy(j->out + r0 * j->H, j->x + r0 * j->H, sizeof(float) * (size_t)((r1 - r0) * j->H));
    rms_rows(j->out + r0 * j->H, r1 - r0, j->H, j->w, j->wbf16, j->eps);
}

#define RMS_CHUNK_FLOATS (64 << 10) /* 256 KiB of rows a chunk: a many-row norm is split over the pool */

/* out[T, H] = rms_norm(x[T, H]) * w (x, out fp32; w as in rms_rows); each row is computed alike on any thread */
void ms_rms_norm(const float *x, int64_t T, int64_t H, const void *w, int wbf16, float eps, float *out) {
    rms_job j = {x, out, T, H, w, wbf16, eps};
    const int64_t chunks = T * H / RMS_CHUNK_FLOATS;
    if (chunks >= 2 && pool_parts > 1)
        pool_run_chunks(rms_part, &j, chunks < T ? chunks : T, pool_parts);
    else
        rms_part(&j, 0, 1, 0);
}

/* rotate-half rope of H heads of width D at position pos, in place: x*cos + rotate_half(x)*sin with
 * angle_i = pos * inv_freq[i] (i < D/2) and cos/sin times `factor` */
static void rope_heads(float *x, int64_t H, int64_t D, int64_t pos, const float *inv_freq, float factor) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = (float)pos * inv_freq[i], c = cosf(a) * factor, s = sinf(a) * factor;
        for (int64_t h = 0; h < H; h++) {
            float *r = x + h * D;
            const float lo = r[i], hi = r[i + half];
            r[i] = lo * c - hi * s;
            r[i + half] = hi * c + lo * s;
        }
    }
}

/* One sequence's segment of T new tokens at positions pos0.. (already appended: rows [L - T, L) of the caches).
 * q [T, Hq, D] and the T new cache rows of kc are per-head rms-normalised (weights qn, kn of the dtype nbf16 says,
 * as rms_rows; NULL skips) and roped (inv_freq [D/2]; NULL skips) in place; then each query t attends causally to
 * cache rows 0 .. L - T + t (the last `window` of them when window > 0) with softmax(q k scale), fp32: out
 * [T, Hq, Dv]. kc [L, Hkv, D], vc [L, Hkv, Dv], Hq a
 * multiple of Hkv. Returns 0, or -1 when out of memory. */
int ms_gqa_attend(int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, float *q, float *kc, const float *vc,
                  int64_t L, const void *qn, const void *kn, int nbf16, float eps, const float *inv_freq,
                  float factor, float scale, int64_t window, float *out) {
    const int64_t pos0 = L - T, G = Hq / Hkv;
    float *p = malloc(sizeof(float) * (size_t)(L > 0 ? L : 1));
    if (!p) return -1;
    for (int64_t t = 0; t < T; t++) {
        float *qt = q + t * Hq * D, *kt = kc + (pos0 + t) * Hkv * D;
        if (qn) rms_rows(qt, Hq, D, qn, nbf16, eps);
        if (kn) rms_rows(kt, Hkv, D, kn, nbf16, eps);
        if (inv_freq) {
            rope_heads(qt, Hq, D, pos0 + t, inv_freq, factor);
            rope_heads(kt, Hkv, D, pos0 + t, inv_freq, factor);
        }
    }
    for (int64_t t = 0; t < T; t++) {
        const int64_t n = pos0 + t + 1, j0 = window > 0 && n > window ? n - window : 0; /* keys [j0, n) */
        for (int64_t h = 0; h < Hq; h++) {
            const float *qh = q + (t * Hq + h) * D;
            const int64_t g = h / G;
            float m = -INFINITY;
            for (int64_t j = j0; j < n; j++) {
                const float *kj = kc + (j * Hkv + g) * D;
                p[j] = dot_lanes(qh, kj, D) * scale;
                if (p[j] > m) m = p[j];
            }
            const float sum = softmax_exps(p + j0, n - j0, m);
            float *oh = out + (t * Hq + h) * Dv;
            for (int64_t d = 0; d < Dv; d++) oh[d] = 0.0f;
            for (int64_t j = j0; j < n; j++) {
                const float w = p[j] / sum, *vj = vc + (j * Hkv + g) * Dv;
                for (int64_t d = 0; d < Dv; d++) oh[d] += w * vj[d];
            }
        }
    }
    free(p);
    return 0;
}

/* ------------------------------------------------------------------------- KDA decode (one token per sequence) */
/* Short causal depthwise conv for B sequences, one new token each: y[b, c] = sum_{t < K-1} win_b[t, c] taps[c, t]
 * + x_b[c] taps[c, K-1]; then each window drops its oldest row and appends x_b. win_b (fp32 [K-1, C]) at Ws[b],
 * x_b (fp32 [C]) at Xs[b], taps fp32 [C, K], y fp32 [B, C]. */
void ms_conv_decode(int64_t B, int64_t C, int64_t K, const int64_t *Ws, const int64_t *Xs, const float *taps,
                    float *y) {
    for (int64_t b = 0; b < B; b++) {
        float *win = (float *)(intptr_t)Ws[b];
        const float *x = (const float *)(intptr_t)Xs[b];
        float *yb = y + b * C;
        for (int64_t c = 0; c < C; c++) yb[c] = x[c] * taps[c * K + K - 1];
        for (int64_t t = 0; t < K - 1; t++) {
            const float *row = win + t * C;
            for (int64_t c = 0; c < C; c++) yb[c] += row[c] * taps[c * K + t];
        }
        if (K > 1) {
            memmove(win, win + C, sizeof(float) * (size_t)((K - 2) * C));
            memcpy(win + (K - 2) * C, x, sizeof(float) * (size_t)C);
        }
    }
}

/* The delta-rule step for B sequences x H heads, each state S (fp32 [H, dk, dv] at Ss[b]) updated in place:
 *   S <- diag(exp g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
 * q, k, g fp32 [B, H, dk], v fp32 [B, H, dv], beta fp32 [B, H], out fp32 [B, H, dv]. Two passes over S. */
void ms_kda_decode(int64_t B, int64_t H, int64_t dk, int64_t dv, const int64_t *Ss, const float *q, const float *k,
                   const float *v, const float *g, const float *beta, float *out) {
    float u[dv > 0 ? dv : 1]; /* one head's value width (128 on Kimi Linear / K3): on the stack, cannot fail */
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < H; h++) {
            const int64_t bh = b * H + h;
            float *S = (float *)(intptr_t)Ss[b] + h * dk * dv;
            const float *qh = q + bh * dk, *kh = k + bh * dk, *gh = g + bh * dk, *vh = v + bh * dv;
            float *oh = out + bh * dv;
            for (int64_t j = 0; j < dv; j++) u[j] = 0.0f;
            for (int64_t i = 0; i < dk; i++) {
                const float e = expf(gh[i]), ki = kh[i];
                float *row = S + i * dv;
                for (int64_t j = 0; j < dv; j++) {
                    const float s = row[j] * e;
                    row[j] = s;
                    u[j] += ki * s;
                }
            }
            const float bt = beta[bh];
            for (int64_t j = 0; j < dv; j++) {
                u[j] = bt * (vh[j] - u[j]);
                oh[j] = 0.0f;
            }
            for (int64_t i = 0; i < dk; i++) {
                const float ki = kh[i], qi = qh[i];
                float *row = S + i * dv;
                for (int64_t j = 0; j < dv; j++) {
                    const float s = row[j] + ki * u[j];
                    row[j] = s;
                    oh[j] += qi * s;
                }
            }
        }
    }
}
