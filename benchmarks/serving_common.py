"""What the serving benchmarks (serving.py, tuning.py, autoscaling.py) share.

``generated_model`` writes a random Llama model of a preset size once and reuses it.
``ServerProcess`` runs one OpenAI-compatible server (kvpilot's or a peer's) as a subprocess on
127.0.0.1 and waits for its /health.

``PoissonLoad`` sends Poisson arrivals of OpenAI completions at ``rate`` per second (it may change
while running, for load steps) whether or not earlier requests have finished, up to
``max_in_flight`` outstanding; arrivals beyond that are shed at the client and counted (they are
demand that went unserved). A completed request is credited with the tokens its ``usage`` says
were returned. Prompt
and output lengths are drawn uniformly from the given ranges; EOS is ignored so every request
asks for its full output. Requests go round-robin to ``targets()``, engine base URLs read per
request. A request an engine turns away before doing any work (the connection refused by a pod
that has just gone, or a 503 ``shutting_down`` from a draining one) goes to the next target, as
a load balancer retries it; such requests count as ``rerouted``, and as failed only if no target
serves them.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

MODEL_CACHE = Path.home() / ".cache" / "kvpilot" / "models"

WORDS = (
    "the engine schedules every request each step so finished sequences leave the batch and waiting "
    "ones join at once while paged attention keeps the cache in small blocks allocated as tokens "
    "arrive operators tune batch size against latency targets measured from metrics"
).split()
ATTEMPTS = 4  # targets tried per request before it counts as failed
NO_TARGET_WAIT_S = 0.5


def cpu_description() -> str:
    """The CPU model, core count and AVX and AMX flags, printed with every CPU result (machines differ), and
    what a run without some of them (scripts/as-avx2.sh) took away: such a run is an emulation."""
    from kvpilot.kernels import cpu_features

    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = cpu_features.cpu_flags_line().split()
    avx = " ".join(sorted(f for f in flags if "avx" in f or f.startswith("amx"))) or "no avx"
    description = f"{model}, {os.cpu_count()} CPUs, flags: {avx}"
    removed = " ".join(sorted(cpu_features.detect().removed & set(flags)))
    limits = [f"{name}={os.environ[name]}" for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
              if name in os.environ]
    if removed or limits:
        description += (f"; EMULATED, run without: {removed or 'nothing'} ({cpu_features.ENV})"
                        + "".join(f", {limit}" for limit in limits))
    return description


def native_dtype() -> str:
    """What the engine's dtype auto picks on this CPU: bfloat16 where it computes it natively."""
    from kvpilot.kernels import cpu_features

    return "bfloat16" if cpu_features.detect().native_bf16 else "float32"


def generated_model(preset: str, seed: int) -> Path:
    """A random Llama-family model of ``preset`` size, generated on first use under MODEL_CACHE."""
    path = MODEL_CACHE / f"{preset}-llama-seed{seed}"
    if not (path / "config.json").exists():
        from kvpilot.engine.model_files import make_model

        tmp = path.with_name(path.name + ".tmp")
        make_model(tmp, preset=preset, arch="llama", seed=seed)
        tmp.rename(path)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One server subprocess listening on 127.0.0.1:``port``; its output goes to a log file."""

    def __init__(self, name: str, command: list[str], port: int, env: dict[str, str] | None = None,
                 cwd: str | None = None) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvpilot-bench-{name}-{port}.log"
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env=env, cwd=cwd, start_new_session=True)

    def wait_ready(self, timeout: float = 900.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not healthy after {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        """SIGTERM the server's whole process group (peers fork workers), then SIGKILL after 30 s."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # workers left behind by the server
        except ProcessLookupError:
            pass
        self.log.close()


TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # Debian's libtcmalloc-minimal4


def vllm_cpu_env(vllm_python: Path, cores: int, kv_cache_gib: int) -> dict[str, str]:
    """vLLM-CPU's environment for a fair run: every core computes (by default it reserves one for
    its frontend), the same KV space as kvpilot, and the preloads its CPU install guide asks for:
    tcmalloc (Debian's libtcmalloc-minimal4) and Intel OpenMP (PyPI's intel-openmp, in its
    virtualenv), installed here when missing (they took its served tokens/s from 347 to 482 in one
    pair of runs)."""
    iomp = Path(vllm_python).parent.parent / "lib" / "libiomp5.so"
    if not iomp.exists():
        print(f"installing intel-openmp into {Path(vllm_python).parent.parent} (vLLM's CPU guide preloads it)")
        subprocess.run([str(vllm_python), "-m", "pip", "install", "-q", "intel-openmp"], check=True)
    if not TCMALLOC.exists() and os.geteuid() == 0 and shutil.which("apt-get"):
        print("installing libtcmalloc-minimal4 with apt-get (vLLM's CPU guide preloads tcmalloc)")
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "libtcmalloc-minimal4"], check=True)
    if not TCMALLOC.exists():
        print(f"warning: {TCMALLOC} is missing (apt-get install libtcmalloc-minimal4): vLLM runs without it")
    return {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "LD_PRELOAD": ":".join(str(path) for path in (TCMALLOC, iomp) if path.exists()),
    }


