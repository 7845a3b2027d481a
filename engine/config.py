"""The engine's configuration: what the user asked for, validated once, then frozen.

``EngineConfig`` holds the user's choices (``None`` meaning "pick a default").
Values that depend on the model or the machine — the device, the dtype, the
context length, the number of KV blocks — are resolved once at start-up into a
separate ``ResolvedConfig`` and never patched back into the user's config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.engine.spec_decode.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# auto: keep what the checkpoint holds (AWQ 4-bit, GGUF Q4_0/Q4_1/Q8_0 packed); none: dequantize at load.
QUANTIZATION_METHODS = ("auto", "awq", "gguf", "none")

# Chunked prefill splits long prompts, so the per-step token budget only has to
# keep big matrix multiplies busy; without chunking a whole prompt must fit.
DEFAULT_CHUNKED_BATCHED_TOKENS = 2048
# CPU KV memory is never profiled (there is no device to fill); this is the
# most it takes by default, and less when max_num_seqs full-length sequences fit.
DEFAULT_CPU_KV_CACHE_MEMORY = 4 * 1024**3


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what to change."""


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes; CPU only (CUDA sizes the cache by profiling)
    # Bytes the engine may use in all on a CPU (its container's memory limit): with it and without
    # kv_cache_memory, the KV cache takes gpu_memory_utilization of it less what the process holds,
    # so the tuner's memory fraction sizes the cache on CPUs as on GPUs.
    cpu_memory_limit: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    attention_backend: str = "auto"
    enforce_eager: bool = False  # True disables CUDA graphs and the one-call CPU decode path (engine/cpu_decode.py)
    quantization: str = "auto"  # one of QUANTIZATION_METHODS (docs/quantization.md)
    speculative_config: SpeculativeConfig | None = None  # None: one token per sequence per step
    # LoRA adapters (engine/lora/): how many sit in the model at once, and the largest rank one may have.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model: give the path of a Hugging Face model folder or of a .gguf file")
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("device", self.device, DEVICES)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("quantization", self.quantization, QUANTIZATION_METHODS)
        _check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        if self.max_num_batched_tokens is not None:
            _check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, minimum=1)
        _check_int("block_size", self.block_size, minimum=1)
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size: must be a power of two (8, 16, 32, ...), got {self.block_size}")
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(
            self.gpu_memory_utilization, (int, float)
        ) or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization: must be a fraction in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.kv_cache_memory is not None:
            _check_int("kv_cache_memory", self.kv_cache_memory, minimum=1)
        if self.cpu_memory_limit is not None:
            _check_int("cpu_memory_limit", self.cpu_memory_limit, minimum=1)
        _check_int("seed", self.seed, minimum=0)
        _check_int("max_loras", self.max_loras, minimum=1)
        _check_int("max_lora_rank", self.max_lora_rank, minimum=1)
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            raise ConfigError(
                "speculative_config: build it with SpeculativeConfig.from_dict({...}), got "
                f"{type(self.speculative_config).__name__}"
            )
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs one token per step"
            )
        if (
            not self.enable_chunked_prefill
            and self.max_num_batched_tokens is not None
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is below max_model_len "
                f"({self.max_model_len}) with chunked prefill disabled, so a long prompt could never run: "
                "raise max_num_batched_tokens, lower max_model_len, or enable chunked prefill"
            )


@dataclass(frozen=True)
class ResolvedConfig:
    """Values derived once at start-up from the config, the model and the machine."""

    device: str  # "cpu" | "cuda"
    dtype: str  # "float32" | "bfloat16" | "float16"
    attention_backend: str  # "torch" | "triton"
    max_model_len: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    kv_block_bytes: int  # bytes one block takes across all layers, K and V


def resolve_max_model_len(config: EngineConfig, max_position_embeddings: int) -> int:
    if config.max_model_len is None:
        return max_position_embeddings
    if config.max_model_len > max_position_embeddings:
        raise ConfigError(
            f"max_model_len ({config.max_model_len}) exceeds the model's max_position_embeddings "
            f"({max_position_embeddings}); lower max_model_len"
        )
    return config.max_model_len


def resolve_max_num_batched_tokens(config: EngineConfig, max_model_len: int) -> int:
    if config.max_num_batched_tokens is not None:
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) is below max_model_len "
                f"({max_model_len}) with chunked prefill disabled, so a long prompt could never run: "
                "raise max_num_batched_tokens, lower max_model_len, or enable chunked prefill"
            )
        return config.max_num_batched_tokens
    if config.enable_chunked_prefill:
        return max(DEFAULT_CHUNKED_BATCHED_TOKENS, config.max_num_seqs)
    return max(max_model_len, config.max_num_seqs)


def kv_block_bytes(*, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    # K and V for every layer: [2, block_size, num_kv_heads, head_dim] per layer.
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


def blocks_from_budget(*, budget_bytes: int, block_bytes: int, block_size: int, max_model_len: int, source: str) -> int:
    """Blocks that fit in ``budget_bytes``; raises when not even one full-length sequence fits."""
    num_blocks = max(budget_bytes, 0) // block_bytes
    needed_blocks = math.ceil(max_model_len / block_size)
    if num_blocks < needed_blocks:
        raise ConfigError(
            f"the KV cache budget ({_mib(max(budget_bytes, 0))} from {source}) holds {num_blocks} blocks of "
            f"{block_size} tokens, but one sequence of max_model_len={max_model_len} needs {needed_blocks} "
            f"blocks ({_mib(needed_blocks * block_bytes)}): raise {source} or lower max_model_len"
        )
    return num_blocks


def default_cpu_kv_cache_memory(config: EngineConfig, max_model_len: int, block_bytes: int) -> int:
    blocks_for_all_seqs = config.max_num_seqs * math.ceil(max_model_len / config.block_size)
    return min(DEFAULT_CPU_KV_CACHE_MEMORY, blocks_for_all_seqs * block_bytes)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 1024**2:.1f} MiB"


def _check_choice(field: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{field}: must be one of {', '.join(choices)}; got {value!r}")


def _check_int(field: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{field}: must be an integer >= {minimum}, got {value!r}")
