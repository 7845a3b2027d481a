"""QuantizedLinear's CPU routes: kvpilot's C kernel on its own layout, and after repack_for_cpu
kvpilot's int8-activation kernel or torch's int4 kernel, on the same codes."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.quantization.linear import QuantizedLinear
from kvpilot.engine.quantization.packed import PackedWeight
from kvpilot.kernels import cpu_int8_matmul, cpu_quant_matmul


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


def _strided_activations(k: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Activations laid out as a model's views can leave them: never contiguous, each [..., k]."""
    gen = torch.Generator().manual_seed(k)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    return {
        "transposed": randn(k, 5).t(),  # strides (1, 5)
        "column slice": randn(5, k + 40)[:, 24:24 + k],  # rows k + 40 apart
        "every other row": randn(10, k)[::2],
        "permuted 3-D": randn(3, k, 2).permute(0, 2, 1),  # [3, 2, k], strides (2k, 1, 2)
        "one row of a transpose": randn(k, 4).t()[1:2],  # [1, k]: a decode step's shape
    }


@pytest.mark.parametrize(("route", "bits", "dtype"), [
    ("kvpilot", 4, torch.float32), ("kvpilot", 8, torch.bfloat16), ("reference", 4, torch.float32),
    ("w4a8", 4, torch.float32), ("w8a8", 8, torch.bfloat16), ("torch-int4", 4, torch.bfloat16),
], ids=str)  # fmt: skip
def test_non_contiguous_activations_give_the_products_of_their_contiguous_copy(route, bits, dtype, monkeypatch):
    if route == "reference":  # what a CPU without a C compiler gets
        monkeypatch.setattr(cpu_quant_matmul, "usable", lambda x, bits, group_size: False)
    if route == "torch-int4":
        monkeypatch.setattr(cpu_int8_matmul, "load_kernel", lambda bits, group_size: None)
    linear = QuantizedLinear(random_weight(96, 256, bits), dtype, torch.device("cpu"))
    if route in ("w4a8", "w8a8", "torch-int4"):
        if linear.repack_for_cpu() != route:
            pytest.skip(f"the {route} kernel does not run on this CPU")
    elif route == "kvpilot" and not linear._bind_kvpilot_cpu_kernel():
        pytest.skip("kvpilot's C kernel is not built here (no C compiler)")
    for name, x in _strided_activations(256, dtype).items():
        assert not x.is_contiguous(), name
        if route == "reference":  # torch's matmul may sum in another order for another layout
            torch.testing.assert_close(linear(x), linear(x.contiguous()), msg=name)
        else:  # the kernels read one layout: the same bytes in, the same bytes out
            assert torch.equal(linear(x), linear(x.contiguous())), name
