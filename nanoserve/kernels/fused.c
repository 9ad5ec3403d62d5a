/* The CPU decoder's per-row work fused into one pass each: RMSNorm (with the residual add before it), the rotary
 * embedding with the KV write, and SiLU-and-multiply. Built once per machine by nanoserve/kernels/build.py and
 * called through ctypes (nanoserve/kernels/fused.py).
 *
 * Every row is computed alone, in an order fixed by this source: a row's numbers never depend on how many rows
 * share the call, so prefill, decode and chunked rows agree bitwise. Built with -ffp-contract=off, so no multiply
 * and add are merged into an FMA behind the source's back.
 *
 * Kinds: 0 none, 1 float32, 2 bfloat16 (rounded to nearest even, as torch rounds).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x40u; /* a NaN stays a quiet NaN */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

static inline float load(const void *base, int32_t kind, int64_t i) {
    return kind == 2 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* e^x to about 2 ulp in plain arithmetic (Cephes' polynomial after a reduction by ln 2), so loops over it
 * vectorise without -ffast-math and every machine this builds on computes the same bits from the source. */
static inline float exp_poly(float x) {
    x = x < -87.33654f ? -87.33654f : x; /* a NaN passes both clamps and comes out NaN */
    x = x > 88.72283f ? 88.72283f : x;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    float y = fmaf(p, r * r, r) + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
}

/* sum of x*x in LANES running sums (element i into lane i % LANES), the lanes then added pairwise */
static float sum_squares(const float *x, int64_t n) {
    float lane[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) lane[j] += x[i + j] * x[i + j];
    for (int j = 0; i < n; i++, j++) lane[j] += x[i] * x[i];
    for (int width = LANES / 2; width; width /= 2)
        for (int j = 0; j < width; j++) lane[j] += lane[j + width];
    return lane[0];
}

/* out = (x / sqrt(mean(x^2) + eps)) * w for one row of n */
static void norm_row(const float *x, const float *w, int64_t n, float eps, void *out, int32_t out_kind,
                     int64_t out_at) {
    float inv = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    if (out_kind == 2) {
        uint16_t *o = (uint16_t *)out + out_at;
        for (int64_t i = 0; i < n; i++) o[i] = f32_to_bf16((x[i] * inv) * w[i]);
    } else {
        float *o = (float *)out + out_at;
        for (int64_t i = 0; i < n; i++) o[i] = (x[i] * inv) * w[i];
    }
}

static void add_row(float *x, const void *delta, int32_t kind, int64_t at, int64_t n) {
    if (kind == 2) {
        const uint16_t *d = (const uint16_t *)delta + at;
        for (int64_t i = 0; i < n; i++) x[i] = x[i] + bf16_to_f32(d[i]);
    } else if (kind == 1) {
        const float *d = (const float *)delta + at;
        for (int64_t i = 0; i < n; i++) x[i] = x[i] + d[i];
    }
}

/* x [rows, n] float32, in place x += delta (when delta_kind != 0), then out [rows, n] = rms_norm(x) * w */
void ns_add_rms_norm(float *x, int64_t rows, int64_t n, const void *delta, int32_t delta_kind, const float *w,
                     float eps, void *out, int32_t out_kind) {
    for (int64_t r = 0; r < rows; r++) {
        add_row(x + r * n, delta, delta_kind, r * n, n);
        norm_row(x + r * n, w, n, eps, out, out_kind, r * n);
    }
}

/* x [rows, n] float32 += delta [rows, n] */
void ns_add(float *x, int64_t count, const void *delta, int32_t delta_kind) {
    add_row(x, delta, delta_kind, 0, count);
}

/* One head vector: norm (when w is given), then the neox rotation x cos + roll(x, dim / 2) sin with sin's first
 * half negated (RotaryEmbedding's signed table): the product with cos rounded, the one with sin fused into the
 * add, as torch's addcmul computes it, so the eager rotation and this one agree bitwise. */
static void rotate(float *v, int32_t dim, const float *norm_w, float eps, const float *cos, const float *sin,
                   float *out) {
    if (norm_w) norm_row(v, norm_w, dim, eps, v, 1, 0);
    int32_t half = dim / 2;
    for (int32_t i = 0; i < half; i++) out[i] = fmaf(v[i + half], sin[i], v[i] * cos[i]);
    for (int32_t i = half; i < dim; i++) out[i] = fmaf(v[i - half], sin[i], v[i] * cos[i]);
}

/* qkv [tokens, (heads + 2 kv_heads) * dim] (float32 or bfloat16) -> q [tokens, heads, dim] float32, rotated;
 * k rotated and v written to the caches at slot * slot_stride + head * head_stride (a slot < 0 is not written);
 * with k_block > 0 a K block is stored transposed, [dim, k_block] (the fused attention's layout, heads_kt).
 * cos, sin [tokens, dim]; q_norm, k_norm [dim] or NULL (Qwen3's per-head norms, before the rotation). */
void ns_rope_store(const void *qkv, int32_t qkv_kind, int64_t tokens, int32_t heads, int32_t kv_heads, int32_t dim,
                   const float *cos, const float *sin, const float *q_norm, const float *k_norm, float eps,
                   float *q_out, float *k_cache, float *v_cache, const int64_t *slots, int64_t slot_stride,
                   int64_t head_stride, int32_t k_block) {
    float v[1024];
    if (dim > 1024) return; /* refused by the caller */
    int64_t width = (int64_t)(heads + 2 * kv_heads) * dim;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * dim, *s = sin + t * dim;
        int64_t row = t * width;
        for (int32_t h = 0; h < heads; h++) {
            for (int32_t i = 0; i < dim; i++) v[i] = load(qkv, qkv_kind, row + (int64_t)h * dim + i);
            rotate(v, dim, q_norm, eps, c, s, q_out + (t * heads + h) * dim);
        }
        int64_t slot = slots[t];
        for (int32_t h = 0; h < kv_heads; h++) {
            int64_t k_at = row + (int64_t)(heads + h) * dim, v_at = k_at + (int64_t)kv_heads * dim;
            float rotated[1024];
            for (int32_t i = 0; i < dim; i++) v[i] = load(qkv, qkv_kind, k_at + i);
            rotate(v, dim, k_norm, eps, c, s, rotated);
            if (slot < 0) continue;
            float *vd = v_cache + slot * slot_stride + h * head_stride;
            if (k_block > 0) {
                float *kd = k_cache + h * head_stride + (slot / k_block) * k_block * dim + slot % k_block;
                for (int32_t i = 0; i < dim; i++) kd[(int64_t)i * k_block] = rotated[i];
            } else {
                memcpy(k_cache + slot * slot_stride + h * head_stride, rotated, sizeof(float) * (size_t)dim);
            }
            for (int32_t i = 0; i < dim; i++) vd[i] = load(qkv, qkv_kind, v_at + i);
        }
    }
}

/* gate_up [rows, 2 n] -> out [rows, n] = silu(gate) * up, each op rounded to the kind as torch's ops round */
void ns_silu_mul(const void *gate_up, int32_t kind, int64_t rows, int64_t n, void *out) {
    for (int64_t r = 0; r < rows; r++) {
        if (kind == 2) {
            const uint16_t *g = (const uint16_t *)gate_up + r * 2 * n, *u = g + n;
            uint16_t *o = (uint16_t *)out + r * n;
            for (int64_t i = 0; i < n; i++) {
                float x = bf16_to_f32(g[i]);
                float act = bf16_to_f32(f32_to_bf16(x / (1.0f + exp_poly(-x))));
                o[i] = f32_to_bf16(act * bf16_to_f32(u[i]));
            }
        } else {
            const float *g = (const float *)gate_up + r * 2 * n, *u = g + n;
            float *o = (float *)out + r * n;
            for (int64_t i = 0; i < n; i++) o[i] = (g[i] / (1.0f + exp_poly(-g[i]))) * u[i];
        }
    }
}

/* a . b over n in LANES running fused multiply-adds, the lanes then added pairwise */
static inline float dot(const float *a, const float *b, int32_t n) {
    float lane[LANES] = {0};
    int32_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) lane[j] = fmaf(a[i + j], b[i + j], lane[j]);
    for (int j = 0; i < n; i++, j++) lane[j] = fmaf(a[i], b[i], lane[j]);
    for (int width = LANES / 2; width; width /= 2)
        for (int j = 0; j < width; j++) lane[j] += lane[j + width];
    return lane[0];
}

