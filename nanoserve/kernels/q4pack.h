/* A GGUF 4-bit block's 32 codes in the 4-bit kernels' layout (linear.c's q4x16, q4x8.c): for output l of a group
 * of 16, vector v (64 bytes) holds at byte 4 l + c input 8 v + c in its low nibble and 8 v + 4 + c in its high
 * one. A block's qs holds input j < 16 in byte j's low nibble, j + 16 in its high one: four bytes at a time. */
#ifndef NS_Q4PACK_H
#define NS_Q4PACK_H
#include <stdint.h>
#include <string.h>

static inline void q4_interleave(const uint8_t *qs, uint8_t *p, int l) {
    uint32_t q[4], v[4];
    memcpy(q, qs, 16);
    const uint32_t low = 0x0f0f0f0fu, high = 0xf0f0f0f0u;
    v[0] = (q[0] & low) | ((q[1] & low) << 4);  /* inputs 0-3 and 4-7 */
    v[1] = (q[2] & low) | ((q[3] & low) << 4);  /* 8-11 and 12-15 */
    v[2] = ((q[0] >> 4) & low) | (q[1] & high); /* 16-19 and 20-23 */
    v[3] = ((q[2] >> 4) & low) | (q[3] & high); /* 24-27 and 28-31 */
    for (int k = 0; k < 4; k++) memcpy(p + k * 64 + l * 4, &v[k], 4);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* A group's four vectors of codes as eight vectors of bytes 0..15: nib[2 v] the low nibbles of vector v (inputs
 * 8 v + c), nib[2 v + 1] its high ones (8 v + 4 + c) */
static inline void q4_unpack_avx512(const uint8_t *p, __m512i nib[8]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int v = 0; v < 4; v++) {
        __m512i packed = _mm512_loadu_si512(p + v * 64);
        nib[2 * v] = _mm512_and_si512(packed, low);
        nib[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    }
}
#endif

#endif
