/* moestream native CPU kernels, part 0 (#included in _cpu.c before the GLU code): bf16 matrices in the lossless
 * 12-bit "b12" coding of kernels/b12.py, which a packed checkpoint may hold its bf16 experts in
 * (`moestream pack --codec b12`, docs/pack.md).
 *
 * A bf16 value is its low byte (the exponent's last bit and the 7 mantissa bits, stored as is) and its high byte
 * (sign and the exponent's upper 7 bits). Within a row the high bytes take at most 16 values: the sign and 8
 * consecutive upper-exponent values from the row's base, a 4-bit code (c < 8: base + c, c >= 8: sign set,
 * base + c - 8). A row whose values do not fit (a value 2^15 or more below the row's largest, zeros included) is
 * stored whole as bf16 ("raw"). Layout of an N x K matrix (K a multiple of 64):
 *   N slots of K * 3 / 2 bytes: per 64 values, 64 low bytes then 32 code bytes (position p < 32 in a code byte's
 *     low nibble, p >= 32 in byte p - 32's high nibble), positions in the order the AVX-512 unpack gives
 *     (b12_weight below); a raw row's slot starts with the int64 byte offset of its bf16 row in the matrix;
 *   N base bytes (0xFF: raw; base | 0x80: coded with exceptions), padded to a multiple of 64;
 *   where any row has exceptions (the "b12x" form, K <= 32768): N + 1 uint32 offsets (row n's exceptions are
 *     entries [off[n], off[n + 1])) padded to 64 bytes, then the entries, each uint32 (position << 16 | bf16 bits),
 *     positions rising within a row, padded to 64 bytes: the values 2^15 or more below their row's largest, which
 *     the row's codes cannot give (their codes are placeholders);
 *   the raw rows, K bf16 values each.
 * The products below read the coded bytes: 25% fewer bytes than bf16 stream from memory, and every product sums
 * exactly as it would over the bf16 matrix (one-row products in bf16_gemv's order, 2-15 rows in bf16_tile's, both
 * decoding in registers; more rows decode into a thread's scratch and run the bf16 kernels), so results are bit for
 * bit those of the bf16 weights.
 * The one-token GEMV and the 2-15-token tiles put a row's exceptions into the blocks that hold them after decoding
 * them in registers (b12_patch_block); the other paths decode a row with exceptions into a row of bf16 first.
 * A matrix is passed to the GLU kernels as its address with bit 0 set (B12_TAG); bf16 addresses are even. */

#define B12_TAG ((uintptr_t)1)
#define B12_RAW 0xFF
#define B12_XFLAG 0x80
#define B12_MAX_XK 32768 /* the widest row that may have exceptions (kernels/b12.py MAX_XK) */

#ifndef B12_PF
#define B12_PF 6144
#endif
#ifndef B12_PF_LOCALITY
/* __builtin_prefetch's locality: 2 = prefetcht1, into L2 (with 0, non-temporal, the warm peer_b12 decode's experts
 * took 1.17-1.28x as long) */
#define B12_PF_LOCALITY 2
#endif
#ifndef B12_FEW_OFF
#define B12_FEW_OFF 0 /* 1: few-token products decode rows into scratch first (the earlier path, for A/B runs) */
#endif

INLINE int b12_tagged(const void *w) { return ((uintptr_t)w & B12_TAG) != 0; }
INLINE const uint8_t *b12_addr(const void *w) { return (const uint8_t *)((uintptr_t)w & ~B12_TAG); }
INLINE int64_t b12_slot(int64_t K) { return K * 3 / 2; }

/* the value a block position holds: 0-7 of each 16 are values 8q + r of the first 32, 8-15 of the second */
INLINE int b12_weight(int p) { return (p % 16 < 8) ? 8 * (p / 16) + p % 16 : 32 + 8 * (p / 16) + p % 16 - 8; }

INLINE const uint16_t *b12_raw_row(const uint8_t *m, int64_t K, int64_t n) {
    int64_t off;
    memcpy(&off, m + n * b12_slot(K), sizeof(off));
    return (const uint16_t *)(m + off);
}

