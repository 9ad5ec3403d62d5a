/* GGUF Q4_K, Q5_K and Q6_K weights 16 outputs interleaved (kx16), times the 8-bit activation codes per 256 every K-quant
 * kernel takes (kquant.c's ns_kq_quantize: llama.cpp's Q8_K).
 *
 * Why: kquant.c reads these rows as the file lays them, one output at a time, and a one-row call (decode) spends
 * some 37 cycles a super-block unpacking scales and on the float part: below the memory's speed (Q4_K 14 GB/s, Q6_K
 * 20 a thread from cache on AVX-512). Interleaving 16 outputs, as q4x8.c does for Q4_0 and llama.cpp's CPU backend
 * for these types, makes each integer instruction and each float instruction serve 16 outputs.
 *
 * Layouts, per group of 16 outputs and super-block of 256 inputs (the file's bytes, its 12 packed Q4_K scale bytes
 * unpacked to 16; a group's super-blocks in order, then the next group):
 *   Q4_K (148 bytes an output): codes [2048]: vector v (64 bytes, v < 32) holds at byte 4 l + k output l's input
 *        8 v + k in its low nibble and 8 v + 4 + k in its high one (q4pack.h's layout); scales [128]: byte 16 j + l,
 *        output l's sub-block j scale; mins [128]: byte 32 p + 2 l + h, output l's sub-block 2 p + h min; d [16],
 *        dmin [16]: the f16 super-block scales as the file has them.
 *   Q5_K (180 bytes an output): Q4_K's, with after the codes the fifth bits [512]: vector j (sub-block j) holds at
 *        byte 4 l + k output l's input 32 j + 4 t + k's fifth bit at bit t.
 *   Q6_K (210 bytes an output, as the file): codes [3072]: inputs 16 u .. 16 u + 15 (u < 16) in 192 bytes, two
 *        vectors of their low 4 bits as Q4_K's codes, then one holding at byte 4 l + k the top 2 bits of output l's
 *        inputs 16 u + 4 t + k at bits 2 t (in read order: the three regions apart streamed Q6_K 2048x8192 from
 *        memory at 0.86x); scales [256]: byte 32 p + 2 l + h, output l's scale of inputs 16 (2 p + h) ..; d [16].
 * The arithmetic, an output at a time and the same on every path (AVX-512 VNNI, AVX2, NEON dotprod, plain C), with
 * x the activation codes, dx their super-block's scale and S their sums (per sub-block):
 *   Q4_K, Q5_K  I = sum_j sc_j sum_i q_i x_i, M = sum_j m_j S_j    y = (y + (d dx) I) - (dmin dx) M
 *   Q6_K  I = sum_u sc_u sum_i q_i x_i - 32 sum_u sc_u S_u          y = y + (d dx) I
 * super-block after super-block, the integers exact, each product rounded on its own (no fused multiply-add). An
 * output's bits depend on its row alone: not on the call's other rows, the thread or the instruction set.
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
#define ROWS 4     /* activation rows a super-block's unpacked codes serve at once */
#define ROWS_AHEAD 3 /* super-blocks a call of several rows asks for ahead of the one it works on (group_pass) */
#define INLINE inline __attribute__((always_inline))

/* Q4_K (five 0) and Q5_K (five 1: the codes' fifth bits after the codes) */
#define K5_HIGH 2048
#define K4_SCALES(five) (2048 + (five) * 512)
#define K4_MINS(five) (K4_SCALES(five) + 128)
#define K4_D(five) (K4_MINS(five) + 128)
#define K4_DMIN(five) (K4_D(five) + 32)
#define K4_GROUP(five) (K4_DMIN(five) + 32) /* 2368, 2880 */
#define K6_LO(v) ((v) / 2 * 192 + (v) % 2 * 64) /* Q6_K's codes in order: inputs 16 u .. as low, low, high */
#define K6_HI(u) ((u) * 192 + 128)
#define K6_SCALES 3072
#define K6_D (K6_SCALES + 256)
#define K6_GROUP (K6_D + 32) /* 3360 */

typedef void (*ChunkFn)(const void *task, int64_t chunk, int64_t chunks, int32_t slot);
void ns_pool_run(ChunkFn run, const void *task, int64_t chunks, int32_t threads); /* linear.c */
void ns_kq_quantize(const float *x, int64_t rows, int64_t in, int8_t *q, float *d, int16_t *s, int32_t threads);
int32_t ns_kq_types(void);
const char *ns_kq_name(int32_t type);
int ns_kq_dequant_rows(int32_t type, const uint8_t *w, int64_t rows, int64_t in, const int64_t *idx, int64_t n,
                       float *out);

