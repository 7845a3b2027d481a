"""A group-quantized weight in kvpilot's packed layout (kvpilot.kernels.quant_layout's docstring).

Every quantized format kvpilot loads (AWQ's qweight/qzeros/scales, GGUF's Q4_0, Q4_1 and Q8_0
blocks) is converted into this one layout at load, tensor by tensor, and the kernels multiply
with it directly. The float weight it stands for is ``code * scale + offset`` per group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpilot.kernels.quant_layout import check_packed, dequantize, pack_codes


@dataclass(frozen=True)
class PackedWeight:
    bits: int  # 4 or 8
    group_size: int  # inputs sharing a scale (and offset): a multiple of 32
    codes: torch.Tensor  # 4 bits: [out_features, in_features // 2] uint8; 8 bits: [out_features, in_features] int8
    scales: torch.Tensor  # [out_features, in_features // group_size] float16
    offsets: torch.Tensor | None  # like scales for 4 bits; None for 8 bits (symmetric)

    def __post_init__(self) -> None:
        check_packed(self.codes, self.scales, self.offsets, bits=self.bits, group_size=self.group_size)

    @classmethod
    def from_codes(
        cls, values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, *, bits: int, group_size: int
    ) -> PackedWeight:
        """From integer codes [out, in] (0..15 for 4 bits, int8 for 8) and float [out, in // group] tables."""
        return cls(
            bits=bits,
            group_size=group_size,
            codes=pack_codes(values, bits),
            scales=scales.to(torch.float16).contiguous(),
            offsets=None if offsets is None else offsets.to(torch.float16).contiguous(),
        )

    @property
    def shape(self) -> tuple[int, int]:  # (out_features, in_features), like a dense weight's
        rows, columns = self.codes.shape
        return rows, columns * 2 if self.bits == 4 else columns

    @property
    def nbytes(self) -> int:
        tables = [self.codes, self.scales] + ([] if self.offsets is None else [self.offsets])
        return sum(t.numel() * t.element_size() for t in tables)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [out_features, in_features]
        return dequantize(self.codes, self.scales, self.offsets, bits=self.bits, group_size=self.group_size,
                          dtype=dtype)  # fmt: skip

    def rows(self, index: torch.Tensor) -> PackedWeight:
        """The weight of the output features ``index`` (a reordering or a subset)."""
        return PackedWeight(
            bits=self.bits,
            group_size=self.group_size,
            codes=self.codes[index].contiguous(),
            scales=self.scales[index].contiguous(),
            offsets=None if self.offsets is None else self.offsets[index].contiguous(),
        )

    def to(self, device: torch.device) -> PackedWeight:
        return PackedWeight(
            bits=self.bits,
            group_size=self.group_size,
            codes=self.codes.to(device),
            scales=self.scales.to(device),
            offsets=None if self.offsets is None else self.offsets.to(device),
        )

    def same_format(self, other: PackedWeight) -> bool:
        return (self.bits, self.group_size, self.shape[1]) == (other.bits, other.group_size, other.shape[1])

    @staticmethod
    def concat(parts: Sequence[PackedWeight]) -> PackedWeight:
        """Parts stacked along the output features (q, k, v into one qkv weight); same format required."""
        first = parts[0]
        if not all(first.same_format(p) for p in parts):
            raise ValueError("only weights of one bit width, group size and input size can be stacked")
        if len(parts) == 1:
            return first
        return PackedWeight(
            bits=first.bits,
            group_size=first.group_size,
            codes=torch.cat([p.codes for p in parts]),
            scales=torch.cat([p.scales for p in parts]),
            offsets=None if first.offsets is None else torch.cat([p.offsets for p in parts]),
        )
