"""Fill a CausalLM from a GGUF file: dequantize tensor by tensor straight into the model.

The file stays memory-mapped; each tensor is dequantized to float32 (the gguf package's
dequantizers), put back in Hugging Face row order where llama.cpp reordered it, and handed over
in the model's dtype: matrices to the assembler, which installs each projection once its parts
are in (engine/models/linear_assembly.py), norms and biases into their slices of the model's
parameters. So at most a layer's worth of tensors exists twice at a time, never the whole model.

With ``keep_packed``, matrices stored as Q4_0, Q4_1 or Q8_0 are not dequantized: their blocks
become PackedWeights (engine/quantization/gguf_packed.py) and the model multiplies with them
directly; matrices of other types are dequantized as above.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import torch

from kvpilot.engine.checkpoint import ModelLoadError
from kvpilot.engine.models.gguf_config import ROPE_INTERLEAVED_ARCHITECTURES, gguf_model_arch
from kvpilot.engine.models.gguf_file import SUPPORTED_TENSOR_TYPES, GGUFFile, import_gguf
from kvpilot.engine.models.linear_assembly import LinearAssembler
from kvpilot.engine.models.llama import CausalLM, rope_inv_freq
from kvpilot.engine.models.weight_targets import linear_slots, weight_targets
from kvpilot.engine.quantization.gguf_packed import gguf_to_packed, is_packable

# GGUF tensor names (llama.cpp's) -> Hugging Face names, which weight_targets maps to our parameters.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama 3.1+ files carry their RoPE frequency scaling as this tensor: one divisor per frequency.
ROPE_FREQS_TENSOR = "rope_freqs.weight"


def load_gguf_model(
    path: str | Path, dtype: torch.dtype, device: torch.device | str, keep_packed: bool = False
) -> CausalLM:
    """Build the model the GGUF file describes and fill it from the file's tensors."""
    gguf_file = GGUFFile(path)
    arch = gguf_model_arch(gguf_file)
    device = torch.device(device)
    model = CausalLM(arch, dtype, device)
    targets = weight_targets(model)
    assembler = LinearAssembler(linear_slots(model), dtype, device, str(gguf_file.path), keep_packed=keep_packed)
    unpermute = arch.model_type in ROPE_INTERLEAVED_ARCHITECTURES
    filled: set[str] = set()
    for name, tensor in gguf_file.tensors.items():
        if name == ROPE_FREQS_TENSOR:
            _apply_rope_freqs(model, gguf_file, tensor)
            continue
        hf_name = hf_tensor_name(name)
        module = hf_name.removesuffix(".weight") if hf_name is not None else None
        if module in assembler.slots:
            shape = tuple(int(d) for d in reversed(tensor.shape))  # [rows, cols]: GGML lists the innermost first
            _check_shape(gguf_file, name, shape, assembler.slots[module].shape)
            assembler.add(module, _matrix(gguf_file, tensor, hf_name, arch, unpermute, keep_packed))
            continue
        target = targets.get(hf_name) if hf_name is not None else None
        if target is None:
            raise ModelLoadError(
                f"{gguf_file.path}: tensor {name!r} has no place in a {arch.model_type} model "
                f"({arch.num_layers} layers); kvpilot supports plain Llama, Mistral and Qwen2 checkpoints"
            )
        param, rows = target
        destination = param.data[rows]
        values = dequantize(gguf_file, tensor)  # a float32 vector: a norm or a bias
        _check_shape(gguf_file, name, values.shape, tuple(destination.shape))
        if unpermute and hf_name.endswith("q_proj.bias"):
            values = undo_rope_row_permutation(values, arch.num_heads)
        elif unpermute and hf_name.endswith("k_proj.bias"):
            values = undo_rope_row_permutation(values, arch.num_kv_heads)
        with warnings.catch_warnings():
            # F32 tensors come back as read-only views of the memory map; they are only read here.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            destination.copy_(torch.from_numpy(values))
        filled.add(hf_name)
    missing = sorted(set(targets) - filled) + assembler.missing()
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(
            f"{gguf_file.path}: the file lacks tensors the model needs (Hugging Face names): {shown}"
        )
    if keep_packed:
        assembler.log_summary()
    return model.eval()


