/* GGUF's K-quant blocks multiplied as the file holds them: no repacking, no dense copy.
 *
 * A weight row is the file's row: super-blocks of 256 inputs (Q4_K 144 bytes, Q5_K 176, Q6_K 210). Activations
 * are quantized per row and super-block to 8-bit codes with one float scale (d = max |x| / 127, round to nearest
 * even) and the codes' sums per 16, the format llama.cpp's CPU backend multiplies these blocks by (its Q8_K).
 *
 * Each type is a row of TYPES (its block bytes and its dot product), so the matmul driver and the thread pool
 * never ask which type they run. A dot product splits into exact integer parts per super-block and lane, computed
 * by whichever instruction set the build has (AVX-512 VNNI, AVX2, plain C) with the same integers as result, and a
 * float part every build runs as the same per-lane arithmetic in super-block order and one fixed sum of the lanes:
 * an output's bits depend on its row alone, not on the call's other rows, the thread or the instruction set.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include "half.h"
#include "kdecode.h"

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

/* The integer part of one super-block: Q4_K and Q5_K give sum_j sc_j sum_i q x (scaled) and the mins' term;
 * Q6_K gives sum_k sc_k sum_i (q - 32) x. Element layouts as gguf's dequantize_blocks:
 * Q4_K: d, dmin, scales[12], qs[128]; element 64 j + i in qs[32 j + i]'s low nibble, 64 j + 32 + i in its high.
 * Q5_K: d, dmin, scales[12], qh[32], qs[128]; as Q4_K, plus bit 2 j (low) / 2 j + 1 (high) of qh[i] as bit 4.
 * Q6_K: ql[128], qh[64], scales[16] (int8, one per 16), d; element 128 h + 64 s + i: nibble s of ql[64 h + i],
 *       and bits 2 t.. of qh[32 h + (i mod 32)] with t = 2 s + i / 32, as bits 4-5; q - 32. */

/* The float part keeps LANES partial sums a row, the same in every build: lane l takes, for each super-block,
 * the exact integer sum over the inputs {64 j + 4 l + k : j, k < 4} of weight code times activation code times
 * the code's sub-block scale (I_l), and for Q4_K / Q5_K the min term m_{l/2} times the activations' code sum
 * over inputs 16 l .. 16 l + 15 (M_l); Q6_K's offset sc_l times that sum (O_l). Per super-block, lane by lane,
 * each product rounded on its own (no fused multiply-add):
 *   Q4_K / Q5_K  a_l = (a_l + (d dx) I_l) - (dmin dx) M_l      Q6_K  a_l = a_l + (d dx) (I_l - 32 O_l)
 * and the row's sum is the lanes added in one fixed tree (l + 8, then l + 4, l + 2, l + 1). The vector builds
 * hold the lanes in registers across super-blocks: no horizontal sum per super-block. */
#define LANES 16
/* Each build's block_k45 / block_q6k: one super-block of weights (unpacked once) against n <= ROWS activation
 * rows, x the first row's codes for this super-block and row i's at x + i ldx, its code sums at xs + i lds, its
 * float factors dd[i] (and dm[i]); the lanes of row i in acc[i]. */
#define ROWS 4
/* inlined where called, so a call with one row (decode) or ROWS is compiled for that constant: measured 1.5x on
 * one row against leaving it to the compiler */
#define INLINE inline __attribute__((always_inline))

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KQ_ISA "avx512-vnni"

/* Q5_0 / Q5_1 / IQ4_NL: blocks of 32 inputs, each its own f16 scale; eight of them a run of 256 */
enum { K_Q5_0, K_Q5_1, K_IQ4_NL };

/* bit j of the 32 bits at qh -> 0x10 in byte j (the fifth bit of Q5_0 / Q5_1's code j) */
static INLINE __m256i fifth_bits(const uint8_t *qh) {
    uint32_t v;
    memcpy(&v, qh, 4);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                            3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i bytes = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)v), spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, bit), _mm256_set1_epi8(0x10));
}

/* a block's 32 codes in input order (input j: low nibble of qs[j], j + 16: high of qs[j]): Q5_0 signed (q - 16),
 * Q5_1 unsigned (q), IQ4_NL its table's signed values */
static INLINE __m256i codes32(const uint8_t *block, int kind) {
    const uint8_t *qs = block + (kind == K_Q5_0 ? 6 : kind == K_Q5_1 ? 8 : 2);
    const __m128i low = _mm_set1_epi8(0x0f);
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
    if (kind == K_IQ4_NL) {
        const __m128i table = _mm_loadu_si128((const __m128i *)NS_KVALUES);
        return _mm256_set_m128i(_mm_shuffle_epi8(table, hi), _mm_shuffle_epi8(table, lo));
    }
    __m256i q = _mm256_or_si256(_mm256_set_m128i(hi, lo), fifth_bits(block + (kind == K_Q5_0 ? 2 : 4)));
    return kind == K_Q5_0 ? _mm256_sub_epi8(q, _mm256_set1_epi8(16)) : q;
}

