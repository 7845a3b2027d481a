"""kvpilot against llama.cpp on the same GGUF file, the same cores: decode speed by batch, and cold start.

The file is the demo's, SmolLM2-135M-Instruct Q4_1 (``kvpilot fetch-model smollm2-135m``), and
kvpilot runs with its defaults, as a user who passes no flags would (dtype auto, weights kept
packed, the kernels the CPU's features pick; printed from the engine). llama.cpp is built by
``shared/tools/install-llama-cpp.sh`` (``--llama-bin`` names its bin folder).

- **Decode tokens/s at batch B** (1, 8 and 32 by default): B prompts of 128 random token ids, 64
  tokens each, EOS ignored. llama.cpp: ``llama-batched-bench -npp 128 -ntg 64 -npl B`` (its
  ``S_TG``: B x 64 tokens over the generation phase's seconds). kvpilot: ``LLM.generate`` in a
  fresh process, after a warm-up on other prompts; the decode seconds are a pass of 65 tokens less a
  pass of 1 token (the prefill and first token) over another B prompts, so both count the same
  phase. Different prompts each pass: nothing is served from the prefix cache.
- **Cold start**: seconds from exec to ``/health`` answering 200, ``kvpilot serve FILE`` against
  ``llama-server -m FILE``, each a fresh process (file pages are warm after the first run: a warm
  machine, as the goal is stated).

Both use every core (``--threads``: llama.cpp's ``-t``, torch's threads), unpinned, nothing else
running. The systems take turns, the order rotating each round, ``--repeat`` rounds; every run is
printed, and medians with min-max and the ratio of medians (kvpilot / llama.cpp) are reported, with
the CPU's flags.

    python benchmarks/cpu_peers.py --llama-bin ~/.cache/kvpilot/llama-cpp/build/bin --json /tmp/cpu-peers.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from serving_common import cpu_description, free_port

PROMPT_TOKENS, DECODE_TOKENS = 128, 64
TOKEN_IDS = (100, 40000)  # inside SmolLM2's vocabulary, clear of its special tokens


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-bin", type=Path, default=Path.home() / ".cache/kvpilot/llama-cpp/build/bin",
                        help="llama.cpp's bin folder (shared/tools/install-llama-cpp.sh prints it)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--skip-cold-start", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--decode-worker", nargs=2, metavar=("GGUF", "BATCH"), help=argparse.SUPPRESS)
    return parser.parse_args()


def decode_worker(gguf: str, batch: int, threads: int) -> dict:
    """kvpilot's decode tokens/s at ``batch``, in this (fresh) process, with the engine's defaults."""
    import torch

    torch.set_num_threads(threads)
    from kvpilot.engine import LLM, SamplingParams
    from kvpilot.engine.server.state import weight_layouts

    rng = random.Random(batch)

    def prompts() -> list[list[int]]:
        return [[rng.randint(*TOKEN_IDS) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]

    llm = LLM(gguf)

    def seconds(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts(), params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
        return time.perf_counter() - start

    seconds(8)  # warm-up: the allocator, the thread pool, the kernels' first calls
    first = seconds(1)
    decode = seconds(DECODE_TOKENS + 1) - first
    engine = llm.llm_engine
    return {"decode_tokens_per_second": batch * DECODE_TOKENS / decode, "prefill_seconds": first,
            "dtype": engine.resolved.dtype, "weight_layouts": weight_layouts(engine.runner.model)}


def kvpilot_decode(gguf: Path, batch: int, threads: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--decode-worker", str(gguf), str(batch), "--threads", str(threads)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_decode(bin_dir: Path, gguf: Path, batch: int, threads: int) -> dict:
    context = batch * (PROMPT_TOKENS + DECODE_TOKENS)
    out = subprocess.run(
        [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", str(context), "-b", "2048", "-ub", "512",
         "-npp", str(PROMPT_TOKENS), "-ntg", str(DECODE_TOKENS), "-npl", str(batch), "-t", str(threads),
         "--output-format", "jsonl"],
        capture_output=True, text=True, check=True)
    row = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    return {"decode_tokens_per_second": row["speed_tg"], "prefill_seconds": row["t_pp"]}


def llama_build(bin_dir: Path) -> str:
    """The instruction sets llama.cpp was built for, from its CMake cache: GGML_NATIVE=ON is this
    CPU's; an AVX2-only build (GGML_NATIVE=OFF, GGML_AVX512=OFF) is the peer of an emulated AVX2 run."""
    cache = bin_dir.parent / "CMakeCache.txt"
    if not cache.exists():
        return "unknown (no CMakeCache.txt beside its bin folder)"
    options = [line.split(":", 1)[0] + "=" + line.rsplit("=", 1)[1] for line in cache.read_text().splitlines()
               if line.startswith(("GGML_NATIVE:", "GGML_AVX", "GGML_FMA:", "GGML_AMX"))]
    return " ".join(options)


