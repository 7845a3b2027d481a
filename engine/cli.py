"""The engine's subcommands of ``kvpilot``: ``make-model`` and ``serve``.

Only argparse is imported here; torch and the engine load inside the handlers.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_make_model(subparsers)
    _register_serve(subparsers)


def _register_make_model(subparsers: argparse._SubParsersAction) -> None:
    """`kvpilot make-model`: owned by engine/model_files.py."""


def _register_serve(subparsers: argparse._SubParsersAction) -> None:
    """`kvpilot serve`: owned by engine/server/."""
