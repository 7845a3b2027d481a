"""Decode batches through DecodeCudaGraphs (padded static batches) match the eager forward.

On CPU the padded static batch runs eagerly (use_graphs=False) — exactly what a graph records — which
checks the staging and padding; with KVPILOT_TEST_DEVICE=cuda the same test captures and replays real
CUDA graphs.
"""

from __future__ import annotations

import torch

import pytest

from kvpilot.engine.attention import AttentionMetadata, get_attention_backend
from kvpilot.engine.cuda_graphs import DecodeCudaGraphs, capture_sizes

BLOCK_SIZE = 8
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, MAX_LEN = 97, 64, 4, 2, 16, 2, 64


class _TinyDecoder:
    """Embeddings (token + position), then attention layers with projections and residuals.

    Just enough of a decoder to exercise every static input of a captured step (ids, positions, the
    attention metadata, the KV caches) without the model package and its checkpoint-loading imports.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(0)

        def weight(*shape):
            return (0.2 * torch.randn(*shape, generator=gen)).to(dtype).to(device)

        self.embed = weight(VOCAB, HIDDEN)
        self.pos_embed = weight(MAX_LEN, HIDDEN)
        self.layers = [(weight(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), weight(HEADS * HEAD_DIM, HIDDEN))
                       for _ in range(LAYERS)]
        self.backend = get_attention_backend("triton")
        kv_shape = (2, 16, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.kv_caches = [torch.zeros(kv_shape, dtype=dtype, device=device) for _ in range(LAYERS)]

    def __call__(self, input_ids, positions, metadata):
        hidden = self.embed[input_ids] + self.pos_embed[positions]  # [num_tokens, HIDDEN]
        for (w_qkv, w_out), kv_cache in zip(self.layers, self.kv_caches):
            qkv = hidden @ w_qkv
            q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
            num_tokens = hidden.shape[0]
            attn = self.backend.forward(q.view(num_tokens, HEADS, HEAD_DIM), k.view(num_tokens, KV_HEADS, HEAD_DIM),
                                        v.view(num_tokens, KV_HEADS, HEAD_DIM), kv_cache, metadata, HEAD_DIM ** -0.5)
            hidden = hidden + attn.reshape(num_tokens, -1) @ w_out
        return hidden


def _metadata(q_lens, seq_lens, tables, device) -> AttentionMetadata:
    starts, slots = [0], []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        starts.append(starts[-1] + q_len)
        slots += [tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len - q_len, seq_len)]
    width = max(map(len, tables))
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=list(seq_lens),
    )


def _positions(q_lens, seq_lens, device):
    return torch.tensor([p for q, s in zip(q_lens, seq_lens) for p in range(s - q, s)], device=device)


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(24) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]


def test_needs_the_triton_backend():
    with pytest.raises(ValueError, match="triton"):
        DecodeCudaGraphs.for_model(None, [], get_attention_backend("torch"), max_num_seqs=4, max_model_len=64,
                                   block_size=BLOCK_SIZE, device=torch.device("cpu"), use_graphs=False)


def test_padded_decode_steps_match_eager(device, assert_close):
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    eager_model = _TinyDecoder(device, dtype)
    graph_model = _TinyDecoder(device, dtype)  # same weights, its own KV caches
    tables = [[3, 9], [1, 12, 5], [7], [14, 2]]
    gen = torch.Generator().manual_seed(1)

    # Prefill four prompts eagerly into both caches.
    prompt_lens = [9, 17, 4, 11]
    prefill = _metadata(prompt_lens, prompt_lens, tables, device)
    ids = torch.randint(0, VOCAB, (sum(prompt_lens),), generator=gen).to(device)
    for model in (eager_model, graph_model):
        model(ids, _positions(prompt_lens, prompt_lens, device), prefill)

    graphs = DecodeCudaGraphs(graph_model, sizes=capture_sizes(4), max_model_len=MAX_LEN, block_size=BLOCK_SIZE,
                              device=device, use_graphs=device.type == "cuda")
    if graphs.use_graphs:
        graphs.capture()
    assert not graphs.can_run(prefill)

    # Decode steps of 4, 3 (padded to 4 over the previous step's row 3), 1 and 2 sequences.
    lens = list(prompt_lens)
    for seqs in ([0, 1, 2, 3], [0, 1, 2], [1], [0, 2]):
        for s in seqs:
            lens[s] += 1
        step = _metadata([1] * len(seqs), [lens[s] for s in seqs], [tables[s] for s in seqs], device)
        ids = torch.randint(0, VOCAB, (len(seqs),), generator=gen).to(device)
        positions = _positions([1] * len(seqs), [lens[s] for s in seqs], device)
        assert graphs.can_run(step)
        eager = eager_model(ids, positions, step)
        replayed = graphs.run(ids, positions, step)
        assert replayed.shape == eager.shape
        assert_close(replayed, eager)
        for graph_cache, cache in zip(graph_model.kv_caches, eager_model.kv_caches):
            assert_close(graph_cache, cache)  # padding rows stored nothing

    too_many = _metadata([1] * 5, [2] * 5, [[1]] * 5, device)
    assert not graphs.can_run(too_many)
