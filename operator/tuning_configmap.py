"""The tuning ConfigMap ``NAME-tuning``: where the engine settings in effect are persisted.

The spec gives starting values; with tuning enabled the tuner moves them and
writes them here. Engine pods mount it and read ``tuning.json`` at start
(``kvpilot serve --tuning-file``, keys from the engine contract), so a restarted
pod keeps the tuned ``maxNumSeqs`` without a rollout, and a new pod starts with
every LoRA adapter of spec.loras (running pods load and unload them live). ``state.json`` holds the
settings in effect, including the GPU memory fraction (a pod-template value:
changing it rolls the pods), and the spec values they were seeded from: when
the user edits those, their new values win over the tuner's.

A change of this ConfigMap is what triggers the reconcile that renders a new
memory fraction into the pod template (see ``handlers.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvpilot import engine_contract as contract
from kvpilot.operator.spec import EngineSettings, InferenceServiceSpec

TUNING_FILE_KEY = "tuning.json"  # what the engine reads at start
STATE_KEY = "state.json"  # what only the operator reads


def engine_file(settings: EngineSettings, loras: Mapping[str, str]) -> dict[str, Any]:
    """The engine's --tuning-file: the live settings, which it applies over its flags at start, and
    the LoRA adapters it loads at start (name -> folder in the pod), when there are any."""
    values: dict[str, Any] = {key: getattr(settings, flag) for key, flag in contract.TUNING_FILE_KEYS.items()
                              if flag in contract.LIVE_SETTINGS}
    if loras:
        values[contract.TUNING_FILE_LORAS_KEY] = [{"name": name, "path": path} for name, path in loras.items()]
    return {key: value for key, value in values.items() if value is not None}


def configmap_data(settings: EngineSettings, seed: EngineSettings, loras: Mapping[str, str]) -> dict[str, str]:
    return {
        TUNING_FILE_KEY: json.dumps(engine_file(settings, loras), sort_keys=True),
        STATE_KEY: json.dumps({"current": settings.resource(), "seededFrom": seed.resource()}, sort_keys=True),
    }


def settings_in_effect(spec: InferenceServiceSpec, data: Mapping[str, str] | None) -> EngineSettings:
    """The settings to run with, from the spec and the ConfigMap's data (None when it does not exist yet).

    Without tuning the spec is the state. With tuning, a stored state seeded from
    the current spec is kept (clamped into the spec's bounds, which may have
    narrowed since); a missing, unreadable or stale one is reseeded from the spec.
    """
    seed = EngineSettings.of(spec.engine)
    if spec.tuning is None or not spec.tuning.enabled or not data or STATE_KEY not in data:
        return seed
    try:
        stored = json.loads(data[STATE_KEY])
        current = EngineSettings.model_validate(stored["current"])
        seeded_from = EngineSettings.model_validate(stored["seededFrom"])
    except (ValueError, KeyError, TypeError):  # pydantic's ValidationError is a ValueError
        return seed
    if seeded_from != seed:
        return seed
    return spec.tuning.clamp(current)
