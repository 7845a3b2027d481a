"""Generated tiny models for the engine tests, written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """arch -> path of a generated tiny model of that architecture (llama, mistral or qwen2)."""
    from kvpilot.engine.model_files import make_model

    cache: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in cache:
            cache[arch] = make_model(tmp_path_factory.mktemp(f"tiny-{arch}"), preset="tiny", arch=arch, seed=0)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")