typedef __m512 Facc;
static INLINE Facc facc_zero(void) { return _mm512_setzero_ps(); }
static INLINE float facc_sum(Facc a) {
    __m256 t = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

static inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

/* 64 unsigned codes (at most 63) against each row's 64 signed activations (at most 127 in size): byte pairs
 * summed to 16 bits (at most 2 63 127 < 2^15, no saturation), then pairs of those times their sub-block's scale
 * (a 32-bit lane's scale in both its 16-bit halves) added into the row's 32-bit lane: two instructions a row,
 * exact, measured 1.4x over a 4-byte dot and a 32-bit multiply. The rows go innermost, so one row (decode) is the
 * plain loop and a weight vector serves n rows. */
static INLINE void rows_step(__m512i *acc, __m512i q, __m512i scale, const int8_t *x, int64_t ldx, int n) {
    __m512i scale16 = _mm512_or_si512(_mm512_and_si512(scale, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(scale, 16));
    for (int i = 0; i < n; i++)
        acc[i] = _mm512_dpwssd_epi32(acc[i], _mm512_maddubs_epi16(q, _mm512_loadu_si512((const void *)(x + i * ldx))),
                                     scale16);
}

static INLINE __m512 scaled(float f, __m512i ints) { return _mm512_mul_ps(_mm512_set1_ps(f), _mm512_cvtepi32_ps(ints)); }

static INLINE void block_k45(const uint8_t *qs, const uint8_t *qh, const int8_t *x, int64_t ldx, int n,
                             const uint8_t sc[8], const uint8_t m[8], const int32_t *xs, int64_t lds, const float *dd,
                             const float *dm, Facc *acc) {
    const __m256i low = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    __m256i high = qh ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
    __m512i scales = _mm512_castsi256_si512(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)));
    __m512i ints[ROWS];
    for (int i = 0; i < n; i++) ints[i] = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        if (qh) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j + 1), one), 4));
        }
        /* lanes 0-7: sub-block 2 j, 8-15: sub-block 2 j + 1 */
        __m512i pick = join(_mm256_set1_epi32(2 * j), _mm256_set1_epi32(2 * j + 1));
        rows_step(ints, join(lo, hi), _mm512_permutexvar_epi32(pick, scales), x + 64 * j, ldx, n);
    }
    const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    __m512i mins = _mm512_permutexvar_epi32(
        twice, _mm512_castsi256_si512(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)m))));
    for (int i = 0; i < n; i++) {
        __m512i mi = _mm512_mullo_epi32(mins, _mm512_loadu_si512((const void *)(xs + i * lds)));
        acc[i] = _mm512_sub_ps(_mm512_add_ps(acc[i], scaled(dd[i], ints[i])), scaled(dm[i], mi));
    }
}

static INLINE void block_q6k(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const int8_t *x, int64_t ldx,
                             int n, const int32_t *xs, int64_t lds, const float *dd, Facc *acc) {
    const __m256i low = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(3);
    const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512i ints[ROWS];
    for (int i = 0; i < n; i++) ints[i] = _mm512_setzero_si512();
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
        rows_step(ints, join(q0, q1), _mm512_cvtepi8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(four), spread)),
                  x + 64 * c, ldx, n);
    }
    __m512i offsets = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc));
    for (int i = 0; i < n; i++) {
        __m512i o = _mm512_mullo_epi32(offsets, _mm512_loadu_si512((const void *)(xs + i * lds)));
        acc[i] = _mm512_add_ps(acc[i], scaled(dd[i], _mm512_sub_epi32(ints[i], _mm512_slli_epi32(o, 5))));
    }
}

/* Q2_K / Q3_K: 256 codes of 2 bits (input 128 h + 32 s + l at bits 2 s of qs[32 h + l]), with Q3_K's third bit
 * (bit input / 32 of hmask[l]) as 4; sc the 16 scales, one per 16 inputs: lane l of chunk c takes sc[4 c + l / 4] */
static INLINE void ints_2bit(const uint8_t *qs, const uint8_t *hmask, const int8_t sc[16], const int8_t *x,
                             int64_t ldx, int n, __m512i *ints) {
    const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m256i hm = hmask ? _mm256_loadu_si256((const __m256i *)hmask) : _mm256_setzero_si256();
    for (int i = 0; i < n; i++) ints[i] = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        int s = 2 * (c & 1);
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * (c >> 1)));
        __m256i q0 = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * s), three),
                q1 = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * s + 2), three);
        if (hmask) {
            q0 = _mm256_or_si256(q0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 2 * c), one), 2));
            q1 = _mm256_or_si256(q1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 2 * c + 1), one), 2));
        }
        int32_t four;
        memcpy(&four, sc + 4 * c, 4);
        rows_step(ints, join(q0, q1), _mm512_cvtepi8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(four), spread)),
                  x + 64 * c, ldx, n);
    }
}

static INLINE void block_q2k(const uint8_t *qs, const int8_t sc[16], const uint8_t m[16], const int8_t *x,
                             int64_t ldx, int n, const int32_t *xs, int64_t lds, const float *dd, const float *dm,
                             Facc *acc) {
    __m512i ints[ROWS];
    ints_2bit(qs, NULL, sc, x, ldx, n, ints);
    __m512i mins = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)m));
    for (int i = 0; i < n; i++) {
        __m512i mi = _mm512_mullo_epi32(mins, _mm512_loadu_si512((const void *)(xs + i * lds)));
        acc[i] = _mm512_sub_ps(_mm512_add_ps(acc[i], scaled(dd[i], ints[i])), scaled(dm[i], mi));
    }
}

static INLINE void block_q3k(const uint8_t *qs, const uint8_t *hmask, const int8_t sc[16], const int8_t *x,
                             int64_t ldx, int n, const int32_t *xs, int64_t lds, const float *dd, Facc *acc) {
    __m512i ints[ROWS];
    ints_2bit(qs, hmask, sc, x, ldx, n, ints);
    __m512i offsets = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc));
    for (int i = 0; i < n; i++) {
        __m512i o = _mm512_mullo_epi32(offsets, _mm512_loadu_si512((const void *)(xs + i * lds)));
        acc[i] = _mm512_add_ps(acc[i], scaled(dd[i], _mm512_sub_epi32(ints[i], _mm512_slli_epi32(o, 2))));
    }
}

/* IQ4_XS's signed codes (its table's values, at most 127 in size) against each row's activations: |w| times x with
 * w's sign, byte pairs to 16 bits (at most 2 127 127 < 2^15), then times the 16-bit scales as rows_step does */
