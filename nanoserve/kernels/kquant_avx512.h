/* kquant.c's AVX-512 VNNI build: 64-byte codes, a row's 16 integer lanes in one register, folded to the 8 float
 * lanes (kquant_x86.h's float steps).
 * Included by kquant.c alone, after its shared definitions (QK, SUMS, LANES, ROWS, INLINE, NS_KVALUES, the K_
 * kinds of blocks of 32), where the build has this instruction set. */
/* The integer lanes l and l + 8 of a 16-lane register added: the float part's 8 lanes (kquant.c) */
static INLINE __m256i fold(__m512i ints) {
    return _mm256_add_epi32(_mm512_castsi512_si256(ints), _mm512_extracti64x4_epi64(ints, 1));
}

static inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

/* Two chunks of 64 unsigned codes (at most 63) against each row's two chunks of 64 signed activations (at most
 * 127 in size): each chunk's 4-byte dot products into 32-bit lanes (at most 4 63 127 < 2^15 in size), the two
 * chunks' lane l then paired as 16-bit halves and multiplied by their sub-blocks' scales (sa, sb: a 32-bit lane's
 * scale) in one pair product into the row's 32-bit lane. Exact; three multiplying instructions a row for 128
 * inputs where byte pairs to 16 bits and a pair product per chunk took four (measured 1.08-1.12x on Q4_K at 8-64
 * rows). The rows go innermost, so one row (decode) is the plain loop and the weight vectors serve n rows. */
static INLINE void rows_step2(__m512i *acc, __m512i qa, __m512i sa, __m512i qb, __m512i sb, const int8_t *x,
                              int64_t ldx, int n) {
    __m512i pair = _mm512_mask_blend_epi16(0xAAAAAAAAu, sa, _mm512_slli_epi32(sb, 16));
    for (int i = 0; i < n; i++) {
        __m512i ta = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qa, _mm512_loadu_si512((const void *)(x + i * ldx)));
        __m512i tb = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qb,
                                         _mm512_loadu_si512((const void *)(x + i * ldx + 64)));
        acc[i] = _mm512_dpwssd_epi32(acc[i], _mm512_mask_blend_epi16(0xAAAAAAAAu, ta, _mm512_slli_epi32(tb, 16)), pair);
    }
}

/* Each row's folded lanes */
static INLINE void fold_rows(int n, const __m512i *ints, __m256i *lanes) {
    for (int i = 0; i < n; i++) lanes[i] = fold(ints[i]);
}

static INLINE void block_k45(const uint8_t *qs, const uint8_t *qh, const int8_t *x, int64_t ldx, int n,
                             const uint8_t *scales12, const int16_t *xs, int64_t lds, const float *dd, const float *dm,
                             Facc *acc) {
    __m128i scales_mins = scales_mins_k4(scales12);
    const __m256i low = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    __m256i high = qh ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
    __m512i scales = _mm512_castsi256_si512(_mm256_cvtepu8_epi32(scales_mins));
    __m512i ints[ROWS];
    __m512i q[4], scale[4];
    for (int i = 0; i < n; i++) ints[i] = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        if (qh) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j + 1), one), 4));
        }
        /* lanes 0-7: sub-block 2 j, 8-15: sub-block 2 j + 1 */
        __m512i pick = join(_mm256_set1_epi32(2 * j), _mm256_set1_epi32(2 * j + 1));
        q[j] = join(lo, hi), scale[j] = _mm512_permutexvar_epi32(pick, scales);
    }
    rows_step2(ints, q[0], scale[0], q[1], scale[1], x, ldx, n);
    rows_step2(ints, q[2], scale[2], q[3], scale[3], x + 128, ldx, n);
    __m256i lanes[ROWS];
    fold_rows(n, ints, lanes);
    minus_mins(acc, n, lanes, mins_twice(scales_mins), xs, lds, dd, dm);
}

