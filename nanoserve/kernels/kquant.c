/* GGUF's K-quant blocks multiplied as the file holds them: no repacking, no dense copy.
 *
 * A weight row is the file's row: super-blocks of 256 inputs (Q4_K 144 bytes, Q5_K 176, Q6_K 210). Activations
 * are quantized per row and super-block to 8-bit codes with one float scale (d = max |x| / 127, round to nearest
 * even) and the codes' sums per 16, the format llama.cpp's CPU backend multiplies these blocks by (its Q8_K).
 *
 * Each type is a row of TYPES (its block bytes and its dot product), so the matmul driver and the thread pool
 * never ask which type they run. A dot product splits into an exact integer part per super-block, computed by
 * whichever instruction set the build has (AVX-512 VNNI, AVX2, plain C) with the same integers as result, and a
 * float part that every build runs as the same scalar code in super-block order: an output's bits depend on its
 * row alone, not on the call's other rows, the thread or the instruction set.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include "half.h"

#define QK 256       /* inputs per super-block */
#define SUMS 16      /* inputs per activation code sum */
#define OUT_TILE 16  /* outputs whose weight rows stay in cache while a call's activation rows pass */

typedef void (*ChunkFn)(const void *task, int64_t chunk, int64_t chunks, int32_t slot);
void ns_pool_run(ChunkFn run, const void *task, int64_t chunks, int32_t threads); /* linear.c */

static inline float half_at(const uint8_t *p) { /* exact either way: F16C's conversion is the same function */
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    return f16_to_f32(h);
#endif
}

/* ---- activations: 8-bit codes per super-block ----------------------------------------------------------- */

/* x [in] -> codes q [in], scales d [in / 256], code sums s [in / 16] */
static void quantize_row(const float *x, int64_t in, int8_t *q, float *d, int32_t *s) {
    for (int64_t b = 0; b < in / QK; b++) {
        const float *v = x + b * QK;
        float top = 0.0f;
        for (int i = 0; i < QK; i++) {
            float a = fabsf(v[i]);
            top = a > top ? a : top;
        }
        float inv = top > 0.0f ? 127.0f / top : 0.0f;
        d[b] = top / 127.0f;
        for (int i = 0; i < QK; i++) {
            float t = (v[i] * inv + 12582912.0f) - 12582912.0f; /* to nearest even */
            q[b * QK + i] = (int8_t)(t > 127.0f ? 127.0f : t);
        }
        for (int k = 0; k < QK / SUMS; k++) {
            int32_t sum = 0;
            for (int i = 0; i < SUMS; i++) sum += q[b * QK + k * SUMS + i];
            s[b * (QK / SUMS) + k] = sum;
        }
    }
}

/* ---- the block layouts ---------------------------------------------------------------------------------- */

/* Q4_K / Q5_K: 8 sub-blocks of 32 with a 6-bit scale and a 6-bit min each, packed in 12 bytes (gguf's
 * get_scale_min) */
static inline void scale_min_k4(const uint8_t *s, uint8_t sc[8], uint8_t m[8]) {
    uint32_t w[3], out[4]; /* four bytes at a time: sc[j] = s[j] & 63, sc[j + 4] = s[j + 8] & 15 | (s[j] >> 6) << 4 */
    memcpy(w, s, 12);
    out[0] = w[0] & 0x3f3f3f3fu;
    out[1] = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);
    out[2] = w[1] & 0x3f3f3f3fu;
    out[3] = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);
    memcpy(sc, out, 8);
    memcpy(m, out + 2, 8);
}

/* sum over sub-blocks j of m_j (the activations' code sum over sub-block j) */
static inline int32_t mins_k4(const uint8_t m[8], const int32_t *xs) {
    int32_t total = 0;
    for (int j = 0; j < 8; j++) total += m[j] * (xs[2 * j] + xs[2 * j + 1]);
    return total;
}

/* Q6_K: sum over its 16 sub-blocks k of sc_k (the activations' code sum over sub-block k) */
static inline int32_t offset_q6k(const int8_t *sc, const int32_t *xs) {
    int32_t total = 0;
    for (int k = 0; k < 16; k++) total += sc[k] * xs[k];
    return total;
}

