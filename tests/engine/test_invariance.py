"""Scheduling never changes greedy output: batch size, chunking, prefix caching, preemption."""

from __future__ import annotations

import random

import pytest

from kvpilot.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_MODEL_LEN = 128
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts of varied lengths; half share a 40-token prefix so the prefix cache has work."""
    rng = random.Random(0)
    shared = [rng.randrange(10, 1000) for _ in range(40)]
    result = []
    for i, length in enumerate((5, 17, 33, 48, 9, 61, 26, 70)):
        tail = [rng.randrange(10, 1000) for _ in range(length)]
        result.append((shared + tail)[: 40 + length // 2] if i % 2 else tail)
    return result


def greedy_tokens(model_dir, prompts, **engine_kwargs) -> tuple[list[list[int]], object]:
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm.llm_engine.stats()


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts) -> list[list[int]]:
    # One sequence at a time, whole prompts, nothing cached: the plainest schedule there is.
    tokens, _ = greedy_tokens(
        tiny_model_dir, prompts, max_num_seqs=1, enable_prefix_caching=False, enable_chunked_prefill=False
    )
    assert all(len(t) == NEW_TOKENS for t in tokens)
    return tokens


def test_many_sequences_per_batch(tiny_model_dir, prompts, reference):
    tokens, stats = greedy_tokens(tiny_model_dir, prompts, max_num_seqs=8, enable_prefix_caching=False)
    assert stats.step_running_seqs_total > stats.steps_total  # batches really held several sequences
    assert tokens == reference


def test_chunked_prefill_with_a_tiny_token_budget(tiny_model_dir, prompts, reference):
    tokens, _ = greedy_tokens(
        tiny_model_dir, prompts, max_num_seqs=4, max_num_batched_tokens=7, enable_prefix_caching=False
    )
    assert tokens == reference


def test_prefix_caching_with_shared_prefixes(tiny_model_dir, prompts, reference):
    tokens, stats = greedy_tokens(tiny_model_dir, prompts, max_num_seqs=2, enable_prefix_caching=True)
    assert stats.prefix_cache_hits_total >= 32  # the shared prefix was served from cache
    assert tokens == reference


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_forced_preemption_under_a_tiny_kv_budget(tiny_model_dir, prompts, reference, prefix_caching):
    probe = LLM(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN)
    block_bytes = probe.llm_engine.resolved.kv_block_bytes
    del probe
    # Room for barely more than one full-length sequence: eight sequences must take turns.
    tokens, stats = greedy_tokens(
        tiny_model_dir,
        prompts,
        max_num_seqs=8,
        kv_cache_memory=10 * block_bytes,
        enable_prefix_caching=prefix_caching,
    )
    assert stats.num_kv_blocks == 10
    assert stats.preemptions_total > 0
    assert tokens == reference
