"""The InferenceService resource: pydantic models of its spec and status.

These models are the one source of truth. ``crd.py`` renders the CRD's OpenAPI
schema from them (field descriptions become ``kubectl explain`` text, defaults
become API-server defaults), and each model's ``rules`` become both the CRD's
CEL validations and a pydantic check with the same message, so the operator
and the API server reject the same specs with the same words.

Python attributes are snake_case; the resource's fields are their camelCase
aliases (``max_num_seqs`` is ``maxNumSeqs`` in YAML).
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from kvpilot.engine_contract import MAX_NUM_SPECULATIVE_TOKENS, SPECULATIVE_METHODS, TOOL_CALL_PARSERS

SINGULAR = "inferenceservice"
SHORT_NAMES = ("kvis",)

BLOCK_SIZES = (8, 16, 32, 64, 128)
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "awq", "gguf", "none")
# A chat template rides in the pod spec (an environment variable): far below its object size limit.
MAX_CHAT_TEMPLATE_BYTES = 65536
# Upper bound of the token counts (context length, step budget): far above any model's, low enough
# that a typo (an extra zero or three) is caught at admission rather than by an engine failing to start.
MAX_TOKENS = 1 << 20
# Upper bound of replica counts: a typo, not a fleet.
MAX_REPLICAS = 1024
# Children are named after the InferenceService plus a short suffix, and the
# Service name must be a DNS-1035 label (at most 63 characters).
MAX_NAME_LENGTH = 52


@dataclass(frozen=True)
class Rule:
    """One validation, written twice in one place: CEL for the API server, Python for the operator."""

    cel: str
    message: str
    check: Callable[[Any], bool]
    field_path: str | None = None


class RuleViolation(ValueError):
    """A Rule's check failed; carries the rule, so the error can name its field as the API server does."""

    def __init__(self, rule: Rule) -> None:
        super().__init__(rule.message)
        self.rule = rule


def _add_rules_to_schema(schema: dict[str, Any], cls: type) -> None:
    rules: tuple[Rule, ...] = getattr(cls, "rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [
            {"rule": r.cel, "message": r.message, **({"fieldPath": r.field_path} if r.field_path else {})}
            for r in rules
        ]


class SpecModel(BaseModel):
    """Base of every resource model: camelCase fields, unknown fields rejected, rules checked."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        json_schema_extra=_add_rules_to_schema,
    )
    rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> SpecModel:
        for rule in self.rules:
            if not rule.check(self):
                raise RuleViolation(rule)
        return self


class StatusModel(BaseModel):
    """Base of the status models: camelCase, and tolerant of fields written by newer operators."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


def _object_default(model: type[SpecModel]) -> dict[str, Any]:
    """A nested object's CRD default, written out in full: the API server checks a default
    against the object's CEL rules before the inner fields' defaults would fill it in."""
    return {"default": model().model_dump(by_alias=True, exclude_none=True, mode="json")}


def _preserve_unknown(description: str) -> dict[str, Any]:
    return {"description": description, "json_schema_extra": {"x-kubernetes-preserve-unknown-fields": True}}


# --- spec -----------------------------------------------------------------


class SecretKeySelector(SpecModel):
    """A key of a Secret in the InferenceService's namespace."""

    name: str = Field(description="Name of the Secret.", min_length=1, max_length=253)
    key: str = Field(default="token", description="Key inside the Secret that holds the value.", max_length=253)


# A non-negative Kubernetes quantity (resource.Quantity's grammar): what CEL's isQuantity() accepts, less the sign.
_QUANTITY_PATTERN = r"\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?"


def _is_quantity(text: str) -> bool:
    return re.fullmatch(_QUANTITY_PATTERN, text) is not None


# RE2 patterns (CEL's matches()) that Python's re reads the same way.
MODEL_URI_PATTERNS = (
    "^pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?$",
    "^file:///.+$",
    "^hf://[^/]+/[^/]+$",
)


class ModelLocation(SpecModel):
    """Where a model's files come from: a Hugging Face folder (config.json, safetensors, tokenizer) or one GGUF file."""

    uri: str = Field(
        description=(
            "Location of the model: a Hugging Face folder or one .gguf file. pvc://CLAIM/PATH mounts "
            "PersistentVolumeClaim CLAIM read-only and serves PATH inside it; file:///HOST/PATH mounts a directory, "
            "or a .gguf file, of the node (hostPath); hf://ORG/NAME downloads the repository from the Hugging Face "
            "Hub in an init container before the engine starts."
        ),
        min_length=1,
        max_length=1024,
    )
    revision: str | None = Field(
        default=None, description="hf:// only: branch, tag or commit to download. Defaults to the main branch.",
        max_length=253,
    )
    token_secret: SecretKeySelector | None = Field(
        default=None,
        description="hf:// only: Secret holding a Hugging Face access token, for gated or private repositories.",
    )


