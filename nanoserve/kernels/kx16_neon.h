/* kx16.c's NEON dotprod build: four outputs (quarter m of a group) a 16-byte slice of each vector, SDOT of the codes
 * (0..63 as signed bytes) against the activation quads, the scales by multiply-add.
 * Included by kx16.c alone, after its layout definitions, where the build has this instruction set. */
#define KX_ISA "neon-dotprod"

static INLINE int32x4_t quad_dot(int32x4_t c, int8x16_t q, const int8_t *x) {
    int32_t quad;
    memcpy(&quad, x, 4);
    return vdotq_s32(c, q, vreinterpretq_s8_s32(vdupq_n_s32(quad)));
}

/* lane l: w[2 l] a + w[2 l + 1] b, for a 16-bit pair (a, b) and eight 16-bit factors w (four lanes' pairs) */
static INLINE int32x4_t pair_products(int16x8_t w, int16_t a, int16_t b) {
    int16x4_t ab = vreinterpret_s16_s32(vdup_n_s32((int32_t)((uint16_t)a | (uint32_t)(uint16_t)b << 16)));
    return vpaddq_s32(vmull_s16(vget_low_s16(w), ab), vmull_s16(vget_high_s16(w), ab));
}

/* y = (y + (d dx) I) - (dmin dx) M for the 4 outputs at acc (dmin NULL: y + (d dx) I) */
static INLINE void float_step(float *acc, const uint8_t *d16, const uint8_t *dmin16, float dx, int32x4_t ints,
                              int32x4_t mins) {
    float32x4_t f = vdupq_n_f32(dx), d = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)d16)));
    float32x4_t a = vaddq_f32(vld1q_f32(acc), vmulq_f32(vmulq_f32(d, f), vcvtq_f32_s32(ints)));
    if (dmin16) {
        float32x4_t dmin = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)dmin16)));
        a = vsubq_f32(a, vmulq_f32(vmulq_f32(dmin, f), vcvtq_f32_s32(mins)));
    }
    vst1q_f32(acc, a);
}

static INLINE void k45_rows(const uint8_t *p, int five, const int8_t *x, int64_t in, int n, const float *dx,
                            const int16_t (*s)[16], float (*acc)[OUTS]) {
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
            if (five) { /* quad t's fifth bits at bit t of the sub-block's byte 4 l + k, to bit 4 */
                uint8x16_t high = vld1q_u8(p + K5_HIGH + 64 * j + 16 * m);
                for (int t = 0; t < 8; t++)
                    q[t] = vorrq_s8(q[t], vreinterpretq_s8_u8(vandq_u8(vshlq_u8(high, vdupq_n_s8((int8_t)(4 - t))),
                                                                       vdupq_n_u8(0x10))));
            }
            uint32_t four;
            memcpy(&four, p + K4_SCALES(five) + 16 * j + 4 * m, 4);
            int32x4_t sc = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8(four)))));
            for (int i = 0; i < n; i++) {
                int32x4_t c = vdupq_n_s32(0);
                for (int k = 0; k < 8; k++) c = quad_dot(c, q[k], x + i * in + 32 * j + 4 * k);
                ints[i] = vmlaq_s32(ints[i], c, sc);
            }
        }
        for (int pair = 0; pair < 4; pair++) {
            int16x8_t mm = vreinterpretq_s16_u16(vmovl_u8(vld1_u8(p + K4_MINS(five) + 32 * pair + 8 * m)));
            for (int i = 0; i < n; i++)
                mins[i] = vaddq_s32(mins[i], pair_products(mm, (int16_t)(s[i][4 * pair] + s[i][4 * pair + 1]),
                                                           (int16_t)(s[i][4 * pair + 2] + s[i][4 * pair + 3])));
        }
        for (int i = 0; i < n; i++)
            float_step(acc[i] + 4 * m, p + K4_D(five) + 8 * m, p + K4_DMIN(five) + 8 * m, dx[i], ints[i], mins[i]);
    }
}

static INLINE void q6k_rows(const uint8_t *p, const int8_t *x, int64_t in, int n, const float *dx,
                            const int16_t (*s)[16], float (*acc)[OUTS]) {
    const uint8x16_t low = vdupq_n_u8(0x0f), top = vdupq_n_u8(0x30);
    for (int m = 0; m < 4; m++) {
        int32x4_t ints[ROWS], offsets[ROWS];
        for (int i = 0; i < n; i++) ints[i] = offsets[i] = vdupq_n_s32(0);
        for (int pair = 0; pair < 8; pair++) {
            int16x8_t sc2 = vmovl_s8(vld1_s8((const int8_t *)(p + K6_SCALES + 32 * pair + 8 * m)));
            int32x4_t scales[2] = {vmovl_s16(vget_low_s16(vuzp1q_s16(sc2, sc2))),
                                   vmovl_s16(vget_low_s16(vuzp2q_s16(sc2, sc2)))};
            for (int e = 0; e < 2; e++) {
                int u = 2 * pair + e;
                uint8x16_t lo0 = vld1q_u8(p + K6_LO(2 * u) + 16 * m), lo1 = vld1q_u8(p + K6_LO(2 * u + 1) + 16 * m),
                           hi = vld1q_u8(p + K6_HI(u) + 16 * m);
                int8x16_t q[4] = {
                    vreinterpretq_s8_u8(vorrq_u8(vandq_u8(lo0, low), vandq_u8(vshlq_n_u8(hi, 4), top))),
                    vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(lo0, 4), vandq_u8(vshlq_n_u8(hi, 2), top))),
                    vreinterpretq_s8_u8(vorrq_u8(vandq_u8(lo1, low), vandq_u8(hi, top))),
                    vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(lo1, 4), vandq_u8(vshrq_n_u8(hi, 2), top)))};
                for (int i = 0; i < n; i++) {
                    int32x4_t c = vdupq_n_s32(0);
                    for (int t = 0; t < 4; t++) c = quad_dot(c, q[t], x + i * in + 16 * u + 4 * t);
                    ints[i] = vmlaq_s32(ints[i], c, scales[e]);
                }
            }
            for (int i = 0; i < n; i++)
                offsets[i] = vaddq_s32(offsets[i], pair_products(sc2, s[i][2 * pair], s[i][2 * pair + 1]));
        }
        for (int i = 0; i < n; i++)
            float_step(acc[i] + 4 * m, p + K6_D + 8 * m, NULL, dx[i], vsubq_s32(ints[i], vshlq_n_s32(offsets[i], 5)),
                       ints[i]);
    }
}
