"""Image mode's `podman run` command line, and the clear errors when podman cannot run here."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.localcluster import podman
from kvpilot.localcluster.cluster import ClusterError, LocalCluster

POD = {
    "metadata": {"name": "demo-7f9c", "namespace": "default", "uid": "0123456789abcdef"},
    "spec": {"securityContext": {"runAsUser": 10001, "runAsGroup": 10001}},
}
SPEC = {"name": "engine", "image": "localhost/kvpilot:abc", "securityContext": {"readOnlyRootFilesystem": True}}


def test_run_command_is_what_a_kubelet_gives_the_container():
    env = {"KVPILOT_API_KEY": "secret-value", "POD_IP": "127.0.5.9"}
    mounts = [("/mnt/model", "/host/models", True), ("/tmp", "/state/pods/x/volumes/tmp", False)]
    argv = podman.run_command("/usr/bin/podman", "k8s_engine_x", Path("/state"), POD, SPEC, env, mounts,
                              ["kvpilot"], ["serve", "/mnt/model/m.gguf"])
    assert argv[:2] == ["/usr/bin/podman", "run"]
    assert argv[argv.index("--user") + 1] == "10001:10001" and "--read-only" in argv
    assert "--network=host" in argv and "--pull=never" in argv
    assert argv[argv.index("--label") + 1] == f"{podman.LABEL}=/state"
    volumes = [argv[i + 1] for i, a in enumerate(argv) if a == "--volume"]
    assert volumes == ["/host/models:/mnt/model:ro", "/state/pods/x/volumes/tmp:/tmp"]
    # Names only: values travel in podman's environment, never on a command line.
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--env"] == ["KVPILOT_API_KEY", "POD_IP"]
    assert "secret-value" not in " ".join(argv)
    assert podman.run_env(env)["KVPILOT_API_KEY"] == "secret-value"
    # command replaces the entrypoint, args the image's CMD.
    image = argv.index("localhost/kvpilot:abc")
    assert argv[argv.index("--entrypoint") + 1] == "kvpilot" and argv[image + 1:] == ["serve", "/mnt/model/m.gguf"]


def test_without_command_the_image_entrypoint_runs_with_args():
    argv = podman.run_command("podman", "n", Path("/s"), {**POD, "spec": {}}, {"name": "c", "image": "img"}, {}, [],
                              [], ["--help"])
    assert "--entrypoint" not in argv and "--user" not in argv and argv[-2:] == ["img", "--help"]


def test_up_in_podman_mode_without_podman_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setattr(podman.shutil, "which", lambda name: None)
    with pytest.raises(ClusterError, match="--containers podman: podman is not installed: run scripts/build-image.sh"):
        LocalCluster(tmp_path / "state").up(containers="podman")
    assert not (tmp_path / "state" / "cluster.json").exists()


def test_a_missing_image_names_the_build_command():
    message = podman.missing_image_message("ghcr.io/kvpilot/kvpilot:0.1.0")
    assert "ghcr.io/kvpilot/kvpilot:0.1.0" in message and "scripts/build-image.sh" in message
