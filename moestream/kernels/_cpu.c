/* moestream native CPU kernels: y[T, N] = x[T, K] @ W^T for bf16 and MXFP4 weights, fp32 activations.
 *
 * Built at first use by moestream/kernels/cpu.py with the system gcc (-O3 -march=native) and loaded with ctypes.
 * Each weight row is read once per token tile and dotted with every token of the tile; MXFP4 is decoded in
 * registers (16-entry E2M1 table times the block's 2^(s-127), looked up with a lane permute), never expanded in
 * memory. AVX-512 (F+BW+VL) and AVX2 (+FMA) paths are chosen by the compiler's feature macros (-march=native); the
 * scalar code computes the same thing anywhere (bf16: the same code with one-lane "vectors"; MXFP4 has no AVX2 path).
 * A tiny persistent pthread pool can split the rows of one call over several threads (ms_set_threads).
 * _cpu_step.c and _cpu_layer.c (included at the end) hold the fused decode-step kernels built on these; _cpu_bf16.c
 * the opt-in bf16 compute path for many rows (bf16-rounded activations, fp32 sums); _cpu_fixed.c the batch-invariant
 * dense product and router selection; _cpu_fp8.c block-FP8 weights read as stored.
 *
 * Layouts (see kernels/quant.py): packed uint8 [N, K/2], scales uint8 [N, K/32] (E8M0, 255 rejected by the caller).
 * layout 0 "low_first": byte j holds inputs 2j (low nibble) and 2j+1 (high nibble).
 * layout 1 "gguf": within each block of 32, byte j holds inputs j (low nibble) and j+16 (high nibble).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getcpu */
#endif
#include <math.h>
#include <sched.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define MS_SIMD 2
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MS_SIMD 1
#else
#define MS_SIMD 0
#endif
#define MS_AVX512 (MS_SIMD == 2)

#define MS_ABI 22
#define TILE_T 8   /* tokens per register tile */
#ifndef PF_BYTES
#define PF_BYTES 16384  /* software prefetch distance of the bf16 kernel (measured: 16-32 KiB best) */
#endif
#define MAX_THREADS 16

#define INLINE static inline __attribute__((always_inline))

static const float E2M1[16] __attribute__((unused)) = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* 2^(s - 127) for an E8M0 byte, exact (s = 0 is the subnormal 2^-127; 255 never reaches here). */
INLINE float e8m0(uint8_t s) {
    union { uint32_t u; float f; } v;
    v.u = s ? (uint32_t)s << 23 : 1u << 22;
    return v.f;
}

INLINE float bits_f32(uint32_t u) {
    union { uint32_t u; float f; } v;
    v.u = u;
    return v.f;
}

int ms_abi(void) { return MS_ABI; }
int ms_simd(void) { return MS_SIMD; }

int64_t ms_find_byte(const uint8_t *p, int64_t n, int value) {
    const uint8_t *hit = n > 0 ? memchr(p, value, (size_t)n) : NULL;
    return hit ? (int64_t)(hit - p) : -1;
}

/* ------------------------------------------------------------------------------------------------ bf16 */
/* One vector step reads GW = 2 VW bf16 weights: a shift of each 32-bit pair gives the even inputs' fp32 values, a
 * mask the odd ones, so no shuffles. x is therefore "prepared" once per call: per group of GW inputs, the VW even
 * inputs, then the VW odd ones (zero padded to a whole group); bf16_pos says where input k lands. The scalar
 * build is the same code with VW = 1. */
#if MS_SIMD == 2
#define VW 16
typedef __m512 vf;
typedef __m512i vw_t;
INLINE vf vzero(void) { return _mm512_setzero_ps(); }
INLINE vf vloadf(const float *p) { return _mm512_loadu_ps(p); }
INLINE vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
INLINE vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
INLINE void vstoref(float *p, vf v) { _mm512_storeu_ps(p, v); }
INLINE vw_t vloadw(const uint16_t *p) { return _mm512_loadu_si512((const void *)p); }
INLINE vf veven(vw_t v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
INLINE vf vodd(vw_t v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u))); }
INLINE float vsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif MS_SIMD == 1
#define VW 8
typedef __m256 vf;
typedef __m256i vw_t;
INLINE vf vzero(void) { return _mm256_setzero_ps(); }
INLINE vf vloadf(const float *p) { return _mm256_loadu_ps(p); }
INLINE vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
INLINE vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
INLINE void vstoref(float *p, vf v) { _mm256_storeu_ps(p, v); }
INLINE vw_t vloadw(const uint16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE vf veven(vw_t v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
INLINE vf vodd(vw_t v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u))); }
INLINE float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
#define VW 1
typedef float vf;
typedef uint32_t vw_t;
INLINE vf vzero(void) { return 0.0f; }
INLINE vf vloadf(const float *p) { return *p; }
INLINE vf vfma(vf a, vf b, vf c) { return a * b + c; }
INLINE vf vadd(vf a, vf b) { return a + b; }
INLINE void vstoref(float *p, vf v) { *p = v; }
INLINE vw_t vloadw(const uint16_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 16; }
INLINE vf veven(vw_t v) { return bits_f32(v << 16); }
INLINE vf vodd(vw_t v) { return bits_f32(v & 0xFFFF0000u); }
INLINE float vsum(vf v) { return v; }
#endif
#define GW (2 * VW)

static int64_t bf16_stride(int64_t K) { return (K + GW - 1) / GW * GW; }

/* position of input k in a prepared row */
INLINE int64_t bf16_pos(int64_t k) { return k / GW * GW + (k & 1) * VW + (k % GW) / 2; }

static void bf16_prepare_row(const float *src, int64_t K, float *dst) {
    const int64_t Kp = bf16_stride(K);
    for (int64_t k = K; k < Kp; k++) dst[bf16_pos(k)] = 0.0f;
    for (int64_t k = 0; k < K; k++) dst[bf16_pos(k)] = src[k];
}

static void bf16_prepare(const float *x, int64_t T, int64_t K, float *xp) {
    const int64_t Kp = bf16_stride(K);
    for (int64_t t = 0; t < T; t++) bf16_prepare_row(x + t * K, K, xp + t * Kp);
}

/* R weight rows (stride K) times TT tokens (prepared, stride ldx) -> out[t * ldo + r]. */
INLINE void bf16_tile(const float *x, int64_t ldx, const uint16_t *w, int64_t K, float *out, int64_t ldo,
                      const int R, const int TT) {
    vf acc[4][TILE_T];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) acc[r][t] = vzero();
#define BF16_STEP(WPTR, KK)                                                                     \
    do {                                                                                        \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                   \
            vw_t v = vloadw(WPTR(r));                                                           \
            vf e = veven(v), o = vodd(v);                                                       \
            _Pragma("GCC unroll 8") for (int t = 0; t < TT; t++) {                              \
                acc[r][t] = vfma(e, vloadf(x + t * ldx + (KK)), acc[r][t]);                     \
                acc[r][t] = vfma(o, vloadf(x + t * ldx + (KK) + VW), acc[r][t]);                \
            }                                                                                   \
        }                                                                                       \
    } while (0)
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) { /* one 64-byte line of each row per iteration */
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            /* 16 KiB ahead into L2 (rows are contiguous, so that is a later block of rows): each row stream is
             * only a few KiB, too short for the hardware prefetcher, and a matrix streamed from DRAM ran at
             * 9 GB/s on one core without this and 19 GB/s with it (bench/kernels.py; docs/performance.md) */
            __builtin_prefetch((const char *)(w + r * K + k) + PF_BYTES, 0, 2);
#define W_LINE(r) (w + (r) * K + k + s)
#pragma GCC unroll 16
        for (int s = 0; s < 32; s += GW) BF16_STEP(W_LINE, k + s);
#undef W_LINE
    }
    for (; k + GW <= K; k += GW) {
#define W_MAIN(r) (w + (r) * K + k)
        BF16_STEP(W_MAIN, k);
#undef W_MAIN
    }
    if (k < K) { /* a partial group: its weights copied into zero padding (x is zero padded already) */
        uint16_t tail[4][GW];
        memset(tail, 0, sizeof(tail));
        for (int r = 0; r < R; r++) memcpy(tail[r], w + r * K + k, sizeof(uint16_t) * (size_t)(K - k));
#define W_TAIL(r) (tail[r])
        BF16_STEP(W_TAIL, k);
#undef W_TAIL
    }