/* Q6_K code of output l's input e in a group's super-block p (the plain build's reading, and the unpacking's) */
static inline int q6_code(const uint8_t *p, int l, int e) {
    int v = e / 8, k = e % 8, u = e / 16, t = (e % 16) / 4;
    int low = (p[K6_LO(v) + 4 * l + k % 4] >> (k < 4 ? 0 : 4)) & 15;
    return low | ((p[K6_HI(u) + 4 * l + e % 4] >> (2 * t)) & 3) << 4;
}

/* Each build's k45_rows (Q4_K, and Q5_K with `five`) and q6k_rows: one super-block p of a group against n <= ROWS rows, x the first row's 256
 * codes (row i at x + i in), dx[i] its scale, s[i] its 16 code sums; each row's 16 outputs' sums in acc[i] */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "kx16_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "kx16_avx2.h"
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#include "kx16_neon.h"
#else
#include "kx16_plainc.h"
#endif

const char *ns_kx16_isa(void) { return KX_ISA; }

/* ---- packing: a file block (output l of a group) into the group's super-block p, and back ------------------ */

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

/* Eight codes' vector bytes (4-bit layout: k low, k + 4 high) from eight file nibbles at src, their low (nibble 0)
 * or high halves, four bytes at a time */
static inline uint32_t nibbles8(const uint8_t *src, int nibble) {
    uint32_t w0, w1;
    memcpy(&w0, src, 4), memcpy(&w1, src + 4, 4);
    return nibble ? ((w0 >> 4) & 0x0f0f0f0fu) | (w1 & 0xf0f0f0f0u) : (w0 & 0x0f0f0f0fu) | (w1 & 0x0f0f0f0fu) << 4;
}

/* Q4_K's qs (Q5_K's after its 32 bytes qh): input 64 t + i in qs[32 t + i]'s low nibble, 64 t + 32 + i in its high
 * one (i < 32); Q5_K's fifth bit of input 32 j + i is bit j of qh[i] */
static void k45_in(const uint8_t *block, uint8_t *p, int l, int five) {
    uint8_t sc[8], m[8];
    const uint8_t *qs = block + (five ? 48 : 16);
    for (int v = 0; v < 32; v++) {
        int e = 8 * v;
        uint32_t w = nibbles8(qs + 32 * (e / 64) + e % 32, (e / 32) % 2);
        memcpy(p + v * 64 + 4 * l, &w, 4);
    }
    for (int j = 0; five && j < 8; j++) { /* byte 4 l + k of sub-block j: input 32 j + 4 t + k's fifth bit at bit t */
        uint32_t w = 0;
        for (int t = 0; t < 8; t++) {
            uint32_t bits;
            memcpy(&bits, block + 16 + 4 * t, 4);
            w |= ((bits >> j) & 0x01010101u) << t;
        }
        memcpy(p + K5_HIGH + 64 * j + 4 * l, &w, 4);
    }
    scales_unpack(block + 4, sc, m);
    for (int j = 0; j < 8; j++)
        p[K4_SCALES(five) + 16 * j + l] = sc[j], p[K4_MINS(five) + 32 * (j / 2) + 2 * l + j % 2] = m[j];
    memcpy(p + K4_D(five) + 2 * l, block, 2);
    memcpy(p + K4_DMIN(five) + 2 * l, block + 2, 2);
}

static void q4k_in(const uint8_t *block, uint8_t *p, int l) { k45_in(block, p, l, 0); }
static void q5k_in(const uint8_t *block, uint8_t *p, int l) { k45_in(block, p, l, 1); }

static void k45_out(const uint8_t *p, int l, uint8_t *block, int five) {
    uint8_t sc[8], m[8], *qs = block + (five ? 48 : 16);
    memset(block + 16, 0, five ? 160 : 128);
    for (int e = 0; e < QK; e++) {
        int code = (p[(e / 8) * 64 + 4 * l + e % 4] >> (e % 8 < 4 ? 0 : 4)) & 15;
        qs[32 * (e / 64) + e % 32] |= (uint8_t)(code << ((e / 32) % 2 ? 4 : 0));
        if (five) /* bit t = (e % 32) / 4 of byte 4 l + e % 4 of sub-block e / 32 -> bit e / 32 of qh[e % 32] */
            block[16 + e % 32] |= (uint8_t)(((p[K5_HIGH + 64 * (e / 32) + 4 * l + e % 4] >> ((e % 32) / 4)) & 1) << (e / 32));
    }
    for (int j = 0; j < 8; j++)
        sc[j] = p[K4_SCALES(five) + 16 * j + l], m[j] = p[K4_MINS(five) + 32 * (j / 2) + 2 * l + j % 2];
    scales_pack(sc, m, block + 4);
    memcpy(block, p + K4_D(five) + 2 * l, 2);
    memcpy(block + 2, p + K4_DMIN(five) + 2 * l, 2);
}

