/* GGUF Q4_K weights 16 outputs interleaved (q4kx16), times the 8-bit activation codes per 256 every K-quant kernel
 * takes (kquant.c's ns_kq_quantize: llama.cpp's Q8_K).
 *
 * Why: kquant.c reads Q4_K rows as the file lays them, one output at a time, and a one-row call (decode) spends
 * some 37 cycles a super-block on unpacking scales and on the float part: below the memory's speed on AVX-512
 * (14 GB/s a thread from cache). Interleaving 16 outputs, as q4x8.c does for Q4_0 and llama.cpp's CPU backend for
 * Q4_K, makes each integer instruction serve 16 outputs and each float instruction too.
 *
 * Weights: per group of 16 outputs and super-block of 256 inputs, GROUP_BYTES (148 a row's super-block: the file's
 * 144 and its 12 packed scale bytes unpacked to 16):
 *   codes [2048]: vector v (64 bytes, v < 32) holds at byte 4 l + k output l's input 8 v + k in its low nibble
 *                 and 8 v + 4 + k in its high one (q4pack.h's layout); sub-block j (inputs 32 j ..) is v = 4 j ..;
 *   scales [128]: byte 16 j + l, output l's sub-block j scale (6 bits);
 *   mins [128]:   byte 32 p + 2 l + h, output l's sub-block 2 p + h min (6 bits);
 *   d [16], dmin [16]: the outputs' f16 super-block scales, as the file has them.
 * The arithmetic, an output at a time and the same on every path (AVX-512 VNNI, AVX2, NEON dotprod, plain C):
 * per super-block the exact integers I = sum_j sc_j sum_i q_i x_i and M = sum_j m_j S_j (S_j the activation
 * codes' sum over sub-block j), then y = (y + (d dx) I) - (dmin dx) M, super-block after super-block, each product
 * rounded on its own (no fused multiply-add). An output's bits depend on its row alone: not on the call's other
 * rows, the thread or the instruction set.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include "half.h"

#define QK 256
#define SUMS 16 /* inputs per activation code sum (kquant.c) */
#define OUTS 16
#define CODES 2048
#define SCALES_AT CODES
#define MINS_AT (CODES + 128)
#define D_AT (CODES + 256)
#define DMIN_AT (D_AT + 32)
#define GROUP_BYTES (DMIN_AT + 32) /* 2368 */
#define Q4_K_BYTES 144
#define ROWS 4 /* activation rows a super-block's unpacked codes serve at once */
#define AHEAD 2048 /* bytes a one-row call asks for ahead of the super-block it reads (as q4x8.c) */

typedef void (*ChunkFn)(const void *task, int64_t chunk, int64_t chunks, int32_t slot);
void ns_pool_run(ChunkFn run, const void *task, int64_t chunks, int32_t threads); /* linear.c */
void ns_kq_quantize(const float *x, int64_t rows, int64_t in, int8_t *q, float *d, int16_t *s, int32_t threads);

/* One super-block of 16 outputs against n <= ROWS rows: x the first row's 256 codes (row i at x + i in), dx[i] its
 * scale, s[i] its 8 sub-blocks' code sums; each row's 16 outputs' running sums in acc[i] */

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define ISA "avx512-vnni"
static inline __attribute__((always_inline)) void block_rows(const uint8_t *p, const int8_t *x, int64_t in, int n,
                                                             const float *dx, const int16_t (*s)[8],
                                                             float (*acc)[OUTS]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512i ints[ROWS], mins[ROWS];
    for (int i = 0; i < n; i++) ints[i] = mins[i] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) {
        __m512i q[8];
        for (int v = 0; v < 4; v++) {
            __m512i packed = _mm512_loadu_si512(p + (4 * j + v) * 64);
            q[2 * v] = _mm512_and_si512(packed, low);
            q[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        }
        __m512i scale = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + SCALES_AT + 16 * j)));
        for (int i = 0; i < n; i++) {
            int32_t quads[8];
            memcpy(quads, x + i * in + 32 * j, 32);
            __m512i c = _mm512_setzero_si512();
            for (int k = 0; k < 8; k++) c = _mm512_dpbusd_epi32(c, q[k], _mm512_set1_epi32(quads[k]));
            ints[i] = _mm512_add_epi32(ints[i], _mm512_mullo_epi32(c, scale));
        }
    }
    for (int pair = 0; pair < 4; pair++) { /* lane l: m_2p S_2p + m_2p+1 S_2p+1 in one pair product */
        __m512i m = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + MINS_AT + 32 * pair)));
        for (int i = 0; i < n; i++) {
            uint32_t both = (uint16_t)s[i][2 * pair] | (uint32_t)(uint16_t)s[i][2 * pair + 1] << 16;
            mins[i] = _mm512_dpwssd_epi32(mins[i], m, _mm512_set1_epi32((int32_t)both));
        }
    }
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + D_AT))),
           dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + DMIN_AT)));
    for (int i = 0; i < n; i++) {
        __m512 f = _mm512_set1_ps(dx[i]);
        __m512 a = _mm512_add_ps(_mm512_loadu_ps(acc[i]), _mm512_mul_ps(_mm512_mul_ps(d, f), _mm512_cvtepi32_ps(ints[i])));
        _mm512_storeu_ps(acc[i], _mm512_sub_ps(a, _mm512_mul_ps(_mm512_mul_ps(dmin, f), _mm512_cvtepi32_ps(mins[i]))));
    }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ISA "avx2"