/* The integer part of one super-block: Q4_K and Q5_K give sum_j sc_j sum_i q x (scaled) and the mins' term;
 * Q6_K gives sum_k sc_k sum_i (q - 32) x. Element layouts as gguf's dequantize_blocks:
 * Q4_K: d, dmin, scales[12], qs[128]; element 64 j + i in qs[32 j + i]'s low nibble, 64 j + 32 + i in its high.
 * Q5_K: d, dmin, scales[12], qh[32], qs[128]; as Q4_K, plus bit 2 j (low) / 2 j + 1 (high) of qh[i] as bit 4.
 * Q6_K: ql[128], qh[64], scales[16] (int8, one per 16), d; element 128 h + 64 s + i: nibble s of ql[64 h + i],
 *       and bits 2 t.. of qh[32 h + (i mod 32)] with t = 2 s + i / 32, as bits 4-5; q - 32. */

/* Each build's ints_k45 / ints_q6k: one super-block of weights (unpacked once) against n <= ROWS activation rows,
 * x the first row's codes for this super-block and row i's at x + i ldx; ints[i] the exact integer part. */
#define ROWS 4
/* inlined where called, so a call with one row (decode) or ROWS is compiled for that constant: measured 1.5x on
 * one row against leaving it to the compiler */
#define INLINE inline __attribute__((always_inline))

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KQ_ISA "avx512-vnni"

static inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

/* 64 unsigned codes (at most 63) against each row's 64 signed activations, 4 products a 32-bit lane, each lane
 * times its sub-block's scale (32-bit lanes) into the row's accumulator: measured faster on AVX-512 than 16-bit
 * pairs. The rows go innermost, so one row (decode) is the plain loop and a weight vector serves n rows. */
static INLINE void rows_step(__m512i *acc, __m512i q, __m512i scale, const int8_t *x, int64_t ldx, int n) {
    for (int i = 0; i < n; i++) {
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, _mm512_loadu_si512((const void *)(x + i * ldx)));
        acc[i] = _mm512_add_epi32(acc[i], _mm512_mullo_epi32(dot, scale));
    }
}

/* Q6_K's sum_k sc_k s_k on the vector unit */
static INLINE int32_t offset_vector(const int8_t *sc, const int32_t *xs) {
    __m512i scales = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc));
    return _mm512_reduce_add_epi32(_mm512_mullo_epi32(scales, _mm512_loadu_si512((const void *)xs)));
}
#define OFFSET offset_vector

/* The sums of a's and of b's lanes, in one reduction */
static INLINE void reduce2(__m512i a, __m512i b, int32_t *sum_a, int32_t *sum_b) {
    __m256i t = _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
    __m256i u = _mm256_add_epi32(_mm512_castsi512_si256(b), _mm512_extracti64x4_epi64(b, 1));
    __m256i v = _mm256_hadd_epi32(t, u); /* t01 t23 u01 u23 | t45 t67 u45 u67 */
    v = _mm256_hadd_epi32(v, v);        /* t0-3 u0-3 t0-3 u0-3 | t4-7 u4-7 ... */
    __m128i w = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    *sum_a = _mm_cvtsi128_si32(w);
    *sum_b = _mm_extract_epi32(w, 1);
}

/* Q4_K / Q5_K's integer parts and mins' terms (mins_k4) for n rows, reduced together */
#define HAVE_BLOCK_K45 1
static INLINE void block_k45(const uint8_t *qs, const uint8_t *qh, const int8_t *x, int64_t ldx, int n,
                             const uint8_t sc[8], const uint8_t m[8], const int32_t *xs, int64_t lds, int32_t *ints,
                             int32_t *mins) {
    const __m256i low = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    __m256i high = qh ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
    __m512i scales = _mm512_castsi256_si512(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)));
    __m512i acc[ROWS];
    for (int i = 0; i < n; i++) acc[i] = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        if (qh) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j + 1), one), 4));
        }
        /* lanes 0-7: sub-block 2 j, 8-15: sub-block 2 j + 1 */
        __m512i pick = join(_mm256_set1_epi32(2 * j), _mm256_set1_epi32(2 * j + 1));
        rows_step(acc, join(lo, hi), _mm512_permutexvar_epi32(pick, scales), x + 64 * j, ldx, n);
    }
    /* the mins, each twice (a sub-block of 32 is two sums of 16) */
    const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    __m512i mins16 = _mm512_permutexvar_epi32(
        twice, _mm512_castsi256_si512(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)m))));
    for (int i = 0; i < n; i++)
        reduce2(acc[i], _mm512_mullo_epi32(mins16, _mm512_loadu_si512((const void *)(xs + i * lds))), ints + i,
                mins + i);
}

