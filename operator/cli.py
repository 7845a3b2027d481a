"""The operator's subcommands of ``kvpilot``: ``operator`` (run it) and ``crd`` (print the CRD).

Only argparse is imported at load time; kopf and the Kubernetes client load
inside the handlers.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvpilot.kube_contract import watched_namespaces


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_operator(subparsers)
    _register_crd(subparsers)


def _register_operator(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "operator",
        help="run the kvpilot Kubernetes operator",
        description=(
            "Run the kvpilot operator: it turns InferenceService resources into engine Deployments, "
            "Services, ConfigMaps and PodDisruptionBudgets, and reports their status. Works in a pod "
            "(service account) and from a laptop (kubeconfig). Settings come from KVPILOT_* environment "
            "variables; flags override them."
        ),
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=None, metavar="NS",
                       help="watch this namespace (repeatable); default: $KVPILOT_NAMESPACES "
                            "(comma-separated), else the pod's own namespace in a cluster")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="watch every namespace (needs the chart's cluster-wide RBAC)")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, else $KUBECONFIG)")
    parser.add_argument("--context", default=None, help="kubeconfig context to use")
    parser.add_argument("--health-port", type=int, default=None,
                        help="port of the /healthz endpoint, 0 to disable (default: $KVPILOT_HEALTH_PORT or 8080)")
    parser.add_argument("--engine-image", default=None,
                        help="engine image for services that name none (default: $KVPILOT_ENGINE_IMAGE)")
    parser.add_argument("--resync-seconds", type=float, default=None,
                        help="seconds between full reconciles of each service (default: $KVPILOT_RESYNC_SECONDS or 30)")
    parser.add_argument("--log-level", default=None, choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="log level (default: $KVPILOT_LOG_LEVEL or INFO)")
    parser.set_defaults(func=_run_operator)


def _register_crd(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "crd", help="print the InferenceService CRD (YAML)",
        description="Print the InferenceService CustomResourceDefinition, generated from the operator's models. "
                    "Pipe it to `kubectl apply -f -`.",
    )
    parser.set_defaults(func=_print_crd)


def _print_crd(args: argparse.Namespace) -> int:
    from kvpilot.operator.crd import render_crd

    sys.stdout.write(render_crd())
    return 0




def _run_operator(args: argparse.Namespace) -> int:
    import dataclasses

    from kvpilot.operator.settings import OperatorSettings, SettingsError

    try:
        settings = OperatorSettings.from_env()
    except SettingsError as exc:
        raise SystemExit(f"kvpilot operator: {exc}") from None
    overrides = {
        "health_port": args.health_port,
        "engine_image": args.engine_image,
        "resync_seconds": args.resync_seconds,
        "log_level": args.log_level,
    }
    settings = dataclasses.replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    namespaces = watched_namespaces(args.all_namespaces, args.namespace, os.environ, "kvpilot operator")

    from kvpilot.operator.runner import run_operator

    return run_operator(settings, namespaces=namespaces, kubeconfig=args.kubeconfig, context=args.context)
