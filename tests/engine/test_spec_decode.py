"""Speculative decoding: config, n-gram proposals, rejection sampling, KV rollback, and the engine.

Greedy output with proposals must equal greedy output without them under every schedule the
engine has (batching with and without proposals in one step, chunked prefill, prefix caching,
preemption); sampled output must follow the target's distribution, which the chi-square tests
check with fixed seeds.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.kv_cache_manager import KVCacheManager
from kvpilot.engine.request import Request
from kvpilot.engine.sampler import SamplingInput
from kvpilot.engine.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from kvpilot.engine.spec_decode.ngram_proposer import NgramProposer
from kvpilot.engine.spec_decode.rejection_sampler import rejection_sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_MODEL_LEN = 160
NEW_TOKENS = 64  # long enough for the random model to fall into loops prompt lookup predicts
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 64}


# --- config -------------------------------------------------------------------------------


def test_config_defaults_and_round_trip():
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert config.prompt_lookup_min <= config.prompt_lookup_max and config.model is None
    assert SpeculativeConfig.from_dict(config.to_dict()) == config
    assert SpeculativeConfig.from_dict(None) is None


@pytest.mark.parametrize(
    "value, field",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
         "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/m"}, "model"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ],
)
def test_config_errors_name_the_key(value, field):
    with pytest.raises(SpeculativeConfigError, match=field):
        SpeculativeConfig.from_dict(value)


# --- n-gram proposer ----------------------------------------------------------------------


def test_ngram_takes_the_continuation_of_the_longest_recurring_tail():
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    # tail (7, 8, 9) occurred at 1..3, followed by 10, 11; (9) alone also occurs later, followed by 5.
    tokens = [0, 7, 8, 9, 10, 11, 12, 9, 5, 7, 8, 9]
    assert proposer.lookup(tokens, 2) == [10, 11]
    assert proposer.lookup(tokens, 5) == [10, 11, 12, 9, 5]


def test_ngram_prefers_the_most_recent_match_and_falls_back_to_shorter_tails():
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    assert proposer.lookup([4, 1, 2, 4, 3, 4], 1) == [3]  # (4) at 3 is newer than at 0
    assert proposer.lookup([1, 2, 3, 4, 5], 3) == []  # nothing recurs
    assert NgramProposer(prompt_lookup_min=2, prompt_lookup_max=3).lookup([4, 1, 2, 4, 3, 4], 1) == []


# --- rejection sampler --------------------------------------------------------------------

VOCAB = 6
CHI2_ALPHA_Z = 3.09  # standard normal quantile of 1 - 0.001


def chi2_critical(df: int, z: float = CHI2_ALPHA_Z) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: Counter, probs: list[float], total: int) -> float:
    return sum((counts[t] - total * p) ** 2 / (total * p) for t, p in enumerate(probs))


def greedy_input():
    return SamplingInput(SamplingParams(temperature=0.0), [1], [], None)


def test_greedy_accepts_while_the_proposal_is_the_argmax_then_emits_the_argmax():
    logits = torch.full((4, VOCAB), -5.0)
    for row, best in enumerate([3, 1, 4, 2]):
        logits[row, best] = 5.0
    assert rejection_sample(logits, [[3, 1, 4]], [greedy_input()]) == [[3, 1, 4, 2]]  # all accepted + bonus
    assert rejection_sample(logits, [[3, 5, 4]], [greedy_input()]) == [[3, 1]]  # second rejected
    assert rejection_sample(logits[:1], [[]], [greedy_input()]) == [[3]]


def draw_first_two(target: torch.Tensor, draft_dist: list[float], trials: int, seed: int, sampler=rejection_sample):
    """Per trial: proposals d0, d1 drawn from draft_dist, verified against target rows [3, VOCAB];
    returns the counts of the first emitted token, and of the second one given the first is d0."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0)
    logits = target.log().repeat(trials, 1)  # [3 * trials, VOCAB]
    drafts = [rng.choices(range(VOCAB), draft_dist, k=2) for _ in range(trials)]
    inputs = [SamplingInput(params, [1], [], generator) for _ in range(trials)]
    emitted = sampler(logits, drafts, inputs)
    first = Counter(tokens[0] for tokens in emitted)
    second = Counter(tokens[1] for tokens, draft in zip(emitted, drafts) if tokens[0] == draft[0] == 2)
    return first, second