/* a base byte of a row coded without exceptions (in registers by the tile kernels) */
INLINE int b12_plain(int base) { return base < B12_XFLAG; }
INLINE int64_t b12_pad64(int64_t n) { return (n + 63) / 64 * 64; }

/* row n's exceptions as entries [*at, *end) (none for a row without: both NULL) */
INLINE void b12_exc_range(const uint8_t *m, int64_t N, int64_t K, int64_t n, int base, const uint8_t **at,
                          const uint8_t **end) {
    if (b12_plain(base)) {
        *at = *end = NULL;
        return;
    }
    const uint8_t *t = m + N * b12_slot(K) + b12_pad64(N);
    uint32_t lo, hi;
    memcpy(&lo, t + 4 * n, 4);
    memcpy(&hi, t + 4 * (n + 1), 4);
    const uint8_t *e = t + b12_pad64(4 * (N + 1));
    *at = e + 4 * (int64_t)lo;
    *end = e + 4 * (int64_t)hi;
}

INLINE int64_t b12_exc_pos(const uint8_t *at) {
    uint32_t v;
    memcpy(&v, at, 4);
    return v >> 16;
}

/* row n's exceptions put into its decoded bf16 row dst (kernels/b12.py checked the table when the matrix was read) */
static void b12_patch(const uint8_t *m, int64_t N, int64_t K, int64_t n, int base, uint16_t *dst) {
    const uint8_t *at, *end;
    b12_exc_range(m, N, K, n, base, &at, &end);
    for (; at < end; at += 4) {
        uint32_t v;
        memcpy(&v, at, 4);
        if ((int64_t)(v >> 16) < K) dst[v >> 16] = (uint16_t)(v & 0xFFFF); /* (a checked table always is) */
    }
}

#if MS_SIMD == 2
/* a row's table, code -> high byte, in each 128-bit lane (vpshufb looks up within lanes): base + c for c < 8,
 * 0x80 | (base + c - 8) for c >= 8, in bytes. Made in registers: built in a stack array and loaded back, the bytes
 * stalled on store forwarding once a row, and the peer's one-token grouped expert call ran 0.85x as fast on one
 * thread (bench/ab_builds.py glu). */
INLINE __m512i b12_table(int base) {
    const __m128i step = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m128i sign = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, -128, -128, -128, -128, -128, -128, -128, -128);
    return _mm512_broadcast_i32x4(_mm_or_si128(_mm_add_epi8(_mm_set1_epi8((char)base), step), sign));
}

/* the 64 values of the block at s (64 low bytes, then 32 code bytes) as bf16: values 0-31 in v0, 32-63 in v1 */
INLINE void b12_block(const uint8_t *s, __m512i table, __m512i *v0, __m512i *v1) {
    __builtin_prefetch(s + B12_PF, 0, B12_PF_LOCALITY);
    __builtin_prefetch(s + B12_PF + 64, 0, B12_PF_LOCALITY);
    const __m256i m4 = _mm256_set1_epi8(0x0F), c = _mm256_loadu_si256((const __m256i *)(s + 64));
    const __m512i cc = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(c, m4)),
                                          _mm256_and_si256(_mm256_srli_epi16(c, 4), m4), 1);
    const __m512i hi = _mm512_shuffle_epi8(table, cc), lo = _mm512_loadu_si512((const void *)s);
    *v0 = _mm512_unpacklo_epi8(lo, hi);
    *v1 = _mm512_unpackhi_epi8(lo, hi);
}
#endif

