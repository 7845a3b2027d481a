"""The contract between the engine (`kvpilot serve`) and the operator that drives it.

Every name one side writes and the other reads is spelled here once: the port and
HTTP paths, the admin API's keys, the tuning file's keys, the environment
variables, and the Prometheus metrics the engine exports and the operator reads.
The module imports nothing, so the operator's image never needs torch and the
engine never needs kopf; both import it.

Metric names follow Prometheus conventions: the ``kvpilot_`` prefix, base units in
the name (``_seconds``, ``_ratio``), and ``_total`` on counters. prometheus_client
appends ``_total`` to a Counter's name by itself, so counters are listed here by
their exposed name and the engine strips the suffix when it registers them (see
``counter_base_name``). docs/metrics.md maps each one to its vLLM counterpart.
"""

from __future__ import annotations

# --- HTTP ---------------------------------------------------------------------------

ENGINE_PORT = 8000  # `kvpilot serve --port` default; the Service and the pods' containerPort
# `kvpilot serve --admin-port` default: the admin API listens here only, a port the Service does not expose.
ADMIN_PORT = 8001
HEALTH_PATH = "/health"  # 200 while serving, 503 while draining or when the engine died
METRICS_PATH = "/metrics"  # Prometheus text exposition, no auth
# GET reads, POST changes the scheduler limits live; `Authorization: Bearer <admin token>`.
ADMIN_SCHEDULER_PATH = "/admin/v1/scheduler"
# The admin API's JSON keys: the limits it changes live, named as `kvpilot serve`'s flags.
LIVE_SETTINGS = ("max_num_seqs", "max_num_batched_tokens")
# Everything the admin API changes live: the operator's settings above, plus the depth of
# speculative decoding (an engine started with --speculative-config; 0 pauses it).
ADMIN_SETTINGS = LIVE_SETTINGS + ("num_speculative_tokens",)
# `kvpilot serve --speculative-config` (spec.engine.speculative): the methods the engine offers and the
# most tokens it proposes per step.
SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_NUM_SPECULATIVE_TOKENS = 16
# `kvpilot serve --tool-call-parser` (spec.engine.toolCallParser): how tool_choice auto finds calls.
TOOL_CALL_PARSERS = ("hermes", "json")
# LoRA adapters (spec.loras; `kvpilot serve --enable-lora --lora-modules NAME=PATH ...`), loaded and
# unloaded live on the admin port with vLLM's bodies: {"lora_name", "lora_path"} and {"lora_name"}.
ADMIN_LOAD_LORA_PATH = "/v1/load_lora_adapter"
ADMIN_UNLOAD_LORA_PATH = "/v1/unload_lora_adapter"
# GET: {"enabled": whether the engine serves adapters, "data": [{"name", "path", "rank"}]}, those loaded
ADMIN_LORA_ADAPTERS_PATH = "/admin/v1/lora_adapters"

# --- start-up ------------------------------------------------------------------------

ENV_PREFIX = "KVPILOT_"  # every `kvpilot serve` flag also reads KVPILOT_<FLAG>


def flag_env(flag: str) -> str:
    """The environment variable of a `kvpilot serve` flag (``admin_token`` -> ``KVPILOT_ADMIN_TOKEN``)."""
    return ENV_PREFIX + flag.upper()


ADMIN_TOKEN_ENV = flag_env("admin_token")  # turns the admin API on, with this bearer token
API_KEY_ENV = flag_env("api_key")  # clients must send `Authorization: Bearer <key>` on /v1/*
CHAT_TEMPLATE_ENV = flag_env("chat_template")  # spec.engine.chatTemplate: the Jinja text itself
CPU_MEMORY_LIMIT_ENV = flag_env("cpu_memory_limit")  # the container's memory limit (Downward API)

# `kvpilot serve --tuning-file`: a JSON/YAML mapping whose values override the flags at start,
# so live-tuned values survive a restart. File key -> the flag it overrides.
TUNING_FILE_KEYS = {
    "maxNumSeqs": "max_num_seqs",
    "maxNumBatchedTokens": "max_num_batched_tokens",
    "gpuMemoryUtilization": "gpu_memory_utilization",
}
# The tuning file's list of LoRA adapters ([{"name", "path"}]) a pod loads at start, added to
# --lora-modules: the operator keeps it equal to spec.loras, so a new pod starts with every adapter.
TUNING_FILE_LORAS_KEY = "loraModules"

# --- metrics -------------------------------------------------------------------------

# Gauges: sampled at scrape time.
REQUESTS_RUNNING = "kvpilot_num_requests_running"
REQUESTS_WAITING = "kvpilot_num_requests_waiting"
KV_CACHE_USAGE = "kvpilot_kv_cache_usage_ratio"  # blocks in use / blocks total
KV_CACHE_BLOCKS = "kvpilot_kv_cache_blocks"  # blocks the engine was given at start-up
KV_CACHE_UTILIZATION = "kvpilot_kv_cache_utilization_ratio"  # tokens stored / token slots held
MAX_NUM_SEQS = "kvpilot_max_num_seqs"
MAX_NUM_BATCHED_TOKENS = "kvpilot_max_num_batched_tokens"
GPU_MEMORY_UTILIZATION = "kvpilot_gpu_memory_utilization"
MODEL_INFO = "kvpilot_model_info"  # value 1; labels describe the served model

