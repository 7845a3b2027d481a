"""Pure functions: an InferenceService's spec (+ the engine settings in effect) -> its children's manifests.

No I/O here: ``kube.py`` applies what these return (adding owner references),
and tests read the dicts directly. Children, all named after the service:

- Deployment ``NAME``: engine pods running ``kvpilot serve``.
- Service ``NAME``: port 8000 ``http``, the OpenAI API (never the engines' admin port).
- ConfigMap ``NAME-tuning``: the tuning state and the LoRA adapters the pods read at start.
- PodDisruptionBudget ``NAME``: only when replicas > 1.
- Secret ``NAME-admin``: the engines' admin token (created once, never rewritten).
"""

from __future__ import annotations

import base64
import hashlib
import json
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from kvpilot.engine_contract import (
    ADMIN_PORT,
    ADMIN_TOKEN_ENV,
    API_KEY_ENV,
    CHAT_TEMPLATE_ENV,
    CPU_MEMORY_LIMIT_ENV,
    ENGINE_PORT,
    HEALTH_PATH,
)
from kvpilot.operator import tuning_configmap
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import EngineSettings, InferenceServiceSpec, LoRASource, ModelLocation

PORT_NAME = "http"
ADMIN_PORT_NAME = "admin"
CONTAINER_NAME = "engine"
TUNING_DIR = "/etc/kvpilot/tuning"
TUNING_FILE = f"{TUNING_DIR}/{tuning_configmap.TUNING_FILE_KEY}"
MODEL_ROOT = "/mnt/models"
MODEL_VOLUME = "model"
# spec.engine.speculative.model: its own volume and root, so it may share a claim (or nothing) with the target.
DRAFT_MODEL_ROOT = "/mnt/draft-model"
DRAFT_MODEL_VOLUME = "draft-model"
# spec.loras: one volume per claim, per node directory holding adapters, and per hf:// adapter.
LORA_ROOT = "/mnt/loras"
SCRATCH_DIR = "/tmp"
POD_IP_ENV = "POD_IP"
ADMIN_TOKEN_KEY = "token"
# The image's non-root user (see the Dockerfile).
RUN_AS_USER = 10001

from kvpilot.kube_contract import (  # noqa: E402 (labels: shared with the gateway)
    APP_NAME,
    COMPONENT_LABEL,
    INSTANCE_LABEL,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    NAME_LABEL,
)
from kvpilot.kube_contract import ENGINE_COMPONENT as COMPONENT  # noqa: E402


def tuning_configmap_name(name: str) -> str:
    return f"{name}-tuning"


def admin_secret_name(name: str) -> str:
    return f"{name}-admin"


def selector_labels(name: str) -> dict[str, str]:
    """Labels that pick one InferenceService's engine pods (immutable once a Deployment exists)."""
    return {NAME_LABEL: APP_NAME, INSTANCE_LABEL: name, COMPONENT_LABEL: COMPONENT}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def labels(name: str) -> dict[str, str]:
    """Kubernetes' recommended labels, on every child."""
    return {**selector_labels(name), "app.kubernetes.io/part-of": APP_NAME, MANAGED_BY_LABEL: MANAGED_BY}


def service_url(name: str, namespace: str) -> str:
    return f"http://{name}.{namespace}.svc.cluster.local:{ENGINE_PORT}/v1"


def status_url(name: str, namespace: str, gateway_url: str | None) -> str:
    """The OpenAI base URL clients use: the gateway's when one runs, else the service's own."""
    return f"{gateway_url}/v1" if gateway_url else service_url(name, namespace)


def _metadata(name: str, namespace: str, service: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels(service)}


# --- model volume -----------------------------------------------------------


@dataclass(frozen=True)
class ModelMount:
    """How a model folder reaches the engine container: the path it serves, and what provides it."""

    path: str
    volumes: list[dict[str, Any]]
    volume_mounts: list[dict[str, Any]]
    init_containers: list[dict[str, Any]] = field(default_factory=list)


