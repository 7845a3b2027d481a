"""Builds the control plane's binaries from the pinned Go modules in localcluster/go.

Binaries land in ``$KVPILOT_CACHE/bin/<key>/``, where the key names the pinned
versions and hashes everything that changes the output (go.mod, go.sum, the Go
version, the link flags), so a machine builds each pinned set once and a pin
change never reuses stale binaries. Go's own build and module caches (outside
the repo by default) make a rebuild after a pin change incremental.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

GO_DIR = Path(__file__).resolve().parent / "go"
HELM_DIR = GO_DIR / "helm"


class BuildError(RuntimeError):
    """A component could not be built; the message names it and says why."""


@dataclass(frozen=True)
class Component:
    name: str
    module_dir: Path
    package: str  # what `go build` is given, from module_dir
    pinned_module: str  # the module whose version this binary carries


COMPONENTS = (
    Component("etcd", GO_DIR, "./cmd/etcd", "go.etcd.io/etcd/server/v3"),
    Component("kube-apiserver", GO_DIR, "k8s.io/kubernetes/cmd/kube-apiserver", "k8s.io/kubernetes"),
    Component(
        "kube-controller-manager",
        GO_DIR,
        "k8s.io/kubernetes/cmd/kube-controller-manager",
        "k8s.io/kubernetes",
    ),
    Component("kube-scheduler", GO_DIR, "k8s.io/kubernetes/cmd/kube-scheduler", "k8s.io/kubernetes"),
    Component("kubectl", GO_DIR, "k8s.io/kubernetes/cmd/kubectl", "k8s.io/kubernetes"),
    Component("helm", HELM_DIR, "helm.sh/helm/v3/cmd/helm", "helm.sh/helm/v3"),
)
COMPONENT_NAMES = tuple(c.name for c in COMPONENTS)


def cache_root() -> Path:
    return Path(os.environ.get("KVPILOT_CACHE") or Path.home() / ".cache" / "kvpilot")


def pinned_version(module_dir: Path, module: str) -> str:
    """The version go.mod in ``module_dir`` requires for ``module``."""
    text = (module_dir / "go.mod").read_text()
    if re.search(rf"^module\s+{re.escape(module)}\s*$", text, re.MULTILINE):
        return "v0.0.0-local"  # the module itself: its source is here, not pinned
    match = re.search(rf"^\s*(?:require\s+)?{re.escape(module)}\s+(v\S+)", text, re.MULTILINE)
    if match is None:
        raise BuildError(f"{module_dir / 'go.mod'} does not require {module}")
    return match.group(1)


def _ldflags(component: Component) -> str:
    flags = ["-s", "-w"]  # no symbol tables: the binaries shrink by about a third
    version = pinned_version(component.module_dir, component.pinned_module)
    if component.pinned_module == "k8s.io/kubernetes":
        # Unset, every component reports v0.0.0-master, which breaks `kubectl version`
        # and helm's kubeVersion checks; set both places Kubernetes' own build sets.
        major, minor = version.lstrip("v").split(".")[:2]
        for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
            flags += [
                f"-X {pkg}.gitVersion={version}",
                f"-X {pkg}.gitMajor={major}",
                f"-X {pkg}.gitMinor={minor}",
                f"-X {pkg}.gitTreeState=clean",
            ]
    elif component.name == "helm":
        flags.append(f"-X helm.sh/helm/v3/internal/version.version={version}")
    return " ".join(flags)


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        raise BuildError(
            "the Go toolchain is not on PATH: it is needed to build "
            + ", ".join(COMPONENT_NAMES)
            + " (install Go >= 1.26, e.g. from your distribution or go.dev, then re-run "
            "`kvpilot local-cluster build`)"
        )
    return go


def _go_version(go: str) -> str:
    result = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BuildError(f"`go env GOVERSION` failed: {result.stderr.strip()}")
    return result.stdout.strip()


def build_key(go_version: str | None = None) -> str:
    """Names the pinned versions; the hash covers everything else that shapes the binaries."""
    digest = hashlib.sha256()
    for module_dir in (GO_DIR, HELM_DIR):
        for name in ("go.mod", "go.sum"):
            path = module_dir / name
            digest.update(path.read_bytes() if path.exists() else b"")
    for component in COMPONENTS:
        digest.update(_ldflags(component).encode())
    if go_version is None:
        go = shutil.which("go")
        go_version = _go_version(go) if go else "no-go"
    digest.update(go_version.encode())
    k8s = pinned_version(GO_DIR, "k8s.io/kubernetes")
    etcd = pinned_version(GO_DIR, "go.etcd.io/etcd/server/v3")
    helm = pinned_version(HELM_DIR, "helm.sh/helm/v3")
    return f"k8s-{k8s}_etcd-{etcd}_helm-{helm}_{digest.hexdigest()[:10]}"


def bin_dir() -> Path:
    return cache_root() / "bin" / build_key()


def missing_binaries(directory: Path) -> list[str]:
    return [name for name in COMPONENT_NAMES if not os.access(directory / name, os.X_OK)]


def build(log=sys.stderr) -> Path:
    """Builds every missing binary; returns the bin dir. A no-op when all exist."""
    go = _go()
    target = cache_root() / "bin" / build_key(_go_version(go))
    missing = missing_binaries(target)
    if not missing:
        print(f"build: all components up to date in {target}", file=log)
        return target
    target.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("GOFLAGS", "-mod=readonly")
    for component in COMPONENTS:
        if component.name not in missing:
            continue
        version = pinned_version(component.module_dir, component.pinned_module)
        print(
            f"build: {component.name} ({component.pinned_module} {version}) ...",
            file=log,
            flush=True,
        )
        started = time.monotonic()
        partial = target / f".{component.name}.partial"
        command = [
            go, "build", "-p", str(max(1, os.cpu_count() or 1)), "-trimpath",
            f"-ldflags={_ldflags(component)}", "-o", str(partial), component.package,
        ]  # fmt: skip
        result = subprocess.run(
            command,
            cwd=component.module_dir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            tail = "\n".join(result.stdout.strip().splitlines()[-25:])
            raise BuildError(
                f"building {component.name} from {component.package} "
                f"(in {component.module_dir}) failed with exit code {result.returncode}:\n{tail}"
            )
        partial.rename(target / component.name)  # atomic: a half-built binary never looks built
        print(f"build: {component.name} done in {time.monotonic() - started:.0f}s", file=log)
    return target
