"""One measured pass of one system over the structured-outputs peer workload, in a process of its own.

structured_outputs.py starts this script once per run, so every run begins with a fresh engine (no
compiled grammar, prefix cache or warmed allocator carried over), kvpilot under kvpilot's Python
and vLLM under its own virtualenv's. It imports nothing from kvpilot at module level.

    python structured_outputs_worker.py {kvpilot|vllm} WORKLOAD.json RESULT.json --threads N

The workload file holds ``model`` (a Hugging Face folder), ``dtype``, ``conversations``,
``schema`` and ``max_tokens``; the result file gets the seconds of the constrained ``chat`` call,
its output token count and the texts (the parent validates them against the schema), then the
same for the same chats unconstrained (EOS ignored, each as many tokens as its constrained answer:
the same batch, shrinking the same way), which tells the engine's own speed from the constraint's
cost. Prefix caching is off on both, so the second pass recomputes its prompts as the first did.
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
              max_model_len=MAX_MODEL_LEN, kv_cache_memory=1 << 30, enable_prefix_caching=False)
    constraint = {"json": workload["schema"], "disable_any_whitespace": True}
    return _timed(llm, SamplingParams, workload,
                  SamplingParams(temperature=0.0, max_tokens=workload["max_tokens"], structured_outputs=constraint))


def run_vllm(workload: dict, threads: int) -> dict:
    # Cores and KV space come from the environment structured_outputs.py sets (vllm_cpu_env).
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model=workload["model"], dtype=workload["dtype"], max_num_seqs=MAX_NUM_SEQS,
              max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)
    constraint = StructuredOutputsParams(json=workload["schema"], disable_any_whitespace=True)
    result = _timed(llm, SamplingParams, workload,
                    SamplingParams(temperature=0.0, max_tokens=workload["max_tokens"], structured_outputs=constraint))
    result["backend"] = str(llm.llm_engine.vllm_config.structured_outputs_config.backend)
    return result


def _timed(llm, sampling_params, workload: dict, constrained) -> dict:
    """The constrained chat of every conversation, after an unconstrained warm-up on two others,
    then the same chats unconstrained, each for as many tokens as its constrained answer."""
    conversations = workload["conversations"]
    llm.chat([[{"role": "user", "content": "Say hi."}], [{"role": "user", "content": "Count to three."}]],
             sampling_params(temperature=0.0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.chat(conversations, constrained, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    free = [sampling_params(temperature=0.0, max_tokens=len(o.outputs[0].token_ids), ignore_eos=True)
            for o in outputs]
    start = time.perf_counter()
    free_outputs = llm.chat(conversations, free, use_tqdm=False)
    free_seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "texts": [o.outputs[0].text for o in outputs],
        "unconstrained_output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in free_outputs) / free_seconds,
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
