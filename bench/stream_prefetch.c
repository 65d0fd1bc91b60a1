/* The one-token product's weight stream from DRAM under each software-prefetch hint: b12-coded rows (the
 * decode of kernels/_cpu_b12.c's b12_block, fp32 x) and bf16 rows (bf16_gemv's loop), with the prefetch
 * non-temporal (prefetchnta), into L1 (prefetcht0) or into L2 (prefetcht1), DIST bytes ahead, and a plain read of
 * the same bytes; rows of 1,024 values split over OpenMP threads. Prints GB/s of stored bytes per case.
 *
 *   gcc -O3 -march=native -fopenmp bench/stream_prefetch.c -o /tmp/stream_prefetch
 *   OMP_NUM_THREADS=2 /tmp/stream_prefetch MIB ROUNDS DIST...      (e.g. 768 2 1024 4096 6144)
 *
 * ROW_VALUES (a multiple of 64) sets the row width. AVX-512 (BW) only. The values are arbitrary bytes: this
 * measures the stream, not the products. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* the row width, read at run time as the kernels' is: with a constant the loop unrolls whole and the hints rank
 * otherwise (a non-temporal prefetch was then the fastest) */
static int64_t K = 1024;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline void pf(const char *p, int hint) {
    if (hint == 0) _mm_prefetch(p, _MM_HINT_NTA);
    else if (hint == 1) _mm_prefetch(p, _MM_HINT_T0);
    else _mm_prefetch(p, _MM_HINT_T1);
}

static inline __m512 even(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
static inline __m512 odd(__m512i v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* kind 0: b12 rows (K * 3 / 2 bytes), 1: bf16 rows (2 K bytes), 2: plain read of b12-sized rows */
static float run(int kind, int hint, int64_t dist, const uint8_t *m, int64_t rows, const float *x, float *out) {
    const int64_t slot = kind == 1 ? 2 * K : K * 3 / 2;
    uint8_t lut[16];
    for (int c = 0; c < 16; c++) lut[c] = (uint8_t)(c < 8 ? 60 + c : 0x80 | (60 + c - 8));
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)lut));
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < rows; n++) {
        const uint8_t *s = m + n * slot;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        if (kind == 0) {
            for (int64_t k = 0; k < K; k += 64, s += 96) {
                pf((const char *)s + dist, hint);
                pf((const char *)s + dist + 64, hint);
                const __m256i m4 = _mm256_set1_epi8(15), c = _mm256_loadu_si256((const __m256i *)(s + 64));
                const __m512i cc = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(c, m4)),
                                                      _mm256_and_si256(_mm256_srli_epi16(c, 4), m4), 1);
                const __m512i hi = _mm512_shuffle_epi8(table, cc), lo = _mm512_loadu_si512(s);
                const __m512i v0 = _mm512_unpacklo_epi8(lo, hi), v1 = _mm512_unpackhi_epi8(lo, hi);
                a0 = _mm512_fmadd_ps(even(v0), _mm512_loadu_ps(x + k), a0);
                a1 = _mm512_fmadd_ps(odd(v0), _mm512_loadu_ps(x + k + 16), a1);
                a2 = _mm512_fmadd_ps(even(v1), _mm512_loadu_ps(x + k + 32), a2);
                a3 = _mm512_fmadd_ps(odd(v1), _mm512_loadu_ps(x + k + 48), a3);
            }
        } else if (kind == 1) {
            for (int64_t k = 0; k < K; k += 64, s += 128) {
                pf((const char *)s + dist, hint);
                pf((const char *)s + dist + 64, hint);
                const __m512i v0 = _mm512_loadu_si512(s), v1 = _mm512_loadu_si512(s + 64);
                a0 = _mm512_fmadd_ps(even(v0), _mm512_loadu_ps(x + k), a0);
                a1 = _mm512_fmadd_ps(odd(v0), _mm512_loadu_ps(x + k + 16), a1);
                a2 = _mm512_fmadd_ps(even(v1), _mm512_loadu_ps(x + k + 32), a2);
                a3 = _mm512_fmadd_ps(odd(v1), _mm512_loadu_ps(x + k + 48), a3);
            }
        } else {
            for (int64_t k = 0; k < slot; k += 128) {
                a0 = _mm512_add_ps(a0, _mm512_castsi512_ps(_mm512_loadu_si512(s + k)));
                a1 = _mm512_add_ps(a1, _mm512_castsi512_ps(_mm512_loadu_si512(s + k + 64)));
            }
        }
        out[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    }
    return out[0];
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MIB ROUNDS DIST...\n", argv[0]);
        return 2;
    }
    const int64_t bytes = (int64_t)atol(argv[1]) << 20;
    K = getenv("ROW_VALUES") ? atol(getenv("ROW_VALUES")) / 64 * 64 : 1024;
    const int rounds = atoi(argv[2]);
    uint8_t *m = aligned_alloc(64, (size_t)bytes + 16384);
    for (int64_t i = 0; i < bytes + 16384; i++) m[i] = (uint8_t)((uint64_t)i * 2654435761u >> 13);
    float *x = aligned_alloc(64, K * sizeof(float)), *out = malloc(sizeof(float) * (size_t)(bytes / (K * 3 / 2) + 1));
    for (int k = 0; k < K; k++) x[k] = (float)(k % 7) * 0.01f;
    const char *kinds[] = {"b12", "bf16"}, *hints[] = {"nta", "t0", "t1"};
    volatile float sink = 0;
    for (int r = 0; r < rounds; r++) {
        for (int a = 3; a < argc; a++) {
            const int64_t dist = atol(argv[a]);
            for (int kind = 0; kind < 2; kind++)
                for (int hint = 0; hint < 3; hint++) {
                    const int64_t slot = kind == 1 ? 2 * K : K * 3 / 2, rows = bytes / slot;
                    const double t0 = now();
                    sink += run(kind, hint, dist, m, rows, x, out);
                    printf("round %d  %-4s prefetch%-3s %6lld B ahead: %6.2f GB/s\n", r, kinds[kind], hints[hint],
                           (long long)dist, (double)(rows * slot) / (now() - t0) / 1e9);
                }
        }
        const int64_t rows = bytes / (K * 3 / 2);
        const double t0 = now();
        sink += run(2, 0, 0, m, rows, x, out);
        printf("round %d  plain read:                  %6.2f GB/s\n", r,
               (double)(rows * K * 3 / 2) / (now() - t0) / 1e9);
        fflush(stdout);
    }
    return sink == 12345.0f;
}
