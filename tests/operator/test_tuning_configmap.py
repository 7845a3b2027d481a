"""The tuning ConfigMap: seeded from the spec, kept across reconciles, reseeded when the user edits the spec."""

from __future__ import annotations

import json

from kvpilot.engine.server.launcher import load_tuning_file
from kvpilot.operator import spec, tuning_configmap
from kvpilot.operator.spec import EngineSettings

TUNED = {"model": {"uri": "pvc://m"}, "engine": {"maxNumSeqs": 32},
         "tuning": {"slo": {"itlP99Seconds": 0.1}, "maxNumSeqs": {"min": 8, "max": 128}}}


def _stored(parsed, **changes):
    seed = EngineSettings.of(parsed.engine)
    return tuning_configmap.configmap_data(seed.replace(**changes), seed, {})


def test_engine_file_is_what_kvpilot_serve_reads(tmp_path):
    data = tuning_configmap.configmap_data(EngineSettings(max_num_seqs=48, max_num_batched_tokens=4096),
                                           EngineSettings(max_num_seqs=32, max_num_batched_tokens=4096),
                                           {"sql": "/mnt/loras/a/sql"})
    assert json.loads(data["tuning.json"]) == {"maxNumSeqs": 48, "maxNumBatchedTokens": 4096,
                                               "loraModules": [{"name": "sql", "path": "/mnt/loras/a/sql"}]}
    path = tmp_path / "tuning.json"
    path.write_text(data["tuning.json"])
    assert load_tuning_file(path) == {"max_num_seqs": 48, "max_num_batched_tokens": 4096,
                                      "lora_modules": {"sql": "/mnt/loras/a/sql"}}


def test_without_a_configmap_the_spec_is_the_state():
    parsed = spec.parse_spec(TUNED)
    assert tuning_configmap.settings_in_effect(parsed, None) == EngineSettings(max_num_seqs=32)


def test_tuned_values_survive_a_reconcile():
    parsed = spec.parse_spec(TUNED)
    assert tuning_configmap.settings_in_effect(parsed, _stored(parsed, max_num_seqs=96)).max_num_seqs == 96


def test_tuned_values_are_clamped_into_narrowed_bounds():
    parsed = spec.parse_spec(TUNED)
    data = _stored(parsed, max_num_seqs=120, gpu_memory_utilization=0.5)
    narrowed = spec.parse_spec({**TUNED, "tuning": {**TUNED["tuning"], "maxNumSeqs": {"min": 8, "max": 64}}})
    state = tuning_configmap.settings_in_effect(narrowed, data)
    assert state.max_num_seqs == 64 and state.gpu_memory_utilization == 0.5


def test_clamping_keeps_the_token_budget_valid():
    tuning = spec.Tuning.model_validate({**TUNED["tuning"], "maxNumSeqs": {"min": 40, "max": 64}})
    clamped = tuning.clamp(EngineSettings(max_num_seqs=16, max_num_batched_tokens=16))
    assert (clamped.max_num_seqs, clamped.max_num_batched_tokens) == (40, 40)


def test_editing_the_spec_engine_reseeds():
    parsed = spec.parse_spec(TUNED)
    data = _stored(parsed, max_num_seqs=96)
    edited = spec.parse_spec({**TUNED, "engine": {"maxNumSeqs": 16}})
    assert tuning_configmap.settings_in_effect(edited, data).max_num_seqs == 16


def test_disabled_tuning_ignores_stored_values():
    parsed = spec.parse_spec(TUNED)
    data = _stored(parsed, max_num_seqs=96)
    off = spec.parse_spec({**TUNED, "tuning": {**TUNED["tuning"], "enabled": False}})
    assert tuning_configmap.settings_in_effect(off, data).max_num_seqs == 32


def test_corrupt_configmap_falls_back_to_the_spec():
    parsed = spec.parse_spec(TUNED)
    assert tuning_configmap.settings_in_effect(parsed, {"state.json": "{not json"}).max_num_seqs == 32
    bad = json.dumps({"current": {"maxNumSeqs": -1, "gpuMemoryUtilization": 0.9}, "seededFrom": {}})
    assert tuning_configmap.settings_in_effect(parsed, {"state.json": bad}).max_num_seqs == 32


def test_a_state_written_before_the_settings_type_still_reads():
    # What the operator wrote before EngineSettings: every key, null for an unset token budget.
    old = {"maxNumSeqs": 48, "maxNumBatchedTokens": None, "gpuMemoryUtilization": 0.9}
    seed = {"maxNumSeqs": 32, "maxNumBatchedTokens": None, "gpuMemoryUtilization": 0.9}
    data = {"state.json": json.dumps({"current": old, "seededFrom": seed})}
    assert tuning_configmap.settings_in_effect(spec.parse_spec(TUNED), data).max_num_seqs == 48
