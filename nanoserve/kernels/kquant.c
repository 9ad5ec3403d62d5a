/* GGUF's K-quant blocks (and IQ4_XS's, and the blocks of 32 of Q5_0, Q5_1, IQ4_NL, and 16-bit F16 / BF16 rows)
 * multiplied as the file holds them: no repacking, no dense copy.
 *
 * A weight row is the file's row: runs of 256 inputs (Q4_K 144 bytes, Q5_K 176, Q6_K 210, ...). Activations
 * are quantized per row and super-block to 8-bit codes with one float scale (d = max |x| / 127, round to nearest
 * even) and the codes' sums per 16, the format llama.cpp's CPU backend multiplies these blocks by (its Q8_K).
 *
 * Each type is a row of TYPES (its bytes per 256, dot product and decoder), so the matmul driver and the thread pool
 * never ask which type they run. A dot product splits into exact integer parts per super-block and lane, computed
 * by whichever instruction set the build has (AVX-512 VNNI, AVX2, NEON dotprod, plain C) with the same integers as
 * result, and a float part every build runs as the same per-lane arithmetic in super-block order and one fixed sum
 * of the lanes: an output's bits depend on its row alone, not on the call's other rows, the thread or the
 * instruction set.
 *
 * F16 and BF16 rows (the weights of a 16-bit file) take the activations as float32, unquantized: each weight is
 * converted exactly to float and multiplied and added in one rounding (fused multiply-add) into one of 32 lanes,
 * lane l taking inputs l, l + 32, ... in order, the lanes then summed in the fixed tree (l + 16, l + 8, ...).
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
#define HALF_UNIT 32 /* inputs per unit of a 16-bit row: its float lanes */
#define HALF_ROWS 4  /* activation rows a 16-bit dot takes (eight measured 0.5x on AVX-512) */
#define SUMS 16      /* inputs per activation code sum */
#define OUT_TILE 16  /* outputs whose weight rows stay in cache while a call's activation rows pass */

typedef void (*ChunkFn)(const void *task, int64_t chunk, int64_t chunks, int32_t slot);
void ns_pool_run(ChunkFn run, const void *task, int64_t chunks, int32_t threads); /* linear.c */

/* ---- activations: 8-bit codes per super-block ----------------------------------------------------------- */

/* x [in] -> codes q [in], scales d [in / 256], code sums s [in / 16] */
static void quantize_row(const float *x, int64_t in, int8_t *q, float *d, int16_t *s) {
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
            s[b * (QK / SUMS) + k] = (int16_t)sum; /* at most 16 128 in size */
        }
    }
}

/* A call's activations to codes, rows [r0, r1) a chunk: on the pool from QUANTIZE_POOLED_FROM rows (a prefill's
 * 512 rows of 8192 took 3.4 ms on one thread, 8% of its Q4_K product); a row's codes are its own either way */
#define QUANTIZE_POOLED_FROM 16
typedef struct {
    const float *x;
    int64_t in, rows;
    int8_t *q;
    float *d;
    int16_t *s;
} Quantize;

static void quantize_chunk(const void *task, int64_t chunk, int64_t chunks, int32_t slot) {
    const Quantize *c = task;
    int64_t r0 = c->rows * chunk / chunks, r1 = c->rows * (chunk + 1) / chunks;
    (void)slot;
    for (int64_t r = r0; r < r1; r++)
        quantize_row(c->x + r * c->in, c->in, c->q + r * c->in, c->d + r * (c->in / QK), c->s + r * (c->in / SUMS));
}

/* x [rows, in] float32 (in whole runs of 256) -> each row's 8-bit codes q [rows, in], scales d [rows, in / 256] and
 * code sums per 16 s [rows, in / 16]: the activations every K-quant kernel here takes (kx16.c's too) */
