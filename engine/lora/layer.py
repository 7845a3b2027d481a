"""LoRA on top of a projection: ``LoRALinear`` wraps the layer's own linear method (dense or
packed) and adds each row's ``x·Aᵀ·Bᵀ`` for the adapter that row runs with.

Every row of a step's flat batch belongs to one sequence, and each sequence runs with no adapter or
with the adapter in one of ``max_loras`` slots; ``LoRAMapping`` says which slot each row has.
A projection holds every slot's A and B stacked, so a batch that mixes adapters costs two dense
matmuls whatever the mix: the shrink multiplies each row with every slot's A (x·A_allᵀ, a few
hundred columns), a mask keeps each row's own slot's columns, and the expand multiplies with every
slot's B (both prepacked for oneDNN on CPUs where the base weights are). The slots a row does not
use cost FLOPs, but no gather or scatter, which on a CPU cost far more (torch's index_add in
bfloat16 took ~2.7 ms a call, 68% of a mixed step). On CUDA one pair of
Triton kernels gathers each row's adapter by slot instead (kvpilot/kernels/lora_bgmv.py, Punica's
BGMV).

A fused projection (q/k/v, gate/up) stacks its parts: part p of an adapter with rank r sits in
A's rows and B's columns ``[p·r, (p+1)·r)`` of its slot, B's rows being that part's outputs, so
one matmul pair covers all parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpilot.engine.linear import DenseLinear, Linear


@dataclass(frozen=True)
class LoRAMapping:
    """Which adapter slot each row of a step's batch runs with."""

    row_slots: torch.Tensor  # [num_rows] int32 on the batch's device; -1: the base model alone
    single_slot: int | None  # the slot of every row, when they all share one
    # (num_slots, width, dtype) -> [num_rows, num_slots * width]: 1 in the columns of each row's slot
    _masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_row_slots(cls, row_slots: list[int | None], device: torch.device) -> LoRAMapping | None:
        """``row_slots``: each row's slot (None: the base model alone). None when no row has one."""
        used = {slot for slot in row_slots if slot is not None}
        if not used:
            return None
        single = next(iter(used)) if len(used) == 1 and None not in row_slots else None
        slots = torch.tensor([-1 if s is None else s for s in row_slots], dtype=torch.int32, device=device)
        return cls(slots, single)

    def mask(self, num_slots: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """Built once per step for each width the projections have, then shared by every layer."""
        key = (num_slots, width, dtype)
        if key not in self._masks:
            slots = torch.arange(num_slots, dtype=torch.int32, device=self.row_slots.device)
            own = (self.row_slots[:, None] == slots[None, :]).to(dtype)  # [num_rows, num_slots]
            self._masks[key] = own.repeat_interleave(width, dim=1)  # [num_rows, num_slots * width]
        return self._masks[key]


class LoRALinear(Linear):
    def __init__(self, base: Linear, part_sizes: tuple[int, ...], *, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        """``part_sizes``: the output features of each part stacked in ``base`` (q, k, v of qkv_proj)."""
        assert sum(part_sizes) == base.out_features, (part_sizes, base.out_features)
        super().__init__(base.out_features, base.in_features, None)  # the base adds its own bias
        self.base = base
        self.part_offsets = [0]
        for size in part_sizes:
            self.part_offsets.append(self.part_offsets[-1] + size)
        width = len(part_sizes) * max_rank
        # Slot s's A in lora_a[s] and its B in lora_b[:, s]: every slot's A is one [slots·width, in]
        # matrix and every slot's B one [out, slots·width] matrix, without a copy.
        self.lora_a = torch.zeros(max_loras, width, base.in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(base.out_features, max_loras, width, dtype=dtype, device=device)
        # Per slot: the columns of A·B its adapter uses (parts × its rank); 0 when it leaves this projection alone.
        self.widths = [0] * max_loras
        self.widths_on_device = torch.zeros(max_loras, dtype=torch.int32, device=device)  # what the kernel reads
        # The stacked matrices as linear methods of their own, so a CPU multiplies them with the same
        # prepacked kernels as the base weights (re-packed whenever a slot changes).
        self._shrink = DenseLinear(self.lora_a.view(max_loras * width, base.in_features), None)
        self._expand = DenseLinear(self.lora_b.view(base.out_features, max_loras * width), None)
        self._packed_for: int | None = None  # the batch size hint they are packed for, once packed

    @property
    def layout(self) -> str:  # type: ignore[override]
        return self.base.layout

    def __call__(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        y = self.base(x)  # [num_tokens, out_features]
        if lora is None or not any(self.widths):
            return y
        if y.is_cuda:
            from kvpilot.kernels.lora_bgmv import lora_bgmv  # Triton loads only where it runs (no CPU start-up cost)

            lora_bgmv(x, y, self.lora_a, self.lora_b.transpose(0, 1), lora.row_slots, self.widths_on_device)
            return y
        num_slots, width, _ = self.lora_a.shape
        shrunk = self._shrink(x)  # [num_tokens, slots·width]: every slot's A
        if lora.single_slot is None or num_slots > 1:
            shrunk.mul_(lora.mask(num_slots, width, shrunk.dtype))  # each row keeps its own slot's columns
        return y.add_(self._expand(shrunk))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x)

    def pack_for_cpu(self, batch_size_hint: int, *, embedding: bool = False) -> bool:
        self._packed_for = batch_size_hint
        for stacked in (self._shrink, self._expand):
            stacked.pack_for_cpu(batch_size_hint, embedding=True)  # embedding: keep reading the master tensors
        return self.base.pack_for_cpu(batch_size_hint, embedding=embedding)

    @property
    def nbytes(self) -> int:
        return self.base.nbytes

    def set_slot(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]], rank: int) -> None:
        """Put an adapter in ``slot``: ``parts`` maps a part index to its (A [rank, in], B·scale
        [part's out, rank]); parts it leaves out stay zero. An empty ``parts`` clears the slot."""
        self.lora_a[slot].zero_()
        self.lora_b[:, slot].zero_()
        for part, (a, b) in parts.items():
            columns = slice(part * rank, (part + 1) * rank)
            self.lora_a[slot, columns] = a
            self.lora_b[self.part_offsets[part] : self.part_offsets[part + 1], slot, columns] = b
        self.widths[slot] = (len(self.part_offsets) - 1) * rank if parts else 0
        self.widths_on_device[slot] = self.widths[slot]
        if self._packed_for is not None:
            for stacked in (self._shrink, self._expand):
                stacked.pack_for_cpu(self._packed_for, embedding=True)