/* Causal attention of each query over exactly the keys it may see, read from a paged cache in the heads_kt
 * layout: kv head g, block b holds K transposed, [dim, block_size], at (g * num_blocks + b) * dim * block_size,
 * and V as [block_size, dim] at the same offset.
 *
 * q [tokens, heads, dim] float32; token t reads keys [0, keys_of[t]) of table row row_of[t] (tables [rows, width]
 * block ids). Per query: each score is scale * (q . k) summed over dim in order with fused multiply-adds; then the
 * max, weights exp(s - max) summed (sum_of), values summed in key order with fused multiply-adds,
 * and the sum divided out. Consecutive tokens of one row (a prefill chunk) are taken up to QUERY_TILE at a time
 * so a block of keys is read once for all of them; a query's arithmetic is the same in any tile, so the same
 * query over the same keys gives the same bits in any step. scratch: at least
 * attention_scratch(heads / kv_heads, max keys, dim) floats. out [tokens, heads, dim] in out_kind. */
#define QUERY_TILE 8

/* A vector of VLEN floats and its fused multiply-add: the widest this machine has. Each lane computes what the
 * scalar fmaf would, so the width changes no number. */
#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vec;
#define VLEN 16
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vfma _mm512_fmadd_ps
#define vset1 _mm512_set1_ps
#define vmax _mm512_max_ps
#define vmin _mm512_min_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmul _mm512_mul_ps
/* 2^n for integral n, as exp_poly builds it */
static inline vec vpow2(vec n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vec;
#define VLEN 8
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vfma _mm256_fmadd_ps
#define vset1 _mm256_set1_ps
#define vmax _mm256_max_ps
#define vmin _mm256_min_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmul _mm256_mul_ps
static inline vec vpow2(vec n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#elif defined(__aarch64__)
#include <arm_neon.h>
typedef float32x4_t vec;
#define VLEN 4
#define vload vld1q_f32
#define vstore vst1q_f32
#define vset1 vdupq_n_f32
#define vadd vaddq_f32
#define vsub vsubq_f32
#define vmul vmulq_f32
static inline vec vfma(vec a, vec b, vec c) { return vfmaq_f32(c, a, b); } /* a b + c, one rounding: fmaf's */
/* x86's max and min, a > b ? a : b and a < b ? a : b (NEON's own return a NaN from either side) */
static inline vec vmax(vec a, vec b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
static inline vec vmin(vec a, vec b) { return vbslq_f32(vcltq_f32(a, b), a, b); }
static inline vec vpow2(vec n) {
    return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23));
}
#else
typedef struct { float x[4]; } vec;
#define VLEN 4
static inline vec vload(const float *p) { vec v; memcpy(v.x, p, sizeof v.x); return v; }
static inline void vstore(float *p, vec v) { memcpy(p, v.x, sizeof v.x); }
static inline vec vfma(vec a, vec b, vec c) {
    for (int k = 0; k < 4; k++) c.x[k] = fmaf(a.x[k], b.x[k], c.x[k]);
    return c;
}
static inline vec vset1(float f) { vec v = {{f, f, f, f}}; return v; }
static inline vec vmax(vec a, vec b) {
    for (int k = 0; k < 4; k++) a.x[k] = a.x[k] > b.x[k] ? a.x[k] : b.x[k];
    return a;
}
static inline vec vadd(vec a, vec b) {
    for (int k = 0; k < 4; k++) a.x[k] += b.x[k];
    return a;
}
static inline vec vsub(vec a, vec b) {
    for (int k = 0; k < 4; k++) a.x[k] -= b.x[k];
    return a;
}
#define VEXP_PER_LANE /* no vector unit: exp_poly lane by lane */
#endif

/* exp_poly of every lane, operation for operation (the clamps keep a NaN as the scalar's comparisons do), so a
 * lane's bits are the scalar's */
static inline vec vexp(vec x) {
#ifdef VEXP_PER_LANE
    for (int k = 0; k < VLEN; k++) x.x[k] = exp_poly(x.x[k]);
    return x;
#else
    x = vmax(vset1(-87.33654f), x);
    x = vmin(vset1(88.72283f), x);
    vec n = vsub(vadd(vmul(x, vset1(1.44269504088896341f)), vset1(12582912.0f)), vset1(12582912.0f));
    vec r = vfma(n, vset1(-0.693359375f), x);
    r = vfma(n, vset1(2.12194440e-4f), r);
    vec p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    vec y = vadd(vfma(p, vmul(r, r), r), vset1(1.0f));
    return vmul(y, vpow2(n));
#endif
}

/* the largest of x[0, n) (n > 0), in four running maxima (max is exact in any order; a NaN makes every output
 * of the softmax NaN whichever maximum it meets) */
static float max_of(const float *x, int64_t n) {
    float top = x[0];
    int64_t j = 0;
    if (n >= 4 * VLEN) {
        vec m0 = vload(x), m1 = vload(x + VLEN), m2 = vload(x + 2 * VLEN), m3 = vload(x + 3 * VLEN);
        for (j = 4 * VLEN; j + 4 * VLEN <= n; j += 4 * VLEN) {
            m0 = vmax(m0, vload(x + j));
            m1 = vmax(m1, vload(x + j + VLEN));
            m2 = vmax(m2, vload(x + j + 2 * VLEN));
            m3 = vmax(m3, vload(x + j + 3 * VLEN));
        }
        m0 = vmax(vmax(m0, m1), vmax(m2, m3));
        float lanes[VLEN];
        vstore(lanes, m0);
        for (int k = 0; k < VLEN; k++) top = lanes[k] > top ? lanes[k] : top;
    }
    for (; j < n; j++) top = x[j] > top ? x[j] : top;
    return top;
}

/* x[0, n) summed in 16 running sums in every build (element j into sum j % 16, VLEN of them a vector, so the
 * width changes no number), the sums then added pairwise (l + 8, l + 4, ...), the tail after them in order */
#define SUM_LANES 16
static float sum_of(const float *x, int64_t n) {
    vec acc[SUM_LANES / VLEN];
    for (int v = 0; v < SUM_LANES / VLEN; v++) acc[v] = vset1(0.0f);
    int64_t j = 0;
    for (; j + SUM_LANES <= n; j += SUM_LANES)
        for (int v = 0; v < SUM_LANES / VLEN; v++) acc[v] = vadd(acc[v], vload(x + j + v * VLEN));
    float lanes[SUM_LANES];
    for (int v = 0; v < SUM_LANES / VLEN; v++) vstore(lanes + v * VLEN, acc[v]);
    for (int width = SUM_LANES / 2; width; width /= 2)
        for (int k = 0; k < width; k++) lanes[k] += lanes[k + width];
    float total = lanes[0];
    for (; j < n; j++) total += x[j];
    return total;
}
#if VLEN == 16
#define VCHUNK 4 /* value vectors a query's sum holds in registers: 4 queries x 4 fill half of AVX-512's 32 */
#else
#define VCHUNK 2
#endif
#define SCORE_QUERIES 8 /* queries whose score chains run side by side: two FMA units of 4 cycles' latency */
#if VLEN == 16
#define SCORE_COLUMNS 2 /* key columns a pass reads together: 16 chains, each broadcast used twice (32 registers) */
#else
#define SCORE_COLUMNS 1 /* 16 registers hold no more */
#endif
#define VALUE_QUERIES 4 /* queries whose value sums share each value row's loads */

#define INLINE static inline __attribute__((always_inline))

/* A key column: VLEN consecutive keys of one transposed block, key k of dimension d at col[d * block_size + k].
 * s_i[c][k] = q_i . key k of column c, for nq queries and ncols columns side by side (nq x ncols chains, each
 * query's broadcast shared by the columns; both constants where inlined, so the chains live in registers). Each
 * score is its sum over dim in order with fused multiply-adds, whatever shares the pass. qt holds the queries
 * transposed, [dim, SCORE_QUERIES]. */
INLINE void score_columns(const float *restrict qt, int32_t nq, int32_t ncols, const float *const *col, int32_t dim,
                          int32_t block_size, float (*s)[SCORE_QUERIES][VLEN]) {
    vec r[SCORE_COLUMNS][SCORE_QUERIES];
    for (int32_t c = 0; c < ncols; c++)
        for (int32_t i = 0; i < nq; i++) r[c][i] = vset1(0.0f);
    for (int32_t d = 0; d < dim; d++) {
        vec k[SCORE_COLUMNS];
        for (int32_t c = 0; c < ncols; c++) k[c] = vload(col[c] + (int64_t)d * block_size);
        const float *qd = qt + (int64_t)d * SCORE_QUERIES;
        for (int32_t i = 0; i < nq; i++) {
            vec b = vset1(qd[i]);
            for (int32_t c = 0; c < ncols; c++) r[c][i] = vfma(b, k[c], r[c][i]);
        }
    }
    for (int32_t c = 0; c < ncols; c++)
        for (int32_t i = 0; i < nq; i++) vstore(s[c][i], r[c][i]);
}

#define SCORE_CASE(n)                                                                                              \
    case n:                                                                                                        \
        if (ncols == SCORE_COLUMNS) score_columns(qt, n, SCORE_COLUMNS, col, dim, block_size, s);                  \
        else score_columns(qt, n, 1, col, dim, block_size, s);                                                     \
        break;

/* score_columns for nq <= SCORE_QUERIES queries and ncols <= SCORE_COLUMNS columns */
static void scores_of_columns(const float *restrict qt, int32_t nq, int32_t ncols, const float *const *col,
                              int32_t dim, int32_t block_size, float (*s)[SCORE_QUERIES][VLEN]) {
    switch (nq) {
    SCORE_CASE(8) SCORE_CASE(7) SCORE_CASE(6) SCORE_CASE(5) SCORE_CASE(4) SCORE_CASE(3) SCORE_CASE(2)
    default:
        if (ncols == SCORE_COLUMNS) score_columns(qt, 1, SCORE_COLUMNS, col, dim, block_size, s);
        else score_columns(qt, 1, 1, col, dim, block_size, s);
    }
}

/* a_i[d0, d0 + VCHUNK VLEN) += sum over o < common of e_i[o] * vb[o][...]: nq queries' sums side by side in
 * registers (nq a constant where inlined), each value row loaded once for all of them. */
INLINE void weigh_common(float *const *a, const float *const *e, int32_t nq, int64_t common, const float *restrict vb,
                         int32_t dim, int32_t d0) {
    vec r[VALUE_QUERIES][VCHUNK];
    for (int32_t i = 0; i < nq; i++)
        for (int32_t c = 0; c < VCHUNK; c++) r[i][c] = vload(a[i] + d0 + c * VLEN);
    for (int64_t o = 0; o < common; o++) {
        const float *v = vb + o * dim + d0;
        vec vs[VCHUNK];
        for (int32_t c = 0; c < VCHUNK; c++) vs[c] = vload(v + c * VLEN);
        for (int32_t i = 0; i < nq; i++) {
            vec eo = vset1(e[i][o]);
            for (int32_t c = 0; c < VCHUNK; c++) r[i][c] = vfma(eo, vs[c], r[i][c]);
        }
    }
    for (int32_t i = 0; i < nq; i++)
        for (int32_t c = 0; c < VCHUNK; c++) vstore(a[i] + d0 + c * VLEN, r[i][c]);
}

/* a_i[d] += sum over o < span_i of e_i[o] * vb[o][d], in order of o for each (i, d), for nq <= VALUE_QUERIES
 * queries over one block's value rows: the keys every query has (common) side by side, then each query's
 * remaining keys alone. Each a_i[d] is the same chain of fused multiply-adds in key order however the queries
 * are grouped. */
static void add_weighted_rows(float *const *a, const float *const *e, const int64_t *span, int32_t nq,
                              const float *restrict vb, int32_t dim) {
    int64_t common = span[0];
    for (int32_t i = 1; i < nq; i++) common = span[i] < common ? span[i] : common;
    int32_t d0 = 0;
    for (; d0 + VCHUNK * VLEN <= dim; d0 += VCHUNK * VLEN) {
        switch (nq) {
        case 4: weigh_common(a, e, 4, common, vb, dim, d0); break;
        case 3: weigh_common(a, e, 3, common, vb, dim, d0); break;
        case 2: weigh_common(a, e, 2, common, vb, dim, d0); break;
        default: weigh_common(a, e, 1, common, vb, dim, d0); break;
        }
        for (int32_t i = 0; i < nq; i++)
            for (int32_t c = 0; c < VCHUNK; c++) {
                vec r = vload(a[i] + d0 + c * VLEN);
                for (int64_t o = common; o < span[i]; o++)
                    r = vfma(vset1(e[i][o]), vload(vb + o * dim + d0 + c * VLEN), r);
                vstore(a[i] + d0 + c * VLEN, r);
            }
    }
    for (; d0 + VLEN <= dim; d0 += VLEN)
        for (int32_t i = 0; i < nq; i++) {
            vec r = vload(a[i] + d0);
            for (int64_t o = 0; o < span[i]; o++) r = vfma(vset1(e[i][o]), vload(vb + o * dim + d0), r);
            vstore(a[i] + d0, r);
        }
    for (int32_t i = 0; i < nq; i++)
        for (int32_t d = d0; d < dim; d++)
            for (int64_t o = 0; o < span[i]; o++) a[i][d] = fmaf(e[i][o], vb[o * dim + d], a[i][d]);
}

int64_t ns_attention_scratch(int32_t group, int64_t max_keys, int32_t dim) {
    /* scores, sums, and the queries transposed in passes of SCORE_QUERIES */
    return (int64_t)QUERY_TILE * group * (max_keys + 2 * dim) + (int64_t)SCORE_QUERIES * dim;
}

/* the tile's queries q_i (i < nq: token t0 + i / group, head g * group + i % group) into qt, transposed in passes
 * of SCORE_QUERIES, [pass, dim, SCORE_QUERIES] (a last pass's missing queries zero) */
static void transpose_queries(const float *q, int64_t t0, int32_t nq, int32_t heads, int32_t group, int32_t g,
                              int32_t dim, float *qt) {
    int32_t passes = (nq + SCORE_QUERIES - 1) / SCORE_QUERIES;
    memset(qt, 0, sizeof(float) * (size_t)passes * SCORE_QUERIES * (size_t)dim);
    for (int32_t i = 0; i < nq; i++) {
        const float *qi = q + ((t0 + i / group) * heads + (int64_t)g * group + i % group) * dim;
        float *dst = qt + (int64_t)(i / SCORE_QUERIES) * SCORE_QUERIES * dim + i % SCORE_QUERIES;
        for (int32_t d = 0; d < dim; d++) dst[(int64_t)d * SCORE_QUERIES] = qi[d];
    }
}

/* scores[i][j] = scale * (q_i . k_j) for each query i of the tile and each key j it may see, block by block:
 * a block's keys are read once for every pass of queries that reaches it */
/* the pending columns' scores (at key positions at[c]) into each query's row, scaled, up to its keys */
static void store_scores(int32_t n, int32_t ncols, const int64_t *at, float (*spill)[SCORE_QUERIES][VLEN],
                         const int64_t *keys, float scale, float *rows, int64_t stride) {
    for (int32_t c = 0; c < ncols; c++)
        for (int32_t m = 0; m < n; m++) {
            int64_t left = keys[m] - at[c];
            float *row = rows + m * stride + at[c];
            for (int64_t o = 0; o < (left < VLEN ? left : VLEN); o++) row[o] = spill[c][m][o] * scale;
        }
}

/* scores[i][j] = scale * (q_i . k_j) for each query i of the tile and each key j it may see: per pass of
 * SCORE_QUERIES queries, the key columns up to the pass's last key, SCORE_COLUMNS at a time (a block's keys
 * past its last whole column one by one) */
static void tile_scores(const float *qt, int32_t nq, int32_t group, int64_t t0, int32_t dim, const float *k_cache,
                        int64_t num_blocks, int32_t block_size, int32_t g, const int64_t *table,
                        const int64_t *keys_of, float scale, float *scores, int64_t stride) {
    int64_t block_elems = (int64_t)dim * block_size;
    float spill[SCORE_COLUMNS][SCORE_QUERIES][VLEN];
    for (int32_t i0 = 0; i0 < nq; i0 += SCORE_QUERIES) {
        int32_t n = nq - i0 < SCORE_QUERIES ? nq - i0 : SCORE_QUERIES;
        int64_t keys[SCORE_QUERIES], most = 0, at[SCORE_COLUMNS];
        for (int32_t m = 0; m < n; m++) {
            keys[m] = keys_of[t0 + (i0 + m) / group];
            most = keys[m] > most ? keys[m] : most;
        }
        const float *pass = qt + (int64_t)(i0 / SCORE_QUERIES) * SCORE_QUERIES * dim, *col[SCORE_COLUMNS];
        float *rows = scores + i0 * stride;
        int32_t held = 0;
        for (int64_t j0 = 0; j0 < most; j0 += block_size) {
            const float *kb = k_cache + ((int64_t)g * num_blocks + table[j0 / block_size]) * block_elems;
            int32_t o0 = 0;
            for (; o0 + VLEN <= block_size && j0 + o0 < most; o0 += VLEN) {
                col[held] = kb + o0, at[held++] = j0 + o0;
                if (held == SCORE_COLUMNS) {
                    scores_of_columns(pass, n, held, col, dim, block_size, spill);
                    store_scores(n, held, at, spill, keys, scale, rows, stride);
                    held = 0;
                }
            }
            for (int32_t o = o0; o < block_size && j0 + o < most; o++)
                for (int32_t m = 0; m < n; m++) {
                    float r = 0.0f;
                    for (int32_t d = 0; d < dim; d++)
                        r = fmaf(pass[(int64_t)d * SCORE_QUERIES + m], kb[(int64_t)d * block_size + o], r);
                    if (j0 + o < keys[m]) rows[m * stride + j0 + o] = r * scale;
                }
        }
        if (held) {
            scores_of_columns(pass, n, held, col, dim, block_size, spill);
            store_scores(n, held, at, spill, keys, scale, rows, stride);
        }
    }
}

/* each query's scores row, in place, to exp(score - the row's max); its value sum zeroed */
static void tile_exponents(int32_t nq, int32_t group, int64_t t0, const int64_t *keys_of, int32_t dim,
                           float *scores, int64_t stride, float *acc) {
    for (int32_t i = 0; i < nq; i++) {
        int64_t keys = keys_of[t0 + i / group];
        float *row = scores + i * stride;
        float top = keys > 0 ? max_of(row, keys) : 0.0f;
        int64_t j = 0;
        for (; j + VLEN <= keys; j += VLEN) vstore(row + j, vexp(vsub(vload(row + j), vset1(top))));
        for (; j < keys; j++) row[j] = exp_poly(row[j] - top);
        for (int32_t d = 0; d < dim; d++) acc[(int64_t)i * dim + d] = 0.0f;
    }
}

/* acc_i += the weighted value rows of each query's keys, VALUE_QUERIES queries side by side so each block's
 * values are read once for all of them */
static void tile_values(int32_t nq, int32_t group, int64_t t0, const int64_t *keys_of, int32_t dim,
                        const float *v_cache, int64_t num_blocks, int32_t block_size, int32_t g, const int64_t *table,
                        const float *scores, int64_t stride, float *acc) {
    int64_t block_elems = (int64_t)dim * block_size;
    for (int32_t i0 = 0; i0 < nq; i0 += VALUE_QUERIES) {
        int32_t n = nq - i0 < VALUE_QUERIES ? nq - i0 : VALUE_QUERIES;
        int64_t keys = 0;
        for (int32_t m = 0; m < n; m++) {
            int64_t own = keys_of[t0 + (i0 + m) / group];
            keys = own > keys ? own : keys;
        }
        for (int64_t j0 = 0; j0 < keys; j0 += block_size) {
            const float *vb = v_cache + ((int64_t)g * num_blocks + table[j0 / block_size]) * block_elems;
            float *as[VALUE_QUERIES];
            const float *es[VALUE_QUERIES];
            int64_t spans[VALUE_QUERIES];
            int32_t held = 0;
            for (int32_t m = 0; m < n; m++) {
                int64_t left = keys_of[t0 + (i0 + m) / group] - j0;
                if (left <= 0) continue;
                as[held] = acc + (int64_t)(i0 + m) * dim;
                es[held] = scores + (i0 + m) * stride + j0;
                spans[held++] = left < block_size ? left : block_size;
            }
            add_weighted_rows(as, es, spans, held, vb, dim);
        }
    }
}

/* one tile's queries (count consecutive tokens of one table row, the `group` heads of kv head g each): scores,
 * exponents, weighted values, and the sum divided out into out */
static void attend_tile(const float *q, int64_t t0, int32_t count, int32_t heads, int32_t group, int32_t g,
                        int32_t dim, const float *k_cache, const float *v_cache, int64_t num_blocks,
                        int32_t block_size, const int64_t *table, const int64_t *keys_of, float scale,
                        float *scores, int64_t stride, float *acc, float *qt, void *out, int32_t out_kind) {
    int32_t nq = count * group;
    transpose_queries(q, t0, nq, heads, group, g, dim, qt);
    tile_scores(qt, nq, group, t0, dim, k_cache, num_blocks, block_size, g, table, keys_of, scale, scores, stride);
    tile_exponents(nq, group, t0, keys_of, dim, scores, stride, acc);
    tile_values(nq, group, t0, keys_of, dim, v_cache, num_blocks, block_size, g, table, scores, stride, acc);
    for (int32_t i = 0; i < nq; i++) {
        int64_t t = t0 + i / group, keys = keys_of[t];
        int64_t out_at = (t * heads + (int64_t)g * group + i % group) * dim;
        float inv = keys > 0 ? 1.0f / sum_of(scores + i * stride, keys) : 0.0f;
        const float *a = acc + (int64_t)i * dim;
        if (out_kind == 2)
            for (int32_t d = 0; d < dim; d++) ((uint16_t *)out)[out_at + d] = f32_to_bf16(a[d] * inv);
        else
            for (int32_t d = 0; d < dim; d++) ((float *)out)[out_at + d] = a[d] * inv;
    }
}

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int64_t *tables, *row_of, *keys_of, *tile_start;
    int64_t width, num_blocks, max_keys, tiles, scratch_each;
    int32_t heads, kv_heads, dim, block_size, out_kind;
    float scale, *scratch;
    void *out;
} AttentionJob;

