/* kx16.c's AVX-512 VNNI build: a 64-byte vector is one input quad of all 16 outputs (output l in 32-bit lane l),
 * so a VNNI dot product serves the 16 outputs at once and the float part is one instruction a step for them.
 * Included by kx16.c alone, after its layout definitions, where the build has this instruction set. */
#define KX_ISA "avx512-vnni"

/* the 4 activation codes at x in every 32-bit lane, straight from memory: a broadcast load (read into a general
 * register first, each cost a vector instruction moving it over: 1.19-1.56x at 8 and 64 rows without, A/B in one
 * process) */
typedef int32_t ns_i32_unaligned __attribute__((aligned(1), may_alias));
static INLINE __m512i quad_at(const int8_t *x) { return _mm512_set1_epi32(*(const ns_i32_unaligned *)x); }

static INLINE __m512i pair_of(const int16_t *s, int j) { /* (s[j], s[j + 1]) as a 32-bit lane's 16-bit halves */
    return _mm512_set1_epi32((int32_t)((uint16_t)s[j] | (uint32_t)(uint16_t)s[j + 1] << 16));
}

/* y = (y + (d dx) I) - (dmin dx) M for the 16 outputs (dmin NULL: y + (d dx) I) */
static INLINE void float_step(float *acc, const uint8_t *d16, const uint8_t *dmin16, float dx, __m512i ints,
                              __m512i mins) {
    __m512 f = _mm512_set1_ps(dx), d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d16));
    __m512 a = _mm512_add_ps(_mm512_loadu_ps(acc), _mm512_mul_ps(_mm512_mul_ps(d, f), _mm512_cvtepi32_ps(ints)));
    if (dmin16) {
        __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dmin16));
        a = _mm512_sub_ps(a, _mm512_mul_ps(_mm512_mul_ps(dmin, f), _mm512_cvtepi32_ps(mins)));
    }
    _mm512_storeu_ps(acc, a);
}

static INLINE void k45_rows(const uint8_t *p, int five, const int8_t *x, int64_t in, int n, const float *dx,
                            const int16_t (*s)[16], float (*acc)[OUTS]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512i ints[ROWS], mins[ROWS];
    for (int i = 0; i < n; i++) ints[i] = mins[i] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) {
        __m512i q[8];
        for (int v = 0; v < 4; v++) {
            __m512i packed = _mm512_loadu_si512(p + (4 * j + v) * 64);
            q[2 * v] = _mm512_and_si512(packed, low);
            q[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        }
        if (five) { /* quad t's fifth bits at bit t of the sub-block's byte 4 l + k, to bit 4 */
            const __m512i bit4 = _mm512_set1_epi8(0x10);
            __m512i high = _mm512_loadu_si512(p + K5_HIGH + 64 * j);
            for (int t = 0; t < 8; t++)
                q[t] = _mm512_or_si512(q[t], _mm512_and_si512(t <= 4 ? _mm512_slli_epi16(high, 4 - t)
                                                                      : _mm512_srli_epi16(high, t - 4), bit4));
        }
        __m512i scale = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + K4_SCALES(five) + 16 * j)));
        for (int i = 0; i < n; i++) {
            __m512i c = _mm512_setzero_si512();
            for (int k = 0; k < 8; k++) c = _mm512_dpbusd_epi32(c, q[k], quad_at(x + i * in + 32 * j + 4 * k));
            ints[i] = _mm512_add_epi32(ints[i], _mm512_mullo_epi32(c, scale));
        }
    }
    for (int pair = 0; pair < 4; pair++) { /* lane l: m_2p S_2p + m_2p+1 S_2p+1 in one pair product */
        __m512i m = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + K4_MINS(five) + 32 * pair)));
        for (int i = 0; i < n; i++) {
            int16_t sums[2] = {(int16_t)(s[i][4 * pair] + s[i][4 * pair + 1]),
                               (int16_t)(s[i][4 * pair + 2] + s[i][4 * pair + 3])};
            mins[i] = _mm512_dpwssd_epi32(mins[i], m, pair_of(sums, 0));
        }
    }
    for (int i = 0; i < n; i++) float_step(acc[i], p + K4_D(five), p + K4_DMIN(five), dx[i], ints[i], mins[i]);
}

static INLINE void q6k_rows(const uint8_t *p, const int8_t *x, int64_t in, int n, const float *dx,
                            const int16_t (*s)[16], float (*acc)[OUTS]) {
    const __m512i low = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
    __m512i ints[ROWS], offsets[ROWS];
    for (int i = 0; i < n; i++) ints[i] = offsets[i] = _mm512_setzero_si512();
    for (int pair = 0; pair < 8; pair++) {
        __m512i sc2 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p + K6_SCALES + 32 * pair)));
        __m512i scales[2] = {_mm512_srai_epi32(_mm512_slli_epi32(sc2, 16), 16), _mm512_srai_epi32(sc2, 16)};
        for (int h = 0; h < 2; h++) {
            int u = 2 * pair + h;
            __m512i lo0 = _mm512_loadu_si512(p + K6_LO(2 * u)), lo1 = _mm512_loadu_si512(p + K6_LO(2 * u + 1)),
                    hi = _mm512_loadu_si512(p + K6_HI(u));
            __m512i q[4] = {
                _mm512_or_si512(_mm512_and_si512(lo0, low), _mm512_and_si512(_mm512_slli_epi16(hi, 4), top)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo0, 4), low),
                                _mm512_and_si512(_mm512_slli_epi16(hi, 2), top)),
                _mm512_or_si512(_mm512_and_si512(lo1, low), _mm512_and_si512(hi, top)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo1, 4), low),
                                _mm512_and_si512(_mm512_srli_epi16(hi, 2), top))};
            for (int i = 0; i < n; i++) {
                __m512i c = _mm512_setzero_si512();
                for (int t = 0; t < 4; t++) c = _mm512_dpbusd_epi32(c, q[t], quad_at(x + i * in + 16 * u + 4 * t));
                ints[i] = _mm512_add_epi32(ints[i], _mm512_mullo_epi32(c, scales[h]));
            }
        }
        for (int i = 0; i < n; i++) offsets[i] = _mm512_dpwssd_epi32(offsets[i], sc2, pair_of(s[i], 2 * pair));
    }
    for (int i = 0; i < n; i++)
        float_step(acc[i], p + K6_D, NULL, dx[i], _mm512_sub_epi32(ints[i], _mm512_slli_epi32(offsets[i], 5)),
                   ints[i]);
}
