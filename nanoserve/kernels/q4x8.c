/* GGUF Q4_0 weights times 8-bit activations: q4x8, the activation format llama.cpp multiplies Q4_0 by.
 *
 * Weights: a Q4_0 file's blocks repacked 16 outputs a group of 32 inputs as linear.c's q4x16 lays its codes out,
 * then the 16 outputs' f16 scales s as the file has them (w = (q - 8) s; no zeros: 288 bytes a group, the file's
 * 4.5 bits a weight). Activations: each row's group of 32 to 8-bit codes v = round(x 127 / max |x|) (to nearest
 * even) with one scale d = max |x| / 127 and the codes' sum. A group's product is the exact integer
 * c = sum (q - 8) v, half the integer work of q4x16's 16-bit codes (one 8-bit plane, not two), and the float part
 * y += s (d c) group by group in order, on every path (AVX-512 VNNI, AVX2, plain C). So an output's bits depend on
 * its row alone: not on the call's other rows, the thread or the instruction set.
 *
 * Used for Q4_0 files only: the default model's Q4_1 weights keep q4x16 (8-bit codes flipped near-ties of its
 * greedy text there). No tile (AMX) path: a call of any size runs the vector path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include "half.h"
#include "q4pack.h"

#define GROUP 32
#define OUTS 16                                       /* outputs packed together (linear.c) */
#define GROUP_BYTES (OUTS * GROUP / 2 + OUTS * 2)     /* nibbles, then 16 f16 scales: 288 */
#define Q4_0_BYTES 18                                 /* a file's block: f16 d, 16 bytes of nibbles */
#define ROWS 4                                        /* activation rows a group's unpacked codes serve at once */
#define QUANTIZE_POOLED_FROM 16
/* an activation quad read straight into every lane: a broadcast load, not a general register's move into a vector
 * (kx16_avx512.h's quad_at) */
typedef int32_t ns_i32_unaligned __attribute__((aligned(1), may_alias));

typedef void (*ChunkFn)(const void *task, int64_t chunk, int64_t chunks, int32_t slot);
void ns_pool_run(ChunkFn run, const void *task, int64_t chunks, int32_t threads); /* linear.c */

/* ---- activations ---------------------------------------------------------------------------------------- */

/* x [in] -> codes [in], scales d [in / 32], code sums [in / 32] */
static void quantize_row(const float *x, int64_t in, int8_t *codes, float *d, int32_t *sums) {
    for (int64_t b = 0; b < in / GROUP; b++) {
        const float *v = x + b * GROUP;
        float top = 0.0f;
        for (int i = 0; i < GROUP; i++) {
            float a = fabsf(v[i]);
            top = a > top ? a : top;
        }
        float inv = top > 0.0f ? 127.0f / top : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < GROUP; i++) {
            float t = (v[i] * inv + 12582912.0f) - 12582912.0f; /* to nearest even */
            codes[b * GROUP + i] = (int8_t)(t > 127.0f ? 127.0f : t);
            sum += codes[b * GROUP + i];
        }
        d[b] = top / 127.0f;
        sums[b] = sum;
    }
}

typedef struct {
    const float *x;
    int64_t in, rows;
    int8_t *codes;
    float *d;
    int32_t *sums;
} Quantize;

static void quantize_chunk(const void *task, int64_t chunk, int64_t chunks, int32_t slot) {
    const Quantize *q = task;
    int64_t groups = q->in / GROUP, r0 = q->rows * chunk / chunks, r1 = q->rows * (chunk + 1) / chunks;
    (void)slot;
    for (int64_t r = r0; r < r1; r++)
        quantize_row(q->x + r * q->in, q->in, q->codes + r * q->in, q->d + r * groups, q->sums + r * groups);
}

/* ---- one group of 16 outputs against up to ROWS rows -----------------------------------------------------
 * The packing: vector v (64 bytes) holds, for output l, bytes 4 l .. 4 l + 3: inputs 8 v + k in their low
 * nibbles and 8 v + 4 + k in their high ones. x: the first row's codes of this group, row i's at x + i in. */

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define ISA "avx512-vnni"
/* Every block of one output group against up to 4 rows, each row's sums held in a register across the blocks
 * (against keeping them in memory, a load and a store a row a block: 1.07-1.09x at 1-64 rows); each row's
 * operations are the other paths' group_rows, in the same order, so the same bits. d and sums: the rows'
 * per-block values, a row every `groups`. */
