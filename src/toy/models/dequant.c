/* GGUF blocks of Q4_0, Q4_1 and Q8_0 to bfloat16 or float32 weights, for the frozen base's
   products in training (models/quant.py dequantize: every forward and backward of a LoRA,
   preference, GRPO or distillation step on a quantized base dequantizes each weight it
   meets). torch's path is five elementwise passes over uint8 and float tensors (~0.2 G
   weights a second on a Zen 4 thread); this is one pass, the codes read once and each
   weight written once.

   The bits are the torch path's: w = d * q (+ m), the product exact in float32 (an f16 scale
   of 11 significant bits times a code of at most 8), one rounding at the addition, then
   rounded once more to bfloat16, to nearest even (bf16.h). -ffp-contract=off (models/
   native.py) keeps the addition its own, though a fused one would give the same bits here.

   head_dim > 0: the rows are a Q or K weight in llama.cpp's interleaved order, written back
   in the half-split order toy's rotary reads (quant.py half_split_rows): row h*D + 2i + t to
   h*D + t*D/2 + i.

   Rows are shared out between OpenMP's threads (built with -fopenmp: torch's own threads,
   as models/gelu_bf16.c says), one thread below PARALLEL_MIN weights. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define PARALLEL_MIN 65536

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

/* IEEE half to float, exactly (every half is a float) */
static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        float f = (float)man * 5.9604644775390625e-8f; /* man * 2^-24: exact */
        memcpy(&u, &f, 4);
        u |= sign;
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* one block of 32 weights */
static inline void block(int qtype, const uint8_t *b, float *w) {
    if (qtype == Q8_0) {
        const float d = half(b);
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < 32; j++) w[j] = d * (float)q[j];
    } else if (qtype == Q4_0) {
        const float d = half(b);
        const uint8_t *q = b + 2;
        for (int j = 0; j < 16; j++) {
            w[j] = d * (float)((int)(q[j] & 0xf) - 8);
            w[j + 16] = d * (float)((int)(q[j] >> 4) - 8);
        }
    } else { /* Q4_1 */
        const float d = half(b), m = half(b + 2);
        const uint8_t *q = b + 4;
        for (int j = 0; j < 16; j++) {
            w[j] = d * (float)(q[j] & 0xf) + m;
            w[j + 16] = d * (float)(q[j] >> 4) + m;
        }
    }
}

static int64_t block_bytes(int qtype) {
    return qtype == Q8_0 ? 34 : qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : 0;
}

static inline int64_t out_row(int64_t r, int64_t head_dim) {
    if (head_dim <= 0) return r;
    const int64_t h = r / head_dim, j = r % head_dim;
    return h * head_dim + (j % 2) * (head_dim / 2) + j / 2;
}

/* rows x cols weights from rows x (cols / 32) blocks; 0, or -1 for a type it does not read */
int toy_dequantize(const uint8_t *restrict blocks, void *restrict out, int64_t rows, int64_t cols,
                   int32_t qtype, int32_t bf16, int64_t head_dim) {
    const int64_t bb = block_bytes(qtype);
    if (bb == 0 || cols % 32) return -1;
    const int64_t per_row = cols / 32;
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *src = blocks + r * per_row * bb;
        const int64_t o = out_row(r, head_dim) * cols;
        float w[32];
        for (int64_t k = 0; k < per_row; k++) {
            block(qtype, src + k * bb, w);
            if (bf16) {
                uint16_t *dst = (uint16_t *)out + o + k * 32;
                for (int j = 0; j < 32; j++) dst[j] = narrow(w[j]);
            } else {
                memcpy((float *)out + o + k * 32, w, sizeof w);
            }
        }
    }
    return 0;
}
