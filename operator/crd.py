"""Renders the InferenceService CRD from the pydantic models in ``spec.py``.

pydantic writes JSON Schema; Kubernetes wants a *structural* OpenAPI v3 schema:
no ``$ref``, no ``anyOf`` for optional fields (optional simply means "not
required"), no ``title``, and boolean ``exclusiveMinimum``. This module does
that translation, adds the printer columns and subresources, and writes the
result to crds/ and the Helm chart's crds/ (``python -m kvpilot.operator.crd --write``).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from kvpilot import kube_contract
from kvpilot.operator import spec

CRD_FILE_NAME = f"{kube_contract.GROUP}_{kube_contract.PLURAL}.yaml"
REPO_ROOT = Path(__file__).resolve().parent.parent
CRD_PATHS = (REPO_ROOT / "crds" / CRD_FILE_NAME, REPO_ROOT / "charts" / "kvpilot" / "crds" / CRD_FILE_NAME)
HEADER = "# Generated from kvpilot/operator/spec.py by `python -m kvpilot.operator.crd --write`. Do not edit.\n"

PRINTER_COLUMNS = (
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
     "description": "Every desired replica is ready."},
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.readyReplicas", "description": "Ready engine pods."},
    {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas", "description": "Desired engine pods.",
     "priority": 1},
    {"name": "MaxSeqs", "type": "integer", "jsonPath": ".status.engine.maxNumSeqs",
     "description": "maxNumSeqs in effect."},
    {"name": "Tok/s", "type": "number", "jsonPath": ".status.metrics.outputTokensPerSecond",
     "description": "Generated tokens per second over the last window."},
    {"name": "ITL P99", "type": "number", "jsonPath": ".status.metrics.itlP99Seconds",
     "description": "99th-percentile inter-token latency, seconds."},
    {"name": "TTFT P99", "type": "number", "jsonPath": ".status.metrics.ttftP99Seconds", "priority": 1,
     "description": "99th-percentile time to first token, seconds."},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "priority": 1,
     "description": "Pending, Progressing, Ready, Degraded or Stopped."},
    {"name": "URL", "type": "string", "jsonPath": ".status.url", "priority": 1,
     "description": "In-cluster base URL of the OpenAI-compatible API."},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)

# Keys pydantic emits that a structural schema does not take.
_DROPPED_KEYS = {"title", "additionalProperties", "$defs"}


def openapi_schema(model: type) -> dict[str, Any]:
    """The model's JSON Schema, rewritten as a Kubernetes structural schema."""
    schema = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(schema, schema.get("$defs", {}))


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = copy.deepcopy(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        # A field's own description and default win over the referenced model's.
        node = {**copy.deepcopy(target), **node}
    if "anyOf" in node:
        variants = [v for v in node.pop("anyOf") if v.get("type") != "null"]
        if node.get("x-kubernetes-int-or-string"):
            variants = []
        if len(variants) > 1:
            raise ValueError(f"cannot render a union as a structural schema: {variants}")
        if variants:
            node = {**_structural(variants[0], defs), **node}
    if "default" in node and node["default"] is None:
        del node["default"]  # None means "unset": leave the field out rather than default it to null
    if "exclusiveMinimum" in node and not isinstance(node["exclusiveMinimum"], bool):
        # JSON Schema's bound is a number; OpenAPI v3.0's is a flag on `minimum`.
        node["minimum"] = node.pop("exclusiveMinimum")
        node["exclusiveMinimum"] = True
    preserve = node.get("x-kubernetes-preserve-unknown-fields")
    if preserve:
        node["type"] = "object"
        node.pop("properties", None)
    # A dict[str, X] field is a map: its additionalProperties schema stays; `false` (closed models) goes.
    is_map = isinstance(node.get("additionalProperties"), dict) and not preserve
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "additionalProperties" and is_map:
            out[key] = _structural(value, defs)
        elif key in _DROPPED_KEYS:
            continue
        elif key == "properties":
            out[key] = {name: _structural(prop, defs) for name, prop in value.items()}
        elif key == "items":
            out[key] = _structural(value, defs)
        else:
            out[key] = value
    return _ordered(out)


_KEY_ORDER = ("description", "type", "format", "enum", "default", "minimum", "exclusiveMinimum", "maximum",
              "minLength", "maxLength", "maxItems", "required", "properties", "items")


def _written_by_the_operator(node: dict[str, Any]) -> dict[str, Any]:
    """A status schema: no defaults and no CEL rules, which are for what users write (status.engine
    shares its model with spec.engine)."""
    out = {k: v for k, v in node.items() if k not in ("default", "x-kubernetes-validations")}
    if "properties" in out:
        out["properties"] = {name: _written_by_the_operator(prop) for name, prop in out["properties"].items()}
    if isinstance(out.get("items"), dict):
        out["items"] = _written_by_the_operator(out["items"])
    return out


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    """Stable, readable key order: description first, nested fields after the scalar constraints."""
    ranked = sorted(node, key=lambda k: (_KEY_ORDER.index(k) if k in _KEY_ORDER else len(_KEY_ORDER), k))
    return {k: node[k] for k in ranked}


def build_crd() -> dict[str, Any]:
    root_schema = {
        "description": "An LLM served by kvpilot engine pods, tuned live against a latency SLO.",
        "type": "object",
        "required": ["spec"],
        "x-kubernetes-validations": [
            {"rule": spec.NAME_RULE.cel, "message": spec.NAME_RULE.message},
        ],
        "properties": {
            "apiVersion": {"type": "string", "description": "Versioned schema of this object: kvpilot.io/v1alpha1."},
            "kind": {"type": "string", "description": "InferenceService."},
            "metadata": {"type": "object"},
            "spec": openapi_schema(spec.InferenceServiceSpec),
            "status": _written_by_the_operator(openapi_schema(spec.InferenceServiceStatus)),
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{kube_contract.PLURAL}.{kube_contract.GROUP}",
            "labels": {"app.kubernetes.io/name": "kvpilot", "app.kubernetes.io/part-of": "kvpilot"},
        },
        "spec": {
            "group": kube_contract.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kube_contract.KIND,
                "listKind": f"{kube_contract.KIND}List",
                "plural": kube_contract.PLURAL,
                "singular": spec.SINGULAR,
                "shortNames": list(spec.SHORT_NAMES),
                "categories": ["kvpilot", "all"],
            },
            "versions": [
                {
                    "name": kube_contract.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root_schema},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [dict(c) for c in PRINTER_COLUMNS],
                }
            ],
        },
    }


def render_crd() -> str:
    return HEADER + yaml.safe_dump(build_crd(), sort_keys=False, width=120, allow_unicode=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print or write the InferenceService CRD.")
    parser.add_argument("--write", action="store_true", help=f"write {', '.join(str(p) for p in CRD_PATHS)}")
    args = parser.parse_args(argv)
    text = render_crd()
    if not args.write:
        sys.stdout.write(text)
        return 0
    for path in CRD_PATHS:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
