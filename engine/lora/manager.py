"""The adapters an engine knows (read from disk, kept in host memory in the model's dtype) and the
``max_loras`` slots of the model they run from.

A sequence with an adapter runs only while its adapter sits in a slot: the scheduler asks
``assign_slot`` when it admits the sequence. An adapter already in a slot is reused; otherwise
it takes a free slot, or the least recently used slot that no running sequence needs, and the
scheduler leaves the sequence waiting when every slot is in use by running ones. Removing an
adapter stops new requests from naming it; sequences already holding it finish with it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from kvpilot.engine.lora.adapter import LoRAAdapter, LoRAError, LoRARequest, load_adapter
from kvpilot.engine.lora.layer import LoRALinear
from kvpilot.engine.models import CausalLM
from kvpilot.engine.models.weight_targets import linear_slots

if TYPE_CHECKING:
    from kvpilot.engine.request import Request

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: CausalLM, *, max_loras: int, max_rank: int) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = model.dtype
        # HF module name -> (the LoRALinear that now wraps its projection, its part there)
        self._targets: dict[str, tuple[LoRALinear, int]] = {}
        self._layers: list[LoRALinear] = []
        self.module_shapes: dict[str, tuple[int, int]] = {}
        by_projection: dict[tuple[int, str], list] = {}
        for module, slot in linear_slots(model).items():
            if module.startswith("model.layers."):  # not the embedding or the LM head
                by_projection.setdefault((id(slot.owner), slot.attribute), []).append((module, slot))
                self.module_shapes[module] = slot.shape
        device = next(iter(model.parameters())).device
        for parts in by_projection.values():
            parts.sort(key=lambda item: item[1].part)
            owner, attribute = parts[0][1].owner, parts[0][1].attribute
            wrapped = LoRALinear(getattr(owner, attribute), tuple(slot.shape[0] for _, slot in parts),
                                 max_loras=max_loras, max_rank=max_rank, dtype=self.dtype, device=device)
            setattr(owner, attribute, wrapped)
            self._layers.append(wrapped)
            for module, slot in parts:
                self._targets[module] = (wrapped, slot.part)
        self._adapters: dict[str, LoRAAdapter] = {}  # by name
        self._slots: list[LoRAAdapter | None] = [None] * max_loras
        self._last_used = [0] * max_loras
        self._clock = 0
        self.num_slot_loads = 0

    # ------------------------------------------------------------------ the adapters known

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check the adapter (once per name); a name already known from the same folder
        returns the adapter loaded then (two callers racing to load one adapter both succeed)."""
        known = self._adapters.get(request.lora_name)
        if known is not None:
            if known.request.lora_path != request.lora_path:
                raise LoRAError(
                    f"adapter {request.lora_name!r} is already loaded from {known.request.lora_path} "
                    f"(id {known.request.lora_int_id}); unload it before loading another under that name"
                )
            return known
        for adapter in self._adapters.values():
            if adapter.request.lora_int_id == request.lora_int_id:
                raise LoRAError(
                    f"adapter {request.lora_name!r}: lora_int_id {request.lora_int_id} is already "
                    f"{adapter.name!r}'s; give each adapter its own id"
                )
        adapter = load_adapter(request, self.module_shapes, max_rank=self.max_rank, dtype=self.dtype)
        self._adapters[request.lora_name] = adapter
        logger.info("LoRA adapter %r loaded from %s: rank %d, %d modules, %.1f MiB", adapter.name,
                    request.lora_path, adapter.rank, len(adapter.weights), adapter.nbytes / 2**20)
        return adapter

    def remove(self, name: str) -> LoRAAdapter:
        adapter = self._adapters.pop(name, None)
        if adapter is None:
            raise LoRAError(f"adapter {name!r} is not loaded; loaded: {', '.join(self._adapters) or 'none'}")
        return adapter

    def get(self, name: str) -> LoRAAdapter | None:
        return self._adapters.get(name)

    @property
    def adapters(self) -> list[LoRAAdapter]:
        return list(self._adapters.values())

    # ------------------------------------------------------------------ slots

    def assign_slot(self, request: Request, running: Iterable[Request]) -> bool:
        """Give ``request`` (which has an adapter) the slot its adapter sits in, loading the adapter
        into a slot no running sequence needs if it sits in none; False when every slot is needed."""
        adapter = request.lora
        assert adapter is not None
        self._clock += 1
        for slot, resident in enumerate(self._slots):
            if resident is adapter:
                self._last_used[slot] = self._clock
                request.lora_slot = slot
                return True
        needed = {r.lora_slot for r in running if r.lora_slot is not None}
        free = [slot for slot in range(self.max_loras) if slot not in needed]
        if not free:
            return False
        slot = min(free, key=lambda s: (self._slots[s] is not None, self._last_used[s]))
        self._load_slot(slot, adapter)
        self._last_used[slot] = self._clock
        request.lora_slot = slot
        return True

    def _load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        parts: dict[LoRALinear, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, pair in adapter.weights.items():
            layer, part = self._targets[module]
            parts.setdefault(layer, {})[part] = pair
        for layer in self._layers:
            layer.set_slot(slot, parts.get(layer, {}), adapter.rank)
        self._slots[slot] = adapter
        self.num_slot_loads += 1
