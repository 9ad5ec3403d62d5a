/* kquant.c's plain C build (any CPU): each lane's integers and floats one at a time, the same values. The NEON
 * build takes its float part and replaces its integer parts (NS_KQ_NEON). Included by kquant.c alone, after its shared definitions (QK, SUMS, LANES, ROWS, INLINE, NS_KVALUES, the K_
 * kinds of blocks of 32), where the build has this instruction set. */
typedef struct {
    float v[LANES];
} Facc;
static INLINE Facc facc_zero(void) { return (Facc){{0.0f}}; }
static INLINE float facc_sum(Facc a) {
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int l = 0; l < width; l++) a.v[l] = a.v[l] + a.v[l + width];
    return a.v[0];
}

/* One row's exact integer sums per 4 inputs of each 64 (QUADS of them: quad q takes inputs 4 q .. 4 q + 3 of each
 * chunk), times their sub-block scale; lane l of the float part takes quads l and l + 8 (kquant.c). The codes'
 * products go through a plain array in input order first, so the compiler vectorizes that loop. */
#define QUADS 16
#ifndef NS_KQ_NEON /* the NEON build's own quads (kquant_neon.h): the same integers by SDOT */
static INLINE void quads_k45(const uint8_t *qs, const uint8_t *qh, const int8_t *x, const uint8_t sc[8],
                             int32_t quads[QUADS]) {
    for (int l = 0; l < QUADS; l++) quads[l] = 0;
    for (int j = 0; j < 4; j++) {
        int32_t p[64];
        for (int b = 0; b < 32; b++) {
            int h = qh ? qh[b] : 0;
            p[b] = ((qs[32 * j + b] & 15) | (((h >> (2 * j)) & 1) << 4)) * x[64 * j + b];
            p[32 + b] = ((qs[32 * j + b] >> 4) | (((h >> (2 * j + 1)) & 1) << 4)) * x[64 * j + 32 + b];
        }
        for (int l = 0; l < QUADS; l++)
            quads[l] += sc[2 * j + (l >= 8)] * (p[4 * l] + p[4 * l + 1] + p[4 * l + 2] + p[4 * l + 3]);
    }
}

static INLINE void quads_q6k(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const int8_t *x,
                             int32_t quads[QUADS]) {
    for (int l = 0; l < QUADS; l++) quads[l] = 0;
    for (int c = 0; c < 4; c++) {
        int h = c >> 1, s = c & 1;
        int32_t p[64];
        for (int i = 0; i < 64; i++) /* ql byte 64 h + i, input 64 c + i */
            p[i] = (((ql[64 * h + i] >> (4 * s)) & 15) | (((qh[32 * h + (i & 31)] >> (4 * s + 2 * (i >> 5))) & 3) << 4)) *
                   x[64 * c + i];
        for (int l = 0; l < QUADS; l++)
            quads[l] += sc[4 * c + l / 4] * (p[4 * l] + p[4 * l + 1] + p[4 * l + 2] + p[4 * l + 3]);
    }
}

#endif

/* Q6_K / Q3_K's O_l: the lane's two 16-input groups' code sums times their scales */
static INLINE int32_t offsets(const int8_t sc[16], const int16_t *s, int l) {
    return sc[2 * l] * s[2 * l] + sc[2 * l + 1] * s[2 * l + 1];
}

static INLINE void block_k45(const uint8_t *qs, const uint8_t *qh, const int8_t *x, int64_t ldx, int n,
                             const uint8_t *scales12, const int16_t *xs, int64_t lds, const float *dd, const float *dm,
                             Facc *acc) {
    uint8_t sc[8], m[8];
    scale_min_k4(scales12, sc, m);
    for (int i = 0; i < n; i++) {
        int32_t ints[QUADS];
        quads_k45(qs, qh, x + i * ldx, sc, ints);
        for (int l = 0; l < LANES; l++) {
            const int16_t *s = xs + i * lds + 2 * l;
            int32_t mins = m[l] * s[0] + m[l] * s[1];
            acc[i].v[l] = (acc[i].v[l] + dd[i] * (float)(ints[l] + ints[l + 8])) - dm[i] * (float)mins;
        }
    }
}

static INLINE void block_q6k(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const int8_t *x, int64_t ldx,
                             int n, const int16_t *xs, int64_t lds, const float *dd, Facc *acc) {
    for (int i = 0; i < n; i++) {
        int32_t ints[QUADS];
        quads_q6k(ql, qh, sc, x + i * ldx, ints);
        for (int l = 0; l < LANES; l++)
            acc[i].v[l] = acc[i].v[l] + dd[i] * (float)(ints[l] + ints[l + 8] - 32 * offsets(sc, xs + i * lds, l));
    }
}

#ifndef NS_KQ_NEON
/* Q2_K / Q3_K's quads for one row (see the AVX-512 build for the layout) */
static INLINE void quads_2bit(const uint8_t *qs, const uint8_t *hmask, const int8_t sc[16], const int8_t *x,
                              int32_t quads[QUADS]) {
    for (int l = 0; l < QUADS; l++) quads[l] = 0;
    for (int c = 0; c < 4; c++) {
        int32_t p[64];
        for (int i = 0; i < 64; i++) {
            int e = 64 * c + i, byte = 32 * (c >> 1) + (i & 31), shift = 2 * (2 * (c & 1) + (i >> 5));
            int u = ((qs[byte] >> shift) & 3) | (hmask ? ((hmask[i & 31] >> (e / 32)) & 1) << 2 : 0);
            p[i] = u * x[e];
        }
        for (int l = 0; l < QUADS; l++)
            quads[l] += sc[4 * c + l / 4] * (p[4 * l] + p[4 * l + 1] + p[4 * l + 2] + p[4 * l + 3]);
    }
}

