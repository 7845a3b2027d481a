"""Speculative decoding (n-gram prompt lookup) against plain decoding: SmolLM2-135M, greedy, CPU.

Both modes load SmolLM2-135M-Instruct (its GGUF converted once to a Hugging Face folder) in
``--dtype`` (float32 by default) on ``--threads`` threads.

Workload, made here: chat prompts asking SmolLM2-135M-Instruct to rewrite a passage (written for
this benchmark) with small edits, so the answer copies long runs of the prompt, the case prompt
lookup is for. Greedy decoding, up to ``--max-tokens`` tokens each (the model may stop earlier;
both modes stop at the same token, since their outputs are checked to be identical).

- batch 1: ``--batch1-prompts`` requests, one at a time (max_num_seqs 1).
- batch 32: 32 requests at once (max_num_seqs 32).

Each run is a fresh process (this script with ``--worker``) that loads the model, warms up on a
different prompt, then times ``LLM.generate`` over the workload; plain and speculative runs take
turns, ``--repeat`` rounds. Every run is printed; each mode's median output tokens/s is reported
with its min-max, with the speedup of the medians, and the runs' outputs are compared token by
token (the check fails the benchmark if they differ).

    python benchmarks/speculative.py                    # 3 rounds, batch 1 and 32
    python benchmarks/speculative.py --repeat 1 --batch 1   # a quick look
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                      "prompt_lookup_min": 2}

PASSAGES = (
    "The harbour town woke slowly in winter. Fishing boats lay tied two deep along the stone quay, and "
    "the gulls walked the empty market square as if they owned it. By eight the baker had opened his "
    "shutters, and the smell of bread drifted down to the water, where old men sat on upturned crates "
    "mending nets and arguing about the weather. Nobody hurried. The ferry to the island ran twice a day "
    "in the cold months, and everyone knew its timetable by heart.",
    "To repot a houseplant, water it the day before so the roots hold together. Choose a pot one size "
    "larger than the old one, with a hole in the bottom for drainage. Put a layer of fresh compost in the "
    "new pot, turn the plant upside down with one hand across the soil, and tap the rim of the old pot "
    "until the root ball slides out. Loosen the outer roots gently, set the plant at the same depth as "
    "before, fill around it with compost, and water it well.",
    "The committee met on Tuesday to review the budget for the new library. The architect presented two "
    "designs: a single large reading room with tall windows, and a smaller building with separate rooms "
    "for children, study and local history. Members agreed that the first design was more beautiful but "
    "the second was more practical. After a long discussion they asked the architect to combine the two, "
    "keeping the tall windows and adding a quiet room for study.",
    "Rain had fallen for three days when the river finally broke its banks. The water crept across the "
    "meadow in the night, and by morning the lane to the farm was a shallow brown lake. The farmer moved "
    "his sheep to the high field before breakfast, and his daughter carried the hens, one under each arm, "
    "to the hay loft. In the afternoon the sun came out, and the whole valley shone like a mirror under "
    "a pale blue sky.",
)
EDITS = (
    "Rewrite this passage with small edits: keep every sentence, but change a few words.",
    "Rewrite the following passage with small edits, keeping its meaning and its order.",
    "Copy this passage, making only small edits to the wording.",
    "Rewrite this text with small changes, keeping most of it the same.",
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="rounds; each runs every mode once per batch")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32], choices=(1, 32))
    parser.add_argument("--batch1-prompts", type=int, default=4, help="requests run one at a time at batch 1")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="float32 (default): the output check holds token for token; in bfloat16 the "
                        "verification's wider matmuls round differently and a near-tie can flip")
    parser.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "BATCH"), help=argparse.SUPPRESS)
    return parser.parse_args()


def prompts_for(batch: int, count_at_batch1: int) -> list[list[dict[str, str]]]:
    count = count_at_batch1 if batch == 1 else batch
    return [
        [{"role": "user", "content": f"{EDITS[(i // len(PASSAGES)) % len(EDITS)]}\n\n{PASSAGES[i % len(PASSAGES)]}"}]
        for i in range(count)
    ]


def run_worker(mode: str, batch: int, args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from serving_common import benchmark_model

    from kvpilot.engine import LLM, SamplingParams

    model = benchmark_model("smollm2")
    kwargs = {"speculative_config": SPECULATIVE_CONFIG} if mode == "ngram" else {}
    llm = LLM(str(model), dtype=args.dtype, device="cpu", max_num_seqs=batch, max_model_len=1024, **kwargs)
    tokenizer = llm.get_tokenizer()
    conversations = prompts_for(batch, args.batch1_prompts)
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(["Write one sentence about the sea."], SamplingParams(temperature=0.0, max_tokens=16),
                 use_tqdm=False)  # warm-up: allocator, thread pool, kernels
    engine = llm.llm_engine
    before = engine.stats()
    start = time.perf_counter()
    if batch == 1:
        outputs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = engine.stats()
    token_ids = [o.outputs[0].token_ids for o in outputs]
    result = {
        "mode": mode,
        "batch": batch,
        "seconds": seconds,
        "output_tokens": sum(map(len, token_ids)),
        "steps": after.steps_total - before.steps_total,
        "outputs_sha256": hashlib.sha256(json.dumps(token_ids).encode()).hexdigest(),
        "first_output": outputs[0].outputs[0].text[:200],
    }
    if after.spec_decode is not None:
        drafted = after.spec_decode.num_draft_tokens - before.spec_decode.num_draft_tokens
        accepted = after.spec_decode.num_accepted_tokens - before.spec_decode.num_accepted_tokens
        drafts = after.spec_decode.num_drafts - before.spec_decode.num_drafts
        result["acceptance_rate"] = accepted / drafted if drafted else None
        result["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
    return result


def main() -> int:
    args = parse_args()
    if args.worker:
        mode, batch = args.worker
        print(json.dumps(run_worker(mode, int(batch), args)))
        return 0
    runs: list[dict] = []
    print(f"SmolLM2-135M-Instruct {args.dtype}, {args.threads} threads, greedy, max_tokens {args.max_tokens}; "
          f"speculative: {SPECULATIVE_CONFIG}", flush=True)
    for round_index in range(args.repeat):
        for batch in args.batch:
            modes = ("plain", "ngram") if round_index % 2 == 0 else ("ngram", "plain")
            for mode in modes:
                command = [sys.executable, __file__, "--worker", mode, str(batch),
                           "--threads", str(args.threads), "--max-tokens", str(args.max_tokens), "--dtype", args.dtype,
                           "--batch1-prompts", str(args.batch1_prompts)]
                done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).parent)
                if done.returncode != 0:
                    print(done.stdout, done.stderr, sep="\n", file=sys.stderr)
                    return 1
                run = json.loads(done.stdout.strip().splitlines()[-1])
                run["round"] = round_index
                runs.append(run)
                extra = ""
                if run.get("acceptance_rate") is not None:
                    extra = (f", acceptance {run['acceptance_rate']:.2f}, "
                             f"mean acceptance length {run['mean_acceptance_length']:.2f}")
                print(f"round {round_index} batch {batch:>2} {mode:>5}: {run['output_tokens']} tokens in "
                      f"{run['seconds']:.2f}s = {run['output_tokens'] / run['seconds']:.1f} tok/s, "
                      f"{run['steps']} steps{extra}", flush=True)
    print()
    ok = True
    for batch in args.batch:
        rates = {}
        for mode in ("plain", "ngram"):
            values = [r["output_tokens"] / r["seconds"] for r in runs if r["batch"] == batch and r["mode"] == mode]
            rates[mode] = statistics.median(values)
            print(f"batch {batch:>2} {mode:>5}: median {rates[mode]:.1f} tok/s (min {min(values):.1f}, "
                  f"max {max(values):.1f}, {len(values)} runs)")
        hashes = {r["outputs_sha256"] for r in runs if r["batch"] == batch}
        identical = len(hashes) == 1
        ok &= identical
        print(f"batch {batch:>2}: speculative / plain = {rates['ngram'] / rates['plain']:.2f}x; outputs "
              f"{'identical in every run' if identical else 'DIFFER between runs'}")
    print(f"first output: {runs[0]['first_output']!r}")
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
