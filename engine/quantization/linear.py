"""The packed linear method (engine/linear.py): a weight kept as 4- or 8-bit codes, multiplied
without a dense copy.

The route is chosen per call from where the activations are: the Triton dequantize-in-GEMM kernel
on CUDA (kvpilot.kernels.quant_matmul), the C kernel on the CPU (kvpilot.kernels.cpu_quant_matmul);
where neither runs (a CPU without a C compiler), the reference dequantizes and multiplies.
``repack_for_cpu`` (``pack_for_cpu``, called by CausalLM.pack_weights_for_cpu) moves a weight into
the layout of a faster CPU kernel: kvpilot's int8-activation kernel (kvpilot.kernels.cpu_int8_matmul,
AVX-512 VNNI or AVX2; float32 and bfloat16 models) where it builds, else, for 4 bits in bfloat16,
torch's own int4 kernel (``aten._weight_int4pack_mm_for_cpu``), which blocks registers across
output features.
A packed token embedding is a QuantizedLinear too: ``embedding`` dequantizes just the rows looked up.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from kvpilot.engine.linear import Linear
from kvpilot.engine.quantization.packed import PackedWeight
from kvpilot.kernels import cpu_int8_matmul, cpu_quant_matmul
from kvpilot.kernels.quant_layout import quant_matmul_reference, unpack_codes


class QuantizedLinear(Linear):
    def __init__(self, packed: PackedWeight, dtype: torch.dtype, device: torch.device,
                 bias: nn.Parameter | None = None) -> None:
        super().__init__(*packed.shape, bias)
        self.bits = packed.bits
        self.group_size = packed.group_size
        self.dtype = dtype  # of activations and outputs (the model's dtype)
        packed = packed.to(device)
        self.register_buffer("codes", packed.codes)
        self.register_buffer("scales", packed.scales)
        self.register_buffer("offsets", packed.offsets)
        # Where the codes are laid out: "kvpilot" (kvpilot.kernels.quant_layout), or after
        # repack_for_cpu "w4a8"/"w8a8" (kvpilot.kernels.cpu_int8_matmul) or "torch-int4".
        self.layout = "kvpilot"
        # The CPU kernel bound to these buffers once: kvpilot's layout's on first use (a weight
        # repacked for a faster kernel at load never builds it), the repacked layout's by repack_for_cpu.
        self._cpu_matmul = None
        if self.codes.device.type == "cpu" and dtype in cpu_int8_matmul.DTYPES:  # the kernel repack_for_cpu wants
            cpu_int8_matmul.load_kernel_in_background(self.bits, self.group_size)

    @property
    def packed(self) -> PackedWeight:
        if self.layout != "kvpilot":
            raise RuntimeError(f"this weight was repacked into the {self.layout} layout (repack_for_cpu)")
        return PackedWeight(self.bits, self.group_size, self.codes, self.scales, self.offsets)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    @property
    def int8_kernel(self) -> cpu_int8_matmul.Int8Kernel | None:
        """The int8-activation kernel bound to this weight once repacked (w4a8/w8a8), else None."""
        kernel = self._cpu_matmul
        return kernel if isinstance(kernel, cpu_int8_matmul.Int8Kernel) else None

    def pack_for_cpu(self, batch_size_hint: int, *, embedding: bool = False) -> bool:
        return self.repack_for_cpu(embedding=embedding) != "kvpilot"

    def repack_for_cpu(self, *, embedding: bool = False) -> str:
        """Hold a CPU weight in the layout of the fastest CPU kernel that runs here for the layer's
        dtype (same bytes of codes); returns the layout now held.

        - ``w4a8`` / ``w8a8``: kvpilot's int8-activation kernel (kvpilot.kernels.cpu_int8_matmul),
          float32 and bfloat16 models, on CPUs with AVX-512 VNNI and BF16 or with AVX2 and FMA. It
          rounds x to 8 bits per run of 32 inputs (about 1 % relative). ``embedding`` reads this
          layout too.
        - ``torch-int4`` (4 bits, bfloat16, elsewhere): torch's int4 kernel, which dequantizes
          ``(code - 8) * scale + zero`` per group, so ``zero = offset + 8 * scale`` (kept, like the
          scale, in bfloat16). Not taken with ``embedding=True`` (the weight is also the token
          embedding, and its rows cannot be read back from torch's layout).
        - ``kvpilot``: unchanged where neither applies: another device or dtype, out_features not a
          multiple of 16, no kernel available (float32 models then stay on kvpilot's C kernel).
        """
        if self.layout != "kvpilot" or self.codes.device.type != "cpu" or self.out_features % 16:
            return self.layout
        int8_kernel = (cpu_int8_matmul.load_kernel(self.bits, self.group_size)
                       if self.dtype in cpu_int8_matmul.DTYPES else None)
        convert = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
        if int8_kernel is not None:
            self.codes, self.scales, self.offsets = cpu_int8_matmul.interleave(
                self.codes, self.scales, self.offsets, bits=self.bits, group_size=self.group_size)
            self._cpu_matmul = cpu_int8_matmul.Int8Kernel(int8_kernel, self.codes, self.scales, self.offsets,
                                                          self.dtype)
            self.layout = f"w{self.bits}a8"
        elif self.dtype == torch.bfloat16 and self.bits == 4 and not embedding and convert is not None:
            values = unpack_codes(self.codes, 4).to(torch.int32)  # [out_features, in_features], 0..15
            scales, offsets = self.scales.float(), self.offsets.float()  # [out_features, groups]
            self.codes = convert(values, 1)  # [out_features, in_features // 2] uint8, torch's order
            # [groups, out_features, 2]: (scale, zero) per group and output feature
            self.scales = torch.stack([scales.t(), (offsets + 8 * scales).t()], -1).to(self.dtype).contiguous()
            self.offsets = None  # folded into the zeros beside the scales
            self._cpu_matmul = functools.partial(torch.ops.aten._weight_int4pack_mm_for_cpu, mat2=self.codes,
                                                 qGroupSize=self.group_size, qScaleAndZeros=self.scales)
            self.layout = "torch-int4"
        return self.layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        if self.layout != "kvpilot" and x.dim() == 2 and x.dtype == self.dtype and x.is_contiguous():
            out = self._cpu_matmul(x)  # a decode step's ~120 calls: nothing else on the way
        else:
            out = self._matmul(x)
        return out if self.bias is None else out.add_(self.bias)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:  # any shape, dtype and device
        flat = x.reshape(-1, self.in_features)
        if self.layout != "kvpilot":  # repacked for a CPU kernel, which takes the layer's dtype
            out = self._cpu_matmul(flat.to(self.dtype).contiguous())
        elif flat.dtype == self.dtype and self._bind_kvpilot_cpu_kernel():
            out = self._cpu_matmul(flat)
        elif flat.device.type == "cuda":
            from kvpilot.kernels.quant_matmul import quant_matmul  # Triton: imported only where it runs

            out = quant_matmul(flat.contiguous(), self.codes, self.scales, self.offsets, bits=self.bits,
                               group_size=self.group_size)
        else:
            out = quant_matmul_reference(flat, self.codes, self.scales, self.offsets, bits=self.bits,
                                         group_size=self.group_size)
        return out.view(*x.shape[:-1], self.out_features)

    def _bind_kvpilot_cpu_kernel(self) -> bool:
        """Whether kvpilot's CPU kernel takes this (kvpilot-layout) weight, binding it the first time."""
        if self._cpu_matmul is None and self.codes.device.type == "cpu" and cpu_quant_matmul.usable(
                torch.empty(0, dtype=self.dtype), bits=self.bits, group_size=self.group_size):
            self._cpu_matmul = cpu_quant_matmul.bind(self.codes, self.scales, self.offsets, bits=self.bits,
                                                     group_size=self.group_size, dtype=self.dtype)
        return self._cpu_matmul is not None

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, in_features]: rows of the table
        if self.layout in ("w4a8", "w8a8"):
            codes, scales, offsets = cpu_int8_matmul.rows(self.codes, self.scales, self.offsets, ids, bits=self.bits)
            return PackedWeight(self.bits, self.group_size, codes, scales, offsets).dequantize(self.dtype)
        return self.packed.rows(ids).dequantize(self.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, layout={self.layout}")  # fmt: skip