static INLINE void rows_step_signed(__m512i *acc, __m512i q, __m512i scale, const int8_t *x, int64_t ldx, int n) {
    __m512i scale16 = _mm512_or_si512(_mm512_and_si512(scale, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(scale, 16));
    __m512i size = _mm512_abs_epi8(q);
    __mmask64 negative = _mm512_movepi8_mask(q);
    for (int i = 0; i < n; i++) {
        __m512i v = _mm512_loadu_si512((const void *)(x + i * ldx));
        v = _mm512_mask_sub_epi8(v, negative, _mm512_setzero_si512(), v);
        acc[i] = _mm512_dpwssd_epi32(acc[i], _mm512_maddubs_epi16(size, v), scale16);
    }
}

/* IQ4_XS: 8 blocks of 32, block b's codes the nibbles of qs[16 b ..] (input j low, j + 16 high) looked up in the
 * table; chunk c is blocks 2 c and 2 c + 1, lanes 0-7 and 8-15 */
static INLINE void block_iq4xs(const uint8_t *qs, const int8_t sc[8], const int8_t *x, int64_t ldx, int n,
                               const float *dd, Facc *acc) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)NS_KVALUES));
    __m512i scales = _mm512_castsi256_si512(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc)));
    __m512i ints[ROWS];
    for (int i = 0; i < n; i++) ints[i] = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, low)),
                hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
        __m512i q = join(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
        __m512i pick = join(_mm256_set1_epi32(2 * c), _mm256_set1_epi32(2 * c + 1));
        rows_step_signed(ints, q, _mm512_permutexvar_epi32(pick, scales), x + 64 * c, ldx, n);
    }
    for (int i = 0; i < n; i++) acc[i] = _mm512_add_ps(acc[i], scaled(dd[i], ints[i]));
}

/* Blocks 2 c and 2 c + 1 of a run against each row's chunk c: lane l's sum of code times activation code over its
 * 4 inputs (and Q5_1's sum of activation codes), times its block's d dx (and m dx), into the row's lanes */
static INLINE void block32(const uint8_t *w, int bytes, int kind, const float d[8], const float m[8],
                           const int8_t *x, int64_t ldx, int n, const float *dx, Facc *acc) {
    const __m512i ones16 = _mm512_set1_epi16(1), ones8 = _mm512_set1_epi8(1);
    __m512 dv = _mm512_castps256_ps512(_mm256_loadu_ps(d)), mv = _mm512_castps256_ps512(_mm256_loadu_ps(m));
    for (int c = 0; c < 4; c++) {
        __m512i q = join(codes32(w + 2 * c * bytes, kind), codes32(w + (2 * c + 1) * bytes, kind));
        __m512i pick = join(_mm256_set1_epi32(2 * c), _mm256_set1_epi32(2 * c + 1));
        __m512 dc = _mm512_permutexvar_ps(pick, dv), mc = _mm512_permutexvar_ps(pick, mv);
        __m512i size = kind == K_Q5_1 ? q : _mm512_abs_epi8(q);
        __mmask64 negative = kind == K_Q5_1 ? 0 : _mm512_movepi8_mask(q);
        for (int i = 0; i < n; i++) {
            __m512i v = _mm512_loadu_si512((const void *)(x + i * ldx + 64 * c));
            __m512 f = _mm512_set1_ps(dx[i]);
            if (kind != K_Q5_1) v = _mm512_mask_sub_epi8(v, negative, _mm512_setzero_si512(), v);
            __m512i ints = _mm512_madd_epi16(_mm512_maddubs_epi16(size, v), ones16);
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_mul_ps(dc, f), _mm512_cvtepi32_ps(ints)));
            if (kind == K_Q5_1) {
                __m512i sums = _mm512_madd_epi16(_mm512_maddubs_epi16(ones8, v), ones16);
                acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_mul_ps(mc, f), _mm512_cvtepi32_ps(sums)));
            }
        }
    }
}

#elif defined(__AVX2__)
#define KQ_ISA "avx2"

/* Q5_0 / Q5_1 / IQ4_NL: blocks of 32 inputs, each its own f16 scale; eight of them a run of 256 */
enum { K_Q5_0, K_Q5_1, K_IQ4_NL };

/* bit j of the 32 bits at qh -> 0x10 in byte j (the fifth bit of Q5_0 / Q5_1's code j) */
static INLINE __m256i fifth_bits(const uint8_t *qh) {
    uint32_t v;
    memcpy(&v, qh, 4);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                            3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i bytes = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)v), spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, bit), _mm256_set1_epi8(0x10));
}

/* a block's 32 codes in input order (input j: low nibble of qs[j], j + 16: high of qs[j]): Q5_0 signed (q - 16),
 * Q5_1 unsigned (q), IQ4_NL its table's signed values */
static INLINE __m256i codes32(const uint8_t *block, int kind) {
    const uint8_t *qs = block + (kind == K_Q5_0 ? 6 : kind == K_Q5_1 ? 8 : 2);
    const __m128i low = _mm_set1_epi8(0x0f);
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
    if (kind == K_IQ4_NL) {
        const __m128i table = _mm_loadu_si128((const __m128i *)NS_KVALUES);
        return _mm256_set_m128i(_mm_shuffle_epi8(table, hi), _mm_shuffle_epi8(table, lo));
    }
    __m256i q = _mm256_or_si256(_mm256_set_m128i(hi, lo), fifth_bits(block + (kind == K_Q5_0 ? 2 : 4)));
    return kind == K_Q5_0 ? _mm256_sub_epi8(q, _mm256_set1_epi8(16)) : q;
}

