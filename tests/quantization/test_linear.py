"""QuantizedLinear's CPU routes: kvpilot's C kernel on its own layout, and torch's int4 kernel after
repack_for_torch_cpu, on the same codes."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.quantization.linear import QuantizedLinear
from kvpilot.engine.quantization.packed import PackedWeight


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("group_size", [32, 128])
def test_torch_int4_layout_gives_the_same_products_in_the_same_bytes(dtype, group_size):
    linear = QuantizedLinear(random_weight(96, 256, 4, group_size), dtype, torch.device("cpu"))
    x = torch.randn(5, 256).to(dtype)
    before, nbytes = linear(x), linear.nbytes
    assert linear.repack_for_torch_cpu() and linear.torch_int4
    torch.testing.assert_close(linear(x).float(), before.float(), atol=2e-2, rtol=2e-2)
    # codes as many bytes as before; (scale, zero) per group in the activations' dtype
    assert linear.nbytes == nbytes + (0 if dtype == torch.bfloat16 else 96 * 256 // group_size * 4)
    with pytest.raises(RuntimeError, match="repacked"):
        linear.embedding(torch.tensor([0]))


@pytest.mark.parametrize(("bits", "n"), [(8, 96), (4, 40)], ids=["8-bit", "out_features-not-a-multiple-of-16"])
def test_weights_torch_cannot_take_stay_on_the_c_kernel(bits, n):
    linear = QuantizedLinear(random_weight(n, 64, bits), torch.bfloat16, torch.device("cpu"))
    assert not linear.repack_for_torch_cpu() and not linear.torch_int4
    assert linear(torch.randn(2, 64).to(torch.bfloat16)).shape == (2, n)
