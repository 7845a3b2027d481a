"""GGUF files in the engine, on small synthetic files: the generated tiny models converted to GGUF
the way llama.cpp's converter does, and files broken on purpose for the error messages.

The converter below follows llama.cpp's convert_hf_to_gguf.py: its tensor names, its q/k row
permutation for llama/mistral, Llama 3 RoPE scaling as a ``rope_freqs`` tensor, norms kept in
F32. The real-model checks against transformers are in test_gguf_smollm2.py.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

gguf = pytest.importorskip("gguf")

from kvpilot.engine import LLM, SamplingParams  # noqa: E402
from kvpilot.engine.models import ModelLoadError, load_model, load_tokenizer, read_model_arch  # noqa: E402
from kvpilot.engine.models.gguf_file import GGUFFile  # noqa: E402

MODEL_ARCHS = ("llama", "mistral", "qwen2")
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


# ---------------------------------------------------------------------------- a GGUF converter


def gguf_metadata(model_dir: Path) -> dict[str, object]:
    """The metadata llama.cpp writes for a Llama-family HF folder (tokenizer included)."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = config["model_type"]
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    return {
        f"{arch}.block_count": config["num_hidden_layers"],
        f"{arch}.context_length": config["max_position_embeddings"],
        f"{arch}.embedding_length": config["hidden_size"],
        f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": config["num_attention_heads"],
        f"{arch}.attention.head_count_kv": config["num_key_value_heads"],
        f"{arch}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        f"{arch}.rope.freq_base": float(config["rope_theta"]),
        f"{arch}.rope.dimension_count": config["head_dim"],
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in special else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": config["bos_token_id"],
        "tokenizer.ggml.eos_token_id": config["eos_token_id"],
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": tokenizer_config["chat_template"],
    }


