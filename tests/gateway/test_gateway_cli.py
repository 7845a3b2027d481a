"""`kvpilot gateway` as a user runs it: its flags reach the gateway's settings, and the namespaces it routes
to come from -n/-A, else from $KVPILOT_NAMESPACES (as the chart sets it), else from the pod's namespace."""

from __future__ import annotations

import os

import pytest

from kvpilot import cli as kvpilot_cli
from kvpilot import kube_contract
from kvpilot.gateway import server
from kvpilot.gateway.settings import GatewaySettings


@pytest.fixture
def gateway_run(monkeypatch, tmp_path):
    """``gateway_run(*argv, **env)``: `kvpilot gateway ARGV` with only ``env`` as KVPILOT_* environment;
    returns what it would serve with (serve's arguments) instead of serving."""
    monkeypatch.setattr(kube_contract, "NAMESPACE_FILE", str(tmp_path / "absent"))
    calls = []

    async def serve(settings, namespaces, kubeconfig, context):
        calls.append((settings, namespaces, kubeconfig, context))

    monkeypatch.setattr(server, "serve", serve)

    def run(*argv: str, **env: str):
        for name in [n for n in os.environ if n.startswith("KVPILOT_")]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert kvpilot_cli.main(["gateway", *argv]) == 0
        return calls.pop()

    return run


def test_defaults_and_the_namespaces_from_the_environment(gateway_run):
    assert gateway_run(KVPILOT_NAMESPACES="ml, research") == (GatewaySettings(), ["ml", "research"], None, None)
    assert gateway_run(KVPILOT_NAMESPACES="*")[1] is None  # every namespace


def test_flags_set_the_settings_and_override_the_environment(gateway_run):
    settings, namespaces, kubeconfig, context = gateway_run(
        "--host", "127.0.0.1", "--port", "9000", "--prefix-chars", "0", "--load-factor", "2.5",
        "--scrape-interval", "0.5", "--max-held-requests", "0", "--hold-timeout", "12", "--log-level", "DEBUG",
        "-n", "a", "-n", "b", "--kubeconfig", "/k/config", "--context", "lab", KVPILOT_NAMESPACES="ml",
    )  # fmt: skip
    assert settings == GatewaySettings(host="127.0.0.1", port=9000, prefix_chars=0, load_factor=2.5,
                                       scrape_interval_seconds=0.5, max_held_requests=0, hold_timeout_seconds=12.0,
                                       log_level="DEBUG")
    assert (namespaces, kubeconfig, context) == (["a", "b"], "/k/config", "lab")
    assert gateway_run("-A", KVPILOT_NAMESPACES="ml")[1] is None


def test_bad_flags_and_no_namespace_are_refused_saying_what_to_change(gateway_run):
    with pytest.raises(SystemExit, match="kvpilot gateway: --load-factor must be at least 1"):
        gateway_run("--load-factor", "0.5", KVPILOT_NAMESPACES="ml")
    with pytest.raises(SystemExit, match="kvpilot gateway: give --namespace NS"):
        gateway_run()