static INLINE void block_q6k(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const int8_t *x, int64_t ldx,
                             int n, const int16_t *xs, int64_t lds, const float *dd, Facc *acc) {
    const __m256i low = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(3);
    const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512i ints[ROWS], q[4], scale[4];
    for (int i = 0; i < n; i++) ints[i] = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        int h = c >> 1, s = c & 1;
        __m256i h32 = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h)),
                l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
        __m256i q0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4 * s), low),
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h32, 4 * s), two), 4));
        __m256i q1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4 * s), low),
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h32, 4 * s + 2), two), 4));
        int32_t four;
        memcpy(&four, sc + 4 * c, 4);
        /* lanes 4 k .. 4 k + 3: sub-block 4 c + k */
        q[c] = join(q0, q1), scale[c] = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(four), spread));
    }
    rows_step2(ints, q[0], scale[0], q[1], scale[1], x, ldx, n);
    rows_step2(ints, q[2], scale[2], q[3], scale[3], x + 128, ldx, n);
    __m256i lanes[ROWS];
    fold_rows(n, ints, lanes);
    minus_offsets(acc, n, lanes, sc, 5, xs, lds, dd);
}

/* Q2_K / Q3_K: 256 codes of 2 bits (input 128 h + 32 s + l at bits 2 s of qs[32 h + l]), with Q3_K's third bit
 * (bit input / 32 of hmask[l]) as 4; sc the 16 scales, one per 16 inputs: lane l of chunk c takes sc[4 c + l / 4] */
static INLINE void ints_2bit(const uint8_t *qs, const uint8_t *hmask, const int8_t sc[16], const int8_t *x,
                             int64_t ldx, int n, __m512i *ints) {
    const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m256i hm = hmask ? _mm256_loadu_si256((const __m256i *)hmask) : _mm256_setzero_si256();
    __m512i q[4], scale[4];
    for (int i = 0; i < n; i++) ints[i] = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        int s = 2 * (c & 1);
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * (c >> 1)));
        __m256i q0 = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * s), three),
                q1 = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * s + 2), three);
        if (hmask) {
            q0 = _mm256_or_si256(q0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 2 * c), one), 2));
            q1 = _mm256_or_si256(q1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 2 * c + 1), one), 2));
        }
        int32_t four;
        memcpy(&four, sc + 4 * c, 4);
        q[c] = join(q0, q1), scale[c] = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(four), spread));
    }
    rows_step2(ints, q[0], scale[0], q[1], scale[1], x, ldx, n);
    rows_step2(ints, q[2], scale[2], q[3], scale[3], x + 128, ldx, n);
}

static INLINE void block_q2k(const uint8_t *qs, const int8_t sc[16], const uint8_t m[16], const int8_t *x,
                             int64_t ldx, int n, const int16_t *xs, int64_t lds, const float *dd, const float *dm,
                             Facc *acc) {
    __m512i ints[ROWS];
    __m256i lanes[ROWS];
    ints_2bit(qs, NULL, sc, x, ldx, n, ints);
    fold_rows(n, ints, lanes);
    minus_mins(acc, n, lanes, _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)m)), xs, lds, dd, dm);
}

static INLINE void block_q3k(const uint8_t *qs, const uint8_t *hmask, const int8_t sc[16], const int8_t *x,
                             int64_t ldx, int n, const int16_t *xs, int64_t lds, const float *dd, Facc *acc) {
    __m512i ints[ROWS];
    __m256i lanes[ROWS];
    ints_2bit(qs, hmask, sc, x, ldx, n, ints);
    fold_rows(n, ints, lanes);
    minus_offsets(acc, n, lanes, sc, 2, xs, lds, dd);
}

/* IQ4_XS's signed codes (its table's values, at most 127 in size) against each row's activations: |w| times x with
 * w's sign, byte pairs to 16 bits (at most 2 127 127 < 2^15), then times the 16-bit scales (a 32-bit lane's
 * scale in both halves) */
static INLINE void rows_step_signed(__m512i *acc, __m512i q, __m512i scale, const int8_t *x, int64_t ldx, int n) {
    __m512i scale16 = _mm512_or_si512(_mm512_and_si512(scale, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(scale, 16));
    __m512i size = _mm512_abs_epi8(q);
    __mmask64 negative = _mm512_movepi8_mask(q);
    for (int i = 0; i < n; i++) {
        __m512i v = _mm512_loadu_si512((const void *)(x + i * ldx));
        v = _mm512_mask_sub_epi8(v, negative, _mm512_setzero_si512(), v);
        acc[i] = _mm512_dpwssd_epi32(acc[i], _mm512_maddubs_epi16(size, v), scale16);
    }
}

/* IQ4_XS: 8 blocks of 32, block b's codes the nibbles of qs[16 b ..] (input j low, j + 16 high) looked up in the
 * table; chunk c is blocks 2 c and 2 c + 1, lanes 0-7 and 8-15 */
static INLINE void block_iq4xs(const uint8_t *qs, const int8_t sc[8], const int8_t *x, int64_t ldx, int n,
                               const float *dd, Facc *acc) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)NS_KVALUES));
    __m512i scales = _mm512_castsi256_si512(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc)));
    __m512i ints[ROWS];
    for (int i = 0; i < n; i++) ints[i] = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, low)),
                hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
        __m512i q = join(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
        __m512i pick = join(_mm256_set1_epi32(2 * c), _mm256_set1_epi32(2 * c + 1));
        rows_step_signed(ints, q, _mm512_permutexvar_epi32(pick, scales), x + 64 * c, ldx, n);
    }
    for (int i = 0; i < n; i++) acc[i] = _mm256_add_ps(acc[i], scaled(dd[i], fold(ints[i])));
}