/* linear.c's thread pool: part c of `chunks` of a task for every c, on up to `threads` threads (slot < threads) */
void ns_pool_run(void (*run)(const void *, int64_t, int64_t, int32_t), const void *task, int64_t chunks,
                 int32_t threads);

/* Part `chunk` of `chunks` of the work items (tile, kv head), on the workspace of `slot`: which thread computes
 * an item changes none of its numbers. */
static void attention_chunk(const void *task, int64_t chunk, int64_t chunks, int32_t slot) {
    const AttentionJob *job = task;
    int32_t group = job->heads / job->kv_heads;
    float *scores = job->scratch + slot * job->scratch_each;
    float *acc = scores + (int64_t)QUERY_TILE * group * job->max_keys;
    float *qt = acc + (int64_t)QUERY_TILE * group * job->dim;
    int64_t items = job->tiles * job->kv_heads;
    for (int64_t item = items * chunk / chunks; item < items * (chunk + 1) / chunks; item++) {
        int64_t tile = item / job->kv_heads, t0 = job->tile_start[tile];
        int32_t count = (int32_t)(job->tile_start[tile + 1] - t0), g = (int32_t)(item % job->kv_heads);
        attend_tile(job->q, t0, count, job->heads, group, g, job->dim, job->k_cache, job->v_cache, job->num_blocks,
                    job->block_size, job->tables + job->row_of[t0] * job->width, job->keys_of, job->scale, scores,
                    job->max_keys, acc, qt, job->out, job->out_kind);
    }
}

