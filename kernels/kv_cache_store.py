"""KV-cache store: write the new tokens' K and V into their paged slots.

Cache layout (shared by every backend): kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim],
[0] = K, [1] = V. A token's slot is block_id * block_size + offset_in_block; slot -1 marks a padded
token (CUDA-graph padding) whose K/V must not be written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_cache_store_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    key_stride_tok, key_stride_head, value_stride_tok, value_stride_head,
    k_stride_block, k_stride_slot, k_stride_head,
    v_stride_block, v_stride_slot, v_stride_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    # k, v: [HEADS_PAD, HEAD_DIM_PAD]
    k = tl.load(key_ptr + token * key_stride_tok + heads[:, None] * key_stride_head + dims[None, :],
                mask=mask)
    v = tl.load(value_ptr + token * value_stride_tok + heads[:, None] * value_stride_head + dims[None, :],
                mask=mask)
    k_dst = k_cache_ptr + block * k_stride_block + offset * k_stride_slot
    v_dst = v_cache_ptr + block * v_stride_block + offset * v_stride_slot
    tl.store(k_dst + heads[:, None] * k_stride_head + dims[None, :], k.to(k_cache_ptr.dtype.element_ty),
             mask=mask)
    tl.store(v_dst + heads[:, None] * v_stride_head + dims[None, :], v.to(v_cache_ptr.dtype.element_ty),
             mask=mask)


def kv_cache_store(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into kv_cache at slot_mapping (skip -1)."""
    _check_store_args(key, value, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_size = kv_cache.shape[2]
    _kv_cache_store_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        num_warps=1 if num_kv_heads * head_dim <= 1024 else 4,
    )


def kv_cache_store_reference(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                             slot_mapping: torch.Tensor) -> None:
    """Plain-torch kv_cache_store: scatter the non-padded tokens into the flattened cache."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slots] = key[keep].to(kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slots] = value[keep].to(kv_cache.dtype)


def _check_store_args(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, head_dim]; "
                         f"got key {tuple(key.shape)}, value {tuple(value.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError("kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim]; "
                         f"got {tuple(kv_cache.shape)}")
    if tuple(kv_cache.shape[3:]) != tuple(key.shape[1:]):
        raise ValueError(f"kv_cache heads/head_dim {tuple(kv_cache.shape[3:])} do not match "
                         f"key's {tuple(key.shape[1:])}")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [num_tokens={key.shape[0]}]; "
                         f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if key.stride(2) != 1 or value.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("key, value and kv_cache must be contiguous in head_dim (last stride 1)")
    devices = {key.device, value.device, kv_cache.device, slot_mapping.device}
    if len(devices) != 1:
        raise ValueError(f"key, value, kv_cache and slot_mapping must share one device; got {devices}")
