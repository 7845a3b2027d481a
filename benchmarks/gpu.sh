#!/usr/bin/env bash
# GPU checks for kvpilot's Triton kernels, one command, no installs (budget: under 8 minutes on an H200):
#   1. the kernel tests on CUDA in bfloat16 at real shapes (KVPILOT_TEST_DEVICE=cuda pytest tests/kernels)
#   2. decode attention vs torch SDPA, batch 1-256 x context 512-32k, Llama-3-8B heads: achieved HBM
#      bandwidth as a fraction of peak (benchmarks/gpu_attention.py)
#   3. decode tokens/s of a Llama-3-8B-shaped random model vs its bandwidth roofline (benchmarks/gpu_decode.py)
#
# Usage: benchmarks/gpu.sh [--smoke]
#   --smoke   the same stages on the CPU under TRITON_INTERPRET=1 at tiny sizes (checks the code paths)
# Environment: OUT=<dir> also writes gpu_attention.{json,md}, gpu_decode.{json,md} and tests.log there;
#   PYTHON (default python3); KVPILOT_PEAK_BW_TBS overrides the peak bandwidth (TB/s) taken from the GPU name.
# Every stage runs under a time limit; any failure is reported at the end and makes the exit status 1.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-}
SMOKE=0
for arg in "$@"; do
  case "$arg" in
    --smoke) SMOKE=1 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown argument '$arg' (expected --smoke)" >&2; exit 2 ;;
  esac
done
[ -n "$OUT_DIR" ] && mkdir -p "$OUT_DIR"

# The GPU machine runs the working tree as is: when kvpilot is not installed, expose the component
# folders as kvpilot.* through a folder of symlinks (what pyproject's package-dir mapping does).
# PYTHONSAFEPATH keeps the repository root (and its partial kvpilot/ folder) off sys.path.
if ! PYTHONSAFEPATH=1 "$PY" -c "import kvpilot.kernels, kvpilot.engine" 2>/dev/null; then
  SHIM=$(mktemp -d)
  mkdir "$SHIM/kvpilot"
  for entry in "$REPO"/kvpilot/*; do ln -s "$entry" "$SHIM/kvpilot/"; done
  for component in engine kernels operator localcluster; do ln -s "$REPO/$component" "$SHIM/kvpilot/$component"; done
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1
  "$PY" -c "import kvpilot.kernels, kvpilot.engine" || { echo "gpu.sh: cannot import kvpilot from $REPO" >&2; exit 1; }
fi

"$PY" - <<'EOF'
import importlib.util, platform
import torch, triton
print(f"python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}, "
      f"cuda available: {torch.cuda.is_available()}"
      + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
missing = [m for m in ("pytest", "safetensors", "tokenizers", "transformers") if importlib.util.find_spec(m) is None]
if missing:
    print("not installed here:", ", ".join(missing))
EOF

FAILED=()
run_stage() {  # run_stage NAME SECONDS COMMAND...
  local name=$1 limit=$2 start rc
  shift 2
  echo
  echo "=== $name (limit ${limit}s) ==="
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  echo "=== $name: exit $rc after $(( $(date +%s) - start ))s ==="
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 124 ] && FAILED+=("$name (timed out after ${limit}s)") || FAILED+=("$name (exit $rc)")
  fi
}

if [ "$SMOKE" = 1 ]; then
  export TRITON_INTERPRET=1
  MODE=(--smoke)
  TEST_ENV=(env KVPILOT_TEST_DEVICE=cpu)
  TEST_LIMIT=600  # the interpreter on a shared CPU: slow, and not bound by a GPU budget
else
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "gpu.sh: no CUDA device; use --smoke for the CPU code-path check" >&2; exit 1; }
  MODE=()
  TEST_ENV=(env KVPILOT_TEST_DEVICE=cuda)
  TEST_LIMIT=180
fi

if "$PY" -c "import pytest" 2>/dev/null; then
  export TEST_LOG=${OUT_DIR:+$OUT_DIR/tests.log}
  run_stage "kernel tests" "$TEST_LIMIT" bash -c '"$@" 2>&1 | tee "${TEST_LOG:-/dev/null}"; exit "${PIPESTATUS[0]}"' _ \
    "${TEST_ENV[@]}" "$PY" -m pytest tests/kernels -q -p no:cacheprovider -rs
else
  echo "=== kernel tests: NOT RUN: pytest is not installed for $PY (the benchmarks still check every shape) ==="
  FAILED+=("kernel tests (pytest missing)")
fi
run_stage "decode attention benchmark" 150 "$PY" benchmarks/gpu_attention.py "${MODE[@]}" --sweep-budget-s 45 --out "$OUT_DIR"
run_stage "decode throughput benchmark" 100 "$PY" benchmarks/gpu_decode.py "${MODE[@]}" --out "$OUT_DIR"

echo
if [ "${#FAILED[@]}" -gt 0 ]; then
  printf 'gpu.sh: FAILED: %s\n' "${FAILED[@]}"
  exit 1
fi
echo "gpu.sh: all stages passed${OUT_DIR:+; results in $OUT_DIR}"
