"""The matmuls of one SmolLM2-135M decode step on the CPU, per kernel, at 1, 4, 8 and 32 rows.

What benchmarks/quantization.py measures end to end (a whole engine step), this isolates: the 120
linear layers of SmolLM2-135M's 30 decoder layers (q/k/v 960x576, o 576x576, gate/up 3072x576,
down 576x1536) and its LM head (49152x576), with random weights of those shapes, multiplied by the
kernels a model of that dtype runs (``--dtype``):
- float32 (the default dtype on the CPU, what AVX2 machines run):
  - ``dense-f32``: dense float32 weights through F.linear (torch's BLAS), an unquantized model;
  - ``c-f32``: 4-bit codes (group 32), the head 8-bit, on kvpilot's float32 C kernel
    (kernels/cpu_quant_matmul.c): packed weights before the int8-activation kernel took float32;
  - ``int8-f32``: the same codes on kvpilot's int8-activation kernel (kernels/cpu_int8_matmul.c),
    float32 in and out;
- bfloat16:
  - ``bf16``: dense bfloat16 weights, prepacked for oneDNN where it can reorder them;
  - ``torch-int4``: the 4-bit codes on torch's int4 kernel, the head 8-bit on kvpilot's bfloat16
    C kernel (a CPU where the int8-activation kernel does not build);
  - ``int8``: the same codes on kvpilot's int8-activation kernel, the head too.
Every kernel holds 30 separate layers, as a model does, so a step streams its weights from memory
(float32 513 MiB, bfloat16 257 MiB, packed about 90 MiB: more than the CPU's caches) rather than
reusing one matrix from cache. Every call goes through the engine's own linear methods
(engine/linear.py).

Rounds: each kernel times ``--steps`` steps in turn (the order rotates), ``--repeat`` rounds; every
round is printed, then each kernel's median ms a step with min-max and the ratios of the medians.

    python benchmarks/quant_matmul.py                       # float32
    python benchmarks/quant_matmul.py --dtype bfloat16
    python benchmarks/quant_matmul.py --threads 1 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kvpilot.engine.linear import DenseLinear, Linear
from kvpilot.engine.quantization.linear import QuantizedLinear
from kvpilot.engine.quantization.packed import PackedWeight
from kvpilot.kernels import cpu_features, cpu_int8_matmul

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in): q/k/v, o, gate/up, down
NUM_LAYERS = 30
HEAD_SHAPE = (49152, 576)
GROUP_SIZE = 32  # SmolLM2's GGUF: Q4_1 layers, Q8_0 head
ROWS = (1, 4, 8, 32)
# Per dtype: the dense reference, the packed route without int8 activations, the int8-activation kernel.
KERNELS = {"float32": ("dense-f32", "c-f32", "int8-f32"), "bfloat16": ("bf16", "torch-int4", "int8")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=list(KERNELS), default="float32", help="the model's dtype")
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


def step_weights(kernel: str, dtype: torch.dtype, gen: torch.Generator) -> list[tuple[Linear, int]]:
    """The 121 linear layers of a step (the head last) for this kernel, each with its input size."""
    shapes = [*LAYER_SHAPES * NUM_LAYERS, HEAD_SHAPE]
    if kernel in ("dense-f32", "bf16"):
        layers = [DenseLinear(0.02 * torch.randn(shape, generator=gen).to(dtype), None) for shape in shapes]
        for layer in layers:  # as CausalLM.pack_weights_for_cpu does (oneDNN's layout for bfloat16, where it can)
            layer.pack_for_cpu(max(ROWS))
        return [(layer, shape[1]) for layer, shape in zip(layers, shapes, strict=True)]
    expected = {"c-f32": ("kvpilot", "kvpilot"), "torch-int4": ("torch-int4", "kvpilot"),
                "int8-f32": ("w4a8", "w8a8"), "int8": ("w4a8", "w8a8")}[kernel]  # (layers, head)
    weights = []
    for i, shape in enumerate(shapes):
        head = i == len(shapes) - 1
        layer = QuantizedLinear(random_packed(shape, 8 if head else 4, gen), dtype, torch.device("cpu"))
        if kernel != "c-f32" and layer.repack_for_cpu() != expected[head]:
            raise SystemExit(f"{kernel}: a weight took the {layer.layout} layout, not {expected[head]}")
        weights.append((layer, shape[1]))
    return weights


def time_steps(weights: list[tuple[Linear, int]], rows: int, steps: int, dtype: torch.dtype) -> float:
    """ms a step: every weight once, on activations of its input size."""
    inputs = {k: torch.randn(rows, k).to(dtype) for _, k in weights}
    for layer, k in weights[:4]:  # warm-up (allocator, thread pool)
        layer(inputs[k])
    start = time.perf_counter()
    for _ in range(steps):
        for layer, k in weights:
            layer(inputs[k])
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    dtype, kernels = DTYPES[args.dtype], KERNELS[args.dtype]
    int8_kernel = cpu_int8_matmul.load_kernel(4, GROUP_SIZE)
    if int8_kernel is None:
        raise SystemExit("kvpilot's int8-activation kernel does not build here (needs AVX-512 VNNI and BF16, "
                         "or AVX2, FMA and F16C)")
    gen = torch.Generator().manual_seed(0)
    weights = {kernel: step_weights(kernel, dtype, gen) for kernel in (kernels[0], kernels[2])}
    real_loader = cpu_int8_matmul.load_kernel
    cpu_int8_matmul.load_kernel = lambda bits, group_size: None  # the route without int8 activations
    weights[kernels[1]] = step_weights(kernels[1], dtype, gen)
    cpu_int8_matmul.load_kernel = real_loader
    print(f"CPU: {cpu_features.detect().summary()}; int8-activation kernel built for {int8_kernel.isa}")
    print(f"SmolLM2-135M matmuls of one decode step ({NUM_LAYERS} x {len(LAYER_SHAPES)} layers + LM head), "
          f"{args.dtype}, {args.threads} threads, {args.steps} steps a round, {args.repeat} rounds", flush=True)
    results: dict[tuple[str, int], list[float]] = {}
    for round_index in range(args.repeat):
        order = kernels[round_index % len(kernels):] + kernels[: round_index % len(kernels)]
        for rows in ROWS:
            for kernel in order:
                ms = time_steps(weights[kernel], rows, args.steps, dtype)
                results.setdefault((kernel, rows), []).append(ms)
                print(f"round {round_index} rows {rows:2d} {kernel:10s} {ms:8.2f} ms a step", flush=True)
    dense, packed = kernels[0], kernels[1]
    print(f"\nmedian [min-max] ms a step; ratio of medians against {dense} and {packed}:")
    for rows in ROWS:
        medians = {kernel: statistics.median(results[(kernel, rows)]) for kernel in kernels}
        for kernel in kernels:
            values = results[(kernel, rows)]
            print(f"  rows {rows:2d} {kernel:10s} {medians[kernel]:8.2f} [{min(values):.2f}-{max(values):.2f}]  "
                  f"x{medians[dense] / medians[kernel]:.2f} vs {dense}, x{medians[packed] / medians[kernel]:.2f} "
                  f"vs {packed}")


if __name__ == "__main__":
    main()
