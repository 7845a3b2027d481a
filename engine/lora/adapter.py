"""A LoRA adapter read from a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``)
and checked against the base model it is to run on.

An adapter adds ``x·Aᵀ·Bᵀ·scale`` to some of the model's projections (q/k/v/o, gate/up/down),
with ``A: [r, in_features]``, ``B: [out_features, r]`` and ``scale = lora_alpha / r`` (rsLoRA:
``lora_alpha / sqrt(r)``). Loading keeps each pair in the model's dtype with the scale folded into
B. Anything kvpilot would otherwise drop or apply wrongly is refused with a ``LoRAError`` that
names the adapter and the field: DoRA, trained biases, fully trained modules (``modules_to_save``,
e.g. a tied embedding or LM head), per-module ranks, adapters on the embedding or the LM head, a
rank above ``max_lora_rank``, tensors whose shapes say another base model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections of a Llama-family layer an adapter may target (PEFT's target_modules names).
ADAPTABLE_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight -> (model.layers.3.self_attn.q_proj, A)
_TENSOR_NAME = re.compile(r"^base_model\.model\.(model\.layers\.\d+\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter cannot be used; the message names the adapter, the field or tensor, and what to do."""


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with, as vLLM names it: ``lora_int_id`` (>= 1) identifies this
    adapter's weights (the prefix cache keys on it), ``lora_path`` is its PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAError("lora_name: give the adapter a non-empty name")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRAError(f"adapter {self.lora_name!r}: lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")


@dataclass(frozen=True)
class LoRAAdapter:
    request: LoRARequest
    rank: int
    scale: float
    base_model: str | None  # base_model_name_or_path from its config, for messages
    # HF module name (model.layers.0.self_attn.q_proj) -> (A [rank, in_features], B·scale [out_features, rank])
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def name(self) -> str:
        return self.request.lora_name

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def load_adapter(
    request: LoRARequest, module_shapes: dict[str, tuple[int, int]], *, max_rank: int, dtype: torch.dtype
) -> LoRAAdapter:
    """Read and check ``request``'s folder. ``module_shapes``: each adaptable HF module of the base
    model -> its (out_features, in_features)."""
    where = f"adapter {request.lora_name!r} ({request.lora_path})"
    folder = Path(request.lora_path)
    if not folder.is_dir():
        raise LoRAError(f"{where}: not a folder; give the folder PEFT's save_pretrained wrote")
    config = _read_config(folder, where)
    rank, scale = _check_config(config, where, max_rank)
    weights: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in _read_tensors(folder, where).items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise LoRAError(
                f"{where}: tensor {name!r} is not a LoRA A or B matrix of a decoder layer's "
                f"{'/'.join(ADAPTABLE_MODULES)}; kvpilot does not adapt embeddings, the LM head or norms"
            )
        module, short_name, which = match.groups()
        if short_name not in ADAPTABLE_MODULES or module not in module_shapes:
            raise LoRAError(
                f"{where}: tensor {name!r} targets {module}, which the base model does not have "
                f"(base_model_name_or_path: {config.get('base_model_name_or_path')!r}); is it the right base model?"
            )
        weights.setdefault(module, {})[which] = tensor
    if not weights:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} holds no LoRA tensors")
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, parts in sorted(weights.items()):
        if set(parts) != {"A", "B"}:
            missing = ({"A", "B"} - set(parts)).pop()
            raise LoRAError(f"{where}: {module} has no lora_{missing} tensor; the file is incomplete")
        a, b = parts["A"], parts["B"]
        out_features, in_features = module_shapes[module]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise LoRAError(
                f"{where}: {module}'s lora_A is {tuple(a.shape)} and lora_B {tuple(b.shape)}, but with r={rank} on "
                f"this base model they must be ({rank}, {in_features}) and ({out_features}, {rank}): the adapter "
                f"was trained for another base model (its config says {config.get('base_model_name_or_path')!r})"
            )
        pairs[module] = (a.to(dtype).contiguous(), (b.float() * scale).to(dtype).contiguous())
    return LoRAAdapter(request, rank, scale, config.get("base_model_name_or_path"), pairs)


def _read_config(folder: Path, where: str) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoRAError(f"{where}: no {CONFIG_FILE}; give the folder PEFT's save_pretrained wrote")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError(f"{where}: {CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    return config


def _check_config(config: dict, where: str, max_rank: int) -> tuple[int, float]:
    """(rank, scale) from a PEFT LoRA config, after refusing what kvpilot cannot apply as trained."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"{where}: peft_type is {peft_type!r}; kvpilot serves LoRA adapters only")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"{where}: r={rank} is above max_lora_rank={max_rank}; start the engine with "
                        f"--max-lora-rank {rank} or more")
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    refused = {
        "use_dora": ("DoRA adapters are not supported", lambda v: v in (None, False)),
        "bias": ("trained biases are not supported (use bias='none')", lambda v: v in (None, "none")),
        "modules_to_save": ("fully trained modules (such as a tied embedding or LM head) are not supported",
                            lambda v: not v),
        "fan_in_fan_out": ("fan_in_fan_out weights are for GPT-2-style models, not Llama-family ones",
                           lambda v: v in (None, False)),
        "rank_pattern": ("per-module ranks are not supported", lambda v: not v),
        "alpha_pattern": ("per-module alphas are not supported", lambda v: not v),
    }
    for field, (why, allowed) in refused.items():
        if not allowed(config.get(field)):
            raise LoRAError(f"{where}: {field}={config.get(field)!r}: {why}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if not isinstance(t, str) or t.rsplit(".", 1)[-1] not in ADAPTABLE_MODULES]
        if unknown:
            raise LoRAError(
                f"{where}: target_modules {unknown} are not projections kvpilot adapts; "
                f"it adapts {', '.join(ADAPTABLE_MODULES)}"
            )
    elif targets is not None and not isinstance(targets, str):
        raise LoRAError(f"{where}: target_modules must be a list of module names or a string, got {targets!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _read_tensors(folder: Path, where: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        hint = " (it has adapter_model.bin: convert it to safetensors)" if (folder / "adapter_model.bin").exists() else ""
        raise LoRAError(f"{where}: no {WEIGHTS_FILE}{hint}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} cannot be read ({exc}); the file is corrupt or incomplete") from None
