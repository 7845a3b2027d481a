#!/usr/bin/env bash
# Sets up everything kvpilot needs, on a fresh machine or again on a used one:
#   - a Python virtualenv cached outside the repo ($KVPILOT_CACHE/venv), with
#     every dependency pinned by scripts/constraints.txt and this checkout
#     installed editable into it (a repeat run takes seconds);
#   - a C compiler (gcc from Debian when none is installed): the CPU decode-attention
#     kernel is compiled on first use (kernels/cpu_paged_decode.py);
#   - the local Kubernetes control plane's binaries, built once per machine from
#     the Go module proxy into $KVPILOT_CACHE/bin (see localcluster/).
# Source it (`. scripts/setup.sh`) to get the virtualenv on PATH.
set -euo pipefail

KVPILOT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export KVPILOT_CACHE="${KVPILOT_CACHE:-$HOME/.cache/kvpilot}"
KVPILOT_VENV="$KVPILOT_CACHE/venv"
PYTHON="${PYTHON:-python3.11}"

mkdir -p "$KVPILOT_CACHE"
if ! command -v "${CC:-gcc}" >/dev/null; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "setup: installing gcc (the CPU attention kernel is compiled on first use)" >&2
        apt-get update -qq && apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null
    else
        echo "setup: no C compiler: install gcc (or set CC) for the fast CPU attention kernel" >&2
    fi
fi
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
