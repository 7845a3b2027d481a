"""What a container process gets: its environment, its volumes, its command line.

Kubernetes semantics where a host process can honour them:

- env: a minimal base (PATH with this Python's bin dir first, so ``kvpilot`` and
  ``python`` resolve to the host environment standing in for the image; HOME,
  locale; every ``KVPILOT_*`` variable of the kubelet), the service variables
  KUBERNETES_SERVICE_HOST/PORT of the real API server, then the pod's ``envFrom``
  and ``env`` in order, with ``valueFrom`` resolved (fieldRef incl.
  status.podIP, resourceFieldRef, secretKeyRef, configMapKeyRef) and ``$(VAR)``
  expanded against what came before. Every process also gets KVPILOT_POD_IP,
  KVPILOT_POD_NAME and KVPILOT_POD_NAMESPACE. A container must listen on its pod
  IP: take it from a ``fieldRef: status.podIP`` variable or KVPILOT_POD_IP.
- volumes: materialized under the pod's folder (emptyDir, configMap, secret,
  downwardAPI, projected incl. service-account tokens); hostPath is the host
  path; a persistentVolumeClaim is a folder per claim that outlives pods. A
  process cannot see a volume at its mountPath, so every command, arg and env
  value that starts with a mountPath is rewritten to the host folder, and the
  folder is also given as KVPILOT_VOLUME_<NAME> (name upper-cased, ``-`` → ``_``).
- service account: when the pod has a token volume, KUBECONFIG points at a
  kubeconfig holding the pod's own token (clients fall back to it when
  in-cluster config is absent), so pods act with their RBAC, as in a cluster.
"""

from __future__ import annotations

import base64
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.localcluster.api import ApiError, KubeApi
from kvpilot.localcluster.kubeconfig import write_token_kubeconfig
from kvpilot.localcluster.nodes import CAPACITY

