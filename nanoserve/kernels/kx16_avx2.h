/* kx16.c's AVX2 build: eight outputs (half h of a group) a 32-byte vector, maddubs' 16-bit pair sums of code times
 * activation added in 16 bits while they stay exact, then times the scales in 16-bit pair products to 32 bits.
 * Included by kx16.c alone, after its layout definitions, where the build has this instruction set. */
#define KX_ISA "avx2"

static INLINE __m256i pair_of(const int16_t *s, int j) { /* (s[j], s[j + 1]) as a 32-bit lane's 16-bit halves */
    return _mm256_set1_epi32((int32_t)((uint16_t)s[j] | (uint32_t)(uint16_t)s[j + 1] << 16));
}

/* y = (y + (d dx) I) - (dmin dx) M for the 8 outputs at acc (dmin NULL: y + (d dx) I) */
static INLINE void float_step(float *acc, const uint8_t *d16, const uint8_t *dmin16, float dx, __m256i ints,
                              __m256i mins) {
    __m256 f = _mm256_set1_ps(dx), d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d16));
    __m256 a = _mm256_add_ps(_mm256_loadu_ps(acc), _mm256_mul_ps(_mm256_mul_ps(d, f), _mm256_cvtepi32_ps(ints)));
    if (dmin16) {
        __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dmin16));
        a = _mm256_sub_ps(a, _mm256_mul_ps(_mm256_mul_ps(dmin, f), _mm256_cvtepi32_ps(mins)));
    }
    _mm256_storeu_ps(acc, a);
}

/* the 4 activation codes at x in every 32-bit lane, straight from memory (a broadcast load, not a general
 * register's move into a vector: kx16_avx512.h's quad_at) */
typedef int32_t ns_i32_unaligned __attribute__((aligned(1), may_alias));
static INLINE __m256i quad_of(const int8_t *x) { return _mm256_set1_epi32(*(const ns_i32_unaligned *)x); }

/* Q4_K: a sub-block's eight pair sums added in 16 bits (at most 8 x 2 x 15 x 128 = 30720: exact); Q5_K's four at
 * a time (4 x 2 x 31 x 128 = 31744) */
static INLINE void k45_rows(const uint8_t *p, int five, const int8_t *x, int64_t in, int n, const float *dx,
                            const int16_t (*s)[16], float (*acc)[OUTS]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int h = 0; h < 2; h++) {
        __m256i ints[ROWS], mins[ROWS];
        for (int i = 0; i < n; i++) ints[i] = mins[i] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            __m256i q[8];
            for (int v = 0; v < 4; v++) {
                __m256i packed = _mm256_loadu_si256((const __m256i *)(p + (4 * j + v) * 64 + 32 * h));
                q[2 * v] = _mm256_and_si256(packed, low);
                q[2 * v + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
            }
            if (five) { /* quad t's fifth bits at bit t of the sub-block's byte 4 l + k, to bit 4 */
                const __m256i bit4 = _mm256_set1_epi8(0x10);
                __m256i high = _mm256_loadu_si256((const __m256i *)(p + K5_HIGH + 64 * j + 32 * h));
                for (int t = 0; t < 8; t++)
                    q[t] = _mm256_or_si256(q[t], _mm256_and_si256(t <= 4 ? _mm256_slli_epi16(high, 4 - t)
                                                                          : _mm256_srli_epi16(high, t - 4), bit4));
            }
            __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + K4_SCALES(five) + 16 * j + 8 * h)));
            sc = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16)); /* the scale in both halves of a lane */
            for (int i = 0; i < n; i++) {
                __m256i c[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
                for (int k = 0; k < 8; k++) {
                    __m256i pair = _mm256_maddubs_epi16(q[k], quad_of(x + i * in + 32 * j + 4 * k));
                    c[five && k >= 4] = _mm256_add_epi16(c[five && k >= 4], pair);
                }
                ints[i] = _mm256_add_epi32(ints[i], _mm256_madd_epi16(c[0], sc));
                if (five) ints[i] = _mm256_add_epi32(ints[i], _mm256_madd_epi16(c[1], sc));
            }
        }
        for (int pair = 0; pair < 4; pair++) {
            __m256i m = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + K4_MINS(five) + 32 * pair + 16 * h)));
            for (int i = 0; i < n; i++) {
                int16_t sums[2] = {(int16_t)(s[i][4 * pair] + s[i][4 * pair + 1]),
                                   (int16_t)(s[i][4 * pair + 2] + s[i][4 * pair + 3])};
                mins[i] = _mm256_add_epi32(mins[i], _mm256_madd_epi16(m, pair_of(sums, 0)));
            }
        }
        for (int i = 0; i < n; i++)
            float_step(acc[i] + 8 * h, p + K4_D(five) + 16 * h, p + K4_DMIN(five) + 16 * h, dx[i], ints[i], mins[i]);
    }
}