#undef BF16_STEP
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) out[t * ldo + r] = vsum(acc[r][t]);
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

/* rows per register block for a token tile of tt: accumulators plus weights must fit the register file (32
 * vectors with AVX-512, 16 with AVX2). With AVX-512 one row: the tile then reads its weights as one sequential
 * stream (rows are contiguous), which the hardware prefetcher follows, where 2-4 rows read side by side are 2-4
 * short streams 2 KiB apart. Weights that stream from memory (every expert and dense matrix of a model larger
 * than the L3) ran faster so on the Zen 5 this was measured on, although more rows win when the weights sit in
 * cache: grouped GLU experts of 512 x 1024, one core, 2 / 3 / 4 / 8 tokens an expert, 22.7 / 17.2 / 12.0 / 7.0
 * GB/s with the old 4 / 4 / 4 / 2 rows against 26.3 / 23.9 / 18.5 / 11.7 with one (in cache 48 / 40 / 34 / 16
 * against 40 / 31 / 28 / 16; at 5-6 tokens two rows were as fast or faster, 13.3-19.3 against 12.9-13.1 GB/s);
 * a layer step of 16 tokens routed top-8 over 64 experts, both cores, 31.7-33.6 -> 34.8-35.3 GB/s, and with
 * the peer model's skewed routing (28-30 experts a layer, 1-16 rows each) 13.7 -> 15.5 GB/s on one core
 * (docs/performance.md). The sums per output are the same for any row count. */
static int rows_for(int tt) {
#if MS_SIMD == 2
    (void)tt;
    return 1;
#elif MS_SIMD == 1
    return tt <= 2 ? 4 : (tt <= 4 ? 2 : 1);
#else
    return tt <= 4 ? 4 : 2;
#endif
}

/* One token: rows [n0, n1) of w [N, K] dotted with the prepared x, out[n - n0]. Each row is read start to end
 * (one sequential stream over the whole block) with four independent accumulators, so the FMA latency never limits
 * the stream. A software prefetch GEMV_PF bytes ahead carries the stream over 4 KiB page boundaries, where the
 * hardware prefetcher stops (first measured non-temporal, 1 KiB ahead): a peer layer's 8 grouped experts on one core
 * went from 13.4-14.5 to 15.3-18.2 GB/s (thread CPU time, loaded machine; 512 B and 2 KiB ahead were no better than
 * none). An iteration reads two 64-byte lines and prefetches both (one prefetch an iteration left every other line
 * to the hardware): 32 peer-shaped decode layers from DRAM, two threads, 21.5-22.8 -> 18.8-20.2 ms
 * (docs/performance.md). The
 * prefetch goes into L2 (prefetcht1) 4 KiB ahead: K3's resident dense weights (rows of 7,168 values) streamed at
 * 34.6-36.1 GB/s in a warm decode instead of 23.4-26.3 with a non-temporal prefetch 1 KiB ahead. */
#ifndef GEMV_PF
#define GEMV_PF 4096
#endif
#ifndef GEMV_PF_LOCALITY
#define GEMV_PF_LOCALITY 2
#endif
static void bf16_gemv(const float *x, int64_t K, const uint16_t *w, int64_t n0, int64_t n1, float *out) {
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *row = w + n * K;
        vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
        int64_t k = 0;
        for (; k + 2 * GW <= K; k += 2 * GW) {
#if GEMV_PF > 0
            __builtin_prefetch((const char *)(row + k) + GEMV_PF, 0, GEMV_PF_LOCALITY);
            __builtin_prefetch((const char *)(row + k) + GEMV_PF + 64, 0, GEMV_PF_LOCALITY);
#endif
            vw_t v0 = vloadw(row + k), v1 = vloadw(row + k + GW);
            a0 = vfma(veven(v0), vloadf(x + k), a0);
            a1 = vfma(vodd(v0), vloadf(x + k + VW), a1);
            a2 = vfma(veven(v1), vloadf(x + k + GW), a2);
            a3 = vfma(vodd(v1), vloadf(x + k + GW + VW), a3);
        }
        for (; k + GW <= K; k += GW) {
            vw_t v = vloadw(row + k);
            a0 = vfma(veven(v), vloadf(x + k), a0);
            a1 = vfma(vodd(v), vloadf(x + k + VW), a1);
        }
        if (k < K) { /* a partial group: its weights copied into zero padding (x is zero padded already) */
            uint16_t tail[GW];
            memset(tail, 0, sizeof(tail));
            memcpy(tail, row + k, sizeof(uint16_t) * (size_t)(K - k));
            vw_t v = vloadw(tail);
            a0 = vfma(veven(v), vloadf(x + k), a0);
            a1 = vfma(vodd(v), vloadf(x + k + VW), a1);
        }
        out[n - n0] = vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
    }
}

/* 16+ tokens: the weights converted once per call instead of once per token tile (a fused GLU expert of 512x1024,
 * quiet machine, one core: 35 / 42 / 41 GFLOP/s at 16 / 32 / 64 tokens against the tiles' 34 / 31 / 29; at 8 tokens
 * the tiles win, 41 to 30; docs/performance.md). GEMM_R rows of w at a time are
 * converted to fp32 in the prepared layout (even / odd halves of each group, as x is prepared), GEMM_KC columns
 * at a time, into a block that stays in L1; then every token tile of GEMM_TT tokens runs over it with GEMM_R x
 * GEMM_TT accumulators, the x vectors in registers shared by the rows. */
#ifndef GEMM_R
#define GEMM_R 4
#endif
#ifndef GEMM_TT
/* 4 (16 accumulators, 4 x vectors and a weight vector in registers): a 16-token prefill's tiles come out whole
 * (with 3, five tiles and a one-token tile, which costs nearly as much as a full one). Against 3, in one process
 * alternating builds (bench/ab_builds.py dense), the peer's attention shapes at 16 / 17 / 32 / 128 rows ran 1.04 /
 * 1.04 / 1.05 / 1.01x, and 1.01x at 16 rows in a later run; the same bits (an output's sum does not depend on
 * the tile) */
#define GEMM_TT 4
#endif
#if GEMM_TT < 1 || GEMM_TT > 6
#error "GEMM_TT: 1 to 6 tokens a tile"
#endif
#ifndef GEMM_KC
#define GEMM_KC 1024 /* prepared columns per block: GEMM_R * GEMM_KC * 4 bytes = 16 KiB */
#endif
#ifndef GEMM_MIN_T
#define GEMM_MIN_T 16
#endif

