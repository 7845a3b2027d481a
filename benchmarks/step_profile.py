"""Where a decode step's time goes: kvpilot's engine at batch 1, 16 and 64, op by op.

For each batch size B the engine (bfloat16, CPU, ``--threads``) gets B requests with
``--context`` -token prompts, runs until every one is decoding, then times ``--steps`` decode
steps (each: schedule, prepare inputs, forward, LM head, sample, stop checks) and profiles a few
more with torch.profiler. Printed per batch: the step time (median, min-max) and per token, the
share of the step inside the model forward, and the ops taking the most self CPU time per step,
grouped into GEMMs (linear, LM head), attention, norms, RoPE, activation and the rest.

    python benchmarks/step_profile.py                           # the generated small preset
    python benchmarks/step_profile.py --model PATH.gguf         # any model the engine loads
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from serving_common import benchmark_model

CATEGORIES = (  # (category, substrings of aten op names), first match wins
    ("gemm", ("linear", "addmm", "aten::mm", "matmul", "bmm")),
    ("attention", ("paged_decode", "scaled_dot_product", "index_put", "index_select", "_flash_attention")),
    ("norm", ("rms_norm", "rsqrt", "pow", "mean")),
    ("rope", ("roll", "addcmul", "cos", "sin")),
    ("activation", ("silu",)),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="`small` (default), `smollm2`, or a model path (a folder or a .gguf file)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per batch size")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--top", type=int, default=12, help="ops listed per batch size")
    parser.add_argument("--dtype", default="bfloat16")
    return parser.parse_args()


def category(op: str) -> str:
    for name, patterns in CATEGORIES:
        if any(p in op for p in patterns):
            return name
    return "other"


def main() -> None:
    args = parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    if args.threads:
        torch.set_num_threads(args.threads)
    from kvpilot.engine import LLMEngine, SamplingParams
    from kvpilot.engine.config import EngineConfig

    model = str(benchmark_model(args.model))
    max_batch = max(args.batch)
    engine = LLMEngine.from_config(EngineConfig(
        model=model, dtype=args.dtype, device="cpu", max_num_seqs=max_batch,
        max_model_len=args.context + 4 * args.steps + 64, kv_cache_memory=1 << 30,
        enable_prefix_caching=False))
    print(f"model {model} ({engine.arch.num_layers} layers, hidden {engine.arch.hidden_size}), {args.dtype}, "
          f"{torch.get_num_threads()} threads, context {args.context}", flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=4 * args.steps + 32, ignore_eos=True)
    vocab = engine.arch.vocab_size
    for batch in args.batch:
        for i in range(batch):
            prompt = [(7 + 31 * i + 17 * j) % (vocab - 16) + 8 for j in range(args.context)]
            engine.add_request(f"b{batch}-{i}", prompt, params)
        while engine.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
        ):
            engine.step()
        for _ in range(3):
            engine.step()
        durations = []
        forward_before = engine.runner.forward_seconds
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            durations.append(time.perf_counter() - start)
        forward_share = (engine.runner.forward_seconds - forward_before) / sum(durations)
        profiled_steps = 5
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(profiled_steps):
                engine.step()
        engine.abort_request([f"b{batch}-{i}" for i in range(batch)])

        median = statistics.median(durations)
        print(f"\nbatch {batch:3d}: step {median * 1000:7.2f} ms (min {min(durations) * 1000:.2f}, "
              f"max {max(durations) * 1000:.2f}), {median / batch * 1000:.2f} ms per token, "
              f"{batch / median:.0f} tok/s; {100 * forward_share:.0f}% inside the model forward", flush=True)
        events = [e for e in prof.key_averages() if e.key.startswith("aten::") or "paged_decode" in e.key
                  or e.key.startswith("mkldnn::")]
        total_us = sum(e.self_cpu_time_total for e in prof.key_averages()) / profiled_steps
        by_category: dict[str, float] = defaultdict(float)
        for e in prof.key_averages():
            by_category[category(e.key)] += e.self_cpu_time_total / profiled_steps
        shares = ", ".join(f"{name} {100 * us / total_us:.0f}%" for name, us in
                           sorted(by_category.items(), key=lambda kv: -kv[1]))
        print(f"  self CPU time of torch ops by kind: {shares} (the C kernels are not torch ops)")
        print(f"  {'op':44s} {'calls/step':>10s} {'ms/step':>9s} {'share':>6s}")
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.top]:
            per_step = e.self_cpu_time_total / profiled_steps
            print(f"  {e.key[:44]:44s} {e.count / profiled_steps:10.0f} {per_step / 1000:9.3f} "
                  f"{100 * per_step / total_us:5.1f}%")


if __name__ == "__main__":
    main()