def _location_rules(field: str) -> tuple[Rule, ...]:
    """A ModelLocation's rules, their messages naming it where it sits in the spec (``field``)."""
    return (
        Rule(
            cel=" || ".join(f"self.uri.matches('{p}')" for p in MODEL_URI_PATTERNS),
            message=f"{field}.uri must be pvc://CLAIM/PATH, file:///HOST/PATH or hf://ORG/NAME",
            check=lambda m: any(re.fullmatch(p, m.uri) for p in MODEL_URI_PATTERNS),
            field_path=".uri",
        ),
        Rule(
            cel="self.uri.startsWith('hf://') || (!has(self.revision) && !has(self.tokenSecret))",
            message=f"{field}.revision and {field}.tokenSecret apply only to hf:// model URIs",
            check=lambda m: m.uri.startswith("hf://") or (m.revision is None and m.token_secret is None),
        ),
    )


class ModelSource(ModelLocation):
    """The model to serve, and the name clients know it by."""

    served_name: str | None = Field(
        default=None,
        description="Model name clients send in the OpenAI API's `model` field. Defaults to the InferenceService's name.",
        max_length=253,
    )
    rules: ClassVar[tuple[Rule, ...]] = _location_rules("model")


class DraftModelSource(ModelLocation):
    """The draft of speculative decoding: a smaller model with the target's vocabulary, mounted in the pod
    beside it. It has no servedName: clients never address the draft, only the served model."""

    rules: ClassVar[tuple[Rule, ...]] = _location_rules("engine.speculative.model")


class Resources(SpecModel):
    """Compute each engine pod requests; requests equal limits, so GPU pods are never overcommitted."""

    gpus: int = Field(default=1, ge=0, le=64, description="GPUs per engine pod (one engine process uses them all).")
    gpu_resource_name: str = Field(
        default="nvidia.com/gpu",
        description="Extended resource name of a GPU on the nodes (as the device plugin advertises it).",
        min_length=1,
        max_length=253,
    )
    cpu: int | str | None = Field(
        default=None,
        description="CPU per engine pod as a Kubernetes quantity (e.g. 4 or 3500m). Unset: no CPU request or limit.",
        json_schema_extra={"x-kubernetes-int-or-string": True},
    )
    memory: str | None = Field(
        default=None,
        description="Memory per engine pod as a Kubernetes quantity (e.g. 32Gi). Unset: no memory request or limit.",
        max_length=64,
    )
    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel=(
                "!has(self.cpu) || (type(self.cpu) == int ? self.cpu >= 0 : "
                "isQuantity(self.cpu) && !quantity(self.cpu).isLessThan(quantity('0')))"
            ),
            message="resources.cpu must be a non-negative Kubernetes quantity such as 4 or 3500m",
            check=lambda r: r.cpu is None or (r.cpu >= 0 if isinstance(r.cpu, int) else _is_quantity(r.cpu)),
            field_path=".cpu",
        ),
        Rule(
            cel=("!has(self.memory) || "
                 "(isQuantity(self.memory) && !quantity(self.memory).isLessThan(quantity('0')))"),
            message="resources.memory must be a non-negative Kubernetes quantity such as 32Gi or 512Mi",
            check=lambda r: r.memory is None or _is_quantity(r.memory),
            field_path=".memory",
        ),
    )


class SpeculativeDecoding(SpecModel):
    """Speculative decoding (`kvpilot serve --speculative-config`, vLLM's keys): the engine proposes a few
    tokens per step and the model verifies them in one forward; output is unchanged, decode is faster
    at small batches. See docs/speculative.md."""

    method: str = Field(
        default="ngram", max_length=16,
        description="How tokens are proposed: ngram (prompt lookup: the continuation of an earlier occurrence "
        "of the text's last few tokens; no extra model) or draft_model (a smaller model with the target's "
        "vocabulary decodes k tokens greedily; set engine.speculative.model).",
    )
    num_speculative_tokens: int = Field(
        default=4, ge=1, le=MAX_NUM_SPECULATIVE_TOKENS,
        description="Tokens proposed per request per step (changes live through the engine's admin API).",
    )
    prompt_lookup_max: int | None = Field(
        default=None, ge=1, le=64, description="ngram: longest tail matched. Unset: the engine's default (4)."
    )
    prompt_lookup_min: int | None = Field(
        default=None, ge=1, le=64, description="ngram: shortest tail matched. Unset: the engine's default (2)."
    )
    model: DraftModelSource | None = Field(
        default=None,
        description="draft_model only, and required there: the draft model, a Hugging Face folder or .gguf file "
        "with the target's vocabulary (tokenizer) and at least its context length, smaller so that it proposes "
        "cheaply. Mounted read-only in the pod beside the target (an hf:// draft is downloaded by its own init "
        "container). It has the fields of spec.model except servedName: clients never address the draft.",
    )
    disable_by_batch_size: int | None = Field(
        default=None, ge=1, le=4096,
        description="Speculate only in steps with at most this many running requests. Unset: the engine's "
        "default (4).",
    )
    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel=f"self.method in [{', '.join(repr(m) for m in SPECULATIVE_METHODS)}]",
            message=f"engine.speculative.method must be {' or '.join(SPECULATIVE_METHODS)}",
            check=lambda s: s.method in SPECULATIVE_METHODS,
            field_path=".method",
        ),
        Rule(
            cel="!has(self.promptLookupMin) || !has(self.promptLookupMax) || self.promptLookupMin <= self.promptLookupMax",
            message="engine.speculative.promptLookupMin must be at most promptLookupMax",
            check=lambda s: s.prompt_lookup_min is None or s.prompt_lookup_max is None
            or s.prompt_lookup_min <= s.prompt_lookup_max,
            field_path=".promptLookupMin",
        ),
        Rule(
            cel="self.method != 'draft_model' || has(self.model)",
            message="engine.speculative.model is required with method draft_model: set its uri to the draft model "
            "(a smaller model with the target's vocabulary)",
            check=lambda s: s.method != "draft_model" or s.model is not None,
            field_path=".model",
        ),
        Rule(
            cel="self.method == 'draft_model' || !has(self.model)",
            message="engine.speculative.model applies only to method draft_model: remove it, or set method: draft_model",
            check=lambda s: s.method == "draft_model" or s.model is None,
            field_path=".model",
        ),
        Rule(
            cel="self.method != 'draft_model' || (!has(self.promptLookupMin) && !has(self.promptLookupMax))",
            message="engine.speculative.promptLookupMin and promptLookupMax apply only to method ngram: remove them "
            "with draft_model",
            check=lambda s: s.method != "draft_model" or (s.prompt_lookup_min is None and s.prompt_lookup_max is None),
        ),
    )

    def engine_config(self, draft_path: str | None) -> dict[str, Any]:
        """The engine's speculative_config: the same keys in snake_case, unset ones left to the engine, and
        ``model`` the draft's path inside the pod (``draft_path``: where the pod mounts spec's draft)."""
        if (self.model is None) != (draft_path is None):
            raise ValueError(f"method {self.method} with draft path {draft_path!r}: only draft_model takes one, and needs it")
        config = self.model_dump(exclude={"model"}, exclude_none=True)
        if draft_path is not None:
            config["model"] = draft_path
        return config


