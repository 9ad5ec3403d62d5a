/* 4-bit weights times 16-bit activations: the CPU's packed linear, on integer dot products.
 *
 * Weights: 4-bit codes q with a scale s and a zero z per group of 32 inputs (w = (q - 8) s + z, Int4Blocks),
 * packed by ns_q4_pack for 16 outputs at a time. Activations: each row's group of 32 quantized to 16-bit codes v
 * with one scale (d = max |x| / 32767, round to nearest even: 15 bits, finer than bfloat16's 8) and the codes'
 * sum. A group's product is an exact integer, sum (q - 8) v, which every path computes alike: AVX-512 VNNI's and the
 * tiles' 8-bit dot products on v taken as two int8 planes, AVX2's 16-bit products (madd) on v whole (its one-row
 * calls on the planes), plain C; the float part,
 * y += s (d c) + z (d sum v) with one fused multiply-add, runs group by group in order. So an output's bits depend
 * on its row alone: not on the other rows of the call, the thread that computed it, or the instruction set.
 *
 * A call's output groups are dealt to a persistent pool of threads (ns_pool_*): a decode step makes 120 calls of
 * tens of microseconds, too short to start threads for.
 */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* syscall(), for the tile state request */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define GROUP 32
#define OUTS 16                      /* outputs packed together */
#define AMX_ROWS 16                  /* rows a tile holds */
#ifndef AMX_FROM
#define AMX_FROM 6 /* rows from which a call takes the tiles (measured: 4 rows break even, 8 gain 1.4x) */
#endif
#define GROUP_BYTES (OUTS * GROUP / 2 + 2 * OUTS * 2) /* nibbles, then 16 f16 scales and 16 f16 zeros: 320 */

#include "half.h"
#include "q4pack.h"

/* ---- packing -------------------------------------------------------------------------------------------- */

int64_t ns_q4_packed_bytes(int64_t out, int64_t in) { return (out / OUTS) * (in / GROUP) * GROUP_BYTES; }

/* codes [out, in] (0..15), scales and zeros [out, in / 32] -> dst. Per 16 outputs and group of 32 inputs: 4
 * vectors of 64 bytes, vector v holding for output l, at byte 4 l + c, input 8 v + c in its low nibble and input
 * 8 v + 4 + c in its high one; then the scales and the zeros as f16. */
void ns_q4_pack(const uint8_t *codes, const float *scales, const float *zeros, int64_t out, int64_t in,
                uint8_t *dst) {
    int64_t groups = in / GROUP;
    for (int64_t g = 0; g < out / OUTS; g++)
        for (int64_t b = 0; b < groups; b++) {
            uint8_t *p = dst + (g * groups + b) * GROUP_BYTES;
            for (int v = 0; v < 4; v++)
                for (int l = 0; l < OUTS; l++)
                    for (int c = 0; c < 4; c++) {
                        const uint8_t *row = codes + (g * OUTS + l) * in + b * GROUP + 8 * v + c;
                        p[v * 64 + l * 4 + c] = (uint8_t)((row[0] & 0x0f) | ((row[4] & 0x0f) << 4));
                    }
            uint16_t halves[2 * OUTS];
            for (int l = 0; l < OUTS; l++) {
                halves[l] = f32_to_f16(scales[(g * OUTS + l) * groups + b]);
                halves[OUTS + l] = f32_to_f16(zeros[(g * OUTS + l) * groups + b]);
            }
            memcpy(p + 4 * 64, halves, sizeof halves);
        }
}

/* ---- activations ---------------------------------------------------------------------------------------- */

/* x [rows, in] float32 -> per row and group of 32: 16-bit codes v = round(x 32767 / max |x|) (to nearest even),
 * stored as two byte planes, hi = v >> 8 (signed) and lo = v & 255 (unsigned), so v = 256 hi + lo and each
 * plane goes through the 8-bit dot products exactly (the weights' 4-bit codes are the unsigned side of hi's and
 * the signed side of lo's); codes [rows, 2 in] (a group: 32 hi bytes, then 32 lo), scales [rows, in / 32], code
 * sums [rows, in / 32], and the hi plane's sums (the 8-bit kernel's correction) when asked for. */
static void quantize_rows(const float *x, int64_t rows, int64_t in, int8_t *codes, float *scales, int32_t *sums,
                          int32_t *hi_sums) {
    int64_t groups = in / GROUP;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < groups; b++) {
            const float *v = x + r * in + b * GROUP;
            float top = 0.0f;
            for (int i = 0; i < GROUP; i++) {
                float a = fabsf(v[i]);
                top = a > top ? a : top;
            }
            float inv = top > 0.0f ? 32767.0f / top : 0.0f;
            int32_t sum = 0, hi_sum = 0;
            int8_t *hi = codes + r * 2 * in + b * 2 * GROUP, *lo = hi + GROUP;
            for (int i = 0; i < GROUP; i++) {
                float t = v[i] * inv;
                t = (t + 12582912.0f) - 12582912.0f; /* to nearest even */
                int32_t code = (int32_t)t, high = code >> 8;  /* arithmetic shift: the floor */
                hi[i] = (int8_t)high;
                ((uint8_t *)lo)[i] = (uint8_t)(code - 256 * high);
                sum += code;
                hi_sum += high;
            }
            scales[r * groups + b] = top / 32767.0f;
            sums[r * groups + b] = sum;
            if (hi_sums) hi_sums[r * groups + b] = hi_sum;
        }
}

/* ---- one row against 16 outputs' packed weights ----------------------------------------------------------
 * Per group of 32 inputs: the exact integer sums c_l = sum (q - 8) v = 256 sum q hi + sum q lo - 8 sum v (below
 * 2^24, so exact in float32 too), then acc_l += fma(s_l, d c_l, z_l (d sum v)) in group order;
 * every path below computes exactly these operations. x points at a row's codes (2 in bytes, see quantize_rows). */

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define ISA "avx512-vnni"
#define VEC512 1
#define ROW_TILE 4
/* the 4 activation codes at x in every 32-bit lane, straight from memory: a broadcast load (read into a general
 * register first, each cost a vector instruction moving it over; kx16_avx512.h's quad_at) */
typedef int32_t ns_i32_unaligned __attribute__((aligned(1), may_alias));
static inline __m512i quad_at(const int8_t *x) { return _mm512_set1_epi32(*(const ns_i32_unaligned *)x); }
/* Up to ROW_TILE rows against 16 outputs at once: a group's weights are unpacked once for all of them; each row's
 * arithmetic is the other paths' row_dot, operation for operation. */
static void rows_dot(const uint8_t *wg, int64_t groups, int64_t in, int n, const int8_t *x, const float *xd,
                     const int32_t *xs, float *out) {
    __m512 acc[ROW_TILE];
    for (int i = 0; i < n; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < groups; b++) {
        const uint8_t *p = wg + b * GROUP_BYTES;
        __m512i nib[8];
        q4_unpack_avx512(p, nib);
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256)));
        __m512 zero = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 288)));
        for (int i = 0; i < n; i++) {
            const int8_t *hi4 = x + i * 2 * in + b * 2 * GROUP, *lo4 = hi4 + GROUP;
            float d = xd[i * groups + b];
            int32_t sx = xs[i * groups + b];
            __m512i high = _mm512_setzero_si512(), lows = _mm512_set1_epi32(-8 * sx);
            for (int j = 0; j < 8; j++) { /* codes (0..15) unsigned times hi signed; lo unsigned times codes */
                high = _mm512_dpbusd_epi32(high, nib[j], quad_at(hi4 + 4 * j));
                lows = _mm512_dpbusd_epi32(lows, quad_at(lo4 + 4 * j), nib[j]);
            }
            __m512i c = _mm512_add_epi32(_mm512_slli_epi32(high, 8), lows);
            __m512 t = _mm512_fmadd_ps(scale, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(c)),
                                       _mm512_mul_ps(zero, _mm512_set1_ps(d * (float)sx)));
            acc[i] = _mm512_add_ps(acc[i], t);
        }
    }
    for (int i = 0; i < n; i++) _mm512_storeu_ps(out + i * OUTS, acc[i]);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ISA "avx2"