static void gemm_pack(const uint16_t *w, int64_t K, int rr, int64_t kc, int64_t kk, float *pk) {
    for (int r = 0; r < GEMM_R; r++) {
        float *dst = pk + r * GEMM_KC;
        if (r >= rr) {
            memset(dst, 0, sizeof(float) * (size_t)kk);
            continue;
        }
        const uint16_t *row = w + r * K;
        for (int64_t p = 0; p < kk; p += GW) {
            const int64_t k = kc + p; /* prepared column p of the block = input group starting at k */
            vw_t v;
            if (k + GW <= K) {
                v = vloadw(row + k);
            } else {
                uint16_t tail[GW];
                memset(tail, 0, sizeof(tail));
                if (k < K) memcpy(tail, row + k, sizeof(uint16_t) * (size_t)(K - k));
                v = vloadw(tail);
            }
            vstoref(dst + p, veven(v));
            vstoref(dst + p + VW, vodd(v));
        }
    }
}

INLINE void gemm_tile(const float *x, int64_t ldx, const float *pk, int64_t kk, float *out, int64_t ldo, int rr,
                      int first, const int TT) {
    vf acc[GEMM_R][GEMM_TT];
#pragma GCC unroll 4
    for (int r = 0; r < GEMM_R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < TT; t++) acc[r][t] = vzero();
    for (int64_t k = 0; k < kk; k += VW) {
        vf xv[GEMM_TT];
#pragma GCC unroll 4
        for (int t = 0; t < TT; t++) xv[t] = vloadf(x + t * ldx + k);
#pragma GCC unroll 4
        for (int r = 0; r < GEMM_R; r++) {
            const vf wv = vloadf(pk + r * GEMM_KC + k);
#pragma GCC unroll 4
            for (int t = 0; t < TT; t++) acc[r][t] = vfma(wv, xv[t], acc[r][t]);
        }
    }
    for (int r = 0; r < rr; r++)
        for (int t = 0; t < TT; t++) {
            float *o = out + t * ldo + r;
            *o = first ? vsum(acc[r][t]) : *o + vsum(acc[r][t]);
        }
}

static void bf16_gemm(const float *x, int64_t ldx, int64_t T, int64_t K, const uint16_t *w, int64_t n0, int64_t n1,
                      float *out, int64_t ldo) {
    _Alignas(64) float pk[GEMM_R * GEMM_KC];
    for (int64_t n = n0; n < n1; n += GEMM_R) {
        const int rr = (int)(n1 - n < GEMM_R ? n1 - n : GEMM_R);
        for (int64_t kc = 0; kc < ldx; kc += GEMM_KC) {
            const int64_t kk = ldx - kc < GEMM_KC ? ldx - kc : GEMM_KC;
            gemm_pack(w + n * K, K, rr, kc, kk, pk);
            float *o = out + (n - n0);
            int64_t t = 0;
            for (; t + GEMM_TT <= T; t += GEMM_TT) gemm_tile(x + t * ldx + kc, ldx, pk, kk, o + t * ldo, ldo, rr, kc == 0, GEMM_TT);
            switch (T - t) { /* the last, narrower tile (a constant width each, so that each unrolls) */
#define GEMM_LAST(W) case W: gemm_tile(x + t * ldx + kc, ldx, pk, kk, o + t * ldo, ldo, rr, kc == 0, W); break;
                GEMM_LAST(1)
#if GEMM_TT > 2
                GEMM_LAST(2)
#endif
#if GEMM_TT > 3
                GEMM_LAST(3)
#endif
#if GEMM_TT > 4
                GEMM_LAST(4)
#endif
#if GEMM_TT > 5
                GEMM_LAST(5)
#endif
#undef GEMM_LAST
                default: break;
            }
        }
    }
}

/* out[t * ldo + (n - n0)] for rows [n0, n1) of w [N, K] and every token of x (prepared, row stride ldx) */
static void bf16_rows(const float *x, int64_t ldx, int64_t T, int64_t K, const uint16_t *w, int64_t n0, int64_t n1,
                      float *out, int64_t ldo) {
    if (T == 1) {
        bf16_gemv(x, K, w, n0, n1, out);
        return;
    }
    if (T >= GEMM_MIN_T) {
        bf16_gemm(x, ldx, T, K, w, n0, n1, out, ldo);
        return;
    }
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
                bf16_block(x + t0 * ldx, ldx, tt, w + (n + done) * K, K, out + t0 * ldo + (n - n0) + done, ldo, r);
        }
        n += step;
    }
}

/* ----------------------------------------------------------------------------------------------- MXFP4 */

/* index of the input that nibble `hi` of byte j of a block holds */
static int mx_input(int layout, int j, int hi) { return layout == 0 ? 2 * j + hi : j + 16 * hi; }

#if MS_AVX512
/* Four blocks (64 packed bytes, one per 128-bit lane) decode at a time: two in-lane byte lookups give each code's
 * bf16 bytes (E2M1 values are exact in bf16), byte unpacks make bf16 words, a shift and a mask make fp32. x is
 * reordered once per call to the order that yields (zero padded to whole groups of four blocks). */
#define MX_GROUP 128

static int64_t mx_stride(int64_t K) { return (K / 32 + 3) / 4 * MX_GROUP; }

static void mx_prepare(const float *x, int64_t T, int64_t K, int layout, float *xp) {
    int order[MX_GROUP]; /* position in the decoded group -> input offset within the group */
    for (int i = 0; i < 8; i++)         /* vector i: 0..3 from low nibbles, 4..7 from high */
        for (int b = 0; b < 4; b++)     /* lane = block */
            for (int d = 0; d < 4; d++) { /* element in the lane */
                int v = i & 3, j = (v >> 1) * 8 + (v & 1) + 2 * d;
                order[i * 16 + b * 4 + d] = b * 32 + mx_input(layout, j, i >= 4);
            }
    const int64_t Kp = mx_stride(K);
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < Kp; g += MX_GROUP)
            for (int i = 0; i < MX_GROUP; i++) {
                int64_t k = g + order[i];
                xp[t * Kp + g + i] = k < K ? x[t * K + k] : 0.0f;
            }
}

/* v = the group of four blocks at block b of nb (64 code bytes; zeros past the last block), sc |= its 4 scale
 * bytes (sc starts at 0). A macro, not an inline function: mxv_row's loop ran at 0.8x with the same lines behind
 * inline helpers (gcc 12) */
#define MX_GROUP_LOAD(p, s, b, nb, v, sc)                                                                  \
    do {                                                                                                    \
        const int64_t rem_ = (nb) - (b);                                                                    \
        if (rem_ >= 4) {                                                                                    \
            (v) = _mm512_loadu_si512((const void *)((p) + (b) * 16));                                       \
            memcpy(&(sc), (s) + (b), 4);                                                                    \
        } else {                                                                                            \
            (v) = _mm512_maskz_loadu_epi8((__mmask64)((1ull << (16 * rem_)) - 1), (p) + (b) * 16);          \
            for (int64_t i_ = 0; i_ < rem_; i_++) (sc) |= (uint32_t)(s)[(b) + i_] << (8 * i_);              \
        }                                                                                                   \
    } while (0)

/* vpshufb indexes putting group scale byte i into the low byte of block i's four 32-bit lanes */
#define MX_LANE_BYTE _mm512_set_epi32(                                                                      \
    (int)0x80808003u, (int)0x80808003u, (int)0x80808003u, (int)0x80808003u, (int)0x80808002u, (int)0x80808002u, \
    (int)0x80808002u, (int)0x80808002u, (int)0x80808001u, (int)0x80808001u, (int)0x80808001u, (int)0x80808001u, \
    (int)0x80808000u, (int)0x80808000u, (int)0x80808000u, (int)0x80808000u)