def cold_start(command: list[str], port: int) -> float:
    """Seconds from exec to /health answering 200."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {process.returncode}: {' '.join(command)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    if response.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.05)
            if time.perf_counter() - start > 300:
                raise RuntimeError(f"{command[0]} not healthy after 300 s")
    finally:
        os.killpg(process.pid, 9)
        process.wait()


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):8.2f} [{min(values):.2f}-{max(values):.2f}]"


def main() -> int:
    args = parse_args()
    if args.decode_worker:
        print(json.dumps(decode_worker(args.decode_worker[0], int(args.decode_worker[1]), args.threads)))
        return 0
    from kvpilot.engine.model_fetch import fetch_model

    gguf = fetch_model("smollm2-135m")
    if not (args.llama_bin / "llama-batched-bench").exists():
        print(f"no llama.cpp in {args.llama_bin}: build it with `bash shared/tools/install-llama-cpp.sh` "
              "(about 12 minutes on 2 cores) and pass --llama-bin")
        return 2
    machine, build = cpu_description(), llama_build(args.llama_bin)
    print(f"machine: {machine}; {args.threads} threads each; file {gguf.name}")
    print(f"llama.cpp built with {build}")
    systems = ["kvpilot", "llama.cpp"]
    runs: list[dict] = []
    for round_ in range(args.repeat):
        order = systems[round_ % 2:] + systems[:round_ % 2]
        for batch in args.batches:
            for system in order:
                result = (kvpilot_decode(gguf, batch, args.threads) if system == "kvpilot"
                          else llama_decode(args.llama_bin, gguf, batch, args.threads))
                runs.append({"round": round_, "what": f"decode batch {batch}", "system": system, **result})
                extra = f", {result['dtype']}, {result['weight_layouts']}" if system == "kvpilot" else ""
                print(f"  round {round_ + 1} decode batch {batch:2d} {system:9s} "
                      f"{result['decode_tokens_per_second']:8.1f} tok/s (prefill pass {result['prefill_seconds']:.2f} s{extra})",
                      flush=True)
        if args.skip_cold_start:
            continue
        for system in order:
            port = free_port()
            command = ([sys.executable, "-m", "kvpilot", "serve", str(gguf), "--port", str(port)] if system == "kvpilot"
                       else [str(args.llama_bin / "llama-server"), "-m", str(gguf), "--port", str(port),
                             "-t", str(args.threads)])
            seconds = cold_start(command, port)
            runs.append({"round": round_, "what": "cold start", "system": system, "seconds": seconds})
            print(f"  round {round_ + 1} cold start {system:9s} {seconds:6.2f} s to /health", flush=True)

    print(f"\nmachine: {machine}")
    print(f"llama.cpp built with {build}")
    print(f"results (median [min-max] over {args.repeat} rounds; ratio of medians, kvpilot / llama.cpp)")
    whats = [f"decode batch {b}" for b in args.batches] + ([] if args.skip_cold_start else ["cold start"])
    for what in whats:
        key = "seconds" if what == "cold start" else "decode_tokens_per_second"
        values = {s: [r[key] for r in runs if r["what"] == what and r["system"] == s] for s in systems}
        unit = "s" if what == "cold start" else "tok/s"
        ratio = statistics.median(values["kvpilot"]) / statistics.median(values["llama.cpp"])
        print(f"  {what:15s} kvpilot {summary(values['kvpilot'])} {unit}, llama.cpp {summary(values['llama.cpp'])} "
              f"{unit}: x{ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "llama_build": build, "threads": args.threads,
                                           "runs": runs}, indent=1))
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
