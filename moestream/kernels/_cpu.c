/* moestream native CPU kernels: y[T, N] = x[T, K] @ W^T for bf16 and MXFP4 weights, fp32 activations.
 *
 * Built at first use by moestream/kernels/cpu.py with the system gcc (-O3 -march=native) and loaded with ctypes.
 * Each weight row is read once per token tile and dotted with every token of the tile; MXFP4 is decoded in
 * registers (16-entry E2M1 table times the block's 2^(s-127), looked up with a lane permute), never expanded in
 * memory. AVX-512 (F+BW+VL) paths sit behind #if; the scalar code below them computes the same thing anywhere.
 * A tiny persistent pthread pool can split the rows of one call over several threads (ms_set_threads).
 *
 * Layouts (see kernels/quant.py): packed uint8 [N, K/2], scales uint8 [N, K/32] (E8M0, 255 rejected by the caller).
 * layout 0 "low_first": byte j holds inputs 2j (low nibble) and 2j+1 (high nibble).
 * layout 1 "gguf": within each block of 32, byte j holds inputs j (low nibble) and j+16 (high nibble).
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define MS_AVX512 1
#else
#define MS_AVX512 0
#endif

#define MS_ABI 3
#define TILE_T 8   /* tokens per register tile */
#define MAX_THREADS 8

#define INLINE static inline __attribute__((always_inline))

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* 2^(s - 127) for an E8M0 byte, exact (s = 0 is the subnormal 2^-127; 255 never reaches here). */
INLINE float e8m0(uint8_t s) {
    union { uint32_t u; float f; } v;
    v.u = s ? (uint32_t)s << 23 : 1u << 22;
    return v.f;
}

INLINE float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

int ms_abi(void) { return MS_ABI; }
int ms_simd(void) { return MS_AVX512; }

int64_t ms_find_byte(const uint8_t *p, int64_t n, int value) {
    const uint8_t *hit = n > 0 ? memchr(p, value, (size_t)n) : NULL;
    return hit ? (int64_t)(hit - p) : -1;
}

/* ------------------------------------------------------------------------------------------------ bf16 */

#if MS_AVX512
INLINE __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
INLINE __m512 bf16x16_mask(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* R weight rows (stride K) times TT tokens (stride ldx) -> out[t * ldo + r]. */
INLINE void bf16_tile(const float *x, int64_t ldx, const uint16_t *w, int64_t K, float *out, int64_t ldo,
                      const int R, const int TT) {
    __m512 acc[4][TILE_T];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) acc[r][t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) wv[r] = bf16x16(w + r * K + k);
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
            __m512 xv = _mm512_loadu_ps(x + t * ldx + k);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
        }
    }
    if (k < K) {
        __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        __m512 wv[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) wv[r] = bf16x16_mask(w + r * K + k, m);
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
            __m512 xv = _mm512_maskz_loadu_ps(m, x + t * ldx + k);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) out[t * ldo + r] = _mm512_reduce_add_ps(acc[r][t]);
}

#define BF16_CASE(R, TT) \
    case TT: bf16_tile(x, ldx, w, K, out, ldo, R, TT); break;
#define BF16_SWITCH(R)                                                                                 \
    switch (tt) { BF16_CASE(R, 1) BF16_CASE(R, 2) BF16_CASE(R, 3) BF16_CASE(R, 4) BF16_CASE(R, 5)     \
                  BF16_CASE(R, 6) BF16_CASE(R, 7) BF16_CASE(R, 8) }

static void bf16_block(const float *x, int64_t ldx, int tt, const uint16_t *w, int64_t K, float *out, int64_t ldo,
                       int rows) {
    if (rows == 4) { BF16_SWITCH(4) }
    else if (rows == 2) { BF16_SWITCH(2) }
    else { BF16_SWITCH(1) }
}
#else
static void bf16_block(const float *x, int64_t ldx, int tt, const uint16_t *w, int64_t K, float *out, int64_t ldo,
                       int rows) {
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < tt; t++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc += bf16_to_f32(w[r * K + k]) * x[t * ldx + k];
            out[t * ldo + r] = acc;
        }
}
#endif

/* rows per register block for a token tile of tt: 16 accumulators at most */
static int rows_for(int tt) { return tt <= 4 ? 4 : 2; }