INLINE void mx_tile(const float *xp, int64_t ldx, const uint8_t *p, const uint8_t *s, int64_t K, float *out,
                    int64_t ldo, const int TT) {
    const __m512i hb = _mm512_broadcast_i32x4(_mm_setr_epi8(0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40,
        (char)0x80, (char)0xBF, (char)0xBF, (char)0xBF, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0));
    const __m512i sb = _mm512_broadcast_i32x4(_mm_setr_epi8(0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40,
        (char)0x80, (char)0xC0, 0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0));
    const __m512i nib = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512i lane_byte = MX_LANE_BYTE;
    const __m512i tiny = _mm512_set1_epi32(1 << 22); /* scale byte 0: 2^-127, a subnormal */
    const int64_t nb = K / 32;
    __m512 acc[TILE_T];
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0, g = 0; b < nb; b += 4, g += MX_GROUP) {
        __m512i v;
        uint32_t sc = 0;
        MX_GROUP_LOAD(p, s, b, nb, v, sc);
        __m512i bits = _mm512_slli_epi32(_mm512_shuffle_epi8(_mm512_set1_epi32((int)sc), lane_byte), 23);
        __m512 scale = _mm512_castsi512_ps(_mm512_max_epi32(bits, tiny));
        __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        __m512i w[8];
        __m512i h = _mm512_shuffle_epi8(hb, lo), l = _mm512_shuffle_epi8(sb, lo);
        w[0] = _mm512_unpacklo_epi8(l, h);
        w[2] = _mm512_unpackhi_epi8(l, h);
        h = _mm512_shuffle_epi8(hb, hi);
        l = _mm512_shuffle_epi8(sb, hi);
        w[4] = _mm512_unpacklo_epi8(l, h);
        w[6] = _mm512_unpackhi_epi8(l, h);
        __m512 f[8];
#pragma GCC unroll 4
        for (int i = 0; i < 8; i += 2) {
            f[i] = _mm512_castsi512_ps(_mm512_slli_epi32(w[i], 16));
            f[i + 1] = _mm512_castsi512_ps(_mm512_and_si512(w[i], high));
        }
        if (TT >= 3) { /* scale the weights once for all tokens */
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) f[i] = _mm512_mul_ps(f[i], scale);
#pragma GCC unroll 8
            for (int t = 0; t < TT; t++) {
                const float *xt = xp + t * ldx + g;
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++) acc[t] = _mm512_fmadd_ps(f[i], _mm512_loadu_ps(xt + 16 * i), acc[t]);
            }
        } else { /* few tokens: scale each token's partial sums */
#pragma GCC unroll 2
            for (int t = 0; t < TT; t++) {
                const float *xt = xp + t * ldx + g;
                __m512 p0 = _mm512_mul_ps(f[0], _mm512_loadu_ps(xt));
                __m512 p1 = _mm512_mul_ps(f[1], _mm512_loadu_ps(xt + 16));
#pragma GCC unroll 3
                for (int i = 2; i < 8; i += 2) {
                    p0 = _mm512_fmadd_ps(f[i], _mm512_loadu_ps(xt + 16 * i), p0);
                    p1 = _mm512_fmadd_ps(f[i + 1], _mm512_loadu_ps(xt + 16 * i + 16), p1);
                }
                acc[t] = _mm512_fmadd_ps(_mm512_add_ps(p0, p1), scale, acc[t]);
            }
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) out[t * ldo] = _mm512_reduce_add_ps(acc[t]);
}

#elif MS_SIMD == 1
/* AVX2: a block's 16 bytes give 32 codes, its bytes' low nibbles in the low 128-bit lane and their high nibbles in
 * the high lane (one broadcast load and one per-lane variable shift); as in the AVX-512 path, two in-lane byte
 * lookups give each code's bf16 bytes (E2M1 values are exact in bf16), byte unpacks make bf16 words, and a shift and
 * a mask make 4 x 8 fp32 weights. x is reordered once per call to the order they come in. The block's scale
 * 2^(s - 127) (exact) multiplies each token's partial sum of the block once (1-2 tokens), or the weights once for
 * all tokens (3+ tokens), instead of every weight: a power of two commutes with fp32 rounding, so only the
 * summation order differs from scaling each weight. */
static int64_t mx_stride(int64_t K) { return K; }
#ifndef MX_PF_BYTES
#define MX_PF_BYTES 4096 /* software prefetch distance of the weight rows (measured: 4 KiB best, 2-8 KiB close) */
#endif

static void mx_prepare(const float *x, int64_t T, int64_t K, int layout, float *xp) {
    int order[32]; /* position in the decoded block -> input offset within the block */
    for (int v = 0; v < 4; v++)             /* vector v: 0, 2 the even codes of bytes 0-7, 8-15; 1, 3 the odd */
        for (int lane = 0; lane < 2; lane++) /* lane 0: low nibbles, 1: high nibbles */
            for (int d = 0; d < 4; d++) {
                int j = (v >> 1) * 8 + (v & 1) + 2 * d;
                order[v * 8 + lane * 4 + d] = mx_input(layout, j, lane);
            }
    for (int64_t t = 0; t < T; t++)
        for (int64_t b = 0; b < K; b += 32)
            for (int i = 0; i < 32; i++) xp[t * K + b + i] = x[t * K + b + order[i]];
}

/* the block at q (16 bytes) as 4 x 8 fp32 weights in the prepared order, unscaled */
INLINE void mx_decode(const uint8_t *q, __m256 f[4]) {
    const __m256i hb = _mm256_broadcastsi128_si256(_mm_setr_epi8(0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40,
        (char)0x80, (char)0xBF, (char)0xBF, (char)0xBF, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0));
    const __m256i sb = _mm256_broadcastsi128_si256(_mm_setr_epi8(0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40,
        (char)0x80, (char)0xC0, 0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0));
    const __m256i nib = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi32((int)0xFFFF0000u);
    const __m256i shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
    const __m256i c = _mm256_and_si256(_mm256_srlv_epi32(v, shift), nib);
    const __m256i h = _mm256_shuffle_epi8(hb, c), l = _mm256_shuffle_epi8(sb, c);
    const __m256i w0 = _mm256_unpacklo_epi8(l, h), w1 = _mm256_unpackhi_epi8(l, h);
    f[0] = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
    f[1] = _mm256_castsi256_ps(_mm256_and_si256(w0, high));
    f[2] = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
    f[3] = _mm256_castsi256_ps(_mm256_and_si256(w1, high));
}

/* 2^(s - 127) for n E8M0 bytes into out (exact; s = 0 gives the subnormal 2^-127) */
static void mx_scales(const uint8_t *s, int64_t n, float *out) {
    const __m256i tiny = _mm256_set1_epi32(1 << 22);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(s + i)));
        _mm256_storeu_si256((__m256i *)(out + i), _mm256_max_epi32(_mm256_slli_epi32(e, 23), tiny));
    }
    for (; i < n; i++) out[i] = e8m0(s[i]);
}

