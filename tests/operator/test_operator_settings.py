"""Operator settings from the environment, and the CLI around them."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest
import yaml

from kvpilot import kube_contract
from kvpilot.operator import cli, crd
from kvpilot.operator.settings import OperatorSettings, SettingsError


def test_defaults_without_environment():
    settings = OperatorSettings.from_env({})
    assert settings == OperatorSettings()
    assert settings.termination_grace_seconds > settings.engine_drain_seconds + settings.engine_shutdown_grace_seconds


def test_environment_overrides():
    settings = OperatorSettings.from_env({
        "KVPILOT_ENGINE_IMAGE": "r.example/kvpilot:dev", "KVPILOT_RESYNC_SECONDS": "2.5",
        "KVPILOT_LOG_LEVEL": "debug", "KVPILOT_ENGINE_BIND_POD_IP": "true",
        "KVPILOT_ENGINE_IMAGE_PULL_POLICY": "Never",
    })
    assert settings.engine_image == "r.example/kvpilot:dev" and settings.resync_seconds == 2.5
    assert settings.log_level == "DEBUG" and settings.engine_bind_pod_ip
    assert settings.engine_image_pull_policy == "Never"


def test_leader_election_is_off_unless_a_lease_is_named():
    assert OperatorSettings.from_env({}).leader_election_lease is None
    settings = OperatorSettings.from_env({"KVPILOT_LEADER_ELECTION_LEASE": "kvpilot-system/kv-kvpilot",
                                          "KVPILOT_POD_NAME": "kv-kvpilot-7d9-abc", "KVPILOT_LISTEN_ADDRESS": "10.1.2.3"})
    assert settings.leader_election_lease == ("kvpilot-system", "kv-kvpilot")
    assert settings.leader_election_identity == "kv-kvpilot-7d9-abc" and settings.listen_address == "10.1.2.3"


@pytest.mark.parametrize("name,value", [("KVPILOT_RESYNC_SECONDS", "soon"), ("KVPILOT_HEALTH_PORT", "-1"),
                                        ("KVPILOT_LOG_LEVEL", "chatty"), ("KVPILOT_ENGINE_BIND_POD_IP", "maybe"),
                                        ("KVPILOT_LEADER_ELECTION_LEASE", "no-namespace"),
                                        ("KVPILOT_LEADER_ELECTION_LEASE_SECONDS", "1")])
def test_bad_values_name_the_variable(name, value):
    with pytest.raises(SettingsError, match=name):
        OperatorSettings.from_env({name: value})


def _args(*argv):
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["operator", *argv])


def _watched(args, env):
    return kube_contract.watched_namespaces(args.all_namespaces, args.namespace, env, "kvpilot operator")


def test_namespace_scope(monkeypatch, tmp_path):
    monkeypatch.setattr(kube_contract, "NAMESPACE_FILE", str(tmp_path / "absent"))
    assert _watched(_args("-n", "a", "-n", "b"), {}) == ["a", "b"]
    assert _watched(_args("--all-namespaces"), {}) is None
    assert _watched(_args(), {"KVPILOT_NAMESPACES": "x, y"}) == ["x", "y"]
    assert _watched(_args(), {"KVPILOT_NAMESPACES": "*"}) is None
    with pytest.raises(SystemExit, match="kvpilot operator: give --namespace NS .* or --all-namespaces"):
        _watched(_args(), {})
    (tmp_path / "ns").write_text("kvpilot-system\n")
    monkeypatch.setattr(kube_contract, "NAMESPACE_FILE", str(tmp_path / "ns"))
    assert _watched(_args(), {}) == ["kvpilot-system"]


def test_namespace_and_all_namespaces_exclude_each_other():
    with pytest.raises(SystemExit):
        _args("-n", "a", "-A")


def test_operator_never_imports_torch_or_the_engine():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import kvpilot.operator.runner, kvpilot.operator.handlers, kvpilot.operator.crd\n"
        "heavy = [m for m in ('torch', 'triton', 'transformers', 'kvpilot.engine') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kopf_logs_in_with_the_same_credentials_as_our_client():
    from kubernetes import client

    from kvpilot.operator.runner import connection_info

    configuration = client.Configuration(host="https://10.0.0.1:6443")
    configuration.api_key = {"BearerToken": "abc.def"}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    configuration.ssl_ca_cert = "/pki/ca.crt"
    info = connection_info(configuration)
    assert info.server == "https://10.0.0.1:6443" and info.ca_path == "/pki/ca.crt"
    assert info.scheme == "Bearer" and info.token == "abc.def" and info.insecure is False


# --- `kvpilot operator` and `kvpilot crd` as a user runs them --------------------------------


@pytest.fixture
def operator_run(monkeypatch, tmp_path):
    """``operator_run(*argv, **env)``: `kvpilot operator ARGV` with only ``env`` as KVPILOT_* environment;
    returns what it would run the operator with (run_operator's arguments) instead of running it."""
    from kvpilot import cli as kvpilot_cli
    from kvpilot.operator import runner

    monkeypatch.setattr(kube_contract, "NAMESPACE_FILE", str(tmp_path / "absent"))
    calls = []
    monkeypatch.setattr(runner, "run_operator", lambda settings, **kwargs: calls.append((settings, kwargs)) or 0)

    def run(*argv: str, **env: str) -> tuple[OperatorSettings, dict]:
        for name in [n for n in os.environ if n.startswith("KVPILOT_")]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert kvpilot_cli.main(["operator", *argv]) == 0
        return calls.pop()

    return run


ENVIRONMENT = {"KVPILOT_ENGINE_IMAGE": "r.example/kvpilot:env", "KVPILOT_RESYNC_SECONDS": "7",
               "KVPILOT_HEALTH_PORT": "9001", "KVPILOT_LOG_LEVEL": "warning", "KVPILOT_NAMESPACES": "env-a,env-b",
               "KVPILOT_ENGINE_BIND_POD_IP": "true"}


def test_operator_takes_its_settings_from_the_environment(operator_run):
    settings, kwargs = operator_run(**ENVIRONMENT)
    assert settings == OperatorSettings.from_env(ENVIRONMENT)
    assert (settings.engine_image, settings.resync_seconds, settings.health_port, settings.log_level) == (
        "r.example/kvpilot:env", 7.0, 9001, "WARNING")
    assert kwargs == {"namespaces": ["env-a", "env-b"], "kubeconfig": None, "context": None}


def test_operator_flags_override_the_environment_one_by_one(operator_run):
    settings, kwargs = operator_run(
        "--engine-image", "r.example/kvpilot:flag", "--resync-seconds", "2.5", "--health-port", "0",
        "--log-level", "DEBUG", "-n", "flag-ns", "--kubeconfig", "/k/config", "--context", "lab", **ENVIRONMENT,
    )  # fmt: skip
    assert (settings.engine_image, settings.resync_seconds, settings.health_port, settings.log_level) == (
        "r.example/kvpilot:flag", 2.5, 0, "DEBUG")  # 0 is a value (no health endpoint), not "unset"
    assert settings.engine_bind_pod_ip  # what no flag sets still comes from the environment
    assert kwargs == {"namespaces": ["flag-ns"], "kubeconfig": "/k/config", "context": "lab"}
    only_image, _ = operator_run("--engine-image", "r.example/kvpilot:flag", **ENVIRONMENT)
    from_env = OperatorSettings.from_env(ENVIRONMENT)
    assert only_image == dataclasses.replace(from_env, engine_image="r.example/kvpilot:flag")
    assert operator_run("-A", **ENVIRONMENT)[1]["namespaces"] is None


def test_operator_refuses_a_bad_environment_naming_the_variable(operator_run):
    with pytest.raises(SystemExit, match="kvpilot operator: KVPILOT_RESYNC_SECONDS='soon'"):
        operator_run(KVPILOT_RESYNC_SECONDS="soon")


def test_kvpilot_crd_prints_the_committed_crd():
    import subprocess
    import sys

    printed = subprocess.run([sys.executable, "-m", "kvpilot", "crd"], capture_output=True, text=True, check=True,
                             timeout=120).stdout
    for path in crd.CRD_PATHS:
        assert printed == path.read_text(), f"`kvpilot crd` differs from {path}"
    document = yaml.safe_load(printed)
    assert document["kind"] == "CustomResourceDefinition"
    assert document["metadata"]["name"] == "inferenceservices.kvpilot.io"
    assert document["spec"]["names"]["kind"] == "InferenceService" and "kvis" in document["spec"]["names"]["shortNames"]
