"""spec.engine.quantization: validated by the spec's rule and passed to `kvpilot serve` as --quantization."""

from __future__ import annotations

import pytest

from kvpilot.operator import builders, spec, tuning_configmap
from kvpilot.operator.settings import OperatorSettings


def _engine_args(engine: dict) -> list[str]:
    parsed = spec.parse_spec({"model": {"uri": "pvc://models/llama"}, "engine": engine})
    state = tuning_configmap.settings_in_effect(parsed, None)
    settings = OperatorSettings(engine_image="registry.example/kvpilot:1.2.3")
    return builders.engine_args("llama", parsed, state, "/models/llama", settings)


@pytest.mark.parametrize("quantization", ["auto", "awq", "gguf", "none"])
def test_quantization_becomes_the_serve_flag(quantization):
    args = _engine_args({"quantization": quantization})
    assert args[args.index("--quantization") + 1] == quantization


def test_quantization_defaults_to_auto():
    args = _engine_args({})
    assert args[args.index("--quantization") + 1] == "auto"


def test_unknown_quantization_is_rejected_naming_the_field():
    with pytest.raises(ValueError, match="engine.quantization must be auto, awq, gguf or none"):
        spec.parse_spec({"model": {"uri": "pvc://models/llama"}, "engine": {"quantization": "int4"}})
