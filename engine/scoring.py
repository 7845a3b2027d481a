"""A loaded model's logits for one whole sequence, and perplexity: what quality checks measure.

The sequence goes through the model the engine's way (a fresh paged KV cache, the torch
attention backend), in one forward or prefilled ``chunk`` tokens at a time, with nothing
scheduled or sampled. ``EVAL_PASSAGE`` is a fixed plain-English passage (about 300 tokens,
written for kvpilot) that the perplexity checks and benchmarks share.
"""

from __future__ import annotations

import math

import torch

from kvpilot.engine.attention import AttentionMetadata, get_attention_backend

EVAL_PASSAGE = """\
The old lighthouse stood at the end of a narrow spit of rock, a mile from the nearest house. For
more than a hundred years its lamp had turned through the night, warning ships away from the reef
that lay hidden beneath the grey water. The keepers who lived there kept a careful log of every
storm, every passing vessel and every repair they made to the great glass lens. In winter the wind
came straight from the north, and waves broke over the gallery rail so hard that the whole tower
seemed to shake. In summer the sea was calm and blue, and children from the village rowed out to
bring the keepers fresh bread, letters and news from the mainland.
When the lamp was finally automated, the last keeper packed his books and his tools into a small
wooden boat and rowed back to the harbour. He said that he would miss the silence most of all, and
the way the light swept across the water, steady and patient, as if it were counting the hours
until morning. Today the tower is a museum. Visitors climb the spiral stairs, read the old logs
behind glass, and look out over the same reef that so many sailors feared. On a clear day you can
see the coast of the next island, and on a stormy night you can still watch the beam turn slowly
in the dark, as it has done for generations.
"""
BLOCK_SIZE = 16


def sequence_logits(model, tokens: list[int], chunk: int | None = None) -> torch.Tensor:
    """Logits [len(tokens), vocab] of ``model`` (a loaded CausalLM) at every position of one
    sequence, computed in one forward, or ``chunk`` tokens at a time (chunked prefill)."""
    arch, n = model.arch, len(tokens)
    num_blocks = -(-n // BLOCK_SIZE)
    kv_caches = [torch.zeros(2, num_blocks, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim, dtype=model.dtype)
                 for _ in range(arch.num_layers)]
    backend, logits, step = get_attention_backend("torch"), [], chunk or n
    for start in range(0, n, step):
        new = tokens[start:start + step]
        seq_len = start + len(new)
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor([0, len(new)], dtype=torch.int32),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32),
            block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
            slot_mapping=torch.arange(start, seq_len, dtype=torch.int64),
            max_query_len=len(new), max_seq_len=seq_len, query_start_loc_cpu=[0, len(new)], seq_lens_cpu=[seq_len],
        )
        with torch.inference_mode():
            hidden = model(torch.tensor(new), torch.arange(start, seq_len), kv_caches, metadata, backend)
            logits.append(model.compute_logits(hidden))
    return torch.cat(logits)


def perplexity(logits: torch.Tensor, tokens: list[int]) -> float:
    """exp(mean negative log-likelihood of each token after the first, given the ones before)."""
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(tokens[1:]))
    return math.exp(nll.item())
