/* kquant.c's AVX2 build: a row's 8 integer and 8 float lanes in one register each, 16-bit pair products.
 * Included by kquant.c alone, after its shared definitions (QK, SUMS, LANES, ROWS, INLINE, NS_KVALUES, the K_
 * kinds of blocks of 32), where the build has this instruction set. */
/* 16 float lanes (the 16-bit rows' first tree step, l + 8, then facc_sum) */
static INLINE float sum16(__m256 lo, __m256 hi) { return facc_sum(_mm256_add_ps(lo, hi)); }

/* One chunk of 64 inputs: 2 x 32 unsigned codes (at most 63) against each row's 64 signed activations in 16-bit
 * pairs (no saturation: 2 63 127 < 2^15), each pair times its 16-bit scale, summed in 32 bits into the row's 8
 * lanes (the chunk's first 32 inputs, ql, and its last 32, qh, into the same lane). The chunk's codes are made and
 * used at once: AVX2 has 16 vector registers, and all 8 chunks' codes and scales held beside 4 rows' sums spilled
 * (measured 5.4x slower at 64 rows). */
static INLINE void rows_chunk(__m256i ql, __m256i sl, __m256i qh, __m256i sh, const int8_t *x, int64_t ldx, int n,
                              __m256i *ints) {
    for (int i = 0; i < n; i++) {
        const int8_t *at = x + i * ldx;
        __m256i p0 = _mm256_maddubs_epi16(ql, _mm256_loadu_si256((const __m256i *)at));
        __m256i p1 = _mm256_maddubs_epi16(qh, _mm256_loadu_si256((const __m256i *)(at + 32)));
        ints[i] = _mm256_add_epi32(ints[i], _mm256_add_epi32(_mm256_madd_epi16(p0, sl), _mm256_madd_epi16(p1, sh)));
    }
}

/* The 16 signed scales as 16-bit words, words 0-7 (low) and 8-15 (high) in both 128-bit halves */
static INLINE void scale_halves(const int8_t sc[16], __m256i *first8, __m256i *last8) {
    __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
    *first8 = _mm256_permute2x128_si256(sc16, sc16, 0x00), *last8 = _mm256_permute2x128_si256(sc16, sc16, 0x11);
}

/* Word w of each 128-bit half of v in all that half's words (a shuffle control per word) */
static INLINE __m256i word_everywhere(__m256i v, int lo_word, int hi_word) {
    __m128i lo = _mm_set1_epi16((short)((2 * lo_word + 1) << 8 | 2 * lo_word)),
            hi = _mm_set1_epi16((short)((2 * hi_word + 1) << 8 | 2 * hi_word));
    return _mm256_shuffle_epi8(v, _mm256_setr_m128i(lo, hi));
}

static INLINE void ints_zero(int n, __m256i *ints) {
    for (int i = 0; i < n; i++) ints[i] = _mm256_setzero_si256();
}

static INLINE void block_k45(const uint8_t *qs, const uint8_t *qh, const int8_t *x, int64_t ldx, int n,
                             const uint8_t *scales12, const int16_t *xs, int64_t lds, const float *dd, const float *dm,
                             Facc *acc) {
    __m128i scales_mins = scales_mins_k4(scales12);
    const __m256i low = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    __m256i high = qh ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
    __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scales_mins));
    __m256i ints[ROWS];
    ints_zero(n, ints);
    for (int j = 0; j < 4; j++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        __m256i l = _mm256_and_si256(raw, low), h = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        if (qh) {
            l = _mm256_or_si256(l, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j), one), 4));
            h = _mm256_or_si256(h, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j + 1), one), 4));
        }
        rows_chunk(l, word_everywhere(scales, 2 * j, 2 * j), h, word_everywhere(scales, 2 * j + 1, 2 * j + 1), x + 64 * j,
                   ldx, n, ints);
    }
    minus_mins(acc, n, ints, mins_twice(scales_mins), xs, lds, dd, dm);
}

