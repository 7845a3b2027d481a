"""ModelArch: the architecture facts the engine needs, parsed once from a HF config.json
(or from a GGUF file's metadata: engine/models/gguf_config.py)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.engine.checkpoint import ModelLoadError, is_gguf_path
from kvpilot.engine.models.gguf_file import GGUFFile

# HF `architectures` entry -> the family it belongs to.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int | None = None  # llama3 only


@dataclass(frozen=True)
class ModelArch:
    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    model_type: str  # "llama" | "mistral" | "qwen2"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    tie_word_embeddings: bool
    sliding_window: int | None  # None: full attention (also when the config disables it)
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


def read_model_arch(model_path: str | Path) -> ModelArch:
    """The architecture of the model at model_path: a .gguf file's metadata, or a Hugging Face
    folder's ``config.json`` (and ``generation_config.json`` for extra EOS ids)."""
    if is_gguf_path(model_path):
        # gguf_config builds on this module's ModelArch, hence the late import.
        from kvpilot.engine.models.gguf_config import gguf_model_arch

        return gguf_model_arch(GGUFFile(model_path))
    model_dir = Path(model_path)
    if not model_dir.is_dir():
        raise ModelLoadError(
            f"model {str(model_dir)!r} does not exist or is neither a directory nor a GGUF file; pass the path of "
            "a Hugging Face model folder (config.json, *.safetensors, tokenizer files), e.g. one written by "
            "`kvpilot make-model`, or of a .gguf file, e.g. one fetched by `kvpilot fetch-model`"
        )
    gguf_files = sorted(p.name for p in model_dir.glob("*.gguf"))
    if gguf_files and not (model_dir / "config.json").is_file():
        raise ModelLoadError(
            f"{model_dir} holds GGUF file(s) ({', '.join(gguf_files)}) but no config.json; pass the .gguf "
            f"file itself, e.g. {model_dir / gguf_files[0]}"
        )
    config = _read_json(model_dir / "config.json", required=True)
    generation_config = _read_json(model_dir / "generation_config.json", required=False) or {}
    return parse_model_arch(config, generation_config, source=str(model_dir / "config.json"))


def saved_dtype(model_path: str | Path) -> str | None:
    """The dtype a Hugging Face folder's config.json records ("bfloat16", ...); None for GGUF files,
    whose quantized weights have no one float type, and when the config names none."""
    if is_gguf_path(model_path):
        return None
    config = _read_json(Path(model_path) / "config.json", required=True) or {}
    # transformers 5 writes "dtype", 4.x "torch_dtype".
    saved = config.get("dtype") or config.get("torch_dtype")
    return saved if isinstance(saved, str) else None


def parse_model_arch(config: dict[str, Any], generation_config: dict[str, Any], source: str) -> ModelArch:
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not architectures:
        raise ModelLoadError(f"{source}: field 'architectures' is missing; expected one of {_supported()}")
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: architecture {architecture!r} is not supported; supported architectures: {_supported()}"
        )
    family = SUPPORTED_ARCHITECTURES[architecture]
    field = _FieldReader(config, source)

    hidden_size = field.positive_int("hidden_size")
    num_heads = field.positive_int("num_attention_heads")
    num_kv_heads = field.positive_int("num_key_value_heads", default=num_heads)
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{source}: num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )
    if config.get("head_dim") is not None:
        head_dim = field.positive_int("head_dim")
    else:
        if hidden_size % num_heads:
            raise ModelLoadError(
                f"{source}: hidden_size ({hidden_size}) is not divisible by num_attention_heads ({num_heads}); "
                "set head_dim explicitly"
            )
        head_dim = hidden_size // num_heads
    hidden_act = config.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ModelLoadError(f"{source}: hidden_act {hidden_act!r} is not supported; only 'silu' is")

    rope_theta, rope_scaling = _parse_rope(config, source)
    sliding_window = config.get("sliding_window")
    if family == "qwen2" and not config.get("use_sliding_window", False):
        sliding_window = None
    return ModelArch(
        architecture=architecture,
        model_type=family,
        hidden_size=hidden_size,
        num_layers=field.positive_int("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=field.positive_int("intermediate_size"),
        vocab_size=field.positive_int("vocab_size"),
        max_position_embeddings=field.positive_int("max_position_embeddings"),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        sliding_window=int(sliding_window) if sliding_window else None,
        qkv_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
        o_proj_bias=family != "qwen2" and bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_eos_ids(config, generation_config),
    )


def _parse_rope(config: dict[str, Any], source: str) -> tuple[float, RopeScaling]:
    # transformers 5 writes `rope_parameters` (theta included); 4.x writes rope_theta + rope_scaling.
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    scaling = RopeScaling(rope_type=rope_type)
    if rope_type in ("linear", "llama3"):
        if "factor" not in params:
            raise ModelLoadError(f"{source}: rope scaling of type {rope_type!r} needs a 'factor'")
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=params.get("original_max_position_embeddings"),
        )
        if rope_type == "llama3" and scaling.original_max_position_embeddings is None:
            raise ModelLoadError(f"{source}: llama3 rope scaling needs 'original_max_position_embeddings'")
    return theta, scaling


def _eos_ids(config: dict[str, Any], generation_config: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for value in (config.get("eos_token_id"), generation_config.get("eos_token_id")):
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ModelLoadError(
                f"{path.name} not found in {str(path.parent)!r}: not a Hugging Face model folder "
                "(expected config.json, *.safetensors and tokenizer files)"
            )
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc}); regenerate or re-download the model") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


class _FieldReader:
    def __init__(self, config: dict[str, Any], source: str) -> None:
        self._config = config
        self._source = source

    def positive_int(self, name: str, default: int | None = None) -> int:
        value = self._config.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelLoadError(f"{self._source}: field {name!r} must be a positive integer, got {value!r}")
        return value


def _supported() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)
