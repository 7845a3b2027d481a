"""Load a Hugging Face model folder (config.json + safetensors, sharded or not) into CausalLM."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvpilot.engine.models.config import ModelArch, read_model_arch
from kvpilot.engine.models.errors import ModelLoadError
from kvpilot.engine.models.llama import CausalLM, DecoderLayer

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Buffers some checkpoints carry that the model recomputes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """Build the model described by model_dir/config.json and fill it from its safetensors."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of float32, bfloat16, float16; got {dtype}")
    model_dir = Path(model_dir)
    arch = read_model_arch(model_dir)
    device = torch.device(device)
    model = CausalLM(arch, dtype, device)
    targets = _weight_targets(model)
    filled: set[str] = set()
    with ExitStack() as stack:
        for hf_name, handle in _open_weights(model_dir, stack):
            target = targets.get(hf_name)
            if target is None:
                continue  # lm_head of a tied model, rotary buffers, or extra tensors we do not use
            param, rows = target
            destination = param.data[rows]
            tensor = handle.get_tensor(hf_name)
            if tensor.shape != destination.shape:
                raise ModelLoadError(
                    f"weight {hf_name!r} in {model_dir} has shape {tuple(tensor.shape)} but config.json implies "
                    f"{tuple(destination.shape)}; the weights do not belong to this config"
                )
            destination.copy_(tensor)
            filled.add(hf_name)
    missing = sorted(set(targets) - filled)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"weights missing from the safetensors in {model_dir}: {shown}")
    return model.eval()


def load_tokenizer(model_dir: str | Path):
    """The folder's fast tokenizer (transformers ``PreTrainedTokenizerFast``)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model folder {str(model_dir)!r} does not exist or is not a directory")
    if not (model_dir / "tokenizer.json").is_file():
        raise ModelLoadError(
            f"tokenizer.json not found in {model_dir}: kvpilot needs a fast (tokenizers) tokenizer "
            "saved with the model"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, json.JSONDecodeError, TypeError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"the tokenizer in {model_dir} is not a fast tokenizer; kvpilot needs tokenizer.json")
    return tokenizer


def _weight_targets(model: CausalLM) -> dict[str, tuple[torch.nn.Parameter, slice]]:
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


def _open_weights(model_dir: Path, stack: ExitStack) -> Iterator[tuple[str, object]]:
    """(tensor name, open safetensors handle) for every tensor in the folder's weight files."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index (needs 'weight_map'): {exc}") from exc
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors weights in {model_dir}; kvpilot loads safetensors only "
            "(convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True))"
        )
    for file_name in files:
        path = model_dir / file_name
        if not path.is_file():
            raise ModelLoadError(f"weight file {file_name} listed in {index.name} is missing from {model_dir}")
        try:
            handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read weight file {path}: {exc}; the file is corrupt or truncated") from exc
        for name in handle.keys():
            if not name.endswith(_IGNORED_SUFFIXES):
                yield name, handle
