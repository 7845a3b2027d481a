"""The engine's start-up: resolve the config against the model and the device, load the weights
(packed for this CPU where they can be), build the model runner, size the KV cache (from
``kv_cache_memory`` on a CPU, from a profiling forward and ``gpu_memory_utilization`` on a GPU)
and allocate it. Derived values are computed here once, into ``ResolvedConfig``; the config itself
is never changed.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kvpilot.engine.attention import get_attention_backend
from kvpilot.engine.config import (
    ConfigError,
    EngineConfig,
    ResolvedConfig,
    blocks_from_budget,
    default_cpu_kv_cache_memory,
    kv_block_bytes,
    resolve_max_model_len,
    resolve_max_num_batched_tokens,
)
from kvpilot.engine.cpu_decode import packed_projections
from kvpilot.engine.lora.manager import LoRAManager
from kvpilot.engine.model_runner import ModelRunner
from kvpilot.engine.models import CausalLM, ModelArch, load_model, load_tokenizer, read_model_arch, saved_dtype
from kvpilot.engine.sampler import Sampler, SamplingInput
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.kernels import cpu_decode_layers, cpu_features, cpu_fused_ops, cpu_paged_decode
from kvpilot.kernels.cpu_build import load_in_background

logger = logging.getLogger("kvpilot.engine.llm_engine")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def start(config: EngineConfig) -> tuple[EngineConfig, ResolvedConfig, ModelArch, object, ModelRunner, CausalLM | None]:
    """What LLMEngine is built from: the config, its resolved values, the model's architecture, the
    tokenizer, the model runner (KV cache allocated) and the draft model, if any."""
    arch = read_model_arch(config.model)
    device = _resolve_device(config.device)
    dtype = _resolve_dtype(config.dtype, config.model, device)
    max_model_len = _resolve_max_model_len(config, arch)
    max_num_batched_tokens = resolve_max_num_batched_tokens(config, max_model_len)
    backend_name = config.attention_backend
    if backend_name == "auto":
        backend_name = "triton" if device == "cuda" else "torch"

    torch.manual_seed(config.seed)
    started = time.perf_counter()
    # The tokenizer is built beside the weights: a GGUF file's takes seconds of parsing the first
    # time (no cache yet, as in a new pod) while the weights' kernel builds wait on the compiler.
    with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
        tokenizer_loading = pool.submit(load_tokenizer, config.model)
        model = load_model(config.model, TORCH_DTYPES[dtype], torch.device(device), config.quantization)
        if device == "cpu":  # behind the packed weights' kernels, which packing needs first
            _build_cpu_kernels_in_background(config, model)
        lora = None
        if config.enable_lora:  # before packing: the adapters' stacked matrices are packed with the base weights
            lora = LoRAManager(model, max_loras=config.max_loras, max_rank=config.max_lora_rank)
        if device == "cpu":
            model.pack_weights_for_cpu(batch_size_hint=config.max_num_seqs)
        draft_model = None
        if config.speculative_config is not None and config.speculative_config.method == "draft_model":
            draft_model = _load_draft_model(config, arch, TORCH_DTYPES[dtype], device, max_model_len)
        weights_loaded = time.perf_counter()
        tokenizer = tokenizer_loading.result()
    tokenizer_loaded = time.perf_counter()
    runner = ModelRunner(
        model,
        device=torch.device(device),
        block_size=config.block_size,
        backend=get_attention_backend(backend_name),
        sampler=Sampler(arch.eos_token_ids),
        lora=lora,
    )
    block_bytes = kv_block_bytes(
        block_size=config.block_size,
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        dtype_bytes=TORCH_DTYPES[dtype].itemsize,
    )
    if draft_model is not None:  # the draft's KV cache has as many blocks as the target's
        draft_arch = draft_model.arch
        block_bytes += kv_block_bytes(
            block_size=config.block_size,
            num_layers=draft_arch.num_layers,
            num_kv_heads=draft_arch.num_kv_heads,
            head_dim=draft_arch.head_dim,
            dtype_bytes=TORCH_DTYPES[dtype].itemsize,
        )
    budget, source = _kv_cache_budget(config, runner, device, max_model_len, max_num_batched_tokens, block_bytes)
    num_blocks = blocks_from_budget(
        budget_bytes=budget,
        block_bytes=block_bytes,
        block_size=config.block_size,
        max_model_len=max_model_len,
        source=source,
    )
    runner.allocate_kv_cache(num_blocks)
    # A batch's adapter rows change every step, which a captured graph cannot follow.
    if device == "cuda" and not config.enforce_eager and backend_name == "triton" and lora is None:
        # Decode batches grow to max_num_seqs; a live increase beyond it runs eagerly.
        runner.enable_cuda_graphs(max_num_seqs=config.max_num_seqs, max_model_len=max_model_len)
    if device == "cpu" and not config.enforce_eager and runner.enable_cpu_decode_path():
        logger.info("decode steps run every layer in one C call (engine/cpu_decode.py; --enforce-eager: layer by layer)")
    resolved = ResolvedConfig(
        device=device,
        dtype=dtype,
        attention_backend=backend_name,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        num_kv_blocks=num_blocks,
        kv_block_bytes=block_bytes,
    )
    logger.info(
        "engine ready: %s on %s/%s, %d KV blocks of %d tokens (%.1f MiB), max_model_len %d; weights loaded "
        "in %.1f s, the tokenizer (built beside them) %.1f s later, KV cache sized (profiling forward, warm-up) "
        "in %.1f s",
        arch.architecture, device, dtype, num_blocks, config.block_size,
        num_blocks * block_bytes / 1024**2, max_model_len, weights_loaded - started,
        tokenizer_loaded - weights_loaded, time.perf_counter() - tokenizer_loaded,
    )
    return config, resolved, arch, tokenizer, runner, draft_model


def _build_cpu_kernels_in_background(config: EngineConfig, model: CausalLM) -> None:
    """The CPU kernels every step calls, compiled while the weights are packed (a new pod has none
    cached; kernels/cpu_build.py): the fused norms and activations, decode attention and, for a
    model whose projections are all packed and unless --enforce-eager or LoRA rule it out, the
    one-call decode. A packed weight's matmul kernel was started as the weight loaded
    (QuantizedLinear)."""
    arch, dtype = model.arch, model.dtype
    load_in_background(cpu_fused_ops.load_ops, dtype)
    shape = {"head_dim": arch.head_dim, "num_kv_heads": arch.num_kv_heads, "block_size": config.block_size}
    if cpu_paged_decode.supports(dtype=dtype, num_heads=arch.num_heads, **shape):
        load_in_background(cpu_paged_decode.load_kernel, dtype, group=arch.num_heads // arch.num_kv_heads, **shape)
    if packed_projections(model) is not None and not config.enforce_eager and not config.enable_lora:
        load_in_background(cpu_decode_layers.load_kernel, dtype)


def _load_draft_model(
    config: EngineConfig, arch: ModelArch, dtype: torch.dtype, device: str, max_model_len: int
) -> CausalLM:
    path = config.speculative_config.model
    draft_arch = read_model_arch(path)
    if draft_arch.vocab_size != arch.vocab_size:
        raise ConfigError(
            f"speculative_config.model: the draft's vocabulary has {draft_arch.vocab_size} tokens but the target's "
            f"has {arch.vocab_size}; use a draft model with the target's tokenizer"
        )
    if draft_arch.max_position_embeddings < max_model_len:
        raise ConfigError(
            f"speculative_config.model: the draft handles {draft_arch.max_position_embeddings} positions, fewer "
            f"than max_model_len ({max_model_len}); lower max_model_len or use another draft"
        )
    draft = load_model(path, dtype, torch.device(device), quantization="auto")  # a packed draft stays packed
    if device == "cpu":
        draft.pack_weights_for_cpu(batch_size_hint=config.speculative_config.disable_by_batch_size)
    return draft


def _resolve_max_model_len(config: EngineConfig, arch: ModelArch) -> int:
    max_model_len = resolve_max_model_len(config, arch.max_position_embeddings)
    if arch.sliding_window is not None and max_model_len > arch.sliding_window:
        if config.max_model_len is not None:
            raise ConfigError(
                f"max_model_len ({max_model_len}) exceeds the model's sliding window ({arch.sliding_window}); "
                "sliding-window attention is not supported, so lower max_model_len to at most the window"
            )
        max_model_len = arch.sliding_window
    return max_model_len


def _kv_cache_budget(
    config: EngineConfig,
    runner: ModelRunner,
    device: str,
    max_model_len: int,
    max_num_batched_tokens: int,
    block_bytes: int,
) -> tuple[int, str]:
    """(bytes for the KV cache, the setting they come from, for error messages)."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory, "kv_cache_memory"
    if device == "cpu" and config.cpu_memory_limit is not None:
        return _cpu_kv_budget(config, runner.model.arch, max_num_batched_tokens), \
            "gpu_memory_utilization of cpu_memory_limit"
    if device == "cpu":
        return default_cpu_kv_cache_memory(config, max_model_len, block_bytes), "kv_cache_memory (default)"
    return _profile_kv_budget(runner, config, max_num_batched_tokens), "gpu_memory_utilization"