#define VEC256 1
#define ROW_TILE 8
/* The AVX2 paths' own activation layout, made once a call from quantize_rows' planes (no other path runs in this
 * build): each group's 32 codes v = 256 hi + lo (|v| <= 32767) as 16-bit pairs, a 32-bit lane per input quad j,
 * (v[4 j], v[4 j + 2]) in the group's first 32 bytes and (v[4 j + 1], v[4 j + 3]) in its last 32 (where the planes
 * were), for madd's 16-bit products, which are exact where maddubs' byte products would saturate on 8-bit codes. */
#define VECTOR_LAYOUT 1
static void vector_layout(int8_t *xq, int64_t rows, int64_t in) {
    const __m256i low_byte = _mm256_set1_epi16(0x00ff), high_byte = _mm256_set1_epi16((short)0xff00);
    for (int64_t k = 0; k < rows * (in / GROUP); k++) {
        __m256i *g = (__m256i *)(xq + k * 2 * GROUP);
        __m256i hi = _mm256_loadu_si256(g), lo = _mm256_loadu_si256(g + 1);
        /* 16-bit words: (hi[2m] << 8) | lo[2m] = v[2m] and (hi[2m+1] << 8) | lo[2m+1] = v[2m+1], two's complement */
        _mm256_storeu_si256(g, _mm256_or_si256(_mm256_slli_epi16(hi, 8), _mm256_and_si256(lo, low_byte)));
        _mm256_storeu_si256(g + 1, _mm256_or_si256(_mm256_and_si256(hi, high_byte), _mm256_srli_epi16(lo, 8)));
    }
}

static inline __m256i broadcast4(const int8_t *bytes) {
    int32_t four;
    memcpy(&four, bytes, 4);
    return _mm256_set1_epi32(four);
}

/* A call of fewer rows than this takes the 4-bit kernel on quantize_rows' byte planes (rows_dot_planes), not on the
 * 16-bit pairs: for one row, widening a group's codes costs more than it saves (the same bits either way). */
#define PAIRS_FROM 2

/* One-row calls' 4-bit kernel (PAIRS_FROM), rows one at a time, on the byte planes as they are: the codes (0..15) unsigned against hi,
 * lo unsigned against the codes, in maddubs' 16-bit sums, which hold them exactly: hi's 8 quads at most
 * 8 x 2 x 15 x 128 = 30720, lo's in two runs of 4 quads at most 4 x 2 x 255 x 15 = 30600 each (adds_epi16, which
 * cannot saturate on these, keeps the compiler from a tree of adds that spilled every product). c = 256 sum q hi +
 * sum q lo - 8 sum v, and rows_dot's float part. */
static void rows_dot_planes(const uint8_t *wg, int64_t groups, int64_t in, int n, const int8_t *x, const float *xd,
                            const int32_t *xs, float *out) {
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int i = 0; i < n; i++) {
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
        for (int64_t b = 0; b < groups; b++) {
            const uint8_t *p = wg + b * GROUP_BYTES;
            const int8_t *row = x + i * 2 * in + b * 2 * GROUP;
            __m256i h[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, l[2][2] = {{h[0], h[0]}, {h[0], h[0]}};
            for (int v = 0; v < 4; v++) { /* vector v: quad 2 v in the low nibbles, 2 v + 1 in the high */
                __m256i w[2] = {_mm256_loadu_si256((const __m256i *)(p + v * 64)),
                                _mm256_loadu_si256((const __m256i *)(p + v * 64 + 32))};
                for (int half = 0; half < 2; half++) {
                    int j = 2 * v + half;
                    __m256i hv = broadcast4(row + 4 * j), lv = broadcast4(row + GROUP + 4 * j);
                    for (int o = 0; o < 2; o++) {
                        __m256i q = _mm256_and_si256(half ? _mm256_srli_epi16(w[o], 4) : w[o], low);
                        h[o] = _mm256_adds_epi16(h[o], _mm256_maddubs_epi16(q, hv));
                        l[v >> 1][o] = _mm256_adds_epi16(l[v >> 1][o], _mm256_maddubs_epi16(lv, q));
                    }
                }
            }
            float d = xd[i * groups + b];
            int32_t sx = xs[i * groups + b];
            __m256 dv = _mm256_set1_ps(d), dz = _mm256_set1_ps(d * (float)sx);
            __m256i eight = _mm256_set1_epi32(8 * sx), c[2];
            for (int o = 0; o < 2; o++)
                c[o] = _mm256_sub_epi32(_mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(h[o], ones), 8),
                                                         _mm256_add_epi32(_mm256_madd_epi16(l[0][o], ones),
                                                                          _mm256_madd_epi16(l[1][o], ones))),
                                        eight);
            __m256 sc0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 256)));
            __m256 sc1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 272)));
            __m256 z0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 288)));
            __m256 z1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 304)));
            acc0 = _mm256_add_ps(acc0, _mm256_fmadd_ps(sc0, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(c[0])),
                                                       _mm256_mul_ps(z0, dz)));
            acc1 = _mm256_add_ps(acc1, _mm256_fmadd_ps(sc1, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(c[1])),
                                                       _mm256_mul_ps(z1, dz)));
        }
        _mm256_storeu_ps(out + i * OUTS, acc0);
        _mm256_storeu_ps(out + i * OUTS + 8, acc1);
    }
}

/* Up to ROW_TILE rows against one group of 16 outputs given its 16-bit codes, wide[4 j + 2 h + o]: input quad j's
 * even (o = 0: inputs 4 j, 4 j + 2) or odd (o = 1) pair for outputs 8 h .. 8 h + 7, a 32-bit lane each. c[i][h]:
 * row i's 32 products per output, summed in 32 bits: exact, as |v| <= 32767 and |w| <= 128 keep them below 2^27.
 * Kept in this order (the empty asm): the compiler's tree of the same adds held every product at once and spilled
 * them. */
static inline void wide_sums(const __m256i wide[32], const int8_t *x, int64_t in, int64_t b, int n,
                             __m256i c[ROW_TILE][2]) {
    for (int i = 0; i < n; i++) {
        const int8_t *row = x + i * 2 * in + b * 2 * GROUP; /* the even pairs, then the odd (vector_layout) */
        __m256i c0 = _mm256_setzero_si256(), c1 = c0;
        for (int j = 0; j < 8; j++) {
            __m256i ev = broadcast4(row + 4 * j), ov = broadcast4(row + GROUP + 4 * j);
            c0 = _mm256_add_epi32(c0, _mm256_add_epi32(_mm256_madd_epi16(wide[4 * j], ev),
                                                       _mm256_madd_epi16(wide[4 * j + 1], ov)));
            c1 = _mm256_add_epi32(c1, _mm256_add_epi32(_mm256_madd_epi16(wide[4 * j + 2], ev),
                                                       _mm256_madd_epi16(wide[4 * j + 3], ov)));
            __asm__("" : "+x"(c0), "+x"(c1));
        }
        c[i][0] = c0, c[i][1] = c1;
    }
}

