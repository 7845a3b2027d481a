"""Weight-only quantized matmul on the CPU: the C kernel in cpu_quant_matmul.c, built on first use.

Same layout and result as the Triton kernel (kvpilot.kernels.quant_layout defines both); this is
the CPU's route, where Triton does not run. Built by cpu_build.py once per output dtype, bit width
and group size.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import NamedTuple

import torch

from kvpilot.kernels.cpu_build import DTYPE_CODES, KernelBuildError, load_library
from kvpilot.kernels.quant_layout import check_packed

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_quant_matmul.c")
__all__ = ["BoundKernel", "KernelBuildError", "bind", "cpu_quant_matmul", "load_kernel", "usable"]


def usable(x: torch.Tensor, *, bits: int, group_size: int) -> bool:
    """Whether the kernel runs for activations like x (CPU, a supported dtype, the kernel built)."""
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPE_CODES
        and load_kernel(x.dtype, bits=bits, group_size=group_size) is not None
    )


def cpu_quant_matmul(
    x: torch.Tensor,  # [M, K]
    codes: torch.Tensor,  # 4 bits: [N, K // 2] uint8; 8 bits: [N, K] int8
    scales: torch.Tensor,  # [N, K // group_size] float16
    offsets: torch.Tensor | None,  # [N, K // group_size] float16 (4 bits); None (8 bits)
    *,
    bits: int,
    group_size: int,
) -> torch.Tensor:  # [M, N] in x's dtype
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    return bind(codes, scales, offsets, bits=bits, group_size=group_size, dtype=x.dtype)(x)


def bind(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, *, bits: int, group_size: int,
    dtype: torch.dtype,
) -> BoundKernel:
    """The weight checked once and bound to its kernel: a callable [M, K] dtype -> [M, N] dtype.

    A model calls its linear layers hundreds of times a step; the checks are paid here, at load."""
    n, k = check_packed(codes, scales, offsets, bits=bits, group_size=group_size)
    if codes.device.type != "cpu":
        raise ValueError(f"codes must be on the CPU, got {codes.device}")
    kernel = load_kernel(dtype, bits=bits, group_size=group_size) if dtype in DTYPE_CODES else None
    if kernel is None:
        raise ValueError(f"no CPU quantized-matmul kernel for {dtype} activations; check usable() first")
    return BoundKernel(kernel, codes, scales, offsets, n, k, dtype, group_size)


class BoundKernel:
    __slots__ = ("_kernel", "_tensors", "_pointers", "n", "k", "dtype", "group_size")

    def __init__(self, kernel: Kernel, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                 n: int, k: int, dtype: torch.dtype, group_size: int) -> None:
        self._kernel = kernel
        self._tensors = (codes, scales, offsets)  # held: the kernel reads them through raw pointers
        self._pointers = (codes.data_ptr(), scales.data_ptr(), None if offsets is None else offsets.data_ptr())
        self.n, self.k, self.dtype, self.group_size = n, k, dtype, group_size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if x.shape[1:] != (self.k,) or x.dtype != self.dtype or x.device.type != "cpu":
            raise ValueError(f"x must be [M, {self.k}] {self.dtype} on the CPU, got {tuple(x.shape)} {x.dtype} "
                             f"{x.device}")
        m = x.shape[0]
        # [M, K], read by every output feature: as it is (bfloat16 builds) or converted to float32 once.
        x_in = x.contiguous() if self._kernel.x_bf16 else x.float().contiguous()
        out = torch.empty(m, self.n, dtype=self.dtype)
        if m:
            self._kernel.function(x_in.data_ptr(), *self._pointers, out.data_ptr(), m, self.n, self.k)
        return out


class Kernel(NamedTuple):
    function: ctypes._CFuncPtr
    x_bf16: bool  # the build reads bfloat16 x as it is (AVX-512 BF16); else float32 x


@functools.cache
def load_kernel(dtype: torch.dtype, *, bits: int, group_size: int) -> Kernel | None:
    """The kernel for this output dtype, bit width and group size; None (after one warning) when it
    cannot be built, in which case callers multiply through the reference."""
    try:
        library = load_library(SOURCE, {"DTYPE": DTYPE_CODES[dtype], "BITS": bits, "GROUP_SIZE": group_size})
    except KernelBuildError as exc:
        logger.warning("quantized matmul on the CPU falls back to dequantize-then-matmul (slower): %s", exc)
        return None
    function = library.kvpilot_quant_matmul
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    function.restype = None
    function.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64]  # x, codes, scales, offsets, out, m, n, k
    x_bf16 = bool(ctypes.c_int.in_dll(library, "kvpilot_quant_matmul_x_bf16").value)
    return Kernel(function, x_bf16)
