#!/usr/bin/env bash
# Sets up everything kvpilot needs, on a fresh machine or again on a used one:
#   - a Python virtualenv cached outside the repo ($KVPILOT_CACHE/venv), with
#     every dependency pinned by scripts/constraints.txt and this checkout
#     installed editable into it (a repeat run takes seconds);
#   - the local Kubernetes control plane's binaries, built once per machine from
#     the Go module proxy into $KVPILOT_CACHE/bin (see localcluster/).
# Source it (`. scripts/setup.sh`) to get the virtualenv on PATH.
set -euo pipefail

KVPILOT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export KVPILOT_CACHE="${KVPILOT_CACHE:-$HOME/.cache/kvpilot}"
KVPILOT_VENV="$KVPILOT_CACHE/venv"
PYTHON="${PYTHON:-python3.11}"

mkdir -p "$KVPILOT_CACHE"
if [[ ! -x "$KVPILOT_VENV/bin/python" ]]; then
    echo "setup: creating virtualenv $KVPILOT_VENV" >&2
    "$PYTHON" -m venv "$KVPILOT_VENV"
    "$KVPILOT_VENV/bin/pip" install --quiet --upgrade pip
fi
echo "setup: installing kvpilot[dev] into $KVPILOT_VENV" >&2
"$KVPILOT_VENV/bin/pip" install --quiet --disable-pip-version-check \
    -c "$KVPILOT_ROOT/scripts/constraints.txt" -e "$KVPILOT_ROOT[dev]"

export PATH="$KVPILOT_VENV/bin:$PATH"
export VIRTUAL_ENV="$KVPILOT_VENV"

if [[ -f "$KVPILOT_ROOT/localcluster/go/go.mod" ]]; then
    echo "setup: building the local control plane (cached in $KVPILOT_CACHE/bin)" >&2
    kvpilot local-cluster build
    export PATH="$(kvpilot local-cluster bin-dir):$PATH"
fi
