"""`kvpilot serve` flags, their KVPILOT_* variables, and the persisted tuning file."""

from __future__ import annotations

import argparse
import json
import logging
import re

import pytest

from kvpilot.engine.server.args import (
    SERVE_FLAGS,
    ArgsError,
    add_serve_arguments,
    engine_overrides,
    load_chat_template,
    parse_size,
    resolve_serve_args,
)
from kvpilot.engine.server.launcher import TuningFileError, load_tuning_file, run_server


def parse(argv: list[str], env: dict[str, str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return resolve_serve_args(parser.parse_args(argv), environ=env or {})


def test_defaults_and_served_name():
    args = parse(["/models/m"])
    assert (args.host, args.port, args.max_waiting_requests, args.log_level) == ("0.0.0.0", 8000, 1024, "info")
    assert args.served_model_name == "/models/m"
    assert engine_overrides(args) == {}  # the engine's own defaults apply


def test_environment_fills_flags_and_the_command_line_wins():
    env = {
        "KVPILOT_MODEL": "/models/env",
        "KVPILOT_MAX_NUM_SEQS": "12",
        "KVPILOT_ADMIN_TOKEN": "s3cret",
        "KVPILOT_ENABLE_PREFIX_CACHING": "false",
        "KVPILOT_KV_CACHE_MEMORY": "2GiB",
        "KVPILOT_PORT": "9000",
        "KVPILOT_DTYPE": "float32",
        "KVPILOT_CPU_MEMORY_LIMIT": "8Gi",  # as the Downward API passes a limit written 8Gi
    }
    args = parse(["--port", "9100"], env)
    assert args.model == "/models/env" and args.port == 9100 and args.admin_token == "s3cret"
    assert engine_overrides(args) == {
        "max_num_seqs": 12, "enable_prefix_caching": False, "kv_cache_memory": 2 * 1024**3, "dtype": "float32",
        "cpu_memory_limit": 8 * 1024**3,
    }  # fmt: skip
    assert parse(["/m", "--max-num-seqs", "3", "--enable-prefix-caching"], env).max_num_seqs == 3
    assert engine_overrides(parse(["/m", "--enable-prefix-caching"], env))["enable_prefix_caching"] is True


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"KVPILOT_MAX_NUM_SEQS": "many"}, "KVPILOT_MAX_NUM_SEQS='many' (for --max-num-seqs)"),
        ({"KVPILOT_MAX_NUM_SEQS": "0"}, "positive integer"),
        ({"KVPILOT_ENFORCE_EAGER": "perhaps"}, "true or false"),
        ({"KVPILOT_DEVICE": "tpu"}, "must be one of auto, cpu, cuda"),
        ({"KVPILOT_KV_CACHE_MEMORY": "lots"}, "4GiB"),
        ({"KVPILOT_MAX_WAITING_SECONDS": "0"}, "KVPILOT_MAX_WAITING_SECONDS='0' (for --max-waiting-seconds): must be > 0"),
        ({"KVPILOT_MAX_WAITING_SECONDS": "inf"}, "finite number"),
    ],
)
def test_bad_environment_values_name_the_variable(env, fragment):
    with pytest.raises(ArgsError) as info:
        parse(["/m"], env)
    assert fragment in str(info.value)


def test_kubernetes_service_link_is_not_a_port():
    assert parse(["/m"], {"KVPILOT_PORT": "tcp://10.96.0.7:8000"}).port == 8000


def test_missing_model_says_how_to_give_it():
    with pytest.raises(ArgsError, match="KVPILOT_MODEL"):
        parse([], {})


