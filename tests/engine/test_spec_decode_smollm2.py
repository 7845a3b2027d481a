"""Speculative decoding on a real trained model: SmolLM2-135M-Instruct, asked to rewrite a passage.

The answer copies long runs of the prompt, so prompt lookup proposes tokens the model accepts;
greedy output must be the same tokens as without proposals, alone and in a batch.
"""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PASSAGE = (
    "The old lighthouse stood at the end of a narrow spit of rock. Every evening the keeper climbed the "
    "ninety steps to light the lamp, and every morning he climbed them again to put it out. Ships passed "
    "far out at sea, and none of them ever knew his name."
)
REQUESTS = [
    f"Rewrite this passage with small edits:\n\n{PASSAGE}",
    f"Copy this text, changing only a few words:\n\n{PASSAGE}",
    "What is the capital of France?",  # little to look up: mostly rejected or absent proposals
]


@pytest.fixture(scope="module")
def prompts(smollm2_gguf) -> list[str]:
    llm = LLM(str(smollm2_gguf), dtype="float32", device="cpu", max_model_len=512)
    tokenizer = llm.get_tokenizer()
    return [tokenizer.apply_chat_template([{"role": "user", "content": r}], add_generation_prompt=True,
                                          tokenize=False) for r in REQUESTS]


def generate(model, prompts, **kwargs):
    llm = LLM(str(model), dtype="float32", device="cpu", max_model_len=512, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm.llm_engine.stats()


def test_greedy_output_is_unchanged_and_proposals_are_accepted(smollm2_gguf, prompts):
    expected, plain = generate(smollm2_gguf, prompts, max_num_seqs=1)
    spec_config = {"method": "ngram", "num_speculative_tokens": 4}
    alone, stats = generate(smollm2_gguf, prompts, max_num_seqs=1, speculative_config=spec_config)
    assert alone == expected
    spec = stats.spec_decode
    assert spec.acceptance_rate > 0.3 and spec.mean_acceptance_length > 1.5, spec
    assert stats.steps_total < plain.steps_total  # several tokens per step
    batched, _ = generate(smollm2_gguf, prompts, max_num_seqs=3,
                          speculative_config={**spec_config, "disable_by_batch_size": 3})
    assert batched == expected