/* rows [n0, n1) of every token */
static void bf16_rows(const float *x, int64_t T, int64_t K, const uint16_t *w, int64_t n0, int64_t n1, float *out,
                      int64_t N) {
    int64_t n = n0;
    while (n < n1) {
        int64_t left = n1 - n;
        /* the widest block for the first tile decides the step; later tiles reuse those rows from L1 */
        int step = rows_for(T < TILE_T ? (int)T : TILE_T);
        if (left < step) step = left >= 2 ? 2 : 1;
        for (int64_t t0 = 0; t0 < T; t0 += TILE_T) {
            int tt = (int)(T - t0 < TILE_T ? T - t0 : TILE_T);
            int r = rows_for(tt) < step ? rows_for(tt) : step;
            for (int done = 0; done < step; done += r)
                bf16_block(x + t0 * K, K, tt, w + (n + done) * K, K, out + t0 * N + n + done, N, r);
        }
        n += step;
    }
}

/* ----------------------------------------------------------------------------------------------- MXFP4 */

/* x rows of K inputs reordered so that each block of 32 lists its 16 low-nibble inputs, then its 16 high-nibble
 * inputs (the gguf order already is that). */
static void permute_low_first(const float *x, int64_t T, int64_t K, float *xp) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t b = 0; b < K; b += 32) {
            const float *src = x + t * K + b;
            float *dst = xp + t * K + b;
            for (int j = 0; j < 16; j++) {
                dst[j] = src[2 * j];
                dst[16 + j] = src[2 * j + 1];
            }
        }
}

#if MS_AVX512
static float SCALE[256];
__attribute__((constructor)) static void init_scales(void) {
    for (int s = 0; s < 256; s++) SCALE[s] = e8m0((uint8_t)s);
}

INLINE void mx_tile(const float *xp, int64_t ldx, const uint8_t *p, const uint8_t *s, int64_t K, float *out,
                    int64_t ldo, const int R, const int TT) {
    const __m512 table = _mm512_loadu_ps(E2M1);
    const int64_t half = K / 2, nb = K / 32;
    __m512 acc[4][TILE_T];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512 lo[4], hi[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + r * half + b * 16)));
            __m512 tab = _mm512_mul_ps(table, _mm512_set1_ps(SCALE[s[r * nb + b]]));
            lo[r] = _mm512_permutexvar_ps(v, tab); /* the permute reads the low 4 bits of each lane */
            hi[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tab);
        }
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
            __m512 x0 = _mm512_loadu_ps(xp + t * ldx + b * 32);
            __m512 x1 = _mm512_loadu_ps(xp + t * ldx + b * 32 + 16);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                acc[r][t] = _mm512_fmadd_ps(lo[r], x0, acc[r][t]);
                acc[r][t] = _mm512_fmadd_ps(hi[r], x1, acc[r][t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) out[t * ldo + r] = _mm512_reduce_add_ps(acc[r][t]);
}

#define MX_CASE(R, TT) \
    case TT: mx_tile(xp, ldx, p, s, K, out, ldo, R, TT); break;
#define MX_SWITCH(R)                                                                                \
    switch (tt) { MX_CASE(R, 1) MX_CASE(R, 2) MX_CASE(R, 3) MX_CASE(R, 4) MX_CASE(R, 5) MX_CASE(R, 6) \
                  MX_CASE(R, 7) MX_CASE(R, 8) }

static void mx_block(const float *xp, int64_t ldx, int tt, const uint8_t *p, const uint8_t *s, int64_t K,
                     float *out, int64_t ldo, int rows) {
    if (rows == 4) { MX_SWITCH(4) }
    else if (rows == 2) { MX_SWITCH(2) }
    else { MX_SWITCH(1) }
}
#else
static void mx_block(const float *xp, int64_t ldx, int tt, const uint8_t *p, const uint8_t *s, int64_t K,
                     float *out, int64_t ldo, int rows) {
    const int64_t half = K / 2, nb = K / 32;
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < tt; t++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                float scale = e8m0(s[r * nb + b]);
                const uint8_t *q = p + r * half + b * 16;
                const float *xb = xp + t * ldx + b * 32;
                for (int j = 0; j < 16; j++) {
                    acc += (E2M1[q[j] & 15] * scale) * xb[j];
                    acc += (E2M1[q[j] >> 4] * scale) * xb[16 + j];
                }
            }
            out[t * ldo + r] = acc;
        }
}
#endif