def gguf_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names and in its row order, float32."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        values = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = values
        elif name == "model.norm.weight":
            out["output_norm.weight"] = values
        elif name == "lm_head.weight":
            out["output.weight"] = values
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            if arch != "qwen2" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                values = llama_cpp_permute(values, heads if module == "self_attn.q_proj" else kv_heads)
            out[f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"] = values
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":
        out["rope_freqs.weight"] = llama3_rope_factors(config)
    return out


def llama_cpp_permute(values: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rows, halves interleaved for GPT-J style RoPE."""
    return (
        values.reshape(num_heads, 2, values.shape[0] // num_heads // 2, *values.shape[1:])
        .swapaxes(1, 2)
        .reshape(values.shape)
    )


def llama3_rope_factors(config: dict) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama 3 scaling: one divisor per rotary frequency."""
    scaling = config["rope_scaling"]
    head_dim = config["head_dim"]
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * config["rope_theta"] ** (i / head_dim)
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(
    path: Path,
    arch: str,
    metadata: dict[str, object],
    tensors: dict[str, np.ndarray],
    tensor_type: str = "F32",
) -> Path:
    """Writes a GGUF file; matrices in ``tensor_type``, vectors (norms, biases) in F32 as llama.cpp does."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        _add_value(writer, key, value)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    for name, values in tensors.items():
        if values.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, values.astype(np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_value(writer, key: str, value: object) -> None:
    types = gguf.GGUFValueType
    if isinstance(value, bool):
        writer.add_key_value(key, value, types.BOOL)
    elif isinstance(value, int):
        writer.add_key_value(key, value, types.UINT32)
    elif isinstance(value, float):
        writer.add_key_value(key, value, types.FLOAT32)
    elif isinstance(value, str):
        writer.add_key_value(key, value, types.STRING)
    else:
        assert isinstance(value, list) and value
        sub = types.STRING if isinstance(value[0], str) else types.INT32
        writer.add_key_value(key, value, types.ARRAY, sub_type=sub)


def convert(model_dir: Path, path: Path, tensor_type: str = "F32") -> Path:
    arch = json.loads((model_dir / "config.json").read_text())["model_type"]
    return write_gguf(path, arch, gguf_metadata(model_dir), gguf_tensors(model_dir), tensor_type)


@pytest.fixture(scope="module")
def tiny_ggufs(tiny_model_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_gguf")
    return {arch: convert(tiny_model_dirs[arch], root / f"{arch}.gguf") for arch in MODEL_ARCHS}


# ---------------------------------------------------------------------------- loading


@pytest.mark.parametrize("arch", MODEL_ARCHS)
def test_f32_gguf_loads_the_same_weights_as_the_hf_folder(arch, tiny_model_dirs, tiny_ggufs):
    """Every parameter equal: names mapped, q/k rows un-permuted, biases and tied heads placed."""
    from_hf = load_model(tiny_model_dirs[arch], torch.float32, "cpu")
    from_gguf = load_model(tiny_ggufs[arch], torch.float32, "cpu")
    hf_params, gguf_params = dict(from_hf.named_parameters()), dict(from_gguf.named_parameters())
    assert hf_params.keys() == gguf_params.keys()
    for name, value in hf_params.items():
        assert torch.equal(gguf_params[name], value), name
    # Llama's tiny preset uses Llama 3 RoPE scaling, which reaches the GGUF as a rope_freqs tensor.
    torch.testing.assert_close(from_gguf.rope_inv_freq, from_hf.rope_inv_freq, rtol=1e-6, atol=0)


@pytest.mark.parametrize("arch", MODEL_ARCHS)
def test_gguf_metadata_gives_the_hf_config_architecture(arch, tiny_model_dirs, tiny_ggufs):
    from dataclasses import replace

    from_hf = read_model_arch(tiny_model_dirs[arch])
    from_gguf = read_model_arch(tiny_ggufs[arch])
    if arch == "llama":
        # GGUF has no llama3 scaling metadata; the frequencies come from the rope_freqs tensor.
        assert from_gguf.rope_scaling.rope_type == "default"
        from_gguf = replace(from_gguf, rope_scaling=from_hf.rope_scaling)
    # GGUF stores floats in float32: 1e-5 comes back as 9.99999974e-06.
    assert from_gguf.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps, rel=1e-7)
    assert replace(from_gguf, rms_norm_eps=from_hf.rms_norm_eps) == from_hf


def test_greedy_generation_from_gguf_equals_the_hf_folder(tiny_model_dirs, tiny_ggufs):
    prompts = [[11, 200, 37, 900, 5], list(range(40, 90))]
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    outputs = {}
    for source in (tiny_model_dirs["llama"], tiny_ggufs["llama"]):
        llm = LLM(str(source), dtype="float32", device="cpu", max_model_len=256, max_num_seqs=4,
                  kv_cache_memory=16 << 20)
        outputs[source] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs[tiny_ggufs["llama"]] == outputs[tiny_model_dirs["llama"]]


@pytest.mark.parametrize("tensor_type,tolerance", [("F16", 2e-3), ("Q8_0", 2e-2)])
def test_quantized_gguf_logits_stay_close_to_float(tensor_type, tolerance, tiny_model_dirs, tmp_path):
    """A whole model through the dequantizers: logits move by about the weights' rounding error."""
    path = convert(tiny_model_dirs["qwen2"], tmp_path / f"qwen2-{tensor_type}.gguf", tensor_type)
    assert {t.tensor_type.name for t in GGUFFile(path).tensors.values()} == {tensor_type, "F32"}
    reference = load_model(tiny_model_dirs["qwen2"], torch.float32, "cpu")
    quantized = load_model(path, torch.float32, "cpu")
    hidden = torch.randn(8, reference.arch.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = reference.compute_logits(hidden)
        got = quantized.compute_logits(hidden)
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()
    assert not torch.equal(got, expected)  # the weights really went through rounding


def test_loads_into_bfloat16(tiny_model_dirs, tiny_ggufs):
    model = load_model(tiny_ggufs["mistral"], torch.bfloat16, "cpu")
    reference = load_model(tiny_model_dirs["mistral"], torch.bfloat16, "cpu")
    assert model.dtype == torch.bfloat16
    for (name, value), (_, expected) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(value, expected), name


def test_gguf_tokenizer_and_chat_template(tiny_model_dirs, tiny_ggufs):
    tokenizer = load_tokenizer(tiny_ggufs["llama"])
    hf_tokenizer = load_tokenizer(tiny_model_dirs["llama"])
    assert tokenizer.is_fast and len(tokenizer) == 1536
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>"
    ids = tokenizer("Hello world").input_ids
    assert ids[0] == 1 and tokenizer.decode(ids, skip_special_tokens=True) == "Hello world"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )


@pytest.mark.parametrize("arch", MODEL_ARCHS)
def test_gguf_tokenizer_is_the_one_autotokenizer_builds(arch, tiny_ggufs, tmp_path, monkeypatch):
    """kvpilot picks the tokenizer class from its own read of the file instead of AutoTokenizer's
    slow one: the same class, vocabulary, pre-tokenizer, special tokens and chat template."""
    from transformers import AutoTokenizer

    from kvpilot.engine.models import gguf_tokenizer

    monkeypatch.setenv(gguf_tokenizer.TOKENIZER_CACHE_ENV, str(tmp_path))  # built, not loaded from a cache
    ours = load_tokenizer(tiny_ggufs[arch])
    theirs = AutoTokenizer.from_pretrained(tiny_ggufs[arch].parent, gguf_file=tiny_ggufs[arch].name,
                                           local_files_only=True)
    assert type(ours) is type(theirs)
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.chat_template == theirs.chat_template
    text = "Hello world, the capital of France is Paris.<|im_end|> 12345"
    assert ours(text).input_ids == theirs(text).input_ids


def test_a_gguf_tokenizer_is_built_once_then_loaded_from_the_cache(tiny_ggufs, tmp_path, monkeypatch):
    from kvpilot.engine.models import gguf_tokenizer

    monkeypatch.setenv(gguf_tokenizer.TOKENIZER_CACHE_ENV, str(tmp_path / "cache"))
    built = load_tokenizer(tiny_ggufs["qwen2"])
    assert [f.name for f in (tmp_path / "cache").iterdir()] and not any((tmp_path / "cache").glob(".*"))

    def no_build(path, architecture):
        raise AssertionError(f"built {path} again instead of loading the cache")

    monkeypatch.setattr(gguf_tokenizer, "_from_the_file_alone", no_build)
    cached = load_tokenizer(tiny_ggufs["qwen2"])
    text = "Hello world, the capital of France is Paris. <|im_end|>"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert cached(text).input_ids == built(text).input_ids
    assert cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        built.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (cached.bos_token, cached.eos_token, cached.all_special_tokens) == \
        (built.bos_token, built.eos_token, built.all_special_tokens)


def test_sentencepiece_vocabulary_adds_bos(tmp_path):
    """A llama (SentencePiece) vocabulary: pieces with scores, '▁' for spaces, BOS added by default."""
    # Scores fall with the position, so merges apply in list order: ▁h, ▁w, ▁he, ll, llo, ▁hello, ...
    pieces = ["<unk>", "<s>", "</s>", "▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁w", "▁he", "ll", "llo",
              "▁hello", "or", "▁wor", "ld", "▁world"]
    metadata = {
        "llama.block_count": 1, "llama.context_length": 64, "llama.embedding_length": 32,
        "llama.feed_forward_length": 64, "llama.attention.head_count": 2,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0] + [-float(i) for i in range(len(pieces) - 3)],
        "tokenizer.ggml.token_type": [2, 3, 3] + [1] * (len(pieces) - 3),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
    }
    path = tmp_path / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        if key == "tokenizer.ggml.scores":
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32)
        else:
            _add_value(writer, key, value)
    writer.add_tensor("token_embd.weight", np.zeros((len(pieces), 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tokenizer = load_tokenizer(path)
    ids = tokenizer("hello world").input_ids
    assert tokenizer.convert_ids_to_tokens(ids) == ["<s>", "▁hello", "▁world"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello world"


# ---------------------------------------------------------------------------- clear errors


def test_truncated_file_names_the_tensor(tiny_model_dirs, tmp_path):
    path = convert(tiny_model_dirs["llama"], tmp_path / "cut.gguf")
    cut = GGUFFile(path).tensors["blk.1.ffn_down.weight"]
    os.truncate(path, cut.data_offset + cut.n_bytes // 2)  # as an interrupted download leaves it
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.1.ffn_down.weight' \(F32.*the file is truncated"):
        load_model(path, torch.float32, "cpu")


def test_file_cut_inside_its_header(tiny_model_dirs, tmp_path):
    path = convert(tiny_model_dirs["llama"], tmp_path / "cut.gguf")
    os.truncate(path, 1000)  # inside the token list
    with pytest.raises(ModelLoadError, match="cannot read the GGUF header.*truncated or corrupt"):
        read_model_arch(path)


def test_unknown_tensor_type_names_the_tensor(tiny_model_dirs, tmp_path):
    path = convert(tiny_model_dirs["llama"], tmp_path / "odd.gguf")
    reader = gguf.GGUFReader(str(path), "r+")
    victim = reader.tensors[3]
    victim.field.parts[4][0] = 250  # the tensor's type id, rewritten in the file through the memory map
    reader.data.flush()
    del reader
    with pytest.raises(ModelLoadError, match=rf"tensor '{victim.name}' has type id 250.*Q8_0, Q4_0"):
        load_model(path, torch.float32, "cpu")


def test_unsupported_tensor_type_names_tensor_type_and_the_supported_ones(tiny_model_dirs, tmp_path):
    metadata = gguf_metadata(tiny_model_dirs["llama"])
    tensors = gguf_tensors(tiny_model_dirs["llama"])
    path = tmp_path / "iq4nl.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        _add_value(writer, key, value)
    for name, values in tensors.items():
        if name == "blk.1.ffn_up.weight":  # [352, 128] as IQ4_NL: 4 blocks of 18 bytes a row
            raw = np.random.default_rng(0).integers(0, 255, size=(352, 4 * 18), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.1.ffn_up.weight' has type IQ4_NL.*supported: F32, F16"):
        load_model(path, torch.float32, "cpu")


def test_missing_metadata_key_is_named(tiny_model_dirs, tmp_path):
    metadata = gguf_metadata(tiny_model_dirs["qwen2"])
    del metadata["qwen2.feed_forward_length"]
    path = write_gguf(tmp_path / "nokey.gguf", "qwen2", metadata, gguf_tensors(tiny_model_dirs["qwen2"]))
    with pytest.raises(ModelLoadError, match="metadata key 'qwen2.feed_forward_length' is missing"):
        LLM(str(path), device="cpu")


def test_missing_tensor_is_named(tiny_model_dirs, tmp_path):
    tensors = gguf_tensors(tiny_model_dirs["llama"])
    del tensors["blk.1.attn_v.weight"]
    path = write_gguf(tmp_path / "notensor.gguf", "llama", gguf_metadata(tiny_model_dirs["llama"]), tensors)
    with pytest.raises(ModelLoadError, match=r"lacks tensors .*model.layers.1.self_attn.v_proj.weight"):
        load_model(path, torch.float32, "cpu")


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"gpt2.block_count": 2},
                      {"token_embd.weight": np.zeros((8, 4), np.float32)})
    with pytest.raises(ModelLoadError, match="GGUF architecture 'gpt2' is not supported.*'llama', 'mistral', 'qwen2'"):
        read_model_arch(path)


def test_split_gguf_is_refused_with_the_merge_command(tiny_model_dirs, tmp_path):
    metadata = {**gguf_metadata(tiny_model_dirs["llama"]), "split.count": 3}
    path = write_gguf(tmp_path / "m-00001-of-00003.gguf", "llama", metadata, gguf_tensors(tiny_model_dirs["llama"]))
    with pytest.raises(ModelLoadError, match="one of 3 parts.*llama-gguf-split --merge"):
        read_model_arch(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(ModelLoadError, match=r"not a GGUF file \(it starts with b'PK"):
        read_model_arch(path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        read_model_arch(tmp_path / "missing.gguf")


def test_folder_holding_only_a_gguf_points_at_the_file(tiny_ggufs, tmp_path):
    (tmp_path / "m.gguf").write_bytes(tiny_ggufs["llama"].read_bytes())
    with pytest.raises(ModelLoadError, match=r"pass the \.gguf file itself, e\.g\. .*m\.gguf"):
        read_model_arch(tmp_path)


def test_tokenizer_errors_name_the_missing_key(tiny_model_dirs, tmp_path):
    metadata = gguf_metadata(tiny_model_dirs["llama"])
    del metadata["tokenizer.ggml.tokens"]
    path = write_gguf(tmp_path / "notokens.gguf", "llama", metadata, gguf_tensors(tiny_model_dirs["llama"]))
    with pytest.raises(ModelLoadError, match="metadata key 'tokenizer.ggml.tokens' is missing"):
        load_tokenizer(path)
    metadata = {**gguf_metadata(tiny_model_dirs["llama"]), "tokenizer.ggml.model": "rwkv"}
    path = write_gguf(tmp_path / "rwkv.gguf", "llama", metadata, gguf_tensors(tiny_model_dirs["llama"]))
    with pytest.raises(ModelLoadError, match="cannot build the tokenizer .*'rwkv'"):
        load_tokenizer(path)


def test_tokenizer_comes_from_the_gguf_even_inside_a_hf_folder(tiny_model_dirs, tiny_ggufs, tmp_path):
    """Files beside the GGUF (here another model's tokenizer.json and config) must not be used."""
    import shutil

    folder = shutil.copytree(tiny_model_dirs["qwen2"], tmp_path / "qwen2-folder")
    (folder / "llama.gguf").write_bytes(tiny_ggufs["llama"].read_bytes())
    tokenizer = load_tokenizer(folder / "llama.gguf")
    assert tokenizer("Hello world").input_ids == load_tokenizer(tiny_ggufs["llama"])("Hello world").input_ids
    assert tokenizer.bos_token == "<s>"