#endif

static INLINE void block_q2k(const uint8_t *qs, const int8_t sc[16], const uint8_t m[16], const int8_t *x,
                             int64_t ldx, int n, const int16_t *xs, int64_t lds, const float *dd, const float *dm,
                             Facc *acc) {
    for (int i = 0; i < n; i++) {
        int32_t ints[QUADS];
        quads_2bit(qs, NULL, sc, x + i * ldx, ints);
        for (int l = 0; l < LANES; l++) {
            const int16_t *s = xs + i * lds + 2 * l;
            int32_t mins = m[2 * l] * s[0] + m[2 * l + 1] * s[1];
            acc[i].v[l] = (acc[i].v[l] + dd[i] * (float)(ints[l] + ints[l + 8])) - dm[i] * (float)mins;
        }
    }
}

static INLINE void block_q3k(const uint8_t *qs, const uint8_t *hmask, const int8_t sc[16], const int8_t *x,
                             int64_t ldx, int n, const int16_t *xs, int64_t lds, const float *dd, Facc *acc) {
    for (int i = 0; i < n; i++) {
        int32_t ints[QUADS];
        quads_2bit(qs, hmask, sc, x + i * ldx, ints);
        for (int l = 0; l < LANES; l++)
            acc[i].v[l] = acc[i].v[l] + dd[i] * (float)(ints[l] + ints[l + 8] - 4 * offsets(sc, xs + i * lds, l));
    }
}

#ifndef NS_KQ_NEON
/* IQ4_XS's quads for one row: its nibbles' NS_KVALUES times the activations, at their block's scale */
static INLINE void quads_iq4xs(const uint8_t *qs, const int8_t sc[8], const int8_t *x, int32_t quads[QUADS]) {
    for (int l = 0; l < QUADS; l++) quads[l] = 0;
    for (int c = 0; c < 4; c++) {
        int32_t p[64];
        for (int e = 0; e < 64; e++) { /* block 2 c + e / 32, input e % 32 of it */
            int byte = qs[32 * c + 16 * (e / 32) + (e & 15)];
            p[e] = NS_KVALUES[(e & 16) ? byte >> 4 : byte & 15] * x[64 * c + e];
        }
        for (int l = 0; l < QUADS; l++)
            quads[l] += sc[2 * c + (l >= 8)] * (p[4 * l] + p[4 * l + 1] + p[4 * l + 2] + p[4 * l + 3]);
    }
}
#endif

static INLINE void block_iq4xs(const uint8_t *qs, const int8_t sc[8], const int8_t *x, int64_t ldx, int n,
                               const float *dd, Facc *acc) {
    for (int i = 0; i < n; i++) {
        int32_t quads[QUADS];
        quads_iq4xs(qs, sc, x + i * ldx, quads);
        for (int l = 0; l < LANES; l++) acc[i].v[l] = acc[i].v[l] + dd[i] * (float)(quads[l] + quads[l + 8]);
    }
}

static INLINE int code32(const uint8_t *block, int kind, int j) {
    const uint8_t *qs = block + (kind == K_Q5_0 ? 6 : kind == K_Q5_1 ? 8 : 2);
    int q = j < 16 ? qs[j] & 15 : qs[j - 16] >> 4;
    if (kind == K_IQ4_NL) return NS_KVALUES[q];
    uint32_t qh;
    memcpy(&qh, block + (kind == K_Q5_0 ? 2 : 4), 4);
    q |= (int)((qh >> j) & 1) << 4;
    return kind == K_Q5_0 ? q - 16 : q;
}

static INLINE void block32(const uint8_t *w, int bytes, int kind, const float d[8], const float m[8],
                           const int8_t *x, int64_t ldx, int n, const float *dx, Facc *acc) {
    for (int i = 0; i < n; i++)
        for (int c = 0; c < 4; c++)
            for (int h = 0; h < 2; h++) { /* block 2 c, then 2 c + 1 */
                int b = 2 * c + h;
                for (int l = 0; l < LANES; l++) {
                    const int8_t *v = x + i * ldx + 64 * c + 32 * h + 4 * l;
                    int32_t ints = 0, sums = 0;
                    for (int k = 0; k < 4; k++) ints += code32(w + b * bytes, kind, 4 * l + k) * v[k], sums += v[k];
                    acc[i].v[l] = acc[i].v[l] + (d[b] * dx[i]) * (float)ints;
                    if (kind == K_Q5_1) acc[i].v[l] = acc[i].v[l] + (m[b] * dx[i]) * (float)sums;
                }
            }
}

#ifndef NS_KQ_NEON
/* F16 / BF16 rows: 32 float lanes a row, each a fused multiply-add of the weight (converted exactly) and the
 * activation, unit after unit, then the lanes' fixed tree */
static INLINE float half_value(const uint8_t *p, int bf16) {
    uint16_t h;
    memcpy(&h, p, 2);
    if (!bf16) return f16_to_f32(h);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static INLINE void rows_half(const uint8_t *w, int bf16, const float *x, int64_t in, int n, float *sums) {
    for (int i = 0; i < n; i++) {
        float a[HALF_UNIT] = {0.0f};
        for (int64_t u = 0; u < in; u += HALF_UNIT)
            for (int l = 0; l < HALF_UNIT; l++) a[l] = fmaf(half_value(w + 2 * (u + l), bf16), x[i * in + u + l], a[l]);
        for (int width = HALF_UNIT / 2; width >= 1; width /= 2)
            for (int l = 0; l < width; l++) a[l] = a[l] + a[l + width];
        sums[i] = a[0];
    }
}
#endif
