"""Where each Hugging Face tensor goes in CausalLM (shared by both loaders).

CausalLM keeps q/k/v in one matrix and gate/up in another; a checkpoint stores them apart.
``linear_slots`` says, for every matrix module a Llama-family checkpoint has, which projection of
the model it is part of and which part; the loader installs each projection whole (packed or
dense, engine/models/linear_assembly.py) once all its parts are read. ``weight_targets`` maps every
other tensor (norms, biases) to the parameter, and the rows of it, that the tensor fills.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvpilot.engine.models.config import ModelArch
from kvpilot.engine.models.llama import CausalLM, DecoderLayer


@dataclass(frozen=True)
class LinearSlot:
    """One checkpoint module's place in a matrix of the model: part ``part`` of ``num_parts``, stacked
    along the output features (q, k, v of qkv_proj)."""

    owner: nn.Module
    attribute: str
    part: int
    num_parts: int
    shape: tuple[int, int]  # (out_features, in_features) of this part


def linear_slots(model: CausalLM) -> dict[str, LinearSlot]:
    """HF module name (``model.layers.0.self_attn.q_proj``) -> its slot, for every matrix of the model."""
    arch: ModelArch = model.arch
    hidden, inter = arch.hidden_size, arch.intermediate_size
    slots = {"model.embed_tokens": LinearSlot(model, "embed_tokens", 0, 1, (arch.vocab_size, hidden))}
    if not arch.tie_word_embeddings:
        slots["lm_head"] = LinearSlot(model, "lm_head", 0, 1, (arch.vocab_size, hidden))
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        q, kv = layer.q_size, layer.kv_size
        parts = {
            "self_attn.q_proj": ("qkv_proj", 0, 3, (q, hidden)),
            "self_attn.k_proj": ("qkv_proj", 1, 3, (kv, hidden)),
            "self_attn.v_proj": ("qkv_proj", 2, 3, (kv, hidden)),
            "self_attn.o_proj": ("o_proj", 0, 1, (hidden, q)),
            "mlp.gate_proj": ("gate_up_proj", 0, 2, (inter, hidden)),
            "mlp.up_proj": ("gate_up_proj", 1, 2, (inter, hidden)),
            "mlp.down_proj": ("down_proj", 0, 1, (hidden, inter)),
        }
        for module, (attribute, part, num_parts, shape) in parts.items():
            slots[f"model.layers.{i}.{module}"] = LinearSlot(layer, attribute, part, num_parts, shape)
    return slots


def weight_targets(model: CausalLM) -> dict[str, tuple[torch.nn.Parameter, slice]]:
    """HF tensor name -> (our parameter, the rows of it that tensor fills), for every tensor that is
    not a matrix: norms and biases (a bias belongs to its projection, whichever kind is installed)."""
    arch: ModelArch = model.arch
    everything = slice(None)
    targets: dict[str, tuple[torch.nn.Parameter, slice]] = {"model.norm.weight": (model.norm, everything)}
    inter = arch.intermediate_size
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        p = f"model.layers.{i}."
        q, kv = layer.q_size, layer.kv_size
        targets[f"{p}input_layernorm.weight"] = (layer.input_layernorm, everything)
        targets[f"{p}post_attention_layernorm.weight"] = (layer.post_attention_layernorm, everything)
        if layer.qkv_proj.bias is not None:
            qkv_rows = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
            for name, rows in qkv_rows.items():
                targets[f"{p}self_attn.{name}.bias"] = (layer.qkv_proj.bias, rows)
        if layer.o_proj.bias is not None:
            targets[f"{p}self_attn.o_proj.bias"] = (layer.o_proj.bias, everything)
        if layer.gate_up_proj.bias is not None and layer.down_proj.bias is not None:
            targets[f"{p}mlp.gate_proj.bias"] = (layer.gate_up_proj.bias, slice(0, inter))
            targets[f"{p}mlp.up_proj.bias"] = (layer.gate_up_proj.bias, slice(inter, 2 * inter))
            targets[f"{p}mlp.down_proj.bias"] = (layer.down_proj.bias, everything)
    return targets
