/* IEEE half precision to and from float32, exactly (round to nearest even), with no F16C needed: the packed
 * kernels' scales (linear.c) and GGUF's block scales (kquant.c, kdecode.c). */
#ifndef NS_HALF_H
#define NS_HALF_H
#include <stdint.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, mag = x & 0x7fffffffu;
    if (mag >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (mag > 0x7f800000u ? 0x200u : 0)); /* inf, NaN */
    if (mag >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);                                      /* overflow */
    if (mag < 0x38800000u) { /* subnormal half: round the value at 2^-24 steps, to nearest even */
        float a;
        memcpy(&a, &mag, 4);
        float scaled = a * 16777216.0f; /* exact: a power of two */
        float rounded = (scaled + 12582912.0f) - 12582912.0f;
        return (uint16_t)(sign | (uint16_t)rounded);
    }
    uint32_t rounded = mag + 0x0fffu + ((mag >> 13) & 1u); /* to nearest even at 13 dropped bits */
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, x;
    if (exp == 0) {
        float f = (float)man * 5.9604644775390625e-8f; /* man * 2^-24, exact */
        memcpy(&x, &f, 4);
        x |= sign;
    } else if (exp == 31) {
        x = sign | 0x7f800000u | (man << 13);
    } else {
        x = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &x, 4);
    return f;
}

/* the f16 at p (unaligned, as GGUF's block scales lie): exact either way, F16C's conversion is the same function */
static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    return f16_to_f32(h);
#endif
}

#endif