def model_mount(source: ModelLocation, volume: str, root: str, image: str,
                container_security: dict[str, Any]) -> ModelMount:
    """``source`` as volume ``volume``: a claim, a node's folder or a download mounted at ``root``, a
    node's single .gguf file at ``root/NAME``. An hf:// download runs in init container
    ``download_container_name(volume)``."""
    uri = source.uri
    if uri.startswith("pvc://"):
        claim, _, sub_path = uri[len("pvc://"):].partition("/")
        return ModelMount(
            path=f"{root}/{sub_path}".rstrip("/"),
            volumes=[{"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}],
            volume_mounts=[{"name": volume, "mountPath": root, "readOnly": True}],
        )
    if uri.startswith("file:///"):
        # Under root, not at the node's own path: the image's user may not traverse that path's
        # parents in the container (a file under /root, say). A .gguf URI names a single-file
        # model (the engine reads it without a folder around it).
        host_path = "/" + uri[len("file:///"):].rstrip("/")
        single_file = host_path.lower().endswith(".gguf")
        path = f"{root}/{posixpath.basename(host_path)}" if single_file else root
        return ModelMount(
            path=path,
            volumes=[{"name": volume, "hostPath": {"path": host_path, "type": "File" if single_file else "Directory"}}],
            volume_mounts=[{"name": volume, "mountPath": path, "readOnly": True}],
        )
    if uri.startswith("hf://"):
        repo = uri[len("hf://"):]
        return ModelMount(
            path=root,
            volumes=[{"name": volume, "emptyDir": {}}],
            volume_mounts=[{"name": volume, "mountPath": root, "readOnly": True}],
            init_containers=[_download_container(source, repo, volume, root, image, container_security)],
        )
    raise ValueError(f"model uri {uri!r}: unknown scheme (use pvc://, file:/// or hf://)")


def draft_model_mount(spec: InferenceServiceSpec, target: ModelMount, image: str,
                      container_security: dict[str, Any]) -> ModelMount | None:
    """spec.engine.speculative.model beside the target (``target``); None without a draft model."""
    speculative = spec.engine.speculative
    if speculative is None or speculative.model is None:
        return None
    if speculative.model.uri.startswith("file:///") and speculative.model.uri.rstrip("/") == spec.model.uri.rstrip("/"):
        # The target's own file or folder: already mounted, and read from there.
        return ModelMount(path=target.path, volumes=[], volume_mounts=[])
    return model_mount(speculative.model, DRAFT_MODEL_VOLUME, DRAFT_MODEL_ROOT, image, container_security)


@dataclass(frozen=True)
class LoRAVolume:
    """Where a LoRA adapter's folder comes from: ``volume`` (shared by every adapter it holds)
    mounted at ``root``, the adapter at ``path`` below it."""

    volume: dict[str, Any]
    root: str
    path: str
    source: LoRASource


def lora_volume(source: LoRASource) -> LoRAVolume:
    """A pvc:// adapter reads its claim, mounted once for every adapter on it; a file:// adapter its
    node directory's parent, so adapters side by side share one mount (adding one there changes no
    pod template and loads live); an hf:// adapter is downloaded into a volume of its own."""
    uri = source.uri
    if uri.startswith("pvc://"):
        claim, _, sub_path = uri[len("pvc://"):].partition("/")
        volume = f"lora-pvc-{_short_hash(claim)}"
        root = f"{LORA_ROOT}/{volume}"
        return LoRAVolume({"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}},
                          root, f"{root}/{sub_path}".rstrip("/"), source)
    if uri.startswith("file:///"):
        host_path = "/" + uri[len("file:///"):].rstrip("/")
        parent = posixpath.dirname(host_path)
        volume = f"lora-dir-{_short_hash(parent)}"
        root = f"{LORA_ROOT}/{volume}"
        return LoRAVolume({"name": volume, "hostPath": {"path": parent, "type": "Directory"}}, root,
                          f"{root}/{posixpath.basename(host_path)}", source)
    if uri.startswith("hf://"):
        volume = f"lora-hf-{_short_hash(uri + chr(0) + (source.revision or ''))}"
        root = f"{LORA_ROOT}/{volume}"
        return LoRAVolume({"name": volume, "emptyDir": {}}, root, root, source)
    raise ValueError(f"lora uri {uri!r}: unknown scheme (use pvc://, file:/// or hf://)")


def lora_paths(spec: InferenceServiceSpec) -> dict[str, str]:
    """Each adapter's folder inside an engine pod, by name."""
    return {source.name: lora_volume(source).path for source in spec.loras}


def _lora_pod_parts(spec: InferenceServiceSpec, image: str, container_security: dict[str, Any]
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, the engine's volume mounts, download init containers) for spec.loras, each volume once."""
    volumes: dict[str, LoRAVolume] = {}
    for source in spec.loras:
        placed = lora_volume(source)
        volumes.setdefault(placed.volume["name"], placed)
    ordered = [volumes[name] for name in sorted(volumes)]
    downloads = [
        _download_container(v.source, v.source.uri[len("hf://"):], v.volume["name"], v.root, image, container_security)
        for v in ordered if "emptyDir" in v.volume
    ]
    mounts = [{"name": v.volume["name"], "mountPath": v.root, "readOnly": True} for v in ordered]
    return [v.volume for v in ordered], mounts, downloads


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def download_container_name(volume: str) -> str:
    """The init container that downloads an hf:// model into volume ``volume``."""
    return f"download-{volume}"


def _download_container(source: ModelLocation, repo: str, volume: str, root: str, image: str,
                        container_security: dict[str, Any]) -> dict[str, Any]:
    args = ["download", repo, "--local-dir", root]
    if source.revision:
        args += ["--revision", source.revision]
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": f"{SCRATCH_DIR}/hf"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    if source.token_secret is not None:
        secret = source.token_secret
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}})
    return {
        "name": download_container_name(volume),
        "image": image,
        "command": ["hf"],
        "args": args,
        "env": env,
        "securityContext": container_security,
        "volumeMounts": [
            {"name": volume, "mountPath": root},
            {"name": "scratch", "mountPath": SCRATCH_DIR},
        ],
    }


# --- engine pod ---------------------------------------------------------------


def served_model_name(name: str, spec: InferenceServiceSpec) -> str:
    return spec.model.served_name or name


def engine_args(name: str, spec: InferenceServiceSpec, in_effect: EngineSettings, model_path: str,
                settings: OperatorSettings, draft_path: str | None = None) -> list[str]:
    """`kvpilot serve` arguments. maxNumSeqs and maxNumBatchedTokens come from the spec here and are
    overridden at start by the tuning file, so the tuner changing them does not roll the pods; the
    memory fraction comes from the settings in effect, so changing it does. ``draft_path``: where the
    pod mounts spec.engine.speculative.model (draft_model only)."""
    engine = spec.engine
    args = [
        "serve", model_path,
        "--host", f"$({POD_IP_ENV})" if settings.engine_bind_pod_ip else "0.0.0.0",
        "--port", str(ENGINE_PORT),
        "--served-model-name", served_model_name(name, spec),
        "--max-num-seqs", str(engine.max_num_seqs),
        "--gpu-memory-utilization", _number(in_effect.gpu_memory_utilization),
        "--block-size", str(engine.block_size),
        "--dtype", engine.dtype,
        "--quantization", engine.quantization,
    ]
    if engine.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(engine.max_num_batched_tokens)]
    if engine.max_model_len is not None:
        args += ["--max-model-len", str(engine.max_model_len)]
    args.append("--enable-chunked-prefill" if engine.enable_chunked_prefill else "--no-enable-chunked-prefill")
    args.append("--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching")
    args += [
        "--tuning-file", TUNING_FILE,
        "--shutdown-grace-period", str(settings.engine_shutdown_grace_seconds),
    ]
    if engine.speculative is not None:
        config = engine.speculative.engine_config(draft_path)
        args += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    if engine.tool_call_parser is not None:
        args += ["--tool-call-parser", engine.tool_call_parser]
    if engine.max_waiting_seconds is not None:
        args += ["--max-waiting-seconds", _number(engine.max_waiting_seconds)]
    if spec.loras:  # the adapters themselves come from the tuning file, which follows spec.loras live
        args += ["--enable-lora", "--max-loras", str(engine.max_loras), "--max-lora-rank", str(engine.max_lora_rank)]
    return args + list(engine.extra_args)