static void mx_rows(const float *xp, int64_t T, int64_t K, const uint8_t *p, const uint8_t *s, int64_t n0,
                    int64_t n1, float *out, int64_t N) {
    const int64_t half = K / 2, nb = K / 32;
    int64_t n = n0;
    while (n < n1) {
        int64_t left = n1 - n;
        int step = rows_for(T < TILE_T ? (int)T : TILE_T);
        if (left < step) step = left >= 2 ? 2 : 1;
        for (int64_t t0 = 0; t0 < T; t0 += TILE_T) {
            int tt = (int)(T - t0 < TILE_T ? T - t0 : TILE_T);
            int r = rows_for(tt) < step ? rows_for(tt) : step;
            for (int done = 0; done < step; done += r)
                mx_block(xp + t0 * K, K, tt, p + (n + done) * half, s + (n + done) * nb, K,
                         out + t0 * N + n + done, N, r);
        }
        n += step;
    }
}

/* ------------------------------------------------------------------------------------------ thread pool */

typedef void (*job_fn)(void *arg, int part, int parts);

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER; /* one multi-threaded call at a time */
static pthread_t pool_threads[MAX_THREADS];
static int pool_workers = 0;      /* started workers */
static int pool_parts = 1;        /* threads per call, the caller included */
static int pool_spin = 20000;     /* pause iterations a worker polls for the next job before sleeping */
static uint64_t pool_gen = 0;     /* under pool_mu; read atomically while spinning */
static uint64_t pool_gen_base = 0; /* pool_gen when workers were last started (their first `seen`) */
static int pool_sleepers = 0;
static job_fn pool_job;
static void *pool_arg;
static int pool_job_parts;
static atomic_int pool_pending;

INLINE void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *pool_main(void *arg) {
    int id = (int)(intptr_t)arg; /* part index: 1.. */
    uint64_t seen = pool_gen_base;
    for (;;) {
        int spins = 0;
        while (__atomic_load_n(&pool_gen, __ATOMIC_ACQUIRE) == seen && spins < pool_spin) {
            cpu_relax();
            spins++;
        }
        pthread_mutex_lock(&pool_mu);
        while (pool_gen == seen) {
            pool_sleepers++;
            pthread_cond_wait(&pool_cv, &pool_mu);
            pool_sleepers--;
        }
        seen = pool_gen;
        job_fn fn = pool_job;
        void *a = pool_arg;
        int parts = pool_job_parts;
        pthread_mutex_unlock(&pool_mu);
        if (id < parts) fn(a, id, parts);
        atomic_fetch_sub_explicit(&pool_pending, 1, memory_order_release);
    }
    return NULL;
}

static void pool_after_fork(void) { /* the child has none of the parent's workers */
    pool_workers = 0;
    pthread_mutex_init(&pool_mu, NULL);
    pthread_cond_init(&pool_cv, NULL);
    pthread_mutex_init(&pool_busy, NULL);
}

static void pool_start(int want) {
    static int atfork = 0;
    if (!atfork) {
        pthread_atfork(NULL, NULL, pool_after_fork);
        atfork = 1;
    }
    pool_gen_base = pool_gen;
    while (pool_workers < want - 1 && pool_workers < MAX_THREADS - 1) {
        if (pthread_create(&pool_threads[pool_workers], NULL, pool_main, (void *)(intptr_t)(pool_workers + 1)))
            break;
        pthread_detach(pool_threads[pool_workers]);
        pool_workers++;
    }
}