/* Up to ROW_TILE rows against 16 outputs at once, as rows_dot above: a group's codes are widened once for all of them
 * (q, 0..15, as 16-bit pairs; vector v of the packing holds quad 2 v in its bytes' low nibbles, quad 2 v + 1 in their
 * high ones), then c = sum q v - 8 sum v, the same integer as every path's, and rows_dot's float part, operation for
 * operation. */
static void rows_dot(const uint8_t *wg, int64_t groups, int64_t in, int n, const int8_t *x, const float *xd,
                     const int32_t *xs, float *out) {
    const __m256i nibble = _mm256_set1_epi16(0x000f);
    __m256 acc[ROW_TILE][2];
    for (int i = 0; i < n; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < groups; b++) {
        const uint8_t *p = wg + b * GROUP_BYTES;
        __m256i wide[32];
        for (int v = 0; v < 4; v++)
            for (int h = 0; h < 2; h++) { /* a 16-bit word: byte 2m + 1's nibbles above byte 2m's */
                __m256i w = _mm256_loadu_si256((const __m256i *)(p + v * 64 + h * 32));
                wide[8 * v + 2 * h] = _mm256_and_si256(w, nibble);                          /* quad 2v, even */
                wide[8 * v + 2 * h + 1] = _mm256_and_si256(_mm256_srli_epi16(w, 8), nibble); /* quad 2v, odd */
                wide[8 * v + 4 + 2 * h] = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
                wide[8 * v + 4 + 2 * h + 1] = _mm256_srli_epi16(w, 12);
            }
        __m256 sc0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 256)));
        __m256 sc1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 272)));
        __m256 z0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 288)));
        __m256 z1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 304)));
        __m256i c[ROW_TILE][2];
        wide_sums(wide, x, in, b, n, c);
        for (int i = 0; i < n; i++) {
            float d = xd[i * groups + b];
            int32_t sx = xs[i * groups + b];
            __m256 dv = _mm256_set1_ps(d), dz = _mm256_set1_ps(d * (float)sx);
            __m256i eight = _mm256_set1_epi32(8 * sx);
            __m256i c0 = _mm256_sub_epi32(c[i][0], eight), c1 = _mm256_sub_epi32(c[i][1], eight);
            acc[i][0] = _mm256_add_ps(acc[i][0], _mm256_fmadd_ps(sc0, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(c0)),
                                                                 _mm256_mul_ps(z0, dz)));
            acc[i][1] = _mm256_add_ps(acc[i][1], _mm256_fmadd_ps(sc1, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(c1)),
                                                                 _mm256_mul_ps(z1, dz)));
        }
    }
    for (int i = 0; i < n; i++) {
        _mm256_storeu_ps(out + i * OUTS, acc[i][0]);
        _mm256_storeu_ps(out + i * OUTS + 8, acc[i][1]);
    }
}
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#define ISA "neon-dotprod"
#define NEON_DOT 1
static inline int8x16_t broadcast4(const int8_t *bytes) {
    int32_t four;
    memcpy(&four, bytes, 4);
    return vreinterpretq_s8_s32(vdupq_n_s32(four));
}

/* A group's lo plane (unsigned bytes) less 128, as SDOT's signed bytes */
static inline void lo_signed(const int8_t *lo, int8_t out[GROUP]) {
    for (int h = 0; h < 2; h++)
        vst1q_s8(out + 16 * h, vreinterpretq_s8_u8(veorq_u8(vld1q_u8((const uint8_t *)lo + 16 * h), vdupq_n_u8(0x80))));
}

/* Four outputs' exact c = sum q (256 hi + lo) over a group, codes[j] their signed codes for inputs 4 j .. 4 j + 3:
 * 256 sum q hi + sum q (lo - 128) + 128 sum q, each sum by SDOT (|c| < 2^28, as every path's) */
static inline int32x4_t group_ints(const int8x16_t codes[8], const int8_t *hi, const int8_t *lo_minus_128) {
    int32x4_t h = vdupq_n_s32(0), l = h, q = h;
    const int8x16_t ones = vdupq_n_s8(1);
    for (int j = 0; j < 8; j++) {
        h = vdotq_s32(h, codes[j], broadcast4(hi + 4 * j));
        l = vdotq_s32(l, codes[j], broadcast4(lo_minus_128 + 4 * j));
        q = vdotq_s32(q, codes[j], ones);
    }
    return vaddq_s32(vshlq_n_s32(h, 8), vaddq_s32(l, vshlq_n_s32(q, 7)));
}

static inline float32x4_t halves4(const uint8_t *p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p)));
}

/* One row against 16 outputs' 4-bit weights on NEON: vector v's slice m (outputs 4 m ..) holds the codes of inputs
 * 8 v .. (low nibbles, quad 2 v) and 8 v + 4 .. (high, quad 2 v + 1); less 8, then the plain build's float
 * operations four outputs a register */
static void row_dot(const uint8_t *wg, int64_t groups, const int8_t *x, const float *xd, const int32_t *xs,
                    float out[OUTS]) {
    float32x4_t acc[4];
    for (int m = 0; m < 4; m++) acc[m] = vdupq_n_f32(0.0f);
    const uint8x16_t low = vdupq_n_u8(0x0f);
    const int8x16_t eight = vdupq_n_s8(8);
    for (int64_t b = 0; b < groups; b++) {
        const uint8_t *p = wg + b * GROUP_BYTES;
        const int8_t *hi = x + b * 2 * GROUP;
        int8_t lo[GROUP];
        lo_signed(hi + GROUP, lo);
        float d = xd[b];
        float32x4_t dv = vdupq_n_f32(d), dz = vdupq_n_f32(d * (float)xs[b]);
        for (int m = 0; m < 4; m++) {
            int8x16_t codes[8];
            for (int v = 0; v < 4; v++) {
                uint8x16_t raw = vld1q_u8(p + v * 64 + 16 * m);
                codes[2 * v] = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(raw, low)), eight);
                codes[2 * v + 1] = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(raw, 4)), eight);
            }
            float32x4_t c = vcvtq_f32_s32(group_ints(codes, hi, lo));
            float32x4_t zero_part = vmulq_f32(halves4(p + 256 + 2 * OUTS + 8 * m), dz);
            acc[m] = vaddq_f32(acc[m], vfmaq_f32(zero_part, halves4(p + 256 + 8 * m), vmulq_f32(dv, c)));
        }
    }
    for (int m = 0; m < 4; m++) vst1q_f32(out + 4 * m, acc[m]);
}
#else
#define ISA "portable"
static void row_dot(const uint8_t *wg, int64_t groups, const int8_t *x, const float *xd, const int32_t *xs,
                    float out[OUTS]) {
    float acc[OUTS] = {0};
    for (int64_t b = 0; b < groups; b++) {
        const uint8_t *p = wg + b * GROUP_BYTES;
        const int8_t *hi = x + b * 2 * GROUP;
        const uint8_t *lo = (const uint8_t *)hi + GROUP;
        uint16_t halves[2 * OUTS];
        memcpy(halves, p + 4 * 64, sizeof halves);
        float d = xd[b];
        int32_t sx = xs[b];
        for (int l = 0; l < OUTS; l++) {
            int32_t c = 0;
            for (int v = 0; v < 4; v++)
                for (int k = 0; k < 4; k++) {
                    uint8_t byte = p[v * 64 + l * 4 + k];
                    int i0 = 8 * v + k, i1 = 8 * v + 4 + k;
                    c += ((byte & 0x0f) - 8) * (256 * hi[i0] + lo[i0])
                       + ((byte >> 4) - 8) * (256 * hi[i1] + lo[i1]);
                }
            acc[l] = acc[l] + fmaf(f16_to_f32(halves[l]), d * (float)c, f16_to_f32(halves[OUTS + l]) * (d * (float)sx));
        }
    }
    memcpy(out, acc, sizeof acc);
}
#endif

