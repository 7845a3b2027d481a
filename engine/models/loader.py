"""Load a model into CausalLM: a Hugging Face folder (config.json + safetensors, sharded or not)
or a single GGUF file (engine/models/gguf_weights.py), told apart by the path.

An AWQ folder (config.json's quantization_config) loads with its linear layers kept 4-bit
(``quantization`` "awq"), or dequantized into the model's dtype ("none").
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvpilot.engine.checkpoint import ModelLoadError, is_gguf_path
from kvpilot.engine.models.config import read_model_arch
from kvpilot.engine.models.linear_assembly import LinearAssembler
from kvpilot.engine.models.llama import CausalLM
from kvpilot.engine.models.weight_targets import linear_slots, weight_targets
from kvpilot.engine.quantization.awq import TENSOR_SUFFIXES as AWQ_SUFFIXES
from kvpilot.engine.quantization.awq import awq_to_packed
from kvpilot.engine.quantization.method import read_awq_config, resolve_quantization

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Buffers some checkpoints carry that the model recomputes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    model_path: str | Path, dtype: torch.dtype, device: torch.device | str, quantization: str = "none"
) -> CausalLM:
    """Build the model at model_path (a Hugging Face folder or a .gguf file) and fill its weights.

    ``quantization`` (engine/quantization/method.py): "auto" keeps what the checkpoint holds
    packed, "awq"/"gguf" insist on it, "none" (the default here) dequantizes everything."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of float32, bfloat16, float16; got {dtype}")
    method = resolve_quantization(quantization, model_path)
    if is_gguf_path(model_path):
        from kvpilot.engine.models.gguf_weights import load_gguf_model

        return load_gguf_model(model_path, dtype, device, keep_packed=method == "gguf")
    model_dir = Path(model_path)
    arch = read_model_arch(model_dir)
    awq = read_awq_config(model_dir)
    device = torch.device(device)
    model = CausalLM(arch, dtype, device)
    targets = weight_targets(model)
    assembler = LinearAssembler(linear_slots(model), dtype, device, str(model_dir), keep_packed=method == "awq")
    awq_parts: dict[str, dict[str, torch.Tensor]] = {}  # module -> its AWQ tensors read so far
    filled: set[str] = set()
    with ExitStack() as stack:
        for hf_name, handle in open_weights(model_dir, stack):
            module, _, suffix = hf_name.rpartition(".")
            if awq is not None and suffix in AWQ_SUFFIXES:
                parts = awq_parts.setdefault(module, {})
                parts[suffix] = handle.get_tensor(hf_name)
                if len(parts) == len(AWQ_SUFFIXES):
                    del awq_parts[module]
                    if module not in assembler.slots:
                        raise ModelLoadError(f"AWQ layer {module!r} has no place in this model")
                    assembler.add(module, awq_to_packed(module, **parts, group_size=awq.group_size,
                                                        shape=assembler.slots[module].shape))  # fmt: skip
                continue
            if suffix == "weight" and module in assembler.slots:
                tensor = handle.get_tensor(hf_name)  # a dense matrix (or a layer AWQ left unquantized)
                _check_shape(hf_name, tensor, assembler.slots[module].shape, model_dir)
                assembler.add(module, tensor)
                continue
            target = targets.get(hf_name)
            if target is None:
                continue  # lm_head of a tied model, rotary buffers, or extra tensors we do not use
            param, rows = target
            destination = param.data[rows]
            tensor = handle.get_tensor(hf_name)
            _check_shape(hf_name, tensor, tuple(destination.shape), model_dir)
            destination.copy_(tensor)
            filled.add(hf_name)
    if awq_parts:
        module, parts = next(iter(awq_parts.items()))
        absent = ", ".join(f"{module}.{s}" for s in AWQ_SUFFIXES if s not in parts)
        raise ModelLoadError(f"AWQ tensors missing from the safetensors in {model_dir}: {absent}")
    missing = sorted(set(targets) - filled) + assembler.missing()
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"weights missing from the safetensors in {model_dir}: {shown}")
    if method == "awq":
        assembler.log_summary()
    return model.eval()


def _check_shape(hf_name: str, tensor: torch.Tensor, expected: tuple[int, ...], model_dir: Path) -> None:
    if tuple(tensor.shape) != expected:
        raise ModelLoadError(
            f"weight {hf_name!r} in {model_dir} has shape {tuple(tensor.shape)} but config.json implies "
            f"{expected}; the weights do not belong to this config"
        )


def load_tokenizer(model_path: str | Path):
    """The model's fast tokenizer (transformers), from the folder's files or the GGUF file's metadata."""
    if is_gguf_path(model_path):
        from kvpilot.engine.models.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(model_path)
    model_dir = Path(model_path)
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


def open_weights(model_dir: Path, stack: ExitStack) -> Iterator[tuple[str, object]]:
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