/* row n of the N x K matrix m decoded to bf16 into dst[K] */
static void b12_decode_row(const uint8_t *m, int64_t N, int64_t K, int64_t n, uint16_t *dst) {
    const int flagged = m[N * b12_slot(K) + n], base = flagged & 0x7F;
    if (flagged == B12_RAW) {
        memcpy(dst, b12_raw_row(m, K, n), sizeof(uint16_t) * (size_t)K);
        return;
    }
    const uint8_t *s = m + n * b12_slot(K);
#if MS_SIMD == 2
    const __m512i table = b12_table(base);
    for (int64_t k = 0; k < K; k += 64, s += 96) {
        __m512i v0, v1;
        b12_block(s, table, &v0, &v1);
        _mm512_storeu_si512((void *)(dst + k), v0);
        _mm512_storeu_si512((void *)(dst + k + 32), v1);
    }
#else
    for (int64_t k = 0; k < K; k += 64, s += 96)
        for (int p = 0; p < 64; p++) {
            const int c = p < 32 ? s[64 + p] & 15 : s[64 + p - 32] >> 4;
            const int hi = c < 8 ? base + c : 0x80 | (base + c - 8);
            dst[k + b12_weight(p)] = (uint16_t)(hi << 8 | s[p]);
        }
#endif
    if (!b12_plain(flagged)) b12_patch(m, N, K, n, flagged, dst);
}

#if MS_SIMD == 2
/* the exceptions at *at that fall in the block of values [k, k + 64) put into its decoded values v0 (0-31), v1
 * (32-63); *at moves past them. Rare (a row of K3's width holds one or two), so through memory. */
static void b12_patch_block(__m512i *v0, __m512i *v1, int64_t k, const uint8_t **at, const uint8_t *end) {
    uint16_t tmp[64];
    _mm512_storeu_si512((void *)tmp, *v0);
    _mm512_storeu_si512((void *)(tmp + 32), *v1);
    for (; *at < end; *at += 4) {
        uint32_t v;
        memcpy(&v, *at, 4);
        const int64_t p = v >> 16;
        if (p >= k + 64) break;
        if (p >= k) tmp[p - k] = (uint16_t)(v & 0xFFFF);
    }
    *v0 = _mm512_loadu_si512((const void *)tmp);
    *v1 = _mm512_loadu_si512((const void *)(tmp + 32));
}
#endif

#if MS_SIMD == 2
/* one coded row (slot s, its table) times x: bf16_gemv's loop (the same four accumulators over the same 64-value
 * steps, so the same sums) with each step's 128 bytes of bf16 replaced by 96 coded bytes decoded in registers; X (a
 * compile-time 0 or 1): the row has exceptions [xa, xe), patched into the blocks that hold them (b12_patch_block) */
INLINE float b12_row_dot(const float *x, int64_t K, const uint8_t *s, __m512i table, const uint8_t *xa,
                         const uint8_t *xe, const int X) {
    vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    for (int64_t k = 0; k < K; k += 64, s += 96) {
        vw_t v0, v1;
        b12_block(s, table, &v0, &v1);
        if (X && xa < xe && b12_exc_pos(xa) < k + 64) b12_patch_block(&v0, &v1, k, &xa, xe);
        a0 = vfma(veven(v0), vloadf(x + k), a0);
        a1 = vfma(vodd(v0), vloadf(x + k + VW), a1);
        a2 = vfma(veven(v1), vloadf(x + k + GW), a2);
        a3 = vfma(vodd(v1), vloadf(x + k + GW + VW), a3);
    }
    return vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
}

/* row n (with exceptions) times x. Out of line, and run after the other rows: with the check in b12_gemv's own
 * loop, or this loop beside it, the peer's one-token grouped expert call (which has no such rows) ran 0.94-0.97x as
 * fast. */
__attribute__((noinline)) static float b12_row_exc(const float *x, int64_t K, const uint8_t *m, int64_t N, int64_t n) {
    const int base = m[N * b12_slot(K) + n];
    const uint8_t *xa, *xe;
    b12_exc_range(m, N, K, n, base, &xa, &xe);
    return b12_row_dot(x, K, m + n * b12_slot(K), b12_table(base & 0x7F), xa, xe, 1);
}

/* One token, rows [n0, n1) of the coded matrix (b12_row_dot). In a standalone stream of 302 MB of coded rows from
 * DRAM, two threads, the coded bytes read at 34-52 GB/s with prefetches 3-6 KiB ahead, 1.08-1.45x faster than
 * bf16_gemv over the same values in the same runs (39-52 GB/s); a layout with each row's codes in a plane of their
 * own read at 17-21 GB/s (docs/performance.md, "b12"). */
