/* One token through a llama block on a packed GGUF base, in C: the products on the codes
   and the glue between them (norms, rotary, the cache write, attention, SwiGLU).

   Why: a decode step reads every code of the block once, so it is bound by memory, not
   arithmetic: SmolLM2-135M's block is 2.2 MB of Q4_1 codes and scales. Inductor's kernel
   on the packed layout of models/decode.py (lanes over output rows, groups of the input
   one row of words apart) read them at 10-15 GB/s on a 2-core Zen 4 whose sequential
   read is 24 GB/s; laid out here as one record per 32 rows and group (the 32 rows' words,
   then their scales and offsets), each thread reads its rows as one stream and the
   products run at 22-25 GB/s (bench/nibble_kernel.py, c_gb_per_s). One call a block also
   takes the compiled step's call and Python around it away.

   Layout of a packed matrix (toy_packed; decode.PackedSpec's blocked parts): N output rows
   in blocks of RB (the last padded with zero codes and scales), each block's groups in
   order, so that a thread's rows are one stream:
       words   (ceil(N/RB), G, W, RB) uint32: word w of group g for row b*RB + r at [b][g][w][r],
               codes 8w.. (4w..) of the group, the first in the low bits; bytes are q + 128;
       scales  (ceil(N/RB), G, RB) float16 or float32;
       offsets (ceil(N/RB), G, RB) of the same (has_z), the type's own z per group.
   y[n] = sum_g s[g,n] * sum_j q[g,j,n] x[g,j] + z'[g,n] * sum_j x[g,j], z' = z (- 128 s for
   bytes): the arithmetic of decode.py's kernels, in float32, the sums in another order (the
   tests hold the result to the dequantized product within float32 rounding).

   A matrix of bits 32 is float32 rows (N, K) at `words` (a projection an adapter was merged
   into: toy/lora.py merge_lora): one dot product a row.

   Threads: the products of a step split their row blocks over OpenMP's threads; the library
   is built with -fopenmp and takes the libgomp torch has loaded (models/native.py), so the
   split runs on torch's own threads at torch's thread count. The glue is a few microseconds
   of work and runs on the calling thread. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exp.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

#define RB 32
#define PREFETCH 4 /* groups ahead of the one read */

typedef struct {
    const uint32_t *words;
    const uint8_t *s, *z; /* scales, offsets (NULL: none) */
    int64_t G, W, N;      /* groups, words a group, rows */
    int32_t bits;         /* 4 or 8 */
    int32_t wide;         /* scales and offsets as float32 (else float16) */
} toy_packed;

typedef struct {
    toy_packed q, k, v, o, gate, up, down;
    const float *norm1, *norm2;
    double eps1, eps2, scale;
    int64_t d_model, d_ff, n_head, n_kv, head_dim, rot; /* rot: rotary dims (<= head_dim) */
} toy_llama_block;

