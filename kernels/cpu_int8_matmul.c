/*
 * Quantized weights times int8 activations on the CPU: out = x @ W.T for float32 or bfloat16 x and
 * out (x's dtype, chosen per call), W kept as 4-bit codes with a float16 scale and offset per group
 * (W = code * scale + offset) or as 8-bit codes with a float16 scale per group (W = code * scale).
 *
 * At decode batch sizes of 4 and more, a floating-point dot product per weight bounds a step on the
 * CPU whatever the weight's format. Here each row of x is first quantized to int8 in runs of 32
 * inputs (symmetric, one float32 scale a run: xq = round(x / s), s = max|x| / 127), and codes times
 * xq accumulate exactly in integers. The run's integer sum is scaled by s in float32, a group's sum
 * by the weight's scale, and for 4 bits the offset's share is added per group: offset * the sum of
 * the rounded x over the group (sum of s * sum(xq) over its runs), so the result is the dequantized
 * weight times the rounded x, to float32 rounding.
 *
 * Two instruction sets, chosen when cpu_build.py compiles this file for the machine (-march=native,
 * less what KVPILOT_CPU_FEATURES removes):
 * - AVX-512 VNNI (Zen 4, Sapphire Rapids): VPDPBUSD multiplies 64 unsigned-by-signed byte pairs
 *   and adds them in groups of 4 into 16 int32 lanes, one lane per output feature. Its unsigned
 *   operand is the weight, so 8-bit codes are stored as code + 128 and scale * 128 * sum(s * xq)
 *   is taken off per group again.
 * - AVX2 (Haswell, Zen 1 and later): VPMADDUBSW multiplies 32 unsigned-by-signed byte pairs and
 *   adds neighbours into 16 int16 lanes, VPMADDWD by ones adds those pairs into 8 int32 lanes, one
 *   per output feature, so a 16-feature tile is two halves of 8. VPMADDUBSW saturates at int16:
 *   a 4-bit pair is at most 2 * 15 * 127 = 3810, so the int16 lanes of a whole run (8 products
 *   of pairs) sum to at most 30480 before one VPMADDWD widens them. An 8-bit pair could reach
 *   2 * 255 * 127, so the codes are made signed again (xor 128) and multiplied as |code| times
 *   xq with the code's sign (VPSIGNB), at most 2 * 128 * 127 = 32512, widened after each product.
 *
 * Layout (built by kvpilot.kernels.cpu_int8_matmul.interleave, the same for both instruction sets):
 * per tile of 16 output features and run of 32 inputs, 64-byte vectors in which byte 4 * f + q
 * holds input 4 * j + q of feature f, so 4 broadcast bytes of xq meet 4 inputs of every feature
 * (AVX2 reads bytes 0-31 and 32-63 of a vector as features 0-7 and 8-15):
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

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define VNNI 1
#define ISA "avx512_vnni"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VNNI 0
#define ISA "avx2"
#else
#error "needs AVX-512 VNNI, BF16 and BW, or AVX2, FMA and F16C"
#endif
#if !defined(GROUP_SIZE) || GROUP_SIZE % 32 || !defined(BITS) || (BITS != 4 && BITS != 8)
#error "build with -DBITS=4|8 -DGROUP_SIZE=32|64|128|256"
#endif

/* Read by cpu_int8_matmul.py: the instruction set this build multiplies with. */
const char kvpilot_int8_matmul_isa[] = ISA;

#define ROW_TILE 8
#define FEATURE_TILE 16
#define RUN 32
#define RUN_BYTES (RUN * BITS / 8 * FEATURE_TILE) /* codes of one run of a tile */
/* A per-row term each group adds: 4 bits, the rounded x's sum (the offset's share); 8 bits on VNNI, the codes' bias. */
#define GROUP_TERM (BITS == 4 || VNNI)
/* Below this many multiply-adds the call runs on one thread: a parallel region costs more. */
#define PARALLEL_MIN_MACS 65536

#if VNNI
static inline __m512 load16(const void *x, int64_t i, int bf16) { /* x[i..i+15] in float32 */
    if (bf16) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    return _mm512_loadu_ps((const float *)x + i);
}

/*
 * One row of x (k inputs): xq [K] int8, scale [K / 32] and the per-group term [K / GROUP_SIZE]
 * float32: the rounded x's sum over the group, sum over its runs of scale * sum(xq) (4 bits: the
 * offsets' share; 8 bits: times -128, the codes' bias). The offsets meet the same rounded x as the
 * codes: Q4_1's offset is about -8 scales, and the rounding errors of its share and the codes' then
 * cancel, as they do in the dequantized weight times the rounded x (with x's exact sum here, SmolLM2's
 * layers came out 1-4x further from the float product than rounding x explains).
 */
