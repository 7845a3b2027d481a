#!/usr/bin/env bash
# Runs a command as on a CPU with AVX2 but without AVX-512 or AVX-VNNI (an AMD EPYC before Zen 4),
# on a machine that has them: kvpilot's own choices and C kernels (KVPILOT_CPU_FEATURES: dtype auto
# is float32, the int8 kernel's AVX2 build), torch's vectorized kernels (ATEN_CPU_CAPABILITY) and
# oneDNN's (ONEDNN_MAX_CPU_ISA). Host-process pods of the local cluster inherit all three.
# It runs an AVX2 machine's code paths, not its clock, caches or memory: a benchmark run under it
# prints "emulated" with the CPU, and its numbers do not stand in for a real AVX2 machine's.
#   usage: scripts/as-avx2.sh COMMAND [ARGS...]   e.g. scripts/as-avx2.sh scripts/test.sh -m "not e2e"
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 COMMAND [ARGS...]" >&2; exit 2; }
grep -qw avx2 /proc/cpuinfo || { echo "$0: this CPU has no AVX2 to run as" >&2; exit 2; }
export KVPILOT_CPU_FEATURES="-avx512f,-avx_vnni${KVPILOT_CPU_FEATURES:+,$KVPILOT_CPU_FEATURES}"
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
exec "$@"