INLINE void mx_tile(const float *xp, int64_t ldx, const uint8_t *p, const uint8_t *s, int64_t K, float *out,
                    int64_t ldo, const int TT) {
    const int64_t nb = K / 32;
    __m256 acc[TILE_T][2];
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256 f[4];
        if (!(b & 3)) _mm_prefetch((const char *)(p + b * 16 + MX_PF_BYTES), _MM_HINT_T0);
        mx_decode(p + b * 16, f);
        const __m256 scale = _mm256_set1_ps(e8m0(s[b]));
        if (TT >= 3) { /* scale the weights once for all tokens */
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) f[i] = _mm256_mul_ps(f[i], scale);
#pragma GCC unroll 8
            for (int t = 0; t < TT; t++) {
                const float *xt = xp + t * ldx + b * 32;
                acc[t][0] = _mm256_fmadd_ps(f[0], _mm256_loadu_ps(xt), acc[t][0]);
                acc[t][1] = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xt + 8), acc[t][1]);
                acc[t][0] = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xt + 16), acc[t][0]);
                acc[t][1] = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xt + 24), acc[t][1]);
            }
        } else { /* few tokens: scale each token's partial sum of the block */
#pragma GCC unroll 2
            for (int t = 0; t < TT; t++) {
                const float *xt = xp + t * ldx + b * 32;
                __m256 q0 = _mm256_mul_ps(f[0], _mm256_loadu_ps(xt));
                __m256 q1 = _mm256_mul_ps(f[1], _mm256_loadu_ps(xt + 8));
                q0 = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xt + 16), q0);
                q1 = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xt + 24), q1);
                acc[t][0] = _mm256_fmadd_ps(_mm256_add_ps(q0, q1), scale, acc[t][0]);
            }
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) out[t * ldo] = vsum(_mm256_add_ps(acc[t][0], acc[t][1]));
}

/* one token, two rows at once (the x loads shared); each row's scales converted a chunk at a time */
#define MX_SCALE_CHUNK 64
static void mx_rows2(const float *xp, const uint8_t *p, const uint8_t *s, int64_t K, float *out) {
    const int64_t nb = K / 32, half = K / 2;
    float sc[2][MX_SCALE_CHUNK];
    __m256 a[2][2];
    for (int r = 0; r < 2; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += MX_SCALE_CHUNK) {
        const int64_t n = nb - b0 < MX_SCALE_CHUNK ? nb - b0 : MX_SCALE_CHUNK;
        mx_scales(s + b0, n, sc[0]);
        mx_scales(s + nb + b0, n, sc[1]);
        for (int64_t i = 0; i < n; i++) {
            const int64_t b = b0 + i;
            const float *xb = xp + b * 32;
            if (!(b & 3)) { /* each row's stream, MX_PF_BYTES ahead (past the row's end: the next pair's rows) */
                _mm_prefetch((const char *)(p + b * 16 + MX_PF_BYTES), _MM_HINT_T0);
                _mm_prefetch((const char *)(p + half + b * 16 + MX_PF_BYTES), _MM_HINT_T0);
            }
            const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
            const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
#pragma GCC unroll 2
            for (int r = 0; r < 2; r++) {
                __m256 f[4];
                mx_decode(p + r * half + b * 16, f);
                __m256 q0 = _mm256_mul_ps(f[0], x0), q1 = _mm256_mul_ps(f[1], x1);
                q0 = _mm256_fmadd_ps(f[2], x2, q0);
                q1 = _mm256_fmadd_ps(f[3], x3, q1);
                a[r][0] = _mm256_fmadd_ps(_mm256_add_ps(q0, q1), _mm256_broadcast_ss(&sc[r][i]), a[r][0]);
            }
        }
    }
    for (int r = 0; r < 2; r++) out[r] = vsum(_mm256_add_ps(a[r][0], a[r][1]));
}

#else
/* x reordered so that each block of 32 lists the inputs of its bytes' low nibbles, then of their high nibbles */
static int64_t mx_stride(int64_t K) { return K; }

static void mx_prepare(const float *x, int64_t T, int64_t K, int layout, float *xp) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t b = 0; b < K; b += 32)
            for (int j = 0; j < 16; j++) {
                xp[t * K + b + j] = x[t * K + b + mx_input(layout, j, 0)];
                xp[t * K + b + 16 + j] = x[t * K + b + mx_input(layout, j, 1)];
            }
}

static void mx_row(const float *xp, int64_t ldx, int tt, const uint8_t *p, const uint8_t *s, int64_t K, float *out,
                   int64_t ldo) {
    const int64_t nb = K / 32;
    for (int t = 0; t < tt; t++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            float scale = e8m0(s[b]);
            const uint8_t *q = p + b * 16;
            const float *xb = xp + t * ldx + b * 32;
            for (int j = 0; j < 16; j++) {
                acc += (E2M1[q[j] & 15] * scale) * xb[j];
                acc += (E2M1[q[j] >> 4] * scale) * xb[16 + j];
            }
        }
        out[t * ldo] = acc;
    }
}
#endif

#if MS_SIMD
#define MX_CASE(TT) \
    case TT: mx_tile(xp, ldx, p, s, K, out, ldo, TT); break;

static void mx_row(const float *xp, int64_t ldx, int tt, const uint8_t *p, const uint8_t *s, int64_t K, float *out,
                   int64_t ldo) {
    switch (tt) { MX_CASE(1) MX_CASE(2) MX_CASE(3) MX_CASE(4) MX_CASE(5) MX_CASE(6) MX_CASE(7) MX_CASE(8) }
}
#endif

/* rows [n0, n1) of every token; x prepared (row stride ldx) */
static void mx_rows(const float *xp, int64_t ldx, int64_t T, int64_t K, const uint8_t *p, const uint8_t *s,
                    int64_t n0, int64_t n1, float *out, int64_t N) {
    const int64_t half = K / 2, nb = K / 32;
#if MS_SIMD == 1
    if (T == 1) { /* decode: two rows per pass */
        for (; n0 + 2 <= n1; n0 += 2) mx_rows2(xp, p + n0 * half, s + n0 * nb, K, out + n0);
    }
#endif
    for (int64_t n = n0; n < n1; n++)
        for (int64_t t0 = 0; t0 < T; t0 += TILE_T) {
            int tt = (int)(T - t0 < TILE_T ? T - t0 : TILE_T);
            mx_row(xp + t0 * ldx, ldx, tt, p + n * half, s + n * nb, K, out + t0 * N + n, N);
        }
}

/* ------------------------------------------------------------------------------------------ thread pool */

typedef void (*job_fn)(void *arg, int part, int parts);

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;
static pthread_cond_t pool_done_cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER; /* one multi-threaded call at a time */
static pthread_t pool_threads[MAX_THREADS];
static int pool_workers = 0;      /* started workers */
static int pool_parts = 1;        /* threads per call, the caller included */
static int pool_bg_active = 0;    /* a background prefetch is posted (pool_prefetch; under pool_busy) */
/* how long a worker polls for the next job before sleeping on the condition variable, and the caller for a started
 * part to finish before it sleeps: a sleeping thread costs a futex wake-up per call, tens of microseconds and far
 * more when its idle vCPU has halted (or lands on the caller's CPU, see pool_caller_cpu); a polling one costs a
 * core. 300 us (the default until 2026-12-02) was shorter than many gaps between a decode step's calls on a busy
 * machine: the worker slept ~2-3 times a token on the 4-layer peer, 20-45% of calls on q3m_med. (The caller used
 * to poll 2000 pauses, about 40 us on Zen 3, and then sleep.) */