static void b12_gemv(const float *x, int64_t K, const uint8_t *m, int64_t N, int64_t n0, int64_t n1, float *out) {
    const uint8_t *bases = m + N * b12_slot(K);
    int exc = 0; /* rows with exceptions: after the others (b12_row_exc) */
    for (int64_t n = n0; n < n1; n++) {
        const int base = bases[n];
        if (base == B12_RAW) {
            bf16_gemv(x, K, b12_raw_row(m, K, n), 0, 1, out + (n - n0));
            continue;
        }
        if (!b12_plain(base)) {
            exc = 1;
            continue;
        }
        out[n - n0] = b12_row_dot(x, K, m + n * b12_slot(K), b12_table(base), NULL, NULL, 0);
    }
    for (int64_t n = n0; exc && n < n1; n++)
        if (!b12_plain(bases[n]) && bases[n] != B12_RAW) out[n - n0] = b12_row_exc(x, K, m, N, n);
}
#endif

#if MS_SIMD == 2
/* R coded rows from row n (none stored whole; exceptions put in, b12_patch_block) times TT tokens (prepared x,
 * stride ldx) -> out[t * ldo + r]:
 * bf16_tile's sums (one accumulator per row and token, each 32-value half's even values then its odd ones), with
 * each 64-value block decoded in registers once for all TT tokens instead of into a scratch row first. Two rows a
 * pass keep enough independent sums in flight for two or three tokens. */
INLINE void b12_tile(const float *x, int64_t ldx, const uint8_t *m, int64_t N, int64_t K, int64_t n, float *out,
                     int64_t ldo, const int R, const int TT, const int X) {
    const uint8_t *bases = m + N * b12_slot(K), *s[2], *xa[2], *xe[2];
    __m512i table[2];
    vf acc[2][TILE_T];
#pragma GCC unroll 2
    for (int r = 0; r < R; r++) {
        table[r] = b12_table(bases[n + r] & 0x7F);
        s[r] = m + (n + r) * b12_slot(K);
        b12_exc_range(m, N, K, n + r, bases[n + r], &xa[r], &xe[r]);
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) acc[r][t] = vzero();
    }
    for (int64_t k = 0, o = 0; k < K; k += 64, o += 96) {
#pragma GCC unroll 2
        for (int r = 0; r < R; r++) {
            vw_t v0, v1;
            b12_block(s[r] + o, table[r], &v0, &v1);
            if (X && xa[r] < xe[r] && b12_exc_pos(xa[r]) < k + 64) b12_patch_block(&v0, &v1, k, &xa[r], xe[r]);
            const vf e0 = veven(v0), o0 = vodd(v0), e1 = veven(v1), o1 = vodd(v1);
#pragma GCC unroll 8
            for (int t = 0; t < TT; t++) {
                const float *xt = x + t * ldx + k;
                acc[r][t] = vfma(e0, vloadf(xt), acc[r][t]);
                acc[r][t] = vfma(o0, vloadf(xt + VW), acc[r][t]);
                acc[r][t] = vfma(e1, vloadf(xt + GW), acc[r][t]);
                acc[r][t] = vfma(o1, vloadf(xt + GW + VW), acc[r][t]);
            }
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) out[t * ldo + r] = vsum(acc[r][t]);
}

#define B12_CASE(R, TT, X) \
    case TT: b12_tile(x, ldx, m, N, K, n, out, ldo, R, TT, X); break;
#define B12_SWITCH(R, X)                                                                                          \
    switch (tt) { B12_CASE(R, 1, X) B12_CASE(R, 2, X) B12_CASE(R, 3, X) B12_CASE(R, 4, X) B12_CASE(R, 5, X)      \
                  B12_CASE(R, 6, X) B12_CASE(R, 7, X) B12_CASE(R, 8, X) }

/* `rows` (1 or 2) coded rows from row n through b12_tile; exc: one row with exceptions (its own instance, so that
 * the plain rows' loop carries no check) */
