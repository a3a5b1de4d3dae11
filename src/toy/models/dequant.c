/* A frozen base's GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) to bfloat16 or
   float32 weights, for its products in training (models/quant.py dequantize: every forward
   and backward of a LoRA, preference, GRPO or distillation step on a base kept in its
   blocks dequantizes each weight it meets). torch's path is five elementwise passes over
   uint8 and float tensors (~0.2 G weights a second on a Zen 4 thread); this is one pass,
   the codes read once and each weight written once.

   The bits are the torch path's: w = d * q (+ m), the product exact in float32 (an f16
   scale of 11 significant bits times a code of at most 8; a K-quant's sub-block scale
   d * sc, 11 bits times 6 or 8, times a code of at most 6: under 24 bits), one rounding at
   the addition, then rounded once more to bfloat16, to nearest even (bf16.h).
   -ffp-contract=off (models/native.py) keeps the addition its own, though a fused one
   would give the same bits here.

   head_dim > 0: the rows are a Q or K weight in llama.cpp's interleaved order, written back
   in the half-split order toy's rotary reads (quant.py half_split_rows): row h*D + 2i + t to
   h*D + t*D/2 + i.

   Rows are shared out between OpenMP's threads (built with -fopenmp: torch's own threads,
   as models/gelu_bf16.c says), one thread below PARALLEL_MIN weights. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define PARALLEL_MIN 65536

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

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
    } else if (qtype == Q4_1) {
        const float d = half(b), m = half(b + 2);
        const uint8_t *q = b + 4;
        for (int j = 0; j < 16; j++) {
            w[j] = d * (float)(q[j] & 0xf) + m;
            w[j + 16] = d * (float)(q[j] >> 4) + m;
        }
    } else { /* Q5_0, Q5_1: the fifth bit of code j is bit j of the little-endian word qh */
        const int one = qtype == Q5_1;
        const float d = half(b), m = one ? half(b + 2) : 0.0f;
        uint32_t qh;
        memcpy(&qh, b + (one ? 4 : 2), 4);
        const uint8_t *q = b + (one ? 8 : 6);
        for (int j = 0; j < 16; j++) {
            const int lo = (q[j] & 0xf) | (((qh >> j) & 1) << 4);
            const int hi = (q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            if (one) {
                w[j] = d * (float)lo + m;
                w[j + 16] = d * (float)hi + m;
            } else {
                w[j] = d * (float)(lo - 16);
                w[j + 16] = d * (float)(hi - 16);
            }
        }
    }
}

/* Q4_K/Q5_K: the 6-bit scale and minimum of sub-block j from the 12 bytes at q (ggml's
   get_scale_min_k4) */
static inline void scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* one super-block of 256 weights: Q4_K and Q5_K (d * sc) * q - (dmin * m) a sub-block of 32,
   Q6_K (d * sc) * (q - 32) a sub-block of 16 */
static inline void super_block(int qtype, const uint8_t *b, float *w) {
    if (qtype == Q6_K) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = half(b + 208);
        for (int n = 0; n < 2; n++, ql += 64, qh += 32, sc += 8, w += 128) {
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                w[l] = (d * (float)sc[is]) * (float)q1;
                w[l + 32] = (d * (float)sc[is + 2]) * (float)q2;
                w[l + 64] = (d * (float)sc[is + 4]) * (float)q3;
                w[l + 96] = (d * (float)sc[is + 6]) * (float)q4;
            }
        }
        return;
    }
    const float d = half(b), dmin = half(b + 2);
    const uint8_t *scales = b + 4;
    const uint8_t *qh = b + 16, *ql = b + (qtype == Q5_K ? 48 : 16);
    for (int j = 0; j < 4; j++, ql += 32, w += 64) {
        int sc1, m1, sc2, m2;
        scale_min(2 * j, scales, &sc1, &m1);
        scale_min(2 * j + 1, scales, &sc2, &m2);
        const float d1 = d * (float)sc1, z1 = -(dmin * (float)m1);
        const float d2 = d * (float)sc2, z2 = -(dmin * (float)m2);
        for (int l = 0; l < 32; l++) {
            int lo = ql[l] & 0xf, hi = ql[l] >> 4;
            if (qtype == Q5_K) {
                lo += ((qh[l] >> (2 * j)) & 1) << 4;
                hi += ((qh[l] >> (2 * j + 1)) & 1) << 4;
            }
            w[l] = d1 * (float)lo + z1;
            w[l + 32] = d2 * (float)hi + z2;
        }
    }
}

static int64_t block_bytes(int qtype) {
    switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

static inline int64_t out_row(int64_t r, int64_t head_dim) {
    if (head_dim <= 0) return r;
    const int64_t h = r / head_dim, j = r % head_dim;
    return h * head_dim + (j % 2) * (head_dim / 2) + j / 2;
}

/* rows x cols weights from rows x (cols / block) blocks; 0, or -1 for a type it does not
   read */
int toy_dequantize(const uint8_t *restrict blocks, void *restrict out, int64_t rows, int64_t cols,
                   int32_t qtype, int32_t bf16, int64_t head_dim) {
    const int64_t bb = block_bytes(qtype);
    const int64_t n = (qtype == Q4_K || qtype == Q5_K || qtype == Q6_K) ? 256 : 32;
    if (bb == 0 || cols % n) return -1;
    const int64_t per_row = cols / n;
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *src = blocks + r * per_row * bb;
        const int64_t o = out_row(r, head_dim) * cols;
        float w[256];
        for (int64_t k = 0; k < per_row; k++) {
            if (n == 256)
                super_block(qtype, src + k * bb, w);
            else
                block(qtype, src + k * bb, w);
            if (bf16) {
                uint16_t *dst = (uint16_t *)out + o + k * n;
                for (int j = 0; j < n; j++) dst[j] = narrow(w[j]);
            } else {
                memcpy((float *)out + o + k * n, w, n * sizeof(float));
            }
        }
    }
    return 0;
}