class EngineSettings(SpecModel):
    """The engine settings the tuner moves: one type from spec.engine through the tuner and the
    tuning ConfigMap to status.engine. maxNumSeqs and maxNumBatchedTokens reach running engines
    through their admin API; gpuMemoryUtilization is a pod-template value (changing it rolls pods)."""

    max_num_seqs: int = Field(
        default=64, ge=1, le=4096,
        description=(
            "Most requests the engine runs in one batch: higher raises throughput and inter-token latency. "
            "With tuning enabled the tuner moves it within spec.tuning.maxNumSeqs, starting from spec.engine's."
        ),
    )
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, le=MAX_TOKENS,
        description="Token budget of one engine step (prefill chunks plus decodes). Unset: the engine's default.",
    )
    gpu_memory_utilization: float = Field(
        default=0.9,
        description=(
            "Fraction of GPU memory the engine may use in all (weights, activations, KV cache), in (0, 1]. "
            "With tuning enabled the tuner moves it within spec.tuning.gpuMemoryUtilization, starting from "
            "spec.engine's."
        ),
    )
    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.gpuMemoryUtilization > 0.0 && self.gpuMemoryUtilization <= 1.0",
            message="engine.gpuMemoryUtilization must be a fraction greater than 0 and at most 1",
            check=lambda e: 0.0 < e.gpu_memory_utilization <= 1.0,
            field_path=".gpuMemoryUtilization",
        ),
        Rule(
            cel="!has(self.maxNumBatchedTokens) || self.maxNumBatchedTokens >= self.maxNumSeqs",
            message="engine.maxNumBatchedTokens must be at least engine.maxNumSeqs: each running request needs a token per step",
            check=lambda e: e.max_num_batched_tokens is None or e.max_num_batched_tokens >= e.max_num_seqs,
            field_path=".maxNumBatchedTokens",
        ),
    )

    @classmethod
    def of(cls, engine: EngineSettings) -> EngineSettings:
        """Just the settings of ``engine`` (a spec's EngineParams carries more fields)."""
        return cls(**{name: getattr(engine, name) for name in cls.model_fields})

    def replace(self, **changes: Any) -> EngineSettings:
        """A copy with ``changes``, validated (a bare model_copy would skip the rules)."""
        return type(self).model_validate({**self.model_dump(), **changes})

    def resource(self) -> dict[str, Any]:
        """The resource's spelling, for status.engine and the tuning state: camelCase keys, and None
        for an unset field (which a merge patch removes)."""
        return self.model_dump(by_alias=True)


