"""The CPU decode-attention C kernel against the torch reference (it runs on the CPU only)."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import cpu_paged_decode
from kvpilot.kernels.paged_attention import paged_attention_reference

CPU = torch.device("cpu")
TOLERANCES = {torch.float32: (2e-5, 1e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}

# (seq_lens, num_heads, num_kv_heads, head_dim, block_size); one decode token per sequence.
CASES = [
    ([1, 13, 40, 7, 100], 4, 4, 32, 8),  # GQA 1, a one-token context, partial blocks
    ([17, 64, 3], 8, 2, 64, 16),  # GQA 4: the small preset's ratio
    ([30, 9, 31], 6, 2, 24, 16),  # GQA 3, head_dim not a power of two
    ([50, 1, 129], 8, 1, 128, 32),  # multi-query, head_dim 128
    ([200, 5], 4, 2, 16, 128),  # the largest block size
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"lens{c[0]}-h{c[1]}-kv{c[2]}-d{c[3]}-b{c[4]}")
def test_matches_reference(case, dtype, make_batch):
    seq_lens, num_heads, num_kv_heads, head_dim, block_size = case
    # NaN sits in every slot a sequence must not read: a stray read fails the comparison.
    batch = make_batch([1] * len(seq_lens), seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, block_size=block_size, dtype=dtype, device=CPU)  # fmt: skip
    expected = paged_attention_reference(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                         batch.query_start_loc, batch.scale)  # fmt: skip
    out = torch.full_like(batch.query, float("nan"))
    index = torch.arange(len(seq_lens), dtype=torch.int32)
    cpu_paged_decode.paged_decode_attention(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                            index, index, batch.scale, out)  # fmt: skip
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


def test_only_the_given_rows_are_written(make_batch):
    # Sequences 0 and 2 decode from rows 3 and 0 of a wider query; every other row stays untouched.
    batch = make_batch([1, 1, 1], [20, 5, 33], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                             dtype=torch.float32, device=CPU)  # fmt: skip
    query = torch.randn(5, 4, 16)
    query[3], query[0] = batch.query[0], batch.query[2]
    out = torch.full_like(query, 7.0)
    cpu_paged_decode.paged_decode_attention(
        query, batch.kv_cache, batch.block_tables, batch.seq_lens,
        torch.tensor([0, 2], dtype=torch.int32), torch.tensor([3, 0], dtype=torch.int32), batch.scale, out,
    )  # fmt: skip
    expected = paged_attention_reference(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                         batch.query_start_loc, batch.scale)  # fmt: skip
    torch.testing.assert_close(out[3], expected[0])
    torch.testing.assert_close(out[0], expected[2])
    assert (out[[1, 2, 4]] == 7.0).all()


def test_bad_arguments_name_the_problem(make_batch):
    batch = make_batch([1], [9], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                             dtype=torch.float32, device=CPU)  # fmt: skip
    index = torch.zeros(1, dtype=torch.int32)
    args = (batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens, index, index, batch.scale)
    with pytest.raises(ValueError, match="seqs must be int32"):
        cpu_paged_decode.paged_decode_attention(*args[:4], index.long(), *args[5:], torch.empty_like(batch.query))
    with pytest.raises(ValueError, match="share a dtype"):
        cpu_paged_decode.paged_decode_attention(*args, torch.empty_like(batch.query, dtype=torch.float16))
    wide = torch.zeros(2, 1, 8, 2, 512)
    with pytest.raises(ValueError, match="head_dim <= 256"):
        cpu_paged_decode.paged_decode_attention(torch.zeros(1, 4, 512), wide, *args[2:], torch.zeros(1, 4, 512))


def test_a_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-cc")
    monkeypatch.setenv("KVPILOT_KERNEL_CACHE", str(tmp_path))
    cpu_paged_decode.load_kernel.cache_clear()
    try:
        with pytest.raises(cpu_paged_decode.KernelBuildError, match="install gcc"):
            cpu_paged_decode.load_kernel(torch.float32, head_dim=16, num_kv_heads=2, group=2, block_size=8)
    finally:
        cpu_paged_decode.load_kernel.cache_clear()
