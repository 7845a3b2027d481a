"""Where each Hugging Face tensor goes in CausalLM's fused parameters (shared by both loaders).

CausalLM keeps q/k/v in one matrix and gate/up in another; a checkpoint stores them apart. The
map below says, for every tensor name a Llama-family checkpoint uses, which parameter and which
rows of it the tensor fills.
"""

from __future__ import annotations

import torch

from kvpilot.engine.models.config import ModelArch
from kvpilot.engine.models.llama import CausalLM, DecoderLayer


def weight_targets(model: CausalLM) -> dict[str, tuple[torch.nn.Parameter, slice]]:
    """HF tensor name -> (our parameter, the rows of it that tensor fills)."""
    arch: ModelArch = model.arch
    everything = slice(None)
    targets: dict[str, tuple[torch.nn.Parameter, slice]] = {
        "model.embed_tokens.weight": (model.embed_tokens, everything),
        "model.norm.weight": (model.norm, everything),
    }
    if model.lm_head is not None:
        targets["lm_head.weight"] = (model.lm_head, everything)
    inter = arch.intermediate_size
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        p = f"model.layers.{i}."
        q, kv = layer.q_size, layer.kv_size
        qkv_rows = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
        for name, rows in qkv_rows.items():
            targets[f"{p}self_attn.{name}.weight"] = (layer.qkv_proj, rows)
            if layer.qkv_bias is not None:
                targets[f"{p}self_attn.{name}.bias"] = (layer.qkv_bias, rows)
        targets[f"{p}self_attn.o_proj.weight"] = (layer.o_proj, everything)
        targets[f"{p}mlp.gate_proj.weight"] = (layer.gate_up_proj, slice(0, inter))
        targets[f"{p}mlp.up_proj.weight"] = (layer.gate_up_proj, slice(inter, 2 * inter))
        targets[f"{p}mlp.down_proj.weight"] = (layer.down_proj, everything)
        targets[f"{p}input_layernorm.weight"] = (layer.input_layernorm, everything)
        targets[f"{p}post_attention_layernorm.weight"] = (layer.post_attention_layernorm, everything)
        if layer.o_bias is not None:
            targets[f"{p}self_attn.o_proj.bias"] = (layer.o_bias, everything)
        if layer.gate_up_bias is not None and layer.down_bias is not None:
            targets[f"{p}mlp.gate_proj.bias"] = (layer.gate_up_bias, slice(0, inter))
            targets[f"{p}mlp.up_proj.bias"] = (layer.gate_up_bias, slice(inter, 2 * inter))
            targets[f"{p}mlp.down_proj.bias"] = (layer.down_bias, everything)
    return targets
