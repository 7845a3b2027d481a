/*
 * Quantized weights times int8 activations on the CPU (AVX-512 VNNI): out = x @ W.T for bfloat16 x
 * and out, W kept as 4-bit codes with a float16 scale and offset per group (W = code * scale +
 * offset) or as 8-bit codes with a float16 scale per group (W = code * scale).
 *
 * At decode batch sizes of 4 and more, a bfloat16 dot product per weight (VDPBF16PS: 32 products an
 * instruction) bounds a step on the CPU whatever the weight's format. Here each row of x is first
 * quantized to int8 in runs of 32 inputs (symmetric, one float32 scale a run: xq = round(x / s),
 * s = max|x| / 127), and codes times xq accumulate in int32 with VPDPBUSD (64 products an
 * instruction). The run's int32 sum is scaled by s in float32, a group's sum by the weight's scale,
 * and a per-row term is added per group: for 4 bits the offset's share, offset * sum(x) (the exact
 * float32 sum of x over the group); for 8 bits the correction of the codes' bias (VPDPBUSD takes one
 * unsigned operand, so 8-bit codes are stored as code + 128, and scale * 128 * sum(s * xq) is taken
 * off again).
 *
 * Layout (built by kvpilot.kernels.cpu_int8_matmul.interleave): per tile of 16 output features and
 * run of 32 inputs, 64-byte vectors in which byte 4 * f + q holds input 4 * j + q of feature f, so
 * one VPDPBUSD multiplies 4 inputs of 16 features by 4 broadcast bytes of xq:
 *   4 bits: codes [N / 16, K / 32, 4, 16, 4] uint8; vector j's low nibbles are inputs 4j..4j+3 and
 *           its high nibbles inputs 16+4j..16+4j+3;
 *   8 bits: codes [N / 16, K / 32, 8, 16, 4] uint8, code + 128, vector j holding inputs 4j..4j+3.
 * scales (and offsets, 4 bits): [N / 16, K / GROUP_SIZE, 16] float16.
 *
 * Built by cpu_int8_matmul.py through cpu_build.py once per BITS and GROUP_SIZE.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#if !defined(__AVX512VNNI__) || !defined(__AVX512BF16__) || !defined(__AVX512BW__)
#error "needs AVX-512 VNNI, BF16 and BW (Zen 4, Sapphire Rapids or later)"
#endif
#if !defined(GROUP_SIZE) || GROUP_SIZE % 32 || !defined(BITS) || (BITS != 4 && BITS != 8)
#error "build with -DBITS=4|8 -DGROUP_SIZE=32|64|128|256"
#endif

#define ROW_TILE 8
#define FEATURE_TILE 16
#define RUN 32
#define RUN_BYTES (RUN * BITS / 8 * FEATURE_TILE) /* codes of one run of a tile */
/* Below this many multiply-adds the call runs on one thread: a parallel region costs more. */
#define PARALLEL_MIN_MACS 65536

/*
 * One row of bfloat16 x: xq [K] int8, scale [K / 32] and the per-group term [K / GROUP_SIZE] float32
 * (4 bits: sum(x) over the group; 8 bits: -128 * sum over its runs of scale * sum(xq)).
 */
static void quantize_row(const uint16_t *x, int64_t k, int8_t *xq, float *scale, float *group_term) {
    for (int64_t g = 0; g < k / GROUP_SIZE; ++g) {
        __m512 sum = _mm512_setzero_ps();
        float term = 0.0f;
        for (int64_t b = g * (GROUP_SIZE / RUN); b < (g + 1) * (GROUP_SIZE / RUN); ++b) {
            const __m512i raw = _mm512_loadu_si512(x + b * RUN); /* 32 bfloat16 */
            const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
            const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            const float s = amax / 127.0f;
            const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
            const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
            scale[b] = s;
            _mm_storeu_si128((__m128i *)(xq + b * RUN), _mm512_cvtsepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(xq + b * RUN + 16), _mm512_cvtsepi32_epi8(qhi));
#if BITS == 4
            sum = _mm512_add_ps(sum, _mm512_add_ps(lo, hi));
#else
            term -= 128.0f * s * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#endif
        }
        group_term[g] = BITS == 4 ? _mm512_reduce_add_ps(sum) : term;
    }
}

