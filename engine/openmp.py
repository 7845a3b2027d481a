"""Intel's OpenMP runtime for the CPU server, loaded before torch.

torch's PyPI wheels run their CPU kernels on GNU libgomp. In `kvpilot serve` the engine's
OpenMP threads share the cores with the server's event loop thread (HTTP, SSE), and libgomp's
waiting threads keep their cores while the event loop needs one: measured on 2 cores, a step of
64 decodes costs the same under either runtime offline, but served over HTTP (64 streaming
clients, max_num_seqs 64) kvpilot delivered 1430 output tok/s on libgomp and 1790-1830 on Intel
OpenMP (docs/performance.md). vLLM's CPU guide preloads Intel OpenMP for the same reason.

Loading ``libiomp5.so`` (PyPI's ``intel-openmp``, installed beside kvpilot on x86-64) with
``RTLD_GLOBAL`` before torch is imported makes it the first provider of the OpenMP symbols, so
torch's kernels and kvpilot's C kernels run on it (it implements libgomp's ``GOMP_*`` entry
points). ``KVPILOT_OPENMP=gnu`` keeps libgomp.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

OPENMP_ENV = "KVPILOT_OPENMP"  # "intel" (default) or "gnu"
LIBRARY = "libiomp5.so"


def use_intel_openmp() -> str:
    """Load Intel OpenMP if it can still take effect; returns which runtime the process will use."""
    choice = os.environ.get(OPENMP_ENV, "intel")
    if choice not in ("intel", "gnu"):
        raise ValueError(f"{OPENMP_ENV} must be 'intel' or 'gnu', got {choice!r}")
    if choice == "gnu":
        return "gnu"
    if "torch" in sys.modules:
        return "gnu" if not _intel_loaded() else "intel"  # too late to choose: torch has bound its runtime
    library = Path(sys.prefix) / "lib" / LIBRARY
    if not library.is_file():
        logger.info("Intel OpenMP (%s) is not installed; CPU kernels use GNU libgomp", library)
        return "gnu"
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    return "intel"


def _intel_loaded() -> bool:
    try:
        return LIBRARY in Path("/proc/self/maps").read_text()
    except OSError:
        return False