TARGET = torch.tensor([[0.05, 0.10, 0.40, 0.25, 0.15, 0.05],
                       [0.30, 0.05, 0.05, 0.20, 0.30, 0.10],
                       [1 / 6] * 6])  # fmt: skip
# Proposals that disagree with the target: token 2 often, token 5 (target 5%) far too often.
DRAFT_DIST = [0.05, 0.05, 0.45, 0.05, 0.05, 0.35]


def test_sampled_tokens_follow_the_target_distribution():
    trials = 20_000
    first, second = draw_first_two(TARGET, DRAFT_DIST, trials, seed=0)
    assert chi2(first, TARGET[0].tolist(), trials) < chi2_critical(VOCAB - 1)
    # The second token, when the first was the accepted proposal 2, follows the second row.
    n = sum(second.values())
    assert n > 2000
    assert chi2(second, TARGET[1].tolist(), n) < chi2_critical(VOCAB - 1)


def test_the_chi_square_check_catches_a_sampler_that_keeps_every_proposal():
    def accept_everything(logits, drafts, inputs):
        return [list(d) + [0] for d in drafts]

    trials = 20_000
    first, _ = draw_first_two(TARGET, DRAFT_DIST, trials, seed=0, sampler=accept_everything)
    assert chi2(first, TARGET[0].tolist(), trials) > chi2_critical(VOCAB - 1)


def test_top_k_applies_to_proposals_too():
    # With top_k=1 only the argmax survives: a proposal of anything else is always rejected.
    params = SamplingParams(temperature=1.0, top_k=1)
    generator = torch.Generator().manual_seed(0)
    logits = TARGET.log()
    for _ in range(50):
        (tokens,) = rejection_sample(logits, [[5, 0]], [SamplingInput(params, [1], [], generator)])
        assert tokens == [2]


# --- KV cache rollback --------------------------------------------------------------------


def test_trim_frees_blocks_of_rejected_proposals_and_they_are_never_cached():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    request = Request("a", list(range(10, 16)), params=None, arrival_time=0.0)  # 6 verified tokens
    assert manager.allocate_slots(request, 6) is not None
    request.num_computed_tokens = 6
    request.append_output_token(16)  # sampled, not computed yet
    request.spec_token_ids = [17, 18, 19, 20, 21]
    # Verify token 16 and the 5 proposals: slots up to 12 tokens, 3 blocks.
    assert manager.allocate_slots(request, 6) is not None
    request.num_computed_tokens = 12
    assert len(manager.get_block_ids("a")) == 3
    # Only the first block is all verified tokens; the second holds proposals and stays uncached.
    assert len(manager.pool.cached) == 1
    # Two proposals accepted, three rejected: keep 7 + 2 = 9 computed tokens.
    request.spec_token_ids = []
    for token in (17, 18, 30):
        request.append_output_token(token)
    request.num_computed_tokens = 9
    manager.trim(request, 9)
    assert len(manager.get_block_ids("a")) == 3 and manager.utilization_counts() == (9, 12)
    manager.trim(request, 8)
    assert len(manager.get_block_ids("a")) == 2 and manager.num_free_blocks == 6
    request.num_computed_tokens = 8
    # The next allocation caches the second block, now made of verified tokens only.
    assert manager.allocate_slots(request, 2) is not None
    assert len(manager.pool.cached) == 2
    manager.free(request)
    assert manager.num_free_blocks == 8


