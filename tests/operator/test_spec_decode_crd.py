"""spec.engine.speculative: validated like the engine validates it, rendered into the CRD, passed as
`kvpilot serve --speculative-config`; a draft model gets its own volume in the pod."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from kvpilot.engine.server.args import add_serve_arguments, engine_overrides, resolve_serve_args
from kvpilot.engine.spec_decode.config import MAX_NUM_SPECULATIVE_TOKENS, SpeculativeConfig
from kvpilot.operator import builders, crd, spec, status, tuning_configmap
from kvpilot.operator.settings import OperatorSettings

INVALID = yaml.safe_load((Path(__file__).parent / "invalid_specs.yaml").read_text())


def pod_spec(speculative: dict | None, model_uri: str = "pvc://models/smollm2") -> dict:
    engine = {} if speculative is None else {"speculative": speculative}
    parsed = spec.parse_spec({"model": {"uri": model_uri}, "engine": engine})
    state = tuning_configmap.settings_in_effect(parsed, None)
    deployment = builders.build_deployment("smol", "ml", parsed, state, OperatorSettings())
    return deployment["spec"]["template"]["spec"]


def engine_args(speculative: dict | None, model_uri: str = "pvc://models/smollm2") -> list[str]:
    (container,) = pod_spec(speculative, model_uri)["containers"]
    return container["args"]


def engine_config(args: list[str]) -> SpeculativeConfig:
    """What `kvpilot serve` makes of these arguments' --speculative-config."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    parsed = resolve_serve_args(parser.parse_args(args[1:]), environ={})
    return SpeculativeConfig.from_dict(engine_overrides(parsed)["speculative_config"])


def rendered_json(args: list[str]) -> dict:
    return json.loads(args[args.index("--speculative-config") + 1])


def test_the_engine_gets_the_same_config_as_json():
    args = engine_args({"method": "ngram", "numSpeculativeTokens": 3, "promptLookupMax": 5})
    assert rendered_json(args) == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
    config = engine_config(args)
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == ("ngram", 3, 5)


def test_off_unless_asked_and_defaults_filled():
    assert "--speculative-config" not in engine_args(None)
    args = engine_args({})
    assert rendered_json(args) == {"method": "ngram", "num_speculative_tokens": 4}
    engine_config(args)


