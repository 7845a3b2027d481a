"""The chart's Grafana dashboard queries only metrics that the engine and the operator really export."""

from __future__ import annotations

import json
import re

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.operator import crd, operator_metrics
from kvpilot.operator.autoscaler import ScaleDecision, ScalingHistory
from kvpilot.operator.spec import EngineSettings, Slo
from kvpilot.operator.tuner import Decision, TuningHistory

DASHBOARD = crd.REPO_ROOT / "charts" / "kvpilot" / "dashboards" / "kvpilot.json"


def _exposed(text: str) -> dict[str, set[tuple[str, str]]]:
    """Sample name → the (label, value) pairs seen on it, from a /metrics page."""
    seen: dict[str, set[tuple[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            seen.setdefault(sample.name, set()).update(sample.labels.items())
    return seen


@pytest.fixture(scope="module")
def operator_page():
    """The operator's /metrics after one tuning and scaling interval of one service, as the control loop
    records them."""
    before, after = EngineSettings(max_num_seqs=8), EngineSettings(max_num_seqs=16)
    operator_metrics.record_decision("ml", "llama", Decision(after, "grow", TuningHistory(), before))
    operator_metrics.record_scale("ml", "llama", ScaleDecision(2, "up", ScalingHistory(), 1))
    operator_metrics.record_slo("ml", "llama", Slo(ttft_p99_seconds=2.0, itl_p99_seconds=0.1))
    operator_metrics.record_replicas("ml", "llama", desired=2, ready=1)
    operator_metrics.SCRAPE_ERRORS.labels("ml", "llama").inc(0)
    yield generate_latest(operator_metrics.REGISTRY).decode()
    operator_metrics.forget("ml", "llama")


def _queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [a["expr"] for a in dashboard["annotations"]["list"]]
    queries += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return queries


def test_every_metric_the_dashboard_queries_is_exported(engine_metrics_page, operator_page):
    exported = set(_exposed(engine_metrics_page)) | set(_exposed(operator_page))
    queried = {name for query in _queries() for name in re.findall(r"\bkvpilot_[a-z0-9_]+", query)}
    assert queried, "the dashboard queries no kvpilot metric"
    assert queried - exported == set(), f"not exported by the engine or the operator: {queried - exported}"


_SELECTOR = re.compile(r"(kvpilot_[a-z0-9_]+)\{([^}]*)\}")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')


def _label_filters() -> list[tuple[str, str, str, str]]:
    """(metric, label, operator, value) of every label matcher in the dashboard's selectors, but those on
    Grafana's variables ($namespace, $service: the targets' own labels, added by the scrape)."""
    return [(name, label, op, value) for query in _queries() for name, selector in _SELECTOR.findall(query)
            for label, op, value in _MATCHER.findall(selector) if not value.startswith("$")]


def test_the_label_values_the_dashboard_filters_on_are_exported(engine_metrics_page, operator_page):
    exposed = {**_exposed(engine_metrics_page), **_exposed(operator_page)}
    filters = _label_filters()
    # Every matcher on a fixed value in the dashboard's text is one checked here: none escapes the pattern.
    written = sum(len(re.findall(r'(?:=~|!~|!=|=)\s*"(?!\$)', query)) for query in _queries())
    assert filters and len(filters) == written, (written, filters)
    for name, label, op, value in filters:
        values = {v for k, v in exposed.get(name, ()) if k == label}
        if op in ("=~", "!~"):
            assert any(re.fullmatch(value, v) for v in values), f"{name}: {label}{op}{value!r} matches nothing exported"
        else:
            assert value in values, f"{name}: {label}={value!r} never exported (seen: {values})"


def test_every_panel_shows_one_service():
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            assert 'namespace="$namespace", service="$service"' in target["expr"], panel["title"]


def test_a_deleted_service_leaves_no_series(operator_page):
    operator_metrics.record_replicas("ml", "gone", desired=1, ready=1)
    operator_metrics.forget("ml", "gone")
    page = generate_latest(operator_metrics.REGISTRY).decode()
    assert 'service="gone"' not in page and 'service="llama"' in page
