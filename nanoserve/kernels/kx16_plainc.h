/* kx16.c's portable build: the same integers and float steps, one output and row at a time.
 * Included by kx16.c alone, after its layout definitions. */
#define KX_ISA "portable"

/* Q4_K's y = (y + (d dx) I) - (dmin dx) M; Q6_K's y + (d dx) I */
static INLINE float k4_step(float y, float d, float dmin, float dx, int32_t ints, int32_t mins) {
    float a = y + (d * dx) * (float)ints;
    return a - (dmin * dx) * (float)mins;
}

static INLINE float k6_step(float y, float d, float dx, int32_t ints) { return y + (d * dx) * (float)ints; }

static INLINE void k45_rows(const uint8_t *p, int five, const int8_t *x, int64_t in, int n, const float *dx,
                            const int16_t (*s)[16], float (*acc)[OUTS]) {
    for (int l = 0; l < OUTS; l++)
        for (int i = 0; i < n; i++) {
            const int8_t *row = x + i * in;
            int32_t ints = 0, mins = 0;
            for (int j = 0; j < 8; j++) {
                int32_t c = 0;
                for (int v = 4 * j; v < 4 * j + 4; v++)
                    for (int k = 0; k < 4; k++) {
                        uint8_t byte = p[v * 64 + 4 * l + k];
                        int lo = byte & 0x0f, hi = byte >> 4;
                        if (five) { /* quad t = 2 (v - 4 j) (+ 1 high): bit t of the sub-block's byte 4 l + k */
                            int t = 2 * (v - 4 * j), fifth = p[K5_HIGH + 64 * j + 4 * l + k];
                            lo |= ((fifth >> t) & 1) << 4, hi |= ((fifth >> (t + 1)) & 1) << 4;
                        }
                        c += lo * row[8 * v + k] + hi * row[8 * v + 4 + k];
                    }
                ints += c * p[K4_SCALES(five) + 16 * j + l];
                mins += p[K4_MINS(five) + 32 * (j / 2) + 2 * l + j % 2] * (s[i][2 * j] + s[i][2 * j + 1]);
            }
            acc[i][l] = k4_step(acc[i][l], half_at(p + K4_D(five) + 2 * l), half_at(p + K4_DMIN(five) + 2 * l), dx[i], ints, mins);
        }
}

static INLINE void q6k_rows(const uint8_t *p, const int8_t *x, int64_t in, int n, const float *dx,
                            const int16_t (*s)[16], float (*acc)[OUTS]) {
    for (int l = 0; l < OUTS; l++)
        for (int i = 0; i < n; i++) {
            const int8_t *row = x + i * in;
            int32_t ints = 0, offsets = 0;
            for (int u = 0; u < 16; u++) {
                int32_t c = 0, sc = (int8_t)p[K6_SCALES + 32 * (u / 2) + 2 * l + u % 2];
                for (int e = 16 * u; e < 16 * u + 16; e++) c += q6_code(p, l, e) * row[e];
                ints += c * sc;
                offsets += sc * s[i][u];
            }
            acc[i][l] = k6_step(acc[i][l], half_at(p + K6_D + 2 * l), dx[i], ints - offsets * 32);
        }
}