/* Eight outputs (half h) at a time: maddubs' 16-bit pair sums of code times activation, a sub-block's eight added
 * in 16 bits (at most 8 x 2 x 15 x 128 = 30720: exact), then times the scale in a pair product to 32 bits */
static inline __attribute__((always_inline)) void block_rows(const uint8_t *p, const int8_t *x, int64_t in, int n,
                                                             const float *dx, const int16_t (*s)[8],
                                                             float (*acc)[OUTS]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int h = 0; h < 2; h++) {
        __m256i ints[ROWS], mins[ROWS];
        for (int i = 0; i < n; i++) ints[i] = mins[i] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            __m256i q[8];
            for (int v = 0; v < 4; v++) {
                __m256i packed = _mm256_loadu_si256((const __m256i *)(p + (4 * j + v) * 64 + 32 * h));
                q[2 * v] = _mm256_and_si256(packed, low);
                q[2 * v + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
            }
            __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + SCALES_AT + 16 * j + 8 * h)));
            sc = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16)); /* the scale in both halves of a lane */
            for (int i = 0; i < n; i++) {
                __m256i c = _mm256_setzero_si256();
                for (int k = 0; k < 8; k++) {
                    int32_t quad;
                    memcpy(&quad, x + i * in + 32 * j + 4 * k, 4);
                    c = _mm256_add_epi16(c, _mm256_maddubs_epi16(q[k], _mm256_set1_epi32(quad)));
                }
                ints[i] = _mm256_add_epi32(ints[i], _mm256_madd_epi16(c, sc));
            }
        }
        for (int pair = 0; pair < 4; pair++) {
            __m256i m = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + MINS_AT + 32 * pair + 16 * h)));
            for (int i = 0; i < n; i++) {
                uint32_t both = (uint16_t)s[i][2 * pair] | (uint32_t)(uint16_t)s[i][2 * pair + 1] << 16;
                mins[i] = _mm256_add_epi32(mins[i], _mm256_madd_epi16(m, _mm256_set1_epi32((int32_t)both)));
            }
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + D_AT + 16 * h))),
               dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + DMIN_AT + 16 * h)));
        for (int i = 0; i < n; i++) {
            __m256 f = _mm256_set1_ps(dx[i]);
            __m256 a = _mm256_add_ps(_mm256_loadu_ps(acc[i] + 8 * h),
                                     _mm256_mul_ps(_mm256_mul_ps(d, f), _mm256_cvtepi32_ps(ints[i])));
            _mm256_storeu_ps(acc[i] + 8 * h,
                             _mm256_sub_ps(a, _mm256_mul_ps(_mm256_mul_ps(dmin, f), _mm256_cvtepi32_ps(mins[i]))));
        }
    }
}
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#define ISA "neon-dotprod"
/* Four outputs (quarter m) at a time: SDOT of the codes (0..15 as signed bytes) against the activation quads, the
 * scales by multiply-add, the mins as widening products paired */
