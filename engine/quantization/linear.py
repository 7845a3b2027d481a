"""A linear layer whose weight stays packed (4- or 8-bit codes), multiplied without a dense copy.

The route is chosen per call from where the activations are: the Triton dequantize-in-GEMM kernel
on CUDA (kvpilot.kernels.quant_matmul), the C kernel on the CPU (kvpilot.kernels.cpu_quant_matmul);
where neither runs (a CPU without a C compiler), the reference dequantizes and multiplies.
A packed token embedding is a QuantizedLinear too: ``embedding`` dequantizes just the rows looked up.
"""

from __future__ import annotations

import torch
from torch import nn

from kvpilot.engine.quantization.packed import PackedWeight
from kvpilot.kernels import cpu_quant_matmul
from kvpilot.kernels.quant_layout import quant_matmul_reference


class QuantizedLinear(nn.Module):
    def __init__(self, packed: PackedWeight, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.bits = packed.bits
        self.group_size = packed.group_size
        self.out_features, self.in_features = packed.shape
        self.dtype = dtype  # of activations and outputs (the model's dtype)
        packed = packed.to(device)
        self.register_buffer("codes", packed.codes)
        self.register_buffer("scales", packed.scales)
        self.register_buffer("offsets", packed.offsets)
        # The CPU kernel bound to these buffers once (checks and build paid at load, not per call).
        self._cpu_kernel = None
        if device.type == "cpu" and cpu_quant_matmul.usable(torch.empty(0, dtype=dtype), bits=self.bits,
                                                            group_size=self.group_size):
            self._cpu_kernel = cpu_quant_matmul.bind(self.codes, self.scales, self.offsets, bits=self.bits,
                                                     group_size=self.group_size, dtype=dtype)

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(self.bits, self.group_size, self.codes, self.scales, self.offsets)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        flat = x.reshape(-1, self.in_features)
        kw = {"bits": self.bits, "group_size": self.group_size}
        if self._cpu_kernel is not None and flat.dtype == self.dtype:
            out = self._cpu_kernel(flat)
        elif flat.device.type == "cuda":
            from kvpilot.kernels.quant_matmul import quant_matmul  # Triton: imported only where it runs

            out = quant_matmul(flat.contiguous(), self.codes, self.scales, self.offsets, **kw)
        else:
            out = quant_matmul_reference(flat, self.codes, self.scales, self.offsets, **kw)
        return out.view(*x.shape[:-1], self.out_features)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, in_features]: rows of the table
        return self.packed.rows(ids).dequantize(self.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}")  # fmt: skip
