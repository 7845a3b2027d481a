"""Decode-only CPU steps in one C call (engine/cpu_decode.py): the same tokens and logprobs as the
layer-by-layer path, bit for bit, step after step (so the K/V it stores are the same too), for
llama and qwen2 (q/k/v biases) in float32 and bfloat16 on both int8-kernel instruction sets; and
taken only where it applies."""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.kernels import cpu_features

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(cpu_features.detect().int8_matmul_isa is None, reason="no int8-activation kernel here"),
]

# Contexts across block boundaries (block size 16) and of different lengths in one batch.
PROMPTS = [[1, 17, 230, 5, 99], [1, 400, 401, 402] * 5, [1, 7] * 9, list(range(3, 40))]
KW = {"device": "cpu", "max_model_len": 256, "kv_cache_memory": 16 << 20, "block_size": 16}


@pytest.mark.parametrize("cpu", ["this", "avx2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decode_steps_give_the_layer_by_layer_tokens_and_logprobs_bit_for_bit(arch, dtype, cpu, awq_model_dirs,
                                                                              cpu_without):
    if cpu == "avx2":
        cpu_without("avx512f")  # an AVX-512 machine runs the AVX2 kernels too
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)
    outputs = {}
    for eager in (True, False):
        llm = LLM(str(awq_model_dirs[arch]), dtype=dtype, enforce_eager=eager, **KW)
        assert (llm.llm_engine.runner.cpu_decode is None) == eager
        outputs[eager] = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for fused, layered in zip(outputs[False], outputs[True], strict=True):
        assert fused.token_ids == layered.token_ids
        assert fused.logprobs == layered.logprobs  # exact: the same kernels on the same values


def test_taken_only_for_packed_int8_kernel_weights_without_lora(awq_model_dirs, tiny_model_dirs):
    packed = LLM(str(awq_model_dirs["llama"]), dtype="float32", **KW)
    runner = packed.llm_engine.runner
    assert runner.cpu_decode is not None
    runner.cpu_decode, runner.lora = None, object()  # adapters' rows change per step: no one-call path
    assert not runner.enable_cpu_decode_path()
    dense = LLM(str(tiny_model_dirs["llama"]), dtype="float32", **KW)  # float weights: torch's matmuls
    assert dense.llm_engine.runner.cpu_decode is None
