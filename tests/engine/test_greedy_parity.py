"""The engine's greedy tokens equal Hugging Face transformers' generate, for every supported family."""

from __future__ import annotations

import random

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 32



@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_greedy_tokens_match_transformers_generate(tiny_model_dirs, arch):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dirs[arch]
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 1000) for _ in range(length)] for length in (3, 11, 26, 40, 57)]

    hf_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            # One prompt per call: no padding, so nothing but the model's own numerics differ.
            # min_new_tokens masks EOS exactly like the engine's min_tokens does.
            out = hf_model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )
            expected.append(out[0, len(prompt) :].tolist())

    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_model_len=256, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    assert all(len(tokens) == NEW_TOKENS for tokens in expected)
    assert got == expected