static INLINE void ints_q6k(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const int8_t *x, int64_t ldx,
                            int n, int32_t *ints) {
    const __m256i low = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(3);
    const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512i acc[ROWS];
    for (int i = 0; i < n; i++) acc[i] = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        int h = c >> 1, s = c & 1;
        __m256i h32 = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h)),
                l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
        __m256i q0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4 * s), low),
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h32, 4 * s), two), 4));
        __m256i q1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4 * s), low),
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h32, 4 * s + 2), two), 4));
        int32_t four;
        memcpy(&four, sc + 4 * c, 4);
        /* lanes 4 k .. 4 k + 3: sub-block 4 c + k */
        rows_step(acc, join(q0, q1), _mm512_cvtepi8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(four), spread)),
                  x + 64 * c, ldx, n);
    }
    for (int i = 0; i < n; i++) ints[i] = _mm512_reduce_add_epi32(acc[i]);
}

#elif defined(__AVX2__)
#define KQ_ISA "avx2"

static inline int32_t hsum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* 8 x 32 unsigned codes (at most 63) against each row's 256 signed activations in 16-bit pairs (no saturation:
 * 2 63 127 < 2^15), each pair times its 16-bit scale, summed in 32 bits */
static inline void rows_ints(const __m256i q[8], const __m256i scale[8], const int8_t *x, int64_t ldx, int n,
                             int32_t *ints) {
    for (int i = 0; i < n; i++) {
        __m256i acc = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            __m256i pairs = _mm256_maddubs_epi16(q[j], _mm256_loadu_si256((const __m256i *)(x + i * ldx + 32 * j)));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scale[j]));
        }
        ints[i] = hsum8(acc);
    }
}

static INLINE void ints_k45(const uint8_t *qs, const uint8_t *qh, const int8_t *x, int64_t ldx, int n,
                            const uint8_t sc[8], int32_t *ints) {
    const __m256i low = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    __m256i high = qh ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
    __m256i q[8], scale[8];
    for (int j = 0; j < 4; j++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        if (qh) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j + 1), one), 4));
        }
        q[2 * j] = lo, q[2 * j + 1] = hi;
        scale[2 * j] = _mm256_set1_epi16(sc[2 * j]), scale[2 * j + 1] = _mm256_set1_epi16(sc[2 * j + 1]);
    }
    rows_ints(q, scale, x, ldx, n, ints);
}

static INLINE void ints_q6k(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const int8_t *x, int64_t ldx,
                            int n, int32_t *ints) {
    const __m256i low = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(3);
    __m256i q[8], scale[8];
    for (int c = 0; c < 4; c++) {
        int h = c >> 1, s = c & 1;
        __m256i h32 = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h)),
                l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
        q[2 * c] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4 * s), low),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h32, 4 * s), two), 4));
        q[2 * c + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4 * s), low),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h32, 4 * s + 2), two), 4));
        const int8_t *k = sc + 4 * c;
        scale[2 * c] = _mm256_setr_m128i(_mm_set1_epi16(k[0]), _mm_set1_epi16(k[1]));
        scale[2 * c + 1] = _mm256_setr_m128i(_mm_set1_epi16(k[2]), _mm_set1_epi16(k[3]));
    }
    rows_ints(q, scale, x, ldx, n, ints);
}

#else
#define KQ_ISA "portable"

static INLINE void ints_k45(const uint8_t *qs, const uint8_t *qh, const int8_t *x, int64_t ldx, int n,
                            const uint8_t sc[8], int32_t *ints) {
    for (int r = 0; r < n; r++, x += ldx) {
        int32_t total = 0;
        for (int j = 0; j < 4; j++) {
            int32_t lo = 0, hi = 0;
            for (int i = 0; i < 32; i++) {
                int h = qh ? qh[i] : 0;
                lo += ((qs[32 * j + i] & 15) | (((h >> (2 * j)) & 1) << 4)) * x[64 * j + i];
                hi += ((qs[32 * j + i] >> 4) | (((h >> (2 * j + 1)) & 1) << 4)) * x[64 * j + 32 + i];
            }
            total += sc[2 * j] * lo + sc[2 * j + 1] * hi;
        }
        ints[r] = total;
    }
}

