"""The engine pods' secrets and ports: keys come from Secrets as environment variables, the admin port
stays out of the Service."""

from __future__ import annotations

from kvpilot import engine_contract as contract
from kvpilot.operator import builders, spec, tuning_configmap
from kvpilot.operator.settings import OperatorSettings

SETTINGS = OperatorSettings(engine_image="registry.example/kvpilot:1.2.3")


def _deployment_and_service(spec_dict):
    parsed = spec.parse_spec(spec_dict)
    children = builders.build_children("llama", "ml", parsed, tuning_configmap.settings_in_effect(parsed, None),
                                       SETTINGS)
    return children.deployment, children.service


def _engine(deployment):
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_api_key_comes_from_the_secret_as_an_environment_variable():
    deployment, _ = _deployment_and_service(
        {"model": {"uri": "pvc://m"}, "apiKeySecretRef": {"name": "clients", "key": "api-key"}})
    container = _engine(deployment)
    key = next(e for e in container["env"] if e["name"] == contract.API_KEY_ENV)
    assert key == {"name": "KVPILOT_API_KEY", "valueFrom": {"secretKeyRef": {"name": "clients", "key": "api-key"}}}
    assert not any(arg.startswith("--api-key") or arg.startswith("--admin-token") for arg in container["args"])
    # No secret value anywhere in the pod spec: every secret-looking variable comes from a Secret.
    for env in container["env"]:
        if env["name"] in (contract.API_KEY_ENV, contract.ADMIN_TOKEN_ENV):
            assert "value" not in env and "secretKeyRef" in env["valueFrom"]


def test_no_api_key_without_a_secret_ref():
    deployment, _ = _deployment_and_service({"model": {"uri": "pvc://m"}})
    container = _engine(deployment)
    assert all(e["name"] != contract.API_KEY_ENV for e in container["env"])
    refs = [e["valueFrom"]["secretKeyRef"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    assert refs == [{"name": "llama-admin", "key": "token"}]


def test_the_admin_port_is_the_containers_but_not_the_services():
    deployment, service = _deployment_and_service({"model": {"uri": "pvc://m"}})
    ports = {p["name"]: p["containerPort"] for p in _engine(deployment)["ports"]}
    assert ports == {"http": contract.ENGINE_PORT, "admin": contract.ADMIN_PORT}
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [("http", contract.ENGINE_PORT)]
    assert contract.ADMIN_PORT != contract.ENGINE_PORT
