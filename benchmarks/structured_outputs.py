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

    python benchmarks/structured_outputs.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model = str(fetch_model("smollm2-135m"))
    print(f"CPU: {cpu_features.detect().summary()}; SmolLM2-135M Q4_1 GGUF, dtype auto, batch {BATCH}, {TOKENS} tokens")
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