static INLINE void ints_q6k(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const int8_t *x, int64_t ldx,
                            int n, int32_t *ints) {
    for (int r = 0; r < n; r++, x += ldx) {
        int32_t total = 0;
        for (int c = 0; c < 4; c++) {
            int h = c >> 1, s = c & 1;
            for (int k = 0; k < 4; k++) {
                int32_t part = 0;
                for (int i = 16 * k; i < 16 * k + 16; i++) {
                    int q = ((ql[64 * h + i] >> (4 * s)) & 15) |
                            (((qh[32 * h + (i & 31)] >> (4 * s + 2 * (i >> 5))) & 3) << 4);
                    part += q * x[64 * c + i];
                }
                total += sc[4 * c + k] * part;
            }
        }
        ints[r] = total;
    }
}
#endif

#ifndef OFFSET
#define OFFSET offset_q6k
#endif

#ifndef HAVE_BLOCK_K45
static INLINE void block_k45(const uint8_t *qs, const uint8_t *qh, const int8_t *x, int64_t ldx, int n,
                             const uint8_t sc[8], const uint8_t m[8], const int32_t *xs, int64_t lds, int32_t *ints,
                             int32_t *mins) {
    ints_k45(qs, qh, x, ldx, n, sc, ints);
    for (int i = 0; i < n; i++) mins[i] = mins_k4(m, xs + i * lds);
}
#endif

/* ---- one weight row against up to ROWS activation rows: the float part, the same code in every build ----
 * Activations (Act): row i's codes at q + i in, its scales at d + i (in / 256), its code sums at s + i (in / 16). */

typedef struct {
    const int8_t *q;
    const float *d;
    const int32_t *s;
    int64_t in;
} Act;

/* Q4_K (qh_at 0) and Q5_K: each row's sum over super-blocks, in order, of (d dx) ints - (dmin dx) mins */
static INLINE void dot_k45(const uint8_t *w, int64_t block_bytes, int64_t qh_at, Act x, int n, float *sums) {
    int64_t blocks = x.in / QK;
    float acc[ROWS] = {0.0f}; /* local: the sums' chain stays in registers (sums may alias the activations) */
    for (int64_t b = 0; b < blocks; b++, w += block_bytes) {
        uint8_t sc[8], m[8];
        int32_t ints[ROWS];
        scale_min_k4(w + 4, sc, m);
        const uint8_t *qh = qh_at ? w + qh_at : NULL, *qs = w + (qh_at ? qh_at + 32 : 16);
        int32_t mins[ROWS];
        block_k45(qs, qh, x.q + b * QK, x.in, n, sc, m, x.s + b * (QK / SUMS), x.in / SUMS, ints, mins);
        float d = half_at(w), dmin = half_at(w + 2);
        for (int i = 0; i < n; i++) {
            float dx = x.d[i * blocks + b];
            acc[i] = acc[i] + (d * dx) * (float)ints[i];
            acc[i] = acc[i] - (dmin * dx) * (float)mins[i];
        }
    }
    for (int i = 0; i < n; i++) sums[i] = acc[i];
}

/* Each dot is inlined for one row (decode), a full tile and the rest, so the compiler unrolls the first two. */
static void dot_q4k(const uint8_t *w, Act x, int n, float *sums) {
    if (n == 1)
        dot_k45(w, 144, 0, x, 1, sums);
    else if (n == ROWS)
        dot_k45(w, 144, 0, x, ROWS, sums);
    else
        dot_k45(w, 144, 0, x, n, sums);
}

static void dot_q5k(const uint8_t *w, Act x, int n, float *sums) {
    if (n == 1)
        dot_k45(w, 176, 16, x, 1, sums);
    else if (n == ROWS)
        dot_k45(w, 176, 16, x, ROWS, sums);
    else
        dot_k45(w, 176, 16, x, n, sums);
}

