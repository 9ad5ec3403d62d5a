/* kquant.c's helpers both x86 vector builds share (AVX2 instructions).
 * Included by kquant.c alone, after its shared definitions (QK, SUMS, LANES, ROWS, INLINE, NS_KVALUES, the K_
 * kinds of blocks of 32), where the build has this instruction set. */
/* The float part (see kquant.c): a row's 8 lanes in one AVX2 register in either build */
typedef __m256 Facc;
static INLINE Facc facc_zero(void) { return _mm256_setzero_ps(); }
static INLINE float facc_sum(Facc a) { /* l + 4, l + 2, l + 1 */
    __m128 u = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

static INLINE __m256 scaled(float f, __m256i ints) { return _mm256_mul_ps(_mm256_set1_ps(f), _mm256_cvtepi32_ps(ints)); }

/* Each lane's two 16-input code sums times their factors (16-bit each), in one pair product: exact */
static INLINE __m256i group_sums(const int16_t *xs, __m256i factors) {
    return _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xs), factors);
}

/* The k45 float step (Q4_K, Q5_K, Q2_K): a_l = (a_l + (d dx) I_l) - (dmin dx) M_l; mins: each 16-input group's */
static INLINE void minus_mins(Facc *acc, int n, const __m256i *ints, __m256i mins, const int16_t *xs, int64_t lds,
                              const float *dd, const float *dm) {
    for (int i = 0; i < n; i++)
        acc[i] = _mm256_sub_ps(_mm256_add_ps(acc[i], scaled(dd[i], ints[i])),
                               scaled(dm[i], group_sums(xs + i * lds, mins)));
}

/* The offset float step (Q6_K: 32 = 1 << 5, Q3_K: 4 = 1 << 2): a_l = a_l + (d dx) (I_l - (O_l << shift)) */
static INLINE void minus_offsets(Facc *acc, int n, const __m256i *ints, const int8_t sc[16], int shift,
                                 const int16_t *xs, int64_t lds, const float *dd) {
    __m256i offsets = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
    for (int i = 0; i < n; i++) {
        __m256i o = _mm256_slli_epi32(group_sums(xs + i * lds, offsets), shift);
        acc[i] = _mm256_add_ps(acc[i], scaled(dd[i], _mm256_sub_epi32(ints[i], o)));
    }
}

/* Q4_K / Q5_K's 12 scale bytes (kquant.c's scale_min_k4) unpacked in one register: the 8 scales in bytes 0-7, the
 * 8 mins in 8-15 (eight vector instructions where the scalar unpacking took some 25, a fifth of a one-row super-block's) */
static INLINE __m128i scales_mins_k4(const uint8_t *s) {
    __m128i v = _mm_loadu_si128((const __m128i *)s); /* 12 bytes and 4 of the codes after them */
    __m128i a = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4));
    a = _mm_and_si128(a, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    __m128i b = _mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)), 2); /* words 1, 3: w0, w1 */
    return _mm_or_si128(a, _mm_and_si128(b, _mm_setr_epi32(0, 0x30303030, 0, 0x30303030)));
}

/* The 8 mins of scales_mins_k4 as the 16 groups' (m_l twice) */
static INLINE __m256i mins_twice(__m128i scales_mins) {
    __m128i m8 = _mm_srli_si128(scales_mins, 8);
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
}

/* bit j of the 32 bits at qh -> 0x10 in byte j (the fifth bit of Q5_0 / Q5_1's code j) */
static INLINE __m256i fifth_bits(const uint8_t *qh) {
    uint32_t v;
    memcpy(&v, qh, 4);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                            3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i bytes = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)v), spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, bit), _mm256_set1_epi8(0x10));
}

/* a block's 32 codes in input order (input j: low nibble of qs[j], j + 16: high of qs[j]): Q5_0 signed (q - 16),
 * Q5_1 unsigned (q), IQ4_NL its table's signed values */
static INLINE __m256i codes32(const uint8_t *block, int kind) {
    const uint8_t *qs = block + (kind == K_Q5_0 ? 6 : kind == K_Q5_1 ? 8 : 2);
    const __m128i low = _mm_set1_epi8(0x0f);
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
    if (kind == K_IQ4_NL) {
        const __m128i table = _mm_loadu_si128((const __m128i *)NS_KVALUES);
        return _mm256_set_m128i(_mm_shuffle_epi8(table, hi), _mm_shuffle_epi8(table, lo));
    }
    __m256i q = _mm256_or_si256(_mm256_set_m128i(hi, lo), fifth_bits(block + (kind == K_Q5_0 ? 2 : 4)));
    return kind == K_Q5_0 ? _mm256_sub_epi8(q, _mm256_set1_epi8(16)) : q;
}
