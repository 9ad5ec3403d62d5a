/* kquant.c's helpers both x86 vector builds share (AVX2 instructions).
 * Included by kquant.c alone, after its shared definitions (QK, SUMS, LANES, ROWS, INLINE, NS_KVALUES, the K_
 * kinds of blocks of 32), where the build has this instruction set. */
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
