"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flat, variable-length batch.

Weights are laid out for CPU speed: q/k/v are one matmul (``qkv_proj``) and gate/up are one
matmul (``gate_up_proj``); the loader fuses the Hugging Face tensors into them. The small
operations between the matmuls (residual add + RMSNorm, RoPE, SiLU-and-mul) run as fused C
kernels on the CPU and as their torch references elsewhere (kvpilot.kernels.cpu_fused_ops).
Numerics follow transformers' reference implementation (RMSNorm in float32, RoPE in the model
dtype with float32 angles) so logits match it closely.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.engine.attention import AttentionBackend, AttentionMetadata
from kvpilot.engine.models.config import ModelArch, RopeScaling
from kvpilot.engine.quantization.linear import QuantizedLinear
from kvpilot.kernels import cpu_features, cpu_fused_ops


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised on purpose: the loader (or make_model) fills every parameter.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def linear(
    x: torch.Tensor, weight: torch.Tensor | QuantizedLinear, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear, oneDNN's kernel for a weight that CausalLM.pack_weights_for_cpu prepacked, or the
    quantized matmul for a weight kept packed."""
    if isinstance(weight, QuantizedLinear):
        out = weight.forward(x)  # not through nn.Module's call: no hooks are set on it
        return out if bias is None else out.add_(bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def add_rms_norm(
    delta: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of residual + delta, residual + delta); without a residual, of delta alone."""
    if cpu_fused_ops.usable(delta):
        return cpu_fused_ops.add_rms_norm(delta, residual, weight, eps)
    return cpu_fused_ops.add_rms_norm_reference(delta, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if cpu_fused_ops.usable(gate_up):
        return cpu_fused_ops.silu_mul(gate_up)
    return cpu_fused_ops.silu_mul_reference(gate_up)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos, signed_sin: [num_tokens, 1, head_dim] (halves repeated,
    sin's first half negated). On the CPU x is rotated in place."""
    if cpu_fused_ops.usable(x):
        return cpu_fused_ops.rope_(x, cos, signed_sin)
    return cpu_fused_ops.rope_reference(x, cos, signed_sin)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32, with linear or llama3 scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        assert scaling.original_max_position_embeddings is not None
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device, quantized: bool = False) -> None:
        super().__init__()
        self.arch = arch
        hidden, head_dim = arch.hidden_size, arch.head_dim
        self.q_size = arch.num_heads * head_dim
        self.kv_size = arch.num_kv_heads * head_dim
        kw = {"dtype": dtype, "device": device}

        def matrix(rows: int, columns: int) -> nn.Parameter | None:
            # Quantized: left empty for the loader, which installs a QuantizedLinear (or a dense weight).
            return None if quantized else _empty(rows, columns, **kw)

        self.input_layernorm = _empty(hidden, **kw)
        self.qkv_proj = matrix(self.q_size + 2 * self.kv_size, hidden)
        self.qkv_bias = _empty(self.q_size + 2 * self.kv_size, **kw) if arch.qkv_bias else None
        self.o_proj = matrix(hidden, self.q_size)
        self.o_bias = _empty(hidden, **kw) if arch.o_proj_bias else None
        self.post_attention_layernorm = _empty(hidden, **kw)
        self.gate_up_proj = matrix(2 * arch.intermediate_size, hidden)
        self.gate_up_bias = _empty(2 * arch.intermediate_size, **kw) if arch.mlp_bias else None
        self.down_proj = matrix(hidden, arch.intermediate_size)
        self.down_bias = _empty(hidden, **kw) if arch.mlp_bias else None

    def forward(
        self,
        delta: torch.Tensor,  # [num_tokens, hidden_size]: the previous layer's output (the embeddings first)
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]: the residual stream so far; None first
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        signed_sin: torch.Tensor,  # [num_tokens, 1, head_dim]: sin with its first half negated
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's output, the residual stream before it is added)
        arch = self.arch
        num_tokens = delta.shape[0]
        x, residual = add_rms_norm(delta, residual, self.input_layernorm, arch.rms_norm_eps)
        qkv = linear(x, self.qkv_proj, self.qkv_bias)  # [num_tokens, q_size + 2 * kv_size]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads are adjacent in qkv, so one rotation covers both.
        qk = apply_rope(qk.view(num_tokens, arch.num_heads + arch.num_kv_heads, arch.head_dim), cos, signed_sin)
        q, k = qk.split([arch.num_heads, arch.num_kv_heads], dim=1)
        v = v.view(num_tokens, arch.num_kv_heads, arch.head_dim)
        attn = backend.forward(q, k, v, kv_cache, metadata, arch.attention_scale)  # [num_tokens, heads, head_dim]
        attn_out = linear(attn.reshape(num_tokens, self.q_size), self.o_proj, self.o_bias)

        x, residual = add_rms_norm(attn_out, residual, self.post_attention_layernorm, arch.rms_norm_eps)
        gate_up = linear(x, self.gate_up_proj, self.gate_up_bias)  # [num_tokens, 2 * intermediate]
        return linear(silu_mul(gate_up), self.down_proj, self.down_bias), residual


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head of a Llama-family model.

    ``quantized``: the embedding, the LM head and the layers' matrices start empty (None), and the
    loader installs each as a QuantizedLinear or a dense weight (weight_targets.linear_slots)."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device, quantized: bool = False) -> None:
        super().__init__()
        self.arch = arch
        kw = {"dtype": dtype, "device": device}
        table = None if quantized else _empty(arch.vocab_size, arch.hidden_size, **kw)
        self.embed_tokens: nn.Parameter | QuantizedLinear | None = table
        self.layers = nn.ModuleList(DecoderLayer(arch, dtype, device, quantized) for _ in range(arch.num_layers))
        self.norm = _empty(arch.hidden_size, **kw)
        untied_head = None if quantized else _empty(arch.vocab_size, arch.hidden_size, **kw)
        self.lm_head = None if arch.tie_word_embeddings else untied_head
        # Angles are computed per step from the positions (as transformers does) rather than cached
        # for max_position_embeddings, which is 128k positions for Llama 3.
        inv_freq = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        self.register_buffer("rope_inv_freq", inv_freq.to(device), persistent=False)  # [head_dim // 2] float32

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [num_tokens, hidden_size], after the final norm
        if isinstance(self.embed_tokens, QuantizedLinear):
            hidden = self.embed_tokens.embedding(input_ids)  # [num_tokens, hidden_size]
        else:
            hidden = F.embedding(input_ids, self.embed_tokens)
        angles = positions.float()[:, None] * self.rope_inv_freq[None, :]  # [num_tokens, head_dim // 2]
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # [num_tokens, 1, head_dim]
        cos = angles.cos().to(hidden.dtype)
        signed_sin = angles.sin().to(hidden.dtype)
        signed_sin[..., : self.arch.head_dim // 2].neg_()
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, signed_sin, kv_cache, metadata, backend)
        return add_rms_norm(hidden, residual, self.norm, self.arch.rms_norm_eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return linear(hidden, head).float()

    def pack_weights_for_cpu(self, batch_size_hint: int) -> bool:
        """Hold a CPU model's matmul weights in the layouts of the fastest kernels this CPU runs,
        once, instead of converting per call; returns whether any weight moved.

        Weights kept packed move into the layout of a quantized CPU kernel, whatever the model's
        dtype (QuantizedLinear.repack_for_cpu: float32 and bfloat16 models take the int8-activation
        kernel where it builds). Dense weights of a bfloat16 model go into oneDNN's blocked layout
        where oneDNN can reorder bfloat16 (AVX-512 BW/VL/DQ or AVX-NE-CONVERT,
        kvpilot.kernels.cpu_features): decode-sized matmuls get markedly faster (the AMX kernels
        otherwise re-pack the weight on every call). Other devices keep every weight as it is; dense
        weights stay as they are in other dtypes and with a torch built without oneDNN.
        """
        if self.norm.device.type != "cpu":
            return False
        onednn = (self.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
                  and cpu_features.detect().onednn_bf16_prepack)
        moved = False

        def pack(owner: nn.Module, name: str, *, embedding: bool = False) -> None:
            nonlocal moved
            weight = getattr(owner, name)
            if isinstance(weight, QuantizedLinear):
                moved |= weight.repack_for_cpu(embedding=embedding) != "kvpilot"
            elif onednn:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)
                delattr(owner, name)  # a Parameter slot cannot hold an opaque oneDNN tensor
                setattr(owner, name, packed)
                moved = True

        for layer in self.layers:
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                pack(layer, name)
        if self.lm_head is not None:
            pack(self, "lm_head")
        elif isinstance(self.embed_tokens, QuantizedLinear):
            pack(self, "embed_tokens", embedding=True)  # the tied head is also the embedding
        elif onednn:
            # A tied dense head gets its own packed copy: the embedding lookup needs the plain table.
            self.lm_head = self.embed_tokens.detach()
            pack(self, "lm_head")
        return moved
