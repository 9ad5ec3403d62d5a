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
#include <stdint.h>
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

static inline void store(void *base, int32_t kind, int64_t i, float v) {
    if (kind == 2)
        ((uint16_t *)base)[i] = f32_to_bf16(v);
    else
        ((float *)base)[i] = v;
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
 * k rotated and v written to the caches at slot * slot_stride + head * head_stride (a slot < 0 is not written).
 * cos, sin [tokens, dim]; q_norm, k_norm [dim] or NULL (Qwen3's per-head norms, before the rotation). */
void ns_rope_store(const void *qkv, int32_t qkv_kind, int64_t tokens, int32_t heads, int32_t kv_heads, int32_t dim,
                   const float *cos, const float *sin, const float *q_norm, const float *k_norm, float eps,
                   float *q_out, float *k_cache, float *v_cache, const int64_t *slots, int64_t slot_stride,
                   int64_t head_stride) {
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
            float *kd = k_cache + slot * slot_stride + h * head_stride, *vd = v_cache + slot * slot_stride + h * head_stride;
            memcpy(kd, rotated, sizeof(float) * (size_t)dim);
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

/* Causal attention of each query over exactly the keys it may see, read from the paged cache.
 *
 * q [tokens, heads, dim] float32; token t reads keys [0, keys_of[t]) of table row row_of[t] (tables [rows, width]
 * block ids); key j of a row lives at slot table[j / block_size] * block_size + j % block_size, whose kv head g
 * sits at slot * slot_stride + g * head_stride in k_cache / v_cache. Per query: scores scale * q.k, their max,
 * weights exp(s - max) summed in float64 in key order, values summed in key order with fused multiply-adds, then
 * divided by the sum. The same query over the same keys gives the same bits in any step. scratch holds one
 * query's scores (at least the longest keys_of). out [tokens, heads, dim] in out_kind. */
void ns_attention(const float *q, int64_t tokens, int32_t heads, int32_t kv_heads, int32_t dim, const float *k_cache,
                  const float *v_cache, int64_t slot_stride, int64_t head_stride, const int64_t *tables, int64_t width,
                  int32_t block_size, const int64_t *row_of, const int64_t *keys_of, float scale, float *scratch,
                  void *out, int32_t out_kind) {
    int32_t group = heads / kv_heads;
    float acc[1024];
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t *table = tables + row_of[t] * width;
        int64_t keys = keys_of[t];
        for (int32_t h = 0; h < heads; h++) {
            const float *qv = q + (t * heads + h) * dim;
            int64_t head_at = (int64_t)(h / group) * head_stride, out_at = (t * heads + h) * dim;
            for (int32_t d = 0; d < dim; d++) acc[d] = 0.0f;
            if (keys <= 0) {
                for (int32_t d = 0; d < dim; d++) store(out, out_kind, out_at + d, 0.0f);
                continue;
            }
            float top = -INFINITY;
            for (int64_t j0 = 0; j0 < keys; j0 += block_size) {
                const float *k = k_cache + table[j0 / block_size] * block_size * slot_stride + head_at;
                int64_t span = keys - j0 < block_size ? keys - j0 : block_size;
                for (int64_t o = 0; o < span; o++) {
                    float s = dot(qv, k + o * slot_stride, dim) * scale;
                    scratch[j0 + o] = s;
                    top = s > top ? s : top;
                }
            }
            for (int64_t j = 0; j < keys; j++) scratch[j] = exp_poly(scratch[j] - top);
            double total = 0.0;
            for (int64_t j = 0; j < keys; j++) total += scratch[j];
            for (int64_t j0 = 0; j0 < keys; j0 += block_size) {
                const float *v = v_cache + table[j0 / block_size] * block_size * slot_stride + head_at;
                int64_t span = keys - j0 < block_size ? keys - j0 : block_size;
                for (int64_t o = 0; o < span; o++) {
                    float e = scratch[j0 + o];
                    const float *vv = v + o * slot_stride;
                    for (int32_t d = 0; d < dim; d++) acc[d] = fmaf(e, vv[d], acc[d]);
                }
            }
            float inv = (float)(1.0 / total);
            for (int32_t d = 0; d < dim; d++) store(out, out_kind, out_at + d, acc[d] * inv);
        }
    }
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