class EngineParams(EngineSettings):
    """Parameters of the kvpilot engine (`kvpilot serve`). Changing them rolls the pods one at a time."""

    block_size: int = Field(default=16, description="Tokens per KV-cache block: a power of two from 8 to 128.")
    max_model_len: int | None = Field(
        default=None, ge=1, le=MAX_TOKENS,
        description="Longest sequence (prompt plus output) served. Unset: the model's own limit."
    )
    enable_chunked_prefill: bool = Field(
        default=True, description="Split long prompts across steps so they do not stall running requests."
    )
    enable_prefix_caching: bool = Field(
        default=True, description="Reuse the KV cache of prompt prefixes that earlier requests already computed."
    )
    dtype: str = Field(
        default="auto",
        description="Weights and activations dtype: auto (the model's own), float32, bfloat16 or float16.",
        max_length=16,
    )
    quantization: str = Field(
        default="auto",
        description=(
            "Weights kept quantized: auto (what the model holds: AWQ checkpoints stay 4-bit, GGUF Q4_0/Q4_1/Q8_0 "
            "tensors stay packed), awq, gguf, or none (dequantize at load)."
        ),
        max_length=8,
    )
    speculative: SpeculativeDecoding | None = Field(
        default=None, description="Speculative decoding. Unset: off (one token per request per step)."
    )
    tool_call_parser: str | None = Field(
        default=None, max_length=16,
        description=(
            "How requests with tool_choice auto find tool calls in the model's text: hermes "
            "(<tool_call>{...}</tool_call>, the format of most open models' templates) or json (the whole answer "
            "is a call). Unset: tool_choice auto is refused; required and named functions need no parser."
        ),
    )
    chat_template: str | None = Field(
        default=None, max_length=MAX_CHAT_TEMPLATE_BYTES,
        description=(
            "A Jinja chat template used instead of the model's own, e.g. one that offers tools to the model "
            "(examples/chat-templates/ holds one). A syntax error stops the engine at start, naming the line."
        ),
    )
    max_loras: int = Field(
        default=4, ge=1, le=64,
        description=(
            "LoRA adapters (spec.loras) resident in the engine at once; requests for others wait for a slot "
            "(the least recently used one no running request needs). Only read when spec.loras is set."
        ),
    )
    max_lora_rank: int = Field(
        default=16, ge=1, le=512,
        description="Largest rank (r) an adapter in spec.loras may have; a higher one fails to load, naming it.",
    )
    max_waiting_seconds: float | None = Field(
        default=None, gt=0, le=3600,
        description=(
            "Turn a request away (429 + Retry-After; the kvpilot gateway tries another Ready pod) when the "
            "requests waiting ahead of it would take longer than this to start, at the pace the engine has been "
            "starting them. Under overload this keeps the admitted requests within a time-to-first-token SLO "
            "instead of queueing every one past it: set it below tuning.slo.ttftP99Seconds by the time a prompt "
            "takes to prefill. Unset: requests queue up to the engine's --max-waiting-requests (1024)."
        ),
    )
    extra_args: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="More `kvpilot serve` arguments, appended last (e.g. [\"--device\", \"cpu\"]).",
        json_schema_extra={"items": {"type": "string", "maxLength": 1024}},
    )
    rules: ClassVar[tuple[Rule, ...]] = EngineSettings.rules + (
        Rule(
            cel="self.blockSize in [8, 16, 32, 64, 128]",
            message="engine.blockSize must be a power of two from 8 to 128 (8, 16, 32, 64 or 128)",
            check=lambda e: e.block_size in BLOCK_SIZES,
            field_path=".blockSize",
        ),
        Rule(
            cel="self.dtype in ['auto', 'float32', 'bfloat16', 'float16']",
            message="engine.dtype must be auto, float32, bfloat16 or float16",
            check=lambda e: e.dtype in DTYPES,
            field_path=".dtype",
        ),
        Rule(
            cel="self.quantization in ['auto', 'awq', 'gguf', 'none']",
            message="engine.quantization must be auto, awq, gguf or none",
            check=lambda e: e.quantization in QUANTIZATIONS,
            field_path=".quantization",
        ),
        Rule(
            cel=f"!has(self.toolCallParser) || self.toolCallParser in {list(TOOL_CALL_PARSERS)}",
            message=f"engine.toolCallParser must be {' or '.join(TOOL_CALL_PARSERS)}",
            check=lambda e: e.tool_call_parser is None or e.tool_call_parser in TOOL_CALL_PARSERS,
            field_path=".toolCallParser",
        ),
    )


def _min_at_most_max(field: str) -> Rule:
    return Rule(cel="self.min <= self.max", message=f"tuning.{field}.min must be at most tuning.{field}.max",
                check=lambda b: b.min <= b.max, field_path=".min")


class _WholeBounds(SpecModel):
    min: int
    max: int

    def clamp(self, value: float) -> int:
        """The whole number nearest ``value`` from below, within the bounds."""
        return int(min(max(math.floor(value), self.min), self.max))


class MaxNumSeqsBounds(_WholeBounds):
    """Bounds the tuner keeps engine.maxNumSeqs within."""

    min: int = Field(default=1, ge=1, description="Smallest maxNumSeqs the tuner may set.")
    max: int = Field(default=256, ge=1, le=4096, description="Largest maxNumSeqs the tuner may set.")
    rules: ClassVar[tuple[Rule, ...]] = (_min_at_most_max("maxNumSeqs"),)


class BatchedTokensBounds(_WholeBounds):
    """Bounds the tuner keeps engine.maxNumBatchedTokens within."""

    min: int = Field(ge=1, le=MAX_TOKENS, description="Smallest maxNumBatchedTokens the tuner may set.")
    max: int = Field(ge=1, le=MAX_TOKENS, description="Largest maxNumBatchedTokens the tuner may set.")
    rules: ClassVar[tuple[Rule, ...]] = (_min_at_most_max("maxNumBatchedTokens"),)


