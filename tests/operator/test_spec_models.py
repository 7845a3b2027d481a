"""The spec models: defaults, aliases, and the validation rules the CRD shares."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from kvpilot import kube_contract
from kvpilot.operator import spec

INVALID = yaml.safe_load((Path(__file__).parent / "invalid_specs.yaml").read_text())


def test_minimal_spec_gets_every_default():
    parsed = spec.parse_spec({"model": {"uri": "pvc://models/llama-3-8b"}})
    assert parsed.replicas == 1
    assert parsed.resources.gpus == 1 and parsed.resources.gpu_resource_name == "nvidia.com/gpu"
    assert parsed.engine.max_num_seqs == 64 and parsed.engine.block_size == 16
    assert parsed.engine.gpu_memory_utilization == 0.9
    assert parsed.autoscaling is None and parsed.tuning is None


def test_fields_are_camel_case_in_yaml():
    parsed = spec.parse_spec({
        "model": {"uri": "hf://org/name", "servedName": "llama", "tokenSecret": {"name": "hf"}},
        "engine": {"maxNumSeqs": 16, "enablePrefixCaching": False, "extraArgs": ["--device", "cpu"]},
        "tuning": {"slo": {"itlP99Seconds": 0.1}, "maxNumSeqs": {"min": 8, "max": 64}},
    })
    assert parsed.model.served_name == "llama" and parsed.model.token_secret.key == "token"
    assert parsed.engine.max_num_seqs == 16 and not parsed.engine.enable_prefix_caching
    assert parsed.tuning.enabled and parsed.tuning.max_num_seqs.max == 64
    dumped = parsed.model_dump(by_alias=True, exclude_none=True)
    assert dumped["engine"]["maxNumSeqs"] == 16


def test_unknown_field_is_rejected_by_name():
    with pytest.raises(ValidationError, match="maxNumSeq"):
        spec.parse_spec({"model": {"uri": "pvc://m"}, "engine": {"maxNumSeq": 3}})


@pytest.mark.parametrize("uri", ["pvc://models", "pvc://models/llama/v1", "file:///data/llama", "hf://meta/llama-3"])
def test_known_model_uris_pass(uri):
    assert spec.parse_spec({"model": {"uri": uri}}).model.uri == uri


@pytest.mark.parametrize("case", INVALID, ids=[c["case"] for c in INVALID])
def test_invalid_specs_fail_naming_the_field_with_the_crd_message(case):
    with pytest.raises(ValidationError) as info:
        spec.parse_spec(case["spec"])
    message = spec.spec_error_message(info.value)
    assert f"{case['field']}: " in message and case["message"] in message, message


def test_error_message_names_every_problem_in_the_api_servers_words():
    with pytest.raises(ValidationError) as info:
        spec.parse_spec({"model": {"uri": "pvc://m"}, "replicas": 5000, "engine": {"blockSize": 24, "x": 1},
                         "tolerations": ["not an object"]})
    assert spec.spec_error_message(info.value).split("; ") == [
        "spec.replicas: Input should be less than or equal to 1024",
        "spec.engine.x: unknown field",
        "spec.tolerations[0]: Input should be a valid dictionary",
    ]


def test_every_rule_message_is_covered_by_an_invalid_case():
    """Each CEL rule must have a case, so the e2e test proves the API server says the same."""
    messages = {c["message"] for c in INVALID}
    models = [spec.ModelSource, spec.Resources, spec.EngineParams, spec.MaxNumSeqsBounds,
              spec.MemoryFractionBounds, spec.Tuning, spec.Autoscaling, spec.LoRASource, spec.InferenceServiceSpec]
    for model in models:
        for rule in model.rules:
            assert any(m in rule.message for m in messages), f"no invalid case for: {rule.message}"


def test_tuning_disabled_skips_the_bounds_rules():
    parsed = spec.parse_spec({
        "model": {"uri": "pvc://m"},
        "engine": {"maxNumSeqs": 512},
        "tuning": {"enabled": False, "maxNumSeqs": {"min": 8, "max": 256}},
    })
    assert parsed.tuning is not None and not parsed.tuning.enabled


@pytest.mark.parametrize("name,ok", [("llama", True), ("llama-3-8b", True), ("3llama", False), ("Llama", False),
                                     ("a" * 52, True), ("a" * 53, False), ("llama-", False)])
def test_name_rule(name, ok):
    assert spec.NAME_RULE.check(name) is ok


@pytest.mark.parametrize("example", ["minimal.yaml", "full.yaml"])
def test_examples_are_valid(example):
    from kvpilot.operator import crd

    doc = yaml.safe_load((crd.REPO_ROOT / "examples" / example).read_text())
    assert doc["apiVersion"] == kube_contract.API_VERSION and doc["kind"] == kube_contract.KIND
    assert spec.NAME_RULE.check(doc["metadata"]["name"])
    spec.parse_spec(doc["spec"])


def test_full_example_sets_every_spec_field():
    from kvpilot.operator import crd

    doc = yaml.safe_load((crd.REPO_ROOT / "examples" / "full.yaml").read_text())

    def unset(model_cls, values, prefix):
        for name, field in model_cls.model_fields.items():
            alias = field.alias or name
            if alias not in values:
                yield prefix + alias
            else:
                value = values[alias]
                value = value[0] if isinstance(value, list) and value else value  # a list's fields: its first item's
                for candidate in (field.annotation, *typing.get_args(field.annotation)):
                    if isinstance(candidate, type) and issubclass(candidate, spec.SpecModel):
                        yield from unset(candidate, value, f"{prefix}{alias}.")

    missing = [f for f in unset(spec.InferenceServiceSpec, doc["spec"], "spec.")
               if f not in ("spec.model.revision", "spec.model.tokenSecret",  # hf:// only
                            "spec.loras.revision", "spec.loras.tokenSecret",
                            "spec.engine.speculative.model",  # method: draft_model only (full.yaml's is ngram)
                            "spec.tuning.slo.itlP99Seconds")]  # one of it and tpotP99Seconds (full.yaml's)
    assert missing == []
