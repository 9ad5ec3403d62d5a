/* kdecode.c: GGUF's rarer weight types decoded to float32 exactly as gguf does, `blocks` runs of 256 inputs. */
#ifndef NS_KDECODE_H
#define NS_KDECODE_H
#include <stdint.h>

/* IQ4_NL / IQ4_XS's 16 code values (ggml's kvalues_iq4nl) */
static const int8_t NS_KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

void ns_dec_q5_0(const uint8_t *w, int64_t blocks, float *out);
void ns_dec_q5_1(const uint8_t *w, int64_t blocks, float *out);
void ns_dec_iq4_nl(const uint8_t *w, int64_t blocks, float *out);
void ns_dec_iq4_xs(const uint8_t *w, int64_t blocks, float *out);
void ns_dec_q2_k(const uint8_t *w, int64_t blocks, float *out);
void ns_dec_q3_k(const uint8_t *w, int64_t blocks, float *out);

#endif
