"""Decode-only CPU steps with all decoder layers in one C call (kvpilot.kernels.cpu_decode_layers).

The CPU's counterpart of cuda_graphs.py: at decode batch sizes a layer-by-layer forward in Python
pays microseconds of wrapping per kernel, about a dozen kernels a layer, while the kernels
themselves are short. On SmolLM2 at batch 1 that was ~2 ms of a 7.5 ms token. This path hands the
same kernels, the layer's buffers and the step's metadata to one C loop over the layers, and gives
the same hidden states bit for bit.

It is taken (ModelRunner.run_model) for steps where every sequence decodes one token, on models
whose every projection runs on the int8-activation kernel (packed 4- or 8-bit weights, a float32 or
bfloat16 model: GGUF and AWQ files on CPUs with AVX-512 VNNI or AVX2) with the torch attention
backend's decode kernel and no LoRA adapters. Everything else, and every step with
``enforce_eager``, runs layer by layer.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from kvpilot.engine.attention import AttentionMetadata
from kvpilot.engine.models.llama import CausalLM, add_rms_norm
from kvpilot.engine.quantization.linear import QuantizedLinear
from kvpilot.kernels import cpu_decode_layers, cpu_fused_ops, cpu_paged_decode
from kvpilot.kernels.cpu_build import KernelBuildError
from kvpilot.kernels.cpu_decode_layers import DecodeLayer, DecodeModel, DecodeStep, address

logger = logging.getLogger(__name__)


class CpuDecodePath:
    """Runs a decode-only step of ``model`` over ``kv_caches`` in one C call (see the module doc)."""

    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor]) -> None:
        arch, dtype = model.arch, model.dtype
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_caches[0].shape
        self._model = model
        self._kernel = cpu_decode_layers.load_kernel(dtype)
        ops = cpu_fused_ops.load_ops(dtype)
        attention = cpu_paged_decode.load_kernel(dtype, head_dim=head_dim, num_kv_heads=num_kv_heads,
                                                 group=arch.num_heads // num_kv_heads, block_size=block_size)
        if ops is None:
            raise KernelBuildError("the fused CPU ops could not be built")
        self._layers = (DecodeLayer * arch.num_layers)(*(
            DecodeLayer(layer.input_layernorm.data_ptr(), layer.post_attention_layernorm.data_ptr(),
                        *(_linear(projection) for projection in layer.projections()), cache.data_ptr())
            for layer, cache in zip(model.layers, kv_caches, strict=True)
        ))  # fmt: skip
        self._struct = DecodeModel(
            arch.num_layers, arch.hidden_size, arch.num_heads, num_kv_heads, head_dim, arch.intermediate_size,
            num_blocks, block_size, arch.rms_norm_eps, arch.attention_scale, int(dtype == torch.bfloat16),
            address(ops.kvpilot_add_rms_norm), address(ops.kvpilot_silu_mul), address(ops.kvpilot_rope),
            address(attention), self._layers,
        )  # fmt: skip
        self._kv_caches = kv_caches  # held: the structs point into them
        self._qkv_size = (arch.num_heads + 2 * num_kv_heads) * head_dim

    @classmethod
    def for_model(cls, model: CausalLM, kv_caches: list[torch.Tensor]) -> CpuDecodePath | None:
        """The path for this model, or None (logged) where it does not apply: see the module doc."""
        projections = packed_projections(model)
        if projections is None or any(p.int8_kernel is None for p in projections):
            return None  # a dense weight, torch's int4 layout, or a LoRA wrapper
        if model.dtype not in (torch.float32, torch.bfloat16) or not kv_caches or not all(
                cache.is_contiguous() and cache.device.type == "cpu" for cache in kv_caches):
            return None
        _, _, block_size, num_kv_heads, head_dim = kv_caches[0].shape
        if not cpu_paged_decode.supports(dtype=model.dtype, num_heads=model.arch.num_heads,
                                         num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size):
            return None
        try:
            return cls(model, kv_caches)
        except KernelBuildError as exc:
            logger.warning("decode steps run layer by layer (slower): %s", exc)
            return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """A decode-only step (sequence i's one token is row i): hidden states after the final norm."""
        model = self._model
        n = input_ids.shape[0]
        delta = model.embed_tokens.embedding(input_ids).contiguous()  # [n, hidden]
        cos, signed_sin = model.rope_tables(positions, delta.dtype)  # [n, 1, head_dim] each
        residual, normed = torch.empty_like(delta), torch.empty_like(delta)
        qkv = delta.new_empty(n, self._qkv_size)
        attn = delta.new_empty(n, model.arch.num_heads * model.arch.head_dim)
        gate_up = delta.new_empty(n, 2 * model.arch.intermediate_size)
        act = delta.new_empty(n, model.arch.intermediate_size)
        index = torch.arange(n, dtype=torch.int32)
        block_tables = metadata.block_tables
        step = DecodeStep(
            n, delta.data_ptr(), residual.data_ptr(), normed.data_ptr(), qkv.data_ptr(), attn.data_ptr(),
            gate_up.data_ptr(), act.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(),
            metadata.slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
            metadata.seq_lens.data_ptr(), index.data_ptr(),
        )  # fmt: skip
        if self._kernel(ctypes.byref(self._struct), ctypes.byref(step)):
            raise MemoryError(f"no memory for {n} rows of activations quantized to int8")
        return add_rms_norm(delta, residual, model.norm, model.arch.rms_norm_eps)[0]


def packed_projections(model: CausalLM) -> list[QuantizedLinear] | None:
    """Every projection of the model, when all of them are packed (QuantizedLinear); else None."""
    projections = [projection for layer in model.layers for projection in layer.projections()]
    return projections if all(isinstance(p, QuantizedLinear) for p in projections) else None


def _linear(projection: QuantizedLinear) -> cpu_decode_layers.Linear:
    kernel = projection.int8_kernel
    assert kernel is not None  # for_model checked every projection
    bias = projection.bias
    return cpu_decode_layers.Linear(address(kernel.function), *kernel.pointers,
                                    None if bias is None else bias.data_ptr(), kernel.n, kernel.k)