# Counters (exposed names).
PREEMPTIONS = "kvpilot_preemptions_total"
PREFIX_CACHE_QUERIES = "kvpilot_prefix_cache_queries_total"  # prompt tokens looked up
PREFIX_CACHE_HITS = "kvpilot_prefix_cache_hits_total"  # prompt tokens found cached
PROMPT_TOKENS = "kvpilot_prompt_tokens_total"
GENERATION_TOKENS = "kvpilot_generation_tokens_total"
REQUEST_SUCCESS = "kvpilot_request_success_total"  # label: finish_reason
REQUESTS_REJECTED = "kvpilot_requests_rejected_total"  # 429s at admission; label: reason (REJECT_REASONS)
# Per LoRA adapter (label LORA_NAME_LABEL; only adapters loaded now, so as many series as adapters).
LORA_REQUESTS = "kvpilot_lora_requests_total"  # finished requests that ran with the adapter
LORA_GENERATION_TOKENS = "kvpilot_lora_generation_tokens_total"  # tokens generated with it
LORA_NAME_LABEL = "lora_name"
ENGINE_STEPS = "kvpilot_engine_steps_total"  # scheduler iterations that ran a forward
STEP_RUNNING_SEQS = "kvpilot_step_running_seqs_total"  # running requests summed over steps

# Speculative decoding (only with --speculative-config), vLLM's spec_decode names with our prefix.
SPEC_DECODE_NUM_SPECULATIVE_TOKENS = "kvpilot_spec_decode_num_speculative_tokens"  # gauge: current k
SPEC_DECODE_NUM_DRAFTS = "kvpilot_spec_decode_num_drafts_total"  # sequence-steps that verified proposals
SPEC_DECODE_NUM_DRAFT_TOKENS = "kvpilot_spec_decode_num_draft_tokens_total"  # proposals verified
SPEC_DECODE_NUM_ACCEPTED_TOKENS = "kvpilot_spec_decode_num_accepted_tokens_total"  # proposals accepted
# label: position (0 = the first proposal of a step)
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS = "kvpilot_spec_decode_num_accepted_tokens_per_pos_total"
# Gauges since start: accepted / draft tokens, and 1 + accepted / drafts (tokens per verifying step).
SPEC_DECODE_ACCEPTANCE_RATE = "kvpilot_spec_decode_draft_acceptance_ratio"
SPEC_DECODE_MEAN_ACCEPTANCE_LENGTH = "kvpilot_spec_decode_mean_acceptance_length"
POSITION_LABEL = "position"

# Histograms (base names; the exposition adds _bucket, _sum and _count).
TIME_TO_FIRST_TOKEN = "kvpilot_time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "kvpilot_inter_token_latency_seconds"
# A finished request's mean inter-token latency (its TPOT: the gaps INTER_TOKEN_LATENCY observed for it,
# over their count), one observation per request; on INTER_TOKEN_LATENCY_BUCKETS.
TIME_PER_OUTPUT_TOKEN = "kvpilot_request_time_per_output_token_seconds"
E2E_REQUEST_LATENCY = "kvpilot_e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "kvpilot_request_queue_time_seconds"
# The wait of a preempted request until its next token: queueing again, not a token's cost, so it is
# left out of INTER_TOKEN_LATENCY (a lowered max_num_seqs preempts the excess at once).
PREEMPTION_STALL = "kvpilot_request_preemption_stall_seconds"

# The engine's cost curve (engine/step_cost.py): sums over steps of the terms a least-squares fit of
# step seconds on decode rows and prefill tokens needs, one sample per term (label TERM_LABEL); and
# step durations by kind (label STEP_KIND_LABEL), on INTER_TOKEN_LATENCY_BUCKETS.
STEP_COST_SUMS = "kvpilot_step_cost_sums_total"
STEP_COST_TERMS = ("steps", "rows", "prefill", "seconds", "rows_rows", "rows_prefill", "prefill_prefill",
                   "rows_seconds", "prefill_seconds", "seconds_seconds")
TERM_LABEL = "term"
STEP_DURATION = "kvpilot_step_duration_seconds"
STEP_KINDS = ("decode", "prefill")  # decode rows only; carrying prefill tokens (with or without decodes)
STEP_KIND_LABEL = "step_kind"

FINISH_REASON_LABEL = "finish_reason"
REJECT_REASON_LABEL = "reason"
# Why admission turned a request away: the queue held --max-waiting-requests, or the wait predicted
# for it was over --max-waiting-seconds.
REJECT_REASONS = ("queue_full", "queue_wait")
MODEL_NAME_LABEL = "model_name"

# Buckets that resolve both a 2-core CPU (tens to hundreds of ms per step) and
# a GPU (a few ms per decode step).
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
INTER_TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.06, 0.075, 0.09, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0,
    120.0, 240.0, 480.0, 960.0,
)


def counter_base_name(exposed_name: str) -> str:
    """The name to give prometheus_client.Counter so that it exposes ``exposed_name``."""
    if not exposed_name.endswith("_total"):
        raise ValueError(f"counter name {exposed_name!r} must end in _total")
    return exposed_name[: -len("_total")]