static inline __attribute__((always_inline)) void block_rows(const uint8_t *p, const int8_t *x, int64_t in, int n,
                                                             const float *dx, const int16_t (*s)[8],
                                                             float (*acc)[OUTS]) {
    const uint8x16_t low = vdupq_n_u8(0x0f);
    for (int m = 0; m < 4; m++) {
        int32x4_t ints[ROWS], mins[ROWS];
        for (int i = 0; i < n; i++) ints[i] = mins[i] = vdupq_n_s32(0);
        for (int j = 0; j < 8; j++) {
            int8x16_t q[8];
            for (int v = 0; v < 4; v++) {
                uint8x16_t raw = vld1q_u8(p + (4 * j + v) * 64 + 16 * m);
                q[2 * v] = vreinterpretq_s8_u8(vandq_u8(raw, low));
                q[2 * v + 1] = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
            }
            uint32_t four;
            memcpy(&four, p + SCALES_AT + 16 * j + 4 * m, 4);
            int32x4_t sc = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8(four)))));
            for (int i = 0; i < n; i++) {
                int32x4_t c = vdupq_n_s32(0);
                for (int k = 0; k < 8; k++) {
                    int32_t quad;
                    memcpy(&quad, x + i * in + 32 * j + 4 * k, 4);
                    c = vdotq_s32(c, q[k], vreinterpretq_s8_s32(vdupq_n_s32(quad)));
                }
                ints[i] = vmlaq_s32(ints[i], c, sc);
            }
        }
        for (int pair = 0; pair < 4; pair++) {
            int16x8_t mm = vreinterpretq_s16_u16(vmovl_u8(vld1_u8(p + MINS_AT + 32 * pair + 8 * m)));
            for (int i = 0; i < n; i++) {
                int16x4_t both = vreinterpret_s16_s32(
                    vdup_n_s32((int32_t)((uint16_t)s[i][2 * pair] | (uint32_t)(uint16_t)s[i][2 * pair + 1] << 16)));
                int32x4_t lo = vmull_s16(vget_low_s16(mm), both), hi = vmull_s16(vget_high_s16(mm), both);
                mins[i] = vaddq_s32(mins[i], vpaddq_s32(lo, hi));
            }
        }
        float32x4_t d = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(p + D_AT) + 4 * m))),
                    dmin = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(p + DMIN_AT) + 4 * m)));
        for (int i = 0; i < n; i++) {
            float32x4_t f = vdupq_n_f32(dx[i]);
            float32x4_t a = vaddq_f32(vld1q_f32(acc[i] + 4 * m), vmulq_f32(vmulq_f32(d, f), vcvtq_f32_s32(ints[i])));
            vst1q_f32(acc[i] + 4 * m, vsubq_f32(a, vmulq_f32(vmulq_f32(dmin, f), vcvtq_f32_s32(mins[i]))));
        }
    }
}
#else
#define ISA "portable"
static inline void block_rows(const uint8_t *p, const int8_t *x, int64_t in, int n, const float *dx,
                              const int16_t (*s)[8], float (*acc)[OUTS]) {
    for (int l = 0; l < OUTS; l++) {
        float d = half_at(p + D_AT + 2 * l), dmin = half_at(p + DMIN_AT + 2 * l);
        for (int i = 0; i < n; i++) {
            const int8_t *row = x + i * in;
            int32_t ints = 0, mins = 0;
            for (int j = 0; j < 8; j++) {
                int32_t c = 0;
                for (int v = 4 * j; v < 4 * j + 4; v++)
                    for (int k = 0; k < 4; k++) {
                        uint8_t byte = p[v * 64 + 4 * l + k];
                        c += (byte & 0x0f) * row[8 * v + k] + (byte >> 4) * row[8 * v + 4 + k];
                    }
                ints += c * p[SCALES_AT + 16 * j + l];
                mins += p[MINS_AT + 32 * (j / 2) + 2 * l + j % 2] * s[i][j];
            }
            float a = acc[i][l] + (d * dx[i]) * (float)ints;
            acc[i][l] = a - (dmin * dx[i]) * (float)mins;
        }
    }
}
#endif

const char *ns_q4kx16_isa(void) { return ISA; }

/* ---- packing -------------------------------------------------------------------------------------------- */

int64_t ns_q4kx16_packed_bytes(int64_t out, int64_t in) { return (out / OUTS) * (in / QK) * GROUP_BYTES; }

/* Q4_K's 12 scale bytes -> 8 scales, 8 mins (gguf's get_scale_min), and back: the 96 bits either way */
static void scales_unpack(const uint8_t *s, uint8_t sc[8], uint8_t m[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63, m[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 15) | (s[j] >> 6) << 4);
        m[j + 4] = (uint8_t)((s[j + 8] >> 4) | (s[j + 4] >> 6) << 4);
    }
}

