"""Paged decode attention on the CPU: the C kernel in cpu_paged_decode.c, built on first use.

Decode rows (one new token per sequence) are most of a serving step's attention. In plain torch
they cost a gather of every context into a padded buffer and then a
``scaled_dot_product_attention`` call whose tiny per-head matrix products (a handful of query
rows) run far below the memory bandwidth. This kernel reads each K/V row once, straight from its
cache block, for all the query heads that share it.

The kernel is built by cpu_build.py once per shape (dtype, head_dim, query heads per KV head,
block size: compile-time constants, like a Triton kernel's ``constexpr``), in about half a
second. Its reference is
:func:`kvpilot.kernels.paged_attention.paged_attention_reference`.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kvpilot.kernels.cpu_build import DTYPE_CODES, KernelBuildError, load_library

SOURCE = Path(__file__).with_name("cpu_paged_decode.c")
# The kernel keeps per-item scratch on the stack of an OpenMP thread: [query heads per KV head,
# head_dim] floats twice and [query heads per KV head, block_size] once, a few hundred KiB at most.
MAX_HEAD_DIM = 256
MAX_HEAD_ELEMENTS = 32768  # num_heads * head_dim
MAX_BLOCK_SIZE = 128
__all__ = ["KernelBuildError", "kernel_for", "load_kernel", "paged_decode_attention", "supports"]


def supports(*, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether the kernel handles this model and cache shape (else attend with plain torch)."""
    return (
        dtype in DTYPE_CODES
        and head_dim <= MAX_HEAD_DIM
        and num_heads % num_kv_heads == 0
        and num_heads * head_dim <= MAX_HEAD_ELEMENTS
        and num_heads * block_size <= MAX_HEAD_ELEMENTS
        and block_size <= MAX_BLOCK_SIZE
    )


def paged_decode_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    seqs: torch.Tensor,  # [n] int32: the sequences that decode (one query token each)
    rows: torch.Tensor,  # [n] int32: each one's row in query and out
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]; rows not in `rows` are left as they are
) -> torch.Tensor:
    """Sequence ``seqs[i]``'s query row ``rows[i]`` attends to its ``seq_lens`` cached tokens."""
    _check_args(query, kv_cache, block_tables, seq_lens, seqs, rows, out)
    kernel_for(query, kv_cache)(
        query.data_ptr(), query.stride(0), query.stride(1),
        kv_cache.data_ptr(), kv_cache.shape[1],
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
        seqs.data_ptr(), rows.data_ptr(), seqs.shape[0], scale,
        out.data_ptr(), out.stride(0), out.stride(1),
    )  # fmt: skip
    return out


def kernel_for(query: torch.Tensor, kv_cache: torch.Tensor) -> ctypes._CFuncPtr:
    """The kernel for these tensors' dtype and shape (built on first use); raises KernelBuildError."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return load_kernel(query.dtype, head_dim=head_dim, num_kv_heads=num_kv_heads,
                       group=query.shape[1] // num_kv_heads, block_size=block_size)  # fmt: skip


@functools.cache
def load_kernel(
    dtype: torch.dtype, *, head_dim: int, num_kv_heads: int, group: int, block_size: int
) -> ctypes._CFuncPtr:
    """The kernel specialised for this shape: compiled once per machine (cached), then loaded.

    Raises KernelBuildError when there is no working C compiler or the build fails.
    """
    defines = {"HEAD_DIM": head_dim, "KV_HEADS": num_kv_heads, "GROUP": group, "BLOCK_SIZE": block_size,
               "DTYPE": DTYPE_CODES[dtype]}
    kernel = load_library(SOURCE, defines).kvpilot_paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    kernel.restype = None
    kernel.argtypes = [
        ptr, i64, i64,  # query, its token and head strides
        ptr, i64,  # kv_cache, num_blocks
        ptr, i64, ptr,  # block_tables, its row stride, seq_lens
        ptr, ptr, i64, ctypes.c_float,  # seqs, rows, n, scale
        ptr, i64, i64,  # out, its token and head strides
    ]  # fmt: skip
    return kernel


def _check_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seqs: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
) -> None:
    tensors = {"query": query, "kv_cache": kv_cache, "block_tables": block_tables, "seq_lens": seq_lens,
               "seqs": seqs, "rows": rows, "out": out}  # fmt: skip
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {tensor.device}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be contiguous [2, num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(kv_cache.shape)}")  # fmt: skip
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if query.dim() != 3 or query.shape[2] != head_dim or out.shape != query.shape:
        raise ValueError(f"query and out must be [num_tokens, num_heads, {head_dim}], "
                         f"got {tuple(query.shape)} and {tuple(out.shape)}")  # fmt: skip
    if query.dtype != kv_cache.dtype or out.dtype != query.dtype:
        raise ValueError(f"query, kv_cache and out must share a dtype; got {query.dtype}, {kv_cache.dtype}, {out.dtype}")
    if not supports(dtype=query.dtype, num_heads=query.shape[1], num_kv_heads=num_kv_heads, head_dim=head_dim,
                    block_size=block_size):  # fmt: skip
        raise ValueError(
            f"unsupported shape for the CPU decode kernel: dtype {query.dtype}, {query.shape[1]} heads over "
            f"{num_kv_heads} KV heads, head_dim {head_dim}, block_size {block_size} (limits: float32/bfloat16/"
            f"float16, head_dim <= {MAX_HEAD_DIM}, num_heads * head_dim <= {MAX_HEAD_ELEMENTS}, "
            f"block_size <= {MAX_BLOCK_SIZE})"
        )
    if query.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("query and out must be contiguous in head_dim (last stride 1)")
    for name in ("block_tables", "seq_lens", "seqs", "rows"):
        if tensors[name].dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {tensors[name].dtype}")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1 or not seq_lens.is_contiguous():
        raise ValueError("block_tables must be [num_seqs, max_blocks] with contiguous rows; seq_lens contiguous")
    if seqs.shape != rows.shape or seqs.dim() != 1 or not (seqs.is_contiguous() and rows.is_contiguous()):
        raise ValueError(f"seqs and rows must be contiguous [n]; got {tuple(seqs.shape)} and {tuple(rows.shape)}")
