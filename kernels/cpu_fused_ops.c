/*
 * The decoder layer's small operations fused for the CPU: residual add + RMSNorm, SiLU-and-mul,
 * and RoPE in place. In torch each is three to six kernels (a float32 copy, the reduction, a
 * rounding, a multiply, ...), each an OpenMP region and, served, a round trip of the GIL; here
 * each is one pass over its rows.
 *
 * Built and loaded by cpu_fused_ops.py through cpu_build.py, once per DTYPE (cpu_elem.h). Every
 * result is rounded to the element type where torch's reference rounds it (cpu_fused_ops.py's
 * *_reference functions), so bfloat16 results match torch's up to float32 summation order.
 * Rows are split across OpenMP threads; tensors are contiguous unless a stride is passed.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_elem.h"

/* Rows below this many elements in all run on one thread: a parallel region costs more. */
#define PARALLEL_MIN_ELEMENTS 16384

/*
 * delta, residual, out: [n, hidden]; weight: [hidden].
 * With a residual: residual += delta (rounded), out = weight * rms_normalize(residual) (rounded).
 * Without (NULL, the first layer): out = weight * rms_normalize(delta); delta is the residual.
 */
void kvpilot_add_rms_norm(const elem_t *delta, elem_t *residual, const elem_t *weight, elem_t *out,
                          int64_t n, int64_t hidden, float eps) {
#pragma omp parallel for if (n * hidden >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < n; ++r) {
        const elem_t *d = delta + r * hidden;
        elem_t *res = residual ? residual + r * hidden : 0;
        const elem_t *x = res ? res : d;
        float sum_sq = 0.0f;
        for (int64_t i = 0; i < hidden; ++i) {
            float v = to_f32(d[i]);
            if (res) {
                res[i] = from_f32(to_f32(res[i]) + v);
                v = to_f32(res[i]);
            }
            sum_sq += v * v;
        }
        const float inv = 1.0f / sqrtf(sum_sq / (float)hidden + eps);
        elem_t *o = out + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) o[i] = from_f32(to_f32(weight[i]) * to_f32(from_f32(to_f32(x[i]) * inv)));
    }
}

/* gate_up: [n, 2 * inter] (gate, then up); out: [n, inter] = silu(gate) (rounded) * up. */
void kvpilot_silu_mul(const elem_t *gate_up, elem_t *out, int64_t n, int64_t inter) {
#pragma omp parallel for if (n * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < n; ++r) {
        const elem_t *gate = gate_up + r * 2 * inter, *up = gate + inter;
        elem_t *o = out + r * inter;
        for (int64_t i = 0; i < inter; ++i) {
            const float g = to_f32(gate[i]);
            const float silu = to_f32(from_f32(g / (1.0f + expf(-g))));
            o[i] = from_f32(silu * to_f32(up[i]));
        }
    }
}

/*
 * Rotates x in place: [n, heads, head_dim], rows row_stride elements apart, heads contiguous (the
 * q and k heads inside a fused qkv row). cos, signed_sin: [n, head_dim], each half repeated,
 * signed_sin's first half negated. The "rotate half" form: with a = x[i], b = x[i + head_dim/2],
 * x[i] = a cos - b sin, x[i + head_dim/2] = b cos + a sin.
 */
void kvpilot_rope(elem_t *x, int64_t row_stride, int64_t n, int64_t heads, int64_t head_dim,
                  const elem_t *cos, const elem_t *signed_sin) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for if (n * heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < n; ++r) {
        const elem_t *c = cos + r * head_dim, *s = signed_sin + r * head_dim;
        for (int64_t h = 0; h < heads; ++h) {
            elem_t *v = x + r * row_stride + h * head_dim;
            for (int64_t i = 0; i < half; ++i) {
                const float a = to_f32(v[i]), b = to_f32(v[i + half]);
                v[i] = from_f32(to_f32(from_f32(a * to_f32(c[i]))) + b * to_f32(s[i]));
                v[i + half] = from_f32(to_f32(from_f32(b * to_f32(c[i + half]))) + a * to_f32(s[i + half]));
            }
        }
    }
}

/*
 * Structured outputs' token mask, in place: logits [n, vocab] (rows row_stride elements apart);
 * bitmask [n, words] int32, bit t of word w set when token 32 w + t is allowed. A disallowed
 * token's logit becomes -inf; words with every bit set (most of them while a string is free) are
 * skipped whole.
 */
void kvpilot_apply_token_bitmask(elem_t *logits, int64_t row_stride, const int32_t *bitmask, int64_t n,
                                 int64_t vocab, int64_t words) {
    const elem_t minus_inf = from_f32(-INFINITY);
#pragma omp parallel for if (n * vocab >= 4 * PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < n; ++r) {
        elem_t *row = logits + r * row_stride;
        const uint32_t *mask = (const uint32_t *)(bitmask + r * words);
        for (int64_t w = 0; w < words; ++w) {
            const uint32_t bits = mask[w];
            if (bits == 0xFFFFFFFFu) continue;
            const int64_t first = w * 32, last = first + 32 < vocab ? first + 32 : vocab;
            for (int64_t t = first; t < last; ++t) {
                if (!((bits >> (t - first)) & 1u)) row[t] = minus_inf;
            }
        }
    }
}
