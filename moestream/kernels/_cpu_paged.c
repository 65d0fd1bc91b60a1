/* Paged GQA decode attention for a batch of sequences (included by _cpu.c after _cpu_step.c).
 *
 * A batch step of many decoding sequences used to make one native call per sequence and layer, each after a
 * Python-side append to the sequence's KV blocks and, for a bf16 cache, a gathered fp32 copy of it. Here one call
 * does all of them, straight on the block storage: for each sequence it normalises and ropes the new query and key,
 * writes the key and value into the row the caller reserved in the sequence's blocks (fp32; bf16 rounded to
 * nearest even as torch converts; int8 or int4 in groups as kernels/kvquant.py quantises), and attends over rows
 * 0 .. L-1
 * in the same order of operations as
 * ms_gqa_attend, so results are bit-identical to the per-sequence path. Sequences are split over the pool. */

static inline uint16_t f32_bf16(float f) { /* round to nearest even, as torch's fp32 -> bf16 */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

typedef struct {
    int64_t B, Hq, Hkv, D, Dv, block, storage, nbf16, kgroup, vgroup;
    float *q; const float *k, *v; const int64_t *L, *koff, *kblocks, *vblocks;
    const void *qn, *kn; float eps; const float *inv_freq; float factor, scale; float *out;
    float *scratch; int64_t stride, lmax, width; /* per part: scores [Hq, lmax], the new key, one widened row */
} paged_job;

enum { KV_FP32 = 0, KV_BF16 = 1, KV_INT8 = 2, KV_INT4 = 3 };

/* A quantised block (kernels/kvquant.py): fp32 scales [block, width / group], one per `group` consecutive values
 * (groups never straddle a head: group divides the head width), then the values [block, width] int8, or for int4
 * [block, width / 2] bytes, element 2i + 8 in byte i's low nibble and element 2i + 1 + 8 in its high one. */
static inline float *quant_scales(const int64_t *tab, int64_t b, int64_t width, int64_t group, int64_t r) {
    return (float *)(intptr_t)tab[b] + r * (width / group);
}

static inline uint8_t *quant_values(const int64_t *tab, int64_t b, int64_t block, int64_t width, int storage,
                                    int64_t group, int64_t r) {
    const int64_t row = storage == KV_INT4 ? width / 2 : width;
    return (uint8_t *)(intptr_t)tab[b] + 4 * block * (width / group) + r * row;
}

/* row j of a sequence's blocks (block table `tab`), as fp32 into dst (n values) or a pointer when fp32 */
static inline const float *paged_row(const int64_t *tab, int64_t j, int64_t block, int64_t width, int storage,
                                     int64_t group, float *dst) {
    const int64_t b = j / block, r = j % block;
    if (storage == KV_FP32) return (const float *)(intptr_t)tab[b] + r * width;
    if (storage == KV_BF16) {
        const uint16_t *s = (const uint16_t *)(intptr_t)tab[b] + r * width;
        for (int64_t c = 0; c < width; c++) dst[c] = bits_f32((uint32_t)s[c] << 16);
        return dst;
    }
    const uint8_t *s = quant_values(tab, b, block, width, storage, group, r);
    const float *sc = quant_scales(tab, b, width, group, r);
    if (storage == KV_INT8) {
        for (int64_t g0 = 0; g0 < width; g0 += group) {
            const float scale = sc[g0 / group];
            int64_t c = g0;
#if MS_AVX512
            /* 16 codes a vector: widened to int32, converted and scaled, each value one rounding as below */
            for (const __m512 vs = _mm512_set1_ps(scale); c + 16 <= g0 + group; c += 16) {
                const __m512i x = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(s + c)));
                _mm512_storeu_ps(dst + c, _mm512_mul_ps(_mm512_cvtepi32_ps(x), vs));
            }
#endif
            for (; c < g0 + group; c++) dst[c] = (float)(int8_t)s[c] * scale;
        }
        return dst;
    }
    for (int64_t g0 = 0; g0 < width; g0 += group) { /* int4: a group's bytes unpacked, then scaled */
        const float scale = sc[g0 / group];
        int64_t c = g0;
#if MS_AVX512
        /* 32 codes (16 bytes) a pass: each byte widened to a 16-bit lane holding its two codes in element order
         * (low nibble, then high), those 32 bytes widened to int32, less 8, converted and scaled: the same values */
        const __m512 vs = _mm512_set1_ps(scale);
        const __m512i eight = _mm512_set1_epi32(8);
        for (const __m256i nib = _mm256_set1_epi16(0x0F); c + 32 <= g0 + group; c += 32) {
            const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(s + c / 2)));
            const __m256i x = _mm256_or_si256(_mm256_and_si256(w, nib), _mm256_slli_epi16(_mm256_srli_epi16(w, 4), 8));
            const __m512i a0 = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(x)), eight);
            const __m512i a1 = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(x, 1)), eight);
            _mm512_storeu_ps(dst + c, _mm512_mul_ps(_mm512_cvtepi32_ps(a0), vs));
            _mm512_storeu_ps(dst + c + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(a1), vs));
        }
