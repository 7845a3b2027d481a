"""spec.engine.speculative: validated like the engine validates it, rendered into the CRD, passed as
`kvpilot serve --speculative-config`."""

from __future__ import annotations

import argparse
import json

import pytest
import yaml
from pydantic import ValidationError

from kvpilot.engine.server.args import add_serve_arguments, engine_overrides, resolve_serve_args
from kvpilot.engine.spec_decode.config import MAX_NUM_SPECULATIVE_TOKENS, SpeculativeConfig
from kvpilot.operator import builders, crd, spec, tuning_configmap
from kvpilot.operator.settings import OperatorSettings


def engine_args(speculative: dict | None) -> list[str]:
    engine = {} if speculative is None else {"speculative": speculative}
    parsed = spec.parse_spec({"model": {"uri": "pvc://models/smollm2"}, "engine": engine})
    state = tuning_configmap.settings_in_effect(parsed, None)
    deployment = builders.build_deployment("smol", "ml", parsed, state, OperatorSettings())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container["args"]


def test_the_engine_gets_the_same_config_as_json():
    args = engine_args({"method": "ngram", "numSpeculativeTokens": 3, "promptLookupMax": 5})
    value = json.loads(args[args.index("--speculative-config") + 1])
    assert value == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
    # What `kvpilot serve` parses from it is a valid engine config with those values.
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    parsed = resolve_serve_args(parser.parse_args(args[1:]), environ={})
    config = SpeculativeConfig.from_dict(engine_overrides(parsed)["speculative_config"])
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == ("ngram", 3, 5)


def test_off_unless_asked_and_defaults_filled():
    assert "--speculative-config" not in engine_args(None)
    args = engine_args({})
    value = json.loads(args[args.index("--speculative-config") + 1])
    assert value == {"method": "ngram", "num_speculative_tokens": 4}
    SpeculativeConfig.from_dict(value)


@pytest.mark.parametrize(
    "speculative, message",
    [
        ({"method": "eagle"}, "engine.speculative.method"),
        ({"promptLookupMin": 5, "promptLookupMax": 3}, "promptLookupMin must be at most promptLookupMax"),
        ({"numSpeculativeTokens": MAX_NUM_SPECULATIVE_TOKENS + 1}, "numSpeculativeTokens"),
        ({"lookahead": 2}, "lookahead"),
    ],
)
def test_invalid_specs_are_rejected_naming_the_field(speculative, message):
    with pytest.raises(ValidationError, match=message):
        spec.parse_spec({"model": {"uri": "pvc://m"}, "engine": {"speculative": speculative}})


def test_the_crd_carries_the_field_and_its_rules():
    schema = yaml.safe_load(crd.render_crd())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    speculative = schema["properties"]["spec"]["properties"]["engine"]["properties"]["speculative"]
    assert set(speculative["properties"]) == {
        "method", "numSpeculativeTokens", "promptLookupMax", "promptLookupMin", "disableByBatchSize"}
    assert speculative["properties"]["numSpeculativeTokens"]["maximum"] == MAX_NUM_SPECULATIVE_TOKENS
    rules = {rule["message"] for rule in speculative["x-kubernetes-validations"]}
    assert "engine.speculative.method must be ngram" in rules
