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
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays a quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
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
    for (int64_t i = 0; i < n; i++) store(out, out_kind, out_at + i, (x[i] * inv) * w[i]);
}

/* x [rows, n] float32, in place x += delta (when delta_kind != 0), then out [rows, n] = rms_norm(x) * w */
void ns_add_rms_norm(float *x, int64_t rows, int64_t n, const void *delta, int32_t delta_kind, const float *w,
                     float eps, void *out, int32_t out_kind) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = x + r * n;
        if (delta_kind)
            for (int64_t i = 0; i < n; i++) row[i] = row[i] + load(delta, delta_kind, r * n + i);
        norm_row(row, w, n, eps, out, out_kind, r * n);
    }
}

/* x [rows, n] float32 += delta [rows, n] */
void ns_add(float *x, int64_t count, const void *delta, int32_t delta_kind) {
    for (int64_t i = 0; i < count; i++) x[i] = x[i] + load(delta, delta_kind, i);
}

/* One head vector: norm (when w is given), then the neox rotation x cos + roll(x, dim / 2) sin with sin's first
 * half negated (RotaryEmbedding's signed table): the product with cos rounded, the one with sin fused into the
 * add, as torch's addcmul computes it, so the eager rotation and this one agree bitwise. */
static void rotate(float *v, int32_t dim, const float *norm_w, float eps, const float *cos, const float *sin,
                   float *out) {
    if (norm_w) norm_row(v, norm_w, dim, eps, v, 1, 0);
    int32_t half = dim / 2;
    for (int32_t i = 0; i < dim; i++) {
        float straight = v[i] * cos[i];
        out[i] = fmaf(v[(i + half) % dim], sin[i], straight);
    }
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
        int64_t g_at = r * 2 * n, u_at = g_at + n;
        for (int64_t i = 0; i < n; i++) {
            float g = load(gate_up, kind, g_at + i);
            float act = g / (1.0f + expf(-g));
            if (kind == 2) act = bf16_to_f32(f32_to_bf16(act));
            store(out, kind, r * n + i, act * load(gate_up, kind, u_at + i));
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
            if (keys <= 0) {
                for (int32_t d = 0; d < dim; d++) store(out, out_kind, out_at + d, 0.0f);
                continue;
            }
            float top = -INFINITY;
            for (int64_t j = 0; j < keys; j++) {
                int64_t slot = table[j / block_size] * block_size + j % block_size;
                float s = dot(qv, k_cache + slot * slot_stride + head_at, dim) * scale;
                scratch[j] = s;
                if (s > top) top = s;
            }
            double total = 0.0;
            for (int32_t d = 0; d < dim; d++) acc[d] = 0.0f;
            for (int64_t j = 0; j < keys; j++) {
                float e = expf(scratch[j] - top);
                total += e;
                const float *vv = v_cache + (table[j / block_size] * block_size + j % block_size) * slot_stride + head_at;
                for (int32_t d = 0; d < dim; d++) acc[d] = fmaf(e, vv[d], acc[d]);
            }
            float inv = (float)(1.0 / total);
            for (int32_t d = 0; d < dim; d++) store(out, out_kind, out_at + d, acc[d] * inv);
        }
    }
}