# --- the engine on a random model -----------------------------------------------------------


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts that repeat themselves (so proposals exist), of varied lengths; three share a prefix."""
    rng = random.Random(0)
    shared = [rng.randrange(10, 1000) for _ in range(36)]
    result = []
    for i, (pattern, repeats) in enumerate(((5, 6), (9, 4), (3, 9), (12, 3), (7, 5), (4, 8))):
        unit = [rng.randrange(10, 1000) for _ in range(pattern)]
        body = unit * repeats
        result.append(shared + body if i % 2 else body)
    return result


def generate(model_dir, prompts, params, **kwargs):
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN, **kwargs)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm.llm_engine


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts) -> list[list[int]]:
    tokens, _ = generate(tiny_model_dir, prompts, GREEDY, max_num_seqs=1, enable_prefix_caching=False)
    return tokens


def assert_speculated(engine):
    spec = engine.stats().spec_decode
    assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0, spec
    return spec


def test_greedy_output_is_unchanged_one_sequence_at_a_time(tiny_model_dir, prompts, reference):
    tokens, engine = generate(
        tiny_model_dir, prompts, GREEDY, max_num_seqs=1, enable_prefix_caching=False, speculative_config=NGRAM
    )
    assert tokens == reference
    spec = assert_speculated(engine)
    stats = engine.stats()
    # Fewer steps than tokens: accepted proposals came out several per step.
    assert stats.generation_tokens_total == len(prompts) * NEW_TOKENS
    assert spec.num_accepted_tokens == sum(spec.accepted_per_pos)


def test_greedy_output_is_unchanged_with_and_without_proposals_in_one_batch(tiny_model_dir, prompts, reference):
    # Penalised requests get no proposals; a penalty of exactly 1.0 changes nothing in their output.
    params = [GREEDY if i % 2 else SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                                   repetition_penalty=1.0 + 1e-9)
              for i in range(len(prompts))]
    tokens, engine = generate(tiny_model_dir, prompts, params, max_num_seqs=8, speculative_config=NGRAM,
                              enable_prefix_caching=False)
    assert tokens == reference
    assert_speculated(engine)
    assert engine.stats().step_running_seqs_total > engine.stats().steps_total


def test_greedy_output_is_unchanged_under_chunked_prefill_and_prefix_caching(tiny_model_dir, prompts, reference):
    # A budget of 7 tokens cuts prompts into chunks and proposals short.
    tokens, engine = generate(
        tiny_model_dir, prompts, GREEDY, max_num_seqs=4, max_num_batched_tokens=7, enable_prefix_caching=True,
        speculative_config=NGRAM,
    )
    assert tokens == reference
    assert_speculated(engine)
    assert engine.stats().prefix_cache_hits_total > 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_greedy_output_is_unchanged_under_preemption(tiny_model_dir, prompts, reference, prefix_caching):
    probe = LLM(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN)
    block_bytes = probe.llm_engine.resolved.kv_block_bytes
    del probe
    tokens, engine = generate(
        tiny_model_dir, prompts, GREEDY, max_num_seqs=6, kv_cache_memory=12 * block_bytes,
        enable_prefix_caching=prefix_caching, speculative_config=NGRAM,
    )
    assert tokens == reference
    assert engine.stats().preemptions_total > 0
    assert_speculated(engine)
    assert engine.kv_cache_manager.num_free_blocks == 12  # every block came back


def test_no_proposals_while_the_batch_is_larger_than_disable_by_batch_size(tiny_model_dir, prompts, reference):
    config = {**NGRAM, "disable_by_batch_size": len(prompts) - 1}
    tokens, engine = generate(tiny_model_dir, prompts, GREEDY, max_num_seqs=8, speculative_config=config)
    assert tokens == reference
    # Every request has the same length, so all run until the end: speculation never starts.
    assert engine.stats().spec_decode.num_drafts == 0


def test_num_speculative_tokens_is_live_tunable(tiny_model_dir, prompts, reference):
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
              speculative_config=NGRAM)
    engine = llm.llm_engine
    engine.set_num_speculative_tokens(0)
    outputs = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference[:2]
    assert engine.stats().spec_decode.num_drafts == 0 and engine.stats().num_speculative_tokens == 0
    engine.set_num_speculative_tokens(5)
    outputs = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference[:2]
    assert engine.stats().spec_decode.num_drafts > 0 and len(engine.stats().spec_decode.accepted_per_pos) == 5
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine.set_num_speculative_tokens(-1)


def test_setting_k_without_speculation_says_how_to_turn_it_on(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN).llm_engine
    assert engine.stats().spec_decode is None
    with pytest.raises(ValueError, match="speculative-config"):
        engine.set_num_speculative_tokens(2)


def test_stop_tokens_and_max_tokens_cut_accepted_proposals(tiny_model_dir, prompts, reference):
    # Stop at the 10th reference token: output must end there even when it was an accepted proposal.
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, stop_token_ids=[tokens[9]])
              for tokens in reference]
    expected, _ = generate(tiny_model_dir, prompts, params, max_num_seqs=1)
    tokens, _ = generate(tiny_model_dir, prompts, params, max_num_seqs=1, speculative_config=NGRAM)
    assert tokens == expected
    short = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    tokens, _ = generate(tiny_model_dir, prompts, short, max_num_seqs=4, speculative_config=NGRAM)
    assert tokens == [t[:5] for t in reference]


def test_sampled_output_follows_the_target_distribution_end_to_end(tiny_model_dir, prompts):
    """Two samples of the generated tokens after the first (the ones proposals can decide), with and
    without proposals: a chi-square test of homogeneity over the most frequent tokens. The proposer
    is a draft model identical to the target (greedy), so every step proposes and the proposals
    are often but not always accepted."""
    prompt = prompts[2]
    draws = 1500
    params = SamplingParams(temperature=0.3, max_tokens=4, ignore_eos=True)  # acceptance about 1 in 4
    kwargs = {"max_num_seqs": 256, "max_num_batched_tokens": 4096, "enable_prefix_caching": True}
    plain, _ = generate(tiny_model_dir, [prompt] * draws, params, seed=1, **kwargs)
    spec, engine = generate(tiny_model_dir, [prompt] * draws, params, seed=2,
                            speculative_config={**draft_config(tiny_model_dir), "disable_by_batch_size": 4096},
                            **kwargs)
    spec_stats = engine.stats().spec_decode
    assert spec_stats.num_draft_tokens > draws and 0.1 < spec_stats.acceptance_rate < 0.95, spec_stats
    for position in (1, 2, 3):
        statistic, df = homogeneity_chi2(Counter(t[position] for t in plain), Counter(t[position] for t in spec))
        assert df >= 2
        assert statistic < chi2_critical(df), (position, statistic, df)


def homogeneity_chi2(a: Counter, b: Counter, min_count: int = 20) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of two equal-sized samples over the tokens seen at
    least min_count times in both together, plus one bin for the rest."""
    total_a, total_b = sum(a.values()), sum(b.values())
    assert total_a == total_b
    common = [t for t, n in (a + b).most_common() if n >= min_count]
    columns = [(a[t], b[t]) for t in common]
    columns.append((total_a - sum(x for x, _ in columns), total_b - sum(y for _, y in columns)))
    statistic = 0.0
    for x, y in columns:
        expected = (x + y) / 2
        if expected > 0:
            statistic += (x - expected) ** 2 / expected + (y - expected) ** 2 / expected
    return statistic, len(columns) - 1


