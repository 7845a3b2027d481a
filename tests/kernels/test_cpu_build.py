"""The C kernels' build: loading one must not change the process's floating-point behaviour, and
one asked for while it builds in the background is built once."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from kvpilot.kernels import cpu_fused_ops
from kvpilot.kernels.cpu_build import KernelBuildError, load_library

LOAD_EVERY_KERNEL = """
import sys, torch
from kvpilot.kernels import cpu_fused_ops, cpu_paged_decode, cpu_quant_matmul
assert cpu_fused_ops.load_ops(torch.float32) is not None
cpu_paged_decode.load_kernel(torch.float32, head_dim=64, num_kv_heads=2, group=2, block_size=16)
assert cpu_quant_matmul.load_kernel(torch.float32, bits=4, group_size=32) is not None
print(sys.float_info.min / 2 > 0, torch.tensor([1e-40]).mul(1.0).item() > 0)
"""


def test_loading_the_kernels_keeps_subnormal_floats():
    # -ffast-math shared libraries from GCC < 13 set flush-to-zero for the whole process on load.
    try:
        load_library(cpu_fused_ops.SOURCE, {"DTYPE": 0})
    except KernelBuildError as exc:
        pytest.skip(f"no C compiler: {exc}")
    done = subprocess.run([sys.executable, "-P", "-c", LOAD_EVERY_KERNEL], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]


def test_a_kernel_asked_for_while_it_builds_in_the_background_is_built_once(tmp_path, monkeypatch):
    from kvpilot.kernels import cpu_build

    monkeypatch.setenv("KVPILOT_KERNEL_CACHE", str(tmp_path))  # nothing cached: both calls need the build
    compiles = []
    started = threading.Event()

    def slow_compile(*args):  # the real build, slowed so that the second call comes while it runs
        compiles.append(args[-1])
        started.set()
        time.sleep(0.5)
        real_compile(*args)

    real_compile = cpu_build._compile
    monkeypatch.setattr(cpu_build, "_compile", slow_compile)
    defines = {"DTYPE": 0, "KVPILOT_TEST_BUILD": 1}  # a define of its own: a library no other test loads
    cpu_build.load_in_background(cpu_build.load_library, cpu_fused_ops.SOURCE, defines)
    assert started.wait(60), "the background build did not start"
    try:
        library = load_library(cpu_fused_ops.SOURCE, defines)
    except KernelBuildError as exc:
        pytest.skip(f"no C compiler: {exc}")
    assert library.kvpilot_add_rms_norm and len(compiles) == 1
