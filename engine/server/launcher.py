"""``kvpilot serve``: load the engine, apply persisted tuning, run uvicorn until drained."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from kvpilot.engine.server.args import ArgsError, engine_overrides, load_chat_template, resolve_serve_args
from kvpilot.engine.server.engine_protocol import Engine
from kvpilot.engine_contract import TUNING_FILE_KEYS, TUNING_FILE_LORAS_KEY

logger = logging.getLogger("kvpilot.serve")


class TuningFileError(ValueError):
    """The tuning file exists but cannot be used; the message names the file and the key."""


def load_tuning_file(path: str | Path) -> dict[str, Any] | None:
    """The persisted tuning values as engine flag names, and the LoRA adapters to load at start as
    ``lora_modules`` (name -> folder); None when the file does not exist.

    The file is a JSON or YAML mapping (JSON is YAML). A folder is read as a
    mounted ConfigMap: one file per key.
    """
    import yaml

    path = Path(path)
    if not path.exists():
        return None
    if path.is_dir():
        raw: Any = {key: (path / key).read_text().strip() for key in TUNING_FILE_KEYS if (path / key).is_file()}
        raw = {key: yaml.safe_load(value) for key, value in raw.items()}
    else:
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise TuningFileError(f"tuning file {path}: not valid JSON/YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise TuningFileError(
            f"tuning file {path}: expected a mapping like {{maxNumSeqs: 32}}, got {type(raw).__name__}"
        )
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key == TUNING_FILE_LORAS_KEY:
            values["lora_modules"] = _lora_modules(path, value)
            continue
        if key not in TUNING_FILE_KEYS:
            logger.warning("tuning file %s: ignoring unknown key %r (known: %s)", path, key,
                           ", ".join(TUNING_FILE_KEYS))
            continue
        if value is None:
            continue
        if key == "gpuMemoryUtilization":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1
        else:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        if not ok:
            expected = "a fraction in (0, 1]" if key == "gpuMemoryUtilization" else "a positive integer"
            raise TuningFileError(f"tuning file {path}: {key} must be {expected}, got {value!r}")
        values[TUNING_FILE_KEYS[key]] = value
    return values


def _lora_modules(path: Path, value: Any) -> dict[str, str]:
    entries = value if isinstance(value, list) else [value]
    modules = {}
    for entry in entries:
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("path"), str)):
            raise TuningFileError(f"tuning file {path}: {TUNING_FILE_LORAS_KEY} must be a list of {{name, path}}, "
                                  f"got {entry!r}")
        modules[entry["name"]] = entry["path"]
    return modules


def _load_loras(engine: Engine, from_flags: dict[str, str], from_file: dict[str, str]) -> None:
    """The adapters of --lora-modules (one that fails stops the start: the user named it) and of the
    tuning file (one that fails is logged and skipped: the operator reports it and the model serves)."""
    from kvpilot.engine.lora import LoRAError, LoRARequest

    if from_file and not engine.config.enable_lora:
        logger.warning("tuning file lists LoRA adapters (%s) but LoRA is off (--enable-lora): not loading them",
                       ", ".join(from_file))
        return
    for index, (name, path) in enumerate({**from_file, **from_flags}.items(), start=1):
        try:
            adapter = engine.add_lora(LoRARequest(name, index, path))
        except LoRAError as exc:
            if name in from_flags:
                raise
            logger.error("LoRA adapter from the tuning file not loaded: %s", exc)
            continue
        logger.info("LoRA adapter %r: rank %d from %s", adapter.name, adapter.rank, path)


def _checked_chat_template(value: str) -> str:
    """--chat-template's text, parsed once so a syntax error stops ``serve`` here, not every request."""
    import jinja2

    text = load_chat_template(value)
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ArgsError(f"--chat-template: not a valid Jinja template (line {exc.lineno}: {exc.message})") from None
    return text


