"""The engine contract: what the operator writes and reads, the engine reads and writes, under the same names."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvpilot import engine_contract as contract
from kvpilot.engine.server import protocol
from kvpilot.engine.server.args import SERVE_FLAGS
from kvpilot.operator import builders, engine_metrics, tuning_configmap
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import EngineSettings, parse_spec


def test_the_admin_api_takes_and_answers_the_live_settings():
    assert set(protocol.SchedulerLimitsUpdate.model_fields) == set(contract.ADMIN_SETTINGS)
    assert set(protocol.SchedulerLimits.model_fields) == set(contract.ADMIN_SETTINGS)
    assert set(contract.LIVE_SETTINGS) <= set(contract.ADMIN_SETTINGS)


def test_the_engine_exports_every_metric_the_operator_reads(engine_metrics_page):
    exported = {s.name for f in text_string_to_metric_families(engine_metrics_page) for s in f.samples}
    read = set(engine_metrics.GAUGES) | set(engine_metrics.COUNTERS)
    read |= {f"{h}_{suffix}" for h in engine_metrics.HISTOGRAMS for suffix in ("bucket", "sum", "count")}
    assert read - exported == set()


def test_the_engine_pod_speaks_the_engines_names():
    flags = {flag.dest: flag for flag in SERVE_FLAGS}
    assert flags["admin_token"].env == contract.ADMIN_TOKEN_ENV and flags["port"].default == contract.ENGINE_PORT
    spec = parse_spec({"model": {"uri": "pvc://m"}})
    deployment = builders.build_deployment("llama", "ml", spec, EngineSettings.of(spec.engine), OperatorSettings())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert contract.ADMIN_TOKEN_ENV in {e["name"] for e in container["env"]}
    assert container["ports"][0]["containerPort"] == contract.ENGINE_PORT
    assert container["readinessProbe"]["httpGet"]["path"] == contract.HEALTH_PATH
    # Everything the operator persists for the engine is a key the engine's tuning file takes.
    assert set(tuning_configmap.engine_file(EngineSettings(max_num_batched_tokens=64), {})) <= set(contract.TUNING_FILE_KEYS)
