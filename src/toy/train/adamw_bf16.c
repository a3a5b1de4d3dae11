/* AdamW on float32 weights and gradients with both moments stored in bfloat16, one pass
   over memory: 20 bytes a value (read the weight, gradient and two moments, write the
   weight and two moments), where widening the moments to float32 for torch's fused kernel
   and rounding them back moves 36. toy compiles this file for the machine it runs on
   (train/native.py) and HalfStateAdamW calls it from one thread per core, each on its own
   range of values.

   The arithmetic is torch's fused AdamW (its CPU kernel, ADAMW mode) in float32: decay the
   weight, lerp the first moment, update the second, step by lr / bias_correction1 over
   sqrt(v) / sqrt(bias_correction2) + eps; the two moments' multiply-adds fused where
   torch's build fuses them, so from the same float32 inputs both moments come out with
   torch's bits (checked in tests/train/test_optimizer_state.py) and the weight within an
   ulp. Every other product is rounded on its own (-ffp-contract=off): the vector loop and
   its scalar tail round alike, and a value's result does not depend on where a thread's
   range begins. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../models/bf16.h"


static void adamw_run(float *restrict p, const float *restrict g, uint16_t *restrict m,
                      uint16_t *restrict v, int64_t n, float decay, float step_size,
                      float w1, float beta2, float w2, float eps, float bc2_sqrt) {
    for (int64_t i = 0; i < n; i++) {
        const float gi = g[i];
        const float mi = fmaf(w1, gi - widen(m[i]), widen(m[i]));
        const float vi = fmaf(w2 * gi, gi, widen(v[i]) * beta2);
        const float denom = sqrtf(vi) / bc2_sqrt + eps;
        p[i] = p[i] * decay + (-step_size * mi) / denom;
        m[i] = narrow(mi);
        v[i] = narrow(vi);
    }
}

/* The tensors k = 0..nseg-1 laid end to end; update the values [lo, hi) of that line.
   decay[k] = 1 - lr * weight_decay, step_size[k] = lr / bias_correction1 and bc2_sqrt[k]
   per tensor (each has its own step count); w1 = 1 - beta1 and w2 = 1 - beta2. Every
   scalar is computed in double by the caller and rounded once to float, as torch does. */
void toy_adamw_bf16(int64_t nseg, float *const *p, float *const *g, uint16_t *const *m,
                    uint16_t *const *v, const int64_t *n, int64_t lo, int64_t hi,
                    const float *decay, const float *step_size, const float *bc2_sqrt,
                    float w1, float beta2, float w2, float eps) {
    int64_t at = 0;
    for (int64_t k = 0; k < nseg && at < hi; k++) {
        const int64_t a = at, b = at + n[k];
        at = b;
        if (b <= lo) continue;
        const int64_t s = a < lo ? lo - a : 0, e = (b > hi ? hi : b) - a;
        adamw_run(p[k] + s, g[k] + s, m[k] + s, v[k] + s, e - s, decay[k], step_size[k], w1,
                  beta2, w2, eps, bc2_sqrt[k]);
    }
}
