"""kvpilot's packed layout for weight-only quantized matmuls, and the matmul's definition.

For W [out_features N, in_features K], K a multiple of 32, in groups of ``group_size`` consecutive
inputs (a multiple of 32):

- 4 bits: ``codes`` [N, K // 2] uint8. Each run of 32 inputs is 16 bytes; byte i holds input i
  in its low nibble and input i + 16 in its high nibble (GGUF's Q4_0/Q4_1 block order, which
  unpacks into two contiguous halves). ``W = code * scale + offset``.
- 8 bits: ``codes`` [N, K] int8, ``W = code * scale`` (GGUF's Q8_0; no offset).

``scales`` and ``offsets`` are [N, K // group_size] float16. The kernels (quant_matmul.py on
CUDA, cpu_quant_matmul.py on the CPU) compute ``quant_matmul_reference``: dequantize, multiply in
float32, round once. No Triton here, so the CPU path never imports it.
"""

from __future__ import annotations

import torch

CHUNK = 32  # inputs per nibble run (16 bytes) in the 4-bit layout
BITS = (4, 8)


def check_packed(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, *, bits: int, group_size: int
) -> tuple[int, int]:
    """(N, K) of a packed weight; ValueError naming what does not fit the layout."""
    if bits not in BITS:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if group_size < CHUNK or group_size % CHUNK:
        raise ValueError(f"group_size must be a positive multiple of {CHUNK}, got {group_size}")
    if codes.dim() != 2 or not codes.is_contiguous():
        raise ValueError(f"codes must be a contiguous 2-D tensor, got {tuple(codes.shape)}")
    expected_dtype = torch.uint8 if bits == 4 else torch.int8
    if codes.dtype != expected_dtype:
        raise ValueError(f"{bits}-bit codes must be {expected_dtype}, got {codes.dtype}")
    n = codes.shape[0]
    k = codes.shape[1] * 2 if bits == 4 else codes.shape[1]
    if k % group_size:
        raise ValueError(f"in_features ({k}) must be a multiple of group_size ({group_size})")
    groups = (n, k // group_size)
    for name, table in (("scales", scales), ("offsets", offsets)):
        if table is None:
            continue
        if tuple(table.shape) != groups or table.dtype != torch.float16 or not table.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous {list(groups)} float16, got {tuple(table.shape)} {table.dtype}"
            )
    if (offsets is None) != (bits == 8):
        raise ValueError("4-bit weights need offsets and 8-bit weights have none")
    return n, k


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The integer codes [N, K] (uint8 0..15 for 4 bits, int8 for 8 bits) of a packed weight."""
    if bits == 8:
        return codes
    n = codes.shape[0]
    runs = codes.view(n, -1, CHUNK // 2)  # [N, K // 32, 16]
    return torch.cat((runs & 0xF, runs >> 4), dim=-1).view(n, -1)


def pack_codes(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes [N, K] (0..15 for 4 bits, -128..127 for 8) into the packed layout; K a multiple of 32."""
    if bits == 8:
        return values.to(torch.int8).contiguous()
    n, k = values.shape
    if k % CHUNK:
        raise ValueError(f"4-bit packing needs in_features to be a multiple of {CHUNK}, got {k}")
    runs = values.to(torch.uint8).view(n, k // CHUNK, CHUNK)
    return (runs[..., : CHUNK // 2] | (runs[..., CHUNK // 2 :] << 4)).reshape(n, k // 2).contiguous()


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, *, bits: int, group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [N, K]
    """The weight the packed codes stand for, computed in float32 and rounded once to dtype."""
    values = unpack_codes(codes, bits).float()  # [N, K]
    n, k = values.shape
    grouped = values.view(n, k // group_size, group_size) * scales.float()[..., None]
    if offsets is not None:
        grouped += offsets.float()[..., None]
    return grouped.view(n, k).to(dtype)


def quant_matmul_reference(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, *,
    bits: int, group_size: int,
) -> torch.Tensor:
    """The definition: dequantize to float32, multiply in float32, round to x's dtype."""
    weight = dequantize(codes, scales, offsets, bits=bits, group_size=group_size)
    return (x.float() @ weight.T).to(x.dtype)