static int64_t pool_spin_ns = 3000000;
/* Polling in two stages: for the first POOL_HOT_NS a worker only pauses (the gaps between a decode step's calls are
 * mostly shorter: Python between two layers); after that it also yields the CPU every POOL_YIELD_NS, so a thread
 * that wants this CPU meanwhile (torch's own pool in a prefill, another process) gets it, while the worker stays
 * runnable on its CPU and answers the next call without a wake-up. */
#define POOL_HOT_NS 300000
#define POOL_YIELD_NS 50000
static atomic_long pool_stat_runs, pool_stat_caller_sleeps, pool_stat_worker_sleeps, pool_stat_long_waits;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}
static uint64_t pool_gen = 0;     /* under pool_mu; read atomically while spinning */
/* pool_gen when worker i was created (its first `seen`), per worker: a worker may start running only after the
 * caller has posted later jobs (pool_prefetch returns at once), so a shared value could already have moved past a
 * job it must still run */
static uint64_t pool_gen_base[MAX_THREADS];
static int pool_sleepers = 0;
static job_fn pool_job;
static void *pool_arg;
static int pool_job_parts;
/* Part i (1..) of a posted job belongs to whoever first claims it for that job's generation: worker i when it picks
 * the job up, or the caller once its own part is done (it then runs part i itself, or skips it for a job of chunks,
 * whose chunks it has already taken). So a worker that wakes or is scheduled late never holds the call up: the
 * caller waits only for parts a worker has started (pool_done). Each part is computed by the same code whoever
 * runs it, so results do not depend on the timing. */
static _Atomic uint64_t pool_claim[MAX_THREADS]; /* the latest generation whose part i has been claimed */
static _Atomic uint64_t pool_done[MAX_THREADS];  /* the latest generation whose part i a worker has finished */
static atomic_long pool_stat_taken;              /* parts the caller took because their worker had not started */
/* The CPU the caller last posted from, and the CPU each worker runs its part on: on a machine whose other cores are
 * busy (other processes, niced ones included: a CPU running any task is not idle to the scheduler) a woken worker
 * is often placed on the caller's CPU, and polling there only takes time from the thread it waits for. A thread
 * that finds itself on the other's CPU yields the CPU between polls instead: it stays runnable, so the scheduler's
 * load balancing sees two runnable threads on one CPU and moves one to the other CPU (sleeping instead would hide
 * it, and the next wake-up would place it next to the caller again). */
static atomic_int pool_caller_cpu = -1;
static atomic_int pool_worker_cpu[MAX_THREADS];
static atomic_long pool_stat_shared_cpu;         /* polls cut short because both threads were on one CPU */
static atomic_long pool_stat_wait_ns;            /* ns the caller waited for parts a worker had started */

INLINE void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* claims part i of generation gen: 1 when this thread got it */
INLINE int pool_take(int i, uint64_t gen) {
    uint64_t c = atomic_load_explicit(&pool_claim[i], memory_order_acquire);
    while (c < gen)
        if (atomic_compare_exchange_weak_explicit(&pool_claim[i], &c, gen, memory_order_acq_rel,
                                                  memory_order_acquire))
            return 1;
    return 0;
}

static void *pool_main(void *arg) {
    int id = (int)(intptr_t)arg; /* part index: 1.. */
    uint64_t seen = pool_gen_base[id];
    for (;;) {
        const int64_t start = now_ns(), until = start + __atomic_load_n(&pool_spin_ns, __ATOMIC_RELAXED);
        int64_t yielded = start + POOL_HOT_NS;
        for (int spins = 1; __atomic_load_n(&pool_gen, __ATOMIC_ACQUIRE) == seen; spins++) {
            cpu_relax();
            if ((spins & 63) == 0) {
                const int64_t t = now_ns();
                if (t >= until) break;
                if (sched_getcpu() == atomic_load_explicit(&pool_caller_cpu, memory_order_relaxed)) {
                    atomic_fetch_add_explicit(&pool_stat_shared_cpu, 1, memory_order_relaxed);
                    sched_yield();
                } else if (t >= yielded + POOL_YIELD_NS) { /* past the hot window: let a waiting thread run */
                    sched_yield();
                    yielded = t;
                }
            }
        }
        pthread_mutex_lock(&pool_mu);
        if (pool_gen == seen) atomic_fetch_add_explicit(&pool_stat_worker_sleeps, 1, memory_order_relaxed);
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
        if (id < parts && pool_take(id, seen)) {
            atomic_store_explicit(&pool_worker_cpu[id], sched_getcpu(), memory_order_relaxed);
            fn(a, id, parts);
            atomic_store_explicit(&pool_done[id], seen, memory_order_release);
            pthread_mutex_lock(&pool_mu); /* the caller may be asleep on pool_done_cv */
            pthread_cond_broadcast(&pool_done_cv);
            pthread_mutex_unlock(&pool_mu);
        }
    }
    return NULL;
}

static void pool_after_fork(void) { /* the child has none of the parent's workers */
    pool_workers = 0;
    pool_bg_active = 0;
    pthread_mutex_init(&pool_mu, NULL);
    pthread_cond_init(&pool_cv, NULL);
    pthread_cond_init(&pool_done_cv, NULL);
    pthread_mutex_init(&pool_busy, NULL);
}

static void pool_start(int want) {
    static int atfork = 0;
    if (!atfork) {
        pthread_atfork(NULL, NULL, pool_after_fork);
        atfork = 1;
    }
    while (pool_workers < want - 1 && pool_workers < MAX_THREADS - 1) {
        pool_gen_base[pool_workers + 1] = pool_gen;
        if (pthread_create(&pool_threads[pool_workers], NULL, pool_main, (void *)(intptr_t)(pool_workers + 1)))
            break;
        pthread_detach(pool_threads[pool_workers]);
        pool_workers++;
    }
}

/* posts fn to every worker (part 1.. of parts; workers past parts skip it) and returns its generation; the caller
 * holds pool_busy */
static uint64_t pool_post(job_fn fn, void *arg, int parts) {
    pthread_mutex_lock(&pool_mu);
    pool_job = fn;
    pool_arg = arg;
    pool_job_parts = parts;
    const uint64_t gen = pool_gen + 1;
    __atomic_store_n(&pool_gen, gen, __ATOMIC_RELEASE);
    if (pool_sleepers) pthread_cond_broadcast(&pool_cv);
    pthread_mutex_unlock(&pool_mu);
    return gen;
}

/* Finishes job `gen` of `parts` parts: parts no worker has started are the caller's (run = 1: it runs them with
 * fn; run = 0: they are dropped, for a background prefetch), then it waits for the parts workers have started: a
 * worker descheduled mid-part must not cost a spinning core for long, so it polls up to the spin time, then
 * sleeps. */
