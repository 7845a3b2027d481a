"""CPU weights on transparent huge pages: fewer TLB misses while a decode step streams them.

At small decode batches a step reads every weight once from memory (SmolLM2's Q4_1 file: 96 MB a
token), so the packed matmuls run at the memory's bandwidth, and on 4 KiB pages every 4 KiB of
weights costs a TLB miss and a page walk. On 2 MiB pages that cost is gone: on the AVX-512 test
machine (2 cores) the 121 packed matmuls of one SmolLM2 token took 3.1 ms instead of 4.1 ms.

torch's allocator asks for huge pages only for tensors of 2 MiB and more (``THP_MEM_ALLOC_ENABLE``),
and a layer's weights are smaller. So the packed weights are copied into chunks of anonymous memory
advised ``MADV_HUGEPAGE``, one after the other, and each copy keeps its chunk mapped (through
``torch.frombuffer``) until the last tensor in it is freed. Linux backs the advised ranges with huge
pages where ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise`` (the
usual default) and free huge pages exist; elsewhere it is ordinary memory, as before.
"""

from __future__ import annotations

import mmap
import threading

import torch

CHUNK_BYTES = 64 << 20  # a chunk's size (larger tensors get a chunk of their own)
ALIGN = 64  # bytes: a cache line, which every CPU kernel's vector loads are happy with
__all__ = ["copy_to_huge_pages"]

_lock = threading.Lock()
_chunk: torch.Tensor | None = None  # [CHUNK_BYTES] uint8: the chunk copies go into now
_used = 0  # bytes of it taken


def copy_to_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor in memory advised for transparent huge pages (or, where the
    system cannot advise it, a plain contiguous copy)."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE") or nbytes == 0:
        return tensor.clone(memory_format=torch.contiguous_format)
    global _chunk, _used
    with _lock:
        if nbytes > CHUNK_BYTES:
            memory = _advised_chunk(nbytes)
        else:
            if _chunk is None or _used + nbytes > CHUNK_BYTES:
                _chunk, _used = _advised_chunk(CHUNK_BYTES), 0
            memory = _chunk[_used : _used + nbytes]
            _used = -(-(_used + nbytes) // ALIGN) * ALIGN
    copy = memory.view(tensor.dtype).view(tensor.shape)
    copy.copy_(tensor)
    return copy


def _advised_chunk(nbytes: int) -> torch.Tensor:  # [nbytes] uint8, untouched (pages come on first write)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        memory.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages: ordinary pages
        pass
    return torch.frombuffer(memory, dtype=torch.uint8)