static INLINE void block_q6k(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const int8_t *x, int64_t ldx,
                             int n, const int16_t *xs, int64_t lds, const float *dd, Facc *acc) {
    const __m256i mask = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(3);
    __m256i first8, last8;
    scale_halves(sc, &first8, &last8);
    __m256i ints[ROWS];
    ints_zero(n, ints);
    for (int c = 0; c < 4; c++) {
        int h = c >> 1, s = c & 1;
        __m256i h32 = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h)),
                l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
        __m256i qa = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4 * s), mask),
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h32, 4 * s), two), 4));
        __m256i qb = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4 * s), mask),
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h32, 4 * s + 2), two), 4));
        __m256i half = c < 2 ? first8 : last8; /* words 4 c .. 4 c + 3 of the 16 */
        rows_chunk(qa, word_everywhere(half, 4 * c % 8, 4 * c % 8 + 1), qb,
                   word_everywhere(half, 4 * c % 8 + 2, 4 * c % 8 + 3), x + 64 * c, ldx, n, ints);
    }
    minus_offsets(acc, n, ints, sc, 5, xs, lds, dd);
}

/* Q2_K / Q3_K's codes (see the AVX-512 build), chunk by chunk, each lane pair's scale in 16 bits */
static INLINE void ints_2bit(const uint8_t *qs, const uint8_t *hmask, const int8_t sc[16], const int8_t *x,
                             int64_t ldx, int n, __m256i *ints) {
    const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    __m256i hm = hmask ? _mm256_loadu_si256((const __m256i *)hmask) : _mm256_setzero_si256();
    __m256i first8, last8;
    scale_halves(sc, &first8, &last8);
    ints_zero(n, ints);
    for (int c = 0; c < 4; c++) {
        int s = 2 * (c & 1);
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * (c >> 1)));
        __m256i qa = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * s), three);
        __m256i qb = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * s + 2), three);
        if (hmask) {
            qa = _mm256_or_si256(qa, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 2 * c), one), 2));
            qb = _mm256_or_si256(qb, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 2 * c + 1), one), 2));
        }
        __m256i half = c < 2 ? first8 : last8; /* words 4 c .. 4 c + 3 of the 16 */
        rows_chunk(qa, word_everywhere(half, 4 * c % 8, 4 * c % 8 + 1), qb,
                   word_everywhere(half, 4 * c % 8 + 2, 4 * c % 8 + 3), x + 64 * c, ldx, n, ints);
    }
}

static INLINE void block_q2k(const uint8_t *qs, const int8_t sc[16], const uint8_t m[16], const int8_t *x,
                             int64_t ldx, int n, const int16_t *xs, int64_t lds, const float *dd, const float *dm,
                             Facc *acc) {
    __m256i ints[ROWS];
    ints_2bit(qs, NULL, sc, x, ldx, n, ints);
    minus_mins(acc, n, ints, _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)m)), xs, lds, dd, dm);
}

static INLINE void block_q3k(const uint8_t *qs, const uint8_t *hmask, const int8_t sc[16], const int8_t *x,
                             int64_t ldx, int n, const int16_t *xs, int64_t lds, const float *dd, Facc *acc) {
    __m256i ints[ROWS];
    ints_2bit(qs, hmask, sc, x, ldx, n, ints);
    minus_offsets(acc, n, ints, sc, 2, xs, lds, dd);
}