class MemoryFractionBounds(SpecModel):
    """Bounds the tuner keeps engine.gpuMemoryUtilization within."""

    min: float = Field(default=0.5, description="Smallest GPU memory fraction the tuner may set.")
    max: float = Field(default=0.95, description="Largest GPU memory fraction the tuner may set.")
    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.min > 0.0 && self.max <= 1.0 && self.min <= self.max",
            message="tuning.gpuMemoryUtilization bounds must satisfy 0 < min <= max <= 1",
            check=lambda b: 0.0 < b.min <= b.max <= 1.0,
        ),
    )

    def clamp(self, value: float) -> float:
        return round(min(max(value, self.min), self.max), 4)


class Slo(SpecModel):
    """Latency targets the tuner keeps while it raises throughput. Give at least one."""

    ttft_p99_seconds: float | None = Field(
        default=None, gt=0, le=3600, description="Target 99th-percentile time to first token, in seconds."
    )
    itl_p99_seconds: float | None = Field(
        default=None, gt=0, le=60,
        description="Target 99th-percentile inter-token latency (every gap between two tokens), in seconds.",
    )
    tpot_p99_seconds: float | None = Field(
        default=None, gt=0, le=60,
        description=(
            "Target 99th-percentile time per output token of a request (its mean inter-token latency, the TPOT "
            "of goodput), in seconds. Steadier than itlP99Seconds: a prompt's chunk sharing a step lengthens one "
            "gap of each running request, not its TPOT. Give this or itlP99Seconds, not both."
        ),
    )

    @property
    def token_latency(self) -> tuple[str, float] | None:
        """The per-token latency SLO, ("ITL" | "TPOT", seconds), or None without one."""
        if self.tpot_p99_seconds is not None:
            return "TPOT", self.tpot_p99_seconds
        if self.itl_p99_seconds is not None:
            return "ITL", self.itl_p99_seconds
        return None


class Tuning(SpecModel):
    """Live tuning: the operator watches the engines' metrics and sets maxNumSeqs (and, within bounds given,
    maxNumBatchedTokens) and gpuMemoryUtilization to the highest throughput that still meets the SLO."""

    enabled: bool = Field(default=True, description="Tune this service. false keeps the engine parameters as given.")
    interval_seconds: int | None = Field(
        default=None, ge=5, le=3600,
        description="Seconds between tuning decisions. Unset: the operator's default (KVPILOT_TUNING_INTERVAL_SECONDS).",
    )
    slo: Slo = Field(default_factory=Slo, description="Latency targets to meet.",
                     json_schema_extra=_object_default(Slo))
    max_num_seqs: MaxNumSeqsBounds = Field(
        default_factory=MaxNumSeqsBounds, description="Bounds for engine.maxNumSeqs.",
        json_schema_extra=_object_default(MaxNumSeqsBounds),
    )
    gpu_memory_utilization: MemoryFractionBounds = Field(
        default_factory=MemoryFractionBounds,
        description="Bounds for engine.gpuMemoryUtilization (changing it restarts pods one at a time).",
        json_schema_extra=_object_default(MemoryFractionBounds),
    )
    max_num_batched_tokens: BatchedTokensBounds | None = Field(
        default=None,
        description=(
            "Bounds for engine.maxNumBatchedTokens, the per-step token budget that caps prefill chunks: lower cuts "
            "the inter-token latency spikes of steps that carry a prompt, at the cost of time to first token. "
            "Unset: the tuner leaves it as it is."
        ),
    )
    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!self.enabled || has(self.slo.ttftP99Seconds) || has(self.slo.itlP99Seconds) || "
                "has(self.slo.tpotP99Seconds)",
            message="tuning.slo needs ttftP99Seconds, itlP99Seconds or tpotP99Seconds when tuning is enabled",
            check=lambda t: not t.enabled or t.slo.ttft_p99_seconds is not None or t.slo.token_latency is not None,
            field_path=".slo",
        ),
        Rule(
            cel="!has(self.slo.itlP99Seconds) || !has(self.slo.tpotP99Seconds)",
            message="tuning.slo takes itlP99Seconds or tpotP99Seconds, not both: keep the one your users feel "
                    "(tpotP99Seconds for goodput as benchmarks count it)",
            check=lambda t: t.slo.itl_p99_seconds is None or t.slo.tpot_p99_seconds is None,
            field_path=".slo",
        ),
    )

    def clamp(self, settings: EngineSettings) -> EngineSettings:
        """``settings`` moved into the bounds (which may have narrowed since they were chosen)."""
        seqs = self.max_num_seqs.clamp(settings.max_num_seqs)
        tokens = settings.max_num_batched_tokens
        if tokens is not None and self.max_num_batched_tokens is not None:
            tokens = self.max_num_batched_tokens.clamp(tokens)
        return settings.replace(
            max_num_seqs=seqs,
            max_num_batched_tokens=None if tokens is None else max(tokens, seqs),
            gpu_memory_utilization=self.gpu_memory_utilization.clamp(settings.gpu_memory_utilization),
        )


