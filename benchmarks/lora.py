"""LoRA adapters: throughput of a batch mixing adapters against the base model alone, and against
vLLM-CPU serving the same adapters; same workload, same cores, every run its own process.

Workload (fixed seed): ``--num-requests`` requests (default 64) with prompts of uniform 32-96
random tokens and 64 output tokens each (EOS ignored), at most ``--max-num-seqs`` (default 16)
running at once, on the generated ``small`` preset model in bfloat16 on the CPU. The adapter runs
send request i to adapter i mod ``--num-adapters`` (default 4 adapters of rank ``--rank`` 16 on
every projection, random PEFT folders from kvpilot.engine.model_files.make_lora_adapter), all of
them resident (max_loras = the number of adapters), so a batch of 16 holds every adapter.

Systems, each a fresh process per run (offline_worker.py): kvpilot base, kvpilot with adapters,
and with ``--vllm-python`` (shared/tools/install-vllm-cpu.sh) vLLM-CPU with and without adapters,
``--enable-lora`` with the same max_loras and max_lora_rank. They take turns (the order rotates
each round) for ``--repeat`` rounds; every run is printed, then each system's median with its
min-max and the ratios of medians: the goals are kvpilot-lora / kvpilot-base >= 0.8 and
kvpilot-lora / vllm-lora >= 1.5.

    python benchmarks/lora.py --vllm-python ~/.cache/kvpilot/vllm-cpu/bin/python
    python benchmarks/lora.py --quick      # a smoke run, not a measurement
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
from pathlib import Path

from offline_throughput import KV_CACHE_GIB, describe, run_once
from serving_common import MODEL_CACHE, benchmark_model, cpu_description


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="`small` (default): the generated preset; or a folder")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads (cores) for every system")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; every system runs once per round")
    parser.add_argument("--vllm-python", type=Path, default=None, help="python of a virtualenv with vLLM-CPU")
    parser.add_argument("--quick", action="store_true", help="16 requests, one round: a smoke run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.repeat = 16, 1
    return args


def adapters(model: Path, count: int, rank: int) -> list[str]:
    """``count`` random rank-``rank`` adapters for ``model``, written once into the benchmark cache."""
    from kvpilot.engine.model_files import make_lora_adapter

    root = MODEL_CACHE / f"lora-{model.name}-r{rank}"
    return [str(make_lora_adapter(root / f"adapter{i}", model, rank=rank, alpha=2 * rank, seed=i))
            if not (root / f"adapter{i}" / "adapter_config.json").exists() else str(root / f"adapter{i}")
            for i in range(count)]


def main() -> None:
    args = parse_args()
    model = benchmark_model(args.model, args.seed)
    from kvpilot.engine.models import read_model_arch

    arch = read_model_arch(model)
    ordinary = [i for i in range(arch.vocab_size) if i not in set(arch.eos_token_ids)]
    rng = random.Random(args.seed)
    prompts = [[rng.choice(ordinary) for _ in range(rng.randint(32, 96))] for _ in range(args.num_requests)]
    base = {"model": str(model), "prompts": prompts, "output_lens": [args.output_len] * len(prompts)}
    with_loras = base | {"loras": adapters(model, args.num_adapters, args.rank), "max_lora_rank": args.rank,
                         "lora_of": [i % args.num_adapters for i in range(len(prompts))]}
    print(f"{cpu_description()}; model {model}, bfloat16, {args.threads} threads for every system; "
          f"{args.num_requests} requests x {args.output_len} output tokens, at most {args.max_num_seqs} running; "
          f"{args.num_adapters} adapters of rank {args.rank}, request i -> adapter i mod {args.num_adapters}", flush=True)
    files = {}
    for name, workload in (("base", base), ("lora", with_loras)):
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
            json.dump(workload, handle)
        files[name] = Path(handle.name)
    systems = [("kvpilot", "base"), ("kvpilot", "lora")]
    if args.vllm_python is not None:
        systems += [("vllm", "base"), ("vllm", "lora")]
    runs: dict[str, list[dict]] = {f"{s}-{w}": [] for s, w in systems}
    for round_ in range(args.repeat):
        order = systems[round_ % len(systems):] + systems[: round_ % len(systems)]
        for system, workload in order:
            run = run_once(system, files[workload], args)
            runs[f"{system}-{workload}"].append(run)
            print(f"round {round_ + 1}: {system}-{workload:4s} {describe(system, run)}", flush=True)
    for path in files.values():
        path.unlink()

    medians = {name: statistics.median(r["output_tokens_per_s"] for r in values) for name, values in runs.items()}
    print(f"\nmedian output tok/s over {args.repeat} run(s) each (min-max), KV cache {KV_CACHE_GIB} GiB each:")
    for name, values in runs.items():
        tokens = [r["output_tokens_per_s"] for r in values]
        print(f"  {name:13s} {medians[name]:7.1f} ({min(tokens):.1f}-{max(tokens):.1f})")
    ratios = [("kvpilot-lora", "kvpilot-base", 0.8), ("kvpilot-lora", "vllm-lora", 1.5), ("vllm-lora", "vllm-base", None)]
    for numerator, denominator, goal in ratios:
        if denominator in medians:
            ratio = medians[numerator] / medians[denominator]
            verdict = "" if goal is None else f" (goal >= {goal}: {'met' if ratio >= goal else 'missed'})"
            print(f"ratio {numerator} / {denominator}: {ratio:.2f}x{verdict}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                                         "medians": medians}, indent=1) + "\n")


if __name__ == "__main__":
    main()