/* IQ4_XS (see the AVX-512 build): signed codes, |w| times x with w's sign in 16-bit pairs */
static INLINE void block_iq4xs(const uint8_t *qs, const int8_t sc[8], const int8_t *x, int64_t ldx, int n,
                               const float *dd, Facc *acc) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)NS_KVALUES));
    __m256i ints[ROWS];
    ints_zero(n, ints);
    for (int c = 0; c < 4; c++) { /* chunk by chunk, as rows_chunk (16 registers) */
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i l = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, low)),
                h = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
        __m256i qa = _mm256_permute2x128_si256(l, h, 0x20), qb = _mm256_permute2x128_si256(l, h, 0x31);
        __m256i sa = _mm256_set1_epi16(sc[2 * c]), sb = _mm256_set1_epi16(sc[2 * c + 1]);
        __m256i za = _mm256_abs_epi8(qa), zb = _mm256_abs_epi8(qb);
        for (int i = 0; i < n; i++) {
            const int8_t *at = x + i * ldx + 64 * c;
            __m256i x0 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)at), qa),
                    x1 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(at + 32)), qb);
            ints[i] = _mm256_add_epi32(ints[i], _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(za, x0), sa),
                                                                  _mm256_madd_epi16(_mm256_maddubs_epi16(zb, x1), sb)));
        }
    }
    for (int i = 0; i < n; i++) acc[i] = _mm256_add_ps(acc[i], scaled(dd[i], ints[i]));
}

/* Blocks 2 c and 2 c + 1 of a run (see kquant.c): block 2 c's (d dx) I (and Q5_1's (m dx) S) into the lanes, then
 * block 2 c + 1's */
static INLINE void block32(const uint8_t *w, int bytes, int kind, const float d[8], const float m[8],
                           const int8_t *x, int64_t ldx, int n, const float *dx, Facc *acc) {
    const __m256i ones16 = _mm256_set1_epi16(1), ones8 = _mm256_set1_epi8(1);
    for (int c = 0; c < 4; c++) {
        __m256i q[2] = {codes32(w + 2 * c * bytes, kind), codes32(w + (2 * c + 1) * bytes, kind)};
        for (int i = 0; i < n; i++) {
            __m256 f = _mm256_set1_ps(dx[i]);
            for (int h = 0; h < 2; h++) {
                int b = 2 * c + h;
                __m256i v = _mm256_loadu_si256((const __m256i *)(x + i * ldx + 64 * c + 32 * h));
                __m256i size = kind == K_Q5_1 ? q[h] : _mm256_abs_epi8(q[h]);
                if (kind != K_Q5_1) v = _mm256_sign_epi8(v, q[h]);
                __m256i ints = _mm256_madd_epi16(_mm256_maddubs_epi16(size, v), ones16);
                acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d[b]), f),
                                                             _mm256_cvtepi32_ps(ints)));
                if (kind == K_Q5_1) {
                    __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, v), ones16);
                    acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(m[b]), f),
                                                                 _mm256_cvtepi32_ps(sums)));
                }
            }
        }
    }
}

/* F16 / BF16 rows: 32 float lanes a row as four 8-lane registers, each a fused multiply-add of the weight
 * (converted exactly) and the activation, unit after unit; rows two at a time (eight accumulators: sixteen
 * would spill), each pair converting the weights again */
#if !defined(__FMA__) || !defined(__F16C__)
#error "the AVX2 build of kquant.c needs FMA and F16C (every AVX2 CPU has both)"
#endif
static INLINE __m256 half8(const uint8_t *p, int bf16) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}

static INLINE void pair_half(const uint8_t *w, int bf16, const float *x, int64_t in, int n, float *sums) {
    __m256 acc[2][4];
    for (int i = 0; i < n; i++)
        for (int k = 0; k < 4; k++) acc[i][k] = _mm256_setzero_ps();
    for (int64_t u = 0; u < in; u += HALF_UNIT, w += 2 * HALF_UNIT)
        for (int k = 0; k < 4; k++) {
            __m256 a = half8(w + 16 * k, bf16);
            for (int i = 0; i < n; i++)
                acc[i][k] = _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i * in + u + 8 * k), acc[i][k]);
        }
    for (int i = 0; i < n; i++) /* lane l + 16, then the tree */
        sums[i] = sum16(_mm256_add_ps(acc[i][0], acc[i][2]), _mm256_add_ps(acc[i][1], acc[i][3]));
}

static INLINE void rows_half(const uint8_t *w, int bf16, const float *x, int64_t in, int n, float *sums) {
    for (int i = 0; i < n; i += 2) pair_half(w, bf16, x + i * in, in, n - i < 2 ? n - i : 2, sums + i);
}
