"""Decode attention: kvpilot's paged-attention kernel vs torch SDPA over the same KV gathered contiguous.

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, block_size 16, bfloat16), one
layer, every sequence decoding one token over `context` cached tokens. For each batch x context:

- triton: kernels.paged_attention straight from the paged cache (split-KV chosen by the launcher);
- sdpa: torch.nn.functional.scaled_dot_product_attention over K/V already gathered into contiguous
  [batch, kv_heads, context, head_dim] tensors (the gather is not timed: SDPA's best case), with the
  query heads of a KV head folded into the query-length axis so no K/V copy is needed for GQA;
- gather+sdpa: the same, timing the gather from the paged cache too (what a paged engine would pay).

Achieved bandwidth = (K/V bytes read + query and output bytes) / time, as a fraction of the device's
peak HBM bandwidth. Every shape's output is checked against SDPA's before it is timed. An optional
sweep times tile configurations for a few shapes, to tune kernels/paged_attention.py's defaults.

  python benchmarks/gpu_attention.py --out results/          # on a GPU
  python benchmarks/gpu_attention.py --smoke                 # CPU, Triton interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

GOAL_FRACTION = 0.7  # of peak HBM bandwidth, at batch >= GOAL_MIN_BATCH and context >= GOAL_MIN_CONTEXT
GOAL_MIN_BATCH = 32
GOAL_MIN_CONTEXT = 2048
# (tile_n, num_warps, num_stages) to try, most promising first (the sweep stops at its time budget).
# Stages 5 double-buffers the K/V tiles; 3 prefetches the block-table entries two tiles ahead.
SWEEP_TILES = [(64, 4, 3), (128, 4, 3), (32, 4, 3), (64, 8, 3), (128, 8, 3), (64, 4, 5), (32, 4, 5),
               (128, 4, 2), (64, 4, 2), (32, 2, 3)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1 (checks the code paths, times nothing real)")
    parser.add_argument("--batches", default="1,8,32,64,128,256", help="comma-separated batch sizes")
    parser.add_argument("--contexts", default="512,2048,8192,32768", help="comma-separated context lengths")
    parser.add_argument("--max-tokens", type=int, default=4 * 1024 * 1024,
                        help="skip shapes with batch x context above this (KV pool + gathered copies must fit)")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per measurement (median)")
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
    if args.smoke:
        args.batches = [1, 3]
        args.contexts = [48, 100]
        args.reps = 2
        args.sweep_budget_s = 3.0
    return args


def main() -> int:
    args = parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch
    import torch.nn.functional as F

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
    print(f"decode attention | {env} | peak: {peak_source}")
    queries_per_kv = num_heads // num_kv_heads
    scale = head_dim ** -0.5
    elt = torch.tensor([], dtype=dtype).element_size()

    shapes = [(b, c) for b in args.batches for c in args.contexts]
    skipped = [(b, c) for b, c in shapes if b * c > args.max_tokens]
    shapes = [s for s in shapes if s not in skipped]
    if not shapes:
        raise SystemExit("every shape exceeds --max-tokens; raise it or pick smaller --batches/--contexts")
    pool_blocks = max(b * -(-c // block_size) for b, c in shapes) + 1
    gen = torch.Generator(device=device).manual_seed(0)
    # kv_cache: [2, pool_blocks, block_size, num_kv_heads, head_dim], shared by every shape
    kv_cache = torch.empty(2, pool_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    kv_cache.normal_(generator=gen)

    def make_inputs(batch: int, context: int):
        blocks_per_seq = -(-context // block_size)
        order = torch.randperm(pool_blocks, generator=gen, device=device)
        block_tables = order[: batch * blocks_per_seq].view(batch, blocks_per_seq).to(torch.int32)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
        query = torch.randn(batch, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
        return query, block_tables, seq_lens, query_start_loc

    def gathered(block_tables: torch.Tensor, context: int):
        """K, V as [batch, kv_heads, context, head_dim] views over one gather copy each."""
        k = kv_cache[0][block_tables].flatten(1, 2)[:, :context].transpose(1, 2)
        v = kv_cache[1][block_tables].flatten(1, 2)[:, :context].transpose(1, 2)
        return k, v

    def bandwidth(num_bytes: int, ms: float) -> tuple[float, float | None]:
        tbs = num_bytes / (ms * 1e-3) / 1e12
        return tbs, (tbs * 1e12 / peak if peak else None)

    rows, records = [], []
    for batch, context in shapes:
        query, block_tables, seq_lens, query_start_loc = make_inputs(batch, context)
        out = torch.empty_like(query)

        def run_triton(query=query, block_tables=block_tables, seq_lens=seq_lens,
                       query_start_loc=query_start_loc, out=out, context=context):
            paged_attention(query, kv_cache, block_tables, seq_lens, query_start_loc,
                            max_query_len=1, max_seq_len=context, scale=scale, out=out)

        # q folded: [batch, kv_heads, queries_per_kv, head_dim]; the query heads of a KV head are its rows.
        q_folded = query.view(batch, num_kv_heads, queries_per_kv, head_dim)
        k_contig, v_contig = (t.contiguous() for t in gathered(block_tables, context))

        def run_sdpa(q_folded=q_folded, k_contig=k_contig, v_contig=v_contig):
            return F.scaled_dot_product_attention(q_folded, k_contig, v_contig, scale=scale)

        def run_gather_sdpa(q_folded=q_folded, block_tables=block_tables, context=context):
            return F.scaled_dot_product_attention(q_folded, *gathered(block_tables, context), scale=scale)

        run_triton()
        expected = run_sdpa().reshape(batch, num_heads, head_dim)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        if not torch.allclose(out.float(), expected.float(), atol=tol, rtol=tol):
            diff = (out.float() - expected.float()).abs().max().item()
            raise SystemExit(f"MISMATCH: paged attention differs from SDPA at batch {batch}, context {context} "
                             f"(max abs diff {diff:.3g})")

        t_triton = time_ms(run_triton, device, args.reps)
        t_sdpa = time_ms(run_sdpa, device, args.reps)
        t_gather = time_ms(run_gather_sdpa, device, args.reps)
        kv_bytes = 2 * batch * context * num_kv_heads * head_dim * elt
        io_bytes = 2 * batch * num_heads * head_dim * elt + block_tables.numel() * 4
        tbs, frac = bandwidth(kv_bytes + io_bytes, t_triton)
        _, sdpa_frac = bandwidth(kv_bytes + io_bytes, t_sdpa)
        splits = choose_num_splits(batch, num_kv_heads, 1, context, device)
        in_goal = batch >= GOAL_MIN_BATCH and context >= GOAL_MIN_CONTEXT
        meets = None if not in_goal or frac is None else (frac >= GOAL_FRACTION and t_triton < t_sdpa)
        rows.append([batch, context, splits, t_triton * 1e3, tbs, frac, t_sdpa * 1e3, sdpa_frac, t_gather * 1e3,
                     t_sdpa / t_triton, t_gather / t_triton, {None: "", True: "yes", False: "NO"}[meets]])
        records.append(dict(batch=batch, context=context, num_splits=splits, triton_us=t_triton * 1e3,
                            triton_tbs=tbs, triton_peak_fraction=frac, sdpa_us=t_sdpa * 1e3,
                            sdpa_peak_fraction=sdpa_frac, gather_sdpa_us=t_gather * 1e3,
                            speedup_vs_sdpa=t_sdpa / t_triton, speedup_vs_gather_sdpa=t_gather / t_triton,
                            meets_goal=meets))
        del k_contig, v_contig, expected
        if device.type == "cuda":
            torch.cuda.empty_cache()

    headers = ["batch", "context", "splits", "triton us", "TB/s", "of peak", "sdpa us", "sdpa of peak",
               "gather+sdpa us", "x sdpa", "x gather+sdpa", "goal"]
    print(format_table(headers, rows))
    for b, c in skipped:
        print(f"skipped batch {b} x context {c}: above --max-tokens {args.max_tokens}")
    goal_rows = [r for r in records if r["meets_goal"] is not None]
    goal_line = (f"goal (>= {GOAL_FRACTION:.0%} of peak and faster than SDPA at batch >= {GOAL_MIN_BATCH}, "
                 f"context >= {GOAL_MIN_CONTEXT}): {sum(r['meets_goal'] for r in goal_rows)}/{len(goal_rows)} shapes")
    if not goal_rows:
        goal_line = "goal: not evaluated (no peak bandwidth, or no shape at the goal's batch and context)"
    print(goal_line)

    sweep_records, sweep_md = [], ""
    if not args.no_sweep:
        sweep_records = sweep_configs(args, kv_cache, make_inputs, scale, elt, num_kv_heads, head_dim, peak,
                                      default_launch_config, AttentionLaunchConfig, paged_attention, time_ms)
        sweep_rows = [[r["batch"], r["context"], r["tile_n"], r["num_warps"], r["num_stages"], r["num_splits"],
                       r["us"], r["peak_fraction"], r["is_default"]] for r in sweep_records]
        sweep_headers = ["batch", "context", "tile_n", "warps", "stages", "splits", "us", "of peak", "default"]
        print("\ntile-configuration sweep (fastest first per shape)")
        print(format_table(sweep_headers, sweep_rows))
        sweep_md = "\n\n### Tile-configuration sweep\n\n" + markdown_table(sweep_headers, sweep_rows)

    markdown = (f"## Decode attention ({num_heads} query heads, {num_kv_heads} KV heads, head_dim {head_dim}, "
                f"block {block_size}, {str(dtype).removeprefix('torch.')})\n\n"
                f"{env}; peak: {peak_source}\n\n" + markdown_table(headers, rows) + f"\n\n{goal_line}" + sweep_md)
    write_results(args.out, "gpu_attention", {"environment": env, "peak_source": peak_source,
                                              "results": records, "sweep": sweep_records}, markdown)
    return 0


def sweep_configs(args, kv_cache, make_inputs, scale, elt, num_kv_heads, head_dim, peak,
                  default_launch_config, AttentionLaunchConfig, paged_attention, time_ms) -> list[dict]:
    """Time tile shapes x warps x stages x (auto split | no split) on a few decode shapes."""
    from kvpilot.kernels.split_kv_decode import choose_num_splits
    import torch

    import time

    device = kv_cache.device
    records = []
    deadline = time.monotonic() + args.sweep_budget_s
    for batch, context in [(1, 48)] if args.smoke else [(32, 2048), (128, 8192), (4, 32768)]:
        if batch * context > args.max_tokens:
            continue
        query, block_tables, seq_lens, query_start_loc = make_inputs(batch, context)
        queries_per_kv = query.shape[1] // num_kv_heads
        default = default_launch_config(1, queries_per_kv, head_dim, device)
        kv_bytes = 2 * batch * context * num_kv_heads * head_dim * elt
        shape_records = []
        for (tile_n, warps, stages), splits in itertools.product(SWEEP_TILES, (None, 1)):
            if time.monotonic() > deadline:
                print(f"  sweep budget of {args.sweep_budget_s:.0f} s spent; stopping at batch {batch} x {context}")
                break
            config = AttentionLaunchConfig(block_m=default.block_m, tile_n=tile_n, num_warps=warps, num_stages=stages)

            def run(config=config, splits=splits):
                paged_attention(query, kv_cache, block_tables, seq_lens, query_start_loc, max_query_len=1,
                                max_seq_len=context, scale=scale, num_splits=splits, config=config)

            try:
                ms = time_ms(run, device, max(5, args.reps // 3))
            except Exception as exc:  # a config that does not fit shared memory is a data point, not an error
                print(f"  config tile_n={tile_n} warps={warps} stages={stages} failed: {type(exc).__name__}")
                continue
            used_splits = choose_num_splits(batch, num_kv_heads, 1, context, device) if splits is None else 1
            shape_records.append(dict(batch=batch, context=context, tile_n=tile_n, num_warps=warps,
                                      num_stages=stages, num_splits=used_splits, us=ms * 1e3,
                                      peak_fraction=kv_bytes / (ms * 1e-3) / peak if peak else None,
                                      is_default=(config == default and splits is None)))
        shape_records.sort(key=lambda r: r["us"])
        records += shape_records[:6] + [r for r in shape_records[6:] if r["is_default"]]
        del query, block_tables
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
