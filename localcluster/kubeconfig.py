"""Kubeconfig files for the local cluster's clients, with certificates embedded."""

from __future__ import annotations

import base64
from pathlib import Path

import yaml

CONTEXT = "kvpilot-local"


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(path: Path, server: str, pki: Path, client_stem: str) -> None:
    """Writes a kubeconfig that reaches ``server`` as the client ``pki/<client_stem>.crt``."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": CONTEXT,
                "cluster": {
                    "server": server,
                    "certificate-authority-data": _b64(pki / "ca.crt"),
                },
            }
        ],
        "users": [
            {
                "name": client_stem,
                "user": {
                    "client-certificate-data": _b64(pki / f"{client_stem}.crt"),
                    "client-key-data": _b64(pki / f"{client_stem}.key"),
                },
            }
        ],
        "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": client_stem}}],
        "current-context": CONTEXT,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(config, sort_keys=False))
    tmp.chmod(0o600)
    tmp.replace(path)


def write_token_kubeconfig(path: Path, server: str, ca: Path, token: str, namespace: str) -> None:
    """A kubeconfig for a pod's service account, standing in for in-cluster config."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": CONTEXT, "cluster": {"server": server, "certificate-authority-data": _b64(ca)}}
        ],
        "users": [{"name": "serviceaccount", "user": {"token": token}}],
        "contexts": [
            {
                "name": CONTEXT,
                "context": {"cluster": CONTEXT, "user": "serviceaccount", "namespace": namespace},
            }
        ],
        "current-context": CONTEXT,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