#endif
        for (; c < g0 + group; c += 2) {
            const uint8_t byte = s[c / 2];
            dst[c] = (float)((int)(byte & 0x0F) - 8) * scale;
            dst[c + 1] = (float)((int)(byte >> 4) - 8) * scale;
        }
    }
    return dst;
}

/* x [width] quantised in groups as kvquant.quantize does: scale = max |x| / qmax (127 for int8, 7 for int4), values
 * rounded to nearest even and clamped to [-qmax, qmax]; int8 codes into q[c], int4 codes + 8 packed two a byte
 * (element c into byte c / 2, even elements low) */
static void quantize_row(const float *x, int64_t width, int storage, int64_t group, uint8_t *q, float *scales) {
    const float qmax = storage == KV_INT4 ? 7.0f : 127.0f;
    for (int64_t g0 = 0; g0 < width; g0 += group) {
        float amax = 0.0f;
        for (int64_t c = g0; c < g0 + group; c++) amax = fabsf(x[c]) > amax ? fabsf(x[c]) : amax;
        const float s = amax / qmax, safe = s == 0.0f ? 1.0f : s;
        for (int64_t c = g0; c < g0 + group; c++) {
            float v = nearbyintf(x[c] / safe);
            const int code = (int)(v > qmax ? qmax : v < -qmax ? -qmax : v);
            if (storage == KV_INT8)
                q[c] = (uint8_t)(int8_t)code;
            else if (c % 2 == 0)
                q[c / 2] = (uint8_t)(code + 8);
            else
                q[c / 2] |= (uint8_t)((code + 8) << 4);
        }
        scales[g0 / group] = s;
    }
}

/* code c of a row quantize_row wrote, as an int */
static inline int quant_code(const uint8_t *q, int storage, int64_t c) {
    if (storage == KV_INT8) return (int8_t)q[c];
    return (int)((c % 2 ? q[c / 2] >> 4 : q[c / 2] & 0x0F)) - 8;
}

/* rows x [rows, width] quantised as quantize_row (storage KV_INT8 or KV_INT4) into q (width or width / 2 bytes a
 * row) and scales [rows, width / group], and the values they decode to (code * scale, fp32, as kvquant.dequantize)
 * into dec [rows, width]: kvquant.quantized in one pass (a prefill chunk's keys and values) */
void ms_kv_quantize(const float *x, int64_t rows, int64_t width, int storage, int64_t group, uint8_t *q,
                    float *scales, float *dec) {
    const int64_t qw = storage == KV_INT4 ? width / 2 : width, ng = width / group;
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *qr = q + r * qw;
        float *sr = scales + r * ng, *dr = dec + r * width;
        quantize_row(x + r * width, width, storage, group, qr, sr);
        for (int64_t c = 0; c < width; c++) dr[c] = (float)quant_code(qr, storage, c) * sr[c / group];
    }
}

static void paged_store(const int64_t *tab, int64_t j, int64_t block, int64_t width, int storage, int64_t group,
                        const float *src) {
    const int64_t b = j / block, r = j % block;
    if (storage == KV_FP32) {
        memcpy((float *)(intptr_t)tab[b] + r * width, src, sizeof(float) * (size_t)width);
        return;
    }
    if (storage == KV_BF16) {
        uint16_t *d = (uint16_t *)(intptr_t)tab[b] + r * width;
        for (int64_t c = 0; c < width; c++) d[c] = f32_bf16(src[c]);
        return;
    }
    quantize_row(src, width, storage, group, quant_values(tab, b, block, width, storage, group, r),
                 quant_scales(tab, b, width, group, r));
}

/* the value a store of x in this storage gives back (x itself for fp32), into dst */
static void stored_values(const float *x, int64_t width, int storage, int64_t group, uint8_t *qtmp, float *stmp,
                          float *dst) {
    if (storage == KV_FP32) {
        memcpy(dst, x, sizeof(float) * (size_t)width);
    } else if (storage == KV_BF16) {
        for (int64_t c = 0; c < width; c++) dst[c] = bits_f32((uint32_t)f32_bf16(x[c]) << 16);
    } else {
        quantize_row(x, width, storage, group, qtmp, stmp);
        for (int64_t c = 0; c < width; c++) dst[c] = (float)quant_code(qtmp, storage, c) * stmp[c / group];
    }
}