/* ---- AMX: 16 rows at a time on the tile unit ------------------------------------------------------------
 * The same integers as rows_dot (a group's 256 hi and lo dot products per 16 rows and 16 outputs, one tile
 * instruction each), then rows_dot's float operations row by row: the same bits, so whether a call takes the
 * tiles (from AMX_FROM rows; its last tile padded with zero rows) changes nothing. Used where the compiler and the kernel allow it (Linux asks a process to request the
 * tile state) and ns_set_tiles has not turned it off. */
#if defined(VEC512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static atomic_int amx_state = 0; /* 0: not asked yet, 1: granted, -1: refused or turned off */

static int amx_granted(void) {
    int state = atomic_load(&amx_state);
    if (state == 0) {
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        atomic_store(&amx_state, state);
    }
    return state > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles 0-3: the hi and lo sums (16 rows x 16 int32) of two output groups; 4 and 5: 16 rows' hi and lo codes of
 * an input group (32 bytes each); 6 and 7: the two output groups' 4-bit codes for it (8 rows of 4 inputs x 16
 * outputs). Two output groups at once share the activation tiles and give the tile unit independent work. Set
 * per chunk: another library on this thread (oneDNN) may have configured the tiles its own way. */
static void amx_configure(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 6; t++) config.rows[t] = AMX_ROWS, config.colsb[t] = t < 4 ? 64 : GROUP;
    for (int t = 6; t < 8; t++) config.rows[t] = GROUP / 4, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}

/* rows_dot's nib[0..8) less 8 (the weights' signed codes, -8..7) for one group of 16 outputs, stored as a tile:
 * row j holds inputs 4 j .. 4 j + 3 */
static inline void unpack_codes(const uint8_t *p, int8_t *codes) {
    const __m512i low = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi8(8);
    for (int v = 0; v < 4; v++) {
        __m512i packed = _mm512_loadu_si512(p + v * 64);
        _mm512_store_si512(codes + 2 * v * 64, _mm512_sub_epi8(_mm512_and_si512(packed, low), eight));
        _mm512_store_si512(codes + (2 * v + 1) * 64,
                           _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(packed, 4), low), eight));
    }
}

/* rows_dot's float operations on one group's integer sums, for 16 rows */
static inline void amx_accumulate(const uint8_t *p, const int32_t *high, const int32_t *lows, const float *xd,
                                  const int32_t *xs, int64_t groups, int64_t b, int n, __m512 *acc) {
    __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256)));
    __m512 zero = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 288)));
    for (int i = 0; i < n; i++) {
        float d = xd[i * groups + b];
        int32_t sx = xs[i * groups + b]; /* c = 256 sum (q - 8) hi + sum (q - 8) lo = sum (q - 8) v, as rows_dot's */
        __m512i c = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(high + i * OUTS), 8),
                                     _mm512_load_si512(lows + i * OUTS));
        __m512 t = _mm512_fmadd_ps(scale, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(c)),
                                   _mm512_mul_ps(zero, _mm512_set1_ps(d * (float)sx)));
        acc[i] = _mm512_add_ps(acc[i], t);
    }
}

/* Input group b's integer sums for a tile of 16 rows: sums[0] and [1] the hi and lo planes against `codes` (a
 * group's signed codes for 16 outputs, as a tile: 8 rows of 4 inputs x 16 outputs), [2] and [3] against `codes2`
 * when it is not NULL. The two output groups share the activation tiles and give the tile unit independent work. */