/* Q6_K: each row's sum over super-blocks, in order, of (d dx) (ints - 32 sum_k sc_k s_k) */
static INLINE void rows_q6k(const uint8_t *w, Act x, int n, float *sums) {
    int64_t blocks = x.in / QK;
    float acc[ROWS] = {0.0f};
    for (int64_t b = 0; b < blocks; b++, w += 210) {
        const int8_t *sc = (const int8_t *)(w + 192);
        int32_t ints[ROWS];
        ints_q6k(w, w + 128, sc, x.q + b * QK, x.in, n, ints);
        float d = half_at(w + 208);
        for (int i = 0; i < n; i++) {
            int32_t offset = OFFSET(sc, x.s + i * (x.in / SUMS) + b * (QK / SUMS));
            acc[i] = acc[i] + (d * x.d[i * blocks + b]) * (float)(ints[i] - 32 * offset);
        }
    }
    for (int i = 0; i < n; i++) sums[i] = acc[i];
}

static void dot_q6k(const uint8_t *w, Act x, int n, float *sums) {
    if (n == 1)
        rows_q6k(w, x, 1, sums);
    else if (n == ROWS)
        rows_q6k(w, x, ROWS, sums);
    else
        rows_q6k(w, x, n, sums);
}

/* ---- dequantization: gguf's arithmetic in gguf's order, so the floats are its floats --------------------- */

static void dequant_k45(const uint8_t *w, int64_t block_bytes, int64_t qh_at, int64_t blocks, float *out) {
    for (int64_t b = 0; b < blocks; b++, w += block_bytes, out += QK) {
        uint8_t sc[8], m[8];
        scale_min_k4(w + 4, sc, m);
        const uint8_t *qh = qh_at ? w + qh_at : NULL, *qs = w + (qh_at ? qh_at + 32 : 16);
        float d = half_at(w), dmin = half_at(w + 2);
        for (int j = 0; j < 8; j++) {
            float scale = d * (float)sc[j], min = dmin * (float)m[j];
            for (int i = 0; i < 32; i++) {
                int byte = qs[32 * (j / 2) + i], q = (j & 1) ? byte >> 4 : byte & 15;
                if (qh) q |= ((qh[i] >> j) & 1) << 4;
                out[32 * j + i] = scale * (float)q - min;
            }
        }
    }
}

static void dequant_q4k(const uint8_t *w, int64_t blocks, float *out) { dequant_k45(w, 144, 0, blocks, out); }

static void dequant_q5k(const uint8_t *w, int64_t blocks, float *out) { dequant_k45(w, 176, 16, blocks, out); }

static void dequant_q6k(const uint8_t *w, int64_t blocks, float *out) {
    for (int64_t b = 0; b < blocks; b++, w += 210, out += QK) {
        const int8_t *sc = (const int8_t *)(w + 192);
        float d = half_at(w + 208);
        for (int e = 0; e < QK; e++) {
            int h = e / 128, r = e % 128, s = r / 64, i = r % 64, t = r / 32;
            int q = ((w[64 * h + i] >> (4 * s)) & 15) | (((w[128 + 32 * h + (r & 31)] >> (2 * t)) & 3) << 4);
            out[e] = (d * (float)sc[e / 16]) * (float)(q - 32);
        }
    }
}

/* ---- the type table ------------------------------------------------------------------------------------- */

typedef void (*RowDot)(const uint8_t *w, Act x, int n, float *sums); /* one weight row, n <= ROWS rows */
typedef void (*RowDequant)(const uint8_t *w, int64_t blocks, float *out);

typedef struct {
    const char *name;    /* GGUF's type name */
    int64_t block_bytes; /* bytes per 256 inputs */
    RowDot dot;
    RowDequant dequant;
} KQuantType;

static const KQuantType TYPES[] = {
    {"Q4_K", 144, dot_q4k, dequant_q4k},
    {"Q5_K", 176, dot_q5k, dequant_q5k},
    {"Q6_K", 210, dot_q6k, dequant_q6k},
};
#define NTYPES ((int32_t)(sizeof TYPES / sizeof TYPES[0]))

int32_t ns_kq_types(void) { return NTYPES; }
const char *ns_kq_name(int32_t type) { return type >= 0 && type < NTYPES ? TYPES[type].name : ""; }
int64_t ns_kq_block_bytes(int32_t type) { return type >= 0 && type < NTYPES ? TYPES[type].block_bytes : 0; }
const char *ns_kq_isa(void) { return KQ_ISA; }

/* ---- the call ------------------------------------------------------------------------------------------- */

