"""Install each of a model's matrices as its parts arrive from the checkpoint: the one place the
linear method of a layer is chosen (engine/linear.py).

A new CausalLM's projections are UnloadedLinear (weight_targets.linear_slots lists them); a
checkpoint delivers each one's parts one tensor at a time (q, k and v for qkv_proj). Once a
projection has all its parts it is installed: as one QuantizedLinear when packed weights are kept
and every part is packed in the same format, or as a DenseLinear otherwise (dense parts, packed
parts of a load that dequantizes, a part the checkpoint stores unquantized, or parts quantized
differently, as mixed GGUF files have). Only the parts of unfinished projections are held, so a
load never holds more than a layer's worth of them.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from kvpilot.engine.checkpoint import ModelLoadError
from kvpilot.engine.linear import DenseLinear, Linear
from kvpilot.engine.models.weight_targets import LinearSlot
from kvpilot.engine.quantization.linear import QuantizedLinear
from kvpilot.engine.quantization.packed import PackedWeight

logger = logging.getLogger(__name__)


class LinearAssembler:
    def __init__(self, slots: dict[str, LinearSlot], dtype: torch.dtype, device: torch.device, source: str, *,
                 keep_packed: bool) -> None:
        self.slots = slots
        self.dtype = dtype
        self.device = device
        self.source = source
        self.keep_packed = keep_packed  # False: packed parts are dequantized into the model's dtype
        # (owner id, attribute) -> the parts received so far, by part index
        self._pending: dict[tuple[int, str], dict[int, PackedWeight | torch.Tensor]] = {}
        self._filled: set[str] = set()
        self.installed: Counter[str] = Counter()  # "packed 4-bit" / "dense" -> matrices

    def add(self, module: str, part: PackedWeight | torch.Tensor) -> None:
        """``module``'s weight (packed, or a dense float tensor [out_features, in_features]); the
        loader has checked its shape against the slot's."""
        slot = self.slots[module]
        assert tuple(part.shape) == slot.shape, (module, tuple(part.shape), slot.shape)
        if module in self._filled:
            raise ModelLoadError(f"{self.source}: weight {module!r} appears twice")
        self._filled.add(module)
        if isinstance(part, torch.Tensor):
            part = part.to(self.dtype)  # dense parts are kept in the model's dtype, not float32
        parts = self._pending.setdefault((id(slot.owner), slot.attribute), {})
        parts[slot.part] = part
        if len(parts) == slot.num_parts:
            del self._pending[(id(slot.owner), slot.attribute)]
            unloaded: Linear = getattr(slot.owner, slot.attribute)
            setattr(slot.owner, slot.attribute, self._build([parts[i] for i in range(slot.num_parts)], unloaded))

    def missing(self) -> list[str]:
        """The HF weight names (``...q_proj.weight``) of the checkpoint modules that never arrived."""
        return sorted(f"{module}.weight" for module in set(self.slots) - self._filled)

    def _build(self, parts: list[PackedWeight | torch.Tensor], unloaded: Linear) -> Linear:
        first = parts[0]
        if self.keep_packed and isinstance(first, PackedWeight) and all(
                isinstance(p, PackedWeight) and first.same_format(p) for p in parts):
            self.installed[f"packed {first.bits}-bit"] += 1
            return QuantizedLinear(PackedWeight.concat(parts), self.dtype, self.device, unloaded.bias)
        self.installed["dense"] += 1
        dense = [p.dequantize(self.dtype) if isinstance(p, PackedWeight) else p for p in parts]
        return DenseLinear(torch.cat(dense).to(self.device), unloaded.bias)

    def log_summary(self) -> None:
        logger.info("%s: matrices installed: %s", self.source,
                    ", ".join(f"{count} {kind}" for kind, count in sorted(self.installed.items())))  # fmt: skip
