"""Split-KV (flash-decoding) for long-context decode.

A decode step has one query per sequence, so a batch of few sequences gives the paged-attention kernel
only num_seqs x num_kv_heads programs: far fewer than the GPU has SMs, and each one walks a long
context alone. Splitting every context into NUM_SPLITS ranges multiplies the parallelism; each split
writes its partial output (already normalised by its own softmax sum) and its log-sum-exp, and the
merge kernel below combines the splits with the usual rescaling. The paged-attention kernel does the
per-split work (kernels/paged_attention.py, NUM_SPLITS > 1); this file owns the choice of the split
count, the merge kernel, and the merge's torch reference.

Each split covers cdiv(num_tiles, NUM_SPLITS) tiles of its own sequence, computed in the kernel from
that sequence's length, so the grid depends only on the batch size and the split count: a CUDA graph
captured with a given split count stays correct for any context lengths at replay.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_SPLITS = 32
# Below this many keys per split the merge costs more than the parallelism gains.
MIN_KEYS_PER_SPLIT = 256
# Resident programs per SM that keep enough K/V loads in flight to saturate HBM (each program
# prefetches one tile ahead; shared memory and registers allow about four per SM on Hopper).
_TARGET_PROGRAMS_PER_SM = 4


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                      device: torch.device) -> int:
    """How many KV splits to use for a batch; 1 means the plain single-pass kernel.

    Split only decode-only batches (prefill tiles already give plenty of programs) on CUDA, when
    num_seqs x num_kv_heads programs would leave SMs idle and the contexts are long enough that each
    split still reads at least MIN_KEYS_PER_SPLIT keys.
    """
    if device.type != "cuda" or max_query_len != 1 or num_seqs == 0:
        return 1
    programs = num_seqs * num_kv_heads
    target = _TARGET_PROGRAMS_PER_SM * _num_sms(device.index if device.index is not None
                                                 else torch.cuda.current_device())
    if programs >= target:
        return 1
    by_occupancy = triton.cdiv(target, programs)
    by_length = max_seq_len // MIN_KEYS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


@triton.jit
def _merge_splits_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr,
    out_stride_tok, out_stride_head,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_mask = splits < NUM_SPLITS
    row = token.to(tl.int64) * NUM_HEADS + head
    # lse: [SPLITS_PAD] base-2 log-sum-exp of each split's scaled scores; -inf for an empty split.
    lse = tl.load(partial_lse_ptr + row * NUM_SPLITS + splits, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    total = tl.sum(weights, axis=0)
    # partial: [SPLITS_PAD, HEAD_DIM_PAD]
    partial = tl.load(partial_out_ptr + (row * NUM_SPLITS + splits[:, None]) * HEAD_DIM_PAD + dims[None, :],
                      mask=split_mask[:, None], other=0.0)
    merged = tl.sum(partial * weights[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * out_stride_tok + head * out_stride_head + dims,
             merged.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def merge_splits(partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor) -> None:
    """Combine per-split results into out [num_tokens, num_heads, head_dim].

    partial_out: [num_tokens, num_heads, num_splits, head_dim_pad] float32 (head_dim_pad a power of two
    >= head_dim; lanes beyond head_dim are ignored), each split normalised by
    its own softmax sum; partial_lse: [num_tokens, num_heads, num_splits] float32, base-2 log-sum-exp
    of the split's scaled scores (-inf when the split saw no key).
    """
    num_tokens, num_heads, num_splits, head_dim_pad = partial_out.shape
    head_dim = out.shape[2]
    if partial_lse.shape != (num_tokens, num_heads, num_splits):
        raise ValueError(f"partial_lse must be {(num_tokens, num_heads, num_splits)}, got {tuple(partial_lse.shape)}")
    if out.shape[:2] != (num_tokens, num_heads) or head_dim_pad < head_dim or head_dim_pad & (head_dim_pad - 1):
        raise ValueError(f"out {tuple(out.shape)} does not match partial_out {tuple(partial_out.shape)}")
    if not (partial_out.is_contiguous() and partial_lse.is_contiguous()) or out.stride(2) != 1:
        raise ValueError("partial_out/partial_lse must be contiguous and out contiguous in head_dim")
    if num_tokens == 0:
        return
    _merge_splits_kernel[(num_tokens, num_heads)](
        out, partial_out, partial_lse, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, num_warps=1 if head_dim_pad <= 64 else 2,
    )


def merge_splits_reference(partial_out: torch.Tensor, partial_lse: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Plain-torch merge: softmax over the splits' log-sum-exps weights their outputs."""
    # weights: [num_tokens, num_heads, num_splits]; an all-empty row (no keys at all) merges to 0.
    lse_max = partial_lse.amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0)
    weights = torch.exp2(partial_lse - lse_max)
    total = weights.sum(dim=-1, keepdim=True)
    merged = (partial_out * weights.unsqueeze(-1)).sum(dim=2) / torch.where(total == 0, 1.0, total)
    return merged[..., :head_dim]
