"""SamplingParams.output_kind: DELTA outputs carry only what is new and add up to the CUMULATIVE
output, stop strings and several tokens per step (speculative decoding) included; FINAL_ONLY is one
output at the end."""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM, RequestOutputKind, SamplingParams
from kvpilot.engine.outputs import RequestOutput

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DELTA = RequestOutputKind.DELTA
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=160, max_num_seqs=8)


def run(llm: LLM, prompt: str | list[int], params: SamplingParams) -> list[RequestOutput]:
    """Every output of one request, step by step."""
    engine = llm.llm_engine
    prompt_ids = llm.get_tokenizer().encode(prompt) if isinstance(prompt, str) else prompt
    engine.add_request("r", prompt_ids, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def concatenated(deltas: list[RequestOutput]) -> dict[int, tuple[list[int], str, list | None]]:
    """Per sequence index: its tokens, text and logprobs, joined across the deltas."""
    joined: dict[int, tuple[list[int], str, list | None]] = {}
    for output in deltas:
        for completion in output.outputs:
            tokens, text, logprobs = joined.get(completion.index, ([], "", None))
            if completion.logprobs is not None:
                logprobs = (logprobs or []) + completion.logprobs
            joined[completion.index] = (tokens + completion.token_ids, text + completion.text, logprobs)
    return joined


def cumulative(llm: LLM, prompt: str | list[int], params: SamplingParams) -> dict:
    """The same per-index view of the request run again with its own output_kind (CUMULATIVE)."""
    (output,) = llm.generate(prompt, params, use_tqdm=False)
    return {c.index: (c.token_ids, c.text, c.logprobs) for c in output.outputs}


def delta_params(params: SamplingParams) -> SamplingParams:
    return SamplingParams(**{**params.__dict__, "output_kind": DELTA})


def test_deltas_add_up_to_the_cumulative_output_tokens_text_and_logprobs(llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    deltas = run(llm, PROMPT, delta_params(params))
    assert len(deltas) == 12 and all(len(d.outputs[0].token_ids) == 1 for d in deltas)
    assert [d.finished for d in deltas] == [False] * 11 + [True]
    assert [d.outputs[0].finish_reason for d in deltas] == [None] * 11 + ["length"]
    assert concatenated(deltas) == cumulative(llm, PROMPT, params)
    tokens, _, logprobs = concatenated(deltas)[0]
    expected = sum(entry[token] for token, entry in zip(tokens, logprobs))
    assert deltas[-1].outputs[0].cumulative_logprob == pytest.approx(expected)  # the sum so far, not a delta's


def test_n_sequences_each_add_up_and_a_delta_names_only_sequences_with_new_tokens(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, logprobs=0)
    deltas = run(llm, PROMPT, delta_params(params))
    assert all(len(c.token_ids) >= 1 for d in deltas for c in d.outputs)
    assert concatenated(deltas) == cumulative(llm, PROMPT, params)


def test_a_stop_string_is_never_shown_then_taken_back(llm):
    (free,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    text = free.outputs[0].text
    stop = text.strip()[3:7]
    assert len(stop) == 4, "the model produced too little text for this test"
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    deltas = run(llm, PROMPT, delta_params(params))
    expected = text[: text.index(stop)]
    shown = ""
    for delta in deltas:
        shown += delta.outputs[0].text
        assert expected.startswith(shown), f"{shown!r} was shown, the answer is {expected!r}"
    assert shown == expected and deltas[-1].outputs[0].stop_reason == stop
    assert concatenated(deltas) == cumulative(llm, PROMPT, params)


def test_final_only_is_one_finished_output_equal_to_the_cumulative_one(llm):
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=5, ignore_eos=True)
    final_only = SamplingParams(**{**params.__dict__, "output_kind": RequestOutputKind.FINAL_ONLY})
    (output,) = run(llm, PROMPT, final_only)
    assert output.finished
    assert {c.index: (c.token_ids, c.text, c.logprobs) for c in output.outputs} == cumulative(llm, PROMPT, params)


def test_cumulative_outputs_grow_by_prefixes(llm):
    outputs = run(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    final = outputs[-1].outputs[0]
    for output in outputs:
        assert final.token_ids[: len(output.outputs[0].token_ids)] == output.outputs[0].token_ids
        assert final.text.startswith(output.outputs[0].text)


def test_deltas_with_several_tokens_per_step_under_speculative_decoding(tiny_model_dir):
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    spec_llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=160,
                   speculative_config=speculative)
    prompt = list(range(200, 207)) * 6  # repeats itself, so prompt lookup finds proposals
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)  # logprobs would turn proposals off
    deltas = run(spec_llm, prompt, delta_params(params))
    assert max(len(d.outputs[0].token_ids) for d in deltas) > 1, "no step accepted a proposal"
    assert concatenated(deltas) == cumulative(spec_llm, prompt, params)