/* float16 bits -> float32 (exact; the scales are the file's float16 values) */
static inline float half(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3ffu;
    uint32_t u;
    if (e == 31u) {
        u = sign | 0x7f800000u | (m << 13);
    } else if (e) {
        u = sign | ((e + 112u) << 23) | (m << 13);
    } else { /* zero or subnormal: m * 2^-24 */
        float f = (float)m * 5.9604644775390625e-8f;
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void load_row(const uint8_t *p, int wide, float *out) {
    if (wide) {
        memcpy(out, p, RB * 4);
    } else {
        const uint16_t *h = (const uint16_t *)p;
        for (int r = 0; r < RB; r++) out[r] = half(h[r]);
    }
}

#ifdef __AVX512F__
/* 16 scales or offsets of a record as float32 */
static inline __m512 load16(const uint8_t *p, int wide) {
    return wide ? _mm512_loadu_ps(p) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TOY_AVX2 1
/* 8 scales or offsets of a record as float32 */
static inline __m256 load8(const uint8_t *p, int wide) {
    return wide ? _mm256_loadu_ps((const float *)p)
                : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
#endif

/* sum of a[i] * b[i], in 16 running partial sums (a loop the compiler vectorises without
   reordering a float sum it was not told it may reorder) */
static inline float dot(const float *a, const float *b, int64_t n) {
    float part[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) part[j] += a[i + j] * b[i + j];
    float s = 0;
    for (; i < n; i++) s += a[i] * b[i];
    for (int j = 0; j < 16; j++) s += part[j];
    return s;
}

/* out[r] = row b*RB + r of W x for the codes of one block of rows (w32, sp, zp: its words,
   scales and offsets; xsum: each group's sum of x), one loop per instruction set */
#ifdef __AVX512F__
static void block_rows(const toy_packed *P, const float *x, const float *xsum,
                       const uint32_t *w32, const uint8_t *sp, const uint8_t *zp, float *out) {
    const int bits = P->bits, per = bits == 4 ? 8 : 4;
    const int64_t W = P->W, L = W * per, sb = P->wide ? 4 : 2;
    /* by hand: gcc's vectorisation of the loops below ran at a third of this speed */
    const __m512i m = _mm512_set1_epi32(bits == 4 ? 15 : 255);
    __m512 y0 = _mm512_setzero_ps(), y1 = _mm512_setzero_ps();
    for (int64_t g = 0; g < P->G; g++, sp += RB * sb, zp = zp ? zp + RB * sb : 0) {
        for (int64_t c = 0; c < W * RB; c += 16) __builtin_prefetch(w32 + PREFETCH * W * RB + c);
        const float *xg = x + g * L;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
        for (int64_t w = 0; w < W; w++, w32 += RB) {
            const __m512i v0 = _mm512_loadu_si512(w32), v1 = _mm512_loadu_si512(w32 + 16);
            const float *xw = xg + w * per;
            for (int k = 0; k < per; k += 2) {
                const __m512 xa = _mm512_set1_ps(xw[k]), xb = _mm512_set1_ps(xw[k + 1]);
                const unsigned ka = bits * k, kb = bits * (k + 1);
#define CODES(v, sh) _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, sh), m))
                a0 = _mm512_fmadd_ps(CODES(v0, ka), xa, a0);
                a1 = _mm512_fmadd_ps(CODES(v1, ka), xa, a1);
                b0 = _mm512_fmadd_ps(CODES(v0, kb), xb, b0);
                b1 = _mm512_fmadd_ps(CODES(v1, kb), xb, b1);
#undef CODES
            }
        }
        const __m512 s0 = load16(sp, P->wide), s1 = load16(sp + 16 * sb, P->wide);
        y0 = _mm512_fmadd_ps(_mm512_add_ps(a0, b0), s0, y0);
        y1 = _mm512_fmadd_ps(_mm512_add_ps(a1, b1), s1, y1);
        __m512 z0 = _mm512_setzero_ps(), z1 = _mm512_setzero_ps();
        if (zp) z0 = load16(zp, P->wide), z1 = load16(zp + 16 * sb, P->wide);
        if (bits == 8) { /* codes are q + 128 */
            const __m512 c = _mm512_set1_ps(-128.0f);
            z0 = _mm512_fmadd_ps(c, s0, z0), z1 = _mm512_fmadd_ps(c, s1, z1);
        }
        const __m512 xs = _mm512_set1_ps(xsum[g]);
        y0 = _mm512_fmadd_ps(z0, xs, y0), y1 = _mm512_fmadd_ps(z1, xs, y1);
    }
    _mm512_storeu_ps(out, y0);
    _mm512_storeu_ps(out + 16, y1);
}

#elif defined(TOY_AVX2)
static void block_rows(const toy_packed *P, const float *x, const float *xsum,
                       const uint32_t *w32, const uint8_t *sp, const uint8_t *zp, float *out) {
    const int bits = P->bits, per = bits == 4 ? 8 : 4;
    const int64_t W = P->W, L = W * per, sb = P->wide ? 4 : 2;
    /* the same loop 8 rows a vector (most laptops' CPUs: AVX2, FMA and F16C, no AVX-512) */
    const __m256i m = _mm256_set1_epi32(bits == 4 ? 15 : 255);
    __m256 yv[4];
    for (int i = 0; i < 4; i++) yv[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < P->G; g++, sp += RB * sb, zp = zp ? zp + RB * sb : 0) {
        for (int64_t c = 0; c < W * RB; c += 16) __builtin_prefetch(w32 + PREFETCH * W * RB + c);
        const float *xg = x + g * L;
        __m256 a[4], c2[4];
        for (int i = 0; i < 4; i++) a[i] = c2[i] = _mm256_setzero_ps();
        for (int64_t w = 0; w < W; w++, w32 += RB) {
            __m256i v[4];
            for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_si256((const __m256i *)(w32 + 8 * i));
            const float *xw = xg + w * per;
            for (int k = 0; k < per; k += 2) { /* x pre-scaled (products): codes in place */
                const __m256 xa = _mm256_set1_ps(xw[k]), xb = _mm256_set1_ps(xw[k + 1]);
                const __m256i ma = _mm256_slli_epi32(m, bits * k);
                const int top = k + 1 == per - 1; /* the last code: its high bit is the sign */
                const __m256i mb = _mm256_slli_epi32(m, bits * (k + 1));
                for (int i = 0; i < 4; i++) {
                    const __m256i cb = top ? _mm256_srli_epi32(v[i], bits * (k + 1))
                                           : _mm256_and_si256(v[i], mb);
                    a[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v[i], ma)), xa, a[i]);
                    c2[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(cb), xb, c2[i]);
                }
            }
        }
        const __m256 xs = _mm256_set1_ps(xsum[g]), bias = _mm256_set1_ps(-128.0f);
        for (int i = 0; i < 4; i++) {
            const __m256 si = load8(sp + 8 * i * sb, P->wide);
            yv[i] = _mm256_fmadd_ps(_mm256_add_ps(a[i], c2[i]), si, yv[i]);
            __m256 zi = zp ? load8(zp + 8 * i * sb, P->wide) : _mm256_setzero_ps();
            if (bits == 8) zi = _mm256_fmadd_ps(bias, si, zi); /* codes are q + 128 */
            yv[i] = _mm256_fmadd_ps(zi, xs, yv[i]);
        }
    }
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + 8 * i, yv[i]);
}

#else
static void block_rows(const toy_packed *P, const float *x, const float *xsum,
                       const uint32_t *w32, const uint8_t *sp, const uint8_t *zp, float *out) {
    const int bits = P->bits, per = bits == 4 ? 8 : 4;
    const int64_t W = P->W, L = W * per, sb = P->wide ? 4 : 2;
    const uint32_t mask = bits == 4 ? 15u : 255u;
    memset(out, 0, RB * sizeof(float));
    for (int64_t g = 0; g < P->G; g++, sp += RB * sb, zp = zp ? zp + RB * sb : 0) {
        for (int64_t c = 0; c < W * RB; c += 16) __builtin_prefetch(w32 + PREFETCH * W * RB + c);
        float acc[RB] = {0}, s[RB], z[RB] = {0};
        for (int64_t w = 0; w < W; w++, w32 += RB)
            for (int k = 0; k < per; k++) {
                const float xk = x[g * L + w * per + k];
                for (int r = 0; r < RB; r++)
                    acc[r] += (float)(int32_t)((w32[r] >> (bits * k)) & mask) * xk;
            }
        load_row(sp, P->wide, s);
        if (zp) load_row(zp, P->wide, z);
        if (bits == 8)
            for (int r = 0; r < RB; r++) z[r] -= 128.0f * s[r];
        for (int r = 0; r < RB; r++) out[r] += acc[r] * s[r] + z[r] * xsum[g];
    }
}

#endif

/* rows b*RB .. b*RB+RB-1 of y = W x (xsum: each group's sum of x) */
static void rows(const toy_packed *P, const float *x, const float *xsum, float *y, int64_t b) {
    if (P->bits == 32) { /* float32 rows (N, K), an adapter merged in: one dot product a row */
        const float *w = (const float *)P->words;
        const int64_t end = (b + 1) * RB < P->N ? (b + 1) * RB : P->N;
        for (int64_t r = b * RB; r < end; r++) y[r] = dot(w + r * P->W, x, P->W);
        return;
    }
    const int64_t sb = P->wide ? 4 : 2;
    const uint32_t *w32 = P->words + b * P->G * P->W * RB;
    const uint8_t *sp = P->s + b * P->G * RB * sb, *zp = P->z ? P->z + b * P->G * RB * sb : 0;
    float out[RB];
    block_rows(P, x, xsum, w32, sp, zp, out);
    const int64_t n = P->N - b * RB < RB ? P->N - b * RB : RB; /* the last block's real rows */
    memcpy(y + b * RB, out, n * sizeof(float));
}

static void group_sums(const toy_packed *P, const float *x, float *xsum) {
    const int64_t L = P->W * (P->bits == 4 ? 8 : 4);
    for (int64_t g = 0; g < P->G; g++) {
        float t = 0;
        for (int64_t i = 0; i < L; i++) t += x[g * L + i];
        xsum[g] = t;
    }
}

static int64_t in_features(const toy_packed *P) {
    return P->bits == 32 ? P->W : P->G * P->W * (P->bits == 4 ? 8 : 4);
}

/* what rows() reads of x for a matrix: its groups' sums, and (the AVX2 loop) x scaled by
   2^-(bits k) for code k of a word (exact: powers of two), so that the loop takes each code
   masked where it lies, without a shift (the top code, whose high bit is the sign: shifted);
   returns the x to pass */
static const float *prepare(const toy_packed *P, const float *x, float *xsum, float *xq) {
    if (P->bits == 32) return x;
    group_sums(P, x, xsum);
#ifdef TOY_AVX2
    const int per = P->bits == 4 ? 8 : 4;
    for (int64_t i = 0, K = in_features(P); i < K; i++) {
        const int k = (int)(i % per);
        xq[i] = k == per - 1 ? x[i] : ldexpf(x[i], -P->bits * k);
    }
    return xq;
#else
    (void)xq;
    return x;
#endif
}

/* y_i = W_i x for up to three matrices of one input (each its own block type: a Q4_K_M file
   keeps attn_v in Q6_K beside Q4_K queries and keys), their row blocks shared out together */
static void products(const toy_packed *const *P, int n, const float *x, float *const *y) {
    const int64_t K = in_features(P[0]);
    float xsum[3][K / 16 + 1], xq[3][K]; /* groups are 16 or 32 inputs long */
    const float *xin[3];
    for (int i = 0; i < n; i++) xin[i] = prepare(P[i], x, xsum[i], xq[i]);
    int64_t blocks[4] = {0};
    for (int i = 0; i < n; i++) blocks[i + 1] = blocks[i] + (P[i]->N + RB - 1) / RB;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < blocks[n]; t++) {
        int i = 0;
        while (t >= blocks[i + 1]) i++;
        rows(P[i], xin[i], xsum[i], y[i], t - blocks[i]);
    }
}

