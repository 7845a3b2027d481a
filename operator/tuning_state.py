"""The engine parameters in effect for one InferenceService, persisted in its tuning ConfigMap.

The spec gives starting values; with tuning enabled the tuner moves them and
writes them back to the ConfigMap ``NAME-tuning``. Engine pods mount it and
read ``tuning.json`` at start (``kvpilot serve --tuning-file``), so a restarted
pod keeps the tuned ``maxNumSeqs`` without a rollout. ``state.json`` records the
GPU memory fraction (a pod-template value: changing it rolls the pods) and
the spec values the state was seeded from: when the user edits those, their
new values win over the tuner's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace

from kvpilot.operator.spec import EngineParams, InferenceServiceSpec

TUNING_FILE_KEY = "tuning.json"  # what the engine reads at start
STATE_KEY = "state.json"  # what only the operator reads


@dataclass(frozen=True)
class TuningState:
    max_num_seqs: int
    max_num_batched_tokens: int | None
    gpu_memory_utilization: float

    @classmethod
    def from_engine(cls, engine: EngineParams) -> TuningState:
        return cls(engine.max_num_seqs, engine.max_num_batched_tokens, engine.gpu_memory_utilization)

    def engine_file(self) -> dict[str, int]:
        """The engine's --tuning-file content: limits it applies over its flags at start."""
        values = {"maxNumSeqs": self.max_num_seqs}
        if self.max_num_batched_tokens is not None:
            values["maxNumBatchedTokens"] = self.max_num_batched_tokens
        return values

    def as_dict(self) -> dict[str, int | float | None]:
        return {
            "maxNumSeqs": self.max_num_seqs,
            "maxNumBatchedTokens": self.max_num_batched_tokens,
            "gpuMemoryUtilization": self.gpu_memory_utilization,
        }

    @classmethod
    def from_dict(cls, values: Mapping[str, object]) -> TuningState:
        max_num_seqs = values["maxNumSeqs"]
        batched = values.get("maxNumBatchedTokens")
        fraction = values["gpuMemoryUtilization"]
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"maxNumSeqs must be a positive integer, got {max_num_seqs!r}")
        if batched is not None and (not isinstance(batched, int) or batched < 1):
            raise ValueError(f"maxNumBatchedTokens must be a positive integer, got {batched!r}")
        if not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
            raise ValueError(f"gpuMemoryUtilization must be in (0, 1], got {fraction!r}")
        return cls(max_num_seqs, batched, float(fraction))


def configmap_data(state: TuningState, seed: TuningState) -> dict[str, str]:
    return {
        TUNING_FILE_KEY: json.dumps(state.engine_file(), sort_keys=True),
        STATE_KEY: json.dumps({"current": state.as_dict(), "seededFrom": seed.as_dict()}, sort_keys=True),
    }


def resolve(spec: InferenceServiceSpec, data: Mapping[str, str] | None) -> TuningState:
    """The state to run with, from the spec and the ConfigMap's data (None when it does not exist yet).

    Without tuning the spec is the state. With tuning, a stored state seeded from
    the current spec is kept (clamped into the spec's bounds, which may have
    narrowed since); a missing, unreadable or stale one is reseeded from the spec.
    """
    seed = TuningState.from_engine(spec.engine)
    if spec.tuning is None or not spec.tuning.enabled or not data or STATE_KEY not in data:
        return seed
    try:
        stored = json.loads(data[STATE_KEY])
        current = TuningState.from_dict(stored["current"])
        seeded_from = TuningState.from_dict(stored["seededFrom"])
    except (ValueError, KeyError, TypeError):
        return seed
    if seeded_from != seed:
        return seed
    bounds_seqs = spec.tuning.max_num_seqs
    bounds_memory = spec.tuning.gpu_memory_utilization
    return replace(
        current,
        max_num_seqs=min(max(current.max_num_seqs, bounds_seqs.min), bounds_seqs.max),
        gpu_memory_utilization=min(max(current.gpu_memory_utilization, bounds_memory.min), bounds_memory.max),
    )
