"""Which quantization a checkpoint holds, and which one a load uses (``quantization=``, vLLM's values).

- ``auto`` (the default): keep what the checkpoint holds: AWQ folders stay 4-bit, a GGUF file's
  Q4_0/Q4_1/Q8_0 tensors stay packed; plain checkpoints load as they are.
- ``awq``: the checkpoint must be an AWQ folder (config.json's quantization_config says so).
- ``gguf``: the checkpoint must be a .gguf file.
- ``none``: dequantize everything at load into the model's dtype (the reference for the other two).

A Hugging Face folder declares its quantization the way transformers and vLLM read it: a
``quantization_config`` object in config.json with ``quant_method``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvpilot.engine.checkpoint import ModelLoadError, is_gguf_path
from kvpilot.engine.config import QUANTIZATION_METHODS, ConfigError

AWQ_GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class AWQConfig:
    """config.json's ``quantization_config`` of an AWQ checkpoint (AutoAWQ's GEMM layout)."""

    group_size: int
    modules_to_not_convert: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": list(self.modules_to_not_convert) or None}  # fmt: skip


def checkpoint_quantization(model_path: str | Path) -> str:
    """"gguf", "awq" or "none": what the checkpoint at model_path holds."""
    if is_gguf_path(model_path):
        return "gguf"
    return "none" if read_awq_config(model_path) is None else "awq"


def resolve_quantization(requested: str, model_path: str | Path) -> str:
    """The method a load uses: "awq", "gguf" or "none"; ConfigError when the checkpoint cannot give it."""
    if requested not in QUANTIZATION_METHODS:
        raise ConfigError(f"quantization: must be one of {', '.join(QUANTIZATION_METHODS)}; got {requested!r}")
    held = checkpoint_quantization(model_path)
    if requested in ("auto", "none") or requested == held:
        return held if requested == "auto" else requested
    holds = {"gguf": "a GGUF file", "awq": "an AWQ checkpoint", "none": "unquantized weights"}[held]
    fix = ("write an AWQ checkpoint with `kvpilot quantize MODEL_DIR OUT_DIR`, or use quantization=auto"
           if requested == "awq" else "use quantization=auto (or awq/none)")
    raise ConfigError(f"quantization: {requested!r} was asked for, but {model_path} is {holds}; {fix}")


def read_awq_config(model_path: str | Path) -> AWQConfig | None:
    """The AWQ settings of a Hugging Face folder; None when config.json declares no quantization.

    Raises ModelLoadError for a quantization kvpilot does not load (GPTQ, bitsandbytes, ...) or an
    AWQ variant other than 4-bit GEMM with zero points."""
    config_path = Path(model_path) / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None  # the model loader reports a missing or broken config.json itself
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise ModelLoadError(f"{config_path}: quantization_config must be an object, got {quant!r}")
    method = str(quant.get("quant_method", "")).lower()
    if method != "awq":
        raise ModelLoadError(
            f"{config_path}: quantization_config.quant_method is {quant.get('quant_method')!r}; kvpilot loads AWQ "
            "folders and GGUF files (Q4_0, Q4_1, Q8_0 kept packed). Convert with `kvpilot quantize` from the "
            "unquantized model"
        )
    bits = quant.get("bits", quant.get("w_bit"))
    group_size = quant.get("group_size", quant.get("q_group_size"))
    version = str(quant.get("version", "gemm")).lower()
    zero_point = quant.get("zero_point", True)
    if bits != 4 or version != "gemm" or zero_point is not True:
        raise ModelLoadError(
            f"{config_path}: kvpilot loads AWQ checkpoints with bits=4, version 'gemm' and zero_point=true; this one "
            f"has bits={bits!r}, version={quant.get('version')!r}, zero_point={zero_point!r}"
        )
    if group_size not in AWQ_GROUP_SIZES:
        raise ModelLoadError(
            f"{config_path}: quantization_config.group_size is {group_size!r}; kvpilot supports "
            f"{', '.join(map(str, AWQ_GROUP_SIZES))}"
        )
    skipped = quant.get("modules_to_not_convert") or ()
    return AWQConfig(group_size=group_size, modules_to_not_convert=tuple(skipped))
