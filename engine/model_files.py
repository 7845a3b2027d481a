"""Write random Llama-family model folders in Hugging Face format (and LoRA adapters for them in
PEFT's format): tests, benchmarks, demo.

``make_model`` writes config.json, generation_config.json, model.safetensors and a real
tokenizer (see tokenizer_files.py). Weights are random but deterministic per seed, and scaled
so that hidden states depend on the context: greedy decoding wanders through varied tokens
instead of repeating one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHS = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tokenizer_words: int  # pseudo-words of training text; enough for vocab_size merges
    dtype: str  # safetensors dtype: tests want float32, the benchmark model is stored compactly


PRESETS = {
    "tiny": Preset(128, 2, 4, 2, 352, 1536, 2048, tokenizer_words=20_000, dtype="float32"),
    "small": Preset(1024, 8, 16, 4, 2816, 8192, 4096, tokenizer_words=60_000, dtype="bfloat16"),
}


def make_model(out_dir: str | Path, preset: str = "tiny", arch: str = "llama", seed: int = 0) -> Path:
    """Write a random model folder for ``arch`` at ``preset`` size into out_dir; return its path."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}; got {preset!r}")
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}; got {arch!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer; got {seed!r}")
    import torch
    from safetensors.torch import save_file

    from kvpilot.engine.tokenizer_files import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, save_tokenizer, train_tokenizer

    spec = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(spec.vocab_size, spec.tokenizer_words, seed=seed)
    if tokenizer.get_vocab_size() != spec.vocab_size:
        raise RuntimeError(
            f"the built-in text yields {tokenizer.get_vocab_size()} tokens, not the preset's {spec.vocab_size}"
        )
    token_ids = {name: tokenizer.token_to_id(name) for name in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)}
    config = _hf_config(spec, arch, token_ids[BOS_TOKEN], token_ids[EOS_TOKEN], token_ids[PAD_TOKEN])
    gen = torch.Generator().manual_seed(seed * len(ARCHS) + ARCHS.index(arch))
    weights = _random_weights(spec, arch, config["tie_word_embeddings"], gen)
    dtype = getattr(torch, spec.dtype)
    save_file({k: v.to(dtype).contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
         "pad_token_id": config["pad_token_id"]},
    )
    save_tokenizer(tokenizer, out, model_max_length=spec.max_position_embeddings)
    return out


def _hf_config(spec: Preset, arch: str, bos_id: int, eos_id: int, pad_id: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM"}[arch]],
        "model_type": arch,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.hidden_size // spec.num_heads,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "tie_word_embeddings": False,
        "torch_dtype": spec.dtype,
        "use_cache": True,
    }
    if arch == "llama":
        # Llama 3 style: large theta and llama3 frequency scaling, so that path is exercised too.
        config["rope_theta"] = 500000.0
        config["rope_scaling"] = {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": spec.max_position_embeddings // 8,
        }
        config["attention_bias"] = False
        config["mlp_bias"] = False
    elif arch == "mistral":
        config["rope_theta"] = 1000000.0
        config["sliding_window"] = None
    else:
        # Qwen2: q/k/v biases and tied input/output embeddings, as in its small checkpoints.
        config["rope_theta"] = 1000000.0
        config["tie_word_embeddings"] = True
        config["use_sliding_window"] = False
        config["sliding_window"] = None
    return config


def _random_weights(spec: Preset, arch: str, tied: bool, gen) -> dict[str, Any]:
    import torch

    from kvpilot.engine.tokenizer_files import SPECIAL_TOKENS

    hidden, head_dim = spec.hidden_size, spec.hidden_size // spec.num_heads
    q_size, kv_size, inter = spec.num_heads * head_dim, spec.num_kv_heads * head_dim, spec.intermediate_size

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def near_one(size: int) -> torch.Tensor:
        return 1.0 + normal(size, std=0.1)

    # 1/sqrt(fan_in) keeps activations O(1) through every layer so attention and MLP outputs
    # matter as much as the token embedding; that keeps greedy output context-dependent.
    # A tied embedding is also the LM head: kept small so the current token's own row does not
    # dominate the logits (which would make the model repeat its input).
    embed_std = 0.02 if tied else 1.0
    weights: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(spec.vocab_size, hidden, std=embed_std)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = near_one(hidden)
        weights[p + "self_attn.q_proj.weight"] = normal(q_size, hidden, std=hidden**-0.5)
        weights[p + "self_attn.k_proj.weight"] = normal(kv_size, hidden, std=hidden**-0.5)
        weights[p + "self_attn.v_proj.weight"] = normal(kv_size, hidden, std=hidden**-0.5)
        weights[p + "self_attn.o_proj.weight"] = normal(hidden, q_size, std=q_size**-0.5)
        if arch == "qwen2":
            weights[p + "self_attn.q_proj.bias"] = normal(q_size, std=0.1)
            weights[p + "self_attn.k_proj.bias"] = normal(kv_size, std=0.1)
            weights[p + "self_attn.v_proj.bias"] = normal(kv_size, std=0.1)
        weights[p + "post_attention_layernorm.weight"] = near_one(hidden)
        weights[p + "mlp.gate_proj.weight"] = normal(inter, hidden, std=hidden**-0.5)
        weights[p + "mlp.up_proj.weight"] = normal(inter, hidden, std=hidden**-0.5)
        weights[p + "mlp.down_proj.weight"] = normal(hidden, inter, std=inter**-0.5)
    # With a tied head, the final norm restores logits of about unit spread despite the small embedding.
    weights["model.norm.weight"] = near_one(hidden) / (embed_std * hidden**0.5) if tied else near_one(hidden)
    if not tied:
        weights["lm_head.weight"] = normal(spec.vocab_size, hidden, std=hidden**-0.5)
    # Special tokens (ids 0..len(SPECIAL_TOKENS)-1) get damped output rows: a random model should
    # rarely end a greedy continuation with EOS or emit role markers, yet sampling can still reach them.
    head = weights["model.embed_tokens.weight" if tied else "lm_head.weight"]
    head[: len(SPECIAL_TOKENS)] *= 0.25
    return weights


def make_lora_adapter(
    out_dir: str | Path,
    model_dir: str | Path,
    *,
    rank: int = 8,
    alpha: float = 16,
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    use_rslora: bool = False,
    seed: int = 0,
) -> Path:
    """Write a random PEFT LoRA adapter folder for the model in ``model_dir``; return its path.

    Unlike a fresh PEFT adapter (whose B starts at zero) both matrices are random, sized so that
    the adapter changes a random model's greedy output without swamping the base's projections."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size, kv_size = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {  # module -> (out_features, in_features)
        "self_attn.q_proj": (q_size, hidden), "self_attn.k_proj": (kv_size, hidden),
        "self_attn.v_proj": (kv_size, hidden), "self_attn.o_proj": (hidden, q_size),
        "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter),
    }
    scale = alpha / rank**0.5 if use_rslora else alpha / rank
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(config["num_hidden_layers"]):
        for module, (out_features, in_features) in shapes.items():
            if module.split(".")[1] not in target_modules:
                continue
            prefix = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * in_features**-0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * (0.5 * rank**-0.5 / scale)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "adapter_config.json", {
        "peft_type": "LORA", "base_model_name_or_path": str(model_dir), "r": rank, "lora_alpha": alpha,
        "use_rslora": use_rslora, "target_modules": list(target_modules), "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "modules_to_save": None, "task_type": "CAUSAL_LM",
    })
    return out


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