def test_every_flag_has_a_documented_variable():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    text = parser.format_help().replace("\n", " ")
    for flag in SERVE_FLAGS:
        assert flag.option in text and flag.env in " ".join(text.split())


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1024", 1024), ("4GiB", 4 * 1024**3), ("512MiB", 512 * 1024**2), ("1.5GB", 1_500_000_000), ("64k", 64_000)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_tuning_file_json_yaml_and_folder(tmp_path):
    json_file = tmp_path / "tuning.json"
    json_file.write_text(json.dumps({"maxNumSeqs": 24, "maxNumBatchedTokens": 512}))
    assert load_tuning_file(json_file) == {"max_num_seqs": 24, "max_num_batched_tokens": 512}
    yaml_file = tmp_path / "tuning.yaml"
    yaml_file.write_text("maxNumSeqs: 8\ngpuMemoryUtilization: 0.85\n")
    assert load_tuning_file(yaml_file) == {"max_num_seqs": 8, "gpu_memory_utilization": 0.85}
    folder = tmp_path / "configmap"
    folder.mkdir()
    (folder / "maxNumSeqs").write_text("16\n")
    assert load_tuning_file(folder) == {"max_num_seqs": 16}
    assert load_tuning_file(tmp_path / "absent.json") is None


def test_tuning_file_errors_name_the_key(tmp_path, caplog):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"maxNumSeqs": 0}))
    with pytest.raises(TuningFileError, match="maxNumSeqs must be a positive integer"):
        load_tuning_file(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(TuningFileError, match="expected a mapping"):
        load_tuning_file(bad)
    bad.write_text("{unclosed")
    with pytest.raises(TuningFileError, match="not valid JSON/YAML"):
        load_tuning_file(bad)
    bad.write_text(json.dumps({"maxNumSeqs": 4, "speed": "fast"}))
    with caplog.at_level(logging.WARNING):
        assert load_tuning_file(bad) == {"max_num_seqs": 4}
    assert "speed" in caplog.text


def test_chat_template_is_a_file_or_the_template_text(tmp_path, capsys):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert load_chat_template(str(template)) == template.read_text()
    assert load_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ArgsError, match="--chat-template: no file /nowhere.jinja"):
        load_chat_template("/nowhere.jinja")
    # A syntax error stops serve before the model loads, naming the flag and the line.
    bad = tmp_path / "bad.jinja"
    bad.write_text("line one\n{% for m in messages %}{{ m.content }}")
    args = parse(["/no/such/model", "--chat-template", str(bad)])
    assert run_server(args) == 2
    assert "--chat-template: not a valid Jinja template (line 2" in capsys.readouterr().err


def test_tool_call_parser_takes_the_parsers_names():
    assert parse(["/m", "--tool-call-parser", "hermes"]).tool_call_parser == "hermes"
    assert parse(["/m"], {"KVPILOT_TOOL_CALL_PARSER": "json"}).tool_call_parser == "json"
    with pytest.raises(ArgsError, match="must be one of hermes, json"):
        parse(["/m"], {"KVPILOT_TOOL_CALL_PARSER": "mistral"})


def test_lora_modules_from_flags_or_environment_turn_lora_on():
    args = parse(["/m", "--lora-modules", "sql=/a/sql", "chat=/a/chat", "--max-loras", "2"])
    assert args.lora_modules == [("sql", "/a/sql"), ("chat", "/a/chat")]
    assert engine_overrides(args) == {"enable_lora": True, "max_loras": 2}
    from_env = parse(["/m"], {"KVPILOT_LORA_MODULES": "sql=/a/sql chat=/a/chat", "KVPILOT_MAX_LORA_RANK": "64"})
    assert from_env.lora_modules == [("sql", "/a/sql"), ("chat", "/a/chat")] and from_env.max_lora_rank == 64
    assert parse(["/m"]).enable_lora is None  # off unless asked for


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["/m", "--lora-modules", "sql=/a", "sql=/b"], {}, "--lora-modules: sql named twice"),
    (["/m", "--served-model-name", "m", "--lora-modules", "m=/a"], {}, "--lora-modules: m named twice"),
    (["/m"], {"KVPILOT_LORA_MODULES": "sql"}, "KVPILOT_LORA_MODULES='sql' (for --lora-modules): expected NAME=PATH"),
])
def test_bad_lora_modules_name_the_flag(argv, env, message):
    with pytest.raises(ArgsError, match=re.escape(message)):
        parse(argv, env)


def test_a_lora_module_without_a_path_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit):
        parse(["/m", "--lora-modules", "sql"])
    assert "expected NAME=PATH" in capsys.readouterr().err