static void q4k_out(const uint8_t *p, int l, uint8_t *block) { k45_out(p, l, block, 0); }
static void q5k_out(const uint8_t *p, int l, uint8_t *block) { k45_out(p, l, block, 1); }

/* The file's Q6_K block: ql[128], qh[64], scales[16], d; input 128 h + r (s = r / 64, i = r % 64, t = r / 32):
 * nibble s of ql[64 h + i], and bits 2 t of qh[32 h + r % 32] as bits 4-5 (kquant.c) */
static void q6k_in(const uint8_t *block, uint8_t *p, int l) {
    for (int v = 0; v < 32; v++) { /* inputs 8 v .. 8 v + 7: one run of ql, one nibble */
        int h = v / 16, r = (8 * v) % 128;
        uint32_t w = nibbles8(block + 64 * h + r % 64, r / 64);
        memcpy(p + K6_LO(v) + 4 * l, &w, 4);
    }
    for (int u = 0; u < 16; u++) { /* inputs 16 u .. 16 u + 15: one run of qh at one shift */
        int h = u / 8, r = (16 * u) % 128, shift = 2 * (r / 32);
        uint32_t w = 0;
        for (int t = 0; t < 4; t++) {
            uint32_t bits;
            memcpy(&bits, block + 128 + 32 * h + r % 32 + 4 * t, 4);
            w |= ((bits >> shift) & 0x03030303u) << (2 * t);
        }
        memcpy(p + K6_HI(u) + 4 * l, &w, 4);
        p[K6_SCALES + 32 * (u / 2) + 2 * l + u % 2] = block[192 + u];
    }
    memcpy(p + K6_D + 2 * l, block + 208, 2);
}

static void q6k_out(const uint8_t *p, int l, uint8_t *block) {
    memset(block, 0, 192);
    for (int e = 0; e < QK; e++) {
        int h = e / 128, r = e % 128, q = q6_code(p, l, e);
        block[64 * h + r % 64] |= (uint8_t)((q & 15) << (4 * (r / 64)));
        block[128 + 32 * h + r % 32] |= (uint8_t)((q >> 4) << (2 * (r / 32)));
    }
    for (int u = 0; u < 16; u++) block[192 + u] = p[K6_SCALES + 32 * (u / 2) + 2 * l + u % 2];
    memcpy(block + 208, p + K6_D + 2 * l, 2);
}

/* ---- the type table ------------------------------------------------------------------------------------- */

typedef struct {
    const char *name;  /* GGUF's type name */
    int64_t file_bytes; /* a super-block of one output in the file */
    int64_t group_bytes; /* a super-block of 16 outputs here */
    ChunkFn chunk;
    void (*in)(const uint8_t *block, uint8_t *p, int l);
    void (*out)(const uint8_t *p, int l, uint8_t *block);
} Kx16Type;

typedef struct {
    const uint8_t *w;
    const int8_t *q;
    const float *d, *bias;
    const int16_t *s;
    int64_t in, out, rows, ldy;
    float *y;
    int accumulate;
} Kx16Call;

enum { KX_Q4_K, KX_Q5_K, KX_Q6_K };

/* Rows [r, r + n) against output group g, the super-blocks in order, so each output's float part runs as on one
 * row alone; `kind` a constant where inlined */
