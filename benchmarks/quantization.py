"""Weights kept quantized against the same model unquantized, measured in one run on the CPU.

For ``--model smollm2`` (the default), three variants of SmolLM2-135M-Instruct, all with bfloat16
activations:
- ``bf16``: its GGUF file dequantized at load into bfloat16 (``quantization="none"``): the reference;
- ``gguf-packed``: the same file with its Q4_1 matrices and Q8_0 embedding kept packed (``"gguf"``),
  as the engine serves it: on a CPU with AVX-512 VNNI the matmuls round x to int8
  (kernels/cpu_int8_matmul.c);
- ``gguf-torch-int4``: the same, with the 4-bit matmuls on torch's int4 kernel, the 8-bit LM head
  on kvpilot's bfloat16 kernel, x in bfloat16 throughout (what a CPU without AVX-512 VNNI gets):
  what the int8 activations add, in speed and in perplexity;
- ``awq-rtn``: ``kvpilot quantize`` of the bfloat16 Hugging Face copy (benchmarks/serving_common.py),
  4-bit round-to-nearest in AWQ's layout, served packed (``"awq"``).
For ``--model small`` or a folder: ``bf16`` (the folder) and ``awq-rtn`` (its ``kvpilot quantize`` copy).

Each run is a fresh process (``--worker``) with ``--threads`` threads, which measures:
- weight memory: bytes of every parameter and packed buffer of the loaded model;
- decode throughput at batch 1, 4 and 8: B prompts of 32 tokens are prefilled in one step, then
  the following steps (B tokens each, ``--decode-tokens`` per sequence) are timed; one untimed
  generate warms up first (kernel builds, oneDNN), in every variant alike;
- perplexity of a fixed ~300-token passage (the one the SmolLM2 quality test uses), with the weights
  in the layouts the engine serves with (CausalLM.pack_weights_for_cpu).
Variants take turns (the order rotates each round), ``--repeat`` rounds; every run is printed, then
each figure's median with its min-max, and the ratios of medians against ``bf16`` with the
issue's goals (weight memory <= 0.3x, decode >= 1.5x at every batch, perplexity within 3 %).

    python benchmarks/quantization.py                  # SmolLM2, 3 rounds
    python benchmarks/quantization.py --model small    # the generated ~100M preset (random weights)
    python benchmarks/quantization.py --quick          # one round, short decode: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from serving_common import MODEL_CACHE, benchmark_model

BATCHES = (1, 4, 8)
PROMPT_TOKENS = 32
GOALS = {"weight memory": 0.3, "decode": 1.5, "perplexity": 0.03}
TORCH_INT4 = "gguf-torch-int4"  # the variant run without kvpilot's int8-activation kernel


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2",
                        help="`smollm2` (default): SmolLM2-135M-Instruct; `small`: the generated preset; or a folder")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads in every run")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; every variant runs once per round")
    parser.add_argument("--decode-tokens", type=int, default=96, help="tokens decoded per sequence (timed)")
    parser.add_argument("--quick", action="store_true", help="one round, 16 decode tokens: a smoke run")
    parser.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    parser.add_argument("--worker", nargs=3, metavar=("NAME", "PATH", "QUANTIZATION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.repeat, args.decode_tokens = 1, 16
    return args


# ----------------------------------------------------------------------------------- variants


def variants(model: str) -> dict[str, tuple[Path, str]]:
    """name -> (model path, quantization)."""
    if model == "smollm2":
        from kvpilot.engine.model_fetch import fetch_model

        gguf = fetch_model("smollm2-135m")
        return {"bf16": (gguf, "none"), "gguf-packed": (gguf, "gguf"), TORCH_INT4: (gguf, "gguf"),
                "awq-rtn": (awq_copy(benchmark_model("smollm2")), "awq")}
    folder = benchmark_model(model)
    return {"bf16": (folder, "none"), "awq-rtn": (awq_copy(folder), "awq")}


def awq_copy(folder: Path) -> Path:
    """``kvpilot quantize`` of folder (largest group size that divides every layer), made once."""
    config = json.loads((folder / "config.json").read_text())
    sizes = (config["hidden_size"], config["intermediate_size"])
    group_size = next(g for g in (128, 64, 32) if all(s % g == 0 for s in sizes))
    out = MODEL_CACHE / f"{folder.name}-awq-rtn-g{group_size}"
    if not (out / "config.json").exists():
        from kvpilot.engine.awq_writer import quantize_model

        tmp = out.with_name(out.name + ".tmp")
        quantize_model(folder, tmp, group_size=group_size)
        tmp.rename(out)
    return out


# ----------------------------------------------------------------------------------- one run


def worker(name: str, path: str, quantization: str, args: argparse.Namespace) -> dict:
    import torch

    from kvpilot.engine import LLM, SamplingParams
    from kvpilot.engine.models import load_model, load_tokenizer
    from kvpilot.engine.scoring import EVAL_PASSAGE, perplexity, sequence_logits

    torch.set_num_threads(args.threads)
    if name == TORCH_INT4:  # as on a CPU where the int8-activation kernel does not build
        from kvpilot.kernels import cpu_int8_matmul

        cpu_int8_matmul.load_kernel = lambda bits, group_size: None
    started = time.perf_counter()
    model = load_model(path, torch.bfloat16, "cpu", quantization=quantization)
    load_s = time.perf_counter() - started
    weight_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    tokens = load_tokenizer(path)(EVAL_PASSAGE).input_ids
    model.pack_weights_for_cpu(batch_size_hint=max(BATCHES))  # the layouts the engine serves with
    ppl = perplexity(sequence_logits(model, tokens), tokens)
    del model

    llm = LLM(path, dtype="bfloat16", device="cpu", quantization=quantization, max_num_seqs=max(BATCHES),
              max_model_len=512, kv_cache_memory=256 << 20, enable_prefix_caching=False)
    llm.generate([tokens[:PROMPT_TOKENS]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    decode = {batch: decode_tokens_per_second(llm, tokens, batch, args.decode_tokens) for batch in BATCHES}
    return {"variant": name, "weight_bytes": weight_bytes, "perplexity": ppl, "load_s": load_s,
            "decode_tok_s": decode}


def decode_tokens_per_second(llm, tokens: list[int], batch: int, decode_tokens: int) -> float:
    from kvpilot.engine import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens + 1, ignore_eos=True)
    for i in range(batch):
        prompt = tokens[i : i + PROMPT_TOKENS]  # distinct prompts, no shared prefix
        engine.add_request(f"bench-{batch}-{i}", prompt, params)
    engine.step()  # every prompt prefilled in one step (first token out)
    started, produced = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        produced += batch
    return produced / (time.perf_counter() - started)


# ----------------------------------------------------------------------------------- the run


def run_variant(name: str, path: Path, quantization: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--worker", name, str(path), quantization,
               "--threads", str(args.threads), "--decode-tokens", str(args.decode_tokens)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name} run failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict], names: list[str]) -> None:
    def figure(run: dict, key: str) -> float:
        return run["decode_tok_s"][key] if key in run["decode_tok_s"] else run[key]

    keys = ["weight_bytes", "perplexity", *(str(b) for b in BATCHES)]
    labels = {"weight_bytes": "weight MiB", "perplexity": "perplexity",
              **{str(b): f"decode tok/s, batch {b}" for b in BATCHES}}
    medians: dict[str, dict[str, float]] = {}
    print("\nmedian [min-max] per variant:")
    for name in names:
        mine = [r for r in runs if r["variant"] == name]
        medians[name] = {}
        cells = []
        for key in keys:
            values = [figure(r, key) for r in mine]
            scale = 1 / 2**20 if key == "weight_bytes" else 1.0
            medians[name][key] = statistics.median(values)
            cells.append(f"{labels[key]} {medians[name][key] * scale:.2f} "
                         f"[{min(values) * scale:.2f}-{max(values) * scale:.2f}]")
        print(f"  {name:15s} " + "; ".join(cells))
    reference = medians["bf16"]
    print("\nratios of medians against bf16 (goal in brackets):")
    for name in names[1:]:
        ours = medians[name]
        memory = ours["weight_bytes"] / reference["weight_bytes"]
        ppl = ours["perplexity"] / reference["perplexity"] - 1
        speedups = {b: ours[str(b)] / reference[str(b)] for b in BATCHES}
        verdict = (lambda ok: "met" if ok else "MISSED")  # noqa: E731
        print(f"  {name}: weight memory {memory:.3f}x [<= {GOALS['weight memory']}x: {verdict(memory <= 0.3)}]; "
              + ", ".join(f"decode batch {b} {s:.2f}x" for b, s in speedups.items())
              + f" [>= {GOALS['decode']}x: {verdict(min(speedups.values()) >= GOALS['decode'])}]; "
              f"perplexity {ppl * 100:+.2f}% [within 3%: {verdict(abs(ppl) <= GOALS['perplexity'])}]")


def main() -> None:
    args = parse_args()
    if args.worker:
        name, path, quantization = args.worker
        print(json.dumps(worker(name, path, quantization, args)))
        return
    chosen = variants(args.model)
    names = list(chosen)
    print(f"model {args.model}, {args.threads} threads, {args.repeat} rounds, {args.decode_tokens} decode tokens "
          f"per sequence, batches {BATCHES}; variants: "
          + ", ".join(f"{n} ({p.name}, quantization={q})" for n, (p, q) in chosen.items()), flush=True)
    runs = []
    for round_index in range(args.repeat):
        order = names[round_index % len(names):] + names[: round_index % len(names)]
        for name in order:
            run = run_variant(name, *chosen[name], args)
            run["round"] = round_index
            runs.append(run)
            print(f"round {round_index} {name:15s} weights {run['weight_bytes'] / 2**20:7.1f} MiB, perplexity "
                  f"{run['perplexity']:.4f}, decode tok/s "
                  + ", ".join(f"b{b} {run['decode_tok_s'][str(b)]:.1f}" for b in BATCHES)
                  + f" (load {run['load_s']:.1f} s)", flush=True)
    summarize(runs, names)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