static void b12_block_rows(const float *x, int64_t ldx, int tt, const uint8_t *m, int64_t N, int64_t K, int64_t n,
                           float *out, int64_t ldo, int rows, int exc) {
    if (exc) { B12_SWITCH(1, 1) } else if (rows == 2) { B12_SWITCH(2, 0) } else { B12_SWITCH(1, 0) }
}
#undef B12_SWITCH
#undef B12_CASE

/* bf16_rows' tiles (2 <= T < GEMM_MIN_T tokens) over rows [n0, n1) of a coded matrix, the same sums: rows stored
 * whole go through bf16_block itself, the others through b12_tile. */
static void b12_rows_few(const float *x, int64_t ldx, int64_t T, int64_t K, const uint8_t *m, int64_t N, int64_t n0,
                         int64_t n1, float *out, int64_t ldo) {
    const uint8_t *bases = m + N * b12_slot(K);
    for (int64_t t0 = 0; t0 < T; t0 += TILE_T) {
        const int tt = (int)(T - t0 < TILE_T ? T - t0 : TILE_T);
        const float *xt = x + t0 * ldx;
        for (int64_t n = n0; n < n1;) {
            float *o = out + t0 * ldo + (n - n0);
            if (bases[n] == B12_RAW) {
                bf16_block(xt, ldx, tt, b12_raw_row(m, K, n), K, o, ldo, 1);
                n++;
                continue;
            }
            const int exc = !b12_plain(bases[n]), rows = !exc && n + 1 < n1 && b12_plain(bases[n + 1]) ? 2 : 1;
            b12_block_rows(xt, ldx, tt, m, N, K, n, o, ldo, rows, exc);
            n += rows;
        }
    }
}
#endif

/* rows [n, n + rr) of w [N, K] as bf16 rows: w itself (from row n), or decoded into dec [rr * K] */
static const uint16_t *w_bf16_rows(const uint16_t *w, int64_t N, int64_t K, int64_t n, int64_t rr, uint16_t *dec) {
    if (!b12_tagged(w)) return w + n * K;
    for (int64_t r = 0; r < rr; r++) b12_decode_row(b12_addr(w), N, K, n + r, dec + r * K);
    return dec;
}

/* bf16_rows over rows [n0, n1) of w [N, K]: a bf16 matrix, or a coded one (tagged address), whose rows are
 * decoded into dec [(n1 - n0) * K] first (w_bf16_rows) unless fewer than GEMM_MIN_T tokens read them in
 * registers. */
static void w_rows(const float *x, int64_t ldx, int64_t T, int64_t K, const uint16_t *w, int64_t N, int64_t n0,
                   int64_t n1, float *out, int64_t ldo, uint16_t *dec) {
    if (!b12_tagged(w)) {
        bf16_rows(x, ldx, T, K, w, n0, n1, out, ldo);
        return;
    }
#if MS_SIMD == 2
    if (T == 1) {
        b12_gemv(x, K, b12_addr(w), N, n0, n1, out);
        return;
    }
    if (T < GEMM_MIN_T && !B12_FEW_OFF) {
        b12_rows_few(x, ldx, T, K, b12_addr(w), N, n0, n1, out, ldo);
        return;
    }
#endif
    bf16_rows(x, ldx, T, K, w_bf16_rows(w, N, K, n0, n1 - n0, dec), 0, n1 - n0, out, ldo);
}

#define B12_DENSE_ROWS 64 /* rows of a coded dense weight decoded at a time for products of GEMM_MIN_T+ tokens */

/* bf16_part's rows [n0, n1) of a dense weight w [N, K]: bf16_rows, or for a coded matrix (tagged address) w_rows,
 * which reads few-token products in registers and decodes B12_DENSE_ROWS rows at a time into scratch for the
 * others: the same sums as over the bf16 matrix. Returns 0, or -1 when the scratch could not be allocated. */
