"""Which OpenMP runtime `kvpilot serve` runs torch on (engine/openmp.py), checked in fresh processes."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.engine.openmp import LIBRARY, OPENMP_ENV

# Loads the runtime as `kvpilot serve` does, then runs torch and the C decode kernel on 2 threads
# and checks them against plain references: the GOMP_* calls of both must land in that runtime.
PROBE = """
import sys
from kvpilot.engine.openmp import use_intel_openmp
print(use_intel_openmp())
import torch
torch.set_num_threads(2)
a, b = torch.randn(64, 96), torch.randn(96, 80)
assert torch.allclose(a @ b, (a.double() @ b.double()).float(), atol=1e-4)
from kvpilot.kernels import cpu_paged_decode
from kvpilot.kernels.paged_attention import paged_attention_reference
kv = torch.randn(2, 6, 16, 2, 32)
query = torch.randn(3, 4, 32)
tables = torch.tensor([[0, 1, 2], [3, 4, 0], [5, 0, 0]], dtype=torch.int32)
lens = torch.tensor([40, 20, 9], dtype=torch.int32)
out = torch.zeros_like(query)
cpu_paged_decode.paged_decode_attention(query, kv, tables, lens, torch.arange(3, dtype=torch.int32),
                                        torch.arange(3, dtype=torch.int32), 0.2, out)
expected = paged_attention_reference(query, kv, tables, lens, torch.arange(4, dtype=torch.int32), 0.2)
assert torch.allclose(out, expected, atol=1e-4), (out - expected).abs().max()
print("libiomp5" in open("/proc/self/maps").read())
"""


def _probe(env_value: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != OPENMP_ENV}
    if env_value is not None:
        env[OPENMP_ENV] = env_value
    result = subprocess.run([sys.executable, "-P", "-c", PROBE], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.mark.skipif(not (Path(sys.prefix) / "lib" / LIBRARY).is_file() or platform.machine() != "x86_64",
                    reason="intel-openmp is installed on x86-64 only")
def test_intel_openmp_is_loaded_before_torch_and_runs_torch_and_the_c_kernel():
    assert _probe(None) == ["intel", "True"]


def test_gnu_keeps_libgomp():
    assert _probe("gnu") == ["gnu", "False"]


def test_an_unknown_runtime_is_refused(monkeypatch):
    from kvpilot.engine.openmp import use_intel_openmp

    monkeypatch.setenv(OPENMP_ENV, "llvm")
    with pytest.raises(ValueError, match="KVPILOT_OPENMP must be 'intel' or 'gnu'"):
        use_intel_openmp()
