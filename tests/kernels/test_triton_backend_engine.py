"""The engine with attention_backend="triton" generates the torch backend's greedy tokens.

On CPU the triton backend runs interpreted; with KVPILOT_TEST_DEVICE=cuda both run on the GPU and
the triton engine also replays its decode steps through CUDA graphs.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

pytest.importorskip("safetensors", reason="the engine loads checkpoints with safetensors")
pytest.importorskip("tokenizers", reason="the engine needs tokenizers")

from kvpilot.engine import LLM, SamplingParams  # noqa: E402
from kvpilot.engine.model_files import make_model  # noqa: E402

DEVICE = os.environ.get("KVPILOT_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny-llama-triton"), preset="tiny", arch="llama", seed=0)


def test_triton_backend_matches_torch_backend_greedy(model_dir):
    # Two prompts share a 20-token prefix (prefix-cache hit: attention over cached blocks); a small
    # token budget chunks the long prompt and mixes prefill chunks with decodes in one batch.
    shared = list(range(40, 60))
    prompts = [shared + [7, 8, 9], list(range(100, 137)), shared + [11], [5, 6]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    memory = {"kv_cache_memory": 1 << 22} if DEVICE == "cpu" else {"gpu_memory_utilization": 0.05}
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(model_dir), dtype="float32", device=DEVICE, attention_backend=backend, block_size=8,
                  max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, **memory)
        assert llm.llm_engine.resolved.attention_backend == backend
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    assert all(len(tokens) == 8 for tokens in outputs["triton"])
    assert outputs["triton"] == outputs["torch"]
