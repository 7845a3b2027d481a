#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and runs every test, end-to-end ones included.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/engine -x
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
exec python -m pytest "$@"