#define TILE_BLOCKS 1
static void tile_blocks(const uint8_t *wg, const int8_t *x, int64_t in, int64_t groups, int n, const float *d,
                        const int32_t *sums, int ahead, float (*out)[OUTS]) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t b = 0; b < groups; b++) {
        const uint8_t *p = wg + b * GROUP_BYTES;
        if (ahead)
            for (int64_t at = 0; at < GROUP_BYTES; at += 64) __builtin_prefetch(p + ahead + at);
        __m512i nib[8];
        q4_unpack_avx512(p, nib);
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256)));
        const int8_t *xb = x + b * GROUP;
#define ROW_TERM(i, a)                                                                                              \
    {                                                                                                               \
        __m512i c = _mm512_set1_epi32(-8 * sums[(i) * groups + b]);                                                  \
        for (int j = 0; j < 8; j++)                                                                                 \
            c = _mm512_dpbusd_epi32(c, nib[j], _mm512_set1_epi32(*(const ns_i32_unaligned *)(xb + (i) * in + 4 * j))); \
        a = _mm512_add_ps(a, _mm512_mul_ps(scale, _mm512_mul_ps(_mm512_set1_ps(d[(i) * groups + b]),             \
                                                                _mm512_cvtepi32_ps(c))));                           \
    }
        ROW_TERM(0, a0)
        if (n > 1) ROW_TERM(1, a1)
        if (n > 2) ROW_TERM(2, a2)
        if (n > 3) ROW_TERM(3, a3)
#undef ROW_TERM
    }
    _mm512_storeu_ps(out[0], a0);
    if (n > 1) _mm512_storeu_ps(out[1], a1);
    if (n > 2) _mm512_storeu_ps(out[2], a2);
    if (n > 3) _mm512_storeu_ps(out[3], a3);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ISA "avx2"
/* Eight outputs (half h of the group) at a time: the codes (0..15) unsigned against the activation codes in
 * maddubs' 16-bit pair sums, eight quads of them added in 16 bits (at most 8 x 2 x 15 x 127 = 30480: exact), then
 * the pairs summed to 32 bits */
static void group_rows(const uint8_t *p, const int8_t *x, int64_t in, int n, const float *d, const int32_t *sums,
                       float (*acc)[OUTS]) {
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        __m256i q[8];
        for (int v = 0; v < 4; v++) {
            __m256i packed = _mm256_loadu_si256((const __m256i *)(p + v * 64 + h * 32));
            q[2 * v] = _mm256_and_si256(packed, low);
            q[2 * v + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        }
        __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 256 + 16 * h)));
        for (int i = 0; i < n; i++) {
            __m256i s = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++)
                s = _mm256_add_epi16(s, _mm256_maddubs_epi16(q[j], _mm256_set1_epi32(*(const ns_i32_unaligned *)(x + i * in + 4 * j))));
            __m256i c = _mm256_sub_epi32(_mm256_madd_epi16(s, ones), _mm256_set1_epi32(8 * sums[i]));
            __m256 t = _mm256_mul_ps(scale, _mm256_mul_ps(_mm256_set1_ps(d[i]), _mm256_cvtepi32_ps(c)));
            _mm256_storeu_ps(acc[i] + 8 * h, _mm256_add_ps(_mm256_loadu_ps(acc[i] + 8 * h), t));
        }
    }
}
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#define ISA "neon-dotprod"
/* Four outputs at a time, a 16-byte slice of each vector (outputs 4 m .. 4 m + 3): its low nibbles against inputs
 * 8 v .. 8 v + 3, its high ones against 8 v + 4 .. 8 v + 7, by SDOT (the codes 0..15 as signed bytes), then the
 * plain build's float operations, four outputs a register */