typedef struct {
    const KQuantType *type;
    const uint8_t *w;
    Act x;
    const float *bias;
    int64_t rows, out, ldy;
    float *y;
    int accumulate;
} KMatmul;

/* Outputs [o0, o1) for every row: OUT_TILE weight rows at a time stay in cache while the rows pass them, ROWS
 * rows at a time against each weight super-block unpacked once */
static void kq_chunk(const void *task, int64_t chunk, int64_t chunks, int32_t slot) {
    const KMatmul *m = task;
    int64_t o0 = m->out * chunk / chunks, o1 = m->out * (chunk + 1) / chunks, blocks = m->x.in / QK;
    int64_t row_bytes = blocks * m->type->block_bytes;
    (void)slot;
    for (int64_t t = o0; t < o1; t += OUT_TILE) {
        int64_t t1 = t + OUT_TILE < o1 ? t + OUT_TILE : o1;
        for (int64_t r = 0; r < m->rows; r += ROWS) {
            int n = m->rows - r < ROWS ? (int)(m->rows - r) : ROWS;
            Act x = {m->x.q + r * m->x.in, m->x.d + r * blocks, m->x.s + r * (m->x.in / SUMS), m->x.in};
            for (int64_t o = t; o < t1; o++) {
                float sums[ROWS];
                m->type->dot(m->w + o * row_bytes, x, n, sums);
                for (int i = 0; i < n; i++) {
                    float v = m->bias ? sums[i] + m->bias[o] : sums[i];
                    float *at = m->y + (r + i) * m->ldy + o;
                    *at = m->accumulate ? *at + v : v;
                }
            }
        }
    }
}

/* y [rows, out] float32 (a row every `ldy` floats: a merged projection's shards fill columns of one output) =
 * x [rows, in] float32 . W^T (+ bias; added to y with `accumulate`), W [out, in] the file's rows of K-quant
 * `type` (an index into TYPES); on up to `threads` threads. Returns 0, -1 out of memory, -2 for an unknown type
 * or inputs not in whole super-blocks. */
int ns_kq_matmul(int32_t type, const uint8_t *w, const float *x, int64_t rows, int64_t in, int64_t out, int64_t ldy,
                 const float *bias, float *y, int32_t threads, int32_t accumulate) {
    if (type < 0 || type >= NTYPES || in % QK || ldy < out) return -2;
    int64_t blocks = in / QK;
    int8_t *xq = malloc((size_t)(rows * in));
    float *xd = malloc((size_t)(rows * blocks) * sizeof(float));
    int32_t *xs = malloc((size_t)(rows * (in / SUMS)) * sizeof(int32_t));
    if (!xq || !xd || !xs) {
        free(xq), free(xd), free(xs);
        return -1;
    }
    for (int64_t r = 0; r < rows; r++) quantize_row(x + r * in, in, xq + r * in, xd + r * blocks, xs + r * (in / SUMS));
    KMatmul task = {&TYPES[type], w, {xq, xd, xs, in}, bias, rows, out, ldy, y, accumulate};
    int64_t chunks = (int64_t)(threads < 1 ? 1 : threads) * 4, tiles = (out + OUT_TILE - 1) / OUT_TILE;
    if (chunks > tiles) chunks = tiles > 0 ? tiles : 1;
    ns_pool_run(kq_chunk, &task, chunks, threads);
    free(xq), free(xd), free(xs);
    return 0;
}

/* out [n, in] float32 = rows idx[0..n) of W [rows, in] dequantized exactly as gguf does (an embedding's lookup).
 * Returns 0, -2 for an unknown type or inputs not in whole super-blocks, -3 for an index outside [0, rows). */
int ns_kq_dequant_rows(int32_t type, const uint8_t *w, int64_t rows, int64_t in, const int64_t *idx, int64_t n,
                       float *out) {
    if (type < 0 || type >= NTYPES || in % QK) return -2;
    for (int64_t r = 0; r < n; r++)
        if (idx[r] < 0 || idx[r] >= rows) return -3;
    int64_t blocks = in / QK, row_bytes = blocks * TYPES[type].block_bytes;
    for (int64_t r = 0; r < n; r++) TYPES[type].dequant(w + idx[r] * row_bytes, blocks, out + r * in);
    return 0;
}
