"""One measured pass of one system over the offline workload, in a process of its own.

offline_throughput.py starts this script once per run, so every run begins with a fresh engine
(no prefix cache, no warmed allocator carried over) and each system runs under its own Python:
vLLM from its virtualenv, kvpilot and transformers from kvpilot's. It imports nothing from
kvpilot at module level, so the vLLM virtualenv can run it.

    python offline_worker.py {kvpilot|vllm|hf} WORKLOAD.json RESULT.json [options]

The workload file holds ``model``, ``prompts`` (token ids) and ``output_lens``, and optionally
``loras`` (PEFT adapter folders, with ``max_lora_rank``) and ``lora_of`` (per request: an index
into ``loras``, or null for the base model); the result file gets the run's seconds, output
tokens/s and what the system reports about itself.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("system", choices=("kvpilot", "vllm", "hf"))
    parser.add_argument("workload", type=Path)
    parser.add_argument("result", type=Path)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=None, help="KV block size (default: the system's)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gib", type=int, required=True,
                        help="kvpilot's KV space (vLLM's comes from VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    return parser.parse_args()


def run_kvpilot(workload: dict, args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from kvpilot.engine import LLM, SamplingParams

    from kvpilot.engine.lora import LoRARequest

    llm = LLM(workload["model"], dtype="bfloat16", device="cpu", max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_gib << 30,
              **({"block_size": args.block_size} if args.block_size else {}), **_lora_options(workload))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload["output_lens"]]
    loras = _lora_requests(workload, LoRARequest)
    # Warm-up on other prompts (the allocator, the thread pool, the decode kernel's first build).
    llm.generate([p[::-1] for p in workload["prompts"][:4]], params[:4], use_tqdm=False, lora_request=loras[:4])
    engine = llm.llm_engine
    before = engine.stats()
    start = time.perf_counter()
    outputs = llm.generate(workload["prompts"], params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    after = engine.stats()
    steps = after.steps_total - before.steps_total
    return {
        "seconds": seconds,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "prefix_cache_hit_tokens": after.prefix_cache_hits_total - before.prefix_cache_hits_total,
        "steps": steps,
        "mean_batch_seqs": (after.step_running_seqs_total - before.step_running_seqs_total) / steps,
        "preemptions": after.preemptions_total - before.preemptions_total,
        "outside_forward_share": 1 - (after.forward_seconds_total - before.forward_seconds_total)
        / (after.step_seconds_total - before.step_seconds_total),
    }


def run_vllm(workload: dict, args: argparse.Namespace) -> dict:
    # Cores, KV space and preloads come from the environment offline_throughput.py sets (vllm_cpu_env).
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=workload["model"], dtype="bfloat16", max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, **({"block_size": args.block_size} if args.block_size else {}),
              **_lora_options(workload))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload["output_lens"]]
    prompts = [{"prompt_token_ids": p} for p in workload["prompts"]]
    loras = _lora_requests(workload, LoRARequest)
    llm.generate([{"prompt_token_ids": p[::-1]} for p in workload["prompts"][:4]], params[:4], use_tqdm=False,
                 lora_request=loras[:4])
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "prefix_cache_hit_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
    }


def _lora_options(workload: dict) -> dict:
    """The engine arguments for the workload's adapters, the same names in kvpilot and vLLM: every
    adapter resident at once."""
    if not workload.get("loras"):
        return {}
    return {"enable_lora": True, "max_loras": len(workload["loras"]), "max_lora_rank": workload["max_lora_rank"]}


def _lora_requests(workload: dict, request_type) -> list:
    """Per request its LoRARequest (name, id, path: the same signature in kvpilot and vLLM) or None."""
    if not workload.get("loras"):
        return [None] * len(workload["prompts"])
    adapters = [request_type(f"adapter{i}", i + 1, path) for i, path in enumerate(workload["loras"])]
    return [None if index is None else adapters[index] for index in workload["lora_of"]]


def run_hf(workload: dict, args: argparse.Namespace) -> dict:
    """transformers ``generate`` with static batching: batches of --hf-batch-size requests,
    left-padded, every sequence decoded to its batch's longest output; only each request's own
    output tokens count as useful."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(workload["model"], dtype=torch.bfloat16).eval()
    pad_id = model.generation_config.pad_token_id
    pad_id = 0 if pad_id is None else pad_id

    def generate_batch(prompts: list[list[int]], new_tokens: int) -> None:
        width = max(map(len, prompts))
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            # min_new_tokens = max_new_tokens: EOS never ends a sequence early (ignore_eos).
            out = model.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=pad_id)
        assert out.shape[1] == width + new_tokens

    generate_batch([p[::-1] for p in workload["prompts"][:4]], 4)
    prompts, lens, size = workload["prompts"], workload["output_lens"], args.hf_batch_size
    start = time.perf_counter()
    for first in range(0, len(prompts), size):
        generate_batch(prompts[first : first + size], max(lens[first : first + size]))
    return {"seconds": time.perf_counter() - start, "output_tokens": sum(lens), "batch_size": size}


def main() -> None:
    args = parse_args()
    workload = json.loads(args.workload.read_text())
    result = {"kvpilot": run_kvpilot, "vllm": run_vllm, "hf": run_hf}[args.system](workload, args)
    result["output_tokens_per_s"] = result["output_tokens"] / result["seconds"]
    args.result.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
