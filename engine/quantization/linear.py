"""A linear layer whose weight stays packed (4- or 8-bit codes), multiplied without a dense copy.

The route is chosen per call from where the activations are: the Triton dequantize-in-GEMM kernel
on CUDA (kvpilot.kernels.quant_matmul), the C kernel on the CPU (kvpilot.kernels.cpu_quant_matmul);
where neither runs (a CPU without a C compiler), the reference dequantizes and multiplies.
``repack_for_torch_cpu`` (called by CausalLM.pack_weights_for_cpu for bfloat16 models) moves a 4-bit
weight into the layout of torch's own int4 CPU kernel (``aten._weight_int4pack_mm_for_cpu``), which
blocks registers across output features and is faster than the C kernel at every decode batch size.
A packed token embedding is a QuantizedLinear too: ``embedding`` dequantizes just the rows looked up.
"""

from __future__ import annotations

import torch
from torch import nn

from kvpilot.engine.quantization.packed import PackedWeight
from kvpilot.kernels import cpu_quant_matmul
from kvpilot.kernels.quant_layout import quant_matmul_reference, unpack_codes


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
        self.register_buffer("scales_and_zeros", None)  # set by repack_for_torch_cpu
        # The CPU kernel bound to these buffers once (checks and build paid at load, not per call).
        self._cpu_kernel = None
        if device.type == "cpu" and cpu_quant_matmul.usable(torch.empty(0, dtype=dtype), bits=self.bits,
                                                            group_size=self.group_size):
            self._cpu_kernel = cpu_quant_matmul.bind(self.codes, self.scales, self.offsets, bits=self.bits,
                                                     group_size=self.group_size, dtype=dtype)

    @property
    def torch_int4(self) -> bool:
        """Whether the codes are in torch's int4 layout (after repack_for_torch_cpu), not kvpilot's."""
        return self.scales_and_zeros is not None

    @property
    def packed(self) -> PackedWeight:
        if self.torch_int4:
            raise RuntimeError("this weight was repacked into torch's int4 layout (repack_for_torch_cpu)")
        return PackedWeight(self.bits, self.group_size, self.codes, self.scales, self.offsets)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def repack_for_torch_cpu(self) -> bool:
        """Hold a 4-bit CPU weight in torch's int4 layout instead of kvpilot's (same bytes of codes).

        torch dequantizes ``(code - 8) * scale + zero`` per group, so ``zero = offset + 8 * scale``
        (kept, like the scale, in the activations' dtype). Returns False, changing nothing, where
        torch's kernel does not apply: 8-bit codes, another device, out_features not a multiple of
        16, or a torch without the op. A weight also used as the token embedding must not be
        repacked (``embedding`` reads kvpilot's layout).
        """
        convert = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
        if self.bits != 4 or self.codes.device.type != "cpu" or self.out_features % 16 or convert is None:
            return False
        values = unpack_codes(self.codes, 4).to(torch.int32)  # [out_features, in_features], 0..15
        scales, offsets = self.scales.float(), self.offsets.float()  # [out_features, groups]
        zeros = offsets + 8 * scales
        self.codes = convert(values, 1)  # [out_features, in_features // 2] uint8, torch's order
        # [groups, out_features, 2]: (scale, zero) per group and output feature
        self.scales_and_zeros = torch.stack([scales.t(), zeros.t()], -1).to(self.dtype).contiguous()
        self.scales = self.offsets = None  # kvpilot's tables are folded into scales_and_zeros
        self._cpu_kernel = None  # it held kvpilot's tables
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        flat = x.reshape(-1, self.in_features)
        kw = {"bits": self.bits, "group_size": self.group_size}
        if self.torch_int4:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat.to(self.dtype).contiguous(), self.codes, self.group_size, self.scales_and_zeros
            )
        elif self._cpu_kernel is not None and flat.dtype == self.dtype:
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
