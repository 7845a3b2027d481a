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
    return BoundKernel(kernel, codes, scales, offsets, n, k, dtype)


class BoundKernel:
    __slots__ = ("_kernel", "_tensors", "_pointers", "n", "k", "dtype")

    def __init__(self, kernel: ctypes._CFuncPtr, codes: torch.Tensor, scales: torch.Tensor,
                 offsets: torch.Tensor | None, n: int, k: int, dtype: torch.dtype) -> None:
        self._kernel = kernel
        self._tensors = (codes, scales, offsets)  # held: the kernel reads them through raw pointers
        self._pointers = (codes.data_ptr(), scales.data_ptr(), None if offsets is None else offsets.data_ptr())
        self.n, self.k, self.dtype = n, k, dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if x.shape[1:] != (self.k,) or x.dtype != self.dtype or x.device.type != "cpu":
            raise ValueError(f"x must be [M, {self.k}] {self.dtype} on the CPU, got {tuple(x.shape)} {x.dtype} "
                             f"{x.device}")
        x32 = x.float().contiguous()  # [M, K]: converted once, read by every output feature
        out = torch.empty(x.shape[0], self.n, dtype=self.dtype)
        if x.shape[0]:
            self._kernel(x32.data_ptr(), *self._pointers, out.data_ptr(), x.shape[0], self.n, self.k)
        return out


@functools.cache
def load_kernel(dtype: torch.dtype, *, bits: int, group_size: int) -> ctypes._CFuncPtr | None:
    """The kernel for this output dtype, bit width and group size; None (after one warning) when it
    cannot be built, in which case callers multiply through the reference."""
    try:
        library = load_library(SOURCE, {"DTYPE": DTYPE_CODES[dtype], "BITS": bits, "GROUP_SIZE": group_size})
    except KernelBuildError as exc:
        logger.warning("quantized matmul on the CPU falls back to dequantize-then-matmul (slower): %s", exc)
        return None
    kernel = library.kvpilot_quant_matmul
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    kernel.restype = None
    kernel.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64]  # x, codes, scales, offsets, out, m, n, k
    return kernel
