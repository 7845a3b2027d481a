"""What a user deploys, end to end: the kvpilot image built here (scripts/build-image.sh), run by a
local cluster whose kubelet starts every container from its image with podman (image mode).

The chart installs the operator and the gateway from the image; the operator makes an engine pod
from the same image for an InferenceService serving a generated tiny model; a completion and a tool
call (through the spec's chat template and tool-call parser) go through the gateway's hostPort as a
user's would. The pods' containers are podman containers, and the engine's start (pod created ->
container started -> engine loaded -> Ready) is printed. Then LoRA adapters in the spec answer by
name through the gateway, and one added to the spec answers from the same pod, not restarted.

The image is built the first time on a machine (minutes: the Python dependencies, torch included)
and reused while its inputs are unchanged; the cluster is this module's own (image mode is a
cluster's setting), beside the session's process-mode one.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest

from kvpilot.localcluster import podman
from kvpilot.localcluster.cluster import LocalCluster
from kvpilot.localcluster.processes import free_port
from kvpilot.localcluster.testing import ClusterHandle, wait_until
from kvpilot.operator import crd
from kvpilot.operator.kube import Kube
from kvpilot.kube_contract import pod_ready

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

NS = "kvpilot-image-e2e"
RELEASE = "kvi"
OPERATOR_HEALTH_PORT = 18521


@pytest.fixture(scope="module")
def image() -> str:
    build = subprocess.run([str(crd.REPO_ROOT / "scripts" / "build-image.sh")], capture_output=True, text=True,
                           timeout=2000)
    assert build.returncode == 0, build.stderr[-4000:]
    print(build.stderr.strip().splitlines()[-1])  # the image's size
    return build.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def image_cluster(image, tmp_path_factory):
    cluster = LocalCluster(tmp_path_factory.mktemp("image-cluster") / "state")
    result = cluster.up(containers="podman")
    handle = ClusterHandle(cluster, result.record, result.seconds)
    yield handle
    left = handle.down()
    assert not left, f"processes left behind: {left}"
    assert not podman.remove_cluster_containers(cluster.state.root), "containers left behind"


@pytest.fixture(scope="module")
def readable_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model where the image's non-root user can read it (pytest's folders are 0700)."""
    root = tmp_path_factory.mktemp("image-model")
    root.chmod(0o755)
    model = Path(shutil.copytree(tiny_model_dir, root / "tiny"))
    model.chmod(0o755)
    for path in model.iterdir():
        path.chmod(0o644)
    return model