/* 16 output features against `rows` rows (a constant after inlining, so the accumulators stay in registers). */
static inline __attribute__((always_inline)) void tile_rows(
    const uint8_t *codes, const _Float16 *scales, const _Float16 *offsets, const int8_t *xq, const float *xs,
    const float *xterm, uint16_t *out, int64_t n, int64_t k, const int rows) {
    const int64_t runs = k / RUN, groups = k / GROUP_SIZE;
    __m512 acc[ROW_TILE];
    for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512 group_acc[ROW_TILE];
        for (int r = 0; r < rows; ++r) group_acc[r] = _mm512_setzero_ps();
        for (int64_t b = g * (GROUP_SIZE / RUN); b < (g + 1) * (GROUP_SIZE / RUN); ++b) {
            __m512i w[8]; /* w[j]: inputs 4j..4j+3 of the run, for each of the 16 features */
            const uint8_t *run = codes + b * RUN_BYTES;
#if BITS == 4
            const __m512i nibble = _mm512_set1_epi8(15);
            for (int j = 0; j < 4; ++j) {
                const __m512i v = _mm512_loadu_si512(run + j * 64);
                w[j] = _mm512_and_si512(v, nibble);
                w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            }
#else
            for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(run + j * 64);
#endif
            for (int r = 0; r < rows; ++r) {
                const int32_t *xr = (const int32_t *)(xq + r * k + b * RUN);
                __m512i dot = _mm512_setzero_si512();
                for (int j = 0; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, w[j], _mm512_set1_epi32(xr[j]));
                group_acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(xs[r * runs + b]), group_acc[r]);
            }
        }
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + g * FEATURE_TILE)));
#if BITS == 4
        const __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(offsets + g * FEATURE_TILE)));
#else
        (void)offsets;
        const __m512 offset = scale; /* the codes' bias: scale * xterm */
#endif
        for (int r = 0; r < rows; ++r) {
            acc[r] = _mm512_fmadd_ps(group_acc[r], scale, acc[r]);
            acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xterm[r * groups + g]), acc[r]);
        }
    }
    for (int r = 0; r < rows; ++r) _mm256_storeu_si256((__m256i *)(out + r * n), (__m256i)_mm512_cvtneps_pbh(acc[r]));
}

/*
 * x: [m, k] bfloat16, contiguous; codes, scales, offsets (NULL for 8 bits): the layout above (n a
 * multiple of 16, k of GROUP_SIZE); out: [m, n] bfloat16. Returns 0, or -1 (out unwritten) if the
 * workspace for x quantized (m * k bytes and m * k / 16 floats) cannot be allocated.
 */
int kvpilot_int8_matmul(const uint16_t *x, const uint8_t *codes, const _Float16 *scales, const _Float16 *offsets,
                        uint16_t *out, int64_t m, int64_t n, int64_t k) {
    const int64_t runs = k / RUN, groups = k / GROUP_SIZE, tiles = n / FEATURE_TILE;
    const int parallel = m * n * k >= PARALLEL_MIN_MACS;
    if (m == 0) return 0;
    float *xs = malloc(sizeof(float) * m * (runs + groups) + m * k); /* run scales, group terms, xq */
    if (!xs) return -1;
    float *xterm = xs + m * runs;
    int8_t *xq = (int8_t *)(xterm + m * groups);
#pragma omp parallel for schedule(static) if (parallel && m >= 16)
    for (int64_t r = 0; r < m; ++r) quantize_row(x + r * k, k, xq + r * k, xs + r * runs, xterm + r * groups);
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t t = 0; t < tiles; ++t) {
        const uint8_t *tc = codes + t * runs * RUN_BYTES;
        const _Float16 *ts = scales + t * groups * FEATURE_TILE;
        const _Float16 *to = BITS == 4 ? offsets + t * groups * FEATURE_TILE : 0;
        for (int64_t r0 = 0; r0 < m; r0 += ROW_TILE) {
            const int8_t *xr = xq + r0 * k;
            const float *sr = xs + r0 * runs, *gr = xterm + r0 * groups;
            uint16_t *dst = out + r0 * n + t * FEATURE_TILE;
            switch (m - r0 < ROW_TILE ? m - r0 : ROW_TILE) {
                case 1: tile_rows(tc, ts, to, xr, sr, gr, dst, n, k, 1); break;
                case 2: tile_rows(tc, ts, to, xr, sr, gr, dst, n, k, 2); break;
                case 3: tile_rows(tc, ts, to, xr, sr, gr, dst, n, k, 3); break;
                case 4: tile_rows(tc, ts, to, xr, sr, gr, dst, n, k, 4); break;
                case 5: tile_rows(tc, ts, to, xr, sr, gr, dst, n, k, 5); break;
                case 6: tile_rows(tc, ts, to, xr, sr, gr, dst, n, k, 6); break;
                case 7: tile_rows(tc, ts, to, xr, sr, gr, dst, n, k, 7); break;
                default: tile_rows(tc, ts, to, xr, sr, gr, dst, n, k, ROW_TILE); break;
            }
        }
    }
    free(xs);
    return 0;
}