# The host's base, and the instruction sets torch and oneDNN may use (scripts/as-avx2.sh sets them).
BASE_ENV_NAMES = ("HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


class ContainerConfigError(RuntimeError):
    """The pod references something that cannot be resolved (kubelet: CreateContainerConfigError)."""


@dataclass(frozen=True)
class PodContext:
    """What the kubelet knows about the pod beyond its spec."""

    pod: dict[str, Any]
    pod_ip: str
    folder: Path  # the pod's own folder: logs, volumes
    pvc_root: Path
    api: KubeApi
    apiserver_port: int
    ca_file: Path

    @property
    def namespace(self) -> str:
        return self.pod["metadata"]["namespace"]


def volume_env_name(volume: str) -> str:
    return "KVPILOT_VOLUME_" + re.sub(r"[^A-Za-z0-9]", "_", volume).upper()


def _get(api: KubeApi, kind: str, namespace: str, name: str) -> dict | None:
    return api.get(f"/api/v1/namespaces/{namespace}/{kind}/{name}", ok_missing=True)


def _config_data(ctx: PodContext, kind: str, name: str, optional: bool) -> dict[str, bytes] | None:
    """A configmap's or secret's data as bytes; None when missing and optional."""
    obj = _get(ctx.api, kind, ctx.namespace, name)
    if obj is None:
        if optional:
            return None
        singular = "configmap" if kind == "configmaps" else "secret"
        raise ContainerConfigError(f'{singular} "{name}" not found')
    if kind == "secrets":
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return data


_FIELD_LABEL = re.compile(r"metadata\.(labels|annotations)\['(.+)'\]")


def field_value(ctx: PodContext, field_path: str) -> str:
    meta, spec = ctx.pod["metadata"], ctx.pod["spec"]
    simple = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": ctx.pod_ip,
        "status.podIPs": ctx.pod_ip,
        "status.hostIP": "127.0.0.1",
        "status.hostIPs": "127.0.0.1",
    }
    if field_path in simple:
        return simple[field_path]
    match = _FIELD_LABEL.fullmatch(field_path)
    if match:
        return (meta.get(match.group(1)) or {}).get(match.group(2), "")
    if field_path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(field_path.split(".")[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    raise ContainerConfigError(f"unsupported fieldRef fieldPath {field_path!r}")


def resource_value(ctx: PodContext, container: dict, ref: dict) -> str:
    """limits → requests → node capacity, as kubelet falls back to allocatable; divisor ignored."""
    target = next(
        (c for c in ctx.pod["spec"]["containers"] if c["name"] == ref.get("containerName")), container
    )
    kind, _, resource = ref["resource"].partition(".")
    resources = target.get("resources") or {}
    value = (resources.get(kind) or {}).get(resource) or (resources.get("limits") or {}).get(resource)
    return str(value or CAPACITY.get(resource, "0"))


_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined vars replaced, $$ escapes, unknown refs kept."""

    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _VAR_REF.sub(replace, text)


def container_env(ctx: PodContext, container: dict, volume_dirs: dict[str, Path],
                  kubeconfig: Path | None, *, host_process: bool = True) -> dict[str, str]:  # fmt: skip
    """The container's environment. A host process (process mode) also gets the host's base and the
    stand-ins for what it cannot see (PATH to this Python, KUBECONFIG, KVPILOT_VOLUME_*); a container
    run from its image (podman.py) gets what a kubelet sets and the image's own."""
    meta = ctx.pod["metadata"]
    env = {"HOSTNAME": meta["name"]}
    if host_process:
        python_bin = str(Path(sys.executable).parent)
        env["PATH"] = python_bin + os.pathsep + os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        for name in BASE_ENV_NAMES:
            if name in os.environ:
                env[name] = os.environ[name]
        env.update({k: v for k, v in os.environ.items() if k.startswith("KVPILOT_")})
    env.update(
        {
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(ctx.apiserver_port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(ctx.apiserver_port),
            "KUBERNETES_PORT": f"tcp://127.0.0.1:{ctx.apiserver_port}",
            "KVPILOT_POD_IP": ctx.pod_ip,
            "KVPILOT_POD_NAME": meta["name"],
            "KVPILOT_POD_NAMESPACE": meta["namespace"],
        }
    )
    if host_process:
        if kubeconfig is not None:
            env["KUBECONFIG"] = str(kubeconfig)
        for volume, folder in volume_dirs.items():
            env[volume_env_name(volume)] = str(folder)

    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, key in (("configmaps", "configMapRef"), ("secrets", "secretRef")):
            if key in source:
                ref = source[key]
                data = _config_data(ctx, kind, ref["name"], ref.get("optional", False)) or {}
                env.update({prefix + k: v.decode(errors="replace") for k, v in data.items()})
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[name] = field_value(ctx, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            env[name] = resource_value(ctx, container, source["resourceFieldRef"])
        else:
            kind, key = (
                ("secrets", "secretKeyRef") if "secretKeyRef" in source else ("configmaps", "configMapKeyRef")
            )
            ref = source[key]
            data = _config_data(ctx, kind, ref["name"], ref.get("optional", False))
            if data is None:
                continue
            if ref["key"] not in data:
                if ref.get("optional", False):
                    continue
                raise ContainerConfigError(f"couldn't find key {ref['key']} in {kind[:-1]} {ref['name']}")
            env[name] = data[ref["key"]].decode(errors="replace")
    return env


def _write_items(folder: Path, data: dict[str, bytes], items: list[dict] | None) -> None:
    chosen = {i["key"]: i.get("path", i["key"]) for i in items} if items else {k: k for k in data}
    for key, rel in chosen.items():
        if key in data:
            target = folder / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data[key])


def _service_account_token(ctx: PodContext, audience: str | None, seconds: int) -> str:
    meta = ctx.pod["metadata"]
    account = ctx.pod["spec"].get("serviceAccountName") or "default"
    spec: dict[str, Any] = {
        "expirationSeconds": seconds,
        "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]},
    }
    if audience:
        spec["audiences"] = [audience]
    try:
        response = ctx.api.request(
            "POST",
            f"/api/v1/namespaces/{ctx.namespace}/serviceaccounts/{account}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
    except ApiError as exc:
        raise ContainerConfigError(f"service account token for {account}: {exc}") from exc
    return response["status"]["token"]


def _projected(ctx: PodContext, folder: Path, sources: list[dict]) -> str | None:
    """Writes a projected volume; returns the service-account token if one was projected."""
    token = None
    for source in sources:
        if "serviceAccountToken" in source:
            sat = source["serviceAccountToken"]
            token = _service_account_token(ctx, sat.get("audience"), sat.get("expirationSeconds", 3607))
            (folder / sat["path"]).write_text(token)
        elif "configMap" in source or "secret" in source:
            kind, key = ("configmaps", "configMap") if "configMap" in source else ("secrets", "secret")
            ref = source[key]
            data = _config_data(ctx, kind, ref["name"], ref.get("optional", False))
            if data is not None:
                _write_items(folder, data, ref.get("items"))
        elif "downwardAPI" in source:
            _downward(ctx, folder, source["downwardAPI"].get("items") or [])
    return token


def _downward(ctx: PodContext, folder: Path, items: list[dict]) -> None:
    for item in items:
        if "fieldRef" in item:
            (folder / item["path"]).write_text(field_value(ctx, item["fieldRef"]["fieldPath"]))


def materialize_volumes(ctx: PodContext) -> tuple[dict[str, Path], Path | None]:
    """Creates the pod's volumes; returns {volume name: host folder} and a token kubeconfig if any."""
    dirs: dict[str, Path] = {}
    kubeconfig = None
    for volume in ctx.pod["spec"].get("volumes") or []:
        name = volume["name"]
        folder = ctx.folder / "volumes" / name
        if "hostPath" in volume:
            host = Path(volume["hostPath"]["path"])
            if volume["hostPath"].get("type") == "DirectoryOrCreate":
                host.mkdir(parents=True, exist_ok=True)
            dirs[name] = host
            continue
        if "persistentVolumeClaim" in volume:
            claim = ctx.pvc_root / ctx.namespace / volume["persistentVolumeClaim"]["claimName"]
            claim.mkdir(parents=True, exist_ok=True)
            dirs[name] = claim
            continue
        folder.mkdir(parents=True, exist_ok=True)
        dirs[name] = folder
        if "configMap" in volume or "secret" in volume:
            kind, key = ("configmaps", "configMap") if "configMap" in volume else ("secrets", "secret")
            ref = volume[key]
            data = _config_data(
                ctx, kind, ref.get("name") or ref.get("secretName"), ref.get("optional", False)
            )
            if data is not None:
                _write_items(folder, data, ref.get("items"))
        elif "projected" in volume:
            token = _projected(ctx, folder, volume["projected"].get("sources") or [])
            if token is not None and kubeconfig is None:
                kubeconfig = ctx.folder / "kubeconfig"
                write_token_kubeconfig(
                    kubeconfig, f"https://127.0.0.1:{ctx.apiserver_port}", ctx.ca_file, token, ctx.namespace
                )
        elif "downwardAPI" in volume:
            _downward(ctx, folder, volume["downwardAPI"].get("items") or [])
        else:  # emptyDir and anything else: the empty folder is the volume, writable by any user
            folder.chmod(0o777)
    return dirs, kubeconfig


def volume_mounts(container: dict, volume_dirs: dict[str, Path]) -> list[tuple[str, str, bool]]:
    """(mountPath, host path, read-only) for the container's mounts, longest mountPath first."""
    mounts = []
    for mount in container.get("volumeMounts") or []:
        host = volume_dirs.get(mount["name"])
        if host is None:
            raise ContainerConfigError(
                f"volumeMount {mount['mountPath']} names unknown volume {mount['name']}"
            )
        if mount.get("subPath"):
            host = host / mount["subPath"]
        mounts.append((mount["mountPath"].rstrip("/") or "/", str(host), bool(mount.get("readOnly"))))
    return sorted(mounts, key=lambda m: len(m[0]), reverse=True)


def mount_map(container: dict, volume_dirs: dict[str, Path]) -> list[tuple[str, str]]:
    """(mountPath, host path) for the container's mounts, longest mountPath first."""
    return [(path, host) for path, host, _ in volume_mounts(container, volume_dirs)]


def rewrite_paths(text: str, mounts: list[tuple[str, str]]) -> str:
    """Maps a mountPath at the start of ``text``, after '=' or inside a JSON string (an argument like
    ``--speculative-config {"model": "/mnt/draft-model"}``) onto its host folder."""
    if not mounts:
        return text
    # One pass, longest mountPath first: a path already rewritten (e.g. a hostPath under /tmp)
    # must not be rewritten again by a shorter mount (an emptyDir at /tmp).
    hosts = dict(mounts)
    pattern = re.compile(r"(^|=|\")(" + "|".join(re.escape(p) for p, _ in mounts) + r")(?=/|$|\")")
    return pattern.sub(lambda m: m.group(1) + hosts[m.group(2)], text)
