/* exp for toy's C kernels (models/gelu_bf16.c, models/decode_step.c): a short polynomial
   without a math library call, so that the loops around it vectorise. models/native.py keys a
   built library by its source and the local headers it includes. */
#ifndef TOY_EXP_H
#define TOY_EXP_H
#include <stdint.h>
#include <string.h>

/* exp(t) for t in [-87, 87] (the caller clamps): t = n ln2 + r, |r| <= ln2/2, exp(r) by
   Cephes' degree-6 polynomial, 2^n put into the exponent's bits. */
static inline float exp_clamped(float t) {
    /* to the nearest integer, ties to even: adding 1.5 * 2^23 leaves no fraction bits */
    const float n = (t * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (t - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return p * scale;
}

#endif