/* y = W x on one packed matrix (a head, or any product outside a block step) */
void toy_packed_matvec(const toy_packed *P, const float *x, float *y) {
    const toy_packed *one[1] = {P};
    float *out[1] = {y};
    products(one, 1, x, out);
}

static void rms_norm(const float *x, const float *w, double eps, int64_t n, float *out) {
    float ss = 0;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + (float)eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* the final norm of a model, before its head (models/reply_c.py) */
void toy_rms_norm(const float *x, const float *w, double eps, int64_t n, float *out) {
    rms_norm(x, w, eps, n, out);
}

/* row n of a packed matrix as float32 (a token's embedding): the file's value of each code,
   s q + z (q the code; a byte's stored q + 128 taken back to q), one rounding as the file's
   own dequantization; bits 32: the row as it is */
void toy_packed_row(const toy_packed *P, int64_t n, float *out) {
    if (P->bits == 32) {
        memcpy(out, (const float *)P->words + n * P->W, P->W * sizeof(float));
        return;
    }
    const int per = P->bits == 4 ? 8 : 4, mask = P->bits == 4 ? 15 : 255;
    const int64_t b = n / RB, r = n % RB, sb = P->wide ? 4 : 2, L = P->W * per;
    const float bias = P->bits == 8 ? 128.0f : 0.0f;
    for (int64_t g = 0; g < P->G; g++) {
        const uint32_t *w = P->words + ((b * P->G + g) * P->W) * RB + r;
        const uint8_t *sp = P->s + ((b * P->G + g) * RB + r) * sb;
        float s, z = 0;
        if (P->wide) {
            memcpy(&s, sp, 4);
            if (P->z) memcpy(&z, P->z + ((b * P->G + g) * RB + r) * sb, 4);
        } else {
            uint16_t h;
            memcpy(&h, sp, 2);
            s = half(h);
            if (P->z) {
                memcpy(&h, P->z + ((b * P->G + g) * RB + r) * sb, 2);
                z = half(h);
            }
        }
        for (int64_t j = 0; j < P->W; j++)
            for (int k = 0; k < per; k++) {
                const float q = (float)((w[j * RB] >> (P->bits * k)) & mask) - bias;
                out[g * L + j * per + k] = s * q + z;
            }
    }
}

/* the threads OpenMP shares a product's rows over from now on (n > 0), and the count; 1
   where the library was built without OpenMP. A process with torch never calls it: the
   library runs on torch's libgomp at torch's count. */
int toy_threads(int n) {
#ifdef _OPENMP
    if (n > 0) omp_set_num_threads(n);
    return omp_get_max_threads();
#else
    (void)n;
    return 1;
#endif
}

/* half-split rotary on the first `rot` dims of one head (Rotary.tables' cos, sin) */
static void rotate(float *h, const float *cos, const float *sin, int64_t rot) {
    const int64_t m = rot / 2;
    for (int64_t i = 0; i < m; i++) {
        const float a = h[i], b = h[i + m];
        h[i] = a * cos[i] - b * sin[i];
        h[i + m] = b * cos[i + m] + a * sin[i + m];
    }
}

/* one query head over n cached keys and values (D each): softmax(q k^T * scale) v */
static void attend(const float *q, const float *keys, const float *vals, int64_t n, int64_t D,
                   float scale, float *out) {
    float p[n];
    float top = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
        p[t] = dot(q, keys + t * D, D) * scale;
        top = p[t] > top ? p[t] : top;
    }
    float part[16] = {0};
    int64_t t = 0;
    for (; t + 16 <= n; t += 16)
        for (int j = 0; j < 16; j++) {
            const float d = p[t + j] - top;
            part[j] += p[t + j] = exp_clamped(d < -87.0f ? -87.0f : d);
        }
    float sum = 0;
    for (; t < n; t++) {
        const float d = p[t] - top;
        sum += p[t] = exp_clamped(d < -87.0f ? -87.0f : d);
    }
    for (int j = 0; j < 16; j++) sum += part[j];
    const float inv = 1.0f / sum;
    memset(out, 0, D * sizeof(float));
    for (t = 0; t < n; t++) {
        const float w = p[t] * inv;
        for (int64_t d = 0; d < D; d++) out[d] += w * vals[t * D + d];
    }
}

