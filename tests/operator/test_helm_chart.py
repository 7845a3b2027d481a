"""The Helm chart: every value documented, CRDs in sync, `helm lint` clean, RBAC as narrow as promised."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvpilot.operator import crd

CHART = crd.REPO_ROOT / "charts" / "kvpilot"
# `helm template` renders for a pretend cluster; the chart requires a recent one.
KUBE_VERSION = ("--kube-version", "1.37.2")


def _helm() -> str:
    from kvpilot.localcluster.build import BuildError, bin_dir

    try:
        candidate = bin_dir() / "helm"
    except BuildError:
        candidate = None
    if candidate is not None and candidate.exists():
        return str(candidate)
    found = shutil.which("helm")
    if found is None:
        pytest.skip("helm is not built yet: run `kvpilot local-cluster build` (scripts/setup.sh does)")
    return found


def _undocumented_keys(text: str) -> list[str]:
    """helm-docs' rule: a key is documented by a `# --` comment above it, or by a documented ancestor."""
    missing = []
    open_keys: list[tuple[int, bool]] = []  # (indent, documented) of the keys enclosing this line
    comment_pending = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            comment_pending = True
            continue
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if not match:
            continue
        indent = len(match.group(1))
        open_keys = [(i, doc) for i, doc in open_keys if i < indent]
        documented = comment_pending or any(doc for _, doc in open_keys)
        has_inline_value = bool(line.split(":", 1)[1].split("#", 1)[0].strip())
        if not documented and has_inline_value:  # a bare parent is documented through its children
            missing.append(match.group(2))
        open_keys.append((indent, documented))
        comment_pending = False
    return missing


def test_every_value_has_a_doc_comment():
    assert _undocumented_keys((CHART / "values.yaml").read_text()) == []


def test_doc_check_catches_an_undocumented_value():
    assert _undocumented_keys("# -- documented\na: 1\nb: 2\nc:\n  d: 3\n# -- whole map\ne:\n  f: 4\n") == ["b", "d"]


def test_chart_crd_is_the_generated_one():
    assert (CHART / "crds" / crd.CRD_FILE_NAME).read_text() == crd.render_crd()


def test_helm_lint_is_clean():
    helm = _helm()
    for scope in ("cluster", "namespaced"):
        result = subprocess.run([helm, "lint", "--strict", str(CHART), "--set", f"rbac.scope={scope}"],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def _render(*sets: str) -> list[dict]:
    result = subprocess.run([_helm(), "template", "kv", str(CHART), "--namespace", "kvpilot-system", *KUBE_VERSION, *sets],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_cluster_scope_renders_a_cluster_role_and_watches_everything():
    docs = _render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "ServiceAccount"]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVPILOT_NAMESPACES"] == "*" and container["args"] == ["operator"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_namespaced_scope_renders_a_role_per_namespace():
    docs = _render("--set", "rbac.scope=namespaced", "--set", "rbac.watchNamespaces={ml,research}")
    roles = [d for d in docs if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml", "research"]
    assert not [d for d in docs if d["kind"].startswith("Cluster")]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KVPILOT_NAMESPACES"] == "ml,research"


def test_rbac_grants_no_wildcards_and_no_secret_reads_beyond_get():
    role = next(d for d in _render() if d["kind"] == "ClusterRole")
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
        if "secrets" in rule["resources"]:
            assert set(rule["verbs"]) == {"get", "create"}


def test_bad_scope_fails_with_a_message():
    result = subprocess.run([_helm(), "template", "kv", str(CHART), *KUBE_VERSION, "--set", "rbac.scope=everything"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "rbac.scope must be cluster or namespaced" in result.stderr
