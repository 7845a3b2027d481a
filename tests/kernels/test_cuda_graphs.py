"""Decode batches through DecodeCudaGraphs (padded static batches) match the eager forward.

On CPU the padded static batch runs eagerly (use_graphs=False) — exactly what a graph records — which
checks the staging and padding; with KVPILOT_TEST_DEVICE=cuda the same test captures and replays real
CUDA graphs.
"""

from __future__ import annotations

import torch

from kvpilot.engine.attention import AttentionMetadata, get_attention_backend
from kvpilot.engine.cuda_graphs import DecodeCudaGraphs, capture_sizes
from kvpilot.engine.models import CausalLM
from kvpilot.engine.models.config import parse_model_arch

BLOCK_SIZE = 8


def _tiny_model(device: torch.device, dtype: torch.dtype) -> CausalLM:
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 97,
              "max_position_embeddings": 128}
    model = CausalLM(parse_model_arch(config, {}, "test"), dtype, device)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            values = 1 + 0.1 * torch.randn(param.shape, generator=gen) if "norm" in name else \
                0.1 * torch.randn(param.shape, generator=gen)
            param.copy_(values.to(dtype))
    return model


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


def test_padded_decode_steps_match_eager(device, assert_close):
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = _tiny_model(device, dtype)
    backend = get_attention_backend("triton")
    arch = model.arch
    kv_shape = (2, 16, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
    caches = [torch.zeros(kv_shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
    tables = [[3, 9], [1, 12, 5], [7], [14, 2]]
    gen = torch.Generator().manual_seed(1)

    # Prefill four prompts eagerly to fill the cache.
    prompt_lens = [9, 17, 4, 11]
    prefill = _metadata(prompt_lens, prompt_lens, tables, device)
    ids = torch.randint(0, arch.vocab_size, (sum(prompt_lens),), generator=gen).to(device)
    model(ids, _positions(prompt_lens, prompt_lens, device), caches, prefill, backend)

    graph_caches = [c.clone() for c in caches]
    graphs = DecodeCudaGraphs.for_model(model, graph_caches, backend, max_num_seqs=4, max_model_len=64,
                                        block_size=BLOCK_SIZE, device=device, use_graphs=device.type == "cuda")
    assert not graphs.can_run(prefill)

    # Decode steps of 4, 3 (padded to 4 over the previous step's row 3), 1 and 2 sequences.
    lens = list(prompt_lens)
    for seqs in ([0, 1, 2, 3], [0, 1, 2], [1], [0, 2]):
        for s in seqs:
            lens[s] += 1
        step = _metadata([1] * len(seqs), [lens[s] for s in seqs], [tables[s] for s in seqs], device)
        ids = torch.randint(0, arch.vocab_size, (len(seqs),), generator=gen).to(device)
        positions = _positions([1] * len(seqs), [lens[s] for s in seqs], device)
        assert graphs.can_run(step)
        eager = model(ids, positions, caches, step, backend)
        replayed = graphs.run(ids, positions, step)
        assert replayed.shape == eager.shape
        assert_close(replayed, eager)
        for graph_cache, cache in zip(graph_caches, caches):
            assert_close(graph_cache, cache)  # padding rows stored nothing

    too_many = _metadata([1] * 5, [2] * 5, [[1]] * 5, device)
    assert not graphs.can_run(too_many)