typedef struct {
    __m256 lo, hi; /* lanes 0-7, 8-15 */
} Facc;
static INLINE Facc facc_zero(void) { return (Facc){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static INLINE float facc_sum(Facc a) {
    __m256 t = _mm256_add_ps(a.lo, a.hi);
    __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

static INLINE __m256 scaled(float f, __m256i ints) { return _mm256_mul_ps(_mm256_set1_ps(f), _mm256_cvtepi32_ps(ints)); }

/* 8 x 32 unsigned codes (at most 63) against each row's 256 signed activations in 16-bit pairs (no saturation:
 * 2 63 127 < 2^15), each pair times its 16-bit scale, summed in 32 bits: the even vectors' lanes are lanes 0-7,
 * the odd ones' lanes 8-15 */
static INLINE void rows_ints(const __m256i q[8], const __m256i scale[8], const int8_t *x, int64_t ldx, int n,
                             __m256i *lo, __m256i *hi) {
    for (int i = 0; i < n; i++) {
        __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
        for (int j = 0; j < 8; j += 2) {
            const int8_t *at = x + i * ldx + 32 * j;
            __m256i p0 = _mm256_maddubs_epi16(q[j], _mm256_loadu_si256((const __m256i *)at));
            __m256i p1 = _mm256_maddubs_epi16(q[j + 1], _mm256_loadu_si256((const __m256i *)(at + 32)));
            a = _mm256_add_epi32(a, _mm256_madd_epi16(p0, scale[j]));
            b = _mm256_add_epi32(b, _mm256_madd_epi16(p1, scale[j + 1]));
        }
        lo[i] = a, hi[i] = b;
    }
}

static INLINE void block_k45(const uint8_t *qs, const uint8_t *qh, const int8_t *x, int64_t ldx, int n,
                             const uint8_t sc[8], const uint8_t m[8], const int32_t *xs, int64_t lds, const float *dd,
                             const float *dm, Facc *acc) {
    const __m256i low = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    __m256i high = qh ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
    __m256i q[8], scale[8], lo[ROWS], hi[ROWS];
    for (int j = 0; j < 4; j++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        __m256i l = _mm256_and_si256(raw, low), h = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        if (qh) {
            l = _mm256_or_si256(l, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j), one), 4));
            h = _mm256_or_si256(h, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j + 1), one), 4));
        }
        q[2 * j] = l, q[2 * j + 1] = h;
        scale[2 * j] = _mm256_set1_epi16(sc[2 * j]), scale[2 * j + 1] = _mm256_set1_epi16(sc[2 * j + 1]);
    }
    rows_ints(q, scale, x, ldx, n, lo, hi);
    __m128i m8 = _mm_loadl_epi64((const __m128i *)m);
    __m256i m_lo = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(m8, m8)); /* m0 m0 m1 m1 m2 m2 m3 m3 */
    __m256i m_hi = _mm256_cvtepu8_epi32(_mm_srli_si128(_mm_unpacklo_epi8(m8, m8), 8));
    for (int i = 0; i < n; i++) {
        const __m256i *s = (const __m256i *)(xs + i * lds);
        __m256i min_lo = _mm256_mullo_epi32(m_lo, _mm256_loadu_si256(s)),
                min_hi = _mm256_mullo_epi32(m_hi, _mm256_loadu_si256(s + 1));
        acc[i].lo = _mm256_sub_ps(_mm256_add_ps(acc[i].lo, scaled(dd[i], lo[i])), scaled(dm[i], min_lo));
        acc[i].hi = _mm256_sub_ps(_mm256_add_ps(acc[i].hi, scaled(dd[i], hi[i])), scaled(dm[i], min_hi));
    }
}

static INLINE void block_q6k(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const int8_t *x, int64_t ldx,
                             int n, const int32_t *xs, int64_t lds, const float *dd, Facc *acc) {
    const __m256i low = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(3);
    __m256i q[8], scale[8], lo[ROWS], hi[ROWS];
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
    rows_ints(q, scale, x, ldx, n, lo, hi);
    __m256i off_lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc)),
            off_hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8)));
    for (int i = 0; i < n; i++) {
        const __m256i *s = (const __m256i *)(xs + i * lds);
        __m256i o_lo = _mm256_mullo_epi32(off_lo, _mm256_loadu_si256(s)),
                o_hi = _mm256_mullo_epi32(off_hi, _mm256_loadu_si256(s + 1));
        acc[i].lo = _mm256_add_ps(acc[i].lo, scaled(dd[i], _mm256_sub_epi32(lo[i], _mm256_slli_epi32(o_lo, 5))));
        acc[i].hi = _mm256_add_ps(acc[i].hi, scaled(dd[i], _mm256_sub_epi32(hi[i], _mm256_slli_epi32(o_hi, 5))));
    }
}

/* Q2_K / Q3_K's codes (see the AVX-512 build) as 8 vectors of 32, each lane pair's scale in 16 bits */
static INLINE void ints_2bit(const uint8_t *qs, const uint8_t *hmask, const int8_t sc[16], const int8_t *x,
                             int64_t ldx, int n, __m256i *lo, __m256i *hi) {
    const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    __m256i hm = hmask ? _mm256_loadu_si256((const __m256i *)hmask) : _mm256_setzero_si256();
    __m256i q[8], scale[8];
    for (int c = 0; c < 4; c++) {
        int s = 2 * (c & 1);
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * (c >> 1)));
        q[2 * c] = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * s), three);
        q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * s + 2), three);
        if (hmask) {
            q[2 * c] = _mm256_or_si256(q[2 * c], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 2 * c), one), 2));
            q[2 * c + 1] = _mm256_or_si256(q[2 * c + 1],
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 2 * c + 1), one), 2));
        }
        const int8_t *k = sc + 4 * c;
        scale[2 * c] = _mm256_setr_m128i(_mm_set1_epi16(k[0]), _mm_set1_epi16(k[1]));
        scale[2 * c + 1] = _mm256_setr_m128i(_mm_set1_epi16(k[2]), _mm_set1_epi16(k[3]));
    }
    rows_ints(q, scale, x, ldx, n, lo, hi);
}

static INLINE void block_q2k(const uint8_t *qs, const int8_t sc[16], const uint8_t m[16], const int8_t *x,
                             int64_t ldx, int n, const int32_t *xs, int64_t lds, const float *dd, const float *dm,
                             Facc *acc) {
    __m256i lo[ROWS], hi[ROWS];
    ints_2bit(qs, NULL, sc, x, ldx, n, lo, hi);
    __m256i m_lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)m)),
            m_hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(m + 8)));
    for (int i = 0; i < n; i++) {
        const __m256i *s = (const __m256i *)(xs + i * lds);
        __m256i min_lo = _mm256_mullo_epi32(m_lo, _mm256_loadu_si256(s)),
                min_hi = _mm256_mullo_epi32(m_hi, _mm256_loadu_si256(s + 1));
        acc[i].lo = _mm256_sub_ps(_mm256_add_ps(acc[i].lo, scaled(dd[i], lo[i])), scaled(dm[i], min_lo));
        acc[i].hi = _mm256_sub_ps(_mm256_add_ps(acc[i].hi, scaled(dd[i], hi[i])), scaled(dm[i], min_hi));
    }
}

