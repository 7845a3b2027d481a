"""The CRD: generated from the spec models, committed twice (crds/ and the chart), never drifting."""

from __future__ import annotations

import pytest
import yaml

from kvpilot.operator import crd, spec


@pytest.mark.parametrize("path", crd.CRD_PATHS, ids=lambda p: str(p.relative_to(crd.REPO_ROOT)))
def test_committed_crd_matches_the_models(path):
    assert path.exists(), f"{path} is missing: run `python -m kvpilot.operator.crd --write`"
    assert path.read_text() == crd.render_crd(), (
        f"{path} drifted from kvpilot/operator/spec.py: run `python -m kvpilot.operator.crd --write` and commit"
    )


def _walk(node, path="$"):
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def _version():
    return yaml.safe_load(crd.render_crd())["spec"]["versions"][0]


def test_schema_is_structural():
    schema = _version()["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "title", "$defs"):
            assert banned not in node, f"{path} has {banned}"
        if path != "$.metadata" and not node.get("x-kubernetes-int-or-string"):
            assert "type" in node, f"{path} has no type"
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") in (None,), f"{path} closes its properties"


def test_every_spec_and_status_field_is_described_for_kubectl_explain():
    schema = _version()["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema["properties"]["spec"], "$.spec"):
        assert node.get("description") or path.endswith("[]") or path.endswith("{}"), f"{path} has no description"
    for path, node in _walk(schema["properties"]["status"], "$.status"):
        assert node.get("description") or path.endswith("[]") or path.endswith("{}"), f"{path} has no description"


def test_defaults_reach_the_api_server():
    engine = _version()["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"]
    # Written out in full: the API server checks an object's default against its CEL rules as is.
    assert engine["default"]["maxNumSeqs"] == 64 and engine["default"]["blockSize"] == 16
    assert engine["properties"]["maxNumSeqs"]["default"] == 64
    assert "default" not in engine["properties"]["maxNumBatchedTokens"]  # unset means "engine decides"


def test_rules_become_cel_validations():
    spec_schema = _version()["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = spec_schema["properties"]["engine"]["x-kubernetes-validations"]
    block_size = next(r for r in spec.EngineParams.rules if r.field_path == ".blockSize")
    assert {"rule": "self.blockSize in [8, 16, 32, 64, 128]", "message": block_size.message,
            "fieldPath": ".blockSize"} in rules
    assert spec_schema["x-kubernetes-validations"][0]["message"] == spec.InferenceServiceSpec.rules[0].message


def test_subresources_and_printer_columns():
    version = _version()
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert version["subresources"]["status"] == {}
    default_columns = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert default_columns == ["Ready", "Replicas", "MaxSeqs", "Tok/s", "ITL P99", "Age"]
    full = yaml.safe_load(crd.render_crd())
    assert full["spec"]["names"]["shortNames"] == ["kvis"]
    assert full["spec"]["scope"] == "Namespaced"


def test_status_takes_no_defaults_or_rules_from_the_models_it_shares_with_the_spec():
    status = _version()["schema"]["openAPIV3Schema"]["properties"]["status"]
    for path, node in _walk(status, "$.status"):
        assert "default" not in node and "x-kubernetes-validations" not in node, path
    engine = status["properties"]["engine"]["properties"]
    assert set(engine) == {"maxNumSeqs", "maxNumBatchedTokens", "gpuMemoryUtilization"}


def test_printer_columns_point_at_status_fields_that_exist():
    status = _version()["schema"]["openAPIV3Schema"]["properties"]["status"]
    for column in _version()["additionalPrinterColumns"]:
        path = column["jsonPath"]
        if not path.startswith(".status."):
            continue
        node = status
        for part in path[len(".status."):].split("[")[0].split("."):
            node = node["properties"][part]
        assert node
