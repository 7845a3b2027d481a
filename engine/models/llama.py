"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flat, variable-length batch.

Weights are laid out for CPU speed: q/k/v are one matmul (``qkv_proj``) and gate/up are one
matmul (``gate_up_proj``); the loader fuses the Hugging Face tensors into them. Every matrix is a
linear method (engine/linear.py) the loader picks per layer: the model calls ``proj(x)`` and never
asks whether the weight is dense or packed. The small
operations between the matmuls (residual add + RMSNorm, RoPE, SiLU-and-mul) run as fused C
kernels on the CPU and as their torch references elsewhere (kvpilot.kernels.cpu_fused_ops).
Numerics follow transformers' reference implementation (RMSNorm in float32, RoPE in the model
dtype with float32 angles) so logits match it closely.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvpilot.engine.attention import AttentionBackend, AttentionMetadata
from kvpilot.engine.linear import Linear, UnloadedLinear
from kvpilot.engine.lora.layer import LoRAMapping
from kvpilot.engine.models.config import ModelArch, RopeScaling
from kvpilot.kernels import cpu_fused_ops


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised on purpose: the loader fills every parameter.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


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
    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.arch = arch
        hidden, head_dim, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
        self.q_size = arch.num_heads * head_dim
        self.kv_size = arch.num_kv_heads * head_dim
        kw = {"dtype": dtype, "device": device}
        self.input_layernorm = _empty(hidden, **kw)
        self.qkv_proj: Linear = UnloadedLinear(self.q_size + 2 * self.kv_size, hidden, bias=arch.qkv_bias, **kw)
        self.o_proj: Linear = UnloadedLinear(hidden, self.q_size, bias=arch.o_proj_bias, **kw)
        self.post_attention_layernorm = _empty(hidden, **kw)
        self.gate_up_proj: Linear = UnloadedLinear(2 * inter, hidden, bias=arch.mlp_bias, **kw)
        self.down_proj: Linear = UnloadedLinear(hidden, inter, bias=arch.mlp_bias, **kw)

    def projections(self) -> tuple[Linear, ...]:
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj

    def forward(
        self,
        delta: torch.Tensor,  # [num_tokens, hidden_size]: the previous layer's output (the embeddings first)
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]: the residual stream so far; None first
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        signed_sin: torch.Tensor,  # [num_tokens, 1, head_dim]: sin with its first half negated
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        lora: LoRAMapping | None,  # rows that run with a LoRA adapter (each projection adds theirs)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's output, the residual stream before it is added)
        arch = self.arch
        num_tokens = delta.shape[0]
        x, residual = add_rms_norm(delta, residual, self.input_layernorm, arch.rms_norm_eps)
        qkv = self.qkv_proj(x, lora)  # [num_tokens, q_size + 2 * kv_size]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads are adjacent in qkv, so one rotation covers both.
        qk = apply_rope(qk.view(num_tokens, arch.num_heads + arch.num_kv_heads, arch.head_dim), cos, signed_sin)
        q, k = qk.split([arch.num_heads, arch.num_kv_heads], dim=1)
        v = v.view(num_tokens, arch.num_kv_heads, arch.head_dim)
        attn = backend.forward(q, k, v, kv_cache, metadata, arch.attention_scale)  # [num_tokens, heads, head_dim]
        attn_out = self.o_proj(attn.reshape(num_tokens, self.q_size), lora)

        x, residual = add_rms_norm(attn_out, residual, self.post_attention_layernorm, arch.rms_norm_eps)
        gate_up = self.gate_up_proj(x, lora)  # [num_tokens, 2 * intermediate]
        return self.down_proj(silu_mul(gate_up), lora), residual


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head of a Llama-family model.

    The embedding table, the LM head and the layers' matrices start as UnloadedLinear, and the loader
    installs a linear method in each (engine/models/linear_assembly.py). With tied embeddings
    ``lm_head`` is None and the embedding table is also the head."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.arch = arch
        kw = {"dtype": dtype, "device": device}
        self.embed_tokens: Linear = UnloadedLinear(arch.vocab_size, arch.hidden_size, bias=False, **kw)
        self.layers = nn.ModuleList(DecoderLayer(arch, dtype, device) for _ in range(arch.num_layers))
        self.norm = _empty(arch.hidden_size, **kw)
        self.lm_head: Linear | None = (
            None if arch.tie_word_embeddings else UnloadedLinear(arch.vocab_size, arch.hidden_size, bias=False, **kw)
        )
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
        lora: LoRAMapping | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden_size], after the final norm
        hidden = self.embed_tokens.embedding(input_ids)  # [num_tokens, hidden_size]
        cos, signed_sin = self.rope_tables(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, signed_sin, kv_cache, metadata, backend, lora)
        return add_rms_norm(hidden, residual, self.norm, self.arch.rms_norm_eps)[0]

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin) [num_tokens, 1, head_dim] in dtype for positions [num_tokens]: the angles'
        halves repeated, sin's first half negated (apply_rope's tables)."""
        angles = positions.float()[:, None] * self.rope_inv_freq[None, :]  # [num_tokens, head_dim // 2]
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # [num_tokens, 1, head_dim]
        cos = angles.cos().to(dtype)
        signed_sin = angles.sin().to(dtype)
        signed_sin[..., : self.arch.head_dim // 2].neg_()
        return cos, signed_sin

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return head(hidden).float()

    def pack_weights_for_cpu(self, batch_size_hint: int) -> bool:
        """Hold a CPU model's matmul weights in the layouts of the fastest kernels this CPU runs,
        once, instead of converting per call; returns whether any weight moved. Each linear method
        decides for its own weight (Linear.pack_for_cpu): packed codes take a quantized CPU kernel's
        layout, dense bfloat16 weights oneDNN's blocked one where oneDNN can reorder bfloat16."""
        moved = False
        for layer in self.layers:
            for projection in layer.projections():
                moved |= projection.pack_for_cpu(batch_size_hint)
        if self.lm_head is None:  # the tied head is also the embedding, whose rows stay readable
            moved |= self.embed_tokens.pack_for_cpu(batch_size_hint, embedding=True)
        else:
            moved |= self.lm_head.pack_for_cpu(batch_size_hint)
        return moved