/* x_out = block(x_in) for the token at position pos: its key and value written to the
   cache's slot pos (kc, vc: head kh's slot t at [kh * head_stride + t * head_dim]), every
   query head attending over slots 0..pos of its K/V head. */
void toy_llama_step(const toy_llama_block *B, const float *x_in, float *x_out, const float *cos,
                    const float *sin, float *kc, float *vc, int64_t head_stride, int64_t pos) {
    const int64_t C = B->d_model, D = B->head_dim, H = B->n_head, K = B->n_kv, F = B->d_ff;
    float h[C], q[H * D], k[K * D], v[K * D], att[H * D], o[C], g[F], u[F];
    rms_norm(x_in, B->norm1, B->eps1, C, h);
    {
        const toy_packed *P[3] = {&B->q, &B->k, &B->v};
        float *y[3] = {q, k, v};
        products(P, 3, h, y);
    }
    for (int64_t i = 0; i < H; i++) rotate(q + i * D, cos, sin, B->rot);
    for (int64_t i = 0; i < K; i++) {
        rotate(k + i * D, cos, sin, B->rot);
        memcpy(kc + i * head_stride + pos * D, k + i * D, D * sizeof(float));
        memcpy(vc + i * head_stride + pos * D, v + i * D, D * sizeof(float));
    }
    const int64_t n = pos + 1, per_kv = H / K;
    const float scale = (float)B->scale;
#pragma omp parallel for schedule(static) if (n * H >= 4096)
    for (int64_t i = 0; i < H; i++) {
        const int64_t kh = i / per_kv;
        attend(q + i * D, kc + kh * head_stride, vc + kh * head_stride, n, D, scale, att + i * D);
    }
    {
        const toy_packed *P[1] = {&B->o};
        float *y[1] = {o};
        products(P, 1, att, y);
    }
    for (int64_t i = 0; i < C; i++) x_out[i] = x_in[i] + o[i];
    rms_norm(x_out, B->norm2, B->eps2, C, h);
    {
        const toy_packed *P[2] = {&B->gate, &B->up};
        float *y[2] = {g, u};
        products(P, 2, h, y);
    }
    for (int64_t i = 0; i < F; i++) { /* silu(g) u */
        const float e = -g[i] > 87.0f ? 87.0f : (-g[i] < -87.0f ? -87.0f : -g[i]);
        g[i] = g[i] / (1.0f + exp_clamped(e)) * u[i];
    }
    {
        const toy_packed *P[1] = {&B->down};
        float *y[1] = {o};
        products(P, 1, g, y);
    }
    for (int64_t i = 0; i < C; i++) x_out[i] += o[i];
}

/* every block of a model in turn for one token (n blocks; x_in is kept, x_out written; the
   caches of block i at kc[i], vc[i]) */
void toy_llama_steps(const toy_llama_block *B, int64_t n, const float *x_in, float *x_out,
                     const float *cos, const float *sin, float *const *kc, float *const *vc,
                     int64_t head_stride, int64_t pos) {
    const int64_t C = B[0].d_model;
    float x[C];
    memcpy(x, x_in, C * sizeof(float));
    for (int64_t i = 0; i < n; i++) {
        toy_llama_step(B + i, x, x_out, cos, sin, kc[i], vc[i], head_stride, pos);
        memcpy(x, x_out, C * sizeof(float));
    }
}
