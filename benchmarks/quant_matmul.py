"""The matmuls of one SmolLM2-135M decode step on the CPU, per kernel, at 1, 4 and 8 rows.

What benchmarks/quantization.py measures end to end (a whole engine step), this isolates: the 120
linear layers of SmolLM2-135M's 30 decoder layers (q/k/v 960x576, o 576x576, gate/up 3072x576,
down 576x1536) and its LM head (49152x576), with random weights of those shapes, multiplied by
- ``bf16``: dense bfloat16 weights prepacked for oneDNN, as the engine runs an unquantized model;
- ``torch-int4``: 4-bit codes (group 32) on torch's int4 kernel, the head 8-bit on kvpilot's
  bfloat16 C kernel (a CPU without AVX-512 VNNI);
- ``int8``: the same codes on kvpilot's int8-activation kernel, the head too (kernels/cpu_int8_matmul.c).
Every kernel holds 30 separate layers, as a model does, so a step streams its weights from memory
(bfloat16 257 MiB, packed about 90 MiB: more than the CPU's caches) rather than reusing one
matrix from cache. The engine's own ``linear`` dispatches every call.

Rounds: each kernel times ``--steps`` steps in turn (the order rotates), ``--repeat`` rounds; every
round is printed, then each kernel's median ms a step with min-max and the ratios of the medians.

    python benchmarks/quant_matmul.py
    python benchmarks/quant_matmul.py --threads 1 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kvpilot.engine.models.llama import linear
from kvpilot.engine.quantization.linear import QuantizedLinear
from kvpilot.engine.quantization.packed import PackedWeight
from kvpilot.kernels import cpu_int8_matmul

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in): q/k/v, o, gate/up, down
NUM_LAYERS = 30
HEAD_SHAPE = (49152, 576)
GROUP_SIZE = 32  # SmolLM2's GGUF: Q4_1 layers, Q8_0 head
ROWS = (1, 4, 8)
KERNELS = ("bf16", "torch-int4", "int8")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeat", type=int, default=5, help="rounds; every kernel runs once per round")
    parser.add_argument("--steps", type=int, default=20, help="steps timed per kernel per round")
    return parser.parse_args()


def random_packed(shape: tuple[int, int], bits: int, gen: torch.Generator) -> PackedWeight:
    n, k = shape
    groups = k // GROUP_SIZE
    values = torch.randint(0, 16, shape, generator=gen) if bits == 4 else torch.randint(-128, 128, shape, generator=gen)
    scales = 0.01 * torch.rand(n, groups, generator=gen) + 0.001
    offsets = -8 * scales if bits == 4 else None
    return PackedWeight.from_codes(values, scales, offsets, bits=bits, group_size=GROUP_SIZE)


def step_weights(kernel: str, gen: torch.Generator) -> list[tuple[object, int]]:
    """The 121 weights of a step (the head last) as ``linear`` takes them for this kernel, each with
    its input size."""
    shapes = [*LAYER_SHAPES * NUM_LAYERS, HEAD_SHAPE]
    if kernel == "bf16":
        return [(torch.ops.mkldnn._reorder_linear_weight(0.02 * torch.randn(shape, generator=gen).bfloat16(),
                                                          max(ROWS)), shape[1]) for shape in shapes]
    weights = []
    for i, shape in enumerate(shapes):
        head = i == len(shapes) - 1
        layer = QuantizedLinear(random_packed(shape, 8 if head else 4, gen), torch.bfloat16, torch.device("cpu"))
        expected = {"int8": "w8a8" if head else "w4a8", "torch-int4": "kvpilot" if head else "torch-int4"}[kernel]
        if layer.repack_for_cpu() != expected:
            raise SystemExit(f"{kernel}: a weight took the {layer.layout} layout, not {expected}")
        weights.append((layer, shape[1]))
    return weights


def time_steps(weights: list[tuple[object, int]], rows: int, steps: int) -> float:
    """ms a step: every weight once, on activations of its input size."""
    inputs = {k: torch.randn(rows, k).bfloat16() for _, k in weights}
    for weight, k in weights[:4]:  # warm-up (allocator, thread pool)
        linear(inputs[k], weight)
    start = time.perf_counter()
    for _ in range(steps):
        for weight, k in weights:
            linear(inputs[k], weight)
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if cpu_int8_matmul.load_kernel(4, GROUP_SIZE) is None:
        raise SystemExit("kvpilot's int8-activation kernel does not build here (needs AVX-512 VNNI and BF16)")
    gen = torch.Generator().manual_seed(0)
    weights = {"bf16": step_weights("bf16", gen), "int8": step_weights("int8", gen)}
    real_loader = cpu_int8_matmul.load_kernel
    cpu_int8_matmul.load_kernel = lambda bits, group_size: None  # torch's route, as without AVX-512 VNNI
    weights["torch-int4"] = step_weights("torch-int4", gen)
    cpu_int8_matmul.load_kernel = real_loader
    print(f"SmolLM2-135M matmuls of one decode step ({NUM_LAYERS} x {len(LAYER_SHAPES)} layers + LM head), "
          f"{args.threads} threads, {args.steps} steps a round, {args.repeat} rounds", flush=True)
    results: dict[tuple[str, int], list[float]] = {}
    for round_index in range(args.repeat):
        order = KERNELS[round_index % len(KERNELS):] + KERNELS[: round_index % len(KERNELS)]
        for rows in ROWS:
            for kernel in order:
                ms = time_steps(weights[kernel], rows, args.steps)
                results.setdefault((kernel, rows), []).append(ms)
                print(f"round {round_index} rows {rows} {kernel:10s} {ms:7.2f} ms a step", flush=True)
    print("\nmedian [min-max] ms a step; ratio of medians against bf16 and torch-int4:")
    for rows in ROWS:
        medians = {kernel: statistics.median(results[(kernel, rows)]) for kernel in KERNELS}
        for kernel in KERNELS:
            values = results[(kernel, rows)]
            print(f"  rows {rows} {kernel:10s} {medians[kernel]:7.2f} [{min(values):.2f}-{max(values):.2f}]  "
                  f"x{medians['bf16'] / medians[kernel]:.2f} vs bf16, x{medians['torch-int4'] / medians[kernel]:.2f} "
                  f"vs torch-int4")


if __name__ == "__main__":
    main()
