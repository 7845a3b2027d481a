/*
 * A decode step's decoder layers in one call, for Llama-family models on the CPU whose matmuls all
 * run on the int8-activation kernel (cpu_int8_matmul.c).
 *
 * At decode batch sizes a layer is about a dozen small kernels (norms, four matmuls, RoPE, the KV
 * store, attention, SiLU-and-mul), and from Python each call costs microseconds of wrapping, checks
 * and ctypes: ~2 ms of a 7.5 ms SmolLM2 token at batch 1. Here the same kernels run in the same
 * order on the same buffers, called through the function pointers the Python side hands over
 * (each kernel stays in its own library, built for its own shape), so the result is the layer-by-
 * layer path's, bit for bit. Per layer, for n rows (one token of each sequence):
 *
 *   normed = rms_norm(residual += delta)          (the first layer: residual = delta)
 *   qkv = normed @ Wqkv (+ bias); RoPE on q and k; k, v -> kv_cache at slot_mapping
 *   attn = paged decode attention of q over each sequence's cached context
 *   delta = attn @ Wo (+ bias); normed = rms_norm(residual += delta)
 *   delta = silu(gate) * up of normed @ Wgate_up (+ bias), @ Wdown (+ bias)
 *
 * On return ``delta`` holds the last layer's output and ``residual`` the stream before it is added
 * (what the final norm takes). Built by cpu_decode_layers.py once per DTYPE (cpu_elem.h).
 */
#include <stdint.h>
#include <string.h>

#include "cpu_elem.h"

typedef int (*matmul_fn)(const void *x, const void *codes, const void *scales, const void *offsets, void *out,
                         int64_t m, int64_t n, int64_t k, int bf16);
typedef void (*add_rms_norm_fn)(const elem_t *delta, elem_t *residual, const elem_t *weight, elem_t *out, int64_t n,
                                int64_t hidden, float eps);
typedef void (*silu_mul_fn)(const elem_t *gate_up, elem_t *out, int64_t n, int64_t inter);
typedef void (*rope_fn)(elem_t *x, int64_t row_stride, int64_t n, int64_t heads, int64_t head_dim,
                        const elem_t *cos, const elem_t *signed_sin);
typedef void (*attention_fn)(const elem_t *query, int64_t q_stride_tok, int64_t q_stride_head,
                             const elem_t *kv_cache, int64_t num_blocks, const int32_t *block_tables,
                             int64_t table_stride, const int32_t *seq_lens, const int32_t *seqs,
                             const int32_t *rows, int64_t n, float scale, elem_t *out, int64_t out_stride_tok,
                             int64_t out_stride_head);

struct kvpilot_linear { /* one projection on the int8-activation kernel */
    matmul_fn matmul;
    const void *codes, *scales, *offsets; /* offsets: NULL for 8-bit codes */
    const elem_t *bias;                   /* [n], or NULL */
    int64_t n, k;
};

struct kvpilot_decode_layer {
    const elem_t *input_norm, *post_attention_norm; /* [hidden] */
    struct kvpilot_linear qkv, o, gate_up, down;
    elem_t *kv_cache; /* [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous */
};

struct kvpilot_decode_model { /* fixed for the model's life */
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, num_blocks, block_size;
    float eps, scale;
    int bf16;
    add_rms_norm_fn add_rms_norm;
    silu_mul_fn silu_mul;
    rope_fn rope;
    attention_fn attention;
    const struct kvpilot_decode_layer *layers; /* [num_layers] */
};

struct kvpilot_decode_step { /* one step's n rows; every buffer contiguous */
    int64_t n;
    elem_t *delta, *residual, *normed;  /* [n, hidden]; delta holds the embeddings on entry */
    elem_t *qkv;                        /* [n, (num_heads + 2 * num_kv_heads) * head_dim] */
    elem_t *attn;                       /* [n, num_heads * head_dim] */
    elem_t *gate_up, *act;              /* [n, 2 * intermediate], [n, intermediate] */
    const elem_t *cos, *signed_sin;     /* [n, head_dim] */
    const int64_t *slot_mapping;        /* [n]: each row's K/V slot (block * block_size + offset), >= 0 */
    const int32_t *block_tables;        /* [n, table_stride] */
    int64_t table_stride;
    const int32_t *seq_lens, *index;    /* [n]: context lengths; 0 .. n - 1 (row i is sequence i) */
};

static int linear(const struct kvpilot_linear *w, const elem_t *x, elem_t *out, int64_t m, int bf16) {
    if (w->matmul(x, w->codes, w->scales, w->offsets, out, m, w->n, w->k, bf16)) return -1;
    if (w->bias)
        for (int64_t r = 0; r < m; ++r)
            for (int64_t i = 0; i < w->n; ++i) out[r * w->n + i] = from_f32(to_f32(out[r * w->n + i]) + to_f32(w->bias[i]));
    return 0;
}

/* Returns 0, or -1 when a matmul could not allocate its workspace (the outputs are then unusable). */
int kvpilot_decode_layers(const struct kvpilot_decode_model *model, const struct kvpilot_decode_step *step) {
    const int64_t n = step->n, hidden = model->hidden, head_dim = model->head_dim;
    const int64_t q_size = model->num_heads * head_dim, kv_size = model->num_kv_heads * head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    if (n == 0) return 0;
    memcpy(step->residual, step->delta, sizeof(elem_t) * n * hidden);
    for (int64_t l = 0; l < model->num_layers; ++l) {
        const struct kvpilot_decode_layer *layer = &model->layers[l];
        if (l == 0)
            model->add_rms_norm(step->residual, 0, layer->input_norm, step->normed, n, hidden, model->eps);
        else
            model->add_rms_norm(step->delta, step->residual, layer->input_norm, step->normed, n, hidden, model->eps);
        if (linear(&layer->qkv, step->normed, step->qkv, n, model->bf16)) return -1;
        model->rope(step->qkv, qkv_size, n, model->num_heads + model->num_kv_heads, head_dim, step->cos,
                    step->signed_sin);
        elem_t *v_cache = layer->kv_cache + model->num_blocks * model->block_size * kv_size;
        for (int64_t r = 0; r < n; ++r) {
            const int64_t slot = step->slot_mapping[r];
            const elem_t *row = step->qkv + r * qkv_size; /* q heads, k heads, v heads */
            memcpy(layer->kv_cache + slot * kv_size, row + q_size, sizeof(elem_t) * kv_size);
            memcpy(v_cache + slot * kv_size, row + q_size + kv_size, sizeof(elem_t) * kv_size);
        }
        model->attention(step->qkv, qkv_size, head_dim, layer->kv_cache, model->num_blocks, step->block_tables,
                         step->table_stride, step->seq_lens, step->index, step->index, n, model->scale, step->attn,
                         q_size, head_dim);
        if (linear(&layer->o, step->attn, step->delta, n, model->bf16)) return -1;
        model->add_rms_norm(step->delta, step->residual, layer->post_attention_norm, step->normed, n, hidden,
                            model->eps);
        if (linear(&layer->gate_up, step->normed, step->gate_up, n, model->bf16)) return -1;
        model->silu_mul(step->gate_up, step->act, n, model->intermediate);
        if (linear(&layer->down, step->act, step->delta, n, model->bf16)) return -1;
    }
    return 0;
}
