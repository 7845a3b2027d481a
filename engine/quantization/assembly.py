"""Install a quantized model's matrices as their parts arrive from the checkpoint.

A model built with ``quantized=True`` has empty matrix slots (weight_targets.linear_slots); a
checkpoint delivers each slot's parts one tensor at a time (q, k and v for qkv_proj). Once a
slot has all its parts it is installed: as one QuantizedLinear when every part is packed in the
same format, or as a dense weight otherwise (a part the checkpoint stores unquantized, or parts
quantized differently, as mixed GGUF files do). Only the parts of unfinished slots are held, so a
load never holds more than a layer's worth of them.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from kvpilot.engine.checkpoint import ModelLoadError
from kvpilot.engine.models.weight_targets import LinearSlot
from kvpilot.engine.quantization.linear import QuantizedLinear
from kvpilot.engine.quantization.packed import PackedWeight

logger = logging.getLogger(__name__)


class LinearAssembler:
    def __init__(self, slots: dict[str, LinearSlot], dtype: torch.dtype, device: torch.device, source: str) -> None:
        self.slots = slots
        self.dtype = dtype
        self.device = device
        self.source = source
        # (owner id, attribute) -> the parts received so far, by part index
        self._pending: dict[tuple[int, str], dict[int, PackedWeight | torch.Tensor]] = {}
        self._filled: set[str] = set()
        self.installed: Counter[str] = Counter()  # "packed 4-bit" / "dense" -> matrices

    def add(self, module: str, part: PackedWeight | torch.Tensor) -> None:
        """``module``'s weight (packed, or a dense float tensor [out_features, in_features])."""
        slot = self.slots[module]
        if tuple(part.shape) != slot.shape:
            raise ModelLoadError(
                f"{self.source}: weight {module!r} has shape {tuple(part.shape)} but the model's config implies "
                f"{slot.shape}; the weights do not belong to this config"
            )
        if module in self._filled:
            raise ModelLoadError(f"{self.source}: weight {module!r} appears twice")
        self._filled.add(module)
        if isinstance(part, torch.Tensor):
            part = part.to(self.dtype)  # dense parts are kept in the model's dtype, not float32
        parts = self._pending.setdefault((id(slot.owner), slot.attribute), {})
        parts[slot.part] = part
        if len(parts) == slot.num_parts:
            del self._pending[(id(slot.owner), slot.attribute)]
            setattr(slot.owner, slot.attribute, self._build([parts[i] for i in range(slot.num_parts)]))

    def missing(self) -> list[str]:
        return sorted(set(self.slots) - self._filled)

    def _build(self, parts: list[PackedWeight | torch.Tensor]) -> QuantizedLinear | nn.Parameter:
        first = parts[0]
        if isinstance(first, PackedWeight) and all(isinstance(p, PackedWeight) and first.same_format(p) for p in parts):
            self.installed[f"packed {first.bits}-bit"] += 1
            return QuantizedLinear(PackedWeight.concat(parts), self.dtype, self.device)
        self.installed["dense"] += 1
        dense = [p.dequantize(self.dtype) if isinstance(p, PackedWeight) else p for p in parts]
        return nn.Parameter(torch.cat(dense).to(self.device), requires_grad=False)

    def log_summary(self) -> None:
        logger.info("%s: matrices installed: %s", self.source,
                    ", ".join(f"{count} {kind}" for kind, count in sorted(self.installed.items())))  # fmt: skip