/* threads: how many to split the work over (the caller's choice by the work's size; scratch holds that many
 * workspaces of ns_attention_scratch floats). The items are claimed one at a time on linear.c's pool, whose
 * threads are already running: a call that started its own paid about 60 us for them, thirty times a step. */
void ns_attention(const float *q, int64_t tokens, int32_t heads, int32_t kv_heads, int32_t dim, const float *k_cache,
                  const float *v_cache, int64_t num_blocks, int32_t block_size, const int64_t *tables, int64_t width,
                  const int64_t *row_of, const int64_t *keys_of, float scale, float *scratch, int64_t max_keys,
                  void *out, int32_t out_kind, int32_t threads) {
    if (block_size > 256 || tokens <= 0) return; /* refused by the caller */
    int64_t *tile_start = malloc(sizeof(int64_t) * (size_t)(tokens + 1)), tiles = 0;
    if (!tile_start) return;
    for (int64_t t0 = 0; t0 < tokens; tiles++) {
        tile_start[tiles] = t0;
        int32_t count = 1;
        while (count < QUERY_TILE && t0 + count < tokens && row_of[t0 + count] == row_of[t0]) count++;
        t0 += count;
    }
    tile_start[tiles] = tokens;
    AttentionJob job = {q, k_cache, v_cache, tables, row_of, keys_of, tile_start, width, num_blocks, max_keys, tiles,
                        ns_attention_scratch(heads / kv_heads, max_keys, dim), heads, kv_heads, dim, block_size,
                        out_kind, scale, scratch, out};
    int64_t items = tiles * kv_heads;
    if (threads > 1 && items > 1)
        ns_pool_run(attention_chunk, &job, items, threads);
    else
        attention_chunk(&job, 0, 1, 0);
    free(tile_start);
}

