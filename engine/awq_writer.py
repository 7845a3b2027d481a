"""``kvpilot quantize``: write an AWQ-layout checkpoint from an unquantized Hugging Face folder.

The decoder layers' linear weights (q/k/v/o, gate/up/down) become 4-bit AWQ tensors by plain
round-to-nearest per group (engine/quantization/awq.py ``quantize_rtn``): no calibration data and
none of AWQ's activation-aware scale search, so quality is RTN's, a little below a real AWQ
checkpoint's. Embeddings, the LM head, norms and biases are copied unchanged, as AWQ does.
config.json gains the ``quantization_config`` that transformers and vLLM read; tokenizer and other
files are copied.

It reads checkpoints with the model loader's helpers and writes the quantized formats, so it sits
above both engine/models/ and engine/quantization/.
"""

from __future__ import annotations

import json
import re
import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from kvpilot.engine.checkpoint import ModelLoadError, is_gguf_path
from kvpilot.engine.models.config import read_model_arch
from kvpilot.engine.models.loader import open_weights
from kvpilot.engine.quantization.awq import quantize_rtn
from kvpilot.engine.quantization.method import AWQ_GROUP_SIZES, AWQConfig, read_awq_config

QUANTIZED_WEIGHT = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
_NOT_COPIED = re.compile(r".*\.safetensors|model\.safetensors\.index\.json|config\.json")


@dataclass(frozen=True)
class QuantizeResult:
    out_dir: Path
    quantized_layers: int
    bytes_before: int  # of the weights file(s) read
    bytes_after: int  # of model.safetensors written


def quantize_model(model_dir: str | Path, out_dir: str | Path, *, group_size: int = 128) -> QuantizeResult:
    import torch
    from safetensors.torch import save_file

    source, out = Path(model_dir), Path(out_dir)
    if is_gguf_path(source):
        raise ModelLoadError(
            f"{source} is a GGUF file, already quantized: serve it as it is (quantization auto or gguf keeps "
            "its Q4_0/Q4_1/Q8_0 tensors packed); `kvpilot quantize` takes a Hugging Face folder"
        )
    if group_size not in AWQ_GROUP_SIZES:
        raise ValueError(f"group_size: must be one of {', '.join(map(str, AWQ_GROUP_SIZES))}; got {group_size}")
    read_model_arch(source)  # a clear error for a folder that is no supported model
    if read_awq_config(source) is not None:
        raise ModelLoadError(f"{source} is already an AWQ checkpoint (config.json has a quantization_config)")
    if out.resolve() == source.resolve():
        raise ValueError("OUT_DIR must differ from MODEL_DIR: the source checkpoint is read while OUT_DIR is written")

    tensors: dict[str, torch.Tensor] = {}
    quantized = 0
    bytes_before = 0
    with ExitStack() as stack:
        for name, handle in open_weights(source, stack):
            tensor = handle.get_tensor(name)
            bytes_before += tensor.numel() * tensor.element_size()
            if not QUANTIZED_WEIGHT.fullmatch(name):
                tensors[name] = tensor
                continue
            out_features, in_features = tensor.shape
            if in_features % group_size or out_features % 8:
                fitting = [g for g in AWQ_GROUP_SIZES if in_features % g == 0]
                raise ValueError(
                    f"{name}: in_features {in_features} is not a multiple of group_size {group_size}"
                    + (f"; use --group-size {max(fitting)}" if fitting and out_features % 8 == 0 else
                       f" (and out_features {out_features} must be a multiple of 8)")
                )
            module = name.removesuffix(".weight")
            tensors.update({f"{module}.{key}": value for key, value in quantize_rtn(tensor, group_size).items()})
            quantized += 1
    if quantized == 0:
        raise ModelLoadError(f"{source}: no decoder-layer linear weights found to quantize")

    out.mkdir(parents=True, exist_ok=True)
    weights_file = out / "model.safetensors"
    save_file(tensors, str(weights_file), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = AWQConfig(group_size=group_size).to_json()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for path in source.iterdir():
        if path.is_file() and not _NOT_COPIED.fullmatch(path.name):
            shutil.copy2(path, out / path.name)
    return QuantizeResult(out, quantized, bytes_before, weights_file.stat().st_size)