static inline void tile_sums(const int8_t *x, int64_t in, int64_t b, const void *codes, const void *codes2,
                             int32_t sums[4][AMX_ROWS * OUTS]) {
    _tile_loadd(4, x + b * 2 * GROUP, 2 * in);
    _tile_loadd(5, x + b * 2 * GROUP + GROUP, 2 * in);
    _tile_loadd(6, codes, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_dpbssd(0, 4, 6); /* hi signed times codes signed */
    _tile_dpbusd(1, 5, 6); /* lo unsigned times codes signed */
    if (codes2) {
        _tile_loadd(7, codes2, 64);
        _tile_zero(2);
        _tile_zero(3);
        _tile_dpbssd(2, 4, 7);
        _tile_dpbusd(3, 5, 7);
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    if (codes2) {
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
    }
}

/* A tile of 16 rows against output groups wg (and wg2 when not NULL, the next 16 outputs) -> out [n, 16] (out2)
 * for its first n rows (the rest are the zero rows padding a call's last tile) */
static void amx_rows(const uint8_t *wg, const uint8_t *wg2, int64_t groups, int64_t in, const int8_t *x,
                     const float *xd, const int32_t *xs, int n, float *out, float *out2) {
    _Alignas(64) int8_t codes[2][8 * 64];
    _Alignas(64) int32_t sums[4][AMX_ROWS * OUTS];
    __m512 acc[AMX_ROWS], acc2[AMX_ROWS];
    for (int i = 0; i < AMX_ROWS; i++) acc[i] = acc2[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < groups; b++) {
        unpack_codes(wg + b * GROUP_BYTES, codes[0]);
        if (wg2) unpack_codes(wg2 + b * GROUP_BYTES, codes[1]);
        tile_sums(x, in, b, codes[0], wg2 ? codes[1] : NULL, sums);
        amx_accumulate(wg + b * GROUP_BYTES, sums[0], sums[1], xd, xs, groups, b, n, acc);
        if (wg2) amx_accumulate(wg2 + b * GROUP_BYTES, sums[2], sums[3], xd, xs, groups, b, n, acc2);
    }
    for (int i = 0; i < n; i++) _mm512_storeu_ps(out + i * OUTS, acc[i]);
    if (wg2)
        for (int i = 0; i < n; i++) _mm512_storeu_ps(out2 + i * OUTS, acc2[i]);
}
#define HAVE_AMX 1
#else
static int amx_granted(void) { return 0; }
#endif

static atomic_int amx_allowed = 1;
static atomic_llong amx_rows_served = 0;

/* Whether a call of `rows` rows runs on the tiles, 16 rows a tile, the last padded (the same bits either way) */
static int use_tiles(int64_t rows) { return rows >= AMX_FROM && atomic_load(&amx_allowed) && amx_granted(); }

/* The rows the tiles have computed since the library loaded: a measurement, for the stats snapshot */
int64_t ns_tile_rows(void) { return atomic_load(&amx_rows_served); }

/* Turns the AMX path off (0) or back on (1); returns whether it can run here (built for it, and the tiles granted):
 * the tests compare its bits with the vector path's, the benchmark its speed. */
int ns_set_tiles(int allowed) {
    atomic_store(&amx_allowed, allowed != 0);
    return amx_granted();
}

const char *ns_q4_isa(void) { return ISA; }

/* y[r, 16 g + l] = acc[r * 16 + l] (+ bias, + what y holds when accumulating) for n rows */
static inline void store_outputs(const float *acc, int n, int64_t out, int64_t g, const float *bias, int accumulate,
                                 float *y) {
    for (int i = 0; i < n; i++) {
        float *yr = y + i * out + g * OUTS;
        for (int l = 0; l < OUTS; l++) {
            float v = bias ? acc[i * OUTS + l] + bias[g * OUTS + l] : acc[i * OUTS + l];
            yr[l] = accumulate ? yr[l] + v : v;
        }
    }
}

/* ---- 8-bit weights (q8x16) ------------------------------------------------------------------------------
 * GGUF Q8_0 as it is: 8-bit codes q with one f16 scale s per group of 32 inputs (w = q s), packed for 16 outputs at
 * a time: 8 vectors of 64 bytes, vector j holding output l's inputs 4 j .. 4 j + 3 at bytes 4 l .., then the 16
 * scales. A group's product c = sum q v = 256 sum q hi + sum q lo is an exact integer (|c| < 2^28; rounded to
 * float32 once, the same everywhere), then acc_l += s_l (d c) in group order. AVX-512's path takes q + 128
 * (unsigned) against hi and corrects by 128 sum hi; AVX2's takes q and v whole as 16 bits; the tiles take q signed
 * against both planes. */

#define Q8_GROUP_BYTES (OUTS * GROUP + OUTS * 2) /* 544 */

int64_t ns_q8_packed_bytes(int64_t out, int64_t in) { return (out / OUTS) * (in / GROUP) * Q8_GROUP_BYTES; }

/* codes [out, in] int8, scales [out, in / 32] -> dst (the layout above) */
void ns_q8_pack(const int8_t *codes, const float *scales, int64_t out, int64_t in, uint8_t *dst) {
    int64_t groups = in / GROUP;
    for (int64_t g = 0; g < out / OUTS; g++)
        for (int64_t b = 0; b < groups; b++) {
            uint8_t *p = dst + (g * groups + b) * Q8_GROUP_BYTES;
            for (int j = 0; j < 8; j++)
                for (int l = 0; l < OUTS; l++)
                    for (int c = 0; c < 4; c++) p[j * 64 + l * 4 + c] = (uint8_t)codes[(g * OUTS + l) * in + b * GROUP + 4 * j + c];
            uint16_t halves[OUTS];
            for (int l = 0; l < OUTS; l++) halves[l] = f32_to_f16(scales[(g * OUTS + l) * groups + b]);
            memcpy(p + 8 * 64, halves, sizeof halves);
        }
}

#ifdef VEC512
/* Up to ROW_TILE rows against 16 outputs' 8-bit weights: the weights loaded once for all of them */
static void rows_dot8(const uint8_t *wg, int64_t groups, int64_t in, int n, const int8_t *x, const float *xd,
                      const int32_t *xh, float *out) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[ROW_TILE];
    for (int i = 0; i < n; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < groups; b++) {
        const uint8_t *p = wg + b * Q8_GROUP_BYTES;
        __m512i w[8], wu[8];
        for (int j = 0; j < 8; j++) {
            w[j] = _mm512_loadu_si512(p + j * 64);
            wu[j] = _mm512_xor_si512(w[j], flip); /* q + 128, unsigned */
        }
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 512)));
        for (int i = 0; i < n; i++) {
            const int8_t *hi4 = x + i * 2 * in + b * 2 * GROUP, *lo4 = hi4 + GROUP;
            __m512i high = _mm512_set1_epi32(-128 * xh[i * groups + b]), lows = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++) {
                high = _mm512_dpbusd_epi32(high, wu[j], quad_at(hi4 + 4 * j));
                lows = _mm512_dpbusd_epi32(lows, quad_at(lo4 + 4 * j), w[j]);
            }
            __m512i c = _mm512_add_epi32(_mm512_slli_epi32(high, 8), lows);
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(scale, _mm512_mul_ps(_mm512_set1_ps(xd[i * groups + b]),
                                                                              _mm512_cvtepi32_ps(c))));
        }
    }
    for (int i = 0; i < n; i++) _mm512_storeu_ps(out + i * OUTS, acc[i]);
}
#elif defined(VEC256)
/* Up to ROW_TILE rows against 16 outputs' 8-bit weights on AVX2, as the 4-bit kernel's rows_dot: a group's codes
 * widened to 16 bits once for all the rows (each output's 4 bytes of a quad split into its even and its odd inputs),
 * the exact c = sum q v from madd (each lane at most 2 x 128 x 32767, the 16 of an output below 2^28; AVX2's byte
 * products would saturate on these codes), then row_dot8's float operations. */
static void rows_dot8(const uint8_t *wg, int64_t groups, int64_t in, int n, const int8_t *x, const float *xd,
                      const int32_t *xh, float *out) {
    (void)xh; /* the codes are taken signed: no correction by the hi plane's sums */
    __m256 acc[ROW_TILE][2];
    for (int i = 0; i < n; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < groups; b++) {
        const uint8_t *p = wg + b * Q8_GROUP_BYTES;
        __m256i wide[32];
        for (int j = 0; j < 8; j++)
            for (int h = 0; h < 2; h++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(p + j * 64 + h * 32));
                wide[4 * j + 2 * h] = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8); /* bytes 0, 2: signed */
                wide[4 * j + 2 * h + 1] = _mm256_srai_epi16(w, 8);                  /* bytes 1, 3 */
            }
        __m256 sc0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 512)));
        __m256 sc1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 528)));
        __m256i c[ROW_TILE][2];
        wide_sums(wide, x, in, b, n, c);
        for (int i = 0; i < n; i++) {
            __m256 dv = _mm256_set1_ps(xd[i * groups + b]);
            acc[i][0] = _mm256_add_ps(acc[i][0], _mm256_mul_ps(sc0, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(c[i][0]))));
            acc[i][1] = _mm256_add_ps(acc[i][1], _mm256_mul_ps(sc1, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(c[i][1]))));
        }
    }
    for (int i = 0; i < n; i++) {
        _mm256_storeu_ps(out + i * OUTS, acc[i][0]);
        _mm256_storeu_ps(out + i * OUTS + 8, acc[i][1]);
    }
}
#elif defined(NEON_DOT)
/* One row against 16 outputs' 8-bit weights on NEON: vector j's slice m holds outputs 4 m ..'s codes for inputs
 * 4 j .. 4 j + 3; group_ints' exact c, then the plain build's float operations */
static void row_dot8(const uint8_t *wg, int64_t groups, const int8_t *x, const float *xd, float out[OUTS]) {
    float32x4_t acc[4];
    for (int m = 0; m < 4; m++) acc[m] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < groups; b++) {
        const uint8_t *p = wg + b * Q8_GROUP_BYTES;
        const int8_t *hi = x + b * 2 * GROUP;
        int8_t lo[GROUP];
        lo_signed(hi + GROUP, lo);
        float32x4_t dv = vdupq_n_f32(xd[b]);
        for (int m = 0; m < 4; m++) {
            int8x16_t codes[8];
            for (int j = 0; j < 8; j++) codes[j] = vld1q_s8((const int8_t *)p + j * 64 + 16 * m);
            float32x4_t c = vcvtq_f32_s32(group_ints(codes, hi, lo));
            acc[m] = vaddq_f32(acc[m], vmulq_f32(halves4(p + 8 * 64 + 8 * m), vmulq_f32(dv, c)));
        }
    }
    for (int m = 0; m < 4; m++) vst1q_f32(out + 4 * m, acc[m]);
}
#else
/* One row against 16 outputs' 8-bit weights, in plain C */
static void row_dot8(const uint8_t *wg, int64_t groups, const int8_t *x, const float *xd, float out[OUTS]) {
    float acc[OUTS] = {0};
    for (int64_t b = 0; b < groups; b++) {
        const uint8_t *p = wg + b * Q8_GROUP_BYTES;
        const int8_t *hi = x + b * 2 * GROUP;
        const uint8_t *lo = (const uint8_t *)hi + GROUP;
        uint16_t halves[OUTS];
        memcpy(halves, p + 8 * 64, sizeof halves);
        float d = xd[b];
        for (int l = 0; l < OUTS; l++) {
            int32_t c = 0;
            for (int k = 0; k < GROUP; k++) c += (int8_t)p[(k / 4) * 64 + l * 4 + k % 4] * (256 * hi[k] + lo[k]);
            acc[l] = acc[l] + f16_to_f32(halves[l]) * (d * (float)c);
        }
    }
    memcpy(out, acc, sizeof acc);
}
#endif

