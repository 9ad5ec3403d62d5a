/* kquant.c's NEON build (aarch64 with ARMv8.2's dot product instructions, `dotprod`): a row's exact integer sums
 * per 4 inputs (its quads) by SDOT, 16 codes at a time, each times its sub-block scale; the float part is plain
 * C's (kquant_plainc.h: 8 lanes, the same operations in the same order, which the compiler puts in two NEON
 * registers). 16-bit rows take NEON's fused multiply-add, lane for lane plain C's fmaf. Included by kquant.c
 * alone, before kquant_plainc.h, which then leaves out the functions defined here. */
#include <arm_neon.h>
#define NS_KQ_NEON 1
#define QUADS 16 /* a row's integer sums per super-block: plain C's (kquant_plainc.h) */

/* bits shift .. of each byte, masked: (b >> shift) & mask */
static INLINE uint8x16_t bits_at(uint8x16_t b, int shift, uint8_t mask) {
    return vandq_u8(vshlq_u8(b, vdupq_n_s8((int8_t)-shift)), vdupq_n_u8(mask));
}

/* acc (4 quads) + scale x the 4-input sums of 16 codes (|code| < 128) against 16 activation codes: exact */
static INLINE int32x4_t quad_step(int32x4_t acc, uint8x16_t codes, const int8_t *x, int32_t scale) {
    return vmlaq_n_s32(acc, vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(codes), vld1q_s8(x)), scale);
}

static INLINE void quads_store(const int32x4_t q[4], int32_t quads[QUADS]) {
    for (int v = 0; v < 4; v++) vst1q_s32(quads + 4 * v, q[v]);
}

#define QUADS_ZERO {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)}

/* Q4_K / Q5_K: chunk j's byte b holds input b's low nibble and 32 + b's high one (bits 2 j, 2 j + 1 of qh[b] on
 * top for Q5_K); quads 0-7 take the chunk's first 32 inputs at scale sc[2 j], quads 8-15 its last 32 at sc[2 j + 1] */
static INLINE void quads_k45(const uint8_t *qs, const uint8_t *qh, const int8_t *x, const uint8_t sc[8],
                             int32_t quads[QUADS]) {
    int32x4_t q[4] = QUADS_ZERO;
    const uint8x16_t zero = vdupq_n_u8(0);
    uint8x16_t high[2] = {qh ? vld1q_u8(qh) : zero, qh ? vld1q_u8(qh + 16) : zero};
    for (int j = 0; j < 4; j++)
        for (int h = 0; h < 2; h++) { /* the chunk's bytes 16 h .. 16 h + 15 */
            uint8x16_t raw = vld1q_u8(qs + 32 * j + 16 * h);
            uint8x16_t lo = vandq_u8(raw, vdupq_n_u8(15)), hi = vshrq_n_u8(raw, 4);
            if (qh) {
                lo = vorrq_u8(lo, vshlq_n_u8(bits_at(high[h], 2 * j, 1), 4));
                hi = vorrq_u8(hi, vshlq_n_u8(bits_at(high[h], 2 * j + 1, 1), 4));
            }
            q[h] = quad_step(q[h], lo, x + 64 * j + 16 * h, sc[2 * j]);
            q[2 + h] = quad_step(q[2 + h], hi, x + 64 * j + 32 + 16 * h, sc[2 * j + 1]);
        }
    quads_store(q, quads);
}

/* Q6_K: chunk c's inputs 16 k .. 16 k + 15 (quads 4 k .. 4 k + 3, scale sc[4 c + k]) */
static INLINE void quads_q6k(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const int8_t *x,
                             int32_t quads[QUADS]) {
    int32x4_t q[4] = QUADS_ZERO;
    for (int c = 0; c < 4; c++) {
        int h = c >> 1, s = c & 1;
        for (int k = 0; k < 4; k++) {
            uint8x16_t low = bits_at(vld1q_u8(ql + 64 * h + 16 * k), 4 * s, 15);
            uint8x16_t top = bits_at(vld1q_u8(qh + 32 * h + 16 * (k & 1)), 4 * s + 2 * (k >> 1), 3);
            q[k] = quad_step(q[k], vorrq_u8(low, vshlq_n_u8(top, 4)), x + 64 * c + 16 * k, sc[4 * c + k]);
        }
    }
    quads_store(q, quads);
}