static void pool_wait(uint64_t gen, int parts, job_fn fn, void *arg, int run, int counted) {
    int started[MAX_THREADS], n = 0;
    for (int i = 1; i < parts; i++) {
        if (pool_take(i, gen)) {
            if (counted) atomic_fetch_add_explicit(&pool_stat_taken, 1, memory_order_relaxed);
            if (run) fn(arg, i, parts);
        } else {
            started[n++] = i;
        }
    }
    const int64_t waited = counted && n ? now_ns() : 0;
    for (int k = 0; k < n; k++) {
        const int i = started[k];
        const int64_t until = now_ns() + __atomic_load_n(&pool_spin_ns, __ATOMIC_RELAXED);
        int spins = 1;
        const int cpu = sched_getcpu();
        for (; atomic_load_explicit(&pool_done[i], memory_order_acquire) != gen; spins++) {
            cpu_relax();
            if ((spins & 63) == 0) {
                if (now_ns() >= until) break;
                if (cpu == atomic_load_explicit(&pool_worker_cpu[i], memory_order_relaxed)) {
                    if (counted) atomic_fetch_add_explicit(&pool_stat_shared_cpu, 1, memory_order_relaxed);
                    sched_yield();
                }
            }
        }
        if (counted && spins > 2000) atomic_fetch_add_explicit(&pool_stat_long_waits, 1, memory_order_relaxed);
        if (atomic_load_explicit(&pool_done[i], memory_order_acquire) != gen) {
            if (counted) atomic_fetch_add_explicit(&pool_stat_caller_sleeps, 1, memory_order_relaxed);
            pthread_mutex_lock(&pool_mu);
            while (atomic_load_explicit(&pool_done[i], memory_order_acquire) != gen)
                pthread_cond_wait(&pool_done_cv, &pool_mu);
            pthread_mutex_unlock(&pool_mu);
        }
    }
    if (waited) atomic_fetch_add_explicit(&pool_stat_wait_ns, now_ns() - waited, memory_order_relaxed);
}

/* ---- background prefetch. Between two native calls of a decode step (Python's bookkeeping, the serial norms
 * and attention of a layer) the workers would only poll while the memory bus idles. pool_prefetch hands them a
 * list of weight regions to prefetch line by line, in order, without the caller waiting: the lines go
 * through the worker's L2 into the shared L3 (32 MiB here), so the next call's GEMVs find the first megabytes of
 * their weights there. The next pool_run (or pool_prefetch) stops it within a few KiB (pool_bg_stop, polled every
 * 4 KiB) before posting its own job. Only reads: results never depend on it. State under pool_busy. */
#define BG_MAX_REGIONS 16
static int64_t bg_regions[2 * BG_MAX_REGIONS];
static int bg_count = 0;
static atomic_int pool_bg_stop;
static atomic_long pool_stat_prefetches, pool_stat_prefetch_cut, pool_stat_prefetch_bytes;

static void bg_touch(void *arg, int part, int parts) {
    (void)arg;
    const int64_t w = parts - 1, me = part - 1; /* workers only: part 0 (the caller) never runs a posted job */
    int64_t done = 0;
    for (int i = 0; i < bg_count; i++) {
        const char *p = (const char *)(intptr_t)bg_regions[2 * i];
        const int64_t n = bg_regions[2 * i + 1], lo = n * me / w, hi = n * (me + 1) / w;
        for (int64_t off = lo; off < hi; off += 4096) {
            if (atomic_load_explicit(&pool_bg_stop, memory_order_relaxed)) {
                atomic_fetch_add_explicit(&pool_stat_prefetch_cut, 1, memory_order_relaxed);
                goto out;
            }
            const int64_t end = off + 4096 < hi ? off + 4096 : hi;
            /* prefetch instructions, not loads: they never fault, so a region freed meanwhile (the model closed
             * while this runs) costs nothing; they wait for a free miss buffer, so the loop runs at memory speed */
            for (int64_t o = off; o < end; o += 64) __builtin_prefetch(p + o, 0, 3);
            done += end - off;
        }
    }
out:
    atomic_fetch_add_explicit(&pool_stat_prefetch_bytes, done, memory_order_relaxed);
}

/* the caller holds pool_busy: stops a running background prefetch and waits for the workers to leave it */
static uint64_t bg_gen;
static int bg_parts;
static void pool_stop_bg(void) {
    if (!pool_bg_active) return;
    atomic_store_explicit(&pool_bg_stop, 1, memory_order_relaxed);
    pool_wait(bg_gen, bg_parts, NULL, NULL, 0, 0);
    atomic_store_explicit(&pool_bg_stop, 0, memory_order_relaxed);
    pool_bg_active = 0;
}

/* regions: int64 [n, address 0, bytes 0, address 1, bytes 1, ...] (NULL or n = 0: nothing); returns at once */
static void pool_prefetch(const int64_t *regions) {
    if (!regions || regions[0] <= 0 || pool_parts <= 1 || pthread_mutex_trylock(&pool_busy)) return;
    pool_start(pool_parts);
    pool_stop_bg();
    const int parts = pool_parts > pool_workers + 1 ? pool_workers + 1 : pool_parts;
    if (parts > 1) {
        bg_count = regions[0] < BG_MAX_REGIONS ? (int)regions[0] : BG_MAX_REGIONS;
        memcpy(bg_regions, regions + 1, sizeof(int64_t) * 2 * (size_t)bg_count);
        atomic_fetch_add_explicit(&pool_stat_prefetches, 1, memory_order_relaxed);
        bg_gen = pool_post(bg_touch, NULL, parts);
        bg_parts = parts;
        pool_bg_active = 1;
    }
    pthread_mutex_unlock(&pool_busy);
}

void ms_prefetch_async(const int64_t *regions) { pool_prefetch(regions); }

/* runs fn(arg, part, parts) for parts = threads, part 0 on the caller */
static void pool_run(job_fn fn, void *arg, int parts) {
    if (parts <= 1 || pthread_mutex_trylock(&pool_busy)) { /* concurrent callers run alone */
        fn(arg, 0, 1);
        return;
    }
    pool_start(parts);
    pool_stop_bg();
    if (parts > pool_workers + 1) parts = pool_workers + 1;
    if (parts <= 1) {
        pthread_mutex_unlock(&pool_busy);
        fn(arg, 0, 1);
        return;
    }
    atomic_store_explicit(&pool_caller_cpu, sched_getcpu(), memory_order_relaxed);
    const uint64_t gen = pool_post(fn, arg, parts);
    fn(arg, 0, parts);
    atomic_fetch_add_explicit(&pool_stat_runs, 1, memory_order_relaxed);
    pool_wait(gen, parts, fn, arg, 1, 1);
    pthread_mutex_unlock(&pool_busy);
}

/* multi-threaded calls so far, how many of them the caller slept waiting for a worker, how often a worker went
 * to sleep between calls (each such call then paid a wake-up), how many calls the caller polled more than
 * 2000 pauses for (the old poll, after which it slept); background prefetches posted, cut short by the next call,
 * and the bytes they read; parts the caller took, polls cut short on a shared CPU, and the ns the caller waited for
 * parts a worker had started */
void ms_pool_stats(int64_t *out) {
    out[0] = atomic_load(&pool_stat_runs);
    out[1] = atomic_load(&pool_stat_caller_sleeps);
    out[2] = atomic_load(&pool_stat_worker_sleeps);
    out[3] = atomic_load(&pool_stat_long_waits);
    out[4] = atomic_load(&pool_stat_prefetches);
    out[5] = atomic_load(&pool_stat_prefetch_cut);
    out[6] = atomic_load(&pool_stat_prefetch_bytes);
    out[7] = atomic_load(&pool_stat_taken);
    out[8] = atomic_load(&pool_stat_shared_cpu);
    out[9] = atomic_load(&pool_stat_wait_ns);
}

/* Dynamic split: `chunks` pieces of work handed out one at a time to whichever thread is free (the caller
 * included), so a thread that is descheduled or streams slower (a shared machine) leaves its share to the others
 * instead of making them wait. fn(arg, chunk, chunks, slot): slot < parts is the running thread's index (for
 * per-thread scratch). Each chunk is computed by the same code whichever thread runs it, so results do not depend
 * on the thread count or the timing. */
typedef void (*chunk_fn)(void *arg, int64_t chunk, int64_t chunks, int slot);

