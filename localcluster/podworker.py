"""One pod's life on the local kubelet: a thread that runs its containers and reports status."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpilot.localcluster import podman
from kvpilot.localcluster.api import ApiError
from kvpilot.localcluster.container import ContainerRun, RunCommandError
from kvpilot.localcluster.events import PodEvents
from kvpilot.localcluster.nodes import now_rfc3339
from kvpilot.localcluster.podenv import (
    ContainerConfigError,
    PodContext,
    container_env,
    expand,
    materialize_volumes,
    mount_map,
    rewrite_paths,
    volume_mounts,
)

if TYPE_CHECKING:
    from kvpilot.localcluster.kubelet import Kubelet

log = logging.getLogger("kvpilot.localcluster.kubelet")
TICK_S = 0.25
# A missing ConfigMap or Secret is looked up again after this long, and a pod's deletion that the API
# server did not answer is sent again.
SETUP_RETRY_S = 1.0


def pod_key(pod: dict) -> str:
    meta = pod["metadata"]
    return f"{meta['namespace']}/{meta['name']}"


class PodWorker(threading.Thread):
    def __init__(self, kubelet: Kubelet, pod: dict, pod_ip: str) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}-{meta['name']}", daemon=True)
        self.kubelet = kubelet
        self.pod = pod
        self.pod_ip = pod_ip
        self.uid = meta["uid"]
        self.folder: Path = kubelet.state.pods / f"{meta['namespace']}_{meta['name']}_{self.uid[:8]}"
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._gone = False  # the API object is gone: no grace, nothing to report
        self.stop_requested = threading.Event()  # kubelet shutdown
        spec = pod["spec"]
        self.init_runs = [
            ContainerRun(c, self.folder / f"{c['name']}.log", init=True)
            for c in spec.get("initContainers") or []
        ]
        self.runs = [ContainerRun(c, self.folder / f"{c['name']}.log") for c in spec["containers"]]
        self.restart_policy = spec.get("restartPolicy", "Always")
        self.start_time = now_rfc3339()
        self.volume_dirs: dict[str, Path] | None = None
        self.kubeconfig: Path | None = None
        self.setup_error: str | None = None
        self.setup_retry_at = 0.0
        self.init_done = not self.init_runs
        self.phase = "Pending"
        self.transitions: dict[str, tuple[str, str]] = {}
        self.last_posted: dict | None = None
        self.events = PodEvents(kubelet.api)

    # Called from the kubelet's watch thread.
    def update(self, pod: dict) -> None:
        with self._lock:
            self.pod = pod
        self._wake.set()

    def gone(self) -> None:
        self._gone = True
        self._wake.set()

    def shutdown(self) -> None:
        self.stop_requested.set()
        self._wake.set()

    # The worker's own thread.
    def run(self) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            while True:
                with self._lock:
                    pod = self.pod
                if self.stop_requested.is_set():
                    self._stop_all(grace_s=5.0)
                    return
                if self._gone or pod["metadata"].get("deletionTimestamp"):
                    self._terminate(pod)
                    return
                self._step(pod)
                self._post_status(pod)
                if self.phase in ("Succeeded", "Failed"):
                    return
                self._wake.wait(TICK_S)
                self._wake.clear()
        except Exception:
            log.exception("pod %s: worker failed", pod_key(self.pod))
            self._stop_all(grace_s=0.0)
        finally:
            self.kubelet.worker_done(self)

    def _context(self, pod: dict) -> PodContext:
        return PodContext(
            pod=pod,
            pod_ip=self.pod_ip,
            folder=self.folder,
            pvc_root=self.kubelet.state.pvcs,
            api=self.kubelet.api,
            apiserver_port=self.kubelet.apiserver_port,
            ca_file=self.kubelet.state.pki / "ca.crt",
        )

    def _step(self, pod: dict) -> None:
        if self.volume_dirs is None:
            if time.monotonic() < self.setup_retry_at:
                return
            try:
                self.volume_dirs, self.kubeconfig = materialize_volumes(self._context(pod))
                self.setup_error = None
            except (ContainerConfigError, ApiError, OSError) as exc:
                self.setup_error = str(exc)
                self.setup_retry_at = time.monotonic() + SETUP_RETRY_S
                for run in self.init_runs + self.runs:
                    run.waiting = ("CreateContainerConfigError", self.setup_error)
                return
        if not self.init_done:
            self._step_init(pod)
            return
        for run in self.runs:
            self._step_container(pod, run)
        self.phase = self._main_phase()

    def _step_init(self, pod: dict) -> None:
        run = next(r for r in self.init_runs if not (r.terminated and r.terminated["exitCode"] == 0))
        if run.process is None:
            if run.can_start():
                self._start(pod, run)
            return
        if run.poll():
            if run.terminated["exitCode"] == 0:
                self.init_done = all(r.terminated and r.terminated["exitCode"] == 0 for r in self.init_runs)
            elif self.restart_policy == "Never":
                self.phase = "Failed"
            else:
                run.prepare_restart()

    def _step_container(self, pod: dict, run: ContainerRun) -> None:
        if run.process is None:
            if run.can_start() and run.terminated is None:
                self._start(pod, run)
            return
        if run.running:
            kill_reason, failures = run.probe(self.pod_ip)
            for message in failures:
                self.events.emit(pod, run.name, "Warning", "Unhealthy", message)
            if kill_reason is not None:
                log.info("pod %s container %s: %s; restarting", pod_key(pod), run.name, kill_reason)
                self.events.emit(
                    pod,
                    run.name,
                    "Normal",
                    "Killing",
                    f"Container {run.name} {kill_reason}, will be restarted",
                )
                run.stop(self._grace_s(pod), reason="Error")
            else:
                run.poll()
        if run.terminated is not None and self._restarts(run.terminated["exitCode"]):
            run.prepare_restart()
            self.events.emit(
                pod, run.name, "Warning", "BackOff", f"Back-off restarting failed container {run.name}"
            )

    def _restarts(self, exit_code: int) -> bool:
        return self.restart_policy == "Always" or (self.restart_policy == "OnFailure" and exit_code != 0)

    def _start(self, pod: dict, run: ContainerRun) -> None:
        if self.kubelet.podman is not None:
            self._start_from_image(pod, run, self.kubelet.podman)
            return
        assert self.volume_dirs is not None
        try:
            env = container_env(self._context(pod), run.spec, self.volume_dirs, self.kubeconfig)
            mounts = mount_map(run.spec, self.volume_dirs)
            # Values the kubelet itself set (KUBECONFIG, KVPILOT_VOLUME_*) are host paths already;
            # rewriting them would break any that lie under a mountPath such as /tmp.
            host_paths = {str(self.kubeconfig)} | {str(d) for d in self.volume_dirs.values()}
            env = {k: v if v in host_paths else rewrite_paths(v, mounts) for k, v in env.items()}
            argv = [
                rewrite_paths(expand(a, env), mounts)
                for a in (run.spec.get("command") or []) + (run.spec.get("args") or [])
            ]
            cwd = (
                Path(rewrite_paths(run.spec["workingDir"], mounts))
                if run.spec.get("workingDir")
                else self.folder
            )
            run.start(argv, env, cwd)
            self.kubelet.track_pid(run.process)
            self.events.emit(pod, run.name, "Normal", "Started", f"Started container {run.name}")
            log.info(
                "pod %s container %s: started pid %d on %s",
                pod_key(pod),
                run.name,
                run.process.pid,
                self.pod_ip,
            )
        except (ContainerConfigError, ApiError) as exc:
            run.fail_to_start("CreateContainerConfigError", str(exc))
            self.events.emit(pod, run.name, "Warning", "Failed", f"Error: {exc}")
        except RunCommandError as exc:
            run.fail_to_start("RunCommandError", str(exc))
            self.events.emit(pod, run.name, "Warning", "Failed", f"Error: {exc}")
            log.info("pod %s container %s: %s", pod_key(pod), run.name, exc)

    def _start_from_image(self, pod: dict, run: ContainerRun, podman_path: str) -> None:
        """Image mode: the container runs with podman from its image (podman.py)."""
        assert self.volume_dirs is not None
        image = run.spec.get("image") or ""
        try:
            if not podman.image_present(podman_path, image):
                message = podman.missing_image_message(image)
                run.fail_to_start("ErrImageNeverPull", message)
                self.events.emit(pod, run.name, "Warning", "ErrImageNeverPull", message)
                return
            env = container_env(self._context(pod), run.spec, self.volume_dirs, None, host_process=False)
            name = podman.container_name(pod, run.name, run.restart_count)
            podman.remove(podman_path, name)  # one left by a kubelet that died
            argv = podman.run_command(
                podman_path, name, self.kubelet.state.root, pod, run.spec, env,
                volume_mounts(run.spec, self.volume_dirs),
                [expand(a, env) for a in run.spec.get("command") or []],
                [expand(a, env) for a in run.spec.get("args") or []],
            )  # fmt: skip
            run.podman = podman_path
            run.start(argv, podman.run_env(env), self.folder, container=name)
            self.kubelet.track_pid(run.process)
            self.events.emit(pod, run.name, "Normal", "Started", f"Started container {run.name} from {image}")
            log.info("pod %s container %s: started %s from %s on %s", pod_key(pod), run.name, name, image,
                     self.pod_ip)
        except (ContainerConfigError, ApiError) as exc:
            run.fail_to_start("CreateContainerConfigError", str(exc))
            self.events.emit(pod, run.name, "Warning", "Failed", f"Error: {exc}")
        except (RunCommandError, OSError, subprocess.SubprocessError) as exc:
            run.fail_to_start("RunContainerError", str(exc))
            self.events.emit(pod, run.name, "Warning", "Failed", f"Error: {exc}")
            log.info("pod %s container %s: %s", pod_key(pod), run.name, exc)

    def _main_phase(self) -> str:
        if self.restart_policy != "Always" and all(r.terminated is not None for r in self.runs):
            return "Succeeded" if all(r.terminated["exitCode"] == 0 for r in self.runs) else "Failed"
        if all(r.process is not None or r.restart_count > 0 for r in self.runs):
            return "Running"
        return "Pending"

    def _grace_s(self, pod: dict) -> float:
        meta, spec = pod["metadata"], pod["spec"]
        grace = meta.get("deletionGracePeriodSeconds")
        return float(spec.get("terminationGracePeriodSeconds", 30) if grace is None else grace)

    def _stop_all(self, grace_s: float) -> None:
        """SIGTERM every container at once, then SIGKILL what outlives the grace period."""
        runs = [r for r in self.init_runs + self.runs if r.running]
        for run in runs:
            run.signal(15)
        deadline = time.monotonic() + grace_s
        for run in runs:
            run.stop(max(0.0, deadline - time.monotonic()))
        for run in self.init_runs + self.runs:
            run.kill_group()
            self.kubelet.untrack_pid(run.process)

    def _terminate(self, pod: dict) -> None:
        grace = 0.0 if self._gone else self._grace_s(pod)
        log.info("pod %s: stopping containers (grace %.0fs)", pod_key(pod), grace)
        if not self._gone:
            for run in self.init_runs + self.runs:
                if run.running:
                    self.events.emit(pod, run.name, "Normal", "Killing", f"Stopping container {run.name}")
            grace = self._pre_stop(pod, grace)
        self._stop_all(grace)
        if self._gone:
            return
        meta = pod["metadata"]
        while True:
            try:
                self.kubelet.api.request(
                    "DELETE",
                    f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                    {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                     "preconditions": {"uid": self.uid}},
                    ok_missing=True,
                )  # fmt: skip
                return
            except ApiError as exc:
                if exc.status == 409:  # a newer pod of the same name; ours is gone already
                    return
                if exc.status is not None or self.stop_requested.is_set():
                    raise
                if self._gone:  # deleted meanwhile
                    return
                # The API server is restarting: the containers are stopped, only the deletion is left.
                log.info("pod %s: %s; retrying the deletion", pod_key(pod), exc)
                self._wake.wait(SETUP_RETRY_S)
                self._wake.clear()

    def _pre_stop(self, pod: dict, grace: float) -> float:
        """Waits out the running containers' preStop ``sleep`` hooks, as a kubelet does before SIGTERM.

        The hooks run side by side and their time counts against the grace period; returns what is
        left of it. Only the ``sleep`` handler runs here (``exec`` and ``httpGet`` hooks do not):
        it is what keeps a terminating pod serving while load balancers drop it.
        """
        sleeps = [
            float((((run.spec.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}).get("seconds", 0))
            for run in self.runs if run.running
        ]
        seconds = min(max(sleeps, default=0.0), grace)
        if seconds <= 0:
            return grace
        log.info("pod %s: preStop sleep %.0fs", pod_key(pod), seconds)
        started = time.monotonic()
        deadline = started + seconds
        while not (self._gone or self.stop_requested.is_set()) and time.monotonic() < deadline:
            self._wake.wait(deadline - time.monotonic())
            self._wake.clear()
        return max(0.0, grace - (time.monotonic() - started))

    def _condition(self, kind: str, status: bool, reason: str | None = None) -> dict:
        value = "True" if status else "False"
        previous = self.transitions.get(kind)
        if previous is None or previous[0] != value:
            self.transitions[kind] = (value, now_rfc3339())
        condition = {"type": kind, "status": value, "lastProbeTime": None,
                     "lastTransitionTime": self.transitions[kind][1]}  # fmt: skip
        if reason and not status:
            condition["reason"] = reason
        return condition

    def _status(self, pod: dict) -> dict:
        scheduled = [
            c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == "PodScheduled"
        ]
        ready = self.init_done and all(r.ready for r in self.runs) and self.phase == "Running"
        conditions = scheduled + [
            self._condition("PodReadyToStartContainers", self.volume_dirs is not None),
            self._condition("Initialized", self.init_done, "ContainersNotInitialized"),
            self._condition("ContainersReady", ready, "ContainersNotReady"),
            self._condition("Ready", ready, "ContainersNotReady"),
        ]
        status: dict[str, Any] = {
            "phase": self.phase,
            "conditions": conditions,
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": self.pod_ip,
            "podIPs": [{"ip": self.pod_ip}],
            "startTime": self.start_time,
            "containerStatuses": [r.status() for r in self.runs],
        }
        if self.init_runs:
            status["initContainerStatuses"] = [r.status() for r in self.init_runs]
        if self.setup_error:
            status["message"] = self.setup_error
        return status

    def _post_status(self, pod: dict) -> None:
        status = self._status(pod)
        # Posted again when the API's copy says otherwise, as a kubelet's status manager reconciles:
        # after a long API outage the node controller marks the pods of "unreachable" nodes not Ready.
        if status == self.last_posted and _phase_and_ready(pod.get("status") or {}) == _phase_and_ready(status):
            return
        meta = pod["metadata"]
        try:
            self.kubelet.api.merge_patch(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status", {"status": status}
            )
            self.last_posted = status
        except ApiError as exc:
            if exc.status == 404:
                self.gone()
            else:
                log.warning("pod %s: status update failed: %s", pod_key(pod), exc)


def _phase_and_ready(status: dict) -> tuple[str | None, str | None]:
    ready = next((c.get("status") for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    return status.get("phase"), ready
