"""Decode throughput of a Llama-3-8B-shaped model with random weights, against its bandwidth roofline.

The model is the engine's own CausalLM (engine/models) built directly in GPU memory with random
bfloat16 weights (no 16 GB checkpoint on disk), its paged KV cache filled with random values so that
every sequence already holds `context` tokens. Each decode step is what the engine runs for a
decode-only batch: the model forward replayed from its CUDA graph (engine/cuda_graphs.py, triton
attention backend), the LM head, and a greedy argmax fed back as the next input. Host-side scheduling,
sampling options and detokenization are not included.

Roofline: a decode step must read every weight once (the embedding table aside: only the batch's rows)
plus the batch's KV cache, so tokens/s <= batch / (bytes read / peak HBM bandwidth). Reported against
the weights-only bound (the classic small-batch roofline) and against weights + KV.

  python benchmarks/gpu_decode.py --out results/      # on a GPU
  python benchmarks/gpu_decode.py --smoke             # CPU, Triton interpreter, tiny model
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import types

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
}
TINY = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 256,
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--batches", default="1,8,32,64,128,256", help="comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=1024, help="tokens already cached per sequence")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--peak-bw-tbs", type=float, default=None,
                        help="peak HBM bandwidth in TB/s (default: from the device name, or $KVPILOT_PEAK_BW_TBS)")
    parser.add_argument("--out", default=os.environ.get("OUT", ""),
                        help="folder for gpu_decode.json/.md (default: $OUT; empty = print only)")
    args = parser.parse_args()
    try:
        args.batches = sorted({int(b) for b in args.batches.split(",")})
    except ValueError:
        parser.error("--batches takes comma-separated integers, e.g. --batches 1,32,128")
    if args.smoke:
        args.batches, args.context, args.steps = [1, 3], 20, 2
    if min(args.batches) < 1 or args.context < 1 or args.steps < 1:
        parser.error("--batches, --context and --steps must be positive")
    return args


def _allow_models_import_without_safetensors() -> None:
    """GPU machines may lack safetensors, which kvpilot.engine.models imports to load checkpoints.

    This benchmark never loads a checkpoint, so a placeholder module that raises on use is enough.
    """
    if importlib.util.find_spec("safetensors") is not None:
        return
    placeholder = types.ModuleType("safetensors")

    class SafetensorError(Exception):
        pass

    def safe_open(*args, **kwargs):
        raise RuntimeError("safetensors is not installed; gpu_decode.py builds its weights in memory")

    placeholder.SafetensorError, placeholder.safe_open = SafetensorError, safe_open
    sys.modules["safetensors"] = placeholder
    print("note: safetensors is not installed; using a placeholder (no checkpoint is loaded here)")


KERNEL_CATEGORIES = ("attention", "kv store", "matmul", "other")
_MATMUL_MARKERS = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "ampere_", "aten::mm",
                   "aten::addmm", "aten::bmm")


def _category(name: str) -> str:
    lowered = name.lower()
    if "paged_attention" in lowered or "merge_splits" in lowered:
        return "attention"
    if "kv_cache_store" in lowered:
        return "kv store"
    if any(marker in lowered for marker in _MATMUL_MARKERS):
        return "matmul"
    return "other"  # norms, RoPE, activations, residual adds, embedding, argmax: fusion candidates


def kernel_time_breakdown(model, forward, batch, args, arch, device, block_size, blocks_per_seq) -> dict:
    """Milliseconds of one eager decode step (forward + LM head + argmax) per kernel category."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvpilot.engine.attention import AttentionMetadata

    position = args.context
    block_tables = (torch.arange(batch * blocks_per_seq, device=device) + 1).view(batch, blocks_per_seq).int()
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), position + 1, dtype=torch.int32, device=device),
        block_tables=block_tables,
        slot_mapping=block_tables[:, position // block_size].long() * block_size + position % block_size,
        max_query_len=1, max_seq_len=position + 1,
        query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[position + 1] * batch)
    ids = torch.zeros(batch, dtype=torch.int64, device=device)
    positions = torch.full((batch,), position, dtype=torch.int64, device=device)
    on_cuda = device.type == "cuda"

    def step():
        return model.compute_logits(forward(ids, positions, metadata)).argmax(dim=-1)

    with torch.inference_mode():
        step()  # warm: nothing compiles inside the profile
        if on_cuda:
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CUDA] if on_cuda else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            step()
            if on_cuda:
                torch.cuda.synchronize()
    totals = dict.fromkeys(KERNEL_CATEGORIES, 0.0)
    for event in prof.key_averages():
        if on_cuda:
            micros = getattr(event, "self_device_time_total", None)
            if micros is None:
                micros = getattr(event, "self_cuda_time_total", 0.0)
        elif event.key.startswith("aten::") or "_kernel" in event.key:
            micros = event.self_cpu_time_total
        else:
            continue
        totals[_category(event.key)] += micros / 1e3
    return totals


