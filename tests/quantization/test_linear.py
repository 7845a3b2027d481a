"""QuantizedLinear's CPU routes: kvpilot's C kernel on its own layout, and after repack_for_cpu
kvpilot's int8-activation kernel or torch's int4 kernel, on the same codes."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.quantization.linear import QuantizedLinear
from kvpilot.engine.quantization.packed import PackedWeight
from kvpilot.kernels import cpu_w4a8_matmul


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


@pytest.mark.parametrize("layout", ["w4a8", "torch-int4"])
@pytest.mark.parametrize("group_size", [32, 128])
def test_repacked_layouts_give_the_same_products_in_the_same_bytes(layout, group_size, monkeypatch):
    if layout == "w4a8" and cpu_w4a8_matmul.load_kernel(group_size) is None:
        pytest.skip("the int8-activation kernel needs AVX-512 VNNI and BF16")
    if layout == "torch-int4":  # what a CPU without the int8-activation kernel gets
        monkeypatch.setattr(cpu_w4a8_matmul, "load_kernel", lambda group_size: None)
    linear = QuantizedLinear(random_weight(96, 256, 4, group_size), torch.bfloat16, torch.device("cpu"))
    x = torch.randn(5, 256).to(torch.bfloat16)
    before, nbytes = linear(x).float(), linear.nbytes
    assert linear.repack_for_cpu() == layout == linear.layout
    # w4a8 rounds x to 8 bits per run of 32 (about 1 %); torch's kernel only rounds differently.
    after = linear(x).float()
    assert ((after - before).norm() / before.norm()).item() < (0.02 if layout == "w4a8" else 0.01)
    assert linear.nbytes == nbytes  # the same codes; a float16 or bfloat16 pair per group either way
    assert linear.repack_for_cpu() == layout  # a second call changes nothing
    with pytest.raises(RuntimeError, match="repacked"):
        linear.embedding(torch.tensor([0]))


@pytest.mark.parametrize(("bits", "n", "dtype"), [(8, 96, torch.bfloat16), (4, 40, torch.bfloat16), (4, 96, torch.float32)],
                         ids=["8-bit", "out_features-not-a-multiple-of-16", "float32"])
def test_weights_no_faster_kernel_takes_stay_on_the_c_kernel(bits, n, dtype):
    linear = QuantizedLinear(random_weight(n, 64, bits), dtype, torch.device("cpu"))
    assert linear.repack_for_cpu() == "kvpilot" == linear.layout
    assert linear(torch.randn(2, 64).to(dtype)).shape == (2, n)