def run_server(args: argparse.Namespace) -> int:
    try:
        args = resolve_serve_args(args)
    except ArgsError as exc:
        print(f"kvpilot serve: error: {exc}", file=sys.stderr)
        return 2
    if args.admin_token and args.admin_port == args.port:
        print(f"kvpilot serve: error: --admin-port {args.admin_port} is --port: give the admin API a port of its "
              "own (the OpenAI port is the one clients and the Service reach)", file=sys.stderr)
        return 2
    chat_template = None
    if args.chat_template is not None:
        try:
            chat_template = _checked_chat_template(args.chat_template)
        except ArgsError as exc:
            print(f"kvpilot serve: error: {exc}", file=sys.stderr)
            return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    overrides = engine_overrides(args)
    loras_from_file: dict[str, str] = {}
    if args.tuning_file is not None:
        try:
            tuned = load_tuning_file(args.tuning_file)
        except (TuningFileError, OSError) as exc:
            print(f"kvpilot serve: error: {exc}", file=sys.stderr)
            return 2
        if tuned is None:
            logger.info("tuning file %s does not exist (yet): using the flags", args.tuning_file)
        else:
            loras_from_file = tuned.pop("lora_modules", {})
            changes = {k: (overrides.get(k), v) for k, v in tuned.items() if overrides.get(k) != v}
            logger.info(
                "tuning file %s overrides the flags: %s",
                args.tuning_file,
                ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changes.items()) or "no change",
            )
            overrides.update(tuned)

    import uvicorn

    from kvpilot.engine.config import EngineConfig
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.server.api_server import DrainingServer, ServerSettings, build_app
    from kvpilot.engine.server.serving import ChatSettings

    from kvpilot.engine.spec_decode.config import SpeculativeConfig

    imported = _seconds_since_exec()
    try:
        if "speculative_config" in overrides:
            overrides["speculative_config"] = SpeculativeConfig.from_dict(overrides["speculative_config"])
        config = EngineConfig(model=args.model, **overrides)
        logger.info("loading %s", args.model)
        engine = LLMEngine.from_config(config)
    except ValueError as exc:  # ConfigError, ModelLoadError: both say what to change
        print(f"kvpilot serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        _load_loras(engine, dict(args.lora_modules or []), loras_from_file)
    except ValueError as exc:  # a --lora-modules adapter the user named cannot be served
        print(f"kvpilot serve: error: {exc}", file=sys.stderr)
        return 2
    _log_engine(engine, args.served_model_name)
    ready = _seconds_since_exec()
    if ready is not None and imported is not None:
        logger.info("start-up: %.1f s from exec to a loaded engine (Python imports %.1f s, engine %.1f s)",
                    ready, imported, ready - imported)

    settings = ServerSettings(
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        admin_token=args.admin_token,
        admin_port=args.admin_port if args.admin_token else None,
        max_waiting_requests=args.max_waiting_requests,
        max_waiting_seconds=args.max_waiting_seconds,
        shutdown_grace_period=args.shutdown_grace_period,
        max_request_bytes=args.max_request_bytes,
        chat=ChatSettings(chat_template=chat_template, tool_call_parser=args.tool_call_parser),
    )
    app = build_app(engine, settings)
    logger.info(
        "listening on http://%s:%d (API key %s, admin API %s, waiting queue %d requests%s, shutdown grace %.0fs)",
        args.host, args.port, "required" if args.api_key else "off",
        f"on port {args.admin_port}" if args.admin_token else "off", args.max_waiting_requests,
        f" or {args.max_waiting_seconds:g} s of predicted wait" if args.max_waiting_seconds else "",
        args.shutdown_grace_period,
    )  # fmt: skip
    uvicorn_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # The drain already waited for the engine; this only bounds the last response writes.
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    # One server, one drain: the admin API is a second listening socket of the same server.
    sockets = [uvicorn_config.bind_socket()]
    if args.admin_token:
        sockets.append(uvicorn.Config(app, host=args.host, port=args.admin_port).bind_socket())
    server = DrainingServer(uvicorn_config, app.state.kvpilot)
    server.run(sockets=sockets)
    return 0 if server.started else 1


def _seconds_since_exec() -> float | None:
    """Seconds since this process started (Linux /proc), Python's own start-up included."""
    try:
        since_boot = float(Path("/proc/uptime").read_text().split()[0])
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None
    return since_boot - start_ticks / os.sysconf("SC_CLK_TCK")


def _log_engine(engine: Engine, served_name: str) -> None:
    config, resolved, arch = engine.config, engine.resolved, engine.arch
    from kvpilot.engine.server.state import weight_layouts

    logger.info(
        "loaded %s (%s, %d layers, hidden %d, vocab %d) on %s as %s, attention backend %s, weights %s",
        config.model, arch.architecture, arch.num_layers, arch.hidden_size, arch.vocab_size,
        resolved.device, resolved.dtype, resolved.attention_backend, weight_layouts(engine.runner.model),
    )  # fmt: skip
    logger.info(
        "KV cache: %d blocks x %d tokens = %d token slots (%.1f MiB); max_model_len %d, max_num_seqs %d, "
        "max_num_batched_tokens %d, prefix caching %s, chunked prefill %s",
        resolved.num_kv_blocks, config.block_size, resolved.num_kv_blocks * config.block_size,
        resolved.num_kv_blocks * resolved.kv_block_bytes / 1024**2, resolved.max_model_len, config.max_num_seqs,
        resolved.max_num_batched_tokens, "on" if config.enable_prefix_caching else "off",
        "on" if config.enable_chunked_prefill else "off",
    )  # fmt: skip
    if config.speculative_config is not None:
        logger.info("speculative decoding: %s", config.speculative_config.to_dict())
    logger.info("serving it as model %r", served_name)
