"""The kubelet stand-in: pods run as local processes on their own pod IPs, honestly reported."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from kvpilot.localcluster import processes
from kvpilot.localcluster.testing import wait_until

pytestmark = pytest.mark.e2e


def _json(result) -> dict:
    return json.loads(result.stdout)


def _pod(local_cluster, name: str) -> dict:
    return _json(local_cluster.kubectl("get", "pod", name, "-o", "json"))


def _apply(local_cluster, *objects: dict) -> None:
    local_cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)})
    )


def _event_reasons(local_cluster, pod: str) -> set[str]:
    events = _json(
        local_cluster.kubectl("get", "events", "--field-selector", f"involvedObject.name={pod}", "-o", "json")
    )
    return {e["reason"] for e in events["items"]}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except FileNotFoundError:
        return ""


def _http_server_deployment(name: str, gpu_resource: str) -> dict:
    labels = {"app": name}
    container = {
        "name": "web",
        "image": "python:ignored",
        "command": ["python", "-m", "http.server", "8080", "--bind", "$(POD_IP)"],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "http", "containerPort": 8080}],
        "resources": {"limits": {gpu_resource: "2"}},
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [container], "terminationGracePeriodSeconds": 5},
            },
        },
    }


def test_gpu_deployment_runs_processes_on_pod_ips_behind_a_service(local_cluster):
    name = f"web-{uuid.uuid4().hex[:6]}"
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {"selector": {"app": name}, "ports": [{"port": 80, "targetPort": "http"}]},
    }
    _apply(local_cluster, _http_server_deployment(name, local_cluster.gpu_resource), service)
    try:
        local_cluster.kubectl("rollout", "status", f"deployment/{name}", "--timeout=60s", timeout=90)
        pods = _json(local_cluster.kubectl("get", "pods", "-l", f"app={name}", "-o", "json"))["items"]
        assert len(pods) == 2
        ips = sorted(p["status"]["podIP"] for p in pods)
        assert len(set(ips)) == 2 and all(ip.startswith("127.0.") for ip in ips)
        assert {p["spec"]["nodeName"] for p in pods} <= set(local_cluster.nodes)
        for pod in pods:
            assert any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"]["conditions"])
            with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8080/", timeout=5) as response:
                assert response.status == 200

        pids = [pid for pid, start in local_cluster.pod_pids() if "http.server" in _cmdline(pid)]
        serving = [pid for pid in pids if any(ip in _cmdline(pid) for ip in ips)]
        assert len(serving) == 2

        # The API server refuses loopback addresses in EndpointSlices, so a Service gets no
        # endpoints here; what holds is that its selector picks exactly these pods, by pod IP.
        selector = _json(local_cluster.kubectl("get", "service", name, "-o", "json"))["spec"]["selector"]
        selected = _json(
            local_cluster.kubectl(
                "get", "pods", "-l", ",".join(f"{k}={v}" for k, v in selector.items()), "-o", "json"
            )
        )
        assert sorted(p["status"]["podIP"] for p in selected["items"]) == ips

        starts = {pid: start for pid, start in local_cluster.pod_pids() if pid in serving}
        local_cluster.kubectl("delete", "deployment", name, "--wait=true", timeout=90)
        wait_until(
            lambda: not any(processes.is_alive(pid, start) for pid, start in starts.items()),
            30,
            "the pods' processes to stop",
        )
        wait_until(
            lambda: (
                not _json(local_cluster.kubectl("get", "pods", "-l", f"app={name}", "-o", "json"))["items"]
            ),
            30,
            "the pods to be removed",
        )
    finally:
        local_cluster.kubectl("delete", "deployment,service", name, "--ignore-not-found", "--wait=false")


def test_env_from_configmap_secret_and_fieldref_and_kubectl_logs(local_cluster):
    name = f"envtest-{uuid.uuid4().hex[:6]}"
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name},
        "data": {"greeting": "hello"},
    }
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name},
        "stringData": {"token": "s3cret"},
    }
    script = (
        "import os, pathlib;"
        "print('GREETING', os.environ['GREETING']);"
        "print('TOKEN', os.environ['TOKEN']);"
        "print('MY_NAME', os.environ['MY_NAME']);"
        "print('VOLUME', pathlib.Path(os.environ['KVPILOT_VOLUME_CONFIG'], 'greeting').read_text());"
        "print('ARG', os.environ['ARG'])"
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "volumes": [{"name": "config", "configMap": {"name": name}}],
            "containers": [
                {
                    "name": "main",
                    "image": "ignored",
                    "command": ["python", "-c", script],
                    "volumeMounts": [{"name": "config", "mountPath": "/etc/config"}],
                    "env": [
                        {
                            "name": "GREETING",
                            "valueFrom": {"configMapKeyRef": {"name": name, "key": "greeting"}},
                        },
                        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": name, "key": "token"}}},
                        {"name": "MY_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {"name": "ARG", "value": "$(GREETING)-world:/etc/config"},
                    ],
                }
            ],
        },
    }
    _apply(local_cluster, configmap, secret, pod)
    try:
        wait_until(
            lambda: _pod(local_cluster, name)["status"].get("phase") == "Succeeded", 30, "the pod to succeed"
        )
        logs = local_cluster.kubectl("logs", name).stdout
        assert "GREETING hello" in logs
        assert "TOKEN s3cret" in logs
        assert f"MY_NAME {name}" in logs
        assert "VOLUME hello" in logs
        assert "ARG hello-world:/etc/config" in logs
        status = _pod(local_cluster, name)["status"]["containerStatuses"][0]
        assert status["state"]["terminated"]["exitCode"] == 0
    finally:
        local_cluster.kubectl("delete", "pod,configmap,secret", name, "--wait=false")


def test_exits_restart_under_always_and_end_the_pod_otherwise(local_cluster):
    suffix = uuid.uuid4().hex[:6]

    def pod(name: str, policy: str, code: int) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "restartPolicy": policy,
                "containers": [
                    {
                        "name": "main",
                        "image": "ignored",
                        "command": [sys.executable, "-c", f"raise SystemExit({code})"],
                    }
                ],
            },
        }

    crashing, failing = f"crashing-{suffix}", f"failing-{suffix}"
    _apply(local_cluster, pod(crashing, "Always", 3), pod(failing, "Never", 1))
    try:

        def restarted():
            statuses = _pod(local_cluster, crashing)["status"].get("containerStatuses") or []
            return statuses and statuses[0]["restartCount"] >= 2 and statuses[0]

        status = wait_until(restarted, 30, "two restarts of the crashing container")
        assert status["lastState"]["terminated"]["exitCode"] == 3
        assert _pod(local_cluster, crashing)["status"]["phase"] == "Running"
        assert {"Started", "BackOff"} <= _event_reasons(local_cluster, crashing)
        wait_until(
            lambda: _pod(local_cluster, failing)["status"].get("phase") == "Failed", 30, "the pod to fail"
        )
        terminated = _pod(local_cluster, failing)["status"]["containerStatuses"][0]["state"]["terminated"]
        assert terminated["exitCode"] == 1 and terminated["reason"] == "Error"
    finally:
        local_cluster.kubectl("delete", "pod", crashing, failing, "--wait=false")


def test_a_command_that_cannot_run_gets_a_clear_reason(local_cluster):
    name = f"badcmd-{uuid.uuid4().hex[:6]}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "main", "image": "ignored", "command": ["kvpilot-no-such-binary"]}]},
    }
    _apply(local_cluster, pod)
    try:

        def waiting():
            statuses = _pod(local_cluster, name)["status"].get("containerStatuses") or []
            state = statuses[0]["state"].get("waiting") if statuses else None
            return state if state and state["reason"] == "RunCommandError" else None

        state = wait_until(waiting, 30, "the RunCommandError reason")
        assert "kvpilot-no-such-binary" in state["message"] and "not found" in state["message"]
        assert _pod(local_cluster, name)["status"]["phase"] == "Pending"
        assert "Failed" in _event_reasons(local_cluster, name)
    finally:
        local_cluster.kubectl("delete", "pod", name, "--wait=false")


def test_host_network_pod_gets_the_node_address(local_cluster):
    name = f"hostnet-{uuid.uuid4().hex[:6]}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "hostNetwork": True,
            "restartPolicy": "Never",
            "containers": [
                {"name": "main", "image": "ignored", "command": ["sh", "-c", "echo $KVPILOT_POD_IP"]}
            ],
        },
    }
    _apply(local_cluster, pod)
    try:
        wait_until(
            lambda: _pod(local_cluster, name)["status"].get("phase") == "Succeeded", 30, "the pod to end"
        )
        assert _pod(local_cluster, name)["status"]["podIP"] == "127.0.0.1"
        assert local_cluster.kubectl("logs", name).stdout.strip() == "127.0.0.1"
    finally:
        local_cluster.kubectl("delete", "pod", name, "--wait=false")


def test_a_process_ignoring_sigterm_is_killed_after_the_grace_period(local_cluster):
    name = f"stubborn-{uuid.uuid4().hex[:6]}"
    script = (
        "import signal, time; signal.signal(signal.SIGTERM, lambda *_: print('got SIGTERM', flush=True));"
        f"print('ready', flush=True); time.sleep(600)  # {name}"
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            # Long enough that the test sees the process alive after its SIGTERM however loaded the machine.
            "terminationGracePeriodSeconds": 5,
            "containers": [{"name": "main", "image": "ignored", "command": [sys.executable, "-c", script]}],
        },
    }
    _apply(local_cluster, pod)
    try:
        wait_until(
            lambda: "ready" in local_cluster.pod_log("default", name, "main"), 60, "the process to start"
        )
        ((pid, start),) = [(p, s) for p, s in local_cluster.pod_pids() if name in _cmdline(p)]
        local_cluster.kubectl("delete", "pod", name, "--wait=false")
        def got_sigterm() -> bool:
            return "got SIGTERM" in local_cluster.pod_log("default", name, "main")

        wait_until(lambda: got_sigterm() or not processes.is_alive(pid, start), 60, "SIGTERM", interval=0.05)
        assert processes.is_alive(pid, start), "killed before its grace period ran out"
        assert got_sigterm()
        wait_until(lambda: not processes.is_alive(pid, start), 60, "SIGKILL after the grace period")
        wait_until(
            lambda: local_cluster.kubectl("get", "pod", name, check=False).returncode != 0,
            60,
            "the pod's removal",
        )
    finally:
        local_cluster.kubectl("delete", "pod", name, "--ignore-not-found", "--wait=false")


def test_pre_stop_sleep_runs_before_sigterm_within_the_grace_period(local_cluster):
    name = f"draining-{uuid.uuid4().hex[:6]}"
    script = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: (print('got SIGTERM', flush=True), "
        f"sys.exit(0))); print('ready', flush=True); time.sleep(600)  # {name}"
    )
    container = {"name": "main", "image": "ignored", "command": [sys.executable, "-c", script],
                 "lifecycle": {"preStop": {"sleep": {"seconds": 3}}}}  # fmt: skip
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
           "spec": {"terminationGracePeriodSeconds": 10, "containers": [container]}}  # fmt: skip
    _apply(local_cluster, pod)
    try:
        wait_until(
            lambda: "ready" in local_cluster.pod_log("default", name, "main"), 30, "the process to start"
        )
        ((pid, start),) = [(p, s) for p, s in local_cluster.pod_pids() if name in _cmdline(p)]
        deleted = time.monotonic()
        local_cluster.kubectl("delete", "pod", name, "--wait=false")
        wait_until(lambda: "got SIGTERM" in local_cluster.pod_log("default", name, "main"), 60, "SIGTERM")
        # A lower bound (the sleep starts after the deletion): a slow machine only makes it longer.
        assert time.monotonic() - deleted >= 3.0, "SIGTERM came before the preStop sleep was over"
        wait_until(lambda: not processes.is_alive(pid, start), 60, "the process to exit")
    finally:
        local_cluster.kubectl("delete", "pod", name, "--ignore-not-found", "--wait=false")


def test_failing_liveness_probe_restarts_the_container(local_cluster):
    name = f"unlive-{uuid.uuid4().hex[:6]}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": "ignored",
                    "command": ["sleep", "600"],
                    "livenessProbe": {
                        "exec": {"command": ["false"]},
                        "periodSeconds": 1,
                        "failureThreshold": 2,
                    },
                }
            ],
        },
    }
    _apply(local_cluster, pod)
    try:

        def restarted():
            statuses = _pod(local_cluster, name)["status"].get("containerStatuses") or []
            return statuses and statuses[0]["restartCount"] >= 1

        wait_until(restarted, 30, "a restart after the liveness probe failed")
        assert {"Unhealthy", "Killing"} <= _event_reasons(local_cluster, name)
    finally:
        local_cluster.kubectl("delete", "pod", name, "--wait=false")


def test_missing_configmap_holds_the_container_until_it_exists(local_cluster):
    name = f"needscm-{uuid.uuid4().hex[:6]}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "volumes": [{"name": "settings", "configMap": {"name": name}}],
            "containers": [
                {
                    "name": "main",
                    "image": "ignored",
                    "command": ["cat", "/etc/settings/mode"],
                    "volumeMounts": [{"name": "settings", "mountPath": "/etc/settings"}],
                }
            ],
        },
    }
    _apply(local_cluster, pod)
    try:

        def waiting_reason():
            statuses = _pod(local_cluster, name)["status"].get("containerStatuses") or []
            return statuses and (statuses[0]["state"].get("waiting") or {}).get("message")

        message = wait_until(waiting_reason, 30, "the container to wait for its ConfigMap")
        assert f'configmap "{name}" not found' in message
        local_cluster.kubectl("create", "configmap", name, "--from-literal=mode=fast")
        wait_until(
            lambda: _pod(local_cluster, name)["status"].get("phase") == "Succeeded", 30, "the pod to run"
        )
        assert local_cluster.kubectl("logs", name).stdout == "fast"
    finally:
        local_cluster.kubectl("delete", "pod,configmap", name, "--ignore-not-found", "--wait=false")


def test_a_ready_condition_overwritten_in_the_api_is_put_back(local_cluster):
    # What the node controller does to the pods of a node whose heartbeats stopped (a long API outage).
    name = f"marked-{uuid.uuid4().hex[:6]}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": "ignored", "command": ["sleep", "300"]}],
        },
    }
    _apply(local_cluster, pod)

    def ready() -> str | None:
        conditions = _pod(local_cluster, name)["status"].get("conditions") or []
        return next((c["status"] for c in conditions if c["type"] == "Ready"), None)

    try:
        wait_until(lambda: ready() == "True", 30, "the pod Ready")
        local_cluster.kubectl("patch", "pod", name, "--subresource=status", "-p",
                              json.dumps({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}))
        wait_until(lambda: ready() == "True", 10, "the kubelet to report the pod Ready again")
    finally:
        local_cluster.kubectl("delete", "pod", name, "--wait=false")
