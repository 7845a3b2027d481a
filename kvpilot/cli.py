"""The ``kvpilot`` command: one entry point, one subcommand per component.

Each component owns its subcommands in its own ``cli.py`` with a
``register(subparsers)`` function. Those modules import only argparse at load
time, so ``kvpilot --help`` stays fast and the operator's image never needs
torch; heavy imports happen inside the handlers.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvpilot import __version__

COMPONENT_CLIS = (
    "kvpilot.engine.cli",
    "kvpilot.operator.cli",
    "kvpilot.gateway.cli",
    "kvpilot.localcluster.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpilot",
        description="LLM inference on Kubernetes: engine, operator, gateway and local cluster.",
    )
    parser.add_argument("--version", action="version", version=f"kvpilot {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMPONENT_CLIS:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
