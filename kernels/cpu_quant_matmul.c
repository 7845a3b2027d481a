/*
 * Weight-only quantized matmul for the CPU: out = x @ W.T with W kept as 4- or 8-bit codes and
 * dequantized one group at a time into a few float32 registers' worth of stack, never as a whole.
 * At decode batch sizes a linear layer is bound by reading its weight; 4-bit codes are a quarter
 * of bfloat16's bytes.
 *
 * Built and loaded by cpu_quant_matmul.py through cpu_build.py, once per DTYPE (of out), BITS and
 * GROUP_SIZE. The layout is kvpilot.kernels.quant_layout's (its docstring): per output feature,
 * 4-bit codes as 16-byte runs of 32 inputs (low nibbles the first 16, high nibbles the next 16)
 * with a float16 scale and offset per group, or 8-bit codes with a float16 scale per group.
 *
 * Work item: FEATURE_TILE output features. For each tile of ROW_TILE rows of x (float32, converted
 * once by the caller), each feature's groups are dequantized and multiplied into ROW_TILE x LANES
 * float32 accumulators, so a dequantized group serves every row of the tile and a feature's codes
 * stay in cache across the row tiles.
 */
#include <stdint.h>

#include "cpu_elem.h"

#if !defined(BITS) || !defined(GROUP_SIZE)
#error "build with -DBITS=4|8 -DGROUP_SIZE=32|64|128|256 -DDTYPE=0|1|2"
#endif
#if GROUP_SIZE % 32
#error "GROUP_SIZE must be a multiple of 32"
#endif

#define ROW_TILE 8
#define FEATURE_TILE 16
#define LANES 16
/* Below this many multiply-adds the call runs on one thread: a parallel region costs more. */
#define PARALLEL_MIN_MACS 65536

#if defined(__AVX512BF16__) && DTYPE == DTYPE_BF16
#define X_BF16 1
typedef uint16_t x_t; /* bfloat16 activations are read as they are */
#else
#define X_BF16 0
typedef float x_t; /* the caller converts x to float32 once */
#endif
/* Read by cpu_quant_matmul.py: which x this build takes. */
const int kvpilot_quant_matmul_x_bf16 = X_BF16;

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if X_BF16
/*
 * AVX-512 BF16: each run of 32 codes is dequantized (one FMA per 16, in float32) and rounded to
 * bfloat16 once, shared by every row of the tile, which then costs one VDPBF16PS per 32 weights
 * (32 products a step, accumulated in float32). The weight is rounded to bfloat16 exactly as a
 * bfloat16 model dequantized at load holds it.
 */
static inline __attribute__((always_inline)) void feature_rows(
    const x_t *x, int64_t k, const uint8_t *row, const _Float16 *scales, const _Float16 *offsets,
    int64_t groups, elem_t *out, int64_t n, const int rows) {
    __m512 acc[ROW_TILE];
    for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        const __m512 scale = _mm512_set1_ps((float)scales[g]);
#if BITS == 4
        const __m512 offset = _mm512_set1_ps((float)offsets[g]);
#else
        (void)offsets;
#endif
        const x_t *xg = x + g * GROUP_SIZE;
        for (int c = 0; c < GROUP_SIZE / 32; ++c) {
#if BITS == 4
            const __m512i b = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(row + g * (GROUP_SIZE / 2) + c * 16)));
            const __m512 low = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))),
                                               scale, offset);
            const __m512 high = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), scale, offset);
#else
            const __m128i *pair = (const __m128i *)((const int8_t *)row + g * GROUP_SIZE + c * 32);
            const __m512 low = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(pair))), scale);
            const __m512 high =
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(pair + 1))), scale);
#endif
            const __m512bh w = _mm512_cvtne2ps_pbh(high, low); /* inputs 0-15 low, 16-31 high, as x */
            for (int r = 0; r < rows; ++r)
                acc[r] = _mm512_dpbf16_ps(acc[r], w, (__m512bh)_mm512_loadu_si512(xg + r * k + c * 32));
        }
    }
    for (int r = 0; r < rows; ++r) out[r * n] = from_f32(_mm512_reduce_add_ps(acc[r]));
}
#elif defined(__AVX512F__)

/*
 * AVX-512: a 4-bit run of 32 inputs is one 16-byte load, widened to 16 int32 lanes whose low and
 * high nibbles are inputs 0-15 and 16-31, dequantized with one FMA each. 8-bit groups are summed
 * unscaled (code * x) and scaled once per group.
 */
static inline __attribute__((always_inline)) void feature_rows(
    const x_t *x, int64_t k, const uint8_t *row, const _Float16 *scales, const _Float16 *offsets,
    int64_t groups, elem_t *out, int64_t n, const int rows) {
    __m512 acc[ROW_TILE];
    for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        const __m512 scale = _mm512_set1_ps((float)scales[g]);
        const float *xg = x + g * GROUP_SIZE;
#if BITS == 4
        const __m512 offset = _mm512_set1_ps((float)offsets[g]);
        const uint8_t *bytes = row + g * (GROUP_SIZE / 2);
        for (int c = 0; c < GROUP_SIZE / 32; ++c) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(bytes + c * 16)));
            const __m512 low = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))),
                                               scale, offset);
            const __m512 high = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), scale, offset);
            for (int r = 0; r < rows; ++r) {
                const float *xr = xg + r * k + c * 32;
                acc[r] = _mm512_fmadd_ps(low, _mm512_loadu_ps(xr), acc[r]);
                acc[r] = _mm512_fmadd_ps(high, _mm512_loadu_ps(xr + 16), acc[r]);
            }
        }
