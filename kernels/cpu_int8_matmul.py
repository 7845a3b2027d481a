"""Quantized weights times int8 activations on the CPU: the C kernel in cpu_int8_matmul.c.

For float32 and bfloat16 models with 4- or 8-bit weights: x is quantized to int8 per run of 32
inputs inside the call and multiplied in integers, with AVX-512 VNNI's VPDPBUSD (64 products an
instruction) or AVX2's VPMADDUBSW (32), several times the products per instruction of the float32
or bfloat16 dot products that bound the other kernels at decode batch sizes. The result differs
from ``quant_matmul_reference`` by the rounding of x to 8 bits (about 0.5 % relative, like
llama.cpp's 8-bit activations): it is the dequantized weight times the rounded x, to float32
rounding (tests/kernels/test_quant_matmul.py).

The kernel reads its own layout (``interleave``; cpu_int8_matmul.c's comment), the same for both
instruction sets; ``rows`` reads output features back in kvpilot's layout (a packed token
embedding's lookup). Built by cpu_build.py once per bit width and group size, for the instruction
set ``CpuFeatures.int8_matmul_isa`` names; on CPUs with neither ``load_kernel`` returns None.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import NamedTuple

import torch

from kvpilot.kernels import cpu_features
from kvpilot.kernels.cpu_build import KernelBuildError, load_in_background, load_library
from kvpilot.kernels.cpu_huge_pages import copy_to_huge_pages
from kvpilot.kernels.quant_layout import CHUNK, check_packed, unpack_codes

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_int8_matmul.c")
FEATURE_TILE = 16  # output features per work item; N must be a multiple
# 8-bit codes are stored as code + 128: VPDPBUSD's weight operand is unsigned (the AVX2 path undoes it in registers)
BIAS_8BIT = 128
DTYPES = (torch.float32, torch.bfloat16)  # of x and out, chosen per call
__all__ = ["DTYPES", "Int8Kernel", "Kernel", "interleave", "load_kernel", "load_kernel_in_background", "rows"]


def interleave(
    codes: torch.Tensor,  # kvpilot's layout (quant_layout): 4 bits [N, K // 2] uint8, 8 bits [N, K] int8
    scales: torch.Tensor,  # [N, K // group_size] float16
    offsets: torch.Tensor | None,  # [N, K // group_size] float16 (4 bits); None (8 bits)
    *,
    bits: int,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The same weight in the kernel's layout: codes [N / 16, K / 32, 4 (4 bits) or 8 (8 bits), 16, 4]
    uint8, scales and offsets [N / 16, K / group_size, 16] float16. As many bytes as before, on
    transparent huge pages (cpu_huge_pages.py: the kernel streams them at small batches)."""
    n, k = check_packed(codes, scales, offsets, bits=bits, group_size=group_size)
    if n % FEATURE_TILE:
        raise ValueError(f"out_features ({n}) must be a multiple of {FEATURE_TILE}")
    values = unpack_codes(codes, bits)  # [N, K]
    if bits == 4:
        values = values.view(n // FEATURE_TILE, FEATURE_TILE, k // CHUNK, 2, 4, 4)  # tile f run half j q
        tiled = (values[:, :, :, 0] | (values[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)  # tile run j f q
    else:
        values = (values.view(torch.uint8) ^ BIAS_8BIT).view(n // FEATURE_TILE, FEATURE_TILE, k // CHUNK, 8, 4)
        tiled = values.permute(0, 2, 3, 1, 4)  # tile run j f q

    def per_tile(table: torch.Tensor) -> torch.Tensor:  # [N, groups] -> [N / 16, groups, 16]
        return copy_to_huge_pages(table.view(n // FEATURE_TILE, FEATURE_TILE, -1).transpose(1, 2))

    return copy_to_huge_pages(tiled), per_tile(scales), None if offsets is None else per_tile(offsets)


def rows(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, index: torch.Tensor, *, bits: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Output features ``index`` [n] of an interleaved weight, back in kvpilot's layout: (codes
    [n, K // 2] uint8 or [n, K] int8, scales, offsets [n, groups] float16)."""
    tile, feature = index // FEATURE_TILE, index % FEATURE_TILE
    picked = codes[tile, :, :, feature, :].reshape(len(index), -1)  # [n, K // 2] (4 bits) or [n, K]
    if bits == 8:
        picked = (picked ^ BIAS_8BIT).view(torch.int8)
    # Byte 4 * j + q of a 4-bit run holds inputs 4j+q and 16+4j+q: kvpilot's run order already.
    return (picked.contiguous(), scales[tile, :, feature].contiguous(),
            None if offsets is None else offsets[tile, :, feature].contiguous())


class Kernel(NamedTuple):
    function: ctypes._CFuncPtr
    isa: str  # what the build multiplies with: "avx512_vnni" or "avx2" (CpuFeatures.int8_matmul_isa)


class Int8Kernel:
    """An interleaved weight bound to its kernel: a callable [M, K] dtype -> [M, N] dtype."""

    __slots__ = ("function", "_tensors", "pointers", "_bf16", "dtype", "n", "k")

    def __init__(self, kernel: Kernel, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"the int8-activation kernel takes float32 or bfloat16 x, not {dtype}")
        self.function = kernel.function
        self._tensors = (codes, scales, offsets)  # held: the kernel reads them through raw pointers
        self.pointers = tuple(None if t is None else t.data_ptr() for t in self._tensors)  # codes, scales, offsets
        self._bf16 = int(dtype == torch.bfloat16)
        self.dtype = dtype
        self.n = codes.shape[0] * FEATURE_TILE
        self.k = codes.shape[1] * CHUNK

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        # Called ~120 times a decode step: the checks are the few that keep the raw pointers safe.
        if x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != self.k or x.device.type != "cpu":
            raise ValueError(f"x must be [M, {self.k}] {self.dtype} on the CPU, got {tuple(x.shape)} {x.dtype} "
                             f"{x.device}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.n, dtype=self.dtype)
        if self.function(x.data_ptr(), *self.pointers, out.data_ptr(), x.shape[0], self.n, self.k, self._bf16):
            raise MemoryError(f"no memory for {x.shape[0]} x {self.k} activations quantized to int8")
        return out


@functools.cache
def load_kernel_in_background(bits: int, group_size: int) -> None:
    """``load_kernel`` on cpu_build's background thread, once per format: called as weights of this
    format load, so that packing them finds the kernel compiled (a new pod has none cached)."""
    load_in_background(load_kernel, bits, group_size)


@functools.cache
def load_kernel(bits: int, group_size: int) -> Kernel | None:
    """The kernel for this bit width and group size; None where it cannot be built (neither AVX-512
    VNNI/BF16 nor AVX2/FMA, or no compiler)."""
    features = cpu_features.detect()
    if features.int8_matmul_isa is None:
        logger.info("quantized matmuls without int8 activations (the CPU lacks AVX-512 VNNI+BF16 and AVX2+FMA: %s)",
                    features.summary())
        return None
    try:
        library = load_library(SOURCE, {"BITS": bits, "GROUP_SIZE": group_size})
    except KernelBuildError as exc:
        logger.info("quantized matmuls without int8 activations (%s)", str(exc).splitlines()[-1])
        return None
    function = library.kvpilot_int8_matmul
    function.restype = ctypes.c_int
    # x, codes, scales, offsets, out, m, n, k, bf16
    function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    isa = ctypes.string_at(ctypes.addressof(ctypes.c_char.in_dll(library, "kvpilot_int8_matmul_isa"))).decode()
    logger.info("quantized matmuls with int8 activations (%s, %d bits, group size %d)", isa, bits, group_size)
    return Kernel(function, isa)
