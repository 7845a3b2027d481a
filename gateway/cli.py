"""`kvpilot gateway`: the OpenAI-compatible front door of every InferenceService (argparse only at import)."""

from __future__ import annotations

import argparse

from kvpilot import gateway_contract as contract


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvpilot.gateway.settings import GatewaySettings

    defaults = GatewaySettings()
    parser = subparsers.add_parser(
        "gateway",
        help="run the OpenAI-compatible gateway in front of every InferenceService",
        description=(
            "One URL for every model: /v1/completions and /v1/chat/completions go to the InferenceService whose "
            "servedName is the request's `model`, to the Ready pod that already holds the prompt's prefix in its "
            "cache unless that pod carries more than its share of the load. Requests for a service at zero "
            "replicas wait while it wakes. Works in a pod (service account) and from a laptop (kubeconfig)."
        ),
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=None, metavar="NS",
                       help="route to InferenceServices in this namespace (repeatable); default: "
                            "$KVPILOT_NAMESPACES (comma-separated, * for all), else the pod's own namespace")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="route to InferenceServices in every namespace (needs cluster-wide read RBAC)")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, else $KUBECONFIG)")
    parser.add_argument("--context", default=None, help="kubeconfig context to use")
    parser.add_argument("--host", default=defaults.host, help=f"address to listen on (default {defaults.host})")
    parser.add_argument("--port", type=int, default=contract.GATEWAY_PORT,
                        help=f"port to listen on (default {contract.GATEWAY_PORT})")
    parser.add_argument("--prefix-chars", type=int, default=defaults.prefix_chars,
                        help="characters of the prompt that prefix affinity follows; 0 turns affinity off "
                             f"(default {defaults.prefix_chars})")
    parser.add_argument("--load-factor", type=float, default=defaults.load_factor,
                        help="a pod keeps its prefixes while its load is within this many times the mean "
                             f"(default {defaults.load_factor})")
    parser.add_argument("--scrape-interval", type=float, default=defaults.scrape_interval_seconds,
                        help=f"seconds between reads of the engines' load (default {defaults.scrape_interval_seconds:g})")
    parser.add_argument("--max-held-requests", type=int, default=defaults.max_held_requests,
                        help="requests per model that may wait for a Ready pod; more get 503 "
                             f"(default {defaults.max_held_requests})")
    parser.add_argument("--hold-timeout", type=float, default=defaults.hold_timeout_seconds,
                        help="seconds a request waits for a Ready pod before a 503 "
                             f"(default {defaults.hold_timeout_seconds:g})")
    parser.add_argument("--log-level", default=defaults.log_level, choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help=f"log level (default {defaults.log_level})")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import os

    from kvpilot.gateway.server import serve
    from kvpilot.gateway.settings import GatewaySettings
    from kvpilot.kube_contract import watched_namespaces

    try:
        settings = GatewaySettings(
            host=args.host, port=args.port, prefix_chars=args.prefix_chars, load_factor=args.load_factor,
            scrape_interval_seconds=args.scrape_interval, max_held_requests=args.max_held_requests,
            hold_timeout_seconds=args.hold_timeout, log_level=args.log_level,
        )
    except ValueError as exc:
        raise SystemExit(f"kvpilot gateway: {exc}") from None
    namespaces = watched_namespaces(args.all_namespaces, args.namespace, os.environ, "kvpilot gateway")
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(settings, namespaces, args.kubeconfig, args.context))
    return 0
