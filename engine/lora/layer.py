"""LoRA on top of a projection: ``LoRALinear`` wraps the layer's own linear method (dense or
packed) and adds each row's ``x·Aᵀ·Bᵀ`` for the adapter that row runs with.

Every row of a step's flat batch belongs to one sequence, and each sequence runs with no adapter or
with the adapter in one of ``max_loras`` slots; ``LoRAMapping`` says which rows go with which
slot. Slots hold A and B in one tensor per projection, so a batch that mixes adapters costs one
shrink (x·Aᵀ) and one expand (·Bᵀ) matmul per slot present, over that slot's rows (the grouped
form of Punica's SGMV, in torch); on CUDA one pair of Triton kernels gathers each row's adapter
by slot (kvpilot/kernels/lora_bgmv.py, Punica's BGMV). A fused projection (q/k/v, gate/up) stacks its parts: part p of
an adapter with rank r sits in A's rows and B's columns ``[p·r, (p+1)·r)``, B's rows being that
part's outputs, so one matmul pair covers all parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.engine.linear import Linear


@dataclass(frozen=True)
class LoRAMapping:
    """Which rows of a step's batch run with which adapter slot: (slot, rows) per slot present,
    rows being None when every row of the batch has that slot; and each row's slot (-1: none)."""

    groups: tuple[tuple[int, torch.Tensor | None], ...]
    row_slots: torch.Tensor  # [num_rows] int32 on the batch's device

    @classmethod
    def from_row_slots(cls, row_slots: list[int | None], device: torch.device) -> LoRAMapping | None:
        """``row_slots``: each row's slot (None: the base model alone). None when no row has one."""
        used = sorted({slot for slot in row_slots if slot is not None})
        if not used:
            return None
        slots = torch.tensor([-1 if s is None else s for s in row_slots], dtype=torch.int32, device=device)
        if len(used) == 1 and None not in row_slots:
            return cls(((used[0], None),), slots)
        groups = []
        for slot in used:
            rows = [i for i, s in enumerate(row_slots) if s == slot]
            groups.append((slot, torch.tensor(rows, dtype=torch.int64, device=device)))
        return cls(tuple(groups), slots)


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
        self.lora_a = torch.zeros(max_loras, width, base.in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, base.out_features, width, dtype=dtype, device=device)
        # Per slot: the columns of A·B its adapter uses (parts × its rank); 0 when it leaves this projection alone.
        self.widths = [0] * max_loras
        self.widths_on_device = torch.zeros(max_loras, dtype=torch.int32, device=device)  # what the kernel reads

    @property
    def layout(self) -> str:  # type: ignore[override]
        return self.base.layout

    def __call__(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        y = self.base(x)  # [num_tokens, out_features]
        if lora is None:
            return y
        if y.is_cuda:
            from kvpilot.kernels.lora_bgmv import lora_bgmv  # Triton loads only where it runs (no CPU start-up cost)

            lora_bgmv(x, y, self.lora_a, self.lora_b, lora.row_slots, self.widths_on_device)
            return y
        for slot, rows in lora.groups:
            width = self.widths[slot]
            if width == 0:
                continue
            a = self.lora_a[slot, :width]  # [width, in_features]
            b = self.lora_b[slot, :, :width]  # [out_features, width]
            if rows is None:
                y.addmm_(x @ a.T, b.T)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x)

    def pack_for_cpu(self, batch_size_hint: int, *, embedding: bool = False) -> bool:
        return self.base.pack_for_cpu(batch_size_hint, embedding=embedding)

    @property
    def nbytes(self) -> int:
        return self.base.nbytes

    def set_slot(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]], rank: int) -> None:
        """Put an adapter in ``slot``: ``parts`` maps a part index to its (A [rank, in], B·scale
        [part's out, rank]); parts it leaves out stay zero. An empty ``parts`` clears the slot."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for part, (a, b) in parts.items():
            columns = slice(part * rank, (part + 1) * rank)
            self.lora_a[slot, columns] = a
            self.lora_b[slot, self.part_offsets[part] : self.part_offsets[part + 1], columns] = b
        self.widths[slot] = (len(self.part_offsets) - 1) * rank if parts else 0
        self.widths_on_device[slot] = self.widths[slot]