def _api_key_env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    ref = spec.api_key_secret_ref
    if ref is None:
        return []
    return [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def _number(value: float) -> str:
    return repr(float(value))


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    amounts: dict[str, Any] = {}
    if spec.resources.gpus > 0:
        amounts[spec.resources.gpu_resource_name] = str(spec.resources.gpus)
    if spec.resources.cpu is not None:
        amounts["cpu"] = str(spec.resources.cpu)
    if spec.resources.memory is not None:
        amounts["memory"] = spec.resources.memory
    # Requests equal limits: GPUs cannot be overcommitted anyway, and a model server
    # squeezed below its memory request is an OOM kill waiting to happen.
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def _probe(path: str, period: int, failures: int, timeout: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def engine_container(name: str, spec: InferenceServiceSpec, in_effect: EngineSettings, mount: ModelMount,
                     draft: ModelMount | None, image: str, settings: OperatorSettings,
                     lora_mounts: list[dict[str, Any]]) -> dict[str, Any]:
    # /health answers in microseconds: probed every second, a started engine is Ready within a second
    # (a request held at zero replicas waits on it).
    startup_period = 1
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": image,
        "command": ["kvpilot"],
        "args": engine_args(name, spec, in_effect, mount.path, settings, draft.path if draft else None),
        "ports": [
            {"name": PORT_NAME, "containerPort": ENGINE_PORT, "protocol": "TCP"},
            # The operator's alone: the Service leaves it out, the chart's NetworkPolicy admits only the operator.
            {"name": ADMIN_PORT_NAME, "containerPort": ADMIN_PORT, "protocol": "TCP"},
        ],
        "env": [
            {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            # Secrets reach the engine as environment variables from Secrets: never in its arguments or the pod spec.
            {"name": ADMIN_TOKEN_ENV,
             "valueFrom": {"secretKeyRef": {"name": admin_secret_name(name), "key": ADMIN_TOKEN_KEY}}},
            *_api_key_env(spec),
            # On a CPU the memory fraction sizes the KV cache within the container's limit.
            *([{"name": CPU_MEMORY_LIMIT_ENV, "valueFrom": {"resourceFieldRef": {
                "containerName": CONTAINER_NAME, "resource": "limits.memory"}}}] if spec.resources.memory else []),
            # A template is long and multi-line: an environment variable, not an argument.
            *([{"name": CHAT_TEMPLATE_ENV, "value": spec.engine.chat_template}] if spec.engine.chat_template else []),
            # The root filesystem is read-only: caches go to the scratch volume.
            {"name": "HOME", "value": f"{SCRATCH_DIR}/home"},
            {"name": "XDG_CACHE_HOME", "value": f"{SCRATCH_DIR}/cache"},
            {"name": "HF_HOME", "value": f"{SCRATCH_DIR}/hf"},
            {"name": "TRITON_CACHE_DIR", "value": f"{SCRATCH_DIR}/triton"},
        ],
        "resources": _resources(spec),
        # Model load can take minutes; liveness only starts once this passes.
        "startupProbe": _probe(HEALTH_PATH, startup_period,
                               max(1, settings.engine_startup_seconds // startup_period), timeout=3),
        "readinessProbe": _probe(HEALTH_PATH, period=5, failures=2, timeout=3),
        "livenessProbe": _probe(HEALTH_PATH, period=10, failures=6, timeout=5),
        # Keep serving while endpoints drop the pod, then SIGTERM lets the engine drain.
        "lifecycle": {"preStop": {"sleep": {"seconds": settings.engine_drain_seconds}}},
        "securityContext": _container_security(),
        "volumeMounts": [
            *mount.volume_mounts,
            *(draft.volume_mounts if draft else []),
            *lora_mounts,
            {"name": "tuning", "mountPath": TUNING_DIR, "readOnly": True},
            {"name": "scratch", "mountPath": SCRATCH_DIR},
        ],
    }
    pull_policy = spec.image_pull_policy or settings.engine_image_pull_policy
    if pull_policy:
        container["imagePullPolicy"] = pull_policy
    return container


def build_deployment(name: str, namespace: str, spec: InferenceServiceSpec, in_effect: EngineSettings,
                     settings: OperatorSettings) -> dict[str, Any]:
    image = spec.image or settings.engine_image
    mount = model_mount(spec.model, MODEL_VOLUME, MODEL_ROOT, image, _container_security())
    draft = draft_model_mount(spec, mount, image, _container_security())
    lora_volumes, lora_mounts, lora_downloads = _lora_pod_parts(spec, image, _container_security())
    pod_spec: dict[str, Any] = {
        "containers": [engine_container(name, spec, in_effect, mount, draft, image, settings, lora_mounts)],
        "volumes": [
            *mount.volumes,
            *(draft.volumes if draft else []),
            *lora_volumes,
            {"name": "tuning", "configMap": {"name": tuning_configmap_name(name)}},
            {"name": "scratch", "emptyDir": {}},
        ],
        "terminationGracePeriodSeconds": settings.termination_grace_seconds,
        "enableServiceLinks": False,
        # The engine never calls the Kubernetes API: no token in its pods.
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    init_containers = [*mount.init_containers, *(draft.init_containers if draft else []), *lora_downloads]
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    if spec.affinity:
        pod_spec["affinity"] = dict(spec.affinity)
    if spec.resources.gpus > 0:
        # No spare GPU for a surge pod: replace pods one at a time instead of deadlocking.
        rolling = {"maxSurge": 0, "maxUnavailable": 1}
    else:
        rolling = {"maxSurge": 1, "maxUnavailable": 0}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(name, namespace, name),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
            "progressDeadlineSeconds": settings.engine_startup_seconds + 300,
            "revisionHistoryLimit": 3,
            "template": {"metadata": {"labels": labels(name)}, "spec": pod_spec},
        },
    }


# --- the other children ---------------------------------------------------------


def build_service(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, namespace, name),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name),
            "ports": [{"name": PORT_NAME, "port": ENGINE_PORT, "targetPort": PORT_NAME, "protocol": "TCP"}],
        },
    }


