"""The GPU attention path: kvpilot's own Triton kernels over the paged KV cache.

One store kernel writes the step's new K/V into their slots, then one paged-attention launch covers
the whole mixed batch (prefill chunks and decodes together); the launcher switches to split-KV for
decode batches with few, long sequences. Nothing here reads device values back to the host, so a
decode step can be captured in a CUDA graph (engine/cuda_graphs.py). On CPU the same kernels run
under TRITON_INTERPRET=1, which is how the tests exercise this backend.
"""

from __future__ import annotations

import torch

from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.kernels.kv_cache_store import kv_cache_store
from kvpilot.kernels.paged_attention import paged_attention


class TritonAttentionBackend:
    name = "triton"

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        kv_cache_store(key, value, kv_cache, metadata.slot_mapping)
        return paged_attention(
            query,
            kv_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            scale=scale,
        )