def _cpu_kv_budget(config: EngineConfig, arch: ModelArch, max_num_batched_tokens: int) -> int:
    """Bytes left for the KV cache on a CPU: the share of the memory limit less what the process
    holds now (weights, libraries, the tokenizer) and the activations of the largest step (the MLP's
    and the attention's widest tensors over the step's tokens, and float32 logits and their
    softmax for every sequence), estimated: a CPU has no allocator to profile."""
    resident = resident_bytes()
    activations = 4 * (max_num_batched_tokens * (3 * arch.intermediate_size + 4 * arch.hidden_size)
                       + 2 * config.max_num_seqs * arch.vocab_size)
    budget = int(config.cpu_memory_limit * config.gpu_memory_utilization) - resident - activations
    logger.info(
        "memory on the CPU: limit %.2f GiB, share %.2f, resident %.2f GiB, activations ~%.2f GiB -> KV budget "
        "%.2f GiB", config.cpu_memory_limit / 1024**3, config.gpu_memory_utilization, resident / 1024**3,
        activations / 1024**3, budget / 1024**3,
    )
    return budget


def resident_bytes() -> int:
    """This process's resident memory (Linux's /proc; elsewhere its peak, from getrusage)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _resolve_device(device: str) -> str:
    cuda = torch.cuda.is_available()
    if device == "auto":
        return "cuda" if cuda else "cpu"
    if device == "cuda" and not cuda:
        raise ConfigError("device: 'cuda' was requested but no CUDA device is visible; use device='cpu'")
    return device


def _resolve_dtype(dtype: str, model_path: str, device: str) -> str:
    if dtype != "auto":
        if dtype == "float16" and device == "cpu":
            raise ConfigError("dtype: float16 is not supported on CPU; use bfloat16 or float32")
        return dtype
    saved = saved_dtype(model_path)
    if device == "cpu":
        features = cpu_features.detect()
        chosen = auto_cpu_dtype(saved, features)
        logger.info("dtype auto: %s (the checkpoint holds %s; CPU: %s)", chosen, saved or "no float dtype",
                    features.summary())
        return chosen
    return saved if saved in TORCH_DTYPES else "bfloat16"


def auto_cpu_dtype(saved: str | None, features: cpu_features.CpuFeatures) -> str:
    """``dtype="auto"`` on a CPU: a float32 checkpoint stays float32; anything else (bfloat16 or
    float16 weights, a GGUF file) runs in bfloat16 where the CPU multiplies it natively (AVX-512
    BF16, AMX) and in float32 elsewhere, where bfloat16 is emulated and several times slower
    (vLLM-CPU keeps a bfloat16 checkpoint's dtype on any x86 CPU: 3x slower than its own float32 at
    batch 32 on an AVX2 machine)."""
    if saved == "float32":
        return "float32"
    return "bfloat16" if features.native_bf16 else "float32"


def _profile_kv_budget(runner: ModelRunner, config: EngineConfig, max_num_batched_tokens: int) -> int:
    """Bytes left for the KV cache: the device's share minus weights, peak activations and other users."""
    _, total = torch.cuda.mem_get_info()
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
    inputs = [
        SamplingInput(params=params, prompt_token_ids=[0], output_token_ids=[], generator=None)
        for _ in range(config.max_num_seqs)
    ]
    peak = runner.profile_peak_memory(max_num_batched_tokens, config.max_num_seqs, inputs)
    free_after, _ = torch.cuda.mem_get_info()
    # Memory held outside torch's allocator (CUDA context, other processes) counts against the share too.
    non_torch = (total - free_after) - torch.cuda.memory_reserved()
    budget = int(total * config.gpu_memory_utilization) - peak - max(non_torch, 0)
    logger.info(
        "memory profile: total %.2f GiB, share %.2f, peak torch %.2f GiB, other %.2f GiB -> KV budget %.2f GiB",
        total / 1024**3, config.gpu_memory_utilization, peak / 1024**3, non_torch / 1024**3, budget / 1024**3,
    )
    return budget
