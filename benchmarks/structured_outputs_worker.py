"""One measured pass of one system over the structured-outputs peer workload, in a process of its own.

structured_outputs.py starts this script once per run, so every run begins with a fresh engine (no
compiled grammar, prefix cache or warmed allocator carried over), kvpilot under kvpilot's Python
and vLLM under its own virtualenv's. It imports nothing from kvpilot at module level.

    python structured_outputs_worker.py {kvpilot|vllm} WORKLOAD.json RESULT.json --threads N

The workload file holds ``model`` (a Hugging Face folder), ``dtype``, ``conversations``,
``schema`` and ``max_tokens``; the result file gets the seconds of the constrained ``chat`` call,
its output token count and the texts (the parent validates them against the schema).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

MAX_MODEL_LEN, MAX_NUM_SEQS = 1024, 16


def run_kvpilot(workload: dict, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from kvpilot.engine import LLM, SamplingParams

    llm = LLM(workload["model"], dtype=workload["dtype"], device="cpu", max_num_seqs=MAX_NUM_SEQS,
              max_model_len=MAX_MODEL_LEN, kv_cache_memory=1 << 30)
    constraint = {"json": workload["schema"], "disable_any_whitespace": True}
    return _timed(llm, SamplingParams(temperature=0.0, max_tokens=4),
                  SamplingParams(temperature=0.0, max_tokens=workload["max_tokens"], structured_outputs=constraint),
                  workload["conversations"])


def run_vllm(workload: dict, threads: int) -> dict:
    # Cores and KV space come from the environment structured_outputs.py sets (vllm_cpu_env).
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model=workload["model"], dtype=workload["dtype"], max_num_seqs=MAX_NUM_SEQS,
              max_model_len=MAX_MODEL_LEN)
    constraint = StructuredOutputsParams(json=workload["schema"], disable_any_whitespace=True)
    result = _timed(llm, SamplingParams(temperature=0.0, max_tokens=4),
                    SamplingParams(temperature=0.0, max_tokens=workload["max_tokens"], structured_outputs=constraint),
                    workload["conversations"])
    result["backend"] = str(llm.llm_engine.vllm_config.structured_outputs_config.backend)
    return result


def _timed(llm, warm_up, constrained, conversations: list) -> dict:
    """The constrained chat of every conversation, after an unconstrained warm-up on two others."""
    llm.chat([[{"role": "user", "content": "Say hi."}], [{"role": "user", "content": "Count to three."}]],
             warm_up, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.chat(conversations, constrained, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "texts": [o.outputs[0].text for o in outputs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("system", choices=("kvpilot", "vllm"))
    parser.add_argument("workload", type=Path)
    parser.add_argument("result", type=Path)
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args()
    workload = json.loads(args.workload.read_text())
    result = {"kvpilot": run_kvpilot, "vllm": run_vllm}[args.system](workload, args.threads)
    result["output_tokens_per_s"] = result["output_tokens"] / result["seconds"]
    args.result.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