#ifdef HAVE_AMX
/* 16 rows against output groups wg (and wg2): both planes' sums on the tiles, the codes tiled as packed */
static void amx_rows8(const uint8_t *wg, const uint8_t *wg2, int64_t groups, int64_t in, const int8_t *x,
                      const float *xd, const int32_t *xs, int n, float *out, float *out2) {
    (void)xs; /* the tiles take the codes signed: no correction by the hi plane's sums */
    _Alignas(64) int32_t sums[4][AMX_ROWS * OUTS];
    __m512 acc[2][AMX_ROWS];
    for (int i = 0; i < AMX_ROWS; i++) acc[0][i] = acc[1][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < groups; b++) {
        tile_sums(x, in, b, wg + b * Q8_GROUP_BYTES, wg2 ? wg2 + b * Q8_GROUP_BYTES : NULL, sums);
        for (int half = 0; half < (wg2 ? 2 : 1); half++) {
            const uint8_t *p = (half ? wg2 : wg) + b * Q8_GROUP_BYTES;
            __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 512)));
            for (int i = 0; i < n; i++) {
                __m512i c = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[2 * half] + i * OUTS), 8),
                                             _mm512_load_si512(sums[2 * half + 1] + i * OUTS));
                acc[half][i] = _mm512_add_ps(acc[half][i],
                                             _mm512_mul_ps(scale, _mm512_mul_ps(_mm512_set1_ps(xd[i * groups + b]),
                                                                                _mm512_cvtepi32_ps(c))));
            }
        }
    }
    for (int i = 0; i < n; i++) _mm512_storeu_ps(out + i * OUTS, acc[0][i]);
    if (wg2)
        for (int i = 0; i < n; i++) _mm512_storeu_ps(out2 + i * OUTS, acc[1][i]);
}

#endif

/* ---- the two kernels, on the tiles or the vectors --------------------------------------------------------- */

#ifndef ROW_TILE /* one row at a time: the vector paths' signature over row_dot and row_dot8 */
#define ROW_TILE 1
static void rows_dot(const uint8_t *wg, int64_t groups, int64_t in, int n, const int8_t *x, const float *xd,
                     const int32_t *xs, float *out) {
    (void)in, (void)n;
    row_dot(wg, groups, x, xd, xs, out);
}
static void rows_dot8(const uint8_t *wg, int64_t groups, int64_t in, int n, const int8_t *x, const float *xd,
                      const int32_t *xh, float *out) {
    (void)in, (void)n, (void)xh;
    row_dot8(wg, groups, x, xd, out);
}
#endif

typedef void (*VectorRows)(const uint8_t *wg, int64_t groups, int64_t in, int n, const int8_t *x, const float *xd,
                           const int32_t *sums, float *out);
typedef void (*TileRows)(const uint8_t *wg, const uint8_t *wg2, int64_t groups, int64_t in, const int8_t *x,
                         const float *xd, const int32_t *sums, int n, float *out, float *out2);

/* A kernel: its packed group's bytes, its rows on the vectors (up to ROW_TILE at a time) and on the tiles. `sums`
 * is the per-row-group integer each takes: the code sums (4-bit), the hi plane's sums (8-bit). */
typedef struct {
    int64_t group_bytes;
    VectorRows vector;
    TileRows tiles;
} Kernel;

#ifdef HAVE_AMX
static const Kernel Q4 = {GROUP_BYTES, rows_dot, amx_rows}, Q8 = {Q8_GROUP_BYTES, rows_dot8, amx_rows8};

/* Output groups [g0, g1) on the tiles, two at a time; the activations hold whole tiles (the last padded with
 * zero rows by the call) */
static void tile_groups(const Kernel *k, const uint8_t *w, int64_t in, int64_t out, const int8_t *xq,
                        const float *xd, const int32_t *sums, int64_t rows, const float *bias, int accumulate,
                        int64_t g0, int64_t g1, float *y) {
    int64_t groups = in / GROUP;
    _Alignas(64) float acc[2][AMX_ROWS * OUTS];
    for (int64_t g = g0; g < g1; g += 2) {
        const uint8_t *wg = w + g * groups * k->group_bytes, *wg2 = g + 1 < g1 ? wg + groups * k->group_bytes : NULL;
        for (int64_t r0 = 0; r0 < rows; r0 += AMX_ROWS) {
            int n = rows - r0 < AMX_ROWS ? (int)(rows - r0) : AMX_ROWS;
            k->tiles(wg, wg2, groups, in, xq + r0 * 2 * in, xd + r0 * groups, sums + r0 * groups, n, acc[0], acc[1]);
            store_outputs(acc[0], n, out, g, bias, accumulate, y + r0 * out);
            if (wg2) store_outputs(acc[1], n, out, g + 1, bias, accumulate, y + r0 * out);
        }
    }
}
#else
static const Kernel Q4 = {GROUP_BYTES, rows_dot, NULL}, Q8 = {Q8_GROUP_BYTES, rows_dot8, NULL};
#ifdef VECTOR_LAYOUT
static const Kernel Q4_PLANES = {GROUP_BYTES, rows_dot_planes, NULL};
#endif
#endif

/* y[r, 16 g .. 16 g + 16) for rows [0, rows) and output groups [g0, g1) */
static void kernel_groups(const Kernel *k, const uint8_t *w, int64_t in, int64_t out, const int8_t *xq,
                          const float *xd, const int32_t *sums, int64_t rows, const float *bias, int accumulate,
                          int tiles, int64_t g0, int64_t g1, float *y) {
    int64_t groups = in / GROUP;
#ifdef HAVE_AMX
    if (tiles) {
        amx_configure();
        tile_groups(k, w, in, out, xq, xd, sums, rows, bias, accumulate, g0, g1, y);
        _tile_release();
        return;
    }
#else
    (void)tiles;
#endif
    int64_t group_bytes = groups * k->group_bytes;
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *wg = w + g * group_bytes;
        if (rows > 1 && g + 1 < g1) /* this group was read from memory: ask for the next while it computes (one
                                     * row computes too little to hide it: the hardware's prefetch does better) */
            for (int64_t at = 0; at < group_bytes; at += 64) __builtin_prefetch(wg + group_bytes + at);
        for (int64_t r0 = 0; r0 < rows;) {
            float acc[ROW_TILE * OUTS];
            int n = rows - r0 < ROW_TILE ? (int)(rows - r0) : ROW_TILE;
            k->vector(wg, groups, in, n, xq + r0 * 2 * in, xd + r0 * groups, sums + r0 * groups, acc);
            store_outputs(acc, n, out, g, bias, accumulate, y + r0 * out);
            r0 += n;
        }
    }
}

/* ---- the thread pool ------------------------------------------------------------------------------------
 * A call's output groups are cut into chunks that every thread, the caller included, claims one at a time: a
 * worker the OS has not scheduled (a busy machine) only means the others claim more. A claim is a
 * compare-and-swap on (job number, next chunk), so a worker that wakes late can never take a chunk of a later
 * job; once a job's chunks are all finished the caller closes its claims. */

