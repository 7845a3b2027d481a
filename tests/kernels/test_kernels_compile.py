"""Compile the kernels for real GPUs on the CPU: what the interpreter cannot check.

The interpreter runs kernels as numpy code: it never applies Triton's typing rules, shared-memory
limits, or the software pipelining that keeps decode attention at HBM speed. Triton compiles for a
GPU target without a GPU (ptxas ships with it), so these tests compile every kernel (paged attention,
the split-KV merge, the KV-cache store, the quantized matmul, LoRA's BGMV) exactly as its launcher launches it on
Hopper (sm_90) and Ampere (sm_80): launch options, tile sizes and split counts are recorded from the
launchers themselves. They check that each compiles and fits, and that attention's K/V tile loads are
asynchronous copies (pipelined), not synchronous loads.
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
# Streaming multiprocessors of the H100 SXM and the A100: choose_num_splits sizes splits to them.
NUM_SMS = {90: 132, 80: 108}
# (dtype, capability, max_query_len, num_heads, num_kv_heads, head_dim, num_seqs, seq_len)
ATTENTION_CASES = {
    "decode-sm90": ("bf16", 90, 1, 32, 8, 128, 128, 1024),  # Llama-3-8B decode, a full batch: no split
    "prefill-sm90": ("bf16", 90, 512, 32, 8, 128, 1, 512),  # Llama-3-8B prefill
    "split-sm90": ("bf16", 90, 1, 32, 8, 128, 1, 8192),  # one long-context decode: the most splits
    "split-sm80": ("fp16", 80, 1, 32, 8, 128, 4, 2048),  # split-KV decode of a small batch
    "fp32-sm80": ("fp32", 80, 64, 16, 16, 64, 1, 64),  # float32 ("ieee" dots), no GQA
}
# (dtype, capability, num_kv_heads, head_dim)
STORE_CASES = {
    "store-sm90": ("bf16", 90, 8, 128),  # Llama-3-8B (GQA)
    "store-mha-sm80": ("fp16", 80, 32, 128),  # Llama-2-7B (every head its own KV)
}
# (dtype, capability, bits, m, n, k, group_size)
QUANT_CASES = {
    "quant4-decode-sm90": ("bf16", 90, 4, 1, 4096, 4096, 32),  # Q4_1-style weights, one token
    "quant8-prefill-sm80": ("fp16", 80, 8, 512, 4096, 4096, 32),  # Q8_0-style weights, a prefill chunk
}
# (dtype, capability, rows, in_features, out_features, slots, width): LoRA's shrink and expand
LORA_CASES = {
    "lora-qkv-sm90": ("bf16", 90, 256, 4096, 6144, 4, 192),  # Llama-3-8B's qkv_proj, 4 adapters of rank 64
    "lora-down-sm80": ("fp16", 80, 8, 14336, 4096, 2, 16),  # its down_proj, 2 adapters of rank 16
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_POINTER_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
                  torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8"}


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


class _Recorder:
    """Stands in for a @triton.jit kernel in its module: records each launch instead of running it."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def _launches(kernels: list[tuple[object, str]], launcher, *args, **kwargs) -> dict[str, list[tuple[tuple, dict]]]:
    """What ``launcher(*args, **kwargs)`` launches of ``kernels`` ((module, kernel name) pairs), by name."""
    recorders = {name: _Recorder(getattr(module, name)) for module, name in kernels}
    for module, name in kernels:
        setattr(module, name, recorders[name])
    try:
        launcher(*args, **kwargs)
    finally:
        for module, name in kernels:
            setattr(module, name, recorders[name].kernel)
    return {name: recorder.launches for name, recorder in recorders.items()}


def _compile_launch(kernel, launch: tuple[tuple, dict], capability: int) -> dict:
    """Compile ``kernel`` for ``capability`` with the arguments, constexprs and options of one recorded launch."""
    args, kwargs = launch
    constexprs = dict(kwargs)
    # Triton's defaults on CUDA where a launcher leaves them.
    num_warps, num_stages = constexprs.pop("num_warps", 4), constexprs.pop("num_stages", 3)
    runtime = [name for name in kernel.arg_names if name not in constexprs]
    types = {}
    for name, value in zip(runtime, args, strict=True):
        if isinstance(value, torch.Tensor):
            types[name] = "*" + _POINTER_TYPES[value.dtype]
        elif isinstance(value, float):
            types[name] = "fp32"
    return _compile(kernel, types, constexprs, capability, num_warps, num_stages)


