"""Shared set-up for the kernel tests: device/dtype choice and random paged batches (as fixtures).

On CPU (the default) kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py) at small shapes in
float32 and float16. KVPILOT_TEST_DEVICE=cuda runs the same tests on a GPU in bfloat16 (and float16)
at real shapes (Llama-3-8B heads, contexts of thousands of tokens).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

DEVICE = torch.device(os.environ.get("KVPILOT_TEST_DEVICE", "cpu"))
ON_CUDA = DEVICE.type == "cuda"
DTYPES = [torch.bfloat16, torch.float16] if ON_CUDA else [torch.float32, torch.float16]
# (atol, rtol) against the float32 torch references; half precision loses bits when the softmax
# probabilities are rounded to the value dtype before the P @ V product.
TOLERANCES = {
    torch.float32: (2e-5, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2.5e-2, 2.5e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    scale: float


def make_paged_batch(q_lens: list[int], seq_lens: list[int], *, num_heads: int, num_kv_heads: int,
                     head_dim: int, block_size: int, dtype: torch.dtype, seed: int = 0,
                     extra_blocks: int = 3, device: torch.device = DEVICE) -> PagedBatch:
    """A random batch whose block tables are shuffled, non-contiguous and padded with 0 entries.

    Block 0 is never handed to a sequence and, like every slot past a sequence's length, holds NaN:
    a kernel that reads a key it should not see (an unused table entry, the tail of a partial block)
    turns its output into NaN and fails the comparison.
    """
    assert len(q_lens) == len(seq_lens) and all(0 <= q <= s for q, s in zip(q_lens, seq_lens))
    # Generated where it is used: real-shape caches on a GPU hold millions of values.
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + extra_blocks
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    kv_cache[:, 0] = float("nan")
    order = (torch.randperm(num_blocks - 1, generator=gen, device=device) + 1).tolist()
    max_blocks = max(blocks_per_seq + [1]) + 2
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for i, (n, seq_len) in enumerate(zip(blocks_per_seq, seq_lens)):
        mine = [order.pop() for _ in range(n)]
        block_tables[i, :n] = torch.tensor(mine, dtype=torch.int32)
        if seq_len % block_size:
            kv_cache[:, mine[-1], seq_len % block_size:] = float("nan")
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen, device=device).to(dtype)
    query_start_loc = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return PagedBatch(
        query=query, kv_cache=kv_cache, block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), scale=head_dim ** -0.5,
    )


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture(name="make_batch")
def make_batch_fixture():
    return make_paged_batch


@pytest.fixture(name="assert_close")
def assert_close_fixture():
    return assert_close
