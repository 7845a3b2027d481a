"""The linear method: how one projection of the model multiplies, chosen once per layer at load.

The model calls ``proj(x)`` for each projection (q/k/v, o, gate/up, down, the LM head) and never
asks what kind of weight it holds. Each kind is a ``Linear``:
- ``DenseLinear``: a float weight in the model's dtype (moved into oneDNN's blocked layout by
  ``pack_for_cpu`` on CPUs where that is faster);
- ``QuantizedLinear`` (engine/quantization/linear.py): 4- or 8-bit codes multiplied without a
  dense copy;
- ``UnloadedLinear``: a projection's shape and bias before the loader installs its weight
  (engine/models/linear_assembly.py picks the kind per layer from what the checkpoint holds).
A LoRA adapter plugs in as one more ``Linear`` wrapping the layer's own: its forward adds each
row's x·A·B·scale to the base's output, and the other methods pass through to the base.

The token embedding is a ``Linear`` too (``embedding`` reads rows of the table), because a tied
LM head multiplies with the same table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels import cpu_features

if TYPE_CHECKING:
    from kvpilot.engine.lora.layer import LoRAMapping


class Linear(nn.Module):
    """y = x·Wᵀ + b for one projection; each subclass holds W its own way."""

    # How W is stored: "dense" for a float weight, else the packed layout's name (a plain attribute,
    # not a property: QuantizedLinear reads and changes its own on every call's path).
    layout = "dense"

    def __init__(self, out_features: int, in_features: int, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.out_features = out_features
        self.in_features = in_features
        self.bias = bias  # [out_features] in the model's dtype, or None

    def __call__(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        # Straight to forward, past nn.Module's hook machinery: a decode step makes ~120 of these
        # calls, and nothing sets hooks on them. ``lora``: which rows run with which adapter, read
        # by the LoRA wrapper (engine/lora/layer.py) and by nothing else.
        return self.forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        raise NotImplementedError

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, in_features]: rows of W
        raise NotImplementedError(f"{type(self).__name__} is not a token embedding")

    def pack_for_cpu(self, batch_size_hint: int, *, embedding: bool = False) -> bool:
        """Move the weight, once, into the layout of the fastest kernel this CPU runs for it; returns
        whether it moved. ``embedding``: the weight is also the token embedding, whose rows must stay
        readable. Weights on other devices stay as they are."""
        return False

    @property
    def nbytes(self) -> int:  # of W as held (the bias not counted)
        raise NotImplementedError


class DenseLinear(Linear):
    def __init__(self, weight: torch.Tensor, bias: nn.Parameter | None) -> None:
        super().__init__(weight.shape[0], weight.shape[1], bias)
        self.weight: nn.Parameter | None = nn.Parameter(weight, requires_grad=False)  # [out, in], model dtype
        # W in oneDNN's blocked layout once pack_for_cpu moved it; forward multiplies with it instead.
        self.onednn_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def pack_for_cpu(self, batch_size_hint: int, *, embedding: bool = False) -> bool:
        """A bfloat16 weight goes into oneDNN's blocked layout where oneDNN can reorder bfloat16
        (AVX-512 BW/VL/DQ or AVX-NE-CONVERT, kvpilot.kernels.cpu_features): decode-sized matmuls get
        markedly faster (the AMX kernels otherwise re-pack the weight on every call). Other dtypes,
        and a torch built without oneDNN, keep the plain weight."""
        weight = self.weight
        if (weight is None or weight.device.type != "cpu" or weight.dtype != torch.bfloat16
                or not torch.backends.mkldnn.is_available() or not cpu_features.detect().onednn_bf16_prepack):
            return False
        self.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)
        if not embedding:
            self.weight = None  # only the blocked copy is read from now on
        return True

    @property
    def nbytes(self) -> int:
        held = self.onednn_weight if self.weight is None else self.weight
        return held.numel() * held.element_size()


class UnloadedLinear(Linear):
    """A projection before the loader installs its weight: its shape, and its bias (uninitialised,
    filled by the loader like the norms), which the installed Linear takes over."""

    def __init__(self, out_features: int, in_features: int, *, bias: bool, dtype: torch.dtype,
                 device: torch.device) -> None:
        vector = torch.empty(out_features, dtype=dtype, device=device) if bias else None
        super().__init__(out_features, in_features,
                         None if vector is None else nn.Parameter(vector, requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this projection's weight was never loaded (engine/models/linear_assembly.py installs it)")

    @property
    def nbytes(self) -> int:
        return 0