static void scales_pack(const uint8_t sc[8], const uint8_t m[8], uint8_t *s) {
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)(sc[j] | (sc[j + 4] >> 4) << 6);
        s[j + 4] = (uint8_t)(m[j] | (m[j + 4] >> 4) << 6);
        s[j + 8] = (uint8_t)((sc[j + 4] & 15) | (m[j + 4] & 15) << 4);
    }
}

/* The nibble of input e (< 256) in a Q4_K block's qs: 64 t + i in qs[32 t + i]'s low nibble, 64 t + 32 + i in its
 * high one */
static inline int code_of(const uint8_t *qs, int e) {
    int byte = qs[32 * (e / 64) + e % 32];
    return (e / 32) % 2 ? byte >> 4 : byte & 15;
}

/* One file block (output l of the group) into the group's super-block p, and back */
static void block_in(const uint8_t *block, uint8_t *p, int l) {
    const uint8_t *qs = block + 16;
    uint8_t sc[8], m[8];
    for (int v = 0; v < 32; v++)
        for (int k = 0; k < 4; k++)
            p[v * 64 + 4 * l + k] = (uint8_t)(code_of(qs, 8 * v + k) | code_of(qs, 8 * v + 4 + k) << 4);
    scales_unpack(block + 4, sc, m);
    for (int j = 0; j < 8; j++) p[SCALES_AT + 16 * j + l] = sc[j], p[MINS_AT + 32 * (j / 2) + 2 * l + j % 2] = m[j];
    memcpy(p + D_AT + 2 * l, block, 2);
    memcpy(p + DMIN_AT + 2 * l, block + 2, 2);
}

static void block_out(const uint8_t *p, int l, uint8_t *block) {
    uint8_t sc[8], m[8], *qs = block + 16;
    memset(qs, 0, 128);
    for (int v = 0; v < 32; v++)
        for (int k = 0; k < 4; k++)
            for (int half = 0; half < 2; half++) {
                int e = 8 * v + 4 * half + k, code = (p[v * 64 + 4 * l + k] >> (4 * half)) & 15;
                qs[32 * (e / 64) + e % 32] |= (uint8_t)(code << ((e / 32) % 2 ? 4 : 0));
            }
    for (int j = 0; j < 8; j++) sc[j] = p[SCALES_AT + 16 * j + l], m[j] = p[MINS_AT + 32 * (j / 2) + 2 * l + j % 2];
    scales_pack(sc, m, block + 4);
    memcpy(block, p + D_AT + 2 * l, 2);
    memcpy(block + 2, p + DMIN_AT + 2 * l, 2);
}

typedef struct {
    const uint8_t *raw;
    uint8_t *packed;
    int64_t out, in;
    int to_file; /* 0: the file's rows into packed; 1: packed back into the file's rows */
} Pack;

static void pack_chunk(const void *task, int64_t chunk, int64_t chunks, int32_t slot) {
    const Pack *t = task;
    int64_t blocks = t->in / QK, groups = t->out / OUTS;
    (void)slot;
    for (int64_t g = groups * chunk / chunks; g < groups * (chunk + 1) / chunks; g++)
        for (int64_t b = 0; b < blocks; b++)
            for (int l = 0; l < OUTS; l++) {
                uint8_t *p = t->packed + (g * blocks + b) * GROUP_BYTES;
                const uint8_t *block = t->raw + ((g * OUTS + l) * blocks + b) * Q4_K_BYTES;
                if (t->to_file)
                    block_out(p, l, (uint8_t *)block);
                else
                    block_in(block, p, l);
            }
}

static void pack_run(Pack *task, int32_t threads) {
    threads = threads < 1 ? 1 : threads;
    int64_t chunks = (int64_t)threads * 4, groups = task->out / OUTS;
    if (chunks > groups) chunks = groups > 0 ? groups : 1;
    ns_pool_run(pack_chunk, task, chunks, threads);
}

/* A Q4_K file's rows raw [out (in 16s), in / 256 blocks of 144 bytes] -> dst (ns_q4kx16_packed_bytes) */
void ns_q4kx16_pack(const uint8_t *raw, int64_t out, int64_t in, uint8_t *dst, int32_t threads) {
    Pack task = {raw, dst, out, in, 0};
    pack_run(&task, threads);
}

/* The packed weight back into the file's rows raw (the inverse of ns_q4kx16_pack, bit for bit) */
void ns_q4kx16_unpack(const uint8_t *packed, int64_t out, int64_t in, uint8_t *raw, int32_t threads) {
    Pack task = {raw, (uint8_t *)packed, out, in, 1};
    pack_run(&task, threads);
}