static INLINE void block_q3k(const uint8_t *qs, const uint8_t *hmask, const int8_t sc[16], const int8_t *x,
                             int64_t ldx, int n, const int32_t *xs, int64_t lds, const float *dd, Facc *acc) {
    __m256i lo[ROWS], hi[ROWS];
    ints_2bit(qs, hmask, sc, x, ldx, n, lo, hi);
    __m256i off_lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc)),
            off_hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8)));
    for (int i = 0; i < n; i++) {
        const __m256i *s = (const __m256i *)(xs + i * lds);
        __m256i o_lo = _mm256_mullo_epi32(off_lo, _mm256_loadu_si256(s)),
                o_hi = _mm256_mullo_epi32(off_hi, _mm256_loadu_si256(s + 1));
        acc[i].lo = _mm256_add_ps(acc[i].lo, scaled(dd[i], _mm256_sub_epi32(lo[i], _mm256_slli_epi32(o_lo, 2))));
        acc[i].hi = _mm256_add_ps(acc[i].hi, scaled(dd[i], _mm256_sub_epi32(hi[i], _mm256_slli_epi32(o_hi, 2))));
    }
}

/* IQ4_XS (see the AVX-512 build): signed codes, |w| times x with w's sign in 16-bit pairs */
static INLINE void block_iq4xs(const uint8_t *qs, const int8_t sc[8], const int8_t *x, int64_t ldx, int n,
                               const float *dd, Facc *acc) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)NS_KVALUES));
    __m256i size[8], q[8], scale[8];
    for (int c = 0; c < 4; c++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, low)),
                hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
        q[2 * c] = _mm256_permute2x128_si256(lo, hi, 0x20);
        q[2 * c + 1] = _mm256_permute2x128_si256(lo, hi, 0x31);
        size[2 * c] = _mm256_abs_epi8(q[2 * c]), size[2 * c + 1] = _mm256_abs_epi8(q[2 * c + 1]);
        scale[2 * c] = _mm256_set1_epi16(sc[2 * c]), scale[2 * c + 1] = _mm256_set1_epi16(sc[2 * c + 1]);
    }
    for (int i = 0; i < n; i++) {
        __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
        for (int j = 0; j < 8; j += 2) {
            const int8_t *at = x + i * ldx + 32 * j;
            __m256i x0 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)at), q[j]),
                    x1 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(at + 32)), q[j + 1]);
            a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(size[j], x0), scale[j]));
            b = _mm256_add_epi32(b, _mm256_madd_epi16(_mm256_maddubs_epi16(size[j + 1], x1), scale[j + 1]));
        }
        acc[i].lo = _mm256_add_ps(acc[i].lo, scaled(dd[i], a));
        acc[i].hi = _mm256_add_ps(acc[i].hi, scaled(dd[i], b));
    }
}

/* Blocks 2 c and 2 c + 1 of a run (see the AVX-512 build): lanes 0-7 and 8-15 of chunk c */
static INLINE void block32(const uint8_t *w, int bytes, int kind, const float d[8], const float m[8],
                           const int8_t *x, int64_t ldx, int n, const float *dx, Facc *acc) {
    const __m256i ones16 = _mm256_set1_epi16(1), ones8 = _mm256_set1_epi8(1);
    for (int c = 0; c < 4; c++) {
        __m256i q[2] = {codes32(w + 2 * c * bytes, kind), codes32(w + (2 * c + 1) * bytes, kind)};
        for (int i = 0; i < n; i++) {
            __m256 f = _mm256_set1_ps(dx[i]);
            for (int h = 0; h < 2; h++) {
                int b = 2 * c + h;
                __m256i v = _mm256_loadu_si256((const __m256i *)(x + i * ldx + 64 * c + 32 * h));
                __m256i size = kind == K_Q5_1 ? q[h] : _mm256_abs_epi8(q[h]);
                if (kind != K_Q5_1) v = _mm256_sign_epi8(v, q[h]);
                __m256i ints = _mm256_madd_epi16(_mm256_maddubs_epi16(size, v), ones16);
                __m256 *lanes = h ? &acc[i].hi : &acc[i].lo;
                *lanes = _mm256_add_ps(*lanes, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d[b]), f),
                                                             _mm256_cvtepi32_ps(ints)));
                if (kind == K_Q5_1) {
                    __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, v), ones16);
                    *lanes = _mm256_add_ps(*lanes, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(m[b]), f),
                                                                 _mm256_cvtepi32_ps(sums)));
                }
            }
        }
    }
}

#else
#define KQ_ISA "portable"

typedef struct {
    float v[LANES];
} Facc;
static INLINE Facc facc_zero(void) { return (Facc){{0.0f}}; }
static INLINE float facc_sum(Facc a) {
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int l = 0; l < width; l++) a.v[l] = a.v[l] + a.v[l + width];
    return a.v[0];
}

/* One row's 16 lanes of exact integer sums. The codes' products go through a plain array in input order first,
 * so the compiler vectorizes that loop; lane l then adds inputs 4 l .. 4 l + 3 of each 64. */
static INLINE void lanes_k45(const uint8_t *qs, const uint8_t *qh, const int8_t *x, const uint8_t sc[8],
                             int32_t lanes[LANES]) {
    for (int l = 0; l < LANES; l++) lanes[l] = 0;
    for (int j = 0; j < 4; j++) {
        int32_t p[64];
        for (int b = 0; b < 32; b++) {
            int h = qh ? qh[b] : 0;
            p[b] = ((qs[32 * j + b] & 15) | (((h >> (2 * j)) & 1) << 4)) * x[64 * j + b];
            p[32 + b] = ((qs[32 * j + b] >> 4) | (((h >> (2 * j + 1)) & 1) << 4)) * x[64 * j + 32 + b];
        }
        for (int l = 0; l < LANES; l++)
            lanes[l] += sc[2 * j + (l >= 8)] * (p[4 * l] + p[4 * l + 1] + p[4 * l + 2] + p[4 * l + 3]);
    }
}

