"""The offline LLM API and LLMEngine behaviour: inputs, stop conditions, n, aborts, errors, stats."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config import ConfigError, EngineConfig
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.request import InvalidRequestError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=128, max_num_seqs=8)


def engine_of(llm: LLM) -> LLMEngine:
    return llm.llm_engine


def run_to_completion(engine: LLMEngine, max_steps: int = 500) -> dict:
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    assert not engine.has_unfinished_requests()
    return done


def test_importing_the_cli_does_not_import_torch():
    code = "import sys, kvpilot.engine.cli, kvpilot.engine; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_generate_accepts_strings_token_lists_and_mixtures_in_order(llm):
    tokenizer = llm.get_tokenizer()
    text = "the quick brown fox"
    ids = tokenizer(text).input_ids
    single = llm.generate(text, GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].prompt == text and single[0].prompt_token_ids == ids
    assert len(single[0].outputs[0].token_ids) == 8
    assert single[0].outputs[0].finish_reason == "length"
    assert single[0].outputs[0].text == tokenizer.decode(single[0].outputs[0].token_ids, skip_special_tokens=True)

    from_ids = llm.generate(ids, GREEDY, use_tqdm=False)
    assert from_ids[0].prompt is None
    assert from_ids[0].outputs[0].token_ids == single[0].outputs[0].token_ids

    mixed = llm.generate([ids, "another prompt", text], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in (mixed[0], mixed[2])] == [single[0].outputs[0].token_ids] * 2
    assert mixed[1].prompt == "another prompt"


def test_one_sampling_params_per_prompt(llm):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 1, 5)]
    outputs = llm.generate(["a b", "c d e", "f"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 1, 5]
    with pytest.raises(InvalidRequestError, match="sampling_params"):
        llm.generate(["a", "b"], params, use_tqdm=False)


def test_n_sequences_come_back_in_one_output(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    (output,) = llm.generate("hello there", params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in output.outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1  # different seeds per sequence


def test_n_sequences_share_the_prompt_through_the_prefix_cache(llm):
    engine = engine_of(llm)
    before = engine.stats().prefix_cache_hits_total
    prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=3, ignore_eos=True)
    (output,) = llm.generate(prompt, params, use_tqdm=False)
    assert len(output.outputs) == 4 and output.finished
    assert engine.stats().prefix_cache_hits_total - before >= 3 * 32


def test_logprobs_are_returned_per_token(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    (output,) = llm.generate("log probs", params, use_tqdm=False)
    completion = output.outputs[0]
    assert len(completion.logprobs) == 4
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        assert token_id in entry and len(entry) >= 3
        assert entry[token_id] == max(entry.values())  # greedy takes the most likely token
    expected = sum(entry[t] for t, entry in zip(completion.token_ids, completion.logprobs))
    assert completion.cumulative_logprob == pytest.approx(expected)


def test_stop_token_ids_and_eos(llm):
    (free,) = llm.generate("stop here", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    tokens = free.outputs[0].token_ids
    stop_at = tokens[3]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_at])
    (stopped,) = llm.generate("stop here", params, use_tqdm=False)
    completion = stopped.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_at
    assert completion.token_ids == tokens[: tokens.index(stop_at) + 1]


def test_stop_string_truncates_text(llm):
    (free,) = llm.generate("some words", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    text = free.outputs[0].text
    stop = text.strip()[2:5]
    assert stop, "the model produced too little text for this test"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])
    (stopped,) = llm.generate("some words", params, use_tqdm=False)
    completion = stopped.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == text[: text.index(stop)]


MIN_TOKENS_PROMPT = "min tokens"


@pytest.fixture(scope="module")
def first_token(llm) -> int:
    """The token the tiny model greedily writes first for MIN_TOKENS_PROMPT."""
    (free,) = llm.generate(MIN_TOKENS_PROMPT, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return free.outputs[0].token_ids[0]


@pytest.fixture(scope="module")
def eos_first_llm(tiny_model_dir, tmp_path_factory, first_token) -> LLM:
    """The tiny model with that first token listed as an EOS token too (generation_config.json may list
    several, as Llama 3's does): a random model that ends at once, where it would almost never emit its own EOS."""
    folder = tmp_path_factory.mktemp("eos_first") / "model"
    shutil.copytree(tiny_model_dir, folder)
    generation_config = json.loads((folder / "generation_config.json").read_text())
    generation_config["eos_token_id"] = [generation_config["eos_token_id"], first_token]
    (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return LLM(str(folder), dtype="float32", device="cpu", max_model_len=128, max_num_seqs=8)


def test_min_tokens_holds_back_the_eos_the_model_would_write_first(eos_first_llm, first_token):
    (ended,) = eos_first_llm.generate(MIN_TOKENS_PROMPT, SamplingParams(temperature=0.0, max_tokens=8),
                                      use_tqdm=False)
    assert ended.outputs[0].token_ids == [first_token] and ended.outputs[0].finish_reason == "stop"
    params = SamplingParams(temperature=0.0, min_tokens=5, max_tokens=5)
    (output,) = eos_first_llm.generate(MIN_TOKENS_PROMPT, params, use_tqdm=False)
    completion = output.outputs[0]
    assert len(completion.token_ids) == 5 and first_token not in completion.token_ids
    assert completion.finish_reason == "length"


def test_min_tokens_holds_back_a_stop_token_the_model_would_write_first(llm, first_token):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[first_token])
    (ended,) = llm.generate(MIN_TOKENS_PROMPT, params, use_tqdm=False)
    assert ended.outputs[0].token_ids == [first_token] and ended.outputs[0].stop_reason == first_token
    params = SamplingParams(temperature=0.0, min_tokens=4, max_tokens=8, ignore_eos=True,
                            stop_token_ids=[first_token])
    (output,) = llm.generate(MIN_TOKENS_PROMPT, params, use_tqdm=False)
    token_ids = output.outputs[0].token_ids
    assert len(token_ids) >= 4 and first_token not in token_ids[:4]


def test_seeded_sampling_is_reproducible_regardless_of_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    (alone,) = llm.generate("reproducible", seeded, use_tqdm=False)
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(
        ["x y z", "reproducible", "a much longer prompt with several more words in it"],
        [others, seeded, others],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_bad_requests_raise_clearly_and_the_engine_keeps_serving(llm):
    engine = engine_of(llm)
    engine.add_request("good", [5, 6, 7], GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(InvalidRequestError, match="max_model_len is 128"):
        engine.add_request("long", [5] * 128, GREEDY)
    with pytest.raises(InvalidRequestError, match=r"max_tokens \(100\).*max_model_len \(128\)"):
        engine.add_request("long-out", [5] * 50, SamplingParams(max_tokens=100))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request("oov", [5, 10**6], GREEDY)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request("negative", [-1], GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("good", [1], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    done = run_to_completion(engine)
    assert list(done) == ["good"] and len(done["good"].outputs[0].token_ids) == 8

    with pytest.raises(InvalidRequestError, match="prompt 1"):
        llm.generate(["fine", []], GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests()  # the good prompt of the failed batch was withdrawn
    assert len(llm.generate("still serving", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_abort_frees_blocks_at_once(llm):
    engine = engine_of(llm)
    engine.add_request("a", list(range(10, 60)), GREEDY)
    engine.add_request("b", list(range(10, 30)), GREEDY)
    engine.step()
    assert engine.stats().kv_cache_usage > 0
    engine.abort_request("a")
    engine.abort_request(["b", "unknown"])
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_running == 0 and stats.num_waiting == 0
    assert engine.step() == []


def test_streaming_outputs_are_cumulative_and_timed(llm):
    engine = engine_of(llm)
    engine.add_request("s", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen.append(list(output.outputs[0].token_ids))
    assert [len(t) for t in seen] == [1, 2, 3, 4]
    assert all(seen[-1][: len(t)] == t for t in seen)
    metrics = output.metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time
    assert metrics.first_token_time <= metrics.last_token_time <= metrics.finished_time


def test_stats_and_live_limits(llm):
    engine = engine_of(llm)
    before = engine.stats()
    llm.generate(["one two", "three four five"], GREEDY, use_tqdm=False)
    after = engine.stats()
    assert after.generation_tokens_total - before.generation_tokens_total == 16
    assert after.prompt_tokens_total > before.prompt_tokens_total
    assert after.steps_total > before.steps_total
    assert after.num_kv_blocks == engine.num_kv_blocks
    assert 0 < after.kv_utilization_mean <= 1
    engine.set_scheduler_limits(max_num_seqs=2, max_num_batched_tokens=64)
    assert engine.stats().max_num_seqs == 2 and engine.stats().max_num_batched_tokens == 64
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.set_scheduler_limits(max_num_seqs=0)
    engine.set_scheduler_limits(max_num_seqs=8, max_num_batched_tokens=2048)


def test_config_errors_name_the_field(tiny_model_dir):
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(model=str(tiny_model_dir), block_size=12)
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(model=str(tiny_model_dir), gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(model=str(tiny_model_dir), dtype="int8")
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(str(tiny_model_dir), device="cpu", max_model_len=10**6)


def test_kv_budget_too_small_says_what_is_needed(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"max_model_len=128 needs 8 blocks"):
        LLM(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=128, kv_cache_memory=10_000)


def test_on_a_cpu_the_memory_fraction_sizes_the_kv_cache_within_the_memory_limit(tiny_model_dir):
    from kvpilot.engine.startup import resident_bytes

    limit = resident_bytes() + (512 << 20)  # the process (torch, the test session) and 512 MiB more

    def blocks(fraction: float, **more) -> int:
        llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=128, cpu_memory_limit=limit,
                  gpu_memory_utilization=fraction, **more)
        return llm.llm_engine.resolved.num_kv_blocks

    block_bytes = LLM(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=128,
                      kv_cache_memory=1 << 20).llm_engine.resolved.kv_block_bytes
    low, high = blocks(0.9), blocks(1.0)
    # 10% of the limit more is (nearly: the process grows a little between loads) 10% more blocks.
    assert 0.8 < (high - low) * block_bytes / (0.1 * limit) < 1.2, (low, high)
    assert blocks(0.9, kv_cache_memory=1 << 20) * block_bytes <= 1 << 20  # an explicit size wins
    with pytest.raises(ConfigError, match="from gpu_memory_utilization of cpu_memory_limit"):
        blocks(0.05)


def test_missing_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"), device="cpu")


def test_derived_limits_are_resolved_once_from_the_config():
    from kvpilot.engine.config import (
        blocks_from_budget,
        resolve_max_model_len,
        resolve_max_num_batched_tokens,
    )

    chunked = EngineConfig(model="m", max_num_seqs=8)
    assert resolve_max_model_len(chunked, 4096) == 4096
    assert resolve_max_num_batched_tokens(chunked, 4096) == 2048
    whole = EngineConfig(model="m", max_num_seqs=8, enable_chunked_prefill=False)
    assert resolve_max_num_batched_tokens(whole, 4096) == 4096  # a whole prompt must fit one step
    with pytest.raises(ConfigError, match="chunked prefill disabled"):
        resolve_max_num_batched_tokens(
            EngineConfig(model="m", max_num_seqs=8, max_num_batched_tokens=512, enable_chunked_prefill=False), 4096
        )
    assert blocks_from_budget(budget_bytes=10_000, block_bytes=1000, block_size=16, max_model_len=100, source="x") == 10
    with pytest.raises(ConfigError, match=r"needs 7 blocks \(0.0 MiB\): raise x or lower max_model_len"):
        blocks_from_budget(budget_bytes=5_000, block_bytes=1000, block_size=16, max_model_len=100, source="x")