/* runs fn(arg, part, parts) for parts = threads, part 0 on the caller */
static void pool_run(job_fn fn, void *arg, int parts) {
    if (parts <= 1 || pthread_mutex_trylock(&pool_busy)) { /* concurrent callers run alone */
        fn(arg, 0, 1);
        return;
    }
    pool_start(parts);
    if (parts > pool_workers + 1) parts = pool_workers + 1;
    if (parts <= 1) {
        pthread_mutex_unlock(&pool_busy);
        fn(arg, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool_mu);
    pool_job = fn;
    pool_arg = arg;
    pool_job_parts = parts;
    atomic_store_explicit(&pool_pending, pool_workers, memory_order_relaxed);
    __atomic_store_n(&pool_gen, pool_gen + 1, __ATOMIC_RELEASE);
    if (pool_sleepers) pthread_cond_broadcast(&pool_cv);
    pthread_mutex_unlock(&pool_mu);
    fn(arg, 0, parts);
    int spins = 0;
    while (atomic_load_explicit(&pool_pending, memory_order_acquire) > 0) {
        if (++spins < 100000) cpu_relax();
        else sched_yield();
    }
    pthread_mutex_unlock(&pool_busy);
}

void ms_set_threads(int n) { pool_parts = n < 1 ? 1 : (n > MAX_THREADS ? MAX_THREADS : n); }
int ms_get_threads(void) { return pool_parts; }
void ms_set_spin(int n) { pool_spin = n < 0 ? 0 : n; }

/* rows [n0, n1) of part `part` out of `parts`, in multiples of 4 */
static void split(int64_t N, int part, int parts, int64_t *n0, int64_t *n1) {
    int64_t blocks = (N + 3) / 4;
    *n0 = blocks * part / parts * 4;
    *n1 = blocks * (part + 1) / parts * 4;
    if (*n0 > N) *n0 = N;
    if (*n1 > N) *n1 = N;
}

/* ------------------------------------------------------------------------------------------- entry points */

typedef struct {
    const float *x; int64_t T, K; const uint16_t *w; int64_t N; float *out;
} bf16_job;

static void bf16_part(void *arg, int part, int parts) {
    bf16_job *j = arg;
    int64_t n0, n1;
    split(j->N, part, parts, &n0, &n1);
    bf16_rows(j->x, j->T, j->K, j->w, n0, n1, j->out, j->N);
}

/* out[T, N] = x[T, K] (contiguous fp32) @ w[N, K]^T (contiguous bf16); work splits over ms_set_threads threads
 * when there are at least `min_rows_per_thread` rows per thread. */
int ms_linear_bf16(const float *x, int64_t T, int64_t K, const uint16_t *w, int64_t N, float *out,
                   int64_t min_rows_per_thread) {
    if (T <= 0 || N <= 0) return 0;
    if (K <= 0) {
        memset(out, 0, sizeof(float) * (size_t)(T * N));
        return 0;
    }
    bf16_job j = {x, T, K, w, N, out};
    int parts = pool_parts;
    while (parts > 1 && N / parts < min_rows_per_thread) parts--;
    pool_run(bf16_part, &j, parts);
    return 0;
}

typedef struct {
    int64_t E, N, K;
    const float **x; const int64_t *T; const uint8_t **p; const uint8_t **s; float **out;
} mx_job;

static void mx_part(void *arg, int part, int parts) {
    mx_job *j = arg;
    int64_t n0, n1;
    split(j->N, part, parts, &n0, &n1);
    for (int64_t e = 0; e < j->E; e++)
        if (j->T[e] > 0) mx_rows(j->x[e], j->T[e], j->K, j->p[e], j->s[e], n0, n1, j->out[e], j->N);
}

/* For e < E: out[e][T[e], N] = x[e][T[e], K] @ W_e^T, W_e the MXFP4 weight (p[e], s[e]) of N rows; K % 32 == 0.
 * All pointer arrays are int64 addresses. Returns 0, or -1 when out of memory. */
int ms_linear_mxfp4(int64_t E, const int64_t *xs, const int64_t *Ts, const int64_t *ps, const int64_t *ss,
                    const int64_t *outs, int64_t N, int64_t K, int layout, int64_t min_rows_per_thread) {
    if (E <= 0 || N <= 0) return 0;
    int64_t total = 0;
    for (int64_t e = 0; e < E; e++) total += Ts[e] > 0 ? Ts[e] : 0;
    if (K <= 0) {
        for (int64_t e = 0; e < E; e++)
            if (Ts[e] > 0) memset((void *)(intptr_t)outs[e], 0, sizeof(float) * (size_t)(Ts[e] * N));
        return 0;
    }
    void *mem = malloc((size_t)E * 2 * sizeof(void *) + (layout == 0 ? sizeof(float) * (size_t)(total * K) : 0) + 64);
    if (!mem) return -1;
    const float **x = mem;
    float *xp = (float *)((char *)mem + (size_t)E * 2 * sizeof(void *));
    for (int64_t e = 0; e < E; e++) {
        const float *src = (const float *)(intptr_t)xs[e];
        if (layout != 0 || Ts[e] <= 0) {
            x[e] = src;
        } else if (e > 0 && xs[e] == xs[e - 1] && Ts[e] == Ts[e - 1]) {
            x[e] = x[e - 1]; /* the same input for several weights: permuted once */
        } else {
            permute_low_first(src, Ts[e], K, xp);
            x[e] = xp;
            xp += Ts[e] * K;
        }
    }
    mx_job j = {E, N, K, x, Ts, (const uint8_t **)ps, (const uint8_t **)ss, (float **)outs};
    int parts = pool_parts;
    while (parts > 1 && N / parts < min_rows_per_thread) parts--;
    pool_run(mx_part, &j, parts);
    free(mem);
    return 0;
}
