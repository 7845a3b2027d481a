"""Pure parts of what a pod's process gets: $(VAR) expansion and mountPath rewriting."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.localcluster.podenv import (
    ContainerConfigError,
    expand,
    mount_map,
    rewrite_paths,
    volume_env_name,
)


def test_expand_follows_kubernetes_rules():
    env = {"POD_IP": "127.0.1.7", "PORT": "8080"}
    assert expand("--bind=$(POD_IP):$(PORT)", env) == "--bind=127.0.1.7:8080"
    assert expand("$$(POD_IP)", env) == "$(POD_IP)"  # $$ escapes
    assert expand("$(MISSING) stays", env) == "$(MISSING) stays"
    assert expand("cost: $5", env) == "cost: $5"


def test_rewrite_maps_mount_paths_at_start_after_equals_or_in_a_json_string():
    mounts = mount_map(
        {
            "volumeMounts": [
                {"name": "models", "mountPath": "/models"},
                {"name": "cfg", "mountPath": "/models/cfg/"},
            ]
        },
        {"models": Path("/host/pvc"), "cfg": Path("/host/cfg")},
    )
    assert mounts[0][0] == "/models/cfg"  # longest first: the nested mount wins
    assert rewrite_paths("/models/llama", mounts) == "/host/pvc/llama"
    assert rewrite_paths("--model=/models", mounts) == "--model=/host/pvc"
    assert rewrite_paths("/models/cfg/a.yaml", mounts) == "/host/cfg/a.yaml"
    assert rewrite_paths("/modelsX/llama", mounts) == "/modelsX/llama"
    assert rewrite_paths("x/models/llama", mounts) == "x/models/llama"
    assert rewrite_paths('{"model": "/models/cfg", "n": 3}', mounts) == '{"model": "/host/cfg", "n": 3}'


def test_subpath_and_unknown_volume():
    mounts = mount_map(
        {"volumeMounts": [{"name": "v", "mountPath": "/data", "subPath": "a/b"}]}, {"v": Path("/host/v")}
    )
    assert mounts == [("/data", "/host/v/a/b")]
    with pytest.raises(ContainerConfigError, match="unknown volume nope"):
        mount_map({"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}, {})


def test_volume_env_name():
    assert volume_env_name("model-cache") == "KVPILOT_VOLUME_MODEL_CACHE"