def benchmark_model(name: str, seed: int = 0) -> Path:
    """The model folder a benchmark's ``--model`` names, in Hugging Face format so every system
    loads the same weights: ``small`` (the generated preset), ``smollm2`` (SmolLM2-135M-Instruct
    from its GGUF, dequantized once to bfloat16 safetensors by transformers), or a folder."""
    if name == "small":
        return generated_model("small", seed)
    if name == "smollm2":
        return _smollm2_folder()
    return Path(name).resolve()


def _smollm2_folder() -> Path:
    path = MODEL_CACHE / "smollm2-135m-hf-bf16"
    if not (path / "config.json").exists():
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from kvpilot.engine.model_fetch import fetch_model

        gguf = fetch_model("smollm2-135m", log=lambda line: print(line, flush=True))
        print(f"converting {gguf} to a bfloat16 Hugging Face folder {path} ...", flush=True)
        tmp = path.with_name(path.name + ".tmp")
        kwargs = {"gguf_file": gguf.name, "local_files_only": True}
        AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs).save_pretrained(str(tmp))
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.bfloat16, **kwargs)
        # transformers refuses save_pretrained on a GGUF-loaded model; its weights are plain tensors.
        weights = {k: v.contiguous() for k, v in model.state_dict().items()
                   if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del model.config.quantization_config  # the saved weights are plain bfloat16
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(str(tmp))
        model.generation_config.save_pretrained(str(tmp))
        tmp.rename(path)
    return path


@dataclass
class LoadStats:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    shed: int = 0
    rerouted: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    completions: list[tuple[float, int]] = field(default_factory=list)  # (time.time(), output tokens)


class _TurnedAway(Exception):
    """The engine refused the request before doing any work; another may take it."""


class PoissonLoad:
    """Open-loop Poisson arrivals in a background thread with its own event loop."""

    def __init__(self, targets: Callable[[], list[str]], rate: float, max_in_flight: int, seed: int,
                 prompt_words: tuple[int, int], output_tokens: tuple[int, int], model: str) -> None:
        self.targets, self.rate, self.max_in_flight = targets, rate, max_in_flight
        self.prompt_words, self.output_tokens, self.model = prompt_words, output_tokens, model
        self.rng = random.Random(seed)
        self.stats = LoadStats()
        self._next_target = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _request_body(self) -> dict:
        words = self.rng.randint(*self.prompt_words)
        return {
            "model": self.model,
            "prompt": " ".join(self.rng.choice(WORDS) for _ in range(words)),
            "max_tokens": self.rng.randint(*self.output_tokens),
            "ignore_eos": True,
            "temperature": 0.0,
        }

    async def _run(self) -> None:
        in_flight: set[asyncio.Task] = set()
        timeout = aiohttp.ClientTimeout(total=3600)
        # Idle connections go back before uvicorn's 5 s keep-alive closes them: a request sent on
        # one just as the server closes it fails in the client without reaching the engine.
        connector = aiohttp.TCPConnector(limit=self.max_in_flight, keepalive_timeout=3.0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            while not self._stop.is_set():
                await asyncio.sleep(self.rng.expovariate(self.rate))
                if len(in_flight) >= self.max_in_flight:
                    self.stats.shed += 1
                    continue
                task = asyncio.create_task(self._one(session, self._request_body()))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            for task in list(in_flight):
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def _one(self, session: aiohttp.ClientSession, body: dict) -> None:
        self.stats.sent += 1
        key, turned_away = "no target", False
        for _ in range(ATTEMPTS):
            targets = self.targets()
            if not targets:
                await asyncio.sleep(NO_TARGET_WAIT_S)
                continue
            self._next_target += 1
            url = targets[self._next_target % len(targets)]
            if turned_away:
                self.stats.rerouted += 1
            try:
                status, tokens = await self._post(session, url, body)
            except _TurnedAway as exc:
                key, turned_away = str(exc), True
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any other client failure counts as a failed request
                key = type(exc).__name__
                break
            if status == 200:
                self.stats.ok += 1
                self.stats.completions.append((time.time(), tokens))
                return
            key = f"HTTP {status}"
            break
        self.stats.failed += 1
        self.stats.errors[key] = self.stats.errors.get(key, 0) + 1

    @staticmethod
    async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, int]:
        """(HTTP status, output tokens returned: usage.completion_tokens of a 200)."""
        try:
            async with session.post(f"{url}/v1/completions", json=body) as response:
                text = await response.text()
        except aiohttp.ClientConnectorError as exc:
            raise _TurnedAway("connection refused") from exc
        if response.status == 503 and "shutting_down" in text:
            raise _TurnedAway("HTTP 503 shutting_down")
        tokens = json.loads(text)["usage"]["completion_tokens"] if response.status == 200 else 0
        return response.status, tokens
