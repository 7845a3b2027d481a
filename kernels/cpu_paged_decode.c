/*
 * Paged decode attention for the CPU: each sequence's one new query token attends to its whole
 * paged context, reading K and V straight from the KV cache (no gather into a padded copy).
 *
 * Built and loaded by cpu_paged_decode.py (gcc -O3 -march=native -ffast-math -fopenmp), once per
 * shape: HEAD_DIM, KV_HEADS, GROUP (query heads per KV head), BLOCK_SIZE and DTYPE are -D
 * constants, so every loop has a fixed trip count the compiler can unroll and vectorise.
 * The OpenMP calls bind to the libgomp torch has already loaded, so this kernel and torch's own
 * operators share one thread pool and one thread count (torch.set_num_threads).
 *
 * Work item: one sequence and one KV head, so a single sequence (batch 1) still spreads over the
 * threads. An item reads its KV head's K (then V) row of each token in a block, once, for all the
 * query heads that share it. Per block: scores for its tokens, an online-softmax update
 * (running max and sum per query head), then the weighted V rows added to float32 accumulators.
 *
 * Layouts (element strides; the last dimension of query, out and kv_cache is contiguous):
 *   query/out  [num_tokens, num_heads, head_dim]
 *   kv_cache   [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous; [0] = K, [1] = V
 *   block_tables [num_seqs, table_stride] int32; seq_lens [num_seqs] int32
 *   seqs, rows [n] int32: the sequences to attend and the query/out row of each
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "cpu_elem.h"

#if !defined(HEAD_DIM) || !defined(KV_HEADS) || !defined(GROUP) || !defined(BLOCK_SIZE) || !defined(DTYPE)
#error "build with -DHEAD_DIM=.. -DKV_HEADS=.. -DGROUP=.. -DBLOCK_SIZE=.. -DDTYPE=.."
#endif

#define TOKEN_STRIDE (KV_HEADS * HEAD_DIM) /* elements from one cached token to the next */

void kvpilot_paged_decode_attention(
    const elem_t *query, int64_t q_stride_tok, int64_t q_stride_head,
    const elem_t *kv_cache, int64_t num_blocks,
    const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
    const int32_t *seqs, const int32_t *rows, int64_t n, float scale,
    elem_t *out, int64_t out_stride_tok, int64_t out_stride_head) {
    const int64_t block_stride = BLOCK_SIZE * TOKEN_STRIDE;
    const elem_t *v_cache = kv_cache + num_blocks * block_stride;

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < n * KV_HEADS; ++item) {
        const int64_t row = rows[item / KV_HEADS], kvh = item % KV_HEADS;
        const int64_t seq_len = seq_lens[seqs[item / KV_HEADS]];
        const int32_t *table = block_tables + seqs[item / KV_HEADS] * table_stride;

        float q[GROUP][HEAD_DIM], acc[GROUP][HEAD_DIM], scores[GROUP][BLOCK_SIZE];
        float running_max[GROUP], running_sum[GROUP];
        for (int g = 0; g < GROUP; ++g) {
            const elem_t *q_row = query + row * q_stride_tok + (kvh * GROUP + g) * q_stride_head;
            for (int d = 0; d < HEAD_DIM; ++d) {
                q[g][d] = to_f32(q_row[d]) * scale;
                acc[g][d] = 0.0f;
            }
            running_max[g] = -FLT_MAX; /* finite: -ffast-math assumes no infinities */
            running_sum[g] = 0.0f;
        }
        for (int64_t start = 0; start < seq_len; start += BLOCK_SIZE) {
            const int64_t offset = table[start / BLOCK_SIZE] * block_stride + kvh * HEAD_DIM;
            const int count = seq_len - start < BLOCK_SIZE ? (int)(seq_len - start) : BLOCK_SIZE;
            const elem_t *k_rows = kv_cache + offset, *v_rows = v_cache + offset;
            for (int t = 0; t < count; ++t) {
                float k[HEAD_DIM];
                for (int d = 0; d < HEAD_DIM; ++d) k[d] = to_f32(k_rows[t * TOKEN_STRIDE + d]);
                for (int g = 0; g < GROUP; ++g) {
                    float dot = 0.0f;
                    for (int d = 0; d < HEAD_DIM; ++d) dot += q[g][d] * k[d];
                    scores[g][t] = dot;
                }
            }
            for (int g = 0; g < GROUP; ++g) {
                float block_max = running_max[g];
                for (int t = 0; t < count; ++t) block_max = fmaxf(block_max, scores[g][t]);
                const float correction = expf(running_max[g] - block_max);
                float block_sum = 0.0f;
                for (int t = 0; t < count; ++t) {
                    scores[g][t] = expf(scores[g][t] - block_max);
                    block_sum += scores[g][t];
                }
                running_sum[g] = running_sum[g] * correction + block_sum;
                running_max[g] = block_max;
                for (int d = 0; d < HEAD_DIM; ++d) acc[g][d] *= correction;
            }
            for (int t = 0; t < count; ++t) {
                float v[HEAD_DIM];
                for (int d = 0; d < HEAD_DIM; ++d) v[d] = to_f32(v_rows[t * TOKEN_STRIDE + d]);
                for (int g = 0; g < GROUP; ++g) {
                    const float p = scores[g][t];
                    for (int d = 0; d < HEAD_DIM; ++d) acc[g][d] += p * v[d];
                }
            }
        }
        for (int g = 0; g < GROUP; ++g) {
            elem_t *out_row = out + row * out_stride_tok + (kvh * GROUP + g) * out_stride_head;
            const float inv = running_sum[g] > 0.0f ? 1.0f / running_sum[g] : 0.0f;
            for (int d = 0; d < HEAD_DIM; ++d) out_row[d] = from_f32(acc[g][d] * inv);
        }
    }
}