class Autoscaling(SpecModel):
    """Replica autoscaling from the engines' load. The operator sets spec.replicas through the scale
    subresource; disable it to let an HPA or KEDA drive that subresource instead."""

    enabled: bool = Field(default=True, description="Let the operator scale replicas between minReplicas and maxReplicas.")
    min_replicas: int = Field(default=1, ge=0, le=MAX_REPLICAS, description="Fewest replicas.")
    max_replicas: int = Field(ge=1, le=MAX_REPLICAS, description="Most replicas (each needs its own GPUs).")
    scale_to_zero_after_seconds: int | None = Field(
        default=None, ge=30, le=86400,
        description=(
            "With minReplicas 0: seconds without requests before the last replica goes. The kvpilot gateway "
            "holds a request for a service at zero replicas and asks for a replica. Unset: the operator's "
            "scale-down stabilization window (KVPILOT_SCALE_DOWN_STABILIZATION_SECONDS)."
        ),
    )
    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.minReplicas <= self.maxReplicas",
            message="autoscaling.minReplicas must be at most autoscaling.maxReplicas",
            check=lambda a: a.min_replicas <= a.max_replicas,
            field_path=".minReplicas",
        ),
        Rule(
            cel="!has(self.scaleToZeroAfterSeconds) || self.minReplicas == 0",
            message="autoscaling.scaleToZeroAfterSeconds needs autoscaling.minReplicas: 0",
            check=lambda a: a.scale_to_zero_after_seconds is None or a.min_replicas == 0,
            field_path=".scaleToZeroAfterSeconds",
        ),
    )


LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"
MAX_LORAS_LISTED = 32


class LoRASource(ModelLocation):
    """A LoRA adapter (a PEFT folder: adapter_config.json, adapter_model.safetensors) served on top of
    the model under its own name."""

    name: str = Field(
        description="Model name clients send in `model` to use this adapter; /v1/models lists it with the base as parent.",
        min_length=1, max_length=128, pattern=LORA_NAME_PATTERN,
    )
    rules: ClassVar[tuple[Rule, ...]] = _location_rules("loras[]")


class InferenceServiceSpec(SpecModel):
    """Desired state of an InferenceService: a model served by kvpilot engine pods behind a Service."""

    model: ModelSource = Field(description="The model to serve.")
    image: str | None = Field(
        default=None,
        description="Engine container image. Unset: the operator's default (KVPILOT_ENGINE_IMAGE).",
        max_length=1024,
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None,
        description="Always, IfNotPresent or Never. Unset: Kubernetes' default for the image tag.",
    )
    replicas: int = Field(default=1, ge=0, le=MAX_REPLICAS,
                          description="Engine pods. The scale subresource sets this field.")
    resources: Resources = Field(
        default_factory=Resources, description="Compute per engine pod.", json_schema_extra=_object_default(Resources)
    )
    engine: EngineParams = Field(
        default_factory=EngineParams, description="Engine parameters.", json_schema_extra=_object_default(EngineParams)
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels an engine pod's node must have (the pod's nodeSelector)."
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list,
        description="The engine pods' tolerations, as in a pod spec (e.g. for tainted GPU nodes).",
        json_schema_extra={"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
    )
    affinity: dict[str, Any] | None = Field(
        default=None, **_preserve_unknown("The engine pods' affinity, as in a pod spec.")
    )
    loras: list[LoRASource] = Field(
        default_factory=list, max_length=MAX_LORAS_LISTED,
        description=(
            "LoRA adapters served on top of the model, each under its own name. Adding or removing one loads or "
            "unloads it on the running pods without a restart when its files are already reachable there "
            "(a folder under a file:// directory or pvc:// claim another adapter already uses); a new directory, "
            "claim or hf:// adapter rolls the pods, as does the first adapter (it turns LoRA on)."
        ),
    )
    autoscaling: Autoscaling | None = Field(default=None, description="Scale replicas with load. Unset: fixed replicas.")
    tuning: Tuning | None = Field(default=None, description="Tune engine parameters live against an SLO. Unset: no tuning.")
    api_key_secret_ref: SecretKeySelector | None = Field(
        default=None,
        description=(
            "Secret holding the API key clients must send as `Authorization: Bearer <key>` on /v1/*. The engine "
            "reads it from an environment variable filled from the Secret, never from its command line; pods "
            "read it at start, so restart them (kubectl rollout restart) after changing the key. Unset: no key."
        ),
    )
    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!has(self.loras) || self.loras.all(a, self.loras.filter(b, b.name == a.name).size() == 1)",
            message="loras: every adapter needs a name of its own",
            check=lambda s: len({a.name for a in s.loras}) == len(s.loras),
            field_path=".loras",
        ),
        Rule(
            cel="!has(self.loras) || !has(self.model.servedName) || self.loras.all(a, a.name != self.model.servedName)",
            message="loras: an adapter's name must differ from model.servedName, the base model's name",
            check=lambda s: s.model.served_name is None or all(a.name != s.model.served_name for a in s.loras),
            field_path=".loras",
        ),
        Rule(
            cel=(
                "!has(self.tuning) || !self.tuning.enabled || "
                "(self.engine.maxNumSeqs >= self.tuning.maxNumSeqs.min && "
                "self.engine.maxNumSeqs <= self.tuning.maxNumSeqs.max)"
            ),
            message="engine.maxNumSeqs must lie within tuning.maxNumSeqs.min and tuning.maxNumSeqs.max",
            check=lambda s: s.tuning is None or not s.tuning.enabled
            or s.tuning.max_num_seqs.min <= s.engine.max_num_seqs <= s.tuning.max_num_seqs.max,
            field_path=".engine.maxNumSeqs",
        ),
        Rule(
            cel=(
                "!has(self.tuning) || !self.tuning.enabled || "
                "(self.engine.gpuMemoryUtilization >= self.tuning.gpuMemoryUtilization.min && "
                "self.engine.gpuMemoryUtilization <= self.tuning.gpuMemoryUtilization.max)"
            ),
            message="engine.gpuMemoryUtilization must lie within tuning.gpuMemoryUtilization.min and .max",
            check=lambda s: s.tuning is None or not s.tuning.enabled
            or s.tuning.gpu_memory_utilization.min <= s.engine.gpu_memory_utilization <= s.tuning.gpu_memory_utilization.max,
            field_path=".engine.gpuMemoryUtilization",
        ),
    )


