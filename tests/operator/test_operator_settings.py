"""Operator settings from the environment, and the CLI around them."""

from __future__ import annotations

import argparse

import pytest

from kvpilot import kube_contract
from kvpilot.operator import cli
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