static INLINE void lanes_q6k(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const int8_t *x,
                             int32_t lanes[LANES]) {
    for (int l = 0; l < LANES; l++) lanes[l] = 0;
    for (int c = 0; c < 4; c++) {
        int h = c >> 1, s = c & 1;
        int32_t p[64];
        for (int i = 0; i < 64; i++) /* ql byte 64 h + i, input 64 c + i */
            p[i] = (((ql[64 * h + i] >> (4 * s)) & 15) | (((qh[32 * h + (i & 31)] >> (4 * s + 2 * (i >> 5))) & 3) << 4)) *
                   x[64 * c + i];
        for (int l = 0; l < LANES; l++)
            lanes[l] += sc[4 * c + l / 4] * (p[4 * l] + p[4 * l + 1] + p[4 * l + 2] + p[4 * l + 3]);
    }
}

static INLINE void block_k45(const uint8_t *qs, const uint8_t *qh, const int8_t *x, int64_t ldx, int n,
                             const uint8_t sc[8], const uint8_t m[8], const int32_t *xs, int64_t lds, const float *dd,
                             const float *dm, Facc *acc) {
    for (int i = 0; i < n; i++) {
        int32_t ints[LANES];
        lanes_k45(qs, qh, x + i * ldx, sc, ints);
        for (int l = 0; l < LANES; l++) {
            int32_t mins = m[l / 2] * xs[i * lds + l];
            acc[i].v[l] = (acc[i].v[l] + dd[i] * (float)ints[l]) - dm[i] * (float)mins;
        }
    }
}

static INLINE void block_q6k(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const int8_t *x, int64_t ldx,
                             int n, const int32_t *xs, int64_t lds, const float *dd, Facc *acc) {
    for (int i = 0; i < n; i++) {
        int32_t ints[LANES];
        lanes_q6k(ql, qh, sc, x + i * ldx, ints);
        for (int l = 0; l < LANES; l++)
            acc[i].v[l] = acc[i].v[l] + dd[i] * (float)(ints[l] - 32 * (sc[l] * xs[i * lds + l]));
    }
}
/* Q2_K / Q3_K's lanes for one row (see the AVX-512 build for the layout) */
static INLINE void lanes_2bit(const uint8_t *qs, const uint8_t *hmask, const int8_t sc[16], const int8_t *x,
                              int32_t lanes[LANES]) {
    for (int l = 0; l < LANES; l++) lanes[l] = 0;
    for (int c = 0; c < 4; c++) {
        int32_t p[64];
        for (int i = 0; i < 64; i++) {
            int e = 64 * c + i, byte = 32 * (c >> 1) + (i & 31), shift = 2 * (2 * (c & 1) + (i >> 5));
            int u = ((qs[byte] >> shift) & 3) | (hmask ? ((hmask[i & 31] >> (e / 32)) & 1) << 2 : 0);
            p[i] = u * x[e];
        }
        for (int l = 0; l < LANES; l++)
            lanes[l] += sc[4 * c + l / 4] * (p[4 * l] + p[4 * l + 1] + p[4 * l + 2] + p[4 * l + 3]);
    }
}

static INLINE void block_q2k(const uint8_t *qs, const int8_t sc[16], const uint8_t m[16], const int8_t *x,
                             int64_t ldx, int n, const int32_t *xs, int64_t lds, const float *dd, const float *dm,
                             Facc *acc) {
    for (int i = 0; i < n; i++) {
        int32_t ints[LANES];
        lanes_2bit(qs, NULL, sc, x + i * ldx, ints);
        for (int l = 0; l < LANES; l++) {
            int32_t mins = m[l] * xs[i * lds + l];
            acc[i].v[l] = (acc[i].v[l] + dd[i] * (float)ints[l]) - dm[i] * (float)mins;
        }
    }
}

static INLINE void block_q3k(const uint8_t *qs, const uint8_t *hmask, const int8_t sc[16], const int8_t *x,
                             int64_t ldx, int n, const int32_t *xs, int64_t lds, const float *dd, Facc *acc) {
    for (int i = 0; i < n; i++) {
        int32_t ints[LANES];
        lanes_2bit(qs, hmask, sc, x + i * ldx, ints);
        for (int l = 0; l < LANES; l++)
            acc[i].v[l] = acc[i].v[l] + dd[i] * (float)(ints[l] - 4 * (sc[l] * xs[i * lds + l]));
    }
}
static INLINE void block_iq4xs(const uint8_t *qs, const int8_t sc[8], const int8_t *x, int64_t ldx, int n,
                               const float *dd, Facc *acc) {
    for (int i = 0; i < n; i++) {
        int32_t lanes[LANES] = {0};
        for (int c = 0; c < 4; c++) {
            int32_t p[64];
            for (int e = 0; e < 64; e++) { /* block 2 c + e / 32, input e % 32 of it */
                int byte = qs[32 * c + 16 * (e / 32) + (e & 15)];
                p[e] = NS_KVALUES[(e & 16) ? byte >> 4 : byte & 15] * x[i * ldx + 64 * c + e];
            }
            for (int l = 0; l < LANES; l++)
                lanes[l] += sc[2 * c + (l >= 8)] * (p[4 * l] + p[4 * l + 1] + p[4 * l + 2] + p[4 * l + 3]);
        }
        for (int l = 0; l < LANES; l++) acc[i].v[l] = acc[i].v[l] + dd[i] * (float)lanes[l];
    }
}
/* Q5_0 / Q5_1 / IQ4_NL: blocks of 32 inputs, each its own f16 scale; eight of them a run of 256 */
enum { K_Q5_0, K_Q5_1, K_IQ4_NL };