static void quantize_row(const void *x, int bf16, int64_t k, int8_t *xq, float *scale, float *group_term) {
    for (int64_t g = 0; g < k / GROUP_SIZE; ++g) {
        float term = 0.0f;
        for (int64_t b = g * (GROUP_SIZE / RUN); b < (g + 1) * (GROUP_SIZE / RUN); ++b) {
            const __m512 lo = load16(x, b * RUN, bf16), hi = load16(x, b * RUN + 16, bf16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            const float s = amax / 127.0f;
            const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
            const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
            scale[b] = s;
            _mm_storeu_si128((__m128i *)(xq + b * RUN), _mm512_cvtsepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(xq + b * RUN + 16), _mm512_cvtsepi32_epi8(qhi));
            term += s * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        }
        group_term[g] = BITS == 4 ? term : -128.0f * term;
    }
}

/* 16 output features against `rows` rows (a constant after inlining, so the accumulators stay in registers). */
static inline __attribute__((always_inline)) void tile_rows(
    const uint8_t *codes, const _Float16 *scales, const _Float16 *offsets, const int8_t *xq, const float *xs,
    const float *xterm, void *out, int64_t n, int64_t k, int bf16, const int rows) {
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
    for (int r = 0; r < rows; ++r) {
        if (bf16)
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + r * n), (__m256i)_mm512_cvtneps_pbh(acc[r]));
        else
            _mm512_storeu_ps((float *)out + r * n, acc[r]);
    }
}
#else /* AVX2 */
static inline __m256 load8(const void *x, int64_t i, int bf16) { /* x[i..i+7] in float32 */
    if (bf16) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    }
    return _mm256_loadu_ps((const float *)x + i);
}

static inline float reduce_max(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

#if BITS == 4
static inline int32_t reduce_add_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}
#endif

/*
 * One row of x (k inputs): xq [K] int8, scale [K / 32] and, for 4 bits, the rounded x's sum over each
 * group [K / GROUP_SIZE] float32, as the AVX-512 path's (8-bit codes are signed again in registers:
 * no term to take off).
 */
static void quantize_row(const void *x, int bf16, int64_t k, int8_t *xq, float *scale, float *group_term) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    /* VPACKSS packs within 128-bit halves: this puts the 8 runs of 4 bytes back in input order. */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
#if BITS == 4
    float term = 0.0f;
#else
    (void)group_term;
#endif
    for (int64_t b = 0; b < k / RUN; ++b) {
        __m256 v[4]; /* inputs 8i..8i+7 of the run */
        __m256 magnitude = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
            v[i] = load8(x, b * RUN + 8 * i, bf16);
            magnitude = _mm256_max_ps(magnitude, _mm256_andnot_ps(sign, v[i]));
        }
        const float amax = reduce_max(magnitude);
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i q[4];
        for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + b * RUN), _mm256_permutevar8x32_epi32(bytes, order));
        scale[b] = amax / 127.0f;
#if BITS == 4
        term += scale[b] * (float)reduce_add_epi32(
            _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
        if ((b + 1) % (GROUP_SIZE / RUN) == 0) { /* the group's last run */
            group_term[b / (GROUP_SIZE / RUN)] = term;
            term = 0.0f;
        }
#endif
    }
}

static inline void store8(__m256 v, void *out, int64_t i, int bf16) { /* out[i..i+7] */
    if (!bf16) {
        _mm256_storeu_ps((float *)out + i, v);
        return;
    }
    /* Round to nearest even, as torch does: add 0x7fff plus the kept part's lowest bit, keep the top half. */
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    _mm_storeu_si128((__m128i *)((uint16_t *)out + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
}

/* 16 output features, as two halves of 8, against `rows` rows (a constant after inlining). */
static inline __attribute__((always_inline)) void tile_rows(
    const uint8_t *codes, const _Float16 *scales, const _Float16 *offsets, const int8_t *xq, const float *xs,
    const float *xterm, void *out, int64_t n, int64_t k, int bf16, const int rows) {
    const int64_t runs = k / RUN, groups = k / GROUP_SIZE;
    const __m256i ones = _mm256_set1_epi16(1);
#if BITS == 8
    (void)offsets;
    (void)xterm;
#endif
    for (int half = 0; half < 2; ++half) { /* features 8 * half .. 8 * half + 7 */
        __m256 acc[ROW_TILE];
        for (int r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) {
            __m256 group_acc[ROW_TILE];
            for (int r = 0; r < rows; ++r) group_acc[r] = _mm256_setzero_ps();
            for (int64_t b = g * (GROUP_SIZE / RUN); b < (g + 1) * (GROUP_SIZE / RUN); ++b) {
                /* w[j]: inputs 4j..4j+3 of the run for each of the 8 features; rows then go one at a
                 * time, so the compiler keeps one row's products live, not every row's. */
                const uint8_t *run = codes + b * RUN_BYTES + half * 32; /* vector j at run + 64 * j */
                __m256i w[8];
                __m256i dot[ROW_TILE]; /* per row, the run's int32 sum for each of the 8 features */
#if BITS == 4
                const __m256i nibble = _mm256_set1_epi8(15);
                for (int j = 0; j < 4; ++j) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(run + j * 64));
                    w[j] = _mm256_and_si256(v, nibble);
                    w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                }
                for (int r = 0; r < rows; ++r) {
                    const int32_t *xr = (const int32_t *)(xq + r * k + b * RUN);
                    __m256i pairs = _mm256_setzero_si256(); /* int16: at most 8 * 3810, no overflow */
                    for (int j = 0; j < 8; ++j)
                        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(xr[j])));
                    dot[r] = _mm256_madd_epi16(pairs, ones);
                }
#else
                __m256i magnitude[8];
                for (int j = 0; j < 8; ++j) {
                    w[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(run + j * 64)),
                                            _mm256_set1_epi8((char)0x80)); /* the code, signed again */
                    magnitude[j] = _mm256_abs_epi8(w[j]); /* -128 becomes 128, read unsigned */
                }
                for (int r = 0; r < rows; ++r) {
                    const int32_t *xr = (const int32_t *)(xq + r * k + b * RUN);
                    dot[r] = _mm256_setzero_si256();
                    for (int j = 0; j < 8; ++j) {
                        const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(xr[j]), w[j]);
                        const __m256i pairs = _mm256_maddubs_epi16(magnitude[j], signed_x); /* |pair| <= 32512 */
                        dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(pairs, ones));
                    }
                }
