/* GELU, tanh form (GPT-2's, Gemma's), on bfloat16 values: the forward and its gradient,
   one pass over memory each, in float32 inside and rounded once to bfloat16 as torch's bf16
   kernels round.

   Why: torch's CPU kernel for F.gelu(x, approximate="tanh") takes its tanh from a long
   vector routine: 3.7 ms forward and 3.7 backward on 8 x 256 x 1536 bf16 values on a 2-core
   Zen 4, where the erf form takes 0.9 and 1.8 (bench/gelu_kernel.py). Here
       gelu(x)  = x * s,                      s = sigmoid(2u) = (1 + tanh(u)) / 2,
       gelu'(x) = s + 2 x s (1 - s) u',       u = sqrt(2/pi) (x + 0.044715 x^3),
                                              u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2),
   with exp from a short polynomial (Cephes' expf: a float32 error of ~2 ulp, 2^-22 of the
   value; bfloat16 keeps 2^-8): the loop vectorises without a math library. The results
   match torch's kernel to one bfloat16 rounding (tests/models/test_gelu.py); a float32 run
   never comes here (its bytes are torch's).

   Every product is rounded on its own (-ffp-contract=off, train/native's flags), so the
   vector loop and its scalar tail round alike and a value's result does not depend on
   where a thread's range begins. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"


#define K_BETA 0.7978845608028654f /* sqrt(2 / pi) */
#define K_KAPPA 0.044715f

/* s = sigmoid(2u) = 1 / (1 + exp(-2u)); past |2u| = 87, where exp leaves float's range, s
   is 1 (to float32's precision already) or 0 (so that gelu(x) = -0 for a large negative x,
   as torch gives) */
static inline float half_tanh_plus(float x) {
    const float t = -2.0f * K_BETA * (x + K_KAPPA * x * x * x);
    const float e = exp_clamped(t > 87.0f ? 87.0f : (t < -87.0f ? -87.0f : t));
    return t > 87.0f ? 0.0f : 1.0f / (1.0f + e);
}

/* Blocks of BLOCK values shared out between OpenMP's threads: built with -fopenmp, the
   library takes the libgomp torch has loaded (the same soname), so the split runs on torch's
   own threads, as many as torch.get_num_threads() (a pool of toy's own beside them
   contended with their spinning: 1.5x slower after a matmul). Below PARALLEL_MIN values,
   one thread. */
#define BLOCK 16384
#define PARALLEL_MIN 65536

void toy_gelu_bf16(const uint16_t *restrict x, uint16_t *restrict y, int64_t n) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t hi = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        for (int64_t i = b * BLOCK; i < hi; i++) {
            const float v = widen(x[i]);
            y[i] = narrow(v * half_tanh_plus(v));
        }
    }
}

/* the same loop as toy_gelu_bf16's, kept apart: an OpenMP body is outlined before a
   constant flag could pick one of two loops in it */
void toy_gelu_backward_bf16(const uint16_t *restrict g, const uint16_t *restrict x,
                            uint16_t *restrict out, int64_t n) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t hi = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        for (int64_t i = b * BLOCK; i < hi; i++) {
            const float v = widen(x[i]);
            const float s = half_tanh_plus(v);
            const float du = K_BETA * (1.0f + 3.0f * K_KAPPA * v * v);
            out[i] = narrow(widen(g[i]) * (s + 2.0f * v * s * (1.0f - s) * du));
        }
    }
}