def _compile_all() -> dict:
    """Runs in a child process without TRITON_INTERPRET, where triton.jit yields compilable kernels.

    Each kernel is compiled as its launcher launches it on a GPU: the launchers run on CPU tensors of
    the real shapes with their kernels swapped for recorders, with the launch configuration and split
    count their own choosers pick for a CUDA device.
    """
    from kvpilot.kernels import kv_cache_store, lora_bgmv, paged_attention, quant_matmul, split_kv_decode

    results = {}
    cuda = torch.device("cuda", 0)  # only its type and index are read: no GPU is touched
    attention_kernels = [(paged_attention, "_paged_attention_kernel"), (split_kv_decode, "_merge_splits_kernel")]
    for case, (dtype, capability, max_query_len, num_heads, num_kv_heads, head_dim, num_seqs, seq_len) \
            in ATTENTION_CASES.items():
        split_kv_decode._num_sms = lambda _device_index, sms=NUM_SMS[capability]: sms
        config = paged_attention.default_launch_config(max_query_len, num_heads // num_kv_heads, head_dim, cuda)
        num_splits = split_kv_decode.choose_num_splits(num_seqs, num_kv_heads, max_query_len, seq_len, cuda)
        blocks_per_seq = -(-seq_len // 16)
        launches = _launches(
            attention_kernels, paged_attention.paged_attention,
            torch.empty(num_seqs * max_query_len, num_heads, head_dim, dtype=DTYPES[dtype]),
            torch.empty(2, 4, 16, num_kv_heads, head_dim, dtype=DTYPES[dtype]),
            torch.zeros(num_seqs, blocks_per_seq, dtype=torch.int32),
            torch.full((num_seqs,), seq_len, dtype=torch.int32),
            torch.arange(num_seqs + 1, dtype=torch.int32) * max_query_len,
            max_query_len=max_query_len, max_seq_len=seq_len, scale=head_dim ** -0.5,
            num_splits=num_splits, config=config,
        )  # fmt: skip
        (attention,) = launches["_paged_attention_kernel"]
        results[case] = {**_compile_launch(paged_attention._paged_attention_kernel, attention, capability),
                         "num_splits": num_splits}
        if num_splits > 1:
            (merge,) = launches["_merge_splits_kernel"]
            results[f"{case}-merge"] = _compile_launch(split_kv_decode._merge_splits_kernel, merge, capability)
    for case, (dtype, capability, num_kv_heads, head_dim) in STORE_CASES.items():
        num_tokens = 64
        (store,) = _launches(
            [(kv_cache_store, "_kv_cache_store_kernel")], kv_cache_store.kv_cache_store,
            torch.empty(num_tokens, num_kv_heads, head_dim, dtype=DTYPES[dtype]),
            torch.empty(num_tokens, num_kv_heads, head_dim, dtype=DTYPES[dtype]),
            torch.empty(2, 8, 16, num_kv_heads, head_dim, dtype=DTYPES[dtype]),
            torch.arange(num_tokens, dtype=torch.int64),
        )["_kv_cache_store_kernel"]
        results[case] = _compile_launch(kv_cache_store._kv_cache_store_kernel, store, capability)
    for case, (dtype, capability, bits, m, n, k, group_size) in QUANT_CASES.items():
        codes = torch.zeros(n, k // 2, dtype=torch.uint8) if bits == 4 else torch.zeros(n, k, dtype=torch.int8)
        scales = torch.ones(n, k // group_size, dtype=torch.float16)
        (matmul,) = _launches(
            [(quant_matmul, "_quant_matmul_kernel")], quant_matmul.quant_matmul,
            torch.empty(m, k, dtype=DTYPES[dtype]), codes, scales, scales.clone() if bits == 4 else None,
            bits=bits, group_size=group_size,
        )["_quant_matmul_kernel"]
        results[case] = _compile_launch(quant_matmul._quant_matmul_kernel, matmul, capability)
    for case, (dtype, capability, rows, in_features, out_features, slots, width) in LORA_CASES.items():
        shrink, expand = _launches(
            [(lora_bgmv, "_bgmv_kernel")], lora_bgmv.lora_bgmv,
            torch.empty(rows, in_features, dtype=DTYPES[dtype]), torch.empty(rows, out_features, dtype=DTYPES[dtype]),
            torch.empty(slots, width, in_features, dtype=DTYPES[dtype]),
            torch.empty(slots, out_features, width, dtype=DTYPES[dtype]),
            torch.zeros(rows, dtype=torch.int32), torch.full((slots,), width, dtype=torch.int32),
        )["_bgmv_kernel"]
        results[f"{case}-shrink"] = _compile_launch(lora_bgmv._bgmv_kernel, shrink, capability)
        results[f"{case}-expand"] = _compile_launch(lora_bgmv._bgmv_kernel, expand, capability)
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


def test_the_split_cases_split(compiled):
    """choose_num_splits splits the long contexts of few sequences, and nothing else, on these shapes."""
    splits = {case: compiled[case]["num_splits"] for case in ATTENTION_CASES}
    assert splits["decode-sm90"] == splits["prefill-sm90"] == splits["fp32-sm80"] == 1
    assert splits["split-sm90"] > splits["split-sm80"] > 1


@pytest.mark.parametrize("case", [*STORE_CASES, *QUANT_CASES, "split-sm90-merge", "split-sm80-merge",
                                  *(f"{c}-{kind}" for c in LORA_CASES for kind in ("shrink", "expand"))])
def test_store_merge_quantized_matmul_and_lora_kernels_compile_and_fit(compiled, case):
    assert compiled[case]["shared"] <= SHARED_LIMIT[compiled[case]["capability"]]


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