def _seconds(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


@pytest.fixture(scope="module")
def deployed(image_cluster, image, readable_model):
    """The chart from the image with its gateway on a hostPort, and the InferenceService `tiny`
    Ready: (cluster, kube, the gateway's URL, the engine pod)."""
    cluster = image_cluster
    kube = Kube(cluster.api_client())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    repository, tag = image.rsplit(":", 1)
    cluster.kubectl("create", "namespace", NS)
    cluster.helm(
        "install", RELEASE, str(crd.REPO_ROOT / "charts" / "kvpilot"), "--namespace", NS,
        "--set", "rbac.scope=namespaced", "--set", "engine.bindPodIP=true", "--set", "bindPodIP=true",
        "--set", f"image.repository={repository}", "--set", f"image.tag={tag}", "--set", "image.pullPolicy=Never",
        "--set", f"healthPort={OPERATOR_HEALTH_PORT}", "--set", f"metricsPort={OPERATOR_HEALTH_PORT + 1}",
        "--set", "engine.shutdownGraceSeconds=2", "--set", "engine.drainSeconds=1",
        "--set", "gateway.enabled=true", "--set", f"gateway.hostPort={port}", "--set", f"gateway.url={url}",
        "--wait", "--timeout", "5m", timeout=400,
    )  # fmt: skip
    service = {
        "apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "tiny", "namespace": NS},
        "spec": {"model": {"uri": f"file://{readable_model}", "servedName": "tiny"}, "resources": {"gpus": 1},
                 "engine": {"maxNumSeqs": 4, "maxModelLen": 512, "toolCallParser": "hermes",
                            "chatTemplate": (crd.REPO_ROOT / "examples" / "chat-templates" /
                                             "chatml-tools.jinja").read_text(),
                            "extraArgs": ["--device", "cpu", "--kv-cache-memory", "32MiB"]}},
    }  # fmt: skip
    cluster.kubectl("apply", "-f", "-", input=json.dumps(service))

    pod = _wait(cluster, kube, lambda: _engine_pod(kube), 600, "the engine pod to be Ready")
    _wait(cluster, kube, lambda: httpx.get(f"{url}/v1/models", timeout=5).json()["data"], 120, "the gateway to route")
    return cluster, kube, url, pod


def _engine_pod(kube: Kube) -> dict | None:
    """The Ready engine pod of `tiny` (of its newest template while a rollout replaces one)."""
    pods = kube.list("v1", "Pod", NS, label_selector="app.kubernetes.io/instance=tiny")
    return next((p for p in pods if pod_ready(p) and not p["metadata"].get("deletionTimestamp")), None)


def _wait(cluster, kube: Kube, predicate, timeout: float, what: str):
    """wait_until, and on a timeout the pods and their logs in the failure."""
    try:
        return wait_until(predicate, timeout, what, interval=1.0)
    except AssertionError as exc:
        logs = {p["metadata"]["name"]: cluster.pod_log(NS, p["metadata"]["name"], p["spec"]["containers"][0]["name"])
                for p in kube.list("v1", "Pod", NS)}
        raise AssertionError(f"{exc}\n{cluster.kubectl('get', 'pods', '-n', NS, '-o', 'wide').stdout}\n"
                             + "\n".join(f"--- {n}:\n{text[-3000:]}" for n, text in logs.items())) from None


def test_operator_gateway_and_engine_run_from_the_image(deployed, image):
    cluster, kube, url, pod = deployed

    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "ignore_eos": True}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 5
    # A tool call through the gateway, rendered by the spec's chat template: tool_choice required
    # constrains even a random model's output to a valid call.
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}}, "required": ["city"],
        "additionalProperties": False}}}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool],
            "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60}
    reply = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
    assert reply.status_code == 200, reply.text
    (call,) = reply.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"] in (
        "Paris", "Lima")
    assert reply.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert reply.json()["usage"]["prompt_tokens"] > 60  # the template wrote the tool's schema into the prompt

    pods = kube.list("v1", "Pod", NS)
    assert {p["metadata"]["labels"].get("app.kubernetes.io/component") for p in pods} >= {"operator", "gateway"}
    names = set()
    for each in pods:
        assert each["spec"]["containers"][0]["image"] == image, each["metadata"]["name"]
        status = each["status"]["containerStatuses"][0]
        assert status["containerID"].startswith("podman://"), status
        names.add(status["containerID"].removeprefix("podman://"))
    listed = subprocess.run(["podman", "ps", "--format", "{{.Names}}"], env=podman.podman_env(),
                            capture_output=True, text=True, check=True).stdout.split()
    assert names <= set(listed), (names, listed)

    # The engine's start, from the API's timestamps and the engine's own log.
    created = _seconds(pod["metadata"]["creationTimestamp"])
    started = _seconds(pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"])
    ready = _seconds(next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")["lastTransitionTime"])
    log = cluster.pod_log(NS, pod["metadata"]["name"], "engine")
    startup = re.search(r"^(\S+ \S+) \S+ \S+: start-up: ([\d.]+) s from exec to a loaded engine "
                        r"\(Python imports ([\d.]+) s", log, flags=re.MULTILINE)
    loaded = re.search(r"weights loaded in ([\d.]+) s, the tokenizer \(built beside them\) ([\d.]+) s later, "
                       r"KV cache sized .* in ([\d.]+) s", log)
    assert startup and loaded, log[-3000:]
    # The engine's clock and the API's are this machine's (UTC in the image and here).
    logged = datetime.strptime(startup.group(1), "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=timezone.utc).timestamp()
    since_exec = float(startup.group(2))
    exec_at = logged - since_exec
    print(f"engine pod from the image, created -> Ready {ready - created:.1f} s: scheduled and podman started "
          f"{started - created:.1f} s, image start (podman run -> Python's exec) {exec_at - started:.1f} s, "
          f"Python imports {float(startup.group(3)):.1f} s, weights {float(loaded.group(1)):.1f} s, tokenizer after them "
          f"{float(loaded.group(2)):.1f} s, KV cache and warm-up {float(loaded.group(3)):.1f} s, server start and "
          f"readiness probe {ready - logged:.1f} s (timestamps in whole seconds: +-1 s each)")



def test_lora_adapters_from_the_spec_and_one_added_without_a_restart(deployed, tiny_model_dir, tmp_path_factory):
    """spec.loras through the gateway: the first adapters roll the pod (LoRA turns on, their folder is
    mounted); an adapter added beside them is loaded on the running pod, which keeps serving."""
    from kvpilot.engine.model_files import make_lora_adapter

    cluster, kube, url, _ = deployed
    root = tmp_path_factory.mktemp("image-adapters")
    root.chmod(0o755)
    for seed, name in enumerate(("sql", "chat", "support"), start=1):
        folder = make_lora_adapter(root / name, tiny_model_dir, rank=8, seed=seed)
        folder.chmod(0o755)
        for path in folder.iterdir():
            path.chmod(0o644)

    def loras(*names: str) -> str:
        return json.dumps({"spec": {"loras": [{"name": n, "uri": f"file://{root / n}"} for n in names]}})

    def answer(model: str) -> str | None:
        response = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        return response.json()["choices"][0]["text"] if response.status_code == 200 else None

    cluster.kubectl("patch", "kvis", "tiny", "-n", NS, "--type", "merge", "-p", loras("sql", "chat"))
    _wait(cluster, kube, lambda: answer("sql") is not None and answer("chat") is not None, 600,
          "the adapters sql and chat to answer through the gateway")
    pod = _engine_pod(kube)
    restarts = pod["status"]["containerStatuses"][0]["restartCount"]
    listed = {m["id"]: m.get("parent") for m in httpx.get(f"{url}/v1/models", timeout=5).json()["data"]}
    assert listed == {"tiny": None, "sql": "tiny", "chat": "tiny"}
    texts = {model: answer(model) for model in ("tiny", "sql", "chat")}
    assert len(set(texts.values())) == 3, texts  # each adapter changes the model's answer

    cluster.kubectl("patch", "kvis", "tiny", "-n", NS, "--type", "merge", "-p", loras("sql", "chat", "support"))
    _wait(cluster, kube, lambda: answer("support") is not None, 120, "the adapter added to the spec to answer")
    now = _engine_pod(kube)
    assert now["metadata"]["uid"] == pod["metadata"]["uid"]  # the same pod: no rollout
    assert now["status"]["containerStatuses"][0]["restartCount"] == restarts
    assert answer("sql") == texts["sql"]
    _wait(cluster, kube, lambda: [e["loadedPods"] for e in
                                  (kube.get_inference_service(NS, "tiny")["status"].get("loras") or [])] == [1, 1, 1],
          60, "status.loras to show the three adapters loaded")
    status = kube.get_inference_service(NS, "tiny")["status"]
    adapters = next(c for c in status["conditions"] if c["type"] == "AdaptersReady")
    assert adapters["status"] == "True", adapters
