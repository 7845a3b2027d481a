"""The kubelet stand-in's image mode: each container runs with podman from the image its spec names.

`kvpilot local-cluster up --containers podman` turns it on for a cluster (process mode, the default,
runs the container's command as a host process instead). What a container gets here is what a
kubelet gives it: the image's filesystem, user and entrypoint; the pod's env (passed through
podman's environment with ``--env NAME``, so no value shows in a process list); its volumes bind
mounted at their mountPaths (emptyDir mode 0777, as a kubelet makes it); ``runAsUser``/``runAsGroup``
and ``readOnlyRootFilesystem``. Every container shares the host's network and listens on its pod's
127.x address, so probes, host ports and Services work as in process mode. Nothing is pulled: an
image must be in this machine's podman storage (scripts/build-image.sh builds kvpilot's), otherwise
the container waits in ``ErrImageNeverPull`` with the command that builds it.

podman runs with the containers.conf scripts/build-image.sh writes (runc, cgroupfs, no default
ulimits: crun and ulimit changes are refused on this machine class).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from kvpilot.localcluster.build import cache_root

LABEL = "io.kvpilot.local-cluster"  # value: the cluster's state folder, for `down` to find its containers
BUILD_COMMAND = "scripts/build-image.sh"


class PodmanUnavailable(RuntimeError):
    """podman cannot run containers here; the message names the step and the command to run."""


def containers_conf() -> Path:
    return cache_root() / "podman" / "containers.conf"


def podman_env() -> dict[str, str]:
    """The environment podman itself runs in (not the container's)."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
            "CONTAINERS_CONF": str(containers_conf())}


def check() -> str:
    """The podman executable, after checking that it runs containers; raises PodmanUnavailable."""
    podman = shutil.which("podman")
    if podman is None:
        raise PodmanUnavailable(f"podman is not installed: run {BUILD_COMMAND} (installs it with apt as root)")
    if not containers_conf().is_file():
        raise PodmanUnavailable(f"{containers_conf()} is missing: run {BUILD_COMMAND} (it writes podman's settings)")
    try:
        info = subprocess.run([podman, "info"], env=podman_env(), capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise PodmanUnavailable("`podman info` did not answer within 60 s") from None
    if info.returncode != 0:
        last = (info.stderr.strip().splitlines() or ["no output"])[-1]
        raise PodmanUnavailable(f"`podman info` failed ({last}); run: CONTAINERS_CONF={containers_conf()} podman info")
    return podman


def image_present(podman: str, image: str) -> bool:
    return subprocess.run([podman, "image", "exists", image], env=podman_env(), timeout=60).returncode == 0


def missing_image_message(image: str) -> str:
    return (f'image "{image}" is not in this machine\'s podman storage and the local cluster pulls nothing: '
            f"build it ({BUILD_COMMAND}) or `podman load` it")


def container_name(pod: dict, container: str, restart_count: int) -> str:
    meta = pod["metadata"]
    return f"k8s_{container}_{meta['name']}_{meta['namespace']}_{meta['uid'][:8]}_{restart_count}"


def run_command(podman: str, name: str, cluster: Path, pod: dict, spec: dict, env: dict[str, str],
                mounts: list[tuple[str, str, bool]], command: list[str], args: list[str]) -> list[str]:
    """``podman run`` for one container. ``command`` replaces the image's entrypoint and ``args`` its
    CMD, as in Kubernetes; ``env``'s values travel in podman's environment (run_env)."""
    security = {**(pod["spec"].get("securityContext") or {}), **(spec.get("securityContext") or {})}
    argv = [podman, "run", "--rm", "--name", name, "--label", f"{LABEL}={cluster}", "--network=host",
            "--pull=never", "--hostname", pod["metadata"]["name"]]
    if "runAsUser" in security:
        argv += ["--user", f"{security['runAsUser']}:{security.get('runAsGroup', security['runAsUser'])}"]
    if security.get("readOnlyRootFilesystem"):
        argv.append("--read-only")
    if spec.get("workingDir"):
        argv += ["--workdir", spec["workingDir"]]
    for mount_path, host, read_only in mounts:
        argv += ["--volume", f"{host}:{mount_path}{':ro' if read_only else ''}"]
    for key in env:
        argv += ["--env", key]
    if command:
        argv += ["--entrypoint", command[0]]
    argv.append(spec["image"])
    return argv + [*command[1:], *args]


def run_env(env: dict[str, str]) -> dict[str, str]:
    """podman's own environment plus the container's variables, which ``--env NAME`` passes on."""
    return {**podman_env(), **env}


def remove(podman: str, name: str) -> None:
    """Removes the container at once, running or not (after a SIGKILL of its podman process)."""
    subprocess.run([podman, "rm", "--force", "--time", "0", "--ignore", name], env=podman_env(),
                   capture_output=True, timeout=60)


def remove_cluster_containers(cluster: Path) -> list[str]:
    """Every container this cluster's kubelet started and left (`down`, a crashed kubelet)."""
    podman = shutil.which("podman")
    if podman is None or not containers_conf().is_file():
        return []
    listed = subprocess.run([podman, "ps", "--all", "--filter", f"label={LABEL}={cluster}", "--format",
                             "{{.Names}}"], env=podman_env(), capture_output=True, text=True, timeout=60)
    names = listed.stdout.split()
    for name in names:
        remove(podman, name)
    return names