def _check_shape(gguf_file: GGUFFile, name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if shape != expected:
        raise ModelLoadError(
            f"{gguf_file.path}: tensor {name!r} has shape {shape} but the metadata implies "
            f"{expected}; the tensors do not belong to this metadata"
        )


def _matrix(gguf_file: GGUFFile, tensor, hf_name: str, arch, unpermute: bool,  # noqa: ANN001
            keep_packed: bool):  # noqa: ANN202
    """A matrix tensor as a PackedWeight when ``keep_packed`` and its type stays packed, else
    dequantized (float32 torch), with q/k rows put back in Hugging Face order either way."""
    shape = tuple(int(d) for d in reversed(tensor.shape))  # [rows, cols]: GGML lists the innermost first
    heads = {"q_proj.weight": arch.num_heads, "k_proj.weight": arch.num_kv_heads}
    num_heads = next((n for suffix, n in heads.items() if hf_name.endswith(suffix)), None) if unpermute else None
    if keep_packed and is_packable(tensor.tensor_type.name, shape):
        packed = gguf_to_packed(tensor.tensor_type.name, tensor.data, shape)
        if num_heads is None:
            return packed
        order = undo_rope_row_permutation(np.arange(shape[0]), num_heads)
        return packed.rows(torch.from_numpy(order))
    values = dequantize(gguf_file, tensor)
    if num_heads is not None:
        values = undo_rope_row_permutation(values, num_heads)
    return torch.from_numpy(np.array(values, dtype=np.float32))  # owned: F32 tensors are read-only map views


def hf_tensor_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for unknown names."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _LAYER_NAMES:
        return None
    layer, module, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[module]}.{kind}"


def dequantize(gguf_file: GGUFFile, tensor) -> np.ndarray:  # noqa: ANN001 (gguf.ReaderTensor)
    """The tensor's values as float32, shaped [rows, cols] (numpy order: GGML's shape reversed)."""
    gguf = import_gguf()
    type_name = tensor.tensor_type.name
    if type_name not in SUPPORTED_TENSOR_TYPES:
        raise ModelLoadError(
            f"{gguf_file.path}: tensor {tensor.name!r} has type {type_name}, which kvpilot does not dequantize; "
            f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}. Convert the model to one of these (e.g. llama.cpp's "
            "llama-quantize --allow-requantize IN.gguf OUT.gguf Q4_K_M) or use its Hugging Face folder"
        )
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return values.astype(np.float32, copy=False)


def undo_rope_row_permutation(values: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation: per head, rows were stored as interleaved pairs
    (x0, x_half, x1, x_half+1, ...) for its GPT-J style RoPE; Hugging Face's "rotate half" RoPE
    wants the first half of the head's rows, then the second half."""
    rows = values.shape[0]
    head_dim = rows // num_heads
    # stored: [heads, head_dim // 2, 2, ...]; wanted: [heads, 2, head_dim // 2, ...]
    grouped = values.reshape(num_heads, head_dim // 2, 2, *values.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(values.shape)


def _apply_rope_freqs(model: CausalLM, gguf_file: GGUFFile, tensor) -> None:  # noqa: ANN001
    """Divide the model's RoPE frequencies by the file's per-frequency factors, as llama.cpp does."""
    arch = model.arch
    factors = torch.from_numpy(dequantize(gguf_file, tensor).copy())  # [head_dim // 2]
    if tuple(factors.shape) != (arch.head_dim // 2,):
        raise ModelLoadError(
            f"{gguf_file.path}: tensor {ROPE_FREQS_TENSOR!r} has shape {tuple(factors.shape)}, expected "
            f"({arch.head_dim // 2},) (half the head size)"
        )
    base = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
    model.rope_inv_freq.copy_(base / factors)