#else
        (void)offsets;
        const int8_t *codes = (const int8_t *)row + g * GROUP_SIZE;
        __m512 part[ROW_TILE];
        for (int r = 0; r < rows; ++r) part[r] = _mm512_setzero_ps();
        for (int c = 0; c < GROUP_SIZE / 16; ++c) {
            const __m128i sixteen = _mm_loadu_si128((const __m128i *)(codes + c * 16));
            const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sixteen));
            for (int r = 0; r < rows; ++r) part[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xg + r * k + c * 16), part[r]);
        }
        for (int r = 0; r < rows; ++r) acc[r] = _mm512_fmadd_ps(part[r], scale, acc[r]);
#endif
    }
    for (int r = 0; r < rows; ++r) out[r * n] = from_f32(_mm512_reduce_add_ps(acc[r]));
}
#else
/* Portable C (the compiler vectorises what it can): a group dequantized into a stack buffer first. */
static inline void dequantize_group(const uint8_t *row, int64_t g, float scale, float offset, float *w) {
#if BITS == 4
    const uint8_t *bytes = row + g * (GROUP_SIZE / 2);
    for (int c = 0; c < GROUP_SIZE / 32; ++c) {
        for (int i = 0; i < 16; ++i) {
            w[c * 32 + i] = (float)(bytes[c * 16 + i] & 15) * scale + offset;
            w[c * 32 + 16 + i] = (float)(bytes[c * 16 + i] >> 4) * scale + offset;
        }
    }
#else
    (void)offset;
    const int8_t *codes = (const int8_t *)row + g * GROUP_SIZE;
    for (int i = 0; i < GROUP_SIZE; ++i) w[i] = (float)codes[i] * scale;
#endif
}

/* One feature against `rows` rows of x (a constant after inlining, so acc lives in registers). */
static inline __attribute__((always_inline)) void feature_rows(
    const x_t *x, int64_t k, const uint8_t *row, const _Float16 *scales, const _Float16 *offsets,
    int64_t groups, elem_t *out, int64_t n, const int rows) {
    float acc[ROW_TILE][LANES] = {{0}};
    float w[GROUP_SIZE];
    for (int64_t g = 0; g < groups; ++g) {
        dequantize_group(row, g, (float)scales[g], offsets ? (float)offsets[g] : 0.0f, w);
        const float *xg = x + g * GROUP_SIZE;
        for (int i = 0; i < GROUP_SIZE; i += LANES)
            for (int r = 0; r < rows; ++r)
                for (int l = 0; l < LANES; ++l) acc[r][l] += w[i + l] * xg[r * k + i + l];
    }
    for (int r = 0; r < rows; ++r) {
        float sum = 0.0f;
        for (int l = 0; l < LANES; ++l) sum += acc[r][l];
        out[r * n] = from_f32(sum);
    }
}
#endif

/*
 * x: [m, k] float32 (bfloat16 where X_BF16), contiguous; codes: [n, k / 2] uint8 (BITS 4) or [n, k] int8
 * (BITS 8); scales, offsets: [n, k / GROUP_SIZE] float16 (offsets NULL for BITS 8); out: [m, n].
 */
void kvpilot_quant_matmul(const x_t *x, const uint8_t *codes, const _Float16 *scales,
                          const _Float16 *offsets, elem_t *out, int64_t m, int64_t n, int64_t k) {
    const int64_t groups = k / GROUP_SIZE;
    const int64_t row_bytes = BITS == 4 ? k / 2 : k;
    const int64_t items = (n + FEATURE_TILE - 1) / FEATURE_TILE;
#pragma omp parallel for schedule(static) if (m * n * k >= PARALLEL_MIN_MACS)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t f0 = item * FEATURE_TILE;
        const int64_t f1 = f0 + FEATURE_TILE < n ? f0 + FEATURE_TILE : n;
        for (int64_t r0 = 0; r0 < m; r0 += ROW_TILE) {
            const int64_t rows = m - r0 < ROW_TILE ? m - r0 : ROW_TILE;
            for (int64_t f = f0; f < f1; ++f) {
                const x_t *xr = x + r0 * k;
                const uint8_t *row = codes + f * row_bytes;
                const _Float16 *s = scales + f * groups;
                const _Float16 *o = offsets ? offsets + f * groups : 0;
                elem_t *dst = out + r0 * n + f;
                switch (rows) {
                    case 1: feature_rows(xr, k, row, s, o, groups, dst, n, 1); break;
                    case 2: feature_rows(xr, k, row, s, o, groups, dst, n, 2); break;
                    case 3: feature_rows(xr, k, row, s, o, groups, dst, n, 3); break;
                    case 4: feature_rows(xr, k, row, s, o, groups, dst, n, 4); break;
                    case 5: feature_rows(xr, k, row, s, o, groups, dst, n, 5); break;
                    case 6: feature_rows(xr, k, row, s, o, groups, dst, n, 6); break;
                    case 7: feature_rows(xr, k, row, s, o, groups, dst, n, 7); break;
                    default: feature_rows(xr, k, row, s, o, groups, dst, n, ROW_TILE); break;
                }
            }
        }
    }
}