/* ---- the call ------------------------------------------------------------------------------------------- */

typedef struct {
    const uint8_t *w;
    const int8_t *q;
    const float *d, *bias;
    const int16_t *s;
    int64_t in, out, rows, ldy;
    float *y;
    int accumulate;
} Q4Kx16;

/* Rows [r, r + n) against output group g: the super-blocks in order, so each output's float part runs as on one
 * row alone */
static inline __attribute__((always_inline)) void group_pass(const Q4Kx16 *m, int64_t g, int64_t r, int n) {
    int64_t blocks = m->in / QK;
    const uint8_t *wg = m->w + g * blocks * GROUP_BYTES;
    float acc[ROWS][OUTS] = {{0.0f}}, dx[ROWS];
    int16_t s[ROWS][8];
    for (int64_t b = 0; b < blocks; b++) {
        if (m->rows == 1) /* one row (decode): ask AHEAD */
            for (int64_t at = 0; at < GROUP_BYTES; at += 64) __builtin_prefetch(wg + b * GROUP_BYTES + AHEAD + at);
        for (int i = 0; i < n; i++) {
            const int16_t *sums = m->s + (r + i) * (m->in / SUMS) + b * (QK / SUMS);
            dx[i] = m->d[(r + i) * blocks + b];
            for (int j = 0; j < 8; j++) s[i][j] = (int16_t)(sums[2 * j] + sums[2 * j + 1]);
        }
        block_rows(wg + b * GROUP_BYTES, m->q + r * m->in + b * QK, m->in, n, dx, (const int16_t(*)[8])s, acc);
    }
    for (int i = 0; i < n; i++)
        for (int l = 0; l < OUTS; l++) {
            float v = m->bias ? acc[i][l] + m->bias[g * OUTS + l] : acc[i][l];
            float *at = m->y + (r + i) * m->ldy + g * OUTS + l;
            *at = m->accumulate ? *at + v : v;
        }
}

static void q4kx16_chunk(const void *task, int64_t chunk, int64_t chunks, int32_t slot) {
    const Q4Kx16 *m = task;
    int64_t groups = m->out / OUTS, group_bytes = m->in / QK * GROUP_BYTES;
    (void)slot;
    for (int64_t g = groups * chunk / chunks; g < groups * (chunk + 1) / chunks; g++) {
        if (m->rows > 1 && g + 1 < groups * (chunk + 1) / chunks) /* the first rows read this group from memory */
            for (int64_t at = 0; at < group_bytes; at += 64) __builtin_prefetch(m->w + (g + 1) * group_bytes + at);
        if (m->rows == 1) {
            group_pass(m, g, 0, 1);
            continue;
        }
        for (int64_t r = 0; r < m->rows; r += ROWS) {
            if (m->rows - r >= ROWS)
                group_pass(m, g, r, ROWS);
            else
                group_pass(m, g, r, (int)(m->rows - r));
        }
    }
}

/* y [rows, out] (a row every `ldy` floats) = x [rows, in] float32 . W^T (+ bias; added to y with `accumulate`), W
 * packed by ns_q4kx16_pack (out in 16s, in in 256s); on up to `threads` threads. Returns 0, -1 out of memory, -2
 * for a shape it does not take. */
int ns_q4kx16_matmul(const uint8_t *w, const float *x, int64_t rows, int64_t in, int64_t out, int64_t ldy,
                     const float *bias, float *y, int32_t threads, int32_t accumulate) {
    if (in % QK || out % OUTS || ldy < out) return -2;
    int8_t *q = malloc((size_t)(rows * in));
    float *d = malloc((size_t)(rows * (in / QK)) * sizeof(float));
    int16_t *s = malloc((size_t)(rows * (in / SUMS)) * sizeof(int16_t));
    if (!q || !d || !s) {
        free(q), free(d), free(s);
        return -1;
    }
    threads = threads < 1 ? 1 : threads;
    ns_kq_quantize(x, rows, in, q, d, s, threads);
    Q4Kx16 task = {w, q, d, bias, s, in, out, rows, ldy, y, accumulate};
    int64_t chunks = (int64_t)threads * 4, groups = out / OUTS;
    if (chunks > groups) chunks = groups > 0 ? groups : 1;
    ns_pool_run(q4kx16_chunk, &task, chunks, threads);
    free(q), free(d), free(s);
    return 0;
}
