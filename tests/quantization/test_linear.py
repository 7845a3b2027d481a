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


@pytest.mark.parametrize(("layout", "bits"), [("w4a8", 4), ("w8a8", 8), ("torch-int4", 4)])
@pytest.mark.parametrize("group_size", [32, 128])
def test_repacked_layouts_give_the_same_products_in_the_same_bytes(layout, bits, group_size, monkeypatch):
    if layout != "torch-int4" and cpu_int8_matmul.load_kernel(bits, group_size) is None:
        pytest.skip("the int8-activation kernel needs AVX-512 VNNI and BF16")
    if layout == "torch-int4":  # what a CPU without the int8-activation kernel gets
        monkeypatch.setattr(cpu_int8_matmul, "load_kernel", lambda bits, group_size: None)
    linear = QuantizedLinear(random_weight(96, 256, bits, group_size), torch.bfloat16, torch.device("cpu"))
    x = torch.randn(5, 256).to(torch.bfloat16)
    ids = torch.tensor([95, 0, 17])
    before, rows, nbytes = linear(x).float(), linear.embedding(ids), linear.nbytes
    assert linear.repack_for_cpu() == layout == linear.layout
    # int8 activations round x to 8 bits per run of 32 (about 1 %); torch's kernel only rounds differently.
    after = linear(x).float()
    assert ((after - before).norm() / before.norm()).item() < (0.01 if layout == "torch-int4" else 0.02)
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


@pytest.mark.parametrize(("bits", "n", "dtype"), [(4, 40, torch.bfloat16), (4, 96, torch.float32), (8, 96, torch.float32)],
                         ids=["out_features-not-a-multiple-of-16", "float32-4-bit", "float32-8-bit"])
def test_weights_no_faster_kernel_takes_stay_on_the_c_kernel(bits, n, dtype):
    linear = QuantizedLinear(random_weight(n, 64, bits), dtype, torch.device("cpu"))
    assert linear.repack_for_cpu() == "kvpilot" == linear.layout
    assert linear(torch.randn(2, 64).to(dtype)).shape == (2, n)