static INLINE void group_pass(const Kx16Call *m, int kind, int64_t group_bytes, int64_t g, int64_t r, int n) {
    int64_t blocks = m->in / QK;
    const uint8_t *wg = m->w + g * blocks * group_bytes;
    float acc[ROWS][OUTS] = {{0.0f}}, dx[ROWS];
    int16_t s[ROWS][16];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = wg + b * group_bytes;
        /* the first pass over a super-block (it comes from memory): ask for its lines before the work, whose own
         * loads come a line per some 20 instructions, too few in flight to keep the memory busy (2048x8192 from
         * memory, 2 threads, one row: Q6_K 26 GB/s against 18 unasked, 19-21 asking 2048 bytes or a super-block
         * ahead, 16-19 a line a step) */
        if (m->rows == 1) { /* read once, never again this token: asked for as non-temporal, so the stream does not
                             * push out of the caches what the ops between matmuls use (3B Q4_K_M single stream
                             * 1.43x on Zen 4), and a super-block ahead (Zen 5, one process a commit: 3B Q4_K_M 1.12x,
                             * 1B 1.09x against the block in hand; scripts/compare-commits.py --model, BENCHMARKS.md) */
            if (b == 0)
                for (int64_t at = 0; at < group_bytes; at += 64) __builtin_prefetch(p + at, 0, 0);
            for (int64_t at = 0; at < group_bytes; at += 64) __builtin_prefetch(p + group_bytes + at, 0, 0);
        } else if (r == 0) { /* several rows: their passes over a super-block outlast its bytes' trip from memory, so
                            * they ask ROWS_AHEAD super-blocks ahead, the way in flight the whole time (Zen 5, from
                            * memory, 8 rows: Q4_K 1.40x, Q6_K 1.27x against asking for the block in hand;
                            * scripts/kernel-ab.py --stream, BENCHMARKS.md) */
            if (b == 0)
                for (int64_t at = 0; at < ROWS_AHEAD * group_bytes; at += 64) __builtin_prefetch(p + at);
            for (int64_t at = 0; at < group_bytes; at += 64) __builtin_prefetch(p + ROWS_AHEAD * group_bytes + at);
        }
        for (int i = 0; i < n; i++) {
            dx[i] = m->d[(r + i) * blocks + b];
            memcpy(s[i], m->s + (r + i) * (m->in / SUMS) + b * (QK / SUMS), sizeof s[i]);
        }
        const int8_t *x = m->q + r * m->in + b * QK;
        if (kind != KX_Q6_K)
            k45_rows(p, kind == KX_Q5_K, x, m->in, n, dx, (const int16_t(*)[16])s, acc);
        else
            q6k_rows(p, x, m->in, n, dx, (const int16_t(*)[16])s, acc);
    }
    for (int i = 0; i < n; i++)
        for (int l = 0; l < OUTS; l++) {
            float v = m->bias ? acc[i][l] + m->bias[g * OUTS + l] : acc[i][l];
            float *at = m->y + (r + i) * m->ldy + g * OUTS + l;
            *at = m->accumulate ? *at + v : v;
        }
}

/* Output groups of a chunk for every row: one row, or ROWS at a time, each compiled for its count */
static INLINE void chunk_pass(const Kx16Call *m, int kind, int64_t group_bytes, int64_t chunk, int64_t chunks) {
    int64_t groups = m->out / OUTS, g0 = groups * chunk / chunks, g1 = groups * (chunk + 1) / chunks;
    for (int64_t g = g0; g < g1; g++) {
        if (m->rows == 1) {
            group_pass(m, kind, group_bytes, g, 0, 1);
            continue;
        }
        for (int64_t r = 0; r < m->rows; r += ROWS) {
            if (m->rows - r >= ROWS)
                group_pass(m, kind, group_bytes, g, r, ROWS);
            else
                group_pass(m, kind, group_bytes, g, r, (int)(m->rows - r));
        }
    }
}

static void q4k_chunk(const void *task, int64_t chunk, int64_t chunks, int32_t slot) {
    (void)slot;
    chunk_pass(task, KX_Q4_K, K4_GROUP(0), chunk, chunks);
}

static void q5k_chunk(const void *task, int64_t chunk, int64_t chunks, int32_t slot) {
    (void)slot;
    chunk_pass(task, KX_Q5_K, K4_GROUP(1), chunk, chunks);
}

static void q6k_chunk(const void *task, int64_t chunk, int64_t chunks, int32_t slot) {
    (void)slot;
    chunk_pass(task, KX_Q6_K, K6_GROUP, chunk, chunks);
}

static const Kx16Type TYPES[] = {
    {"Q4_K", 144, K4_GROUP(0), q4k_chunk, q4k_in, q4k_out},
    {"Q5_K", 176, K4_GROUP(1), q5k_chunk, q5k_in, q5k_out},
    {"Q6_K", 210, K6_GROUP, q6k_chunk, q6k_in, q6k_out},
};
#define NTYPES ((int32_t)(sizeof TYPES / sizeof TYPES[0]))

int32_t ns_kx16_types(void) { return NTYPES; }
const char *ns_kx16_name(int32_t type) { return type >= 0 && type < NTYPES ? TYPES[type].name : ""; }

int64_t ns_kx16_packed_bytes(int32_t type, int64_t out, int64_t in) {
    return type >= 0 && type < NTYPES ? (out / OUTS) * (in / QK) * TYPES[type].group_bytes : 0;
}