# (target uri, draft, the draft's path in the pod, the draft's volume without its name)
DRAFT_CASES = {
    "pvc, same claim as the target": (
        "pvc://models/smollm2", {"uri": "pvc://models/smollm2-draft"}, "/mnt/draft-model/smollm2-draft",
        {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
    ),
    "pvc, a whole claim": (
        "pvc://models/smollm2", {"uri": "pvc://drafts"}, "/mnt/draft-model",
        {"persistentVolumeClaim": {"claimName": "drafts", "readOnly": True}},
    ),
    "file, a gguf file": (
        "file:///data/smollm2", {"uri": "file:///data/drafts/smollm2-q4.gguf"}, "/mnt/draft-model/smollm2-q4.gguf",
        {"hostPath": {"path": "/data/drafts/smollm2-q4.gguf", "type": "File"}},
    ),
    "file, a folder": (
        "pvc://models/smollm2", {"uri": "file:///data/draft/"}, "/mnt/draft-model",
        {"hostPath": {"path": "/data/draft", "type": "Directory"}},
    ),
    "hf": (
        "hf://org/smollm2", {"uri": "hf://org/smollm2-draft", "revision": "v2", "tokenSecret": {"name": "hf"}},
        "/mnt/draft-model", {"emptyDir": {}},
    ),
}


@pytest.mark.parametrize("case", DRAFT_CASES)
def test_a_draft_model_gets_its_own_volume_and_its_path_reaches_the_engine(case):
    target_uri, draft, path, volume = DRAFT_CASES[case]
    speculative = {"method": "draft_model", "model": draft, "numSpeculativeTokens": 3}
    pod = pod_spec(speculative, target_uri)
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert len(volumes) == len(pod["volumes"]), "two volumes share a name"
    assert {k: v for k, v in volumes["draft-model"].items() if k != "name"} == volume
    mounts = [m for m in container["volumeMounts"] if m["name"] == "draft-model"]
    assert len(mounts) == 1 and mounts[0]["readOnly"] is True and path.startswith(mounts[0]["mountPath"])
    mount_paths = [m["mountPath"] for m in container["volumeMounts"]]
    assert len(set(mount_paths)) == len(mount_paths) and {m["name"] for m in container["volumeMounts"]} <= set(volumes)
    # The target keeps its own volume, and is still what the engine serves.
    assert "model" in volumes and container["args"][1] != path
    assert rendered_json(container["args"]) == {"method": "draft_model", "num_speculative_tokens": 3, "model": path}
    config = engine_config(container["args"])
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", path, 3)


def test_an_hf_draft_is_downloaded_by_its_own_init_container():
    pod = pod_spec({"method": "draft_model", "model": DRAFT_CASES["hf"][1]}, "hf://org/smollm2")
    target, draft = pod["initContainers"]
    assert (target["name"], draft["name"]) == ("download-model", "download-draft-model")
    assert target["args"] == ["download", "org/smollm2", "--local-dir", "/mnt/models"]
    assert draft["args"] == ["download", "org/smollm2-draft", "--local-dir", "/mnt/draft-model", "--revision", "v2"]
    assert {m["name"]: m["mountPath"] for m in draft["volumeMounts"]} == {
        "draft-model": "/mnt/draft-model", "scratch": "/tmp"}
    token = next(e for e in draft["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert not any(e["name"] == "HF_TOKEN" for e in target["env"])  # the target's repository is public here


@pytest.mark.parametrize("container, uri, field", [
    ("download-draft-model", "hf://org/smollm2-draft", "spec.engine.speculative.model.revision"),
    ("download-model", "hf://org/smollm2", "spec.model.revision"),
])
def test_a_failing_download_names_the_model_it_was_for(container, uri, field):
    parsed = spec.parse_spec({"model": {"uri": "hf://org/smollm2"}, "engine": {"speculative": {
        "method": "draft_model", "model": {"uri": "hf://org/smollm2-draft"}}}})
    failing = {"name": container, "restartCount": 2, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
               "lastState": {"terminated": {"exitCode": 1}}}
    pod = {"metadata": {"name": "smol-0"}, "status": {"phase": "Pending", "conditions": [],
                                                       "initContainerStatuses": [failing]}}
    result = status.compute_status(
        name="smol", namespace="ml", generation=1, spec=parsed, settings=spec.EngineSettings.of(parsed.engine),
        deployment={"metadata": {"generation": 1}, "status": {"replicas": 1, "observedGeneration": 1}},
        pods=[pod], events=[], previous_conditions=[], now="2026-01-01T00:00:00Z")
    degraded = next(c for c in result["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "ModelDownloadFailed"
    assert f"cannot download {uri} " in degraded["message"] and field in degraded["message"]
    assert f"-c {container}" in degraded["message"]


def test_a_draft_on_a_pvc_needs_no_init_container():
    pod = pod_spec({"method": "draft_model", "model": {"uri": "pvc://models/draft"}}, "pvc://models/smollm2")
    assert "initContainers" not in pod


def test_the_targets_own_file_as_draft_is_mounted_once():
    pod = pod_spec({"method": "draft_model", "model": {"uri": "file:///data/smollm2.gguf"}},
                   "file:///data/smollm2.gguf")
    (container,) = pod["containers"]
    assert [v["name"] for v in pod["volumes"] if "hostPath" in v] == ["model"]
    assert [m["mountPath"] for m in container["volumeMounts"]].count("/mnt/models/smollm2.gguf") == 1
    assert rendered_json(container["args"])["model"] == "/mnt/models/smollm2.gguf"


def test_engine_config_takes_a_draft_path_only_with_a_draft():
    ngram = spec.SpeculativeDecoding()
    draft = spec.SpeculativeDecoding(method="draft_model", model={"uri": "pvc://m/d"})
    with pytest.raises(ValueError, match="only draft_model takes one"):
        ngram.engine_config("/mnt/draft-model")
    with pytest.raises(ValueError, match="only draft_model takes one"):
        draft.engine_config(None)


@pytest.mark.parametrize(
    "speculative, message",
    [
        ({"method": "eagle"}, "engine.speculative.method must be ngram or draft_model"),
        ({"promptLookupMin": 5, "promptLookupMax": 3}, "promptLookupMin must be at most promptLookupMax"),
        ({"numSpeculativeTokens": MAX_NUM_SPECULATIVE_TOKENS + 1}, "numSpeculativeTokens"),
        ({"lookahead": 2}, "lookahead"),
        ({"method": "draft_model"}, "engine.speculative.model is required with method draft_model"),
        ({"model": {"uri": "pvc://m/d"}}, "engine.speculative.model applies only to method draft_model"),
        ({"method": "draft_model", "model": {"uri": "pvc://m/d"}, "promptLookupMin": 2},
         "promptLookupMin and promptLookupMax apply only to method ngram"),
        ({"method": "draft_model", "model": {"uri": "https://example.com/d.gguf"}}, "engine.speculative.model.uri must be"),
        ({"method": "draft_model", "model": {"uri": "pvc://m/d", "servedName": "d"}}, "servedName"),
    ],
)
def test_invalid_specs_are_rejected_naming_the_field(speculative, message):
    with pytest.raises(ValidationError, match=message):
        spec.parse_spec({"model": {"uri": "pvc://m"}, "engine": {"speculative": speculative}})


def test_valid_draft_specs_pass():
    for draft in ({"uri": "pvc://models/d"}, {"uri": "file:///data/d.gguf"},
                  {"uri": "hf://org/d", "revision": "main", "tokenSecret": {"name": "hf"}}):
        parsed = spec.parse_spec({"model": {"uri": "pvc://m"},
                                  "engine": {"speculative": {"method": "draft_model", "model": draft}}})
        assert parsed.engine.speculative.model.uri == draft["uri"]


def test_every_rule_has_a_case_in_the_invalid_specs_table():
    """So tests/e2e/test_bad_crs.py proves the API server rejects each with the same words."""
    messages = {case["message"] for case in INVALID}
    for model in (spec.SpeculativeDecoding, spec.DraftModelSource):
        for rule in model.rules:
            assert rule.message in messages, f"no case in invalid_specs.yaml for: {rule.message}"


def test_the_crd_carries_the_field_and_its_rules():
    schema = yaml.safe_load(crd.render_crd())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    speculative = schema["properties"]["spec"]["properties"]["engine"]["properties"]["speculative"]
    assert set(speculative["properties"]) == {
        "method", "numSpeculativeTokens", "promptLookupMax", "promptLookupMin", "model", "disableByBatchSize"}
    assert speculative["properties"]["numSpeculativeTokens"]["maximum"] == MAX_NUM_SPECULATIVE_TOKENS
    draft = speculative["properties"]["model"]
    assert set(draft["properties"]) == {"uri", "revision", "tokenSecret"} and draft["required"] == ["uri"]
    rules = {rule["message"] for rule in speculative["x-kubernetes-validations"]}
    assert {r.message for r in spec.SpeculativeDecoding.rules} == rules
    assert "engine.speculative.method must be ngram or draft_model" in rules
    draft_rules = {rule["message"] for rule in draft["x-kubernetes-validations"]}
    assert {r.message for r in spec.DraftModelSource.rules} == draft_rules
