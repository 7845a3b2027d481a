"""The tuning state: seeded from the spec, kept across reconciles, reseeded when the user edits the spec."""

from __future__ import annotations

import dataclasses
import json

from kvpilot.operator import spec, tuning_state
from kvpilot.operator.tuning_state import TuningState

TUNED = {"model": {"uri": "pvc://m"}, "engine": {"maxNumSeqs": 32},
         "tuning": {"slo": {"itlP99Seconds": 0.1}, "maxNumSeqs": {"min": 8, "max": 128}}}


def _stored(parsed, **changes):
    seed = TuningState.from_engine(parsed.engine)
    return tuning_state.configmap_data(dataclasses.replace(seed, **changes), seed)


def test_engine_file_is_what_kvpilot_serve_reads():
    data = tuning_state.configmap_data(TuningState(48, 4096, 0.9), TuningState(32, 4096, 0.9))
    assert json.loads(data["tuning.json"]) == {"maxNumSeqs": 48, "maxNumBatchedTokens": 4096}


def test_without_a_configmap_the_spec_is_the_state():
    parsed = spec.parse_spec(TUNED)
    assert tuning_state.resolve(parsed, None) == TuningState(32, None, 0.9)


def test_tuned_values_survive_a_reconcile():
    parsed = spec.parse_spec(TUNED)
    assert tuning_state.resolve(parsed, _stored(parsed, max_num_seqs=96)).max_num_seqs == 96


def test_tuned_values_are_clamped_into_narrowed_bounds():
    parsed = spec.parse_spec(TUNED)
    data = _stored(parsed, max_num_seqs=120, gpu_memory_utilization=0.5)
    narrowed = spec.parse_spec({**TUNED, "tuning": {**TUNED["tuning"], "maxNumSeqs": {"min": 8, "max": 64}}})
    state = tuning_state.resolve(narrowed, data)
    assert state.max_num_seqs == 64 and state.gpu_memory_utilization == 0.5


def test_editing_the_spec_engine_reseeds():
    parsed = spec.parse_spec(TUNED)
    data = _stored(parsed, max_num_seqs=96)
    edited = spec.parse_spec({**TUNED, "engine": {"maxNumSeqs": 16}})
    assert tuning_state.resolve(edited, data).max_num_seqs == 16


def test_disabled_tuning_ignores_stored_values():
    parsed = spec.parse_spec(TUNED)
    data = _stored(parsed, max_num_seqs=96)
    off = spec.parse_spec({**TUNED, "tuning": {**TUNED["tuning"], "enabled": False}})
    assert tuning_state.resolve(off, data).max_num_seqs == 32


def test_corrupt_configmap_falls_back_to_the_spec():
    parsed = spec.parse_spec(TUNED)
    assert tuning_state.resolve(parsed, {"state.json": "{not json"}).max_num_seqs == 32
    bad = json.dumps({"current": {"maxNumSeqs": -1, "gpuMemoryUtilization": 0.9}, "seededFrom": {}})
    assert tuning_state.resolve(parsed, {"state.json": bad}).max_num_seqs == 32