#endif
                for (int r = 0; r < rows; ++r)
                    group_acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_set1_ps(xs[r * runs + b]),
                                                   group_acc[r]);
            }
            const __m256 scale =
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + g * FEATURE_TILE + half * 8)));
#if BITS == 4
            const __m256 offset =
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(offsets + g * FEATURE_TILE + half * 8)));
#endif
            for (int r = 0; r < rows; ++r) {
                acc[r] = _mm256_fmadd_ps(group_acc[r], scale, acc[r]);
#if BITS == 4
                acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(xterm[r * groups + g]), acc[r]);
#endif
            }
        }
        for (int r = 0; r < rows; ++r) store8(acc[r], out, r * n + half * 8, bf16);
    }
}
#endif

/*
 * x: [m, k] float32 (bf16 = 0) or bfloat16 (bf16 = 1), contiguous; codes, scales, offsets (NULL for
 * 8 bits): the layout above (n a multiple of 16, k of GROUP_SIZE); out: [m, n] in x's dtype.
 * Returns 0, or -1 (out unwritten) if the workspace for x quantized (m * k bytes and m * k / 16
 * floats at most) cannot be allocated.
 */
int kvpilot_int8_matmul(const void *x, const uint8_t *codes, const _Float16 *scales, const _Float16 *offsets,
                        void *out, int64_t m, int64_t n, int64_t k, int bf16) {
    const int64_t runs = k / RUN, groups = GROUP_TERM ? k / GROUP_SIZE : 0, tiles = n / FEATURE_TILE;
    const int64_t x_bytes = bf16 ? 2 : 4;
    const int parallel = m * n * k >= PARALLEL_MIN_MACS;
    if (m == 0) return 0;
    float *xs = malloc(sizeof(float) * m * (runs + groups) + m * k); /* run scales, group terms, xq */
    if (!xs) return -1;
    float *xterm = xs + m * runs;
    int8_t *xq = (int8_t *)(xterm + m * groups);
#pragma omp parallel for schedule(static) if (parallel && m >= 16)
    for (int64_t r = 0; r < m; ++r)
        quantize_row((const char *)x + r * k * x_bytes, bf16, k, xq + r * k, xs + r * runs, xterm + r * groups);
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t t = 0; t < tiles; ++t) {
        const uint8_t *tc = codes + t * runs * RUN_BYTES;
        const _Float16 *ts = scales + t * (k / GROUP_SIZE) * FEATURE_TILE;
        const _Float16 *to = BITS == 4 ? offsets + t * (k / GROUP_SIZE) * FEATURE_TILE : 0;
        for (int64_t r0 = 0; r0 < m; r0 += ROW_TILE) {
            const int8_t *xr = xq + r0 * k;
            const float *sr = xs + r0 * runs, *gr = xterm + r0 * groups;
            void *dst = (char *)out + (r0 * n + t * FEATURE_TILE) * x_bytes;
            switch (m - r0 < ROW_TILE ? m - r0 : ROW_TILE) {
                case 1: tile_rows(tc, ts, to, xr, sr, gr, dst, n, k, bf16, 1); break;
                case 2: tile_rows(tc, ts, to, xr, sr, gr, dst, n, k, bf16, 2); break;
                case 3: tile_rows(tc, ts, to, xr, sr, gr, dst, n, k, bf16, 3); break;
                case 4: tile_rows(tc, ts, to, xr, sr, gr, dst, n, k, bf16, 4); break;
                case 5: tile_rows(tc, ts, to, xr, sr, gr, dst, n, k, bf16, 5); break;
                case 6: tile_rows(tc, ts, to, xr, sr, gr, dst, n, k, bf16, 6); break;
                case 7: tile_rows(tc, ts, to, xr, sr, gr, dst, n, k, bf16, 7); break;
                default: tile_rows(tc, ts, to, xr, sr, gr, dst, n, k, bf16, ROW_TILE); break;
            }
        }
    }
    free(xs);
    return 0;
}