/* logits [rows, vocab] float32, in place: each row's `shortlist` highest (a tie to the lower id) recomputed as
 * hidden[row] . weight[id] over dim (the coarse head's shortlist rescored at full precision; see
 * nanoserve/model/rescore.py). shortlist <= 64. */
void ns_rescore(float *logits, int64_t rows, int64_t vocab, const float *hidden, const float *weight, int32_t dim,
                int32_t shortlist) {
    float best[64];
    int64_t ids[64];
    if (shortlist > 64) shortlist = 64;
    if (shortlist > vocab) shortlist = (int32_t)vocab;
    for (int64_t r = 0; r < rows; r++) {
        float *row = logits + r * vocab;
        int32_t held = 0;
        for (int64_t i = 0; i < vocab; i++) {
            float v = row[i];
            if (held == shortlist && !(v > best[held - 1])) continue;
            int32_t at = held < shortlist ? held++ : held - 1;
            while (at > 0 && v > best[at - 1]) {
                best[at] = best[at - 1];
                ids[at] = ids[at - 1];
                at--;
            }
            best[at] = v;
            ids[at] = i;
        }
        for (int32_t j = 0; j < held; j++) row[ids[j]] = dot(hidden + r * dim, weight + ids[j] * dim, dim);
    }
}

/* Runs every kernel once on small inputs and returns 0: build.py calls it in a child process before a fresh build
 * is cached, so a library this machine cannot execute (an instruction the compiler assumed but the CPU or its
 * hypervisor does not offer) is refused with a reason instead of crashing a server. */