/* Q6_K: two quads' pair sums added in 16 bits (at most 2 x 2 x 63 x 128 = 32256: exact), times the sub-block's
 * scale in a pair product */
static INLINE void q6k_rows(const uint8_t *p, const int8_t *x, int64_t in, int n, const float *dx,
                            const int16_t (*s)[16], float (*acc)[OUTS]) {
    const __m256i low = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        __m256i ints[ROWS], offsets[ROWS];
        for (int i = 0; i < n; i++) ints[i] = offsets[i] = _mm256_setzero_si256();
        for (int pair = 0; pair < 8; pair++) {
            __m256i sc2 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + K6_SCALES + 32 * pair + 16 * h)));
            __m256i even = _mm256_slli_epi32(sc2, 16), odd = _mm256_srli_epi32(sc2, 16);
            __m256i scales[2] = {_mm256_or_si256(even, _mm256_srli_epi32(even, 16)),
                                 _mm256_or_si256(odd, _mm256_slli_epi32(odd, 16))}; /* each in both halves */
            for (int e = 0; e < 2; e++) {
                int u = 2 * pair + e;
                __m256i lo0 = _mm256_loadu_si256((const __m256i *)(p + K6_LO(2 * u) + 32 * h)),
                        lo1 = _mm256_loadu_si256((const __m256i *)(p + K6_LO(2 * u + 1) + 32 * h)),
                        hi = _mm256_loadu_si256((const __m256i *)(p + K6_HI(u) + 32 * h));
                __m256i q[4] = {
                    _mm256_or_si256(_mm256_and_si256(lo0, low), _mm256_and_si256(_mm256_slli_epi16(hi, 4), top)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo0, 4), low),
                                    _mm256_and_si256(_mm256_slli_epi16(hi, 2), top)),
                    _mm256_or_si256(_mm256_and_si256(lo1, low), _mm256_and_si256(hi, top)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo1, 4), low),
                                    _mm256_and_si256(_mm256_srli_epi16(hi, 2), top))};
                for (int i = 0; i < n; i++) {
                    const int8_t *xu = x + i * in + 16 * u;
                    __m256i c01 = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], quad_of(xu)),
                                                   _mm256_maddubs_epi16(q[1], quad_of(xu + 4)));
                    __m256i c23 = _mm256_add_epi16(_mm256_maddubs_epi16(q[2], quad_of(xu + 8)),
                                                   _mm256_maddubs_epi16(q[3], quad_of(xu + 12)));
                    ints[i] = _mm256_add_epi32(ints[i], _mm256_add_epi32(_mm256_madd_epi16(c01, scales[e]),
                                                                         _mm256_madd_epi16(c23, scales[e])));
                }
            }
            for (int i = 0; i < n; i++) offsets[i] = _mm256_add_epi32(offsets[i], _mm256_madd_epi16(sc2, pair_of(s[i], 2 * pair)));
        }
        for (int i = 0; i < n; i++)
            float_step(acc[i] + 8 * h, p + K6_D + 16 * h, NULL, dx[i],
                       _mm256_sub_epi32(ints[i], _mm256_slli_epi32(offsets[i], 5)), ints[i]);
    }
}