static int dense_rows(const float *x, int64_t ldx, int64_t T, int64_t K, const uint16_t *w, int64_t N, int64_t n0,
                      int64_t n1, float *out, int64_t ldo) {
    if (!b12_tagged(w)) {
        bf16_rows(x, ldx, T, K, w, n0, n1, out, ldo);
        return 0;
    }
#if MS_SIMD == 2
    if (T == 1 || (T < GEMM_MIN_T && !B12_FEW_OFF)) {
        w_rows(x, ldx, T, K, w, N, n0, n1, out, ldo, NULL);
        return 0;
    }
#endif
    const int64_t step = n1 - n0 < B12_DENSE_ROWS ? n1 - n0 : B12_DENSE_ROWS;
    uint16_t *dec = malloc(sizeof(uint16_t) * (size_t)(step * K));
    if (!dec) return -1;
    for (int64_t n = n0; n < n1; n += step)
        w_rows(x, ldx, T, K, w, N, n, n + step < n1 ? n + step : n1, out + (n - n0), ldo, dec);
    free(dec);
    return 0;
}

/* Whether the kernels may read the coded N x K matrix at m (nbytes bytes, what b12.check_bytes wraps): 0 when the
 * slots and base bytes fit, every row stored whole points at K bf16 values inside the bytes past them (2-byte
 * aligned), and, where any row is flagged, its exception table fits, its offsets rise from 0 and move exactly at
 * the flagged rows, and each row's positions lie inside it, rising. 1: too short, 2: a row stored whole points
 * outside, 3: the table. One pass over the base bytes and the table: microseconds for an expert. */
int ms_b12_check(const uint8_t *m, int64_t nbytes, int64_t N, int64_t K) {
    if (N <= 0 || K <= 0 || K % 64) return 1;
    const int64_t head = N * b12_slot(K) + b12_pad64(N);
    if (nbytes < head) return 1;
    const uint8_t *bases = m + N * b12_slot(K);
    int flagged = 0;
    for (int64_t n = 0; n < N; n++) flagged |= bases[n] != B12_RAW && !b12_plain(bases[n]);
    int64_t data = head; /* where the rows stored whole may start */
    if (flagged) {
        if (K > B12_MAX_XK || nbytes < head + b12_pad64(4 * (N + 1))) return 3;
        const uint8_t *t = m + head, *e = t + b12_pad64(4 * (N + 1));
        uint32_t prev;
        memcpy(&prev, t, 4);
        if (prev != 0) return 3;
        for (int64_t n = 0; n < N; n++) {
            uint32_t next;
            memcpy(&next, t + 4 * (n + 1), 4);
            const int has = bases[n] != B12_RAW && !b12_plain(bases[n]);
            if (next < prev || (next > prev) != has) return 3;
            if ((int64_t)(e - m) + 4 * (int64_t)next > nbytes) return 3;
            int64_t last = -1;
            for (uint32_t i = prev; i < next; i++) {
                const int64_t pos = b12_exc_pos(e + 4 * (int64_t)i);
                if (pos >= K || pos <= last) return 3;
                last = pos;
            }
            prev = next;
        }
        data = (int64_t)(e - m) + b12_pad64(4 * (int64_t)prev);
    }
    for (int64_t n = 0; n < N; n++) {
        if (bases[n] != B12_RAW) continue;
        int64_t off;
        memcpy(&off, m + n * b12_slot(K), sizeof(off));
        if (off < data || off % 2 || off > nbytes - 2 * K) return 2;
    }
    return 0;
}

/* rows [n0, n1) of the coded N x K matrix m decoded into out [n1 - n0, K] bf16 */
void ms_b12_decode_rows(const uint8_t *m, int64_t N, int64_t K, int64_t n0, int64_t n1, uint16_t *out) {
    for (int64_t n = n0; n < n1; n++) b12_decode_row(m, N, K, n, out + (n - n0) * K);
}

/* Decodes the whole N x K matrix m into out [N, K] bf16 (tests and the general path's check). */
void ms_b12_decode(const uint8_t *m, int64_t N, int64_t K, uint16_t *out) {
    for (int64_t n = 0; n < N; n++) b12_decode_row(m, N, K, n, out + n * K);
}