#define MAX_THREADS 64
#define CHUNKS_PER_THREAD 4
#define SPIN_NS 50000 /* an idle worker polls this long before it sleeps: a step's calls come closer together, and
                        * the ops between steps (torch's own threads among them) get the core back soon after */
#define CLOSED 0xffffffffu

/* A matmul call's shared inputs: its output groups are what the pool's chunks divide */
typedef struct {
    const Kernel *kernel;
    const uint8_t *w;
    const int8_t *xq;
    const float *xd, *bias;
    const int32_t *sums; /* the kernel's per-row-group integers (Kernel) */
    int64_t in, out, rows;
    float *y;
    int accumulate, tiles; /* tiles: the rows go to the tile unit, 16 a tile */
} Matmul;

/* A job: run(task, chunk, chunks, slot) computes part `chunk` of `chunks` of the task on the thread in `slot`
 * (0 the caller, 1.. the workers; below `threads`, so a task may keep a workspace per slot). Which thread takes
 * a chunk changes none of its numbers. */
typedef void (*ChunkFn)(const void *task, int64_t chunk, int64_t chunks, int32_t slot);
typedef struct {
    ChunkFn run;
    const void *task;
    int64_t chunks;
    int32_t threads;
} Job;

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    atomic_uint generation;
    _Atomic uint64_t claim; /* job generation << 32 | next chunk */
    atomic_llong finished;
    int workers, sleeping;
    Job job;
    pthread_t ids[MAX_THREADS];
    struct {
        unsigned born; /* the generation when the worker was made: any later one is a job */
        int32_t slot;
    } starts[MAX_THREADS];
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, {0}, {0}, {{0, 0}}};

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void matmul_chunk(const void *task, int64_t chunk, int64_t chunks, int32_t slot) {
    const Matmul *m = task;
    int64_t total = m->out / OUTS, g0 = total * chunk / chunks, g1 = total * (chunk + 1) / chunks;
    (void)slot;
    kernel_groups(m->kernel, m->w, m->in, m->out, m->xq, m->xd, m->sums, m->rows, m->bias, m->accumulate, m->tiles,
                  g0, g1, m->y);
}

/* Claims and runs chunks of job `generation` until none is left (or the job is no longer that one); a slot the
 * job has no room for claims none. */