/* Blocks 2 c and 2 c + 1 of a run against each row's chunk c: lane l's sum of code times activation code over its
 * 4 inputs (and Q5_1's sum of activation codes) in lanes l (block 2 c) and l + 8 (block 2 c + 1), then block 2 c's
 * (d dx) I (and (m dx) S) into the row's 8 float lanes, then block 2 c + 1's (kquant.c) */
static INLINE void block32(const uint8_t *w, int bytes, int kind, const float d[8], const float m[8],
                           const int8_t *x, int64_t ldx, int n, const float *dx, Facc *acc) {
    const __m512i ones16 = _mm512_set1_epi16(1), ones8 = _mm512_set1_epi8(1);
    for (int c = 0; c < 4; c++) {
        __m512i q = join(codes32(w + 2 * c * bytes, kind), codes32(w + (2 * c + 1) * bytes, kind));
        __m512i size = kind == K_Q5_1 ? q : _mm512_abs_epi8(q);
        __mmask64 negative = kind == K_Q5_1 ? 0 : _mm512_movepi8_mask(q);
        for (int i = 0; i < n; i++) {
            __m512i v = _mm512_loadu_si512((const void *)(x + i * ldx + 64 * c));
            __m256 f = _mm256_set1_ps(dx[i]);
            if (kind != K_Q5_1) v = _mm512_mask_sub_epi8(v, negative, _mm512_setzero_si512(), v);
            __m512i ints = _mm512_madd_epi16(_mm512_maddubs_epi16(size, v), ones16), sums = _mm512_setzero_si512();
            if (kind == K_Q5_1) sums = _mm512_madd_epi16(_mm512_maddubs_epi16(ones8, v), ones16);
            for (int h = 0; h < 2; h++) {
                int b = 2 * c + h;
                __m256i half_ints = h ? _mm512_extracti64x4_epi64(ints, 1) : _mm512_castsi512_si256(ints);
                acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d[b]), f),
                                                             _mm256_cvtepi32_ps(half_ints)));
                if (kind == K_Q5_1) {
                    __m256i half_sums = h ? _mm512_extracti64x4_epi64(sums, 1) : _mm512_castsi512_si256(sums);
                    acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(m[b]), f),
                                                                 _mm256_cvtepi32_ps(half_sums)));
                }
            }
        }
    }
}

/* F16 / BF16 rows: 32 float lanes a row as two registers (lanes 0-15, 16-31), each a fused multiply-add of the
 * weight (converted exactly) and the activation, unit after unit; the rows go innermost so a weight vector serves
 * n rows */
static INLINE __m512 half16(const uint8_t *p, int bf16) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}

static INLINE void rows_half(const uint8_t *w, int bf16, const float *x, int64_t in, int n, float *sums) {
    __m512 lo[HALF_ROWS], hi[HALF_ROWS];
    for (int i = 0; i < n; i++) lo[i] = hi[i] = _mm512_setzero_ps();
    for (int64_t u = 0; u < in; u += HALF_UNIT, w += 2 * HALF_UNIT) {
        __m512 a = half16(w, bf16), b = half16(w + 32, bf16);
        for (int i = 0; i < n; i++) {
            lo[i] = _mm512_fmadd_ps(a, _mm512_loadu_ps(x + i * in + u), lo[i]);
            hi[i] = _mm512_fmadd_ps(b, _mm512_loadu_ps(x + i * in + u + 16), hi[i]);
        }
    }
    for (int i = 0; i < n; i++) { /* lane l + 16, l + 8, then the tree */
        __m512 s = _mm512_add_ps(lo[i], hi[i]);
        sums[i] = facc_sum(_mm256_add_ps(_mm512_castps512_ps256(s),
                                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1))));
    }
}