int ns_q4_matmul(const uint8_t *w, const float *x, int64_t rows, int64_t in, int64_t out, const float *bias,
                 float *y, int32_t threads, int32_t accumulate);
void ns_q4_pack(const uint8_t *codes, const float *scales, const float *zeros, int64_t out, int64_t in,
                uint8_t *dst);
int ns_q8_matmul(const uint8_t *w, const float *x, int64_t rows, int64_t in, int64_t out, const float *bias,
                 float *y, int32_t threads, int32_t accumulate);
void ns_q8_pack(const int8_t *codes, const float *scales, int64_t out, int64_t in, uint8_t *dst);

int ns_self_test(void) {
    enum { DIM = 64, HEADS = 2, BLOCK = 16, KEYS = 20 };
    static float x[2 * DIM], w[DIM], out[2 * DIM], q[KEYS * HEADS * DIM], k[2 * DIM * BLOCK], v[2 * BLOCK * DIM];
    static float scratch[QUERY_TILE * 2 * (2 * BLOCK + DIM) * 2], logits[2 * 40], head[40 * DIM];
    static uint16_t gate_up[2 * DIM], act[DIM];
    for (int i = 0; i < 2 * DIM; i++) x[i] = (float)(i % 7) - 3.0f;
    for (int i = 0; i < DIM; i++) w[i] = 1.0f;
    ns_add_rms_norm(x, 2, DIM, NULL, 0, w, 1e-6f, out, 1);
    for (int i = 0; i < 2 * DIM; i++) gate_up[i] = f32_to_bf16(x[i]);
    ns_silu_mul(gate_up, 2, 1, DIM, act);
    for (int i = 0; i < KEYS * HEADS * DIM; i++) q[i] = (float)(i % 5) * 0.1f;
    for (int i = 0; i < 2 * DIM * BLOCK; i++) k[i] = v[i] = (float)(i % 3);
    int64_t table[2] = {0, 1}, rows[KEYS], keys[KEYS];
    for (int t = 0; t < KEYS; t++) rows[t] = 0, keys[t] = t + 1;
    static float attended[KEYS * HEADS * DIM];
    ns_attention(q, KEYS, HEADS, 1, DIM, k, v, 2, BLOCK, table, 2, rows, keys, 0.125f, scratch, 2 * BLOCK, attended, 1,
                 2);
    for (int i = 0; i < 80; i++) logits[i] = (float)(i % 11);
    for (int i = 0; i < 40 * DIM; i++) head[i] = 0.01f * (float)(i % 13);
    ns_rescore(logits, 2, 40, x, head, DIM, 16);
    static uint8_t codes[32 * 64], packed[2 * 2 * 320];
    static float scales[32 * 2], zeros[32 * 2], product[2 * 32];
    for (int i = 0; i < 32 * 64; i++) codes[i] = (uint8_t)(i % 16);
    for (int i = 0; i < 64; i++) scales[i] = 0.01f, zeros[i] = 0.001f;
    ns_q4_pack(codes, scales, zeros, 32, 64, packed);
    if (ns_q4_matmul(packed, x, 2, 64, 32, NULL, product, 2, 0) != 0 || !isfinite(product[33])) return 1;
    static float rows16[16 * 64], product16[16 * 32]; /* 16 rows: the tile unit's path where the CPU has one */
    for (int i = 0; i < 16 * 64; i++) rows16[i] = (float)(i % 9) - 4.0f;
    if (ns_q4_matmul(packed, rows16, 16, 64, 32, NULL, product16, 2, 0) != 0 || !isfinite(product16[511])) return 1;
    static int8_t codes8[32 * 64];
    static uint8_t packed8[2 * 2 * 544];
    for (int i = 0; i < 32 * 64; i++) codes8[i] = (int8_t)(i % 255 - 127);
    ns_q8_pack(codes8, scales, 32, 64, packed8);
    if (ns_q8_matmul(packed8, rows16, 16, 64, 32, NULL, product16, 2, 0) != 0 || !isfinite(product16[511])) return 1;
    return isfinite(attended[0]) && isfinite(out[0]) && isfinite(logits[0]) && isfinite(bf16_to_f32(act[0])) ? 0 : 1;
}