def build_tuning_configmap(name: str, namespace: str, spec: InferenceServiceSpec,
                           in_effect: EngineSettings) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(tuning_configmap_name(name), namespace, name),
        "data": tuning_configmap.configmap_data(in_effect, seed=EngineSettings.of(spec.engine), loras=lora_paths(spec)),
    }


def build_pdb(name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any] | None:
    """A PodDisruptionBudget keeping all but one pod through voluntary disruptions; None for one replica."""
    if spec.replicas <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(name, namespace, name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)}},
    }


def build_admin_secret(name: str, namespace: str, token: str) -> dict[str, Any]:
    if not re.fullmatch(r"[A-Za-z0-9_\-]{32,}", token):
        raise ValueError("admin token must be at least 32 URL-safe characters")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(admin_secret_name(name), namespace, name),
        "type": "Opaque",
        "stringData": {ADMIN_TOKEN_KEY: token},
    }


def admin_token(secret: dict[str, Any] | None) -> str | None:
    """The token in an admin Secret as read back from the API server; None when it is missing."""
    encoded = ((secret or {}).get("data") or {}).get(ADMIN_TOKEN_KEY)
    return base64.b64decode(encoded).decode() if encoded else None


@dataclass(frozen=True)
class Children:
    """Everything one reconcile applies (the admin Secret is ensured separately: it is created once)."""

    configmap: dict[str, Any]
    deployment: dict[str, Any]
    service: dict[str, Any]
    pdb: dict[str, Any] | None


def build_children(name: str, namespace: str, spec: InferenceServiceSpec, in_effect: EngineSettings,
                   settings: OperatorSettings) -> Children:
    return Children(
        configmap=build_tuning_configmap(name, namespace, spec, in_effect),
        deployment=build_deployment(name, namespace, spec, in_effect, settings),
        service=build_service(name, namespace),
        pdb=build_pdb(name, namespace, spec),
    )
