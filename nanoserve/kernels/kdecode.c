/* GGUF's rarer weight types decoded to float32, gguf's arithmetic in gguf's order, so the floats are its floats.
 *
 * kquant.c's table holds these decoders beside the types' dot products: an embedding's lookup decodes the rows asked
 * with them. Each takes `blocks` runs of 256 inputs (for the types with blocks of 32, eight of them) and writes 256
 * floats a run.
 *
 * Q5_0  (22 bytes / 32):  d f16, qh u32, qs[16]; input j: low nibble of qs[j] (j < 16) or high of qs[j - 16],
 *                          bit j of qh as bit 4; w = d (q - 16)
 * Q5_1  (24 bytes / 32):  d, m f16, qh u32, qs[16]; w = d q + m
 * IQ4_NL (18 bytes / 32): d f16, qs[16] as Q4_0's nibbles; w = d NS_KVALUES[q]
 * IQ4_XS (136 / 256):     d f16, scales_h u16, scales_l[4], qs[128]; 8 blocks of 32, block b's 6-bit scale
 *                          (scales_l nibble b, scales_h bits 2 b..) - 32, its nibbles as IQ4_NL's; w = (d s) NS_KVALUES[q]
 * Q2_K  (84 / 256):       scales[16] (low nibble scale, high min), qs[64], d, dmin f16; input 128 h + 32 s + l:
 *                          bits 2 s.. of qs[32 h + l]; w = (d sc) q - (dmin m), per 16 inputs
 * Q3_K  (110 / 256):      hmask[32], qs[64], scales[12], d f16; 16 six-bit scales - 32; q = bits 2 s.. of
 *                          qs[32 h + l], less 4 where bit (input / 32) of hmask[l] is clear; w = (d sc) q
 */
#include <stdint.h>
#include <string.h>
#include "half.h"
#include "kdecode.h"

/* the 32 codes of a block of nibbles: input j in qs[j]'s low nibble, input j + 16 in its high one */
static inline void nibbles32(const uint8_t *qs, uint8_t q[32]) {
    for (int j = 0; j < 16; j++) q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4;
}

static inline void fifth_bits(const uint8_t *qh_bytes, uint8_t q[32]) {
    uint32_t qh;
    memcpy(&qh, qh_bytes, 4);
    for (int j = 0; j < 32; j++) q[j] |= ((qh >> j) & 1) << 4;
}

void ns_dec_q5_0(const uint8_t *w, int64_t blocks, float *out) {
    for (int64_t b = 0; b < blocks * 8; b++, w += 22, out += 32) {
        uint8_t q[32];
        nibbles32(w + 6, q);
        fifth_bits(w + 2, q);
        float d = half_at(w);
        for (int j = 0; j < 32; j++) out[j] = d * (float)(q[j] - 16);
    }
}

void ns_dec_q5_1(const uint8_t *w, int64_t blocks, float *out) {
    for (int64_t b = 0; b < blocks * 8; b++, w += 24, out += 32) {
        uint8_t q[32];
        nibbles32(w + 8, q);
        fifth_bits(w + 4, q);
        float d = half_at(w), m = half_at(w + 2);
        for (int j = 0; j < 32; j++) out[j] = d * (float)q[j] + m;
    }
}

void ns_dec_iq4_nl(const uint8_t *w, int64_t blocks, float *out) {
    for (int64_t b = 0; b < blocks * 8; b++, w += 18, out += 32) {
        uint8_t q[32];
        nibbles32(w + 2, q);
        float d = half_at(w);
        for (int j = 0; j < 32; j++) out[j] = d * (float)NS_KVALUES[q[j]];
    }
}

void ns_dec_iq4_xs(const uint8_t *w, int64_t blocks, float *out) {
    for (int64_t b = 0; b < blocks; b++, w += 136) {
        float d = half_at(w);
        uint16_t high;
        memcpy(&high, w + 2, 2);
        for (int ib = 0; ib < 8; ib++, out += 32) {
            int scale = ((w[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((high >> (2 * ib)) & 3) << 4);
            float dl = d * (float)(scale - 32);
            uint8_t q[32];
            nibbles32(w + 8 + 16 * ib, q);
            for (int j = 0; j < 32; j++) out[j] = dl * (float)NS_KVALUES[q[j]];
        }
    }
}

void ns_dec_q2_k(const uint8_t *w, int64_t blocks, float *out) {
    for (int64_t b = 0; b < blocks; b++, w += 84, out += 256) {
        const uint8_t *scales = w, *qs = w + 16;
        float d = half_at(w + 80), dmin = half_at(w + 82);
        for (int e = 0; e < 256; e++) {
            int h = e / 128, s = (e / 32) % 4, l = e % 32, k = e / 16;
            float dl = d * (float)(scales[k] & 15), ml = dmin * (float)(scales[k] >> 4);
            out[e] = dl * (float)((qs[32 * h + l] >> (2 * s)) & 3) - ml;
        }
    }
}

void ns_dec_q3_k(const uint8_t *w, int64_t blocks, float *out) {
    for (int64_t b = 0; b < blocks; b++, w += 110, out += 256) {
        const uint8_t *hmask = w, *qs = w + 32, *sc = w + 96;
        float d = half_at(w + 108), dl[16];
        for (int i = 0; i < 16; i++) {
            int low = i < 8 ? sc[i] & 15 : sc[i - 8] >> 4, high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
            dl[i] = d * (float)((int8_t)(low | (high << 4)) - 32);
        }
        for (int e = 0; e < 256; e++) {
            int h = e / 128, s = (e / 32) % 4, l = e % 32;
            int q = ((qs[32 * h + l] >> (2 * s)) & 3) - (((hmask[l] >> (e / 32)) & 1) ? 0 : 4);
            out[e] = dl[e / 16] * (float)q;
        }
    }
}