typedef struct {
    chunk_fn fn;
    void *arg;
    int64_t chunks;
    atomic_llong next;
} chunk_job;

static void chunk_part(void *a, int part, int parts) {
    chunk_job *j = a;
    (void)parts;
    for (int64_t c; (c = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed)) < j->chunks;)
        j->fn(j->arg, c, j->chunks, part);
}

static void pool_run_chunks(chunk_fn fn, void *arg, int64_t chunks, int parts) {
    chunk_job j = {fn, arg, chunks, 0};
    atomic_init(&j.next, 0);
    pool_run(chunk_part, &j, parts > chunks ? (int)chunks : parts);
}

#define CHUNK_ROWS 64 /* rows per chunk of a dynamically split bf16 call (128 KiB of a 1024-wide weight) */

void ms_set_spin_us(int64_t us) { __atomic_store_n(&pool_spin_ns, us < 0 ? 0 : us * 1000, __ATOMIC_RELAXED); }

void ms_set_threads(int n) { pool_parts = n < 1 ? 1 : (n > MAX_THREADS ? MAX_THREADS : n); }
int ms_get_threads(void) { return pool_parts; }

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
    const float *x; int64_t ldx, T, K, nw, total; const int64_t *w, *N, *out;
    atomic_int failed; /* a coded weight's decode scratch could not be allocated (dense_rows) */
} bf16_job;

static int dense_rows(const float *x, int64_t ldx, int64_t T, int64_t K, const uint16_t *w, int64_t N, int64_t n0,
                      int64_t n1, float *out, int64_t ldo); /* _cpu_b12.c */

/* rows [r0, r1) of the weights' rows laid end to end (each weight bf16, or b12-coded at a tagged address) */
static void bf16_part(void *arg, int part, int parts) {
    bf16_job *j = arg;
    int64_t r0, r1, off = 0;
    split(j->total, part, parts, &r0, &r1);
    for (int64_t i = 0; i < j->nw && off < r1; off += j->N[i], i++) {
        const int64_t lo = r0 > off ? r0 - off : 0, hi = r1 - off < j->N[i] ? r1 - off : j->N[i];
        if (lo < hi && dense_rows(j->x, j->ldx, j->T, j->K, (const uint16_t *)(intptr_t)j->w[i], j->N[i], lo, hi,
                                  (float *)(intptr_t)j->out[i] + lo, j->N[i]))
            atomic_store_explicit(&j->failed, 1, memory_order_relaxed);
    }
}

static void bf16_chunk(void *arg, int64_t chunk, int64_t chunks, int slot) {
    (void)slot;
    bf16_part(arg, (int)chunk, (int)chunks);
}

/* the job's rows over `parts` threads, in chunks of about CHUNK_ROWS rows handed out dynamically */
static void bf16_run(bf16_job *j, int parts) {
    if (parts <= 1) {
        bf16_part(j, 0, 1);
        return;
    }
    int64_t chunks = (j->total + CHUNK_ROWS - 1) / CHUNK_ROWS;
    if (chunks < parts) chunks = parts;
    pool_run_chunks(bf16_chunk, j, chunks, parts);
}

/* For i < nw: out_i[T, N[i]] = x[T, K] (contiguous fp32) @ w_i[N[i], K]^T (contiguous bf16, or b12-coded at a
 * tagged address: the same sums, _cpu_b12.c), w_i and out_i at the addresses ws[i], outs[i]: x is prepared once
 * and all the weights' rows split over the threads (when there are at least `min_rows_per_thread` rows per
 * thread). Returns 0, or -1 when out of memory. */
int ms_linear_bf16_many(const float *x, int64_t T, int64_t K, int64_t nw, const int64_t *ws, const int64_t *Ns,
                        const int64_t *outs, int64_t min_rows_per_thread) {
    int64_t total = 0;
    for (int64_t i = 0; i < nw; i++) total += Ns[i];
    if (T <= 0 || total <= 0) return 0;
    if (K <= 0) {
        for (int64_t i = 0; i < nw; i++) memset((void *)(intptr_t)outs[i], 0, sizeof(float) * (size_t)(T * Ns[i]));
        return 0;
    }
    const int64_t ldx = bf16_stride(K);
    float *xp = malloc(sizeof(float) * (size_t)(T * ldx));
    if (!xp) return -1;
    bf16_prepare(x, T, K, xp);
    bf16_job j = {xp, ldx, T, K, nw, total, ws, Ns, outs, 0};
    int parts = pool_parts;
    while (parts > 1 && total / parts < min_rows_per_thread) parts--;
    bf16_run(&j, parts);
    free(xp);
    return atomic_load(&j.failed) ? -1 : 0;
}

/* out[T, N] = x[T, K] @ w[N, K]^T: ms_linear_bf16_many with one weight */
int ms_linear_bf16(const float *x, int64_t T, int64_t K, const uint16_t *w, int64_t N, float *out,
                   int64_t min_rows_per_thread) {
    const int64_t wa = (int64_t)(intptr_t)w, oa = (int64_t)(intptr_t)out;
    return ms_linear_bf16_many(x, T, K, 1, &wa, &N, &oa, min_rows_per_thread);
}

/* For h < H: out[h] [T, N] = x[h] [T, K] (fp32, contiguous) @ w_h [N, K]^T, w_h the bf16 rows at w + h * ws
 * (contiguous rows of K): per-head products (MLA's kv_b fold / unfold) in one call, every head's rows split over
 * the threads together. Returns 0, or -1 when out of memory. */
typedef struct {
    const float *x; int64_t ldx, T, K, H, N, ws; const uint16_t *w; float *out;
} bf16_heads_job;

static void bf16_heads_part(void *arg, int part, int parts) {
    const bf16_heads_job *j = arg;
    int64_t r0, r1;
    split(j->H * j->N, part, parts, &r0, &r1);
    for (int64_t h = r0 / j->N; h < j->H && h * j->N < r1; h++) {
        const int64_t off = h * j->N, lo = r0 > off ? r0 - off : 0, hi = r1 - off < j->N ? r1 - off : j->N;
        if (lo < hi)
            bf16_rows(j->x + h * j->T * j->ldx, j->ldx, j->T, j->K, j->w + h * j->ws, lo, hi,
                      j->out + h * j->T * j->N + lo, j->N);
    }
}

int ms_linear_bf16_heads(const float *x, int64_t H, int64_t T, int64_t K, const uint16_t *w, int64_t ws, int64_t N,
                         float *out, int64_t min_rows_per_thread) {
    if (H <= 0 || T <= 0 || N <= 0) return 0;
    if (K <= 0) {
        memset(out, 0, sizeof(float) * (size_t)(H * T * N));
        return 0;
    }
    const int64_t ldx = bf16_stride(K);
    float *xp = malloc(sizeof(float) * (size_t)(H * T * ldx));
    if (!xp) return -1;
    bf16_prepare(x, H * T, K, xp);
    bf16_heads_job j = {xp, ldx, T, K, H, N, ws, w, out};
    int parts = pool_parts;
    while (parts > 1 && H * N / parts < min_rows_per_thread) parts--;
    pool_run(bf16_heads_part, &j, parts);
    free(xp);
    return 0;
}

#include "_cpu_exp.c"
#include "_cpu_panel.c"
#include "_cpu_b12.c"
#include "_cpu_step.c"
#include "_cpu_paged.c"
#include "_cpu_layer.c"
#include "_cpu_bf16.c"
#include "_cpu_fixed.c"
#include "_cpu_fp8.c"