def main() -> int:
    args = parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    _allow_models_import_without_safetensors()
    from gpu_common import environment, format_table, markdown_table, peak_bandwidth, write_results
    from kvpilot.engine.attention import AttentionMetadata, get_attention_backend
    from kvpilot.engine.cuda_graphs import DecodeCudaGraphs
    from kvpilot.engine.models import CausalLM
    from kvpilot.engine.models.config import parse_model_arch
    from kvpilot.engine.models.linear_assembly import LinearAssembler
    from kvpilot.engine.models.weight_targets import linear_slots

    if args.smoke:
        device, dtype, config, source = torch.device("cpu"), torch.float32, TINY, "tiny (random weights)"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on a GPU, or pass --smoke for the CPU code-path check")
        device, dtype, config, source = torch.device("cuda"), torch.bfloat16, LLAMA3_8B, "Llama-3-8B-shaped (random weights)"
    peak, peak_source = peak_bandwidth(device, args.peak_bw_tbs)
    env = environment(device)
    print(f"decode throughput | {source} | {env} | peak: {peak_source}")

    arch = parse_model_arch(config, {}, source)
    torch.manual_seed(0)
    with torch.no_grad():
        model = CausalLM(arch, dtype, device)
        for param in model.parameters():
            param.fill_(1.0)  # norm weights (and biases)
        assembler = LinearAssembler(linear_slots(model), dtype, device, source, keep_packed=False)
        for module, slot in assembler.slots.items():  # dense matrices, made on the device
            assembler.add(module, torch.empty(slot.shape, dtype=dtype, device=device).normal_(0.0, 0.02))
    elt = torch.tensor([], dtype=dtype).element_size()
    embed_bytes = model.embed_tokens.nbytes
    param_bytes = sum(p.numel() for p in model.parameters()) * elt
    # Untied: the embedding table is only gathered (batch rows); tied: it is also the LM head, read whole.
    weights_read = param_bytes - (0 if arch.tie_word_embeddings else embed_bytes)
    print(f"model: {param_bytes / 1e9:.2f} GB of weights, {weights_read / 1e9:.2f} GB read per decode step")

    block_size, max_batch = args.block_size, max(args.batches)
    max_len = args.context + args.steps + 2
    blocks_per_seq = -(-max_len // block_size)
    num_blocks = max_batch * blocks_per_seq + 1
    kv_shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    kv_caches = [torch.empty(kv_shape, dtype=dtype, device=device).normal_() for _ in range(arch.num_layers)]
    kv_bytes_per_token = arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * elt
    print(f"KV cache: {num_blocks} blocks of {block_size} per layer, {len(kv_caches) * kv_caches[0].numel() * elt / 1e9:.1f} GB")
    backend = get_attention_backend("triton")

    def forward(input_ids, positions, metadata):
        return model(input_ids, positions, kv_caches, metadata, backend)

    use_graphs = device.type == "cuda"
    graphs = DecodeCudaGraphs(forward, sizes=args.batches, max_model_len=max_len, block_size=block_size,
                              device=device, use_graphs=use_graphs)
    start = time.perf_counter()
    if use_graphs:
        graphs.capture()
        print(f"captured {len(args.batches)} CUDA graphs in {time.perf_counter() - start:.1f} s")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    rows, records = [], []
    for batch in args.batches:
        block_tables = (torch.randperm(num_blocks - 1, device=device)[: batch * blocks_per_seq] + 1)
        block_tables = block_tables.view(batch, blocks_per_seq).to(torch.int32)
        steps = []  # (positions, metadata) of each step; built up front so the timed loop is the GPU's work
        for step in range(args.steps + 1):
            position = args.context + step
            positions = torch.full((batch,), position, dtype=torch.int64, device=device)
            slots = block_tables[:, position // block_size].long() * block_size + position % block_size
            steps.append((positions, AttentionMetadata(
                query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
                seq_lens=torch.full((batch,), position + 1, dtype=torch.int32, device=device),
                block_tables=block_tables, slot_mapping=slots, max_query_len=1, max_seq_len=position + 1,
                query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[position + 1] * batch)))

        def decode(run_forward) -> float:
            """Seconds per step over args.steps steps, after one warm-up step."""
            ids = torch.randint(0, arch.vocab_size, (batch,), device=device)
            for index, (positions, metadata) in enumerate(steps):
                if index == 1:
                    sync()
                    begin = time.perf_counter()
                hidden = run_forward(ids, positions, metadata)  # [batch, hidden_size]
                ids = model.compute_logits(hidden).argmax(dim=-1)
            sync()
            return (time.perf_counter() - begin) / args.steps

        with torch.inference_mode():
            graph_step = decode(graphs.run)
            eager_step = decode(forward)
        kv_read = batch * (args.context + args.steps // 2) * kv_bytes_per_token
        weights_step = weights_read + batch * arch.hidden_size * elt
        roof_weights = batch / (weights_step / peak) if peak else None
        roof_all = batch / ((weights_step + kv_read) / peak) if peak else None
        tps, eager_tps = batch / graph_step, batch / eager_step
        rows.append([batch, args.context, graph_step * 1e3, tps, eager_tps, roof_weights,
                     tps / roof_weights if peak else None, roof_all, tps / roof_all if peak else None])
        records.append(dict(batch=batch, context=args.context, step_ms=graph_step * 1e3, tokens_per_s=tps,
                            eager_tokens_per_s=eager_tps, weights_roofline_tokens_per_s=roof_weights,
                            fraction_of_weights_roofline=tps / roof_weights if peak else None,
                            weights_kv_roofline_tokens_per_s=roof_all,
                            fraction_of_weights_kv_roofline=tps / roof_all if peak else None))

    breakdown_rows = []
    for batch in sorted({args.batches[0], *[b for b in args.batches if b in (32, 256)], args.batches[-1]}):
        shares = kernel_time_breakdown(model, forward, batch, args, arch, device, block_size, blocks_per_seq)
        breakdown_rows.append([batch] + [shares.get(c) for c in KERNEL_CATEGORIES])
        records_by_batch = {r["batch"]: r for r in records}
        records_by_batch[batch]["kernel_time_ms"] = shares

    headers = ["batch", "context", "step ms", "tok/s (graph)", "tok/s (eager)", "roofline tok/s (weights)",
               "of roofline", "roofline tok/s (weights+KV)", "of roofline"]
    print(format_table(headers, rows))
    breakdown_headers = ["batch"] + [f"{c} ms" for c in KERNEL_CATEGORIES]
    unit = "GPU kernel" if device.type == "cuda" else "CPU op"
    print(f"\n{unit} time of one eager decode step by kind (profiler; the graph replays the same kernels)")
    print(format_table(breakdown_headers, breakdown_rows))
    markdown = (f"## Decode throughput: {source}, {str(dtype).removeprefix('torch.')}, block {block_size}\n\n"
                f"{env}; peak: {peak_source}; {weights_read / 1e9:.2f} GB of weights read per step\n\n"
                + markdown_table(headers, rows)
                + f"\n\n### {unit} time of one decode step by kind\n\n" + markdown_table(breakdown_headers, breakdown_rows))
    write_results(args.out, "gpu_decode", {"environment": env, "peak_source": peak_source, "model": source,
                                           "weights_read_bytes": weights_read, "results": records}, markdown)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
