"""Builds the CPU C kernels (kernels/cpu_*.c) on first use, and caches them.

A kernel is compiled with the system C compiler (``$CC``, default ``gcc``) for this machine's
CPU (``-march=native``, less any feature ``KVPILOT_CPU_FEATURES`` removes: cpu_features.py), with its shape constants as ``-D`` defines, and cached under
``$KVPILOT_KERNEL_CACHE`` (default ``~/.cache/kvpilot/kernels``), keyed by the sources (the C
file and the headers beside it), the defines, the compiler and the CPU's flags. Its OpenMP calls
bind to the runtime torch has already loaded (libgomp, or Intel OpenMP under `kvpilot serve`),
so kernels and torch's own operators share one thread pool and one thread count.

A new pod has no cached kernels, and compiling them one by one where each is first called put
~1.5 s of gcc (2 cores) on its start's critical path. ``load_in_background`` calls a kernel's (cached) loader
on one background thread instead, early in the start-up, beside the weights' load; the build of
a library holds a lock, so a caller that needs it meanwhile waits for that build instead of
starting a second.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from kvpilot.kernels import cpu_features

# cpu_elem.h's element types, chosen with -DDTYPE.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
# Linked without -ffast-math: GCC before 13 links crtfastmath.o into a -ffast-math shared library,
# and loading it would flush subnormal floats to zero in the whole process (torch and NumPy too).
LINK_FLAGS = ("-shared", "-fopenmp")
LIBS = ("-lm",)  # with libmvec: the vectorised expf that -ffast-math loops call


class KernelBuildError(RuntimeError):
    """A C kernel could not be compiled or loaded; the message says what to install or set."""


_background = ThreadPoolExecutor(1, thread_name_prefix="kernel-build")  # one gcc at a time beside the caller
_build_locks: defaultdict[Path, threading.Lock] = defaultdict(threading.Lock)
_build_locks_lock = threading.Lock()


def load_in_background(loader: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Call ``loader`` (a kernel's ``functools.cache``d loader) on the background build thread, so
    that its first call where the kernel is needed finds it compiled. A failure is left to that
    call, which builds again and reports it."""
    _background.submit(loader, *args, **kwargs)


def wait_for_background_builds() -> None:
    """Return when every load asked of ``load_in_background`` so far is done (tests that fake the
    CPU's features wait, so that no loader of the real features stores its result afterwards)."""
    _background.submit(lambda: None).result()


def load_library(source: Path, defines: dict[str, int]) -> ctypes.CDLL:
    """``source`` compiled with ``-DNAME=VALUE`` for each define (built once, then from the cache)."""
    compiler = os.environ.get("CC", "gcc")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise KernelBuildError(
            f"no working C compiler {compiler!r} for the CPU kernels ({exc}); "
            "install gcc (apt-get install gcc) or point $CC at one"
        ) from None
    features = cpu_features.detect()
    flags = [*COMPILE_FLAGS, *features.compile_flags(), *(f"-D{name}={value}" for name, value in defines.items())]
    sources = [source, *sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256(
        b"\0".join([*(s.read_bytes() for s in sources), version.encode(), " ".join(flags + [*LINK_FLAGS]).encode(),
                    cpu_features.cpu_flags_line().encode()])
    ).hexdigest()[:16]
    cache = Path(os.environ.get("KVPILOT_KERNEL_CACHE") or Path.home() / ".cache" / "kvpilot" / "kernels")
    library = cache / f"{source.stem}-{key}.so"
    with _build_locks_lock:
        build_lock = _build_locks[library]
    with build_lock:  # another thread of this process building it: wait for that build
        if not library.is_file():
            _compile(compiler, flags, source, cache, library)
    return ctypes.CDLL(str(library))


def _compile(compiler: str, flags: list[str], source: Path, cache: Path, library: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: concurrent engines never load a half-written file.
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so")
    os.close(fd)
    obj = tmp[:-3] + ".o"
    for step in ([compiler, *flags, "-c", "-o", obj, str(source)], [compiler, *LINK_FLAGS, "-o", tmp, obj, *LIBS]):
        build = subprocess.run(step, capture_output=True, text=True)
        if build.returncode != 0:
            for path in (tmp, obj):
                Path(path).unlink(missing_ok=True)
            raise KernelBuildError(f"compiling {source.name} with {compiler} failed:\n{build.stderr.strip()}")
    os.unlink(obj)
    os.replace(tmp, library)

