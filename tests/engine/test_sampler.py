"""Sampler behaviour and SamplingParams validation."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kvpilot.engine.sampler import Sampler, SamplingInput
from kvpilot.engine.sampling_params import SamplingParams

EOS = 2
VOCAB = 50


def make_input(params=None, prompt=(5, 6), output=(), seed=None):
    params = params or SamplingParams(temperature=0.0)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingInput(params, prompt_token_ids=list(prompt), output_token_ids=list(output), generator=generator)


def random_logits(rows, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def draw_many(logits_row, params, draws=2000, seed=0):
    """Sample `draws` tokens from one row, one request per row so all draws are independent."""
    sampler = Sampler([EOS])
    gen = torch.Generator().manual_seed(seed)
    inputs = [SamplingInput(params, [5], [], gen) for _ in range(draws)]
    return Counter(sampler.sample(logits_row.expand(draws, -1).clone(), inputs).token_ids)


def test_greedy_is_argmax():
    logits = random_logits(4)
    out = Sampler([EOS]).sample(logits, [make_input() for _ in range(4)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4


def test_low_temperature_concentrates_and_high_temperature_spreads():
    logits = random_logits(1)[0]
    cold = draw_many(logits, SamplingParams(temperature=0.05))
    hot = draw_many(logits, SamplingParams(temperature=5.0))
    assert cold.most_common(1)[0][0] == int(logits.argmax())
    assert cold.most_common(1)[0][1] > 1900
    assert len(hot) > 30


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2] + [0.0] * (VOCAB - 3)))
    counts = draw_many(logits, SamplingParams(temperature=1.0), draws=4000)
    assert set(counts) <= {0, 1, 2}
    for token, p in [(0, 0.5), (1, 0.3), (2, 0.2)]:
        assert abs(counts[token] / 4000 - p) < 0.03


def test_top_k_keeps_only_k_tokens():
    logits = random_logits(1)[0]
    counts = draw_many(logits, SamplingParams(temperature=1.0, top_k=3))
    assert set(counts) == set(logits.topk(3).indices.tolist())


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1] + [0.0] * (VOCAB - 4))
    counts = draw_many(probs.log(), SamplingParams(temperature=1.0, top_p=0.65))
    assert set(counts) == {0, 1}
    # Renormalised over the kept set: 0.4/0.7 and 0.3/0.7.
    assert abs(counts[0] / 2000 - 4 / 7) < 0.04


def test_top_p_always_keeps_the_most_likely_token():
    logits = random_logits(1)[0]
    counts = draw_many(logits, SamplingParams(temperature=1.0, top_p=1e-6))
    assert set(counts) == {int(logits.argmax())}


def test_min_p_drops_tokens_below_fraction_of_the_best():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (VOCAB - 4))
    counts = draw_many(probs.log(), SamplingParams(temperature=1.0, min_p=0.25))
    assert set(counts) == {0, 1, 2}


def test_per_row_settings_in_one_batch():
    """Each row's own settings pick a different token: a row sampled with another row's settings, or
    its token written to another row, changes the answer."""
    ranked = torch.zeros(VOCAB)
    ranked[EOS], ranked[10], ranked[11], ranked[12], ranked[13] = 5.0, 4.0, 3.0, 2.0, 1.0
    flat = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 0.1  # ~1/VOCAB each
    close = torch.zeros(VOCAB)
    close[20], close[21] = 1.0, 0.9  # cold, 20 is all but certain; at temperature 1 nearly anything goes
    rows = [  # (logits, settings, prompt, output, the token its settings pick; None: what it draws alone)
        (ranked, SamplingParams(temperature=0.0), [5], [], EOS),
        (ranked, SamplingParams(temperature=0.0, min_tokens=1), [5], [], 10),  # EOS masked
        # 5 / 10 and 4 / 10 fall below 3: both prompt tokens lose to 11.
        (ranked, SamplingParams(temperature=0.0, repetition_penalty=10.0), [EOS, 10], [], 11),
        # 5 - 2 x 2, 4 - 2 x 2 and 3 - 2 x 1 fall below 2: 12.
        (ranked, SamplingParams(temperature=0.0, frequency_penalty=2.0), [5], [EOS, EOS, 10, 10, 11], 12),
        # Random, but top_k=1 leaves one token, and min_tokens bans EOS and the stop tokens.
        (ranked, SamplingParams(temperature=1.0, top_k=1, min_tokens=1, stop_token_ids=[10, 11, 12], seed=1),
         [5], [], 13),
        (flat, SamplingParams(temperature=1.0, seed=7), [5], [], None),
        (flat, SamplingParams(temperature=1.0, top_k=3, seed=8), [5], [], None),
        (flat, SamplingParams(temperature=1.0, top_p=1e-9, seed=9), [5], [], int(flat.argmax())),
        (close, SamplingParams(temperature=0.01, seed=10), [5], [], 20),
    ]

    def inputs(params, prompt, output):
        return make_input(params, prompt=prompt, output=output, seed=params.seed)

    expected = [
        Sampler([EOS]).sample(logits[None].clone(), [inputs(*row)]).token_ids[0] if token is None else token
        for logits, *row, token in rows
    ]
    # Every row's answer is its own, so rows that swapped settings or tokens cannot go unseen.
    assert len(set(expected)) == len(rows)
    out = Sampler([EOS]).sample(torch.stack([logits for logits, *_ in rows]), [inputs(*row) for _, *row, _ in rows])
    assert out.token_ids == expected


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4], logits[0, 7] = 2.0, -1.0, 1.9
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    out = Sampler([EOS]).sample(logits, [make_input(params, prompt=[3], output=[4])])
    assert out.token_ids == [7]  # 3 was seen (2.0 -> 1.0), so the unseen 1.9 wins


def test_frequency_and_presence_penalties_use_output_tokens_only():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4] = 1.0, 0.5
    sampler = Sampler([EOS])
    # Token 3 only in the prompt: presence/frequency penalties do not touch it.
    prompt_only = make_input(SamplingParams(temperature=0.0, presence_penalty=2.0), prompt=[3])
    assert sampler.sample(logits, [prompt_only]).token_ids == [3]
    presence = make_input(SamplingParams(temperature=0.0, presence_penalty=0.6), output=[3])
    assert sampler.sample(logits, [presence]).token_ids == [4]
    # Frequency scales with the count: 1.0 - 3 * 0.2 = 0.4 < 0.5.
    frequency = make_input(SamplingParams(temperature=0.0, frequency_penalty=0.2), output=[3, 3, 3])
    assert sampler.sample(logits, [frequency]).token_ids == [4]
    once = make_input(SamplingParams(temperature=0.0, frequency_penalty=0.2), output=[3])
    assert sampler.sample(logits, [once]).token_ids == [3]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 9], logits[0, 11] = 5.0, 4.0, 1.0
    sampler = Sampler([EOS])
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9])
    assert sampler.sample(logits, [make_input(params, output=[1, 1])]).token_ids == [11]
    assert sampler.sample(logits, [make_input(params, output=[1, 1, 1])]).token_ids == [EOS]
    # With ignore_eos, EOS is an ordinary token and is not masked.
    ignoring = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert sampler.sample(logits, [make_input(ignoring, output=[])]).token_ids == [EOS]


def test_logprobs_are_the_models_log_softmax():
    logits = random_logits(2)
    params = SamplingParams(temperature=0.0, logprobs=3)
    out = Sampler([EOS]).sample(logits, [make_input(params), make_input(SamplingParams(temperature=0.0, logprobs=0))])
    expected = logits.log_softmax(-1)
    top = expected[0].topk(3)
    assert set(out.logprobs[0]) == set(top.indices.tolist())
    for token, value in out.logprobs[0].items():
        assert math.isclose(value, expected[0, token].item(), abs_tol=1e-5)
    assert list(out.logprobs[1]) == [out.token_ids[1]]
    assert all(v <= 0 for v in out.logprobs[0].values())


def test_logprobs_include_the_sampled_token_outside_the_top_k():
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 10.0
    params = SamplingParams(temperature=1.0, logprobs=1, min_tokens=1, stop_token_ids=[0])
    out = Sampler([EOS]).sample(logits, [make_input(params, seed=0)])
    assert out.token_ids[0] != 0
    assert set(out.logprobs[0]) == {0, out.token_ids[0]}


def test_seeded_request_is_reproducible_regardless_of_batch():
    logits = random_logits(6, seed=4)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123)

    def run(batch_rows, target_row):
        sampler = Sampler([EOS])
        gens = {target_row: torch.Generator().manual_seed(123)}
        tokens = []
        for _ in range(20):
            inputs = [
                SamplingInput(params if r == target_row else SamplingParams(temperature=1.0), [5], [], gens.get(r))
                for r in range(batch_rows)
            ]
            batch_logits = logits[:batch_rows].clone()
            batch_logits[target_row] = logits[0]
            tokens.append(sampler.sample(batch_logits, inputs).token_ids[target_row])
        return tokens

    alone = run(1, 0)
    assert alone == run(6, 3) == run(4, 2)
    assert len(set(alone)) > 1  # the draws really are random


def test_mismatched_rows_are_rejected():
    with pytest.raises(ValueError, match="2 rows of logits for 1 sampling inputs"):
        Sampler([EOS]).sample(random_logits(2), [make_input()])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n must be an integer >= 1"),
        ({"temperature": -0.5}, "temperature must be a number >= 0"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k must be an integer >= 1, or 0 or -1"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"presence_penalty": 3.0}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a number > 0"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"min_tokens": -1}, "min_tokens must be an integer >= 0"),
        ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens \(5\) must be at most max_tokens \(4\)"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
        ({"stop": ["ok", ""]}, r"stop\[1\] must be a non-empty string"),
        ({"stop_token_ids": [3, -1]}, r"stop_token_ids\[1\]"),
        ({"seed": "7"}, "seed must be an integer"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_defaults_and_normalisation():
    params = SamplingParams(stop="###", top_k=-1, max_tokens=None)
    assert params.stop == ["###"]
    assert not params.uses_top_k and params.max_tokens is None
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy
