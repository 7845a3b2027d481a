"""Decode attention: kvpilot's paged-attention kernel vs torch SDPA over the same KV gathered contiguous.

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, block_size 16, bfloat16), one
layer, every sequence decoding one token over `context` cached tokens. For each batch x context:

- triton: kernels.paged_attention straight from the paged cache (split-KV chosen by the launcher);
- sdpa: torch.nn.functional.scaled_dot_product_attention over K/V already gathered into contiguous
  [batch, kv_heads, context, head_dim] tensors (the gather is not timed: SDPA's best case), with the
  query heads of a KV head folded into the query-length axis so no K/V copy is needed for GQA;
- gather+sdpa: the same, timing the gather from the paged cache too (what a paged engine would pay).

Achieved bandwidth = (K/V bytes read + query and output bytes) / time, as a fraction of the device's
peak HBM bandwidth. Every shape's output is checked against SDPA's before it is timed. Then a short
prefill table (causal prompts, TFLOP/s vs SDPA's causal kernel) and an optional sweep of tile
configurations on a few decode shapes, to tune kernels/paged_attention.py's defaults.

  python benchmarks/gpu_attention.py --out results/          # on a GPU
  python benchmarks/gpu_attention.py --smoke                 # CPU, Triton interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from dataclasses import dataclass

GOAL_FRACTION = 0.7  # of peak HBM bandwidth, at batch >= GOAL_MIN_BATCH and context >= GOAL_MIN_CONTEXT
GOAL_MIN_BATCH = 32
GOAL_MIN_CONTEXT = 2048
# (tile_n, num_warps, num_stages) to try, most promising first (the sweep stops at its time budget).
# Stages 5 double-buffers the K/V tiles; 3 prefetches the block-table entries two tiles ahead.
SWEEP_TILES = [(64, 4, 3), (128, 4, 3), (32, 4, 3), (64, 8, 3), (64, 4, 5), (32, 4, 5), (64, 4, 2)]
# Split counts tried with the default tiles (None: the launcher's choice).
SWEEP_SPLITS = [None, 1, 2, 4, 8, 16]
SWEEP_SHAPES = [(32, 2048), (128, 8192), (4, 32768)]
PREFILL_SHAPES = [(1, 2048), (4, 2048), (1, 8192)]  # (prompts, prompt length)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1 (checks the code paths, times nothing real)")
    parser.add_argument("--batches", default="1,8,32,64,128,256", help="comma-separated batch sizes")
    parser.add_argument("--contexts", default="512,2048,8192,32768", help="comma-separated context lengths")
    parser.add_argument("--max-tokens", type=int, default=4 * 1024 * 1024,
                        help="skip shapes with batch x context above this (KV pool + gathered copies must fit)")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per measurement (median)")
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill table")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile-configuration sweep")
    parser.add_argument("--sweep-budget-s", type=float, default=90.0,
                        help="stop the sweep after this many seconds (the results so far are kept)")
    parser.add_argument("--peak-bw-tbs", type=float, default=None,
                        help="peak HBM bandwidth in TB/s (default: from the device name, or $KVPILOT_PEAK_BW_TBS)")
    parser.add_argument("--out", default=os.environ.get("OUT", ""),
                        help="folder for gpu_attention.json/.md (default: $OUT; empty = print only)")
    args = parser.parse_args()
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
        args.contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        parser.error("--batches and --contexts take comma-separated integers, e.g. --batches 1,32,128")
    if min(args.batches + args.contexts) < 1 or args.reps < 1:
        parser.error("--batches, --contexts and --reps must be positive")
    args.sweep_shapes, args.prefill_shapes = SWEEP_SHAPES, PREFILL_SHAPES
    if args.smoke:
        args.batches, args.contexts, args.reps = [1, 3], [48, 100], 2
        args.sweep_shapes, args.prefill_shapes, args.sweep_budget_s = [(1, 48)], [(1, 40), (2, 24)], 3.0
    return args


@dataclass
class Bench:
    """What every table shares: the device, the head shapes and one paged KV pool."""

    torch: object  # the torch module, imported after TRITON_INTERPRET is decided
    device: object
    dtype: object
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_cache: object  # [2, pool_blocks, block_size, num_kv_heads, head_dim]
    generator: object
    peak: float | None
    reps: int

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def elt(self) -> int:
        return self.torch.tensor([], dtype=self.dtype).element_size()

    @property
    def pool_blocks(self) -> int:
        return self.kv_cache.shape[1]

    def tolerance(self) -> float:
        return 2e-2 if self.dtype != self.torch.float32 else 1e-4

    def paged_batch(self, q_lens: list[int], seq_len: int):
        """Sequences of seq_len tokens on random pool blocks, with q_lens new queries each."""
        torch = self.torch
        blocks_per_seq = -(-seq_len // self.block_size)
        order = torch.randperm(self.pool_blocks, generator=self.generator, device=self.device)
        block_tables = order[: len(q_lens) * blocks_per_seq].view(len(q_lens), blocks_per_seq).to(torch.int32)
        seq_lens = torch.full((len(q_lens),), seq_len, dtype=torch.int32, device=self.device)
        starts = [0, *itertools.accumulate(q_lens)]
        query_start_loc = torch.tensor(starts, dtype=torch.int32, device=self.device)
        query = torch.randn(starts[-1], self.num_heads, self.head_dim, generator=self.generator,
                            device=self.device, dtype=self.dtype)
        return query, block_tables, seq_lens, query_start_loc

    def gathered(self, block_tables, context: int):
        """K, V as [batch, kv_heads, context, head_dim] views over one gather copy each."""
        k = self.kv_cache[0][block_tables].flatten(1, 2)[:, :context].transpose(1, 2)
        v = self.kv_cache[1][block_tables].flatten(1, 2)[:, :context].transpose(1, 2)
        return k, v

    def check(self, what: str, actual, expected) -> None:
        tol = self.tolerance()
        if not self.torch.allclose(actual.float(), expected.float(), atol=tol, rtol=tol):
            diff = (actual.float() - expected.float()).abs().max().item()
            raise SystemExit(f"MISMATCH: paged attention differs from SDPA for {what} (max abs diff {diff:.3g})")


def decode_table(bench: Bench, args, time_ms, paged_attention, choose_num_splits) -> tuple[list, list, list]:
    import torch.nn.functional as F

    torch = bench.torch
    h, kvh, d = bench.num_heads, bench.num_kv_heads, bench.head_dim
    rows, records, skipped = [], [], []
    for batch, context in ((b, c) for b in args.batches for c in args.contexts):
        if batch * context > args.max_tokens:
            skipped.append((batch, context))
            continue
        query, block_tables, seq_lens, query_start_loc = bench.paged_batch([1] * batch, context)
        out = torch.empty_like(query)

        def run_triton():
            paged_attention(query, bench.kv_cache, block_tables, seq_lens, query_start_loc,
                            max_query_len=1, max_seq_len=context, scale=bench.scale, out=out)

        # q folded: [batch, kv_heads, queries_per_kv, head_dim]; the query heads of a KV head are its rows.
        q_folded = query.view(batch, kvh, h // kvh, d)
        k_contig, v_contig = (t.contiguous() for t in bench.gathered(block_tables, context))

        def run_sdpa():
            return F.scaled_dot_product_attention(q_folded, k_contig, v_contig, scale=bench.scale)

        def run_gather_sdpa():
            return F.scaled_dot_product_attention(q_folded, *bench.gathered(block_tables, context), scale=bench.scale)

        run_triton()
        bench.check(f"decode batch {batch} x context {context}", out, run_sdpa().reshape(batch, h, d))
        t_triton = time_ms(run_triton, bench.device, args.reps)
        t_sdpa = time_ms(run_sdpa, bench.device, args.reps)
        t_gather = time_ms(run_gather_sdpa, bench.device, args.reps)
        num_bytes = (2 * batch * context * kvh * d + 2 * batch * h * d) * bench.elt + block_tables.numel() * 4
        tbs = num_bytes / (t_triton * 1e-3) / 1e12
        frac = tbs * 1e12 / bench.peak if bench.peak else None
        sdpa_frac = num_bytes / (t_sdpa * 1e-3) / bench.peak if bench.peak else None
        splits = choose_num_splits(batch, kvh, 1, context, bench.device)
        in_goal = batch >= GOAL_MIN_BATCH and context >= GOAL_MIN_CONTEXT
        meets = None if not in_goal or frac is None else (frac >= GOAL_FRACTION and t_triton < t_sdpa)
        rows.append([batch, context, splits, t_triton * 1e3, tbs, frac, t_sdpa * 1e3, sdpa_frac, t_gather * 1e3,
                     t_sdpa / t_triton, t_gather / t_triton, {None: "", True: "yes", False: "NO"}[meets]])
        records.append(dict(batch=batch, context=context, num_splits=splits, triton_us=t_triton * 1e3,
                            triton_tbs=tbs, triton_peak_fraction=frac, sdpa_us=t_sdpa * 1e3,
                            sdpa_peak_fraction=sdpa_frac, gather_sdpa_us=t_gather * 1e3,
                            speedup_vs_sdpa=t_sdpa / t_triton, speedup_vs_gather_sdpa=t_gather / t_triton,
                            meets_goal=meets))
        del k_contig, v_contig
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, records, skipped


def prefill_table(bench: Bench, args, time_ms, paged_attention) -> tuple[list, list]:
    """Causal prompts with nothing cached: TFLOP/s of the paged kernel vs SDPA's causal kernel."""
    import torch.nn.functional as F

    torch = bench.torch
    h, kvh, d = bench.num_heads, bench.num_kv_heads, bench.head_dim
    rows, records = [], []
    for prompts, length in args.prefill_shapes:
        query, block_tables, seq_lens, query_start_loc = bench.paged_batch([length] * prompts, length)

        def run_triton():
            return paged_attention(query, bench.kv_cache, block_tables, seq_lens, query_start_loc,
                                   max_query_len=length, max_seq_len=length, scale=bench.scale)

        # SDPA gets contiguous [prompts, heads, length, head_dim] inputs with K/V repeated per query head.
        q = query.view(prompts, length, h, d).transpose(1, 2).contiguous()
        k, v = (t.repeat_interleave(h // kvh, dim=1).contiguous() for t in bench.gathered(block_tables, length))

        def run_sdpa():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=bench.scale)

        expected = run_sdpa().transpose(1, 2).reshape(prompts * length, h, d)
        bench.check(f"prefill {prompts} x {length}", run_triton(), expected)
        t_triton = time_ms(run_triton, bench.device, args.reps)
        t_sdpa = time_ms(run_sdpa, bench.device, args.reps)
        flops = 2 * prompts * length * length * h * d  # QK^T and PV over the causal half
        rows.append([prompts, length, t_triton * 1e3, flops / (t_triton * 1e-3) / 1e12, t_sdpa * 1e3,
                     flops / (t_sdpa * 1e-3) / 1e12, t_sdpa / t_triton])
        records.append(dict(prompts=prompts, length=length, triton_us=t_triton * 1e3, sdpa_us=t_sdpa * 1e3,
                            triton_tflops=flops / (t_triton * 1e-3) / 1e12,
                            sdpa_tflops=flops / (t_sdpa * 1e-3) / 1e12))
        del q, k, v, expected
    return rows, records


def sweep_table(bench: Bench, args, time_ms, paged_attention, choose_num_splits, default_launch_config,
                AttentionLaunchConfig) -> list[dict]:
    """Time tile shapes x warps x stages (launcher's split count), then split counts (default tiles)."""
    torch = bench.torch
    records = []
    deadline = time.monotonic() + args.sweep_budget_s
    for batch, context in args.sweep_shapes:
        if batch * context > args.max_tokens:
            continue
        query, block_tables, seq_lens, query_start_loc = bench.paged_batch([1] * batch, context)
        default = default_launch_config(1, bench.num_heads // bench.num_kv_heads, bench.head_dim, bench.device)
        kv_bytes = 2 * batch * context * bench.num_kv_heads * bench.head_dim * bench.elt
        shape_records = []
        trials = [(tiles, None) for tiles in SWEEP_TILES] + [(SWEEP_TILES[0], n) for n in SWEEP_SPLITS[1:]]
        for (tile_n, warps, stages), splits in trials:
            if time.monotonic() > deadline:
                print(f"  sweep budget of {args.sweep_budget_s:.0f} s spent; stopping at batch {batch} x {context}")
                break
            config = AttentionLaunchConfig(block_m=default.block_m, tile_n=tile_n, num_warps=warps, num_stages=stages)

            def run(config=config, splits=splits):
                paged_attention(query, bench.kv_cache, block_tables, seq_lens, query_start_loc, max_query_len=1,
                                max_seq_len=context, scale=bench.scale, num_splits=splits, config=config)

            try:
                ms = time_ms(run, bench.device, max(5, args.reps // 3))
            except Exception as exc:  # a config that does not fit shared memory is a data point, not an error
                print(f"  tile_n={tile_n} warps={warps} stages={stages} failed: {type(exc).__name__}: {exc}"[:300])
                continue
            used_splits = choose_num_splits(batch, bench.num_kv_heads, 1, context, bench.device) if splits is None else splits
            shape_records.append(dict(batch=batch, context=context, tile_n=tile_n, num_warps=warps,
                                      num_stages=stages, num_splits=used_splits, us=ms * 1e3,
                                      peak_fraction=kv_bytes / (ms * 1e-3) / bench.peak if bench.peak else None,
                                      is_default=(config == default and splits is None)))
        shape_records.sort(key=lambda r: r["us"])
        records += shape_records[:8] + [r for r in shape_records[8:] if r["is_default"]]
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def main() -> int:
    args = parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    from gpu_common import environment, format_table, markdown_table, peak_bandwidth, time_ms, write_results
    from kvpilot.kernels.paged_attention import AttentionLaunchConfig, default_launch_config, paged_attention
    from kvpilot.kernels.split_kv_decode import choose_num_splits

    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 16
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on a GPU, or pass --smoke for the CPU code-path check")
        device, dtype = torch.device("cuda"), torch.bfloat16
        num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    peak, peak_source = peak_bandwidth(device, args.peak_bw_tbs)
    env = environment(device)
    print(f"paged attention | {env} | peak: {peak_source}")

    shapes = [(b, c) for b in args.batches for c in args.contexts if b * c <= args.max_tokens]
    if not shapes:
        raise SystemExit("every shape exceeds --max-tokens; raise it or pick smaller --batches/--contexts")
    token_counts = [b * -(-c // block_size) for b, c in shapes] + [p * -(-n // block_size) for p, n in args.prefill_shapes]
    generator = torch.Generator(device=device).manual_seed(0)
    kv_cache = torch.empty(2, max(token_counts) + 1, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    kv_cache.normal_(generator=generator)
    bench = Bench(torch, device, dtype, num_heads, num_kv_heads, head_dim, block_size, kv_cache, generator,
                  peak, args.reps)
    title = (f"{num_heads} query heads, {num_kv_heads} KV heads, head_dim {head_dim}, block {block_size}, "
             f"{str(dtype).removeprefix('torch.')}")

    rows, records, skipped = decode_table(bench, args, time_ms, paged_attention, choose_num_splits)
    headers = ["batch", "context", "splits", "triton us", "TB/s", "of peak", "sdpa us", "sdpa of peak",
               "gather+sdpa us", "x sdpa", "x gather+sdpa", "goal"]
    print(f"\ndecode attention ({title})")
    print(format_table(headers, rows))
    for b, c in skipped:
        print(f"skipped batch {b} x context {c}: above --max-tokens {args.max_tokens}")
    goal_rows = [r for r in records if r["meets_goal"] is not None]
    goal_line = (f"goal (>= {GOAL_FRACTION:.0%} of peak and faster than SDPA at batch >= {GOAL_MIN_BATCH}, "
                 f"context >= {GOAL_MIN_CONTEXT}): met on {sum(r['meets_goal'] for r in goal_rows)}/{len(goal_rows)} shapes")
    if not goal_rows:
        goal_line = "goal: not evaluated (no peak bandwidth, or no shape at the goal's batch and context)"
    print(goal_line)
    markdown = f"## Decode attention ({title})\n\n{env}; peak: {peak_source}\n\n{markdown_table(headers, rows)}\n\n{goal_line}"

    prefill_records = []
    if not args.no_prefill:
        prefill_rows, prefill_records = prefill_table(bench, args, time_ms, paged_attention)
        prefill_headers = ["prompts", "length", "triton us", "TFLOP/s", "sdpa us", "sdpa TFLOP/s", "x sdpa"]
        print(f"\ncausal prefill, nothing cached ({title}; SDPA gets contiguous, head-repeated K/V)")
        print(format_table(prefill_headers, prefill_rows))
        markdown += "\n\n### Causal prefill\n\n" + markdown_table(prefill_headers, prefill_rows)

    sweep_records = []
    if not args.no_sweep:
        sweep_records = sweep_table(bench, args, time_ms, paged_attention, choose_num_splits,
                                    default_launch_config, AttentionLaunchConfig)
        sweep_rows = [[r["batch"], r["context"], r["tile_n"], r["num_warps"], r["num_stages"], r["num_splits"],
                       r["us"], r["peak_fraction"], "yes" if r["is_default"] else ""] for r in sweep_records]
        sweep_headers = ["batch", "context", "tile_n", "warps", "stages", "splits", "us", "of peak", "default"]
        print("\ndecode tile-configuration sweep (fastest first per shape)")
        print(format_table(sweep_headers, sweep_rows))
        markdown += "\n\n### Decode tile-configuration sweep\n\n" + markdown_table(sweep_headers, sweep_rows)

    write_results(args.out, "gpu_attention", {"environment": env, "peak_source": peak_source, "decode": records,
                                              "prefill": prefill_records, "sweep": sweep_records}, markdown)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