# --- draft model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_model_dir(tmp_path_factory):
    """Another random `tiny` model: the target's vocabulary size, its own weights."""
    from kvpilot.engine.model_files import make_model

    return make_model(tmp_path_factory.mktemp("draft") / "llama", preset="tiny", arch="llama", seed=1)


def draft_config(model_dir) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3,
            "disable_by_batch_size": 64}


def test_a_draft_identical_to_the_target_is_almost_always_right(tiny_model_dir, prompts, reference):
    # The draft's KV must track the target's exactly (prompt chunks, rejected slots, prefix-cache
    # hits): any slip shows up as rejected proposals from a draft that is the target itself.
    tokens, engine = generate(tiny_model_dir, prompts, GREEDY, max_num_seqs=4, max_num_batched_tokens=9,
                              enable_prefix_caching=True, speculative_config=draft_config(tiny_model_dir))
    assert tokens == reference
    spec = engine.stats().spec_decode
    assert spec.num_drafts > 0 and spec.acceptance_rate > 0.95, spec
    assert engine.stats().prefix_cache_hits_total > 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_greedy_output_is_unchanged_with_another_draft_model_under_preemption(
    tiny_model_dir, draft_model_dir, prompts, reference, prefix_caching
):
    probe = LLM(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
                speculative_config=draft_config(draft_model_dir))
    block_bytes = probe.llm_engine.resolved.kv_block_bytes  # the target's and the draft's KV of a block
    del probe
    tokens, engine = generate(
        tiny_model_dir, prompts, GREEDY, max_num_seqs=6, kv_cache_memory=12 * block_bytes,
        enable_prefix_caching=prefix_caching, speculative_config=draft_config(draft_model_dir),
    )
    assert tokens == reference
    stats = engine.stats()
    assert stats.num_kv_blocks == 12 and stats.preemptions_total > 0 and stats.spec_decode.num_drafts > 0
    assert engine.kv_cache_manager.num_free_blocks == 12


def test_draft_model_must_share_the_vocabulary(tiny_model_dir, tmp_path):
    import json
    import shutil

    from kvpilot.engine.config import ConfigError

    other = tmp_path / "draft"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] += 1
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(str(tiny_model_dir), dtype="float32", device="cpu", speculative_config=draft_config(other))
