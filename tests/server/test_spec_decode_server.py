"""Speculative decoding through `kvpilot serve`: the flag, the same greedy text, /metrics, live k."""

from __future__ import annotations

import argparse
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot import engine_contract as names
from kvpilot.engine.server.args import ArgsError, add_serve_arguments, engine_overrides, resolve_serve_args
from kvpilot.engine.spec_decode.config import SpeculativeConfig

ADMIN_TOKEN = "admin-token"
PROMPT = "one two three four five six seven eight " * 6


def parse(argv: list[str], env: dict[str, str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return resolve_serve_args(parser.parse_args(argv), environ=env or {})


def test_the_flag_and_its_variable_take_json():
    args = parse(["/m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert engine_overrides(args)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4}
    args = parse(["/m"], env={"KVPILOT_SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 2}'})
    assert engine_overrides(args)["speculative_config"]["num_speculative_tokens"] == 2
    with pytest.raises(ArgsError, match="KVPILOT_SPECULATIVE_CONFIG"):
        parse(["/m"], env={"KVPILOT_SPECULATIVE_CONFIG": "[1, 2]"})


def test_serve_refuses_a_bad_config_naming_the_key(tiny_model_dir):
    done = subprocess.run(
        [sys.executable, "-P", "-m", "kvpilot", "serve", str(tiny_model_dir), "--device", "cpu",
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_mx": 3}'],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    assert "prompt_lookup_mx" in done.stderr and "known:" in done.stderr


@pytest.fixture(scope="module")
def servers(live_server_factory, tiny_model_dir):
    # The draft is the served model itself, so proposals are accepted (a random model's text rarely
    # repeats enough for prompt lookup); the ngram path through LLM is in tests/engine.
    spec_config = {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3,
                   "disable_by_batch_size": 8}
    plain = live_server_factory(admin_token=ADMIN_TOKEN, engine={"max_num_seqs": 8})
    spec = live_server_factory(admin_token=ADMIN_TOKEN, engine={
        "max_num_seqs": 8, "speculative_config": SpeculativeConfig.from_dict(spec_config)})
    return plain, spec


def samples(text: str) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if names.POSITION_LABEL in sample.labels:
                key += f"{{{sample.labels[names.POSITION_LABEL]}}}"
            values[key] = sample.value
    return values


def complete(live, prompt: str = PROMPT) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_greedy_text_is_the_same_and_metrics_count_the_proposals(servers):
    plain, spec = servers
    assert complete(spec) == complete(plain)
    values = samples(httpx.get(f"{spec.url}/metrics").text)
    assert values[names.SPEC_DECODE_NUM_SPECULATIVE_TOKENS] == 3
    drafted = values[names.SPEC_DECODE_NUM_DRAFT_TOKENS]
    accepted = values[names.SPEC_DECODE_NUM_ACCEPTED_TOKENS]
    drafts = values[names.SPEC_DECODE_NUM_DRAFTS]
    assert drafted > 0 and 0 < accepted <= drafted and drafts > 0
    assert values[names.SPEC_DECODE_ACCEPTANCE_RATE] == pytest.approx(accepted / drafted)
    assert values[names.SPEC_DECODE_MEAN_ACCEPTANCE_LENGTH] == pytest.approx(1 + accepted / drafts)
    per_pos = sum(values[f"{names.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS}{{{i}}}"] for i in range(3))
    assert per_pos == accepted
    # Without speculation the family is absent rather than zero.
    assert names.SPEC_DECODE_NUM_DRAFT_TOKENS not in samples(httpx.get(f"{plain.url}/metrics").text)


def test_num_speculative_tokens_changes_live_through_the_admin_api(servers):
    plain, spec = servers
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with httpx.Client(base_url=spec.admin_url, headers=admin, timeout=60) as http:
        assert http.get("/admin/v1/scheduler").json()["num_speculative_tokens"] == 3
        try:
            response = http.post("/admin/v1/scheduler", json={"num_speculative_tokens": 0})
            assert response.status_code == 200 and response.json()["num_speculative_tokens"] == 0
            before = spec.engine.stats().spec_decode.num_draft_tokens
            expected = complete(plain, PROMPT + "nine")
            assert complete(spec, PROMPT + "nine") == expected
            assert spec.engine.stats().spec_decode.num_draft_tokens == before  # paused
            response = http.post("/admin/v1/scheduler", json={"num_speculative_tokens": 99, "max_num_seqs": 4})
            assert response.status_code == 400 and response.json()["error"]["param"] == "num_speculative_tokens"
            assert http.get("/admin/v1/scheduler").json()["max_num_seqs"] == 8  # all or nothing
        finally:
            http.post("/admin/v1/scheduler", json={"num_speculative_tokens": 3})
    with httpx.Client(base_url=plain.admin_url, headers=admin, timeout=60) as http:
        response = http.post("/admin/v1/scheduler", json={"num_speculative_tokens": 2})
        assert response.status_code == 400 and "--speculative-config" in response.json()["error"]["message"]
