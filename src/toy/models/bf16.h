/* bfloat16 <-> float32 as torch converts them, for toy's C kernels (models/gelu_bf16.c,
   train/adamw_bf16.c). models/native.py keys a built library by its source and the local
   headers it includes, so a change here rebuilds both. */
#ifndef TOY_BF16_H
#define TOY_BF16_H
#include <stdint.h>
#include <string.h>

static inline float widen(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* to nearest, ties to even (torch's float -> bfloat16 for finite values) */
static inline uint16_t narrow(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u; /* NaN, as torch writes it */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
#endif
