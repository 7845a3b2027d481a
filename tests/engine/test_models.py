"""CausalLM against Hugging Face transformers, through the paged cache; load errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvpilot.engine.attention import AttentionMetadata, get_attention_backend
from kvpilot.engine.models import ModelLoadError, load_model, load_tokenizer, read_model_arch
from kvpilot.kernels import cpu_features

BLOCK_SIZE = 4
NUM_BLOCKS = 64


class PagedBatch:
    """Per-sequence token histories laid out in a shuffled paged cache, one flat step at a time."""

    def __init__(self, model, num_seqs: int, seed: int = 0) -> None:
        arch = model.arch
        self.kv_caches = [
            torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim, dtype=model.dtype)
            for _ in range(arch.num_layers)
        ]
        blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
        per_seq = NUM_BLOCKS // num_seqs
        self.tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(num_seqs)]
        self.lengths = [0] * num_seqs

    def step(self, model, new_tokens: list[list[int]]) -> torch.Tensor:
        """Run every sequence's new tokens as one varlen batch; return logits [num_tokens, vocab]."""
        ids, positions, slots, starts = [], [], [], [0]
        for seq, tokens in enumerate(new_tokens):
            for offset, token in enumerate(tokens):
                pos = self.lengths[seq] + offset
                ids.append(token)
                positions.append(pos)
                slots.append(self.tables[seq][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            starts.append(starts[-1] + len(tokens))
            self.lengths[seq] += len(tokens)
        q_lens = [len(t) for t in new_tokens]
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(self.lengths, dtype=torch.int32),
            block_tables=torch.tensor(self.tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(q_lens),
            max_seq_len=max(self.lengths),
            query_start_loc_cpu=starts,
            seq_lens_cpu=list(self.lengths),
        )
        with torch.inference_mode():
            hidden = model(
                torch.tensor(ids), torch.tensor(positions), self.kv_caches, metadata, get_attention_backend("torch")
            )
            return model.compute_logits(hidden)


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module")
def hf_models(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    return {
        arch: AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        for arch, path in tiny_model_dirs.items()
    }


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_logits_match_transformers_through_paged_cache(arch, tiny_model_dirs, hf_models):
    model = load_model(tiny_model_dirs[arch], torch.float32, "cpu")
    hf_model = hf_models[arch]
    gen = torch.Generator().manual_seed(1)
    vocab = model.arch.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (13, 1, 6, 22)]
    batch = PagedBatch(model, num_seqs=len(prompts))

    # Step 1: prefill every prompt in one flat batch.
    logits = batch.step(model, prompts)
    start = 0
    for prompt in prompts:
        expected = hf_logits(hf_model, prompt)
        torch.testing.assert_close(logits[start : start + len(prompt)], expected, atol=1e-4, rtol=1e-4)
        start += len(prompt)

    # Step 2: decode one token for some sequences and a chunk of three for another, all on top of
    # their cached prefixes, so attention must read the earlier tokens back from the paged cache.
    extra = [[7], [8], [9, 10, 11], [12]]
    logits = batch.step(model, extra)
    start = 0
    for prompt, new in zip(prompts, extra, strict=True):
        expected = hf_logits(hf_model, prompt + new)[-len(new) :]
        torch.testing.assert_close(logits[start : start + len(new)], expected, atol=1e-4, rtol=1e-4)
        start += len(new)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
         "original_max_position_embeddings": 64},
    ],
    ids=lambda rope: rope["rope_type"],
)
def test_rope_variants_match_transformers(rope, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = _copy(tiny_model_dir, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_scaling"] = rope
    config["rope_theta"] = 10000.0
    (model_dir / "config.json").write_text(json.dumps(config))
    model = load_model(model_dir, torch.float32, "cpu")
    assert model.arch.rope_scaling.rope_type == rope["rope_type"]
    hf_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    prompt = torch.randint(3, model.arch.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    logits = PagedBatch(model, 1).step(model, [prompt])
    torch.testing.assert_close(logits, hf_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_tracks_float32(dtype, tiny_model_dir):
    prompt = list(range(5, 25))
    model32 = load_model(tiny_model_dir, torch.float32, "cpu")
    model16 = load_model(tiny_model_dir, dtype, "cpu")
    assert model16.embed_tokens.weight.dtype == dtype
    logits32 = PagedBatch(model32, 1).step(model32, [prompt])
    logits16 = PagedBatch(model16, 1).step(model16, [prompt])
    assert logits16.dtype == torch.float32
    assert torch.isfinite(logits16).all()
    # Half precision keeps 3-4 significant digits; the logits must still agree closely.
    assert (logits16 - logits32).abs().mean() < 0.05 * logits32.abs().mean()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied and tied LM head
def test_prepacked_cpu_weights_give_the_same_logits(arch, tiny_model_dirs):
    prompt = list(range(5, 30))
    plain = load_model(tiny_model_dirs[arch], torch.bfloat16, "cpu")
    packed = load_model(tiny_model_dirs[arch], torch.bfloat16, "cpu")
    if not (torch.backends.mkldnn.is_available() and cpu_features.detect().onednn_bf16_prepack):
        pytest.skip(f"oneDNN cannot reorder bfloat16 weights here (CPU: {cpu_features.detect().summary()})")
    assert packed.pack_weights_for_cpu(batch_size_hint=8)
    assert all(projection.onednn_weight is not None for layer in packed.layers for projection in layer.projections())
    assert not load_model(tiny_model_dirs[arch], torch.float32, "cpu").pack_weights_for_cpu(batch_size_hint=8)
    expected = PagedBatch(plain, 1).step(plain, [prompt])
    got = PagedBatch(packed, 1).step(packed, [prompt])
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9



@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_cpu_without_avx512_keeps_dense_bfloat16_weights_unpacked(arch, tiny_model_dirs, cpu_without):
    # oneDNN's bfloat16 reorder raises on AVX2 (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT).
    cpu_without("avx512f", "avx_ne_convert")
    prompt = list(range(5, 30))
    plain = load_model(tiny_model_dirs[arch], torch.bfloat16, "cpu")
    model = load_model(tiny_model_dirs[arch], torch.bfloat16, "cpu")
    assert not model.pack_weights_for_cpu(batch_size_hint=8)
    assert not any(projection.onednn_weight is not None for layer in model.layers for projection in layer.projections())
    assert (model.lm_head or model.embed_tokens).onednn_weight is None
    torch.testing.assert_close(PagedBatch(model, 1).step(model, [prompt]), PagedBatch(plain, 1).step(plain, [prompt]))

def test_arch_fields(tiny_model_dirs):
    llama = read_model_arch(tiny_model_dirs["llama"])
    assert llama.model_type == "llama" and llama.rope_scaling.rope_type == "llama3"
    assert llama.num_heads % llama.num_kv_heads == 0 and llama.num_kv_heads < llama.num_heads
    assert llama.eos_token_ids == (2,) and llama.bos_token_id == 1
    qwen2 = read_model_arch(tiny_model_dirs["qwen2"])
    assert qwen2.qkv_bias and qwen2.tie_word_embeddings and qwen2.sliding_window is None
    assert load_model(tiny_model_dirs["qwen2"], torch.float32, "cpu").lm_head is None


def test_transformers5_style_rope_parameters_are_read(tiny_model_dir, tmp_path):
    model_dir = _copy(tiny_model_dir, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    scaling = config.pop("rope_scaling")
    config["rope_parameters"] = {**scaling, "rope_theta": config.pop("rope_theta")}
    (model_dir / "config.json").write_text(json.dumps(config))
    assert read_model_arch(model_dir) == read_model_arch(tiny_model_dir)


def _copy(src, tmp_path):
    return shutil.copytree(src, tmp_path / "model")


def test_missing_folder():
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("/nonexistent/model", torch.float32, "cpu")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json not found"):
        load_model(tmp_path, torch.float32, "cpu")


def test_broken_config_json(tiny_model_dir, tmp_path):
    model_dir = _copy(tiny_model_dir, tmp_path)
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(model_dir, torch.float32, "cpu")


def test_unsupported_architecture_names_it_and_the_supported_ones(tiny_model_dir, tmp_path):
    model_dir = _copy(tiny_model_dir, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        load_model(model_dir, torch.float32, "cpu")


def test_invalid_config_field_is_named(tiny_model_dir, tmp_path):
    model_dir = _copy(tiny_model_dir, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_key_value_heads"] = 3
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="multiple of num_key_value_heads"):
        load_model(model_dir, torch.float32, "cpu")


def test_missing_weights_file(tiny_model_dir, tmp_path):
    model_dir = _copy(tiny_model_dir, tmp_path)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors"):
        load_model(model_dir, torch.float32, "cpu")


def test_missing_tensor_is_named(tiny_model_dir, tmp_path):
    model_dir = _copy(tiny_model_dir, tmp_path)
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(model_dir, torch.float32, "cpu")


def test_shape_mismatch_is_named(tiny_model_dir, tmp_path):
    model_dir = _copy(tiny_model_dir, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["intermediate_size"] += 8
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"mlp\.\w+_proj\.weight.* has shape \(\d+, \d+\) but config.json implies"):
        load_model(model_dir, torch.float32, "cpu")


def test_corrupt_weights_file(tiny_model_dir, tmp_path):
    model_dir = _copy(tiny_model_dir, tmp_path)
    (model_dir / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ModelLoadError, match="cannot read weight file"):
        load_model(model_dir, torch.float32, "cpu")


def test_sharded_checkpoint_loads(tiny_model_dir, tmp_path):
    model_dir = _copy(tiny_model_dir, tmp_path)
    weights = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file_name, shard_names in shards.items():
        save_file({n: weights[n] for n in shard_names}, model_dir / file_name)
        weight_map.update(dict.fromkeys(shard_names, file_name))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = load_model(model_dir, torch.float32, "cpu")
    single = load_model(tiny_model_dir, torch.float32, "cpu")
    for a, b in zip(sharded.parameters(), single.parameters(), strict=True):
        assert torch.equal(a, b)


def test_tokenizer_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(ModelLoadError, match="tokenizer.json not found"):
        load_tokenizer(tmp_path)


def test_unsupported_dtype_is_rejected(tiny_model_dir):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(tiny_model_dir, torch.int8, "cpu")