static void group_rows(const uint8_t *p, const int8_t *x, int64_t in, int n, const float *d, const int32_t *sums,
                       float (*acc)[OUTS]) {
    const uint8x16_t low = vdupq_n_u8(0x0f);
    for (int m = 0; m < 4; m++) {
        int8x16_t q[8];
        for (int v = 0; v < 4; v++) {
            uint8x16_t raw = vld1q_u8(p + v * 64 + 16 * m);
            q[2 * v] = vreinterpretq_s8_u8(vandq_u8(raw, low));
            q[2 * v + 1] = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
        }
        float32x4_t scale = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(p + 256) + 4 * m)));
        for (int i = 0; i < n; i++) {
            int32x4_t c = vdupq_n_s32(-8 * sums[i]);
            for (int j = 0; j < 8; j++) {
                int32_t quad;
                memcpy(&quad, x + i * in + 4 * j, 4);
                c = vdotq_s32(c, q[j], vreinterpretq_s8_s32(vdupq_n_s32(quad)));
            }
            float32x4_t t = vmulq_f32(scale, vmulq_f32(vdupq_n_f32(d[i]), vcvtq_f32_s32(c)));
            vst1q_f32(acc[i] + 4 * m, vaddq_f32(vld1q_f32(acc[i] + 4 * m), t));
        }
    }
}
#else
#define ISA "portable"
static void group_rows(const uint8_t *p, const int8_t *x, int64_t in, int n, const float *d, const int32_t *sums,
                       float (*acc)[OUTS]) {
    uint16_t halves[OUTS];
    memcpy(halves, p + 256, sizeof halves);
    for (int i = 0; i < n; i++) {
        const int8_t *row = x + i * in;
        for (int l = 0; l < OUTS; l++) {
            int32_t c = -8 * sums[i];
            for (int v = 0; v < 4; v++)
                for (int k = 0; k < 4; k++) {
                    uint8_t byte = p[v * 64 + l * 4 + k];
                    c += (byte & 0x0f) * row[8 * v + k] + (byte >> 4) * row[8 * v + 4 + k];
                }
            acc[i][l] = acc[i][l] + f16_to_f32(halves[l]) * (d[i] * (float)c);
        }
    }
}
#endif

const char *ns_q4x8_isa(void) { return ISA; }

/* ---- packing -------------------------------------------------------------------------------------------- */

int64_t ns_q4x8_packed_bytes(int64_t out, int64_t in) { return (out / OUTS) * (in / GROUP) * GROUP_BYTES; }

typedef struct {
    const uint8_t *raw;
    int64_t out, in;
    uint8_t *dst;
} Pack;

/* Output groups of a chunk: per group of 32 inputs, the 16 blocks' codes (q4_interleave), then their d, the f16
 * bits as they are */
static void pack_chunk(const void *task, int64_t chunk, int64_t chunks, int32_t slot) {
    const Pack *t = task;
    int64_t groups = t->in / GROUP, all = t->out / OUTS;
    (void)slot;
    for (int64_t g = all * chunk / chunks; g < all * (chunk + 1) / chunks; g++)
        for (int64_t b = 0; b < groups; b++) {
            uint8_t *p = t->dst + (g * groups + b) * GROUP_BYTES;
            for (int l = 0; l < OUTS; l++) {
                const uint8_t *block = t->raw + ((g * OUTS + l) * groups + b) * Q4_0_BYTES;
                q4_interleave(block + 2, p, l);
                memcpy(p + 4 * 64 + 2 * l, block, 2);
            }
        }
}

/* A Q4_0 file's rows raw [out, in / 32 blocks of 18 bytes] -> dst (ns_q4x8_packed_bytes), on the thread pool */
void ns_q4x8_pack_gguf(const uint8_t *raw, int64_t out, int64_t in, uint8_t *dst, int32_t threads) {
    Pack task = {raw, out, in, dst};
    threads = threads < 1 ? 1 : threads;
    int64_t chunks = (int64_t)threads * 4;
    if (chunks > out / OUTS) chunks = out / OUTS > 0 ? out / OUTS : 1;
    ns_pool_run(pack_chunk, &task, chunks, threads);
}

/* ---- the call ------------------------------------------------------------------------------------------- */

typedef struct {
    const uint8_t *w;
    const int8_t *codes;
    const float *d, *bias;
    const int32_t *sums;
    int64_t in, out, rows;
    float *y;
    int accumulate;
} Q4x8;