/* Q2_K / Q3_K: chunk c's inputs 16 k .. 16 k + 15, two bits of qs (and Q3_K's hmask bit 2 c + k / 2 above them) */
static INLINE void quads_2bit(const uint8_t *qs, const uint8_t *hmask, const int8_t sc[16], const int8_t *x,
                              int32_t quads[QUADS]) {
    int32x4_t q[4] = QUADS_ZERO;
    for (int c = 0; c < 4; c++)
        for (int k = 0; k < 4; k++) {
            uint8x16_t codes = bits_at(vld1q_u8(qs + 32 * (c >> 1) + 16 * (k & 1)), 2 * (2 * (c & 1) + (k >> 1)), 3);
            if (hmask)
                codes = vorrq_u8(codes, vshlq_n_u8(bits_at(vld1q_u8(hmask + 16 * (k & 1)), 2 * c + (k >> 1), 1), 2));
            q[k] = quad_step(q[k], codes, x + 64 * c + 16 * k, sc[4 * c + k]);
        }
    quads_store(q, quads);
}

/* IQ4_XS: chunk c's inputs 16 k .. 16 k + 15 are the nibbles (high ones for odd k) of qs[32 c + 16 (k / 2) ..],
 * each NS_KVALUES' entry (a table lookup), at block 2 c + k / 2's scale */
static INLINE void quads_iq4xs(const uint8_t *qs, const int8_t sc[8], const int8_t *x, int32_t quads[QUADS]) {
    int32x4_t q[4] = QUADS_ZERO;
    const uint8x16_t table = vreinterpretq_u8_s8(vld1q_s8(NS_KVALUES));
    for (int c = 0; c < 4; c++)
        for (int k = 0; k < 4; k++) {
            uint8x16_t raw = vld1q_u8(qs + 32 * c + 16 * (k >> 1));
            uint8x16_t nibbles = (k & 1) ? vshrq_n_u8(raw, 4) : vandq_u8(raw, vdupq_n_u8(15));
            q[k] = quad_step(q[k], vqtbl1q_u8(table, nibbles), x + 64 * c + 16 * k, sc[2 * c + (k >> 1)]);
        }
    quads_store(q, quads);
}

/* F16 / BF16 rows: plain C's 32 lanes in 8 registers, each a fused multiply-add (vfmaq: fmaf lane by lane) of the
 * weight converted exactly and the activation, then plain C's tree (l + 16, l + 8, l + 4, l + 2, l + 1) */
static INLINE float32x4_t half4(const uint8_t *p, int bf16) {
    uint16x4_t h = vld1_u16((const uint16_t *)p);
    return bf16 ? vreinterpretq_f32_u32(vshll_n_u16(h, 16)) : vcvt_f32_f16(vreinterpret_f16_u16(h));
}

static INLINE void rows_half(const uint8_t *w, int bf16, const float *x, int64_t in, int n, float *sums) {
    for (int i = 0; i < n; i++) {
        float32x4_t a[8];
        for (int m = 0; m < 8; m++) a[m] = vdupq_n_f32(0.0f);
        for (int64_t u = 0; u < in; u += HALF_UNIT)
            for (int m = 0; m < 8; m++)
                a[m] = vfmaq_f32(a[m], half4(w + 2 * (u + 4 * m), bf16), vld1q_f32(x + i * in + u + 4 * m));
        for (int m = 0; m < 4; m++) a[m] = vaddq_f32(a[m], a[m + 4]);
        a[0] = vaddq_f32(a[0], a[2]), a[1] = vaddq_f32(a[1], a[3]);
        float t[4];
        vst1q_f32(t, vaddq_f32(a[0], a[1]));
        sums[i] = (t[0] + t[2]) + (t[1] + t[3]);
    }
}
