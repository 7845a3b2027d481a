"""ModelArch from a GGUF file's metadata (llama.cpp's keys, ``{arch}.block_count`` and so on).

GGUF keeps no config.json: the architecture facts are metadata keys prefixed with
``general.architecture``, and a few (biases, tied embeddings, vocabulary size) are implied by
which tensors the file holds and their shapes.
"""

from __future__ import annotations

from kvpilot.engine.checkpoint import ModelLoadError
from kvpilot.engine.models.config import ModelArch, RopeScaling
from kvpilot.engine.models.gguf_file import GGUFFile

# general.architecture -> the Hugging Face class it corresponds to. llama.cpp writes Mistral
# (7B, Nemo) checkpoints as "llama"; "mistral" is accepted for converters that name it.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# llama.cpp's converter reorders the q/k rows of these architectures for its interleaved RoPE
# (convert_hf_to_gguf.py, LlamaModel.permute); the weight loader undoes it. Qwen2 is stored as is.
ROPE_INTERLEAVED_ARCHITECTURES = frozenset({"llama", "mistral"})
DEFAULT_ROPE_THETA = 10000.0


def gguf_model_arch(gguf_file: GGUFFile) -> ModelArch:
    """The engine's ModelArch for the model in ``gguf_file``; a ModelLoadError naming what is unsupported."""
    family = gguf_file.architecture
    if family not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf_file.path}: GGUF architecture {family!r} is not supported; kvpilot loads GGUF files of "
            f"architecture {', '.join(map(repr, GGUF_ARCHITECTURES))} (general.architecture)"
        )
    key = _KeyReader(gguf_file, family)
    if key.optional_int("expert_count", 0) > 0:
        raise ModelLoadError(
            f"{gguf_file.path}: this is a mixture-of-experts model ({family}.expert_count = "
            f"{key.optional_int('expert_count', 0)}); kvpilot supports dense Llama, Mistral and Qwen2 models only"
        )
    hidden_size = key.positive_int("embedding_length")
    num_heads = key.positive_int("attention.head_count")
    num_kv_heads = key.optional_int("attention.head_count_kv", num_heads)
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{gguf_file.path}: {family}.attention.head_count ({num_heads}) must be a positive multiple of "
            f"{family}.attention.head_count_kv ({num_kv_heads})"
        )
    head_dim = _head_dim(gguf_file, key, hidden_size, num_heads)
    embedding = gguf_file.tensors.get("token_embd.weight")
    if embedding is None:
        raise ModelLoadError(f"{gguf_file.path}: tensor 'token_embd.weight' (the token embeddings) is missing")
    # GGML shapes list the innermost dimension first: [hidden_size, vocab_size].
    vocab_size = int(embedding.shape[1])
    eos_token_ids = tuple(
        dict.fromkeys(  # ordered and unique: EOS, then the end-of-turn / end-of-message tokens
            token_id
            for name in ("eos_token_id", "eot_token_id", "eom_token_id")
            if (token_id := gguf_file.get(f"tokenizer.ggml.{name}", int)) is not None
        )
    )
    sliding_window = key.optional_int("attention.sliding_window", 0) or None
    return ModelArch(
        architecture=GGUF_ARCHITECTURES[family],
        model_type=family,
        hidden_size=hidden_size,
        num_layers=key.positive_int("block_count"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=key.positive_int("feed_forward_length"),
        vocab_size=vocab_size,
        max_position_embeddings=key.positive_int("context_length"),
        rms_norm_eps=gguf_file.require(f"{family}.attention.layer_norm_rms_epsilon", float),
        rope_theta=gguf_file.get(f"{family}.rope.freq_base", float, DEFAULT_ROPE_THETA),
        rope_scaling=_rope_scaling(gguf_file, family),
        tie_word_embeddings="output.weight" not in gguf_file.tensors,
        sliding_window=sliding_window,
        # Biases exist in the file or not; the first layer speaks for all of them.
        qkv_bias="blk.0.attn_q.bias" in gguf_file.tensors,
        o_proj_bias="blk.0.attn_output.bias" in gguf_file.tensors,
        mlp_bias="blk.0.ffn_down.bias" in gguf_file.tensors,
        bos_token_id=gguf_file.get("tokenizer.ggml.bos_token_id", int),
        eos_token_ids=eos_token_ids,
    )


def _head_dim(gguf_file: GGUFFile, key: _KeyReader, hidden_size: int, num_heads: int) -> int:
    family = gguf_file.architecture
    if hidden_size % num_heads and f"{family}.attention.key_length" not in gguf_file:
        raise ModelLoadError(
            f"{gguf_file.path}: {family}.embedding_length ({hidden_size}) is not divisible by "
            f"{family}.attention.head_count ({num_heads}) and {family}.attention.key_length is missing"
        )
    head_dim = key.optional_int("attention.key_length", hidden_size // num_heads)
    value_dim = key.optional_int("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ModelLoadError(
            f"{gguf_file.path}: key and value heads differ in size ({family}.attention.key_length {head_dim}, "
            f"value_length {value_dim}); kvpilot supports equal sizes only"
        )
    rotary_dim = key.optional_int("rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ModelLoadError(
            f"{gguf_file.path}: {family}.rope.dimension_count ({rotary_dim}) differs from the head size "
            f"({head_dim}); partial rotary embeddings are not supported"
        )
    return head_dim


def _rope_scaling(gguf_file: GGUFFile, family: str) -> RopeScaling:
    """Linear scaling from metadata. Llama 3's frequency scaling is not metadata in GGUF but a tensor,
    ``rope_freqs.weight``, which the weight loader applies to the model's RoPE frequencies."""
    scaling_type = gguf_file.get(f"{family}.rope.scaling.type", str)
    factor = gguf_file.get(f"{family}.rope.scaling.factor", float)
    legacy_linear_factor = gguf_file.get(f"{family}.rope.scale_linear", float)
    if scaling_type is None and legacy_linear_factor is not None:
        scaling_type, factor = "linear", legacy_linear_factor
    if scaling_type in (None, "none") or (scaling_type == "linear" and factor == 1.0):
        return RopeScaling(rope_type="default")
    if scaling_type == "linear":
        if factor is None:
            raise ModelLoadError(f"{gguf_file.path}: {family}.rope.scaling.type is 'linear' but no factor is given")
        return RopeScaling(rope_type="linear", factor=factor)
    raise ModelLoadError(
        f"{gguf_file.path}: RoPE scaling {scaling_type!r} ({family}.rope.scaling.type) is not supported; "
        "kvpilot supports none and linear in GGUF files (and Llama 3's rope_freqs tensor)"
    )


class _KeyReader:
    """Reads ``{family}.NAME`` keys as integers, naming the full key in errors."""

    def __init__(self, gguf_file: GGUFFile, family: str) -> None:
        self._file = gguf_file
        self._family = family

    def positive_int(self, name: str) -> int:
        value = self._file.require(f"{self._family}.{name}", int)
        if value <= 0:
            raise ModelLoadError(f"{self._file.path}: GGUF metadata {self._family}.{name} must be positive, got {value}")
        return value

    def optional_int(self, name: str, default: int) -> int:
        return self._file.get(f"{self._family}.{name}", int, default)
