"""A model kept 4-bit end to end: `kvpilot quantize` writes an AWQ checkpoint of a generated model,
and the engine serves it packed with the same greedy tokens and logits as the same weights dequantized
on kvpilot's C kernel, and close to them through the int8-activation kernel (float32 and bfloat16;
SmolLM2's GGUF in float32 too)."""

from __future__ import annotations

import json

import pytest
import torch

from kvpilot.cli import main as kvpilot_main
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config import ConfigError
from kvpilot.engine.linear import DenseLinear
from kvpilot.engine.models import ModelLoadError, load_model
from kvpilot.engine.quantization.linear import QuantizedLinear
from kvpilot.engine.scoring import EVAL_PASSAGE, perplexity, sequence_logits
from kvpilot.kernels import cpu_features, cpu_int8_matmul

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MATRICES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
PROMPTS = [[1, 17, 230, 5, 99], [1, 400, 401, 402], [1, 7] * 9, [1, 1000, 3, 250, 12, 800, 90]]


@pytest.fixture(params=["llama", "qwen2"])
def awq_dir(request, awq_model_dirs):
    return awq_model_dirs[request.param]


def test_quantize_writes_an_awq_checkpoint(awq_dir):
    config = json.loads((awq_dir / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 32,
                                             "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    assert (awq_dir / "tokenizer.json").is_file()
    from safetensors import safe_open

    with safe_open(str(awq_dir / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
        assert handle.get_tensor("model.layers.0.mlp.down_proj.qweight").shape == (352, 128 // 8)
    assert "model.layers.0.self_attn.q_proj.weight" not in names
    assert {"model.layers.0.self_attn.q_proj.qzeros", "model.layers.0.self_attn.q_proj.scales",
            "model.embed_tokens.weight"} <= names


def test_awq_model_keeps_every_linear_packed_in_under_a_third_of_bfloat16(awq_dir):
    model = load_model(awq_dir, torch.float32, "cpu", quantization="auto")
    packed_bytes = dense_bf16_bytes = 0
    for layer in model.layers:
        for name in MATRICES:
            linear = getattr(layer, name)
            assert isinstance(linear, QuantizedLinear) and linear.bits == 4 and linear.group_size == 32
            packed_bytes += linear.nbytes
            dense_bf16_bytes += linear.out_features * linear.in_features * 2
            assert not any(p.is_floating_point() and p.shape == (linear.out_features, linear.in_features)
                           for p in layer.parameters())  # no dense copy kept beside the codes
    assert isinstance(model.embed_tokens, DenseLinear)  # AWQ leaves embeddings unquantized
    # 4-bit codes plus a float16 scale and offset per 32 inputs: 5 bits a weight, 0.3125 of bfloat16's 16.
    assert packed_bytes / dense_bf16_bytes == pytest.approx(5 / 16)


def test_packed_and_dequantized_weights_give_the_same_logits_and_greedy_tokens(awq_dir, monkeypatch):
    # kvpilot's C kernel multiplies float32 x by the dequantized weight exactly; the engine would
    # otherwise repack for the int8-activation kernel (checked below, within its rounding).
    monkeypatch.setattr(cpu_int8_matmul, "load_kernel", lambda bits, group_size: None)
    packed = load_model(awq_dir, torch.float32, "cpu", quantization="awq")
    dense = load_model(awq_dir, torch.float32, "cpu", quantization="none")
    assert isinstance(dense.layers[0].qkv_proj, DenseLinear)
    for tokens in PROMPTS:
        torch.testing.assert_close(sequence_logits(packed, tokens), sequence_logits(dense, tokens), atol=1e-4, rtol=1e-4)

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    kw = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "kv_cache_memory": 16 << 20}
    outputs = {q: LLM(str(awq_dir), quantization=q, **kw).generate(PROMPTS, params, use_tqdm=False)
               for q in ("awq", "none")}
    for ours, reference in zip(outputs["awq"], outputs["none"], strict=True):
        assert ours.outputs[0].token_ids == reference.outputs[0].token_ids
        assert ours.outputs[0].cumulative_logprob == pytest.approx(reference.outputs[0].cumulative_logprob, abs=1e-3)


def test_a_packed_draft_stays_packed_and_drafts_for_the_full_model(awq_dir, tiny_model_dirs):
    # The model's own 4-bit copy as the draft of the unquantized model (same vocabulary): the
    # draft keeps its checkpoint's format, greedy output is the target's, and about half the
    # proposals hold.
    target = tiny_model_dirs["qwen2" if "qwen2" in awq_dir.name else "llama"]
    kw = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "kv_cache_memory": 16 << 20}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(target), **kw).generate(PROMPTS, params, use_tqdm=False)
    spec = {"method": "draft_model", "model": str(awq_dir), "num_speculative_tokens": 3}
    llm = LLM(str(target), speculative_config=spec, **kw)
    draft = llm.llm_engine.speculator.proposer.model
    assert all(isinstance(getattr(layer, name), QuantizedLinear) for layer in draft.layers for name in MATRICES)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    # 0.50-0.57 here (the draft's 4-bit round-to-nearest copy, on the int8-activation kernel where it
    # builds); a draft unrelated to the target would be accepted about once in its vocabulary.
    assert llm.llm_engine.stats().spec_decode.acceptance_rate > 0.4


@pytest.mark.parametrize("cpu", ["this", "avx2"])
def test_bfloat16_packed_model_stays_close_to_float32(awq_dir, cpu, cpu_without):
    # bfloat16 activations through the same codes: only the activations' rounding differs (8 bits
    # per run of 32 in the int8-activation kernel, AVX-512 VNNI or AVX2; none in torch's int4
    # kernel, taken where neither builds).
    if cpu == "avx2":
        cpu_without("avx512f", "avx_ne_convert")
    full = load_model(awq_dir, torch.float32, "cpu", quantization="awq")
    half = load_model(awq_dir, torch.bfloat16, "cpu", quantization="awq")
    half.pack_weights_for_cpu(batch_size_hint=8)  # codes are repacked; oneDNN packs the dense head where it can
    layouts = {getattr(layer, name).layout for layer in half.layers for name in MATRICES}
    assert layouts == ({"w4a8"} if cpu_features.detect().int8_matmul_isa else {"torch-int4"})
    for tokens in PROMPTS:
        expected = sequence_logits(full, tokens)
        error = (sequence_logits(half, tokens) - expected).norm() / expected.norm()
        assert error.item() < 0.08  # 2-4.5 % here; a wrong route or layout is of the order of 100 %


@pytest.mark.parametrize("cpu", ["this", "avx2"])
def test_float32_packed_model_through_the_int8_kernel_stays_close(awq_dir, cpu, cpu_without):
    # The default dtype on the CPU: the same codes, x rounded to 8 bits per run of 32 in every layer.
    if cpu == "avx2":
        cpu_without("avx512f")  # an AVX-512 machine runs the AVX2 path too
    if cpu_features.detect().int8_matmul_isa is None:
        pytest.skip(f"the int8-activation kernel needs AVX2, FMA and F16C ({cpu_features.detect().summary()})")
    dense = load_model(awq_dir, torch.float32, "cpu", quantization="none")
    packed = load_model(awq_dir, torch.float32, "cpu", quantization="awq")
    assert packed.pack_weights_for_cpu(batch_size_hint=8)
    assert {getattr(layer, name).layout for layer in packed.layers for name in MATRICES} == {"w4a8"}
    for tokens in PROMPTS:
        expected = sequence_logits(dense, tokens)
        error = (sequence_logits(packed, tokens) - expected).norm() / expected.norm()
        # Each matmul is about 1 % off (tests/kernels/test_quant_matmul.py), which these small random
        # models compound to 2-5 % of the logits; a wrong layout or route is of the order of 100 %.
        assert error.item() < 0.08


@pytest.mark.slow
def test_smollm2_gguf_in_float32_through_the_int8_kernel_stays_close(smollm2_gguf):
    # Q4_1 layers and the tied Q8_0 embedding (w8a8, the LM head and the lookup) on the default dtype.
    if cpu_int8_matmul.load_kernel(4, 32) is None:
        pytest.skip(f"the int8-activation kernel needs AVX2, FMA and F16C ({cpu_features.detect().summary()})")
    from kvpilot.engine.models import load_tokenizer

    tokens = load_tokenizer(smollm2_gguf)(EVAL_PASSAGE).input_ids
    dequantized = load_model(smollm2_gguf, torch.float32, "cpu", quantization="none")
    expected = sequence_logits(dequantized, tokens)
    del dequantized
    packed = load_model(smollm2_gguf, torch.float32, "cpu", quantization="gguf")
    packed.pack_weights_for_cpu(batch_size_hint=8)
    assert packed.embed_tokens.layout == "w8a8"
    assert {getattr(layer, name).layout for layer in packed.layers for name in MATRICES} == {"w4a8"}
    got = sequence_logits(packed, tokens)
    error = ((got - expected).norm() / expected.norm()).item()
    ppl = {"int8": perplexity(got, tokens), "dequantized": perplexity(expected, tokens)}
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    print(f"logits off by {error:.4f} (relative norm), {agree:.1%} of next-token argmaxes the same; "
          f"perplexity {ppl['int8']:.4f} vs {ppl['dequantized']:.4f}")
    # Measured on a Sapphire Rapids Xeon: logits 3.0 % off, perplexity +0.4 % (25.69 -> 25.79) on the
    # AVX-512 VNNI build, +0.6 % on the AVX2 one. Before the offsets' share took the rounded x's sum
    # (cpu_int8_matmul.c): 6.2 % and +4.0 % there, 6.6 % and +2.8 % on an AVX2 EPYC. A wrong layout
    # or route gives perplexities in the thousands.
    assert error < 0.05
    assert agree > 0.85
    assert ppl["int8"] == pytest.approx(ppl["dequantized"], rel=0.02)


def test_awq_checkpoint_is_refused_as_gguf_and_plain_folders_as_awq(awq_dir, tiny_model_dir):
    with pytest.raises(ConfigError, match="'gguf' was asked for"):
        LLM(str(awq_dir), quantization="gguf", device="cpu")
    with pytest.raises(ConfigError, match="'awq' was asked for"):
        LLM(str(tiny_model_dir), quantization="awq", device="cpu")


def test_quantize_command(tiny_model_dir, tmp_path, capsys):
    assert kvpilot_main(["quantize", str(tiny_model_dir), str(tmp_path / "out"), "--group-size", "32"]) == 0
    printed = capsys.readouterr().out
    assert "wrote 14 4-bit linear layers (group size 32, round-to-nearest)" in printed
    # in_features 352 (the MLP's down projection) is no multiple of 128: the error says what fits.
    assert kvpilot_main(["quantize", str(tiny_model_dir), str(tmp_path / "bad")]) == 1
    assert "not a multiple of group_size 128; use --group-size 32" in capsys.readouterr().err
    assert kvpilot_main(["quantize", str(tmp_path / "out"), str(tmp_path / "again"), "--group-size", "32"]) == 1
    assert "already an AWQ checkpoint" in capsys.readouterr().err


def test_missing_awq_tensor_is_named(awq_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(awq_dir, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.qzeros"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.qzeros"):
        load_model(broken, torch.float32, "cpu", quantization="awq")
