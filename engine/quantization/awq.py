"""AWQ's tensor layout (AutoAWQ's GEMM version, which transformers and vLLM load) to and from PackedWeight.

A linear layer ``name`` with in_features K, out_features N and group size G is stored as
- ``name.qweight`` [K, N // 8] int32: eight 4-bit codes per int32 along the output features,
  nibble i holding feature ``AWQ_ORDER[i]`` of its eight;
- ``name.qzeros`` [K // G, N // 8] int32: the zero points, packed the same way;
- ``name.scales`` [K // G, N] float16;
and stands for ``W[k, n] = (code - zero) * scale``, used as ``x @ W``. Our layout is W transposed
([N, K]) with ``offset = -zero * scale``.
"""

from __future__ import annotations

import torch

from kvpilot.engine.checkpoint import ModelLoadError
from kvpilot.engine.quantization.packed import PackedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble i sits at bit 4 * i
TENSOR_SUFFIXES = ("qweight", "qzeros", "scales")


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols // 8] int32 -> [rows, cols] int32 codes 0..15, features back in natural order."""
    nibbles = (packed[:, :, None] >> _SHIFTS) & 0xF  # [rows, cols // 8, 8], nibble order
    natural = torch.empty_like(nibbles)
    natural[:, :, list(AWQ_ORDER)] = nibbles  # nibble i is feature AWQ_ORDER[i]
    return natural.reshape(packed.shape[0], -1)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[rows, cols] codes 0..15 -> [rows, cols // 8] int32 in AWQ's nibble order."""
    rows, cols = codes.shape
    nibbles = codes.to(torch.int32).reshape(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)]
    # Summing disjoint bit fields is an OR; the top nibble lands in int32's sign bit, as AWQ stores it.
    words = (nibbles.to(torch.int64) << _SHIFTS.to(torch.int64)).sum(dim=-1)  # [rows, cols // 8], 0 .. 2**32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_to_packed(
    name: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, group_size: int,
    shape: tuple[int, int],
) -> PackedWeight:
    """One linear layer's AWQ tensors as a PackedWeight of ``shape`` (out_features, in_features)."""
    out_features, in_features = shape
    groups = in_features // group_size
    expected = {
        "qweight": ((in_features, out_features // 8), torch.int32, qweight),
        "qzeros": ((groups, out_features // 8), torch.int32, qzeros),
        "scales": ((groups, out_features), None, scales),
    }
    for suffix, (want, dtype, tensor) in expected.items():
        if tuple(tensor.shape) != want or (dtype is not None and tensor.dtype != dtype):
            raise ModelLoadError(
                f"AWQ tensor {name}.{suffix} has shape {tuple(tensor.shape)} ({tensor.dtype}); a [{out_features}, "
                f"{in_features}] layer with group_size {group_size} needs {want}"
                + ("" if dtype is None else f" {dtype}")
            )
    if in_features % group_size or out_features % 8:
        raise ModelLoadError(
            f"AWQ layer {name}: in_features {in_features} must be a multiple of group_size {group_size} and "
            f"out_features {out_features} of 8"
        )
    codes = unpack_int4(qweight).T  # [N, K]
    zeros = unpack_int4(qzeros).T.float()  # [N, K // G]
    scale = scales.T.float()  # [N, K // G]
    return PackedWeight.from_codes(codes, scale, -zeros * scale, bits=4, group_size=group_size)


def quantize_rtn(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """AWQ tensors (qweight, qzeros, scales) for a float weight [N, K] by round-to-nearest.

    Per group: scale = (max - min) / 15 and an integer zero point that puts min at code 0 (so 0.0
    is represented exactly when the group spans it); no activation-aware scaling search."""
    out_features, in_features = weight.shape
    grouped = weight.float().reshape(out_features, in_features // group_size, group_size)
    low = grouped.amin(dim=-1).clamp(max=0.0)
    high = grouped.amax(dim=-1).clamp(min=0.0)
    scales = ((high - low) / 15).clamp(min=1e-8).to(torch.float16).float()  # [N, K // G]
    zeros = (-low / scales).round().clamp(0, 15)
    codes = (grouped / scales[..., None]).round().add(zeros[..., None]).clamp(0, 15)
    return {
        "qweight": pack_int4(codes.reshape(out_features, in_features).T.contiguous()),
        "qzeros": pack_int4(zeros.T.contiguous()),
        "scales": scales.T.contiguous().to(torch.float16),
    }
