"""SmolLM2-135M-Instruct's GGUF (Q4_1 matrices, Q8_0 embedding) kept packed: the same greedy text and
perplexity as the same file dequantized at load, in a third of the memory."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.models import load_model, load_tokenizer
from kvpilot.engine.quantization.linear import QuantizedLinear
from kvpilot.engine.scoring import perplexity, sequence_logits
from kvpilot.kernels import cpu_int8_matmul

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Photosynthesis is the process by which"]
PASSAGE = (
    "The old lighthouse stood at the end of a narrow spit of rock, a mile from the nearest house. For more than "
    "a hundred years its lamp had turned through the night, warning ships away from the reef that lay hidden "
    "beneath the grey water. The keepers who lived there kept a careful log of every storm, every passing vessel "
    "and every repair they made to the great glass lens."
)


def test_matrices_stay_packed_in_a_third_of_bfloat16(smollm2_gguf):
    model = load_model(smollm2_gguf, torch.float32, "cpu", quantization="gguf")
    matrices = [getattr(layer, name) for layer in model.layers
                for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
    assert all(isinstance(m, QuantizedLinear) for m in matrices)
    assert {m.bits for m in matrices} == {4}
    assert isinstance(model.embed_tokens, QuantizedLinear) and model.embed_tokens.bits == 8  # tied: also the head
    packed = sum(m.nbytes for m in [*matrices, model.embed_tokens])
    bf16 = 2 * sum(m.out_features * m.in_features for m in [*matrices, model.embed_tokens])
    print(f"matrices: {packed / 2**20:.1f} MiB packed vs {bf16 / 2**20:.1f} MiB in bfloat16 ({packed / bf16:.3f}x)")
    assert packed / bf16 < 0.37  # Q4_1 is 5 bits a weight, Q8_0 8.5: (106M * 5 + 28M * 8.5) / (134M * 16)


def test_same_greedy_text_as_dequantized(smollm2_gguf, monkeypatch):
    # The exact route (float activations): the default rounds activations to 8 bits as llama.cpp does,
    # which keeps the perplexity (test_quantized_llm.py) but not every greedy token.
    monkeypatch.setattr(cpu_int8_matmul, "load_kernel", lambda bits, group_size: None)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    kw = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "kv_cache_memory": 64 << 20}
    texts = {}
    for quantization in ("gguf", "none"):
        llm = LLM(str(smollm2_gguf), quantization=quantization, **kw)
        texts[quantization] = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        del llm
    assert texts["gguf"] == texts["none"]
    assert "Paris" in texts["gguf"][0], texts["gguf"][0]


def test_same_perplexity_as_dequantized(smollm2_gguf):
    tokens = load_tokenizer(smollm2_gguf)(PASSAGE).input_ids
    results = {}
    for quantization in ("gguf", "none"):
        logits = sequence_logits(load_model(smollm2_gguf, torch.float32, "cpu", quantization=quantization), tokens)
        results[quantization] = perplexity(logits, tokens)
    print(f"perplexity: packed {results['gguf']:.5f}, dequantized {results['none']:.5f}")
    assert results["gguf"] == pytest.approx(results["none"], rel=1e-4)
    assert results["gguf"] < 50