static void paged_one(const paged_job *j, int64_t s, float *p, float *krow, float *row) {
    const int64_t Hq = j->Hq, Hkv = j->Hkv, D = j->D, Dv = j->Dv, G = Hq / Hkv, L = j->L[s], pos = L - 1;
    const int storage = (int)j->storage;
    const int64_t *kt = j->kblocks + j->koff[s], *vt = j->vblocks + j->koff[s];
    float *qs = j->q + s * Hq * D;
    const float *kin = j->k + s * Hkv * D;
    /* the per-sequence path stores the raw key in the cache's dtype first, then norms and ropes that copy in fp32
     * and attends with it unrounded: the same here */
    stored_values(kin, Hkv * D, storage, j->kgroup, (uint8_t *)row, row + Hkv * D, krow);
    if (j->qn) rms_rows(qs, Hq, D, j->qn, (int)j->nbf16, j->eps);
    if (j->kn) rms_rows(krow, Hkv, D, j->kn, (int)j->nbf16, j->eps);
    if (j->inv_freq) {
        rope_heads(qs, Hq, D, pos, j->inv_freq, j->factor);
        rope_heads(krow, Hkv, D, pos, j->inv_freq, j->factor);
    }
    paged_store(kt, pos, j->block, Hkv * D, storage, j->kgroup, krow);
    paged_store(vt, pos, j->block, Hkv * Dv, storage, j->vgroup, j->v + s * Hkv * Dv);
    /* scores p[h, t]: each cache row is read (and widened) once for all heads; per head the order of operations
     * is ms_gqa_attend's (t ascending), so the sums are the same */
    for (int64_t t = 0; t < L; t++) {
        const float *kr = t == pos ? krow : paged_row(kt, t, j->block, Hkv * D, storage, j->kgroup, row);
        for (int64_t h = 0; h < Hq; h++) {
            const float *qh = qs + h * D, *kj = kr + (h / G) * D;
            p[h * L + t] = dot_lanes(qh, kj, D) * j->scale;
        }
    }
    for (int64_t h = 0; h < Hq; h++) {
        float *ph = p + h * L, m = -INFINITY;
        for (int64_t t = 0; t < L; t++)
            if (ph[t] > m) m = ph[t];
        const float sum = softmax_exps(ph, L, m);
        for (int64_t t = 0; t < L; t++) ph[t] = ph[t] / sum;
        float *oh = j->out + (s * Hq + h) * Dv;
        for (int64_t d = 0; d < Dv; d++) oh[d] = 0.0f;
    }
    for (int64_t t = 0; t < L; t++) {
        const float *vr = paged_row(vt, t, j->block, Hkv * Dv, storage, j->vgroup, row);
        for (int64_t h = 0; h < Hq; h++) {
            const float w = p[h * L + t], *vj = vr + (h / G) * Dv;
            float *oh = j->out + (s * Hq + h) * Dv;
            for (int64_t d = 0; d < Dv; d++) oh[d] += w * vj[d];
        }
    }
}

static void paged_part(void *arg, int part, int parts) {
    const paged_job *j = arg;
    float *p = j->scratch + part * j->stride;
    float *krow = p + j->Hq * j->lmax;
    float *row = krow + j->width;
    for (int64_t s = j->B * part / parts; s < j->B * (part + 1) / parts; s++) paged_one(j, s, p, krow, row);
}

/* B sequences decoding one token each. q [B, Hq, D], k [B, Hkv, D], v [B, Hkv, Dv] fp32 contiguous (q is normed and
 * roped in place); sequence s holds L[s] rows after this token (its new row L[s]-1 is already inside its blocks);
 * its K and V block addresses are kblocks/vblocks[koff[s] ..], blocks of `block` rows [block, Hkv, D|Dv] in fp32
 * (storage 0), bf16 (1), or fp32 scales per kgroup / vgroup values then int8 (2) or packed int4 (3) values. Norm
 * weights, rope and scale as ms_gqa_attend (no window). out [B, Hq, Dv].
 * Returns 0, or -1 when out of memory. */
int ms_gqa_decode_paged(int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, float *q, const float *k,
                        const float *v, const int64_t *L, const int64_t *koff, const int64_t *kblocks,
                        const int64_t *vblocks, int64_t block, int storage, int64_t kgroup, int64_t vgroup,
                        const void *qn, const void *kn, int nbf16,
                        float eps, const float *inv_freq, float factor, float scale, float *out) {
    if (B <= 0) return 0;
    int64_t lmax = 1;
    for (int64_t s = 0; s < B; s++) lmax = L[s] > lmax ? L[s] : lmax;
    int parts = pool_parts;
    if (parts > B) parts = (int)B;
    const int64_t width = Hkv * (D > Dv ? D : Dv);
    /* the widened row doubles as the quantised store's temporaries (at most width bytes + width / group scales) */
    const int64_t stride = (Hq * lmax + 3 * width + 15) / 16 * 16;
    float *scratch = malloc(sizeof(float) * (size_t)(stride * parts));
    if (!scratch) return -1;
    paged_job j = {B, Hq, Hkv, D, Dv, block, storage, nbf16, kgroup, vgroup, q, k, v, L, koff, kblocks, vblocks, qn, kn, eps,
                   inv_freq, factor, scale, out, scratch, stride, lmax, width};
    pool_run(paged_part, &j, parts);
    free(scratch);
    return 0;
}