# --- status ---------------------------------------------------------------


class Phase(str, enum.Enum):
    PENDING = "Pending"  # nothing is serving yet and nothing is known to be wrong
    PROGRESSING = "Progressing"  # a rollout or scale-up is under way
    READY = "Ready"  # every desired replica is ready
    DEGRADED = "Degraded"  # something needs the user: see the Degraded condition
    STOPPED = "Stopped"  # scaled to zero replicas


class ConditionType(str, enum.Enum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    ADAPTERS_READY = "AdaptersReady"  # only with spec.loras: every adapter loaded on every Ready pod


class Condition(StatusModel):
    """A Kubernetes-style condition (metav1.Condition)."""

    type: str = Field(description="Ready, Progressing, Degraded, or AdaptersReady (with spec.loras).")
    status: str = Field(description="True, False or Unknown.")
    reason: str = Field(description="One CamelCase word a program can match.")
    message: str = Field(default="", description="What is happening and, when something is wrong, what to do.")
    last_transition_time: str | None = Field(default=None, description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(default=None, description="metadata.generation this condition reflects.")


class MetricsStatus(StatusModel):
    """Service-wide load and latency over the last tuning window, from the engines' /metrics."""

    window_seconds: float | None = Field(default=None, description="Length of the window these figures cover.")
    time: str | None = Field(default=None, description="End of the window (RFC 3339).")
    output_tokens_per_second: float | None = Field(default=None, description="Generated tokens per second, all pods.")
    requests_per_second: float | None = Field(default=None, description="Finished requests per second, all pods.")
    ttft_p99_seconds: float | None = Field(default=None, description="99th-percentile time to first token.")
    itl_p99_seconds: float | None = Field(default=None, description="99th-percentile inter-token latency.")
    tpot_p99_seconds: float | None = Field(default=None, description="99th-percentile time per output token of a request.")
    e2e_p99_seconds: float | None = Field(default=None, description="99th-percentile request latency.")
    kv_cache_usage: float | None = Field(default=None, description="Mean fraction of KV-cache blocks in use.")
    requests_running: float | None = Field(default=None, description="Requests running, summed over pods.")
    requests_waiting: float | None = Field(default=None, description="Requests queued, summed over pods.")
    preemptions_per_second: float | None = Field(default=None, description="Requests preempted per second.")
    rejected_per_second: float | None = Field(
        default=None, description="Requests turned away per second (429: the queue full, or the wait over maxWaitingSeconds)."
    )
    prefix_cache_hit_rate: float | None = Field(default=None, description="Fraction of prompt tokens found cached.")
    scraped_pods: int | None = Field(default=None, description="Ready pods whose metrics were read.")
    unscraped_pods: list[str] = Field(default_factory=list, description="Ready pods whose metrics could not be read.")


class TuningDecision(StatusModel):
    """One change the tuner made."""

    time: str | None = Field(default=None, description="When it was made (RFC 3339).")
    max_num_seqs: int | None = Field(default=None, description="maxNumSeqs after the decision.")
    max_num_batched_tokens: int | None = Field(default=None, description="maxNumBatchedTokens after the decision.")
    gpu_memory_utilization: float | None = Field(default=None, description="GPU memory fraction after the decision.")
    reason: str = Field(default="", description="Why, in one line.")


class TuningStatus(StatusModel):
    """What the tuner last decided and why."""

    last_decision: str | None = Field(default=None, description="The last decision, in one line.")
    reason: str | None = Field(default=None, description="Why it was made.")
    time: str | None = Field(default=None, description="When it was made (RFC 3339).")
    history: list[TuningDecision] = Field(default_factory=list, description="Recent changes, oldest first.")


class AutoscalingStatus(StatusModel):
    """What the autoscaler last decided and why."""

    desired_replicas: int | None = Field(default=None, description="Replicas the autoscaler wants.")
    demand_tokens_per_second: float | None = Field(
        default=None, description="Output tokens/s it planned for: served in the window plus the queue to drain.")
    capacity_per_replica: float | None = Field(
        default=None, description="Output tokens/s one Ready replica delivered while saturated (smoothed).")
    held_requests: int | None = Field(
        default=None, ge=0,
        description="Requests the kvpilot gateway held for this service (no Ready pod) when it decided, over all "
                    "gateway replicas: counted as queued demand.")
    reason: str | None = Field(default=None, description="Why, in one line.")
    time: str | None = Field(default=None, description="When it was decided (RFC 3339).")


class LoRAPodState(StatusModel):
    """One adapter on one Ready engine pod."""

    pod: str = Field(description="The engine pod.")
    state: Literal["Loaded", "Failed"] = Field(description="Loaded: the pod serves the adapter; Failed: it could not load it.")
    message: str | None = Field(default=None, description="Why it failed, from the engine.")


class LoRAStatus(StatusModel):
    """One adapter of spec.loras across the Ready engine pods."""

    name: str = Field(description="The adapter's name (spec.loras[].name).")
    loaded_pods: int = Field(default=0, description="Ready pods that serve it.")
    pods: list[LoRAPodState] = Field(default_factory=list, description="Its state on each Ready pod.")


class InferenceServiceStatus(StatusModel):
    """Observed state, written by the operator through the status subresource."""

    observed_generation: int | None = Field(default=None, description="metadata.generation last reconciled.")
    phase: Phase | None = Field(default=None, description="Pending, Progressing, Ready, Degraded or Stopped.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Progressing and Degraded, with reasons to act on.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    replicas: int | None = Field(default=None, description="Engine pods that exist (the scale subresource reads this).")
    ready_replicas: int | None = Field(default=None, description="Engine pods that are ready to serve.")
    selector: str | None = Field(default=None, description="Label selector of the engine pods, for the scale subresource.")
    url: str | None = Field(default=None, description="In-cluster base URL of the OpenAI-compatible API.")
    engine: EngineSettings | None = Field(
        default=None, description="Engine settings in effect: spec.engine's, or the tuner's once it has acted.")
    metrics: MetricsStatus | None = Field(default=None, description="Recent load and latency.")
    tuning: TuningStatus | None = Field(default=None, description="The tuner's last decision.")
    autoscaling: AutoscalingStatus | None = Field(default=None, description="The autoscaler's last decision.")
    loras: list[LoRAStatus] | None = Field(
        default=None, description="Each LoRA adapter of spec.loras on the Ready pods, as the operator last synced them.")


_NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"

# Checked on the resource's top level, where CEL can read metadata.name.
NAME_RULE = Rule(
    cel=f"size(self.metadata.name) <= {MAX_NAME_LENGTH} && self.metadata.name.matches('{_NAME_PATTERN}')",
    message=(
        f"metadata.name must be at most {MAX_NAME_LENGTH} characters of a-z, 0-9 and '-', starting with a "
        "letter: it names the Service and Deployment"
    ),
    check=lambda name: len(name) <= MAX_NAME_LENGTH and re.fullmatch(_NAME_PATTERN, name) is not None,
)


def lora_name_problem(served_name: str, spec: InferenceServiceSpec) -> str | None:
    """The check CEL cannot make on spec alone: an adapter named like the base model when servedName
    is unset (it defaults to metadata.name)."""
    clash = [a.name for a in spec.loras if a.name == served_name]
    if clash:
        return (f"spec.loras: adapter {clash[0]!r} has the base model's name (model.servedName defaults to "
                "metadata.name): rename the adapter or set model.servedName")
    return None


def parse_spec(spec: dict[str, Any]) -> InferenceServiceSpec:
    """Validates a resource's spec (already defaulted by the API server, or not)."""
    return InferenceServiceSpec.model_validate(spec)


# pydantic's words for the problems the API server words differently.
_API_SERVER_WORDS = {"missing": "Required value", "extra_forbidden": "unknown field"}
# Steps of an error's location that name a union member or a validator, not a field.
_NOT_A_FIELD = re.compile(r"^(int|str|float|bool)$|[\[(]")


def spec_error_message(exc: ValidationError) -> str:
    """Why parse_spec rejected a spec, in the API server's form: ``spec.PATH: what is wrong``, one per
    problem, PATH in the resource's camelCase (a Rule names its fieldPath, as its CEL twin does)."""
    parts = []
    for problem in exc.errors():
        path = "spec"
        for step in problem["loc"]:
            if isinstance(step, int):
                path += f"[{step}]"
            elif not _NOT_A_FIELD.search(step):
                path += f".{step}"
        violation = (problem.get("ctx") or {}).get("error")
        if isinstance(violation, RuleViolation):
            path += violation.rule.field_path or ""
            message = violation.rule.message
        else:
            message = _API_SERVER_WORDS.get(problem["type"], problem["msg"])
        parts.append(f"{path}: {message}")
    return "; ".join(parts)