static INLINE int code32(const uint8_t *block, int kind, int j) {
    const uint8_t *qs = block + (kind == K_Q5_0 ? 6 : kind == K_Q5_1 ? 8 : 2);
    int q = j < 16 ? qs[j] & 15 : qs[j - 16] >> 4;
    if (kind == K_IQ4_NL) return NS_KVALUES[q];
    uint32_t qh;
    memcpy(&qh, block + (kind == K_Q5_0 ? 2 : 4), 4);
    q |= (int)((qh >> j) & 1) << 4;
    return kind == K_Q5_0 ? q - 16 : q;
}

static INLINE void block32(const uint8_t *w, int bytes, int kind, const float d[8], const float m[8],
                           const int8_t *x, int64_t ldx, int n, const float *dx, Facc *acc) {
    for (int i = 0; i < n; i++)
        for (int l = 0; l < LANES; l++)
            for (int c = 0; c < 4; c++) {
                int b = 2 * c + (l >= 8), first = 4 * (l & 7);
                const int8_t *v = x + i * ldx + 64 * c + 32 * (l >= 8) + first;
                int32_t ints = 0, sums = 0;
                for (int k = 0; k < 4; k++) ints += code32(w + b * bytes, kind, first + k) * v[k], sums += v[k];
                acc[i].v[l] = acc[i].v[l] + (d[b] * dx[i]) * (float)ints;
                if (kind == K_Q5_1) acc[i].v[l] = acc[i].v[l] + (m[b] * dx[i]) * (float)sums;
            }
}
#endif

/* ---- one weight row against up to ROWS activation rows: the float part, the same in every build ----------
 * Activations (Act): row i's codes at q + i in, its scales at d + i (in / 256), its code sums at s + i (in / 16). */

typedef struct {
    const int8_t *q;
    const float *d;
    const int32_t *s;
    int64_t in;
} Act;