typedef struct {
    const Kx16Type *type;
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
                uint8_t *p = t->packed + (g * blocks + b) * t->type->group_bytes;
                const uint8_t *block = t->raw + ((g * OUTS + l) * blocks + b) * t->type->file_bytes;
                if (t->to_file)
                    t->type->out(p, l, (uint8_t *)block);
                else
                    t->type->in(block, p, l);
            }
}

static int pack_run(int32_t type, const uint8_t *raw, uint8_t *packed, int64_t out, int64_t in, int to_file,
                    int32_t threads) {
    if (type < 0 || type >= NTYPES || out % OUTS || in % QK) return -2;
    Pack task = {&TYPES[type], raw, packed, out, in, to_file};
    threads = threads < 1 ? 1 : threads;
    int64_t chunks = (int64_t)threads * 4, groups = out / OUTS;
    if (chunks > groups) chunks = groups > 0 ? groups : 1;
    ns_pool_run(pack_chunk, &task, chunks, threads);
    return 0;
}

/* A file's rows raw [out (in 16s), in / 256 blocks] of `type` -> dst (ns_kx16_packed_bytes). 0, or -2 for a type
 * or shape it does not take. */
int ns_kx16_pack(int32_t type, const uint8_t *raw, int64_t out, int64_t in, uint8_t *dst, int32_t threads) {
    return pack_run(type, raw, dst, out, in, 0, threads);
}

/* The packed weight back into the file's rows raw, bit for bit (the inverse of ns_kx16_pack) */
int ns_kx16_unpack(int32_t type, const uint8_t *packed, int64_t out, int64_t in, uint8_t *raw, int32_t threads) {
    return pack_run(type, raw, (uint8_t *)packed, out, in, 1, threads);
}

/* out [n, in] float32 = rows idx[0..n) of the packed W [out, in], dequantized exactly as gguf does (each super-block
 * read back into the file's block, then kquant.c's decoder): a tied embedding's lookup in its head's table.
 * Returns 0, -2 for a type or shape it does not take, -3 for an index outside [0, out). */
int ns_kx16_dequant_rows(int32_t type, const uint8_t *packed, int64_t out, int64_t in, const int64_t *idx, int64_t n,
                         float *dst) {
    if (type < 0 || type >= NTYPES || out % OUTS || in % QK) return -2;
    int32_t decoder = -1;
    for (int32_t t = 0; t < ns_kq_types(); t++)
        if (!strcmp(ns_kq_name(t), TYPES[type].name)) decoder = t;
    for (int64_t r = 0; r < n; r++)
        if (idx[r] < 0 || idx[r] >= out) return -3;
    int64_t blocks = in / QK, zero = 0;
    uint8_t block[256];
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < blocks; b++) {
            TYPES[type].out(packed + ((idx[r] / OUTS) * blocks + b) * TYPES[type].group_bytes, (int)(idx[r] % OUTS),
                            block);
            if (ns_kq_dequant_rows(decoder, block, 1, QK, &zero, 1, dst + r * in + b * QK)) return -2;
        }
    return 0;
}

/* ---- the call ------------------------------------------------------------------------------------------- */

/* y [rows, out] (a row every `ldy` floats) = x [rows, in] float32 . W^T (+ bias; added to y with `accumulate`), W
 * packed by ns_kx16_pack (out in 16s, in in 256s); on up to `threads` threads. Returns 0, -1 out of memory, -2 for
 * a type or shape it does not take. */
int ns_kx16_matmul(int32_t type, const uint8_t *w, const float *x, int64_t rows, int64_t in, int64_t out, int64_t ldy,
                   const float *bias, float *y, int32_t threads, int32_t accumulate) {
    if (type < 0 || type >= NTYPES || in % QK || out % OUTS || ldy < out) return -2;
    int8_t *q = malloc((size_t)(rows * in));
    float *d = malloc((size_t)(rows * (in / QK)) * sizeof(float));
    int16_t *s = malloc((size_t)(rows * (in / SUMS)) * sizeof(int16_t));
    if (!q || !d || !s) {
        free(q), free(d), free(s);
        return -1;
    }
    threads = threads < 1 ? 1 : threads;
    ns_kq_quantize(x, rows, in, q, d, s, threads);
    Kx16Call task = {w, q, d, bias, s, in, out, rows, ldy, y, accumulate};
    int64_t chunks = (int64_t)threads * 4, groups = out / OUTS;
    if (chunks > groups) chunks = groups > 0 ? groups : 1;
    ns_pool_run(TYPES[type].chunk, &task, chunks, threads);
    free(q), free(d), free(s);
    return 0;
}
