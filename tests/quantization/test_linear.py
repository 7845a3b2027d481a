"""QuantizedLinear's CPU routes: kvpilot's C kernel on its own layout, and after repack_for_cpu
kvpilot's int8-activation kernel or torch's int4 kernel, on the same codes."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.quantization.linear import QuantizedLinear
from kvpilot.engine.quantization.packed import PackedWeight
from kvpilot.kernels import cpu_int8_matmul


def random_weight(n: int, k: int, bits: int, group_size: int = 32) -> PackedWeight:
    gen = torch.Generator().manual_seed(n + k + bits)
    groups = k // group_size
    if bits == 4:
        values = torch.randint(0, 16, (n, k), generator=gen)
        offsets = -0.08 * torch.rand(n, groups, generator=gen)
    else:
        values, offsets = torch.randint(-128, 128, (n, k), generator=gen), None
    scales = 0.01 * torch.rand(n, groups, generator=gen) + 0.001
    return PackedWeight.from_codes(values, scales, offsets, bits=bits, group_size=group_size)


@pytest.mark.parametrize(("layout", "bits", "dtype"), [("w4a8", 4, torch.float32), ("w8a8", 8, torch.float32),
                                                     ("w4a8", 4, torch.bfloat16), ("w8a8", 8, torch.bfloat16),
                                                     ("torch-int4", 4, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("group_size", [32, 128])
def test_repacked_layouts_give_the_same_products_in_the_same_bytes(layout, bits, dtype, group_size, monkeypatch):
    if layout != "torch-int4" and cpu_int8_matmul.load_kernel(bits, group_size) is None:
        pytest.skip("the int8-activation kernel needs AVX-512 VNNI and BF16, or AVX2, FMA and F16C")
    if layout == "torch-int4":  # what a CPU without the int8-activation kernel gets
        monkeypatch.setattr(cpu_int8_matmul, "load_kernel", lambda bits, group_size: None)
    linear = QuantizedLinear(random_weight(96, 256, bits, group_size), dtype, torch.device("cpu"))
    x = torch.randn(5, 256).to(dtype)
    ids = torch.tensor([95, 0, 17])
    before, rows, nbytes = linear(x).float(), linear.embedding(ids), linear.nbytes
    assert linear.repack_for_cpu() == layout == linear.layout
    # int8 activations round x to 8 bits per run of 32 (about 1 %); torch's kernel only rounds differently.
    after = linear(x)
    assert after.dtype == dtype
    assert ((after.float() - before).norm() / before.norm()).item() < (0.01 if layout == "torch-int4" else 0.02)
    assert linear.nbytes == nbytes  # the same codes; a float16 or bfloat16 pair per group either way
    assert linear.repack_for_cpu() == layout  # a second call changes nothing
    if layout == "torch-int4":
        with pytest.raises(RuntimeError, match="repacked"):
            linear.embedding(ids)
    else:  # the token embedding's lookup reads the interleaved layout
        assert torch.equal(linear.embedding(ids), rows)


def test_a_tied_embedding_is_never_moved_to_torchs_layout(monkeypatch):
    monkeypatch.setattr(cpu_int8_matmul, "load_kernel", lambda bits, group_size: None)
    linear = QuantizedLinear(random_weight(96, 256, 4), torch.bfloat16, torch.device("cpu"))
    assert linear.repack_for_cpu(embedding=True) == "kvpilot"
    assert linear.embedding(torch.tensor([3])).shape == (1, 256)


@pytest.mark.parametrize(("bits", "n", "dtype", "int8_kernel"),
                         [(4, 40, torch.bfloat16, True), (8, 40, torch.float32, True),
                          (4, 96, torch.float32, False), (8, 96, torch.float32, False)],
                         ids=["out_features-not-a-multiple-of-16", "float32-out_features-not-a-multiple-of-16",
                              "float32-4-bit-no-int8-kernel", "float32-8-bit-no-int8-kernel"])
def test_weights_no_faster_kernel_takes_stay_on_the_c_kernel(bits, n, dtype, int8_kernel, monkeypatch):
    if not int8_kernel:  # a CPU without AVX2: float32 keeps kvpilot's C kernel (torch's int4 one is for bfloat16)
        monkeypatch.setattr(cpu_int8_matmul, "load_kernel", lambda bits, group_size: None)
    linear = QuantizedLinear(random_weight(n, 64, bits), dtype, torch.device("cpu"))
    assert linear.repack_for_cpu() == "kvpilot" == linear.layout
    assert linear(torch.randn(2, 64).to(dtype)).shape == (2, n)