/* bytes the first rows of a call ask for ahead of the block they read: a one-row call AHEAD (1B Q4_0 decode
 * 1.08x, 6 interleaved runs; 8 rows: a step's linears 42 ms against 52 asking the whole next group at a group's
 * start), a call of several rows, whose work on a block outlasts its bytes' trip from memory, AHEAD_ROWS (Zen 5,
 * from memory, 8 rows 1.38x, 32 rows 1.11x against AHEAD; 16 KiB no better; scripts/kernel-ab.py --stream) */
#define AHEAD 2048
#define AHEAD_ROWS 8192

/* Output groups [g0, g1) for every row, ROWS rows against each group's codes unpacked once; the groups of 32
 * inputs in order, so each output's float part runs as on one row alone */
static void q4x8_chunk(const void *task, int64_t chunk, int64_t chunks, int32_t slot) {
    const Q4x8 *m = task;
    int64_t groups = m->in / GROUP, total = m->out / OUTS;
    int64_t g0 = total * chunk / chunks, g1 = total * (chunk + 1) / chunks, group_bytes = groups * GROUP_BYTES;
    (void)slot;
    int ahead = m->rows == 1 ? AHEAD : AHEAD_ROWS;
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *wg = m->w + g * group_bytes;
        for (int64_t r = 0; r < m->rows; r += ROWS) {
            int n = m->rows - r < ROWS ? (int)(m->rows - r) : ROWS;
            float acc[ROWS][OUTS] = {{0.0f}};
#ifdef TILE_BLOCKS
            tile_blocks(wg, m->codes + r * m->in, m->in, groups, n, m->d + r * groups, m->sums + r * groups,
                        r == 0 ? ahead : 0, acc);
#else
            float d[ROWS];
            int32_t sums[ROWS];
            for (int64_t b = 0; b < groups; b++) {
                if (r == 0) /* the first rows read the group from memory: ask ahead, as kquant.c's one-row dots do */
                    for (int64_t at = 0; at < GROUP_BYTES; at += 64) __builtin_prefetch(wg + b * GROUP_BYTES + ahead + at);
                for (int i = 0; i < n; i++) d[i] = m->d[(r + i) * groups + b], sums[i] = m->sums[(r + i) * groups + b];
                group_rows(wg + b * GROUP_BYTES, m->codes + r * m->in + b * GROUP, m->in, n, d, sums, acc);
            }
#endif
            for (int i = 0; i < n; i++)
                for (int l = 0; l < OUTS; l++) {
                    float v = m->bias ? acc[i][l] + m->bias[g * OUTS + l] : acc[i][l];
                    float *at = m->y + (r + i) * m->out + g * OUTS + l;
                    *at = m->accumulate ? *at + v : v;
                }
        }
    }
}

/* y [rows, out] float32 = x [rows, in] float32 . W^T (+ bias; added to y with `accumulate`), W packed by
 * ns_q4x8_pack_gguf (out in 16s, in in 32s); on up to `threads` threads. Returns 0, -1 out of memory. */
int ns_q4x8_matmul(const uint8_t *w, const float *x, int64_t rows, int64_t in, int64_t out, const float *bias,
                   float *y, int32_t threads, int32_t accumulate) {
    int64_t groups = in / GROUP;
    int8_t *codes = malloc((size_t)(rows * in));
    float *d = malloc((size_t)(rows * groups) * sizeof(float));
    int32_t *sums = malloc((size_t)(rows * groups) * sizeof(int32_t));
    if (!codes || !d || !sums) {
        free(codes), free(d), free(sums);
        return -1;
    }
    threads = threads < 1 ? 1 : threads;
    Quantize q = {x, in, rows, codes, d, sums};
    if (rows >= QUANTIZE_POOLED_FROM)
        ns_pool_run(quantize_chunk, &q, threads, threads);
    else
        quantize_chunk(&q, 0, 1, 0);
    Q4x8 task = {w, codes, d, bias, sums, in, out, rows, y, accumulate};
    int64_t chunks = (int64_t)threads * 4, out_groups = out / OUTS;
    if (chunks > out_groups) chunks = out_groups > 0 ? out_groups : 1;
    ns_pool_run(q4x8_chunk, &task, chunks, threads);
    free(codes), free(d), free(sums);
    return 0;
}