static void take_chunks(const Job *job, unsigned generation, int32_t slot) {
    if (slot >= job->threads) return;
    for (;;) {
        uint64_t seen = atomic_load_explicit(&pool.claim, memory_order_acquire);
        uint32_t next = (uint32_t)seen;
        if ((unsigned)(seen >> 32) != generation || next == CLOSED || (int64_t)next >= job->chunks) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.claim, &seen, seen + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        job->run(job->task, next, job->chunks, slot);
        atomic_fetch_add_explicit(&pool.finished, 1, memory_order_release);
    }
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* ---- reading the next weight ahead ----------------------------------------------------------------------
 * Between a decode step's matmuls the caller runs norms, rotary, attention and the Python around them: about 3 ms
 * of a 1B model's 25 ms token, in gaps of tens of microseconds, while the memory bus that bounds the matmuls idles
 * and a worker polls for its next job. Before each matmul the engine names the weight of the one after it
 * (ns_read_ahead); a polling worker, from the moment it runs out of the current matmul's chunks, asks memory for
 * that weight's first bytes (up to READ_AHEAD_MAX, a look at the job counter every READ_AHEAD_STEP) until the next
 * job comes. Only where the bytes come from changes, never a value: a prefetch instruction neither faults (a
 * weight freed meanwhile costs nothing) nor writes. Two engines naming weights from two threads at once can tear
 * a hint: a prefetch of the wrong bytes, nothing more. */
#define READ_AHEAD_STEP 4096
#define READ_AHEAD_MAX (8 << 20) /* a quarter of a 32 MiB last-level cache */

static struct {
    atomic_uint serial; /* odd while it is being written */
    _Atomic uintptr_t at;
    atomic_llong bytes;
} ahead;
static atomic_llong read_ahead_total = 0; /* the bytes the workers asked for: a measurement, not the hints' sum */

/* The matmul after the next reads `bytes` from `p` (NULL or 0: nothing to read ahead). */
void ns_read_ahead(const void *p, int64_t bytes) {
    atomic_fetch_add(&ahead.serial, 1);
    atomic_store(&ahead.at, (uintptr_t)p);
    atomic_store(&ahead.bytes, p == NULL || bytes < 0 ? 0 : (bytes > READ_AHEAD_MAX ? READ_AHEAD_MAX : bytes));
    atomic_fetch_add(&ahead.serial, 1);
}

int64_t ns_read_ahead_bytes(void) { return atomic_load(&read_ahead_total); }

typedef struct {
    unsigned serial;
    uintptr_t at;
    int64_t bytes, done;
} AheadCursor;

/* Asks for the next READ_AHEAD_STEP bytes of the current hint; 0 when there are none to ask for. */
static int read_ahead_step(AheadCursor *c) {
    unsigned serial = atomic_load_explicit(&ahead.serial, memory_order_acquire);
    if (serial & 1) return 0;
    if (serial != c->serial) {
        uintptr_t at = atomic_load(&ahead.at);
        int64_t bytes = atomic_load(&ahead.bytes);
        if (atomic_load(&ahead.serial) != serial) return 0;
        *c = (AheadCursor){serial, at & ~(uintptr_t)63, bytes + (int64_t)(at & 63), 0};
    }
    if (c->done >= c->bytes) return 0;
    int64_t end = c->done + READ_AHEAD_STEP < c->bytes ? c->done + READ_AHEAD_STEP : c->bytes;
    for (int64_t i = c->done; i < end; i += 64) __builtin_prefetch((const char *)c->at + i, 0, 2);
    atomic_fetch_add_explicit(&read_ahead_total, end - c->done, memory_order_relaxed);
    c->done = end;
    return 1;
}

static void *worker(void *arg) {
    unsigned seen = pool.starts[(intptr_t)arg].born;
    int32_t slot = pool.starts[(intptr_t)arg].slot;
    AheadCursor cursor = {0, 0, 0, 0};
    for (;;) {
        unsigned now;
        int64_t since = now_ns();
        int polls = 0;
        while ((now = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen) {
            if (slot == 1 && read_ahead_step(&cursor)) {
                since = now_ns(); /* reading ahead is work: the idle time starts after it */
                continue;
            }
            if ((++polls & 63) || now_ns() - since < SPIN_NS) {
                relax();
                continue;
            }
            pthread_mutex_lock(&pool.lock);
            pool.sleeping++;
            while ((now = atomic_load(&pool.generation)) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            pool.sleeping--;
            pthread_mutex_unlock(&pool.lock);
            break;
        }
        seen = now;
        Job job = pool.job; /* torn only if the job is already over: then every claim below fails */
        take_chunks(&job, now, slot);
    }
    return NULL;
}

static pthread_mutex_t pool_owner = PTHREAD_MUTEX_INITIALIZER; /* one caller at a time uses the pool */

static void forget_pool_in_child(void) { /* a forked child has none of the parent's threads */
    pthread_mutex_init(&pool_owner, NULL);
    pool.workers = 0;
    pool.sleeping = 0;
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
}

static void run_alone(Job job) { job.run(job.task, 0, 1, 0); }

static void run_on_pool(Job job, int threads);

/* Runs `job` on up to `threads` threads: this one and threads - 1 workers, started on first need. A second engine
 * stepping in another thread while the pool is busy runs its call on its own thread (the same bits). */
static void run_pooled(Job job, int threads) {
    if (threads <= 1 || pthread_mutex_trylock(&pool_owner) != 0) {
        run_alone(job);
        return;
    }
    run_on_pool(job, threads);
    pthread_mutex_unlock(&pool_owner);
}

static void run_on_pool(Job job, int threads) {
    static int registered = 0;
    if (!registered) {
        pthread_atfork(NULL, NULL, forget_pool_in_child);
        registered = 1;
    }
    threads = threads < 1 ? 1 : (threads > MAX_THREADS ? MAX_THREADS : threads);
    while (pool.workers < threads - 1) {
        int k = pool.workers;
        pool.starts[k].born = atomic_load(&pool.generation), pool.starts[k].slot = k + 1;
        if (pthread_create(&pool.ids[k], NULL, worker, (void *)(intptr_t)k) != 0) break;
        pthread_detach(pool.ids[pool.workers]);
        pool.workers++;
    }
    if (threads == 1 || pool.workers == 0 || job.chunks <= 1) {
        run_alone(job);
        return;
    }
    job.threads = threads;
    unsigned generation = atomic_load(&pool.generation) + 1;
    pool.job = job;
    atomic_store(&pool.finished, 0);
    atomic_store_explicit(&pool.claim, (uint64_t)generation << 32, memory_order_release);
    atomic_store_explicit(&pool.generation, generation, memory_order_release);
    pthread_mutex_lock(&pool.lock);
    if (pool.sleeping) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    take_chunks(&job, generation, 0);
    while (atomic_load_explicit(&pool.finished, memory_order_acquire) < job.chunks) relax();
    atomic_store_explicit(&pool.claim, ((uint64_t)generation << 32) | CLOSED, memory_order_release);
}

/* Runs part c of `chunks` of `task` for every c on up to `threads` threads of this pool (fused.c's attention
 * shares it: a call that started threads of its own paid about 60 us for them). run's slot is below threads. */
void ns_pool_run(ChunkFn run, const void *task, int64_t chunks, int32_t threads) {
    run_pooled((Job){run, task, chunks, threads}, threads);
}

/* ---- the call ------------------------------------------------------------------------------------------- */

static int matmul(int eight_bit, const uint8_t *w, const float *x, int64_t rows, int64_t in, int64_t out,
                  const float *bias, float *y, int32_t threads, int32_t accumulate) {
    int64_t groups = in / GROUP;
    int tiles = use_tiles(rows);
    int64_t held = tiles ? (rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : rows; /* the tiles read whole tiles */
    int8_t *xq = malloc((size_t)(held * 2 * in));
    float *xd = calloc((size_t)(held * groups), sizeof(float));
    int32_t *xs = calloc((size_t)(held * groups * 2), sizeof(int32_t)), *xh = xs + held * groups;
    if (!xq || !xd || !xs) {
        free(xq), free(xd), free(xs);
        return -1;
    }
    memset(xq + rows * 2 * in, 0, (size_t)((held - rows) * 2 * in)); /* zero rows: they reach no output */
    quantize_rows(x, rows, in, xq, xd, xs, eight_bit ? xh : NULL);
    const Kernel *kernel = eight_bit ? &Q8 : &Q4;
#ifdef VECTOR_LAYOUT
    if (!eight_bit && rows < PAIRS_FROM)
        kernel = &Q4_PLANES;
    else
        vector_layout(xq, rows, in);
#endif
    Matmul task = {kernel, w, xq, xd, bias, eight_bit ? xh : xs, in, out, rows, y, accumulate, tiles};
    int64_t chunks = (int64_t)threads * CHUNKS_PER_THREAD, out_groups = out / OUTS;
    if (chunks > out_groups) chunks = out_groups > 0 ? out_groups : 1;
    run_pooled((Job){matmul_chunk, &task, chunks, threads}, threads);
    if (tiles) atomic_fetch_add(&amx_rows_served, rows);
    free(xq), free(xd), free(xs);
    return 0;
}

/* y [rows, out] float32 = x [rows, in] float32 . W^T (+ bias [out] when given; added to what y holds when
 * `accumulate`), W packed by ns_q4_pack; on up to `threads` threads. Calls are made one at a time (the engine's step
 * thread). Returns 0, or -1 when out of memory. */
int ns_q4_matmul(const uint8_t *w, const float *x, int64_t rows, int64_t in, int64_t out, const float *bias,
                 float *y, int32_t threads, int32_t accumulate) {
    return matmul(0, w, x, rows, in, out, bias, y, threads, accumulate);
}

/* ns_q4_matmul for W packed by ns_q8_pack */
int ns_q8_matmul(const uint8_t *w, const float *x, int64_t rows, int64_t in, int64_t out, const float *bias,
                 float *y, int32_t threads, int32_t accumulate) {
    return matmul(1, w, x, rows, in, out, bias, y, threads, accumulate);
}

/* out[r] = the index of row r's largest value (the first, on a tie; the first NaN if there is one), as
 * torch.argmax: for the sampler's greedy rows, in one pass with no thread pool to wake. */
void ns_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * n;
        int64_t best = 0;
        float top = v[0];
        for (int64_t i = 0; i < n; i++) {
            if (v[i] != v[i]) {
                best = i;
                break;
            }
            if (v[i] > top) top = v[i], best = i;
        }
        out[r] = best;
    }
}

/* ---- packing a file's 4-bit rows ------------------------------------------------------------------------ */

typedef struct {
    const uint8_t *raw;
    int32_t q4_1;
    int64_t out, in;
    uint8_t *dst;
} GgufPack;

/* Output groups [g0, g1) of a GgufPack (see ns_q4_pack_gguf) */
static void gguf_pack_chunk(const void *task, int64_t chunk, int64_t chunks, int32_t slot) {
    const GgufPack *t = task;
    int64_t groups = t->in / GROUP, width = t->q4_1 ? 20 : 18, all = t->out / OUTS;
    (void)slot;
    for (int64_t g = all * chunk / chunks; g < all * (chunk + 1) / chunks; g++)
        for (int64_t b = 0; b < groups; b++) {
            uint8_t *p = t->dst + (g * groups + b) * GROUP_BYTES;
            uint16_t halves[2 * OUTS];
            for (int l = 0; l < OUTS; l++) {
                const uint8_t *block = t->raw + ((g * OUTS + l) * groups + b) * width;
                q4_interleave(block + width - 16, p, l);
                float d = half_at(block), zero = t->q4_1 ? half_at(block + 2) + 8.0f * d : 0.0f;
                halves[l] = f32_to_f16(d);
                halves[OUTS + l] = f32_to_f16(zero);
            }
            memcpy(p + 4 * 64, halves, sizeof halves);
        }
}

/* GGUF Q4_0 (18-byte blocks: f16 d, 16 bytes of nibbles) or Q4_1 (`q4_1`: 20 bytes, f16 d and m first) rows
 * [out, in / 32 blocks] -> dst, as ns_q4_pack packs the same weight from Int4Blocks (code j of a block in byte j's
 * low nibble, code j + 16 in its high one; scale d, zero 0 or m + 8 d in float32, then f16), bit for bit, with no
 * unpacked copy between: a file's 4-bit rows packed straight from its mapped bytes, on up to `threads` threads. */
void ns_q4_pack_gguf(const uint8_t *raw, int32_t q4_1, int64_t out, int64_t in, uint8_t *dst, int32_t threads) {
    GgufPack task = {raw, q4_1, out, in, dst};
    int64_t chunks = (int64_t)(threads < 1 ? 1 : threads) * 4;
    if (chunks > out / OUTS) chunks = out / OUTS > 0 ? out / OUTS : 1;
    ns_pool_run(gguf_pack_chunk, &task, chunks, threads < 1 ? 1 : threads);
}
