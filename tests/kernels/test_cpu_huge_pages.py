"""Packed CPU weights on transparent huge pages (kvpilot.kernels.cpu_huge_pages): the copies hold the
same values, sit in memory advised MADV_HUGEPAGE, and give it back when the last one is freed."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from kvpilot.kernels import cpu_huge_pages, cpu_int8_matmul
from kvpilot.kernels.quant_layout import pack_codes

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="Linux's madvise only")


def mapping_of(address: int) -> tuple[str, list[str]] | None:
    """(the address range, its VmFlags) of the mapping in /proc/self/smaps holding ``address``."""
    found = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                found = head if start <= address < end else None
            elif found and line.startswith("VmFlags:"):
                return found, line.split()[1:]
    return None


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.float32, torch.bfloat16], ids=str)
def test_a_copy_holds_the_same_values_contiguously(dtype):
    source = (torch.arange(6 * 10 * 7) % 251).to(dtype).view(6, 10, 7).transpose(0, 2)  # not contiguous
    copy = cpu_huge_pages.copy_to_huge_pages(source)
    assert copy.is_contiguous() and copy.shape == source.shape and copy.dtype == dtype
    assert torch.equal(copy, source)
    source.zero_()
    assert copy.any(), "a copy, not a view of the source"


def test_copies_sit_in_memory_advised_for_huge_pages_one_after_the_other(monkeypatch):
    monkeypatch.setattr(cpu_huge_pages, "_chunk", None)  # a fresh chunk: the small copies fit in it
    small = [cpu_huge_pages.copy_to_huge_pages(torch.ones(1000 + i, dtype=torch.uint8)) for i in range(3)]
    large = cpu_huge_pages.copy_to_huge_pages(torch.ones(cpu_huge_pages.CHUNK_BYTES + 1, dtype=torch.uint8))
    for tensor in (*small, large):
        assert tensor.data_ptr() % cpu_huge_pages.ALIGN == 0
        found = mapping_of(tensor.data_ptr())
        assert found is not None and "hg" in found[1], f"not advised for huge pages: {found}"
    # Small copies share a chunk (one mapping), back to back: 1000 bytes round up to 1024.
    assert len({mapping_of(t.data_ptr())[0] for t in small}) == 1
    assert small[1].data_ptr() - small[0].data_ptr() == 1024
    # The large copy has memory of its own, outside the small copies' chunk (Linux may list the two
    # mappings as one range in smaps where they happen to be adjacent).
    chunk = range(small[0].data_ptr(), small[0].data_ptr() + cpu_huge_pages.CHUNK_BYTES)
    assert large.data_ptr() + large.numel() <= chunk.start or large.data_ptr() >= chunk.stop


def test_a_chunk_is_unmapped_when_its_last_tensor_is_freed():
    large = cpu_huge_pages.copy_to_huge_pages(torch.ones(cpu_huge_pages.CHUNK_BYTES + 1, dtype=torch.uint8))
    address = large.data_ptr()
    half = large[: len(large) // 2]  # a view keeps the chunk as the tensor does
    del large
    gc.collect()
    assert mapping_of(address) is not None
    del half
    gc.collect()
    assert mapping_of(address) is None


def test_the_int8_kernels_weights_are_on_huge_pages():
    gen = torch.Generator().manual_seed(0)
    codes = pack_codes(torch.randint(0, 16, (32, 128), generator=gen), 4)
    scales = torch.rand(32, 4, generator=gen).to(torch.float16)
    tiled = cpu_int8_matmul.interleave(codes, scales, scales.clone(), bits=4, group_size=32)
    for tensor in tiled:
        assert "hg" in mapping_of(tensor.data_ptr())[1]