void ns_kq_quantize(const float *x, int64_t rows, int64_t in, int8_t *q, float *d, int16_t *s, int32_t threads) {
    Quantize codes = {x, in, rows, q, d, s};
    if (rows >= QUANTIZE_POOLED_FROM)
        ns_pool_run(quantize_chunk, &codes, threads < 1 ? 1 : threads, threads);
    else
        quantize_chunk(&codes, 0, 1, 0);
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

/* The float part keeps LANES partial sums a row, the same in every build. For each super-block, lane l takes the
 * exact integer sum over its 32 inputs {64 j + 4 l + k, 64 j + 32 + 4 l + k : j, k < 4} of weight code times
 * activation code times the code's sub-block scale (I_l), and a correction over inputs 32 l .. 32 l + 31 (the
 * activations' code sums S_g over 16 inputs 16 g .. 16 g + 15, g = 2 l, 2 l + 1, times their group's factor):
 * Q4_K / Q5_K's mins M_l = m_l (S_2l + S_2l+1), Q2_K's M_l = m_2l S_2l + m_2l+1 S_2l+1, Q6_K's offsets
 * O_l = sc_2l S_2l + sc_2l+1 S_2l+1. Per super-block, lane by lane, each product rounded on its own (no fused
 * multiply-add):
 *   Q4_K / Q5_K  a_l = (a_l + (d dx) I_l) - (dmin dx) M_l      Q6_K  a_l = a_l + (d dx) (I_l - 32 O_l)
 * Q2_K goes as Q4_K (a scale and a min per 16 inputs), Q3_K as Q6_K with 4 for 32, IQ4_XS as Q6_K with no
 * offset (its codes signed). The types in blocks of 32 (Q5_0, Q5_1, IQ4_NL) take each chunk j of 64 inputs as its
 * two blocks b = 2 j, 2 j + 1 in turn, I_bl and S_bl (the activation codes' sum) over block b's inputs 4 l .. 4 l
 * + 3:  a_l = a_l + (d_b dx) I_bl, and for Q5_1 then a_l = a_l + (m_b dx) S_bl. The row's sum is the lanes added
 * in one fixed tree (l + 4, then l + 2, l + 1). Eight lanes are one AVX2 register: the float part, a fifth of the
 * work at 16 lanes, costs one instruction per step on either x86 build (AVX-512 adds its integer halves first).
 * The vector builds hold the lanes in registers across super-blocks: no horizontal sum per super-block. */
#define LANES 8
/* Each build's block_k45 (its 12 scale bytes unpacked as scale_min_k4 does), block_q6k and the rest: one
 * super-block of weights (unpacked once) against n <= ROWS
 * activation rows, x the first row's codes for this super-block and row i's at x + i ldx, its code sums at
 * xs + i lds, its float factors dd[i] (and dm[i]); the lanes of row i in acc[i]. ROWS = 8 (against
 * four: AVX-512 1.07x on Q4_K, 1.18x on Q6_K at 8-64 rows; AVX2, whose eight lanes a row are one register, 1.25x on
 * Q4_K). How many rows share a weight's unpacking changes no output's arithmetic. */
#define ROWS 8
/* inlined where called, so a call with one row (decode) or ROWS is compiled for that constant: measured 1.5x on
 * one row against leaving it to the compiler */
#define INLINE inline __attribute__((always_inline))

/* Q5_0 / Q5_1 / IQ4_NL: blocks of 32 inputs, each its own f16 scale; eight of them a run of 256 */
enum { K_Q5_0, K_Q5_1, K_IQ4_NL };

/* Each build's block functions: one header per instruction set, the same lanes and values from each */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KQ_ISA "avx512-vnni"
#include "kquant_x86.h"
#include "kquant_avx512.h"
#elif defined(__AVX2__)
#define KQ_ISA "avx2"
#include "kquant_x86.h"
#include "kquant_avx2.h"
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define KQ_ISA "neon-dotprod"
#include "kquant_neon.h"
#include "kquant_plainc.h"
#else
#define KQ_ISA "portable"
#include "kquant_plainc.h"
#endif

/* ---- one weight row against up to ROWS activation rows: the float part, the same in every build ----------
 * Activations (Act): row i's codes at q + i in, its scales at d + i (in / 256), its code sums at s + i (in / 16). */

typedef struct {
    const int8_t *q;
    const float *d;
    const int16_t *s; /* code sums per 16 inputs, 16-bit: two of them times their 16-bit factors in one pair product */
    int64_t in;
    const float *f; /* the float32 rows themselves (16-bit weights take them unquantized), row i at f + i in */
} Act;

/* One row's dot (decode) asks, each super-block, for the bytes AHEAD of it (the rows after it: a chunk's rows lie
 * one after another): the hardware's prefetch alone left the memory stream's stalls unhidden (1B Q4_K_M decode
 * medians 12.8 / 15.8 / 15.8 / 15.4 tok/s for none, 2048, 3072, 4096 bytes ahead, 3 interleaved runs, 2-core Zen 3).
 * A call with more rows has the driver ask for the next weight row instead (kq_chunk). */
#define AHEAD 2048
static INLINE void ahead(const uint8_t *w, int64_t bytes, int n) {
    if (n == 1)
        for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(w + AHEAD + at);
}

/* Q4_K (qh_at 0) and Q5_K: each row's lanes over super-blocks, in order, then summed */
static INLINE void dot_k45(const uint8_t *w, int64_t block_bytes, int64_t qh_at, Act x, int n, float *sums) {
    int64_t blocks = x.in / QK;
    Facc acc[ROWS];
    for (int i = 0; i < n; i++) acc[i] = facc_zero();
    for (int64_t b = 0; b < blocks; b++, w += block_bytes) {
        ahead(w, block_bytes, n);
        const uint8_t *qh = qh_at ? w + qh_at : NULL, *qs = w + (qh_at ? qh_at + 32 : 16);
        float d = half_at(w), dmin = half_at(w + 2), dd[ROWS], dm[ROWS];
        for (int i = 0; i < n; i++) dd[i] = d * x.d[i * blocks + b], dm[i] = dmin * x.d[i * blocks + b];
        block_k45(qs, qh, x.q + b * QK, x.in, n, w + 4, x.s + b * (QK / SUMS), x.in / SUMS, dd, dm, acc);
    }
    for (int i = 0; i < n; i++) sums[i] = facc_sum(acc[i]);
}

/* Q6_K: each row's lanes over super-blocks, in order, then summed */
static INLINE void rows_q6k(const uint8_t *w, Act x, int n, float *sums) {
    int64_t blocks = x.in / QK;
    Facc acc[ROWS];
    for (int i = 0; i < n; i++) acc[i] = facc_zero();
    for (int64_t b = 0; b < blocks; b++, w += 210) {
        ahead(w, 210, n);
        float d = half_at(w + 208), dd[ROWS];
        for (int i = 0; i < n; i++) dd[i] = d * x.d[i * blocks + b];
        block_q6k(w, w + 128, (const int8_t *)(w + 192), x.q + b * QK, x.in, n, x.s + b * (QK / SUMS), x.in / SUMS,
                  dd, acc);
    }
    for (int i = 0; i < n; i++) sums[i] = facc_sum(acc[i]);
}

/* Q2_K: each row's lanes over super-blocks, the k45 formula with a scale and a min per 16 inputs */
static INLINE void rows_q2k(const uint8_t *w, Act x, int n, float *sums) {
    int64_t blocks = x.in / QK;
    Facc acc[ROWS];
    for (int i = 0; i < n; i++) acc[i] = facc_zero();
    for (int64_t b = 0; b < blocks; b++, w += 84) {
        ahead(w, 84, n);
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
        ahead(w, 110, n);
        int8_t sc[16];
        scales_q3k(w + 96, sc);
        float d = half_at(w + 108), dd[ROWS];
        for (int i = 0; i < n; i++) dd[i] = d * x.d[i * blocks + b];
        block_q3k(w + 32, w, sc, x.q + b * QK, x.in, n, x.s + b * (QK / SUMS), x.in / SUMS, dd, acc);
    }
    for (int i = 0; i < n; i++) sums[i] = facc_sum(acc[i]);
}

/* IQ4_XS: each row's lanes over super-blocks, in order, of (d dx) ints, ints with block b's 6-bit scale less 32 */
static INLINE void rows_iq4xs(const uint8_t *w, Act x, int n, float *sums) {
    int64_t blocks = x.in / QK;
    Facc acc[ROWS];
    for (int i = 0; i < n; i++) acc[i] = facc_zero();
    for (int64_t b = 0; b < blocks; b++, w += 136) {
        ahead(w, 136, n);
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

/* Q5_0 / Q5_1 / IQ4_NL: each row's lanes over runs of 256, chunk by chunk, of (d_b dx) ints (+ (m_b dx) sums) */
static INLINE void rows_32s(const uint8_t *w, int bytes, int kind, Act x, int n, float *sums) {
    int64_t blocks = x.in / QK;
    Facc acc[ROWS];
    for (int i = 0; i < n; i++) acc[i] = facc_zero();
    for (int64_t b = 0; b < blocks; b++, w += 8 * bytes) {
        ahead(w, 8 * bytes, n);
        float d[8], m[8], dx[ROWS];
        for (int k = 0; k < 8; k++)
            d[k] = half_at(w + k * bytes), m[k] = kind == K_Q5_1 ? half_at(w + k * bytes + 2) : 0.0f;
        for (int i = 0; i < n; i++) dx[i] = x.d[i * blocks + b];
        block32(w, bytes, kind, d, m, x.q + b * QK, x.in, n, dx, acc);
    }
    for (int i = 0; i < n; i++) sums[i] = facc_sum(acc[i]);
}

/* A type's rows against a weight row, for the type table (one signature for all) */
static INLINE void rows_q4k(const uint8_t *w, Act x, int n, float *sums) { dot_k45(w, 144, 0, x, n, sums); }
static INLINE void rows_q5k(const uint8_t *w, Act x, int n, float *sums) { dot_k45(w, 176, 16, x, n, sums); }
static INLINE void rows_q5_0(const uint8_t *w, Act x, int n, float *sums) { rows_32s(w, 22, K_Q5_0, x, n, sums); }
static INLINE void rows_q5_1(const uint8_t *w, Act x, int n, float *sums) { rows_32s(w, 24, K_Q5_1, x, n, sums); }
static INLINE void rows_iq4nl(const uint8_t *w, Act x, int n, float *sums) { rows_32s(w, 18, K_IQ4_NL, x, n, sums); }
static INLINE void rows_f16(const uint8_t *w, Act x, int n, float *sums) { rows_half(w, 0, x.f, x.in, n, sums); }
static INLINE void rows_bf16(const uint8_t *w, Act x, int n, float *sums) { rows_half(w, 1, x.f, x.in, n, sums); }

/* Each type's dot: its rows inlined for one row (decode), a full group of `tile` rows and the rest, so the
 * compiler unrolls the first two */
#define DOT(name, rows, tile)                                                                                     \
    static void name(const uint8_t *w, Act x, int n, float *sums) {                                               \
        if (n == 1)                                                                                               \
            rows(w, x, 1, sums);                                                                                  \
        else if (n == tile)                                                                                       \
            rows(w, x, tile, sums);                                                                               \
        else                                                                                                      \
            rows(w, x, n, sums);                                                                                  \
    }
DOT(dot_q4k, rows_q4k, ROWS)
DOT(dot_q5k, rows_q5k, ROWS)
DOT(dot_q6k, rows_q6k, ROWS)
DOT(dot_q2k, rows_q2k, ROWS)
DOT(dot_q3k, rows_q3k, ROWS)
DOT(dot_iq4xs, rows_iq4xs, ROWS)
DOT(dot_q5_0, rows_q5_0, ROWS)
DOT(dot_q5_1, rows_q5_1, ROWS)
DOT(dot_iq4nl, rows_iq4nl, ROWS)
DOT(dot_f16, rows_f16, HALF_ROWS)
DOT(dot_bf16, rows_bf16, HALF_ROWS)

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

/* 16-bit rows to float32: exact */
static void dequant_f16(const uint8_t *w, int64_t units, float *out) {
    for (int64_t i = 0; i < units * HALF_UNIT; i++) out[i] = half_at(w + 2 * i);
}

static void dequant_bf16(const uint8_t *w, int64_t units, float *out) {
    for (int64_t i = 0; i < units * HALF_UNIT; i++) {
        uint16_t h;
        memcpy(&h, w + 2 * i, 2);
        uint32_t bits = (uint32_t)h << 16;
        memcpy(out + i, &bits, 4);
    }
}

/* ---- the type table ------------------------------------------------------------------------------------- */

typedef void (*RowDot)(const uint8_t *w, Act x, int n, float *sums); /* one weight row, n <= ROWS rows */
typedef void (*RowDequant)(const uint8_t *w, int64_t units, float *out);

enum { ACT_Q8K, ACT_F32 }; /* the activations a type's dot takes: 8-bit codes per 256, or float32 as they are */

typedef struct {
    const char *name;    /* GGUF's type name */
    int64_t inputs;      /* inputs per unit (a row is whole units) */
    int64_t block_bytes; /* bytes per unit */
    int act;
    int rows; /* activation rows a dot takes at most (that share one unpacking of the weight row) */
    RowDot dot;
    RowDequant dequant;
} KQuantType;

static const KQuantType TYPES[] = {
    {"Q4_K", QK, 144, ACT_Q8K, ROWS, dot_q4k, dequant_q4k},
    {"Q5_K", QK, 176, ACT_Q8K, ROWS, dot_q5k, dequant_q5k},
    {"Q6_K", QK, 210, ACT_Q8K, ROWS, dot_q6k, dequant_q6k},
    /* the rarer types, their decoders in kdecode.c */
    {"Q5_0", QK, 8 * 22, ACT_Q8K, ROWS, dot_q5_0, ns_dec_q5_0},
    {"Q5_1", QK, 8 * 24, ACT_Q8K, ROWS, dot_q5_1, ns_dec_q5_1},
    {"IQ4_NL", QK, 8 * 18, ACT_Q8K, ROWS, dot_iq4nl, ns_dec_iq4_nl},
    {"IQ4_XS", QK, 136, ACT_Q8K, ROWS, dot_iq4xs, ns_dec_iq4_xs},
    {"Q2_K", QK, 84, ACT_Q8K, ROWS, dot_q2k, ns_dec_q2_k},
    {"Q3_K", QK, 110, ACT_Q8K, ROWS, dot_q3k, ns_dec_q3_k},
    /* a 16-bit file's weights */
    {"F16", HALF_UNIT, 2 * HALF_UNIT, ACT_F32, HALF_ROWS, dot_f16, dequant_f16},
    {"BF16", HALF_UNIT, 2 * HALF_UNIT, ACT_F32, HALF_ROWS, dot_bf16, dequant_bf16},
};
#define NTYPES ((int32_t)(sizeof TYPES / sizeof TYPES[0]))

int32_t ns_kq_types(void) { return NTYPES; }
const char *ns_kq_name(int32_t type) { return type >= 0 && type < NTYPES ? TYPES[type].name : ""; }
int64_t ns_kq_block_bytes(int32_t type) { return type >= 0 && type < NTYPES ? TYPES[type].block_bytes : 0; }
int64_t ns_kq_inputs(int32_t type) { return type >= 0 && type < NTYPES ? TYPES[type].inputs : 0; }
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

/* The activations from row r on */
static Act rows_from(Act x, int act, int64_t r) {
    if (act == ACT_F32) return (Act){NULL, NULL, NULL, x.in, x.f + r * x.in};
    return (Act){x.q + r * x.in, x.d + r * (x.in / QK), x.s + r * (x.in / SUMS), x.in, NULL};
}

/* Outputs [o0, o1) for every row: OUT_TILE weight rows at a time stay in cache while the rows pass them, ROWS
 * rows at a time against each weight super-block unpacked once */
static void kq_chunk(const void *task, int64_t chunk, int64_t chunks, int32_t slot) {
    const KMatmul *m = task;
    int64_t o0 = m->out * chunk / chunks, o1 = m->out * (chunk + 1) / chunks;
    int64_t row_bytes = m->x.in / m->type->inputs * m->type->block_bytes;
    (void)slot;
    for (int64_t t = o0; t < o1; t += OUT_TILE) {
        int64_t t1 = t + OUT_TILE < o1 ? t + OUT_TILE : o1;
        for (int64_t r = 0; r < m->rows; r += m->type->rows) {
            int n = m->rows - r < m->type->rows ? (int)(m->rows - r) : m->type->rows;
            Act x = rows_from(m->x, m->type->act, r);
            for (int64_t o = t; o < t1; o++) {
                float sums[ROWS];
                if (r == 0 && m->rows > 1 && o + 1 < o1) /* the first pass over a tile reads it from memory: ask
                                                          * for the next row (one row: its dot asks ahead) */
                    for (int64_t at = 0; at < row_bytes; at += 64) __builtin_prefetch(m->w + (o + 1) * row_bytes + at);
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

static void run_chunks(const KMatmul *task, int64_t out, int32_t threads) {
    int64_t chunks = (int64_t)(threads < 1 ? 1 : threads) * 4, tiles = (out + OUT_TILE - 1) / OUT_TILE;
    if (chunks > tiles) chunks = tiles > 0 ? tiles : 1;
    ns_pool_run(kq_chunk, task, chunks, threads);
}

/* y [rows, out] float32 (a row every `ldy` floats: a merged projection's shards fill columns of one output) =
 * x [rows, in] float32 . W^T (+ bias; added to y with `accumulate`), W [out, in] the file's rows of type `type`
 * (an index into TYPES); on up to `threads` threads. Returns 0, -1 out of memory, -2 for an unknown type or
 * inputs not in whole units of the type. */
int ns_kq_matmul(int32_t type, const uint8_t *w, const float *x, int64_t rows, int64_t in, int64_t out, int64_t ldy,
                 const float *bias, float *y, int32_t threads, int32_t accumulate) {
    if (type < 0 || type >= NTYPES || in % TYPES[type].inputs || ldy < out) return -2;
    if (TYPES[type].act == ACT_F32) {
        KMatmul task = {&TYPES[type], w, {NULL, NULL, NULL, in, x}, bias, rows, out, ldy, y, accumulate};
        run_chunks(&task, out, threads);
        return 0;
    }
    int64_t blocks = in / QK;
    int8_t *xq = malloc((size_t)(rows * in));
    float *xd = malloc((size_t)(rows * blocks) * sizeof(float));
    int16_t *xs = malloc((size_t)(rows * (in / SUMS)) * sizeof(int16_t));
    if (!xq || !xd || !xs) {
        free(xq), free(xd), free(xs);
        return -1;
    }
    ns_kq_quantize(x, rows, in, xq, xd, xs, threads);
    KMatmul task = {&TYPES[type], w, {xq, xd, xs, in, NULL}, bias, rows, out, ldy, y, accumulate};
    run_chunks(&task, out, threads);
    free(xq), free(xd), free(xs);
    return 0;
}

/* out [n, in] float32 = rows idx[0..n) of W [rows, in] dequantized exactly as gguf does (an embedding's lookup).
 * Returns 0, -2 for an unknown type or inputs not in whole units, -3 for an index outside [0, rows). */
int ns_kq_dequant_rows(int32_t type, const uint8_t *w, int64_t rows, int64_t in, const int64_t *idx, int64_t n,
                       float *out) {
    if (type < 0 || type >= NTYPES || in % TYPES[type].inputs) return -2;
    for (int64_t r = 0; r < n; r++)
        if (idx[r] < 0 || idx[r] >= rows) return -3;
    int64_t units = in / TYPES[type].inputs, row_bytes = units * TYPES[type].block_bytes;
    for (int64_t r = 0; r < n; r++) TYPES[type].dequant(w + idx[r] * row_bytes, units, out + r * in);
    return 0;
}
