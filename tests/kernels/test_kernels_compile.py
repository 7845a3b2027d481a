"""Compile the kernels for real GPUs on the CPU: what the interpreter cannot check.

The interpreter runs kernels as numpy code: it never applies Triton's typing rules, shared-memory
limits, or the software pipelining that keeps decode attention at HBM speed. Triton compiles for a
GPU target without a GPU (ptxas ships with it), so these tests build the launch configurations the
launchers pick for Hopper (sm_90) and Ampere (sm_80) and check that they fit and that the K/V tile
loads are asynchronous copies (pipelined), not synchronous loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("KVPILOT_TEST_DEVICE", "cpu") == "cuda",
                                reason="on a GPU the other tests compile and run these kernels for real")

# Usable shared memory per block (bytes): H100/H200 and A100.
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
# (dtype, capability, max_query_len, num_heads, num_kv_heads, head_dim, num_splits)
ATTENTION_CASES = {
    "decode-sm90": ("bf16", 90, 1, 32, 8, 128, 1),  # Llama-3-8B decode
    "prefill-sm90": ("bf16", 90, 512, 32, 8, 128, 1),  # Llama-3-8B prefill
    "split-sm80": ("fp16", 80, 1, 32, 8, 128, 8),  # split-KV decode
    "fp32-sm80": ("fp32", 80, 64, 16, 16, 64, 1),  # float32 ("ieee" dots), no GQA
}


def _compile(fn, arg_types: dict, constexprs: dict, capability: int, num_warps: int, num_stages: int) -> dict:
    """Compile like the JIT would at launch (torch pointers and these strides are 16-byte aligned)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else arg_types.get(n, "i32") for n in names}
    aligned = [n for n in names if n.endswith("_ptr") or ("stride" in n and not n.startswith("bt_"))]
    source = ASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    kernel = triton.compile(source, target=GPUTarget("cuda", capability, 64 if capability >= 90 else 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    return {"shared": kernel.metadata.shared, "capability": capability,
            "pipelined": "async_copy_global_to_local" in kernel.asm["ttgir"]}


def _compile_all() -> dict:
    """Runs in a child process without TRITON_INTERPRET, where triton.jit yields compilable kernels."""
    from kvpilot.kernels.kv_cache_store import _kv_cache_store_kernel
    from kvpilot.kernels.paged_attention import _paged_attention_kernel, default_launch_config
    from kvpilot.kernels.split_kv_decode import _merge_splits_kernel

    results = {}
    for case, (dtype, capability, max_query_len, num_heads, num_kv_heads, head_dim, splits) in ATTENTION_CASES.items():
        queries_per_kv = num_heads // num_kv_heads
        # Only the device type is read: no GPU is touched.
        config = default_launch_config(max_query_len, queries_per_kv, head_dim, torch.device("cuda"))
        ptr = f"*{dtype}"
        types = dict(out_ptr=ptr, query_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr, block_tables_ptr="*i32",
                     seq_lens_ptr="*i32", query_start_loc_ptr="*i32", partial_out_ptr="*fp32",
                     partial_lse_ptr="*fp32", qk_scale_log2="fp32")
        constexprs = dict(NUM_HEADS=num_heads, QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim,
                          HEAD_DIM_PAD=head_dim, BLOCK_M=config.block_m, BLOCK_Q=config.block_m // queries_per_kv,
                          TILE_N=config.tile_n, BLOCK_SIZE=16, NUM_SPLITS=splits,
                          DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")
        results[case] = _compile(_paged_attention_kernel, types, constexprs, capability,
                                 config.num_warps, config.num_stages)
    ptr = "*bf16"
    results["store-sm90"] = _compile(
        _kv_cache_store_kernel, dict(key_ptr=ptr, value_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr,
                                     slot_mapping_ptr="*i64"),
        dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_PAD=8, HEAD_DIM_PAD=128, BLOCK_SIZE=16), 90, 4, 1)
    results["merge-sm90"] = _compile(
        _merge_splits_kernel, dict(out_ptr=ptr, partial_out_ptr="*fp32", partial_lse_ptr="*fp32"),
        dict(NUM_HEADS=32, NUM_SPLITS=6, SPLITS_PAD=8, HEAD_DIM=128, HEAD_DIM_PAD=128), 90, 2, 1)
    return results


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"compiling for GPU targets failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_paged_attention_compiles_fits_and_pipelines(compiled, case):
    result = compiled[case]
    assert result["shared"] <= SHARED_LIMIT[result["capability"]]
    assert result["pipelined"], "the K/V tile loads are synchronous: decode would not reach HBM speed"


@pytest.mark.parametrize("case", ["store-sm90", "merge-sm90"])
def test_store_and_merge_kernels_compile(compiled, case):
    assert compiled[case]["shared"] <= SHARED_LIMIT[compiled[case]["capability"]]


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
