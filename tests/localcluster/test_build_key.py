"""The binaries' cache key names the pinned versions; a missing toolchain is reported by name."""

from __future__ import annotations

import pytest

from kvpilot.localcluster import build


def test_key_names_pinned_versions():
    key = build.build_key("go1.26.8")
    assert key.startswith("k8s-v1.37.")
    assert "_etcd-v3." in key and "_helm-v3." in key
    assert build.build_key("go1.26.8") == key
    assert build.build_key("go1.27.0") != key  # another toolchain, other binaries


def test_bin_dir_lives_in_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPILOT_CACHE", str(tmp_path))
    assert build.bin_dir().parent == tmp_path / "bin"


def test_missing_go_names_the_components(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(build.BuildError, match="Go toolchain is not on PATH.*kube-apiserver"):
        build.build()


def test_a_failed_build_names_the_component_and_the_compiler_error(monkeypatch, tmp_path):
    module = tmp_path / "broken"
    module.mkdir()
    (module / "go.mod").write_text("module example.com/broken\n\ngo 1.22\n")
    (module / "main.go").write_text("package main\n\nfunc main() { notDefined() }\n")
    monkeypatch.setenv("KVPILOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("GOFLAGS", "-mod=mod")
    monkeypatch.setattr(build, "COMPONENTS", (build.Component("broken", module, ".", "example.com/broken"),))
    monkeypatch.setattr(build, "COMPONENT_NAMES", ("broken",))
    with pytest.raises(build.BuildError, match=r"(?s)building broken .*failed.*undefined: notDefined"):
        build.build()
    assert not list((tmp_path / "cache" / "bin").glob("*/broken"))