/* Q4_K (qh_at 0) and Q5_K: each row's lanes over super-blocks, in order, then summed */
static INLINE void dot_k45(const uint8_t *w, int64_t block_bytes, int64_t qh_at, Act x, int n, float *sums) {
    int64_t blocks = x.in / QK;
    Facc acc[ROWS];
    for (int i = 0; i < n; i++) acc[i] = facc_zero();
    for (int64_t b = 0; b < blocks; b++, w += block_bytes) {
        uint8_t sc[8], m[8];
        scale_min_k4(w + 4, sc, m);
        const uint8_t *qh = qh_at ? w + qh_at : NULL, *qs = w + (qh_at ? qh_at + 32 : 16);
        float d = half_at(w), dmin = half_at(w + 2), dd[ROWS], dm[ROWS];
        for (int i = 0; i < n; i++) dd[i] = d * x.d[i * blocks + b], dm[i] = dmin * x.d[i * blocks + b];
        block_k45(qs, qh, x.q + b * QK, x.in, n, sc, m, x.s + b * (QK / SUMS), x.in / SUMS, dd, dm, acc);
    }
    for (int i = 0; i < n; i++) sums[i] = facc_sum(acc[i]);
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

/* Q6_K: each row's lanes over super-blocks, in order, then summed */
static INLINE void rows_q6k(const uint8_t *w, Act x, int n, float *sums) {
    int64_t blocks = x.in / QK;
    Facc acc[ROWS];
    for (int i = 0; i < n; i++) acc[i] = facc_zero();
    for (int64_t b = 0; b < blocks; b++, w += 210) {
        float d = half_at(w + 208), dd[ROWS];
        for (int i = 0; i < n; i++) dd[i] = d * x.d[i * blocks + b];
        block_q6k(w, w + 128, (const int8_t *)(w + 192), x.q + b * QK, x.in, n, x.s + b * (QK / SUMS), x.in / SUMS,
                  dd, acc);
    }
    for (int i = 0; i < n; i++) sums[i] = facc_sum(acc[i]);
}

static void dot_q6k(const uint8_t *w, Act x, int n, float *sums) {
    if (n == 1)
        rows_q6k(w, x, 1, sums);
    else if (n == ROWS)
        rows_q6k(w, x, ROWS, sums);
    else
        rows_q6k(w, x, n, sums);
}

/* Q2_K: each row's lanes over super-blocks, the k45 formula with a scale and a min per 16 inputs */
static INLINE void rows_q2k(const uint8_t *w, Act x, int n, float *sums) {
    int64_t blocks = x.in / QK;
    Facc acc[ROWS];
    for (int i = 0; i < n; i++) acc[i] = facc_zero();
    for (int64_t b = 0; b < blocks; b++, w += 84) {
        int8_t sc[16];
        uint8_t m[16];
        for (int k = 0; k < 16; k++) sc[k] = (int8_t)(w[k] & 15), m[k] = w[k] >> 4;
        float d = half_at(w + 80), dmin = half_at(w + 82), dd[ROWS], dm[ROWS];
        for (int i = 0; i < n; i++) dd[i] = d * x.d[i * blocks + b], dm[i] = dmin * x.d[i * blocks + b];
        block_q2k(w + 16, sc, m, x.q + b * QK, x.in, n, x.s + b * (QK / SUMS), x.in / SUMS, dd, dm, acc);
    }
    for (int i = 0; i < n; i++) sums[i] = facc_sum(acc[i]);
}

/* Q3_K's 16 six-bit scales, less 32 (gguf's unpacking of its 12 bytes), four at a time: scale i's low nibble is
 * byte i's (i < 8) or byte i - 8's high one, its top two bits at 2 (i / 4) of byte 8 + i % 4 */
static inline void scales_q3k(const uint8_t *s, int8_t sc[16]) {
    uint32_t w[3], out[4];
    memcpy(w, s, 12);
    out[0] = (w[0] & 0x0f0f0f0fu) | ((w[2] & 0x03030303u) << 4);
    out[1] = (w[1] & 0x0f0f0f0fu) | (((w[2] >> 2) & 0x03030303u) << 4);
    out[2] = ((w[0] >> 4) & 0x0f0f0f0fu) | (((w[2] >> 4) & 0x03030303u) << 4);
    out[3] = ((w[1] >> 4) & 0x0f0f0f0fu) | (((w[2] >> 6) & 0x03030303u) << 4);
    uint8_t bytes[16];
    memcpy(bytes, out, 16);
    for (int i = 0; i < 16; i++) sc[i] = (int8_t)(bytes[i] - 32);
}

/* Q3_K: each row's lanes over super-blocks, in order, of (d dx) (ints - 4 sum_k sc_k s_k): the codes go in
 * unsigned (q + 4) and the offset comes off with the activations' code sums, as Q6_K's 32 does */
static INLINE void rows_q3k(const uint8_t *w, Act x, int n, float *sums) {
    int64_t blocks = x.in / QK;
    Facc acc[ROWS];
    for (int i = 0; i < n; i++) acc[i] = facc_zero();
    for (int64_t b = 0; b < blocks; b++, w += 110) {
        int8_t sc[16];
        scales_q3k(w + 96, sc);
        float d = half_at(w + 108), dd[ROWS];
        for (int i = 0; i < n; i++) dd[i] = d * x.d[i * blocks + b];
        block_q3k(w + 32, w, sc, x.q + b * QK, x.in, n, x.s + b * (QK / SUMS), x.in / SUMS, dd, acc);
    }
    for (int i = 0; i < n; i++) sums[i] = facc_sum(acc[i]);
}

static void dot_q2k(const uint8_t *w, Act x, int n, float *sums) {
    if (n == 1)
        rows_q2k(w, x, 1, sums);
    else if (n == ROWS)
        rows_q2k(w, x, ROWS, sums);
    else
        rows_q2k(w, x, n, sums);
}

static void dot_q3k(const uint8_t *w, Act x, int n, float *sums) {
    if (n == 1)
        rows_q3k(w, x, 1, sums);
    else if (n == ROWS)
        rows_q3k(w, x, ROWS, sums);
    else
        rows_q3k(w, x, n, sums);
}

/* IQ4_XS: each row's lanes over super-blocks, in order, of (d dx) ints, ints with block b's 6-bit scale less 32 */
static INLINE void rows_iq4xs(const uint8_t *w, Act x, int n, float *sums) {
    int64_t blocks = x.in / QK;
    Facc acc[ROWS];
    for (int i = 0; i < n; i++) acc[i] = facc_zero();
    for (int64_t b = 0; b < blocks; b++, w += 136) {
        int8_t sc[8];
        uint16_t high;
        memcpy(&high, w + 2, 2);
        for (int k = 0; k < 8; k++)
            sc[k] = (int8_t)((((w[4 + k / 2] >> (4 * (k % 2))) & 15) | (((high >> (2 * k)) & 3) << 4)) - 32);
        float d = half_at(w), dd[ROWS];
        for (int i = 0; i < n; i++) dd[i] = d * x.d[i * blocks + b];
        block_iq4xs(w + 8, sc, x.q + b * QK, x.in, n, dd, acc);
    }
    for (int i = 0; i < n; i++) sums[i] = facc_sum(acc[i]);
}

static void dot_iq4xs(const uint8_t *w, Act x, int n, float *sums) {
    if (n == 1)
        rows_iq4xs(w, x, 1, sums);
    else if (n == ROWS)
        rows_iq4xs(w, x, ROWS, sums);
    else
        rows_iq4xs(w, x, n, sums);
}

/* Q5_0 / Q5_1 / IQ4_NL: each row's lanes over runs of 256, chunk by chunk, of (d_b dx) ints (+ (m_b dx) sums) */
static INLINE void rows_32s(const uint8_t *w, int bytes, int kind, Act x, int n, float *sums) {
    int64_t blocks = x.in / QK;
    Facc acc[ROWS];
    for (int i = 0; i < n; i++) acc[i] = facc_zero();
    for (int64_t b = 0; b < blocks; b++, w += 8 * bytes) {
        float d[8], m[8], dx[ROWS];
        for (int k = 0; k < 8; k++) d[k] = half_at(w + k * bytes), m[k] = kind == K_Q5_1 ? half_at(w + k * bytes + 2) : 0.0f;
        for (int i = 0; i < n; i++) dx[i] = x.d[i * blocks + b];
        block32(w, bytes, kind, d, m, x.q + b * QK, x.in, n, dx, acc);
    }
    for (int i = 0; i < n; i++) sums[i] = facc_sum(acc[i]);
}

#define DOT32(name, bytes, kind)                                                                                  \
    static void name(const uint8_t *w, Act x, int n, float *sums) {                                               \
        if (n == 1)                                                                                               \
            rows_32s(w, bytes, kind, x, 1, sums);                                                                 \
        else if (n == ROWS)                                                                                       \
            rows_32s(w, bytes, kind, x, ROWS, sums);                                                              \
        else                                                                                                      \
            rows_32s(w, bytes, kind, x, n, sums);                                                                 \
    }
DOT32(dot_q5_0, 22, K_Q5_0)
DOT32(dot_q5_1, 24, K_Q5_1)
DOT32(dot_iq4nl, 18, K_IQ4_NL)

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
    RowDot dot;          /* against 8-bit activation codes per 256 */
    RowDequant dequant;
} KQuantType;

static const KQuantType TYPES[] = {
    {"Q4_K", 144, dot_q4k, dequant_q4k},
    {"Q5_K", 176, dot_q5k, dequant_q5k},
    {"Q6_K", 210, dot_q6k, dequant_q6k},
    /* the rarer types, their decoders in kdecode.c */
    {"Q5_0", 8 * 22, dot_q5_0, ns_dec_q5_0},
    {"Q5_1", 8 * 24, dot_q5_1, ns_dec_q5_1},
    {"IQ4_NL", 8 * 18, dot_iq4nl, ns_dec_iq4_nl},
    {"IQ4_XS", 136, dot_iq4xs, ns_dec_iq4_xs},
    {"Q2_K", 84, dot_q2k, ns_dec_q2_k},
    {"Q3_K", 110, dot_q3k, ns_dec_q3_k},
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
 * x [rows, in] float32 . W^T (+ bias; added to y with `accumulate`), W [out, in] the file's rows of type `type`
 * (an index into TYPES); on up to `threads` threads. Returns 0, -1 out of memory, -2 for an unknown type or
 * inputs not in whole runs of 256. */
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
