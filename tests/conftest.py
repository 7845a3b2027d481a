"""Fixtures shared by every test suite.

Triton kernels run on the CPU through Triton's interpreter unless a GPU run
asks otherwise (KVPILOT_TEST_DEVICE=cuda); the flag must be set before any
kernel module is imported, which is why it is set here, at collection time.
"""

from __future__ import annotations

import os

if os.environ.get("KVPILOT_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402  (the environment flag above must be set first)

MODEL_ARCHS = ("llama", "mistral", "qwen2")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict:
    """arch -> folder of a generated `tiny` model (float32, real tokenizer), built once per session."""
    from kvpilot.engine.model_files import make_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_model(root / arch, preset="tiny", arch=arch, seed=0) for arch in MODEL_ARCHS}


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_dirs):
    """Folder of the generated `tiny` Llama model."""
    return tiny_model_dirs["llama"]
