"""The flags of ``kvpilot serve``, each also readable from a ``KVPILOT_*`` environment variable.

Precedence: command line, then the environment variable, then the default. The
environment is read after parsing, so a bad variable only breaks ``serve`` (and
the error names the variable). Only argparse, the standard library and the
engine contract are imported here: ``kvpilot --help`` must stay fast.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpilot.engine_contract import ADMIN_PORT, ENGINE_PORT, ENV_PREFIX, TOOL_CALL_PARSERS, flag_env


class ArgsError(ValueError):
    """A flag or environment value is invalid; the message names it."""


def parse_size(text: str) -> int:
    """Bytes from ``4294967296``, ``4GiB``, ``512MiB``, ``1.5GB``, ``64k`` ..."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?)b?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4GiB, 512MiB, 1073741824)")
    number, prefix, binary = match.groups()
    base = 1024 if binary or not prefix else 1000
    exponent = " kmgt".index(prefix or " ")
    return int(float(number) * base**exponent)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = _finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = _finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object like {{\"method\": \"ngram\"}}, got {text!r}")
    return value


def lora_module(text: str) -> tuple[str, str]:
    """NAME=PATH, as vLLM's --lora-modules takes it."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (an adapter's name and its folder), got {text!r}")
    return name, path


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


@dataclass(frozen=True)
class Flag:
    dest: str
    help: str
    type: Callable[[str], Any] = str
    default: Any = None
    choices: tuple[str, ...] | None = None
    boolean: bool = False  # --x / --no-x
    metavar: str | None = None
    multiple: bool = False  # one or more values (the environment variable separates them by spaces)

    @property
    def option(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def env(self) -> str:
        return flag_env(self.dest)


SERVE_FLAGS = (
    Flag("host", "address to listen on", default="0.0.0.0"),
    Flag("port", "port to listen on", type=positive_int, default=ENGINE_PORT),
    Flag("served_model_name", "model name clients send in `model` (default: MODEL_PATH as given)"),
    Flag("max_num_seqs", "most sequences in the running batch (engine default: 64)", type=positive_int),
    Flag("max_num_batched_tokens", "token budget of one engine step (engine default: 2048 with chunked prefill)",
         type=positive_int),
    Flag("max_model_len", "context length: prompt plus output tokens (default: the model's)", type=positive_int),
    Flag("block_size", "tokens per KV cache block (power of two; default 16)", type=positive_int),
    Flag("gpu_memory_utilization", "fraction of GPU memory the engine may use in all (default 0.9)", type=float),
    Flag("kv_cache_memory", "KV cache size on CPU, in bytes or with a unit: 4GiB, 512MiB", type=parse_size,
         metavar="SIZE"),
    Flag("cpu_memory_limit", "memory the engine may use in all on a CPU (its container's limit; the operator "
         "sets it from the pod's): without --kv-cache-memory the KV cache then takes --gpu-memory-utilization of "
         "it, less the weights and activations", type=parse_size, metavar="SIZE"),
    Flag("dtype", "weight and activation dtype", choices=("auto", "float32", "bfloat16", "float16")),
    Flag("device", "where to run", choices=("auto", "cpu", "cuda")),
    Flag("attention_backend", "attention implementation (auto: triton on GPU, torch on CPU)",
         choices=("auto", "torch", "triton")),
    Flag("quantization", "weights kept quantized: auto (what the checkpoint holds: AWQ folders stay 4-bit, GGUF "
         "Q4_0/Q4_1/Q8_0 stay packed), awq, gguf, or none (dequantize at load); default auto",
         choices=("auto", "awq", "gguf", "none")),
    Flag("enforce_eager", "run every step layer by layer: no CUDA graphs, no one-call CPU decode path", boolean=True),
    Flag("enable_prefix_caching", "reuse KV blocks of shared prompt prefixes (default on)", boolean=True),
    Flag("enable_chunked_prefill", "split long prompts across steps (default on)", boolean=True),
    Flag("seed", "engine random seed (default 0)", type=int),
    Flag("speculative_config", "speculative decoding, vLLM's keys as JSON: {\"method\": \"ngram\", "
         "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2, "
         "\"disable_by_batch_size\": 4} (see docs/speculative.md; default off)", type=json_object, metavar="JSON"),
    Flag("enable_lora", "serve LoRA adapters on top of the model (on by itself with --lora-modules)", boolean=True),
    Flag("lora_modules", "LoRA adapters to serve, each NAME=PATH (a PEFT folder: adapter_config.json, "
         "adapter_model.safetensors); clients send NAME as `model`", type=lora_module, multiple=True,
         metavar="NAME=PATH"),
    Flag("max_loras", "LoRA adapters resident at once; requests for others wait for a slot (default 1)",
         type=positive_int),
    Flag("max_lora_rank", "largest rank an adapter may have (default 16)", type=positive_int),
    Flag("max_waiting_requests", "requests that may wait for a batch slot; beyond it 429 + Retry-After",
         type=positive_int, default=1024),
    Flag("max_waiting_seconds", "turn a request away (429 + Retry-After) when those waiting ahead of it would take "
         "longer than this to start, at the pace the engine has been starting them: keeps admitted requests within "
         "a time-to-first-token SLO under overload (set it below the SLO); unset: only --max-waiting-requests",
         type=positive_float, metavar="SECONDS"),
    Flag("max_request_bytes", "largest request body accepted; beyond it 413 (default 32MiB)", type=parse_size,
         default=32 << 20, metavar="SIZE"),
    Flag("api_key", "require `Authorization: Bearer <key>` on /v1/* (prefer the env variable: a flag's value "
         "shows in the process list)", metavar="KEY"),
    Flag("admin_token", "enable /admin/v1/scheduler on --admin-port, guarded by `Authorization: Bearer <token>`",
         metavar="TOKEN"),
    Flag("admin_port", "port of the admin API, its only listener (the OpenAI port answers 404 for it)",
         type=positive_int, default=ADMIN_PORT),
    Flag("shutdown_grace_period", "seconds SIGTERM waits for in-flight requests before aborting them",
         type=non_negative_float, default=30.0, metavar="SECONDS"),
    Flag("chat_template", "Jinja chat template used instead of the model's own: a file, or the template text "
         "itself (examples/chat-templates/ holds one that offers tools)", metavar="FILE"),
    Flag("tool_call_parser", "how tool_choice auto finds tool calls in the model's text: hermes "
         "(<tool_call>{...}</tool_call>) or json (the whole answer is a call or a list of calls); unset: requests "
         "with tool_choice auto are refused (required and named functions need no parser)",
         choices=TOOL_CALL_PARSERS),
    Flag("tuning_file", "JSON/YAML file with persisted live-tuned values {maxNumSeqs, maxNumBatchedTokens, "
         "gpuMemoryUtilization}; they override the flags at start", metavar="PATH"),
    Flag("log_level", "log level", default="info", choices=("debug", "info", "warning", "error")),
)  # fmt: skip

ENGINE_FIELDS = (
    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "gpu_memory_utilization",
    "kv_cache_memory", "cpu_memory_limit", "dtype", "device", "attention_backend", "quantization", "enforce_eager", "enable_prefix_caching",
    "enable_chunked_prefill", "seed", "speculative_config", "enable_lora", "max_loras", "max_lora_rank",
)  # fmt: skip

EPILOG = (
    "Every flag can also be set with an environment variable KVPILOT_<FLAG>, the flag's name in upper case with "
    "underscores (--max-num-seqs -> KVPILOT_MAX_NUM_SEQS, --admin-token -> KVPILOT_ADMIN_TOKEN, "
    "--enable-prefix-caching -> KVPILOT_ENABLE_PREFIX_CACHING=true|false, MODEL_PATH -> KVPILOT_MODEL). "
    "A flag on the command line wins over its variable."
)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", metavar="MODEL_PATH",
                        help="a Hugging Face model folder (config.json, safetensors, tokenizer) or a single .gguf file "
                        "(e.g. from `kvpilot fetch-model smollm2-135m`) [env KVPILOT_MODEL]")
    for flag in SERVE_FLAGS:
        suffix = f" [env {flag.env}]"
        if flag.default is not None:
            suffix = f" (default: {flag.default})" + suffix
        if flag.boolean:
            parser.add_argument(flag.option, dest=flag.dest, action=argparse.BooleanOptionalAction, default=None,
                                help=flag.help + suffix)
        else:
            parser.add_argument(flag.option, dest=flag.dest, type=flag.type, choices=flag.choices, default=None,
                                metavar=flag.metavar, help=flag.help + suffix, nargs="+" if flag.multiple else None)


def resolve_serve_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> argparse.Namespace:
    """Fill flags not given on the command line from KVPILOT_* variables, then from defaults."""
    values = dict(vars(args))
    if values.get("model") is None:
        values["model"] = environ.get(ENV_PREFIX + "MODEL")
    if not values["model"]:
        raise ArgsError("MODEL_PATH: give the model folder or .gguf file as the first argument or set KVPILOT_MODEL")
    for flag in SERVE_FLAGS:
        if values.get(flag.dest) is not None:
            continue
        raw = environ.get(flag.env)
        # Kubernetes injects KVPILOT_PORT=tcp://IP:PORT into pods when a Service is named
        # "kvpilot" (service links): that is an address, not our --port.
        if raw is None or raw == "" or (flag.dest == "port" and raw.startswith(("tcp://", "udp://"))):
            values[flag.dest] = flag.default
            continue
        values[flag.dest] = _convert_env(flag, raw)
    if values["served_model_name"] is None:
        values["served_model_name"] = values["model"]
    names = [name for name, _ in values["lora_modules"] or []]
    duplicates = sorted({n for n in names if names.count(n) > 1} | ({values["served_model_name"]} & set(names)))
    if duplicates:
        raise ArgsError(f"--lora-modules: {', '.join(duplicates)} named twice (or like --served-model-name); "
                        "give each adapter a name of its own")
    if values["lora_modules"] and values["enable_lora"] is None:
        values["enable_lora"] = True
    return argparse.Namespace(**values)


def _convert_env(flag: Flag, raw: str) -> Any:
    try:
        if flag.multiple:
            return [flag.type(part) for part in raw.split()]
        value = parse_bool(raw) if flag.boolean else flag.type(raw)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ArgsError(f"{flag.env}={raw!r} (for {flag.option}): {exc}") from None
    if flag.choices is not None and value not in flag.choices:
        raise ArgsError(f"{flag.env}={raw!r} (for {flag.option}): must be one of {', '.join(flag.choices)}")
    return value


def load_chat_template(value: str) -> str:
    """--chat-template's text: the file it names, or the value itself when it is a template."""
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as file:
                return file.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ArgsError(f"--chat-template: cannot read {value}: {exc}") from None
    if "{{" in value or "{%" in value:
        return value
    raise ArgsError(f"--chat-template: no file {value}; give a Jinja template file or the template text")


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields the user set; the rest keep EngineConfig's defaults."""
    return {name: getattr(args, name) for name in ENGINE_FIELDS if getattr(args, name) is not None}
