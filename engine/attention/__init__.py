"""Attention backends over the paged KV cache.

Every backend stores the step's new keys and values into the cache and attends over each
sequence's paged context, following the rule documented on :class:`AttentionMetadata`.

KV cache layout (one tensor per layer, shared by every backend and kernel)::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]   # [0] = K, [1] = V

A token's slot is ``block_id * block_size + offset_in_block``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvpilot.engine.attention.metadata import AttentionMetadata

BACKEND_NAMES = ("torch", "triton")


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store key/value into kv_cache at metadata.slot_mapping (skip -1), then attend."""
        ...


def get_attention_backend(name: str) -> AttentionBackend:
    """A fresh backend instance by name: ``"torch"`` (reference, CPU) or ``"triton"`` (GPU)."""
    if name == "torch":
        from kvpilot.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        # Imported lazily: Triton is heavy and only the GPU path needs it.
        from kvpilot.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}; got {name!r}")


__all__ = ["AttentionBackend", "AttentionMetadata", "BACKEND_NAMES", "get_attention_backend"]
