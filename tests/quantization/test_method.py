"""Choosing the quantization: what a checkpoint holds, what was asked for, and the errors in between."""

from __future__ import annotations

import json
import shutil

import pytest

from kvpilot.engine.config import ConfigError, EngineConfig
from kvpilot.engine.checkpoint import ModelLoadError
from kvpilot.engine.quantization.method import checkpoint_quantization, read_awq_config, resolve_quantization
from kvpilot.engine.server.args import engine_overrides, resolve_serve_args


def _with_quantization_config(tmp_path, source, quantization_config):
    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_plain_folder_resolves_to_none(tiny_model_dir):
    assert checkpoint_quantization(tiny_model_dir) == "none"
    assert resolve_quantization("auto", tiny_model_dir) == "none"
    assert resolve_quantization("none", tiny_model_dir) == "none"
    with pytest.raises(ConfigError, match="quantization: 'awq' was asked for.*unquantized weights.*kvpilot quantize"):
        resolve_quantization("awq", tiny_model_dir)
    with pytest.raises(ConfigError, match="'gguf' was asked for"):
        resolve_quantization("gguf", tiny_model_dir)


def test_awq_folder_is_detected_from_its_quantization_config(tmp_path, tiny_model_dir):
    folder = _with_quantization_config(tmp_path, tiny_model_dir, {
        "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "GEMM"})
    assert read_awq_config(folder).group_size == 32
    assert resolve_quantization("auto", folder) == "awq"
    assert resolve_quantization("none", folder) == "none"
    with pytest.raises(ConfigError, match="is an AWQ checkpoint"):
        resolve_quantization("gguf", folder)


@pytest.mark.parametrize("quantization_config,message", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method is 'gptq'"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "bits=4"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemm'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 100}, "group_size is 100"),
])
def test_unsupported_quantization_configs_are_named(tmp_path, tiny_model_dir, quantization_config, message):
    folder = _with_quantization_config(tmp_path, tiny_model_dir, quantization_config)
    with pytest.raises(ModelLoadError, match=message):
        checkpoint_quantization(folder)


def test_engine_config_validates_the_choice():
    assert EngineConfig(model="m").quantization == "auto"
    with pytest.raises(ConfigError, match="quantization: must be one of auto, awq, gguf, none; got 'int4'"):
        EngineConfig(model="m", quantization="int4")


def test_serve_flag_and_environment_reach_the_engine_config():
    import argparse

    from kvpilot.engine.server.args import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = resolve_serve_args(parser.parse_args(["/m", "--quantization", "none"]), environ={})
    assert engine_overrides(args)["quantization"] == "none"
    args = resolve_serve_args(parser.parse_args(["/m"]), environ={"KVPILOT_QUANTIZATION": "awq"})
    assert engine_overrides(args)["quantization"] == "awq"
    assert "quantization" not in engine_overrides(resolve_serve_args(parser.parse_args(["/m"]), environ={}))
