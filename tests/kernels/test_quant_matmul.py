"""Weight-only quantized matmul: the Triton kernel (TRITON_INTERPRET=1 on CPU), the CPU C kernel and
the CPU int8-activation kernel (its AVX-512 VNNI and AVX2 paths, float32 and bfloat16) against the
reference (dequantize to float32, multiply), over odd shapes, both bit widths and the group sizes
the loaders produce; and the packed layouts themselves."""

from __future__ import annotations

import os

import pytest
import torch

from kvpilot.kernels import cpu_features, cpu_int8_matmul, cpu_quant_matmul
from kvpilot.kernels.quant_layout import (
    check_packed,
    dequantize,
    pack_codes,
    quant_matmul_reference,
    unpack_codes,
)
from kvpilot.kernels.quant_matmul import quant_matmul

ON_CUDA = os.environ.get("KVPILOT_TEST_DEVICE", "cpu") == "cuda"
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")

# (M rows, N out features, K in features, group size): one decode row, a few, more than a row tile;
# N not a multiple of any block; K of one group and of many.
CASES = [(1, 45, 64, 32), (3, 96, 160, 32), (9, 33, 256, 128), (17, 80, 192, 64)]
if ON_CUDA:
    CASES += [(1, 4096, 4096, 128), (8, 14336, 4096, 128), (300, 4096, 14336, 128)]
# Against a float32 reference: the kernels sum in float32 in another order and round once to the dtype.
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 1.6e-2), torch.float16: (4e-3, 2e-3)}


def random_packed(n: int, k: int, group_size: int, bits: int, seed: int, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    groups = k // group_size
    if bits == 4:
        values = torch.randint(0, 16, (n, k), generator=gen)
        scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.001).to(torch.float16)
        offsets = (-8 * scales.float() + 0.01 * torch.randn(n, groups, generator=gen)).to(torch.float16)
    else:
        values = torch.randint(-128, 128, (n, k), generator=gen)
        scales = (torch.rand(n, groups, generator=gen) * 0.002 + 0.0001).to(torch.float16)
        offsets = None
    codes = pack_codes(values, bits)
    move = (lambda t: t if t is None else t.to(device))
    return move(codes), move(scales), move(offsets), values


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k,group_size", CASES)
def test_triton_kernel_matches_reference(m, n, k, group_size, bits, dtype, device):
    codes, scales, offsets, _ = random_packed(n, k, group_size, bits, seed=m * 31 + n, device=device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(device)
    kw = {"bits": bits, "group_size": group_size}
    assert_close(quant_matmul(x, codes, scales, offsets, **kw), quant_matmul_reference(x, codes, scales, offsets, **kw))


@pytest.mark.skipif(ON_CUDA, reason="the CPU kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k,group_size", CASES + [(37, 576, 1536, 32), (64, 50, 256, 256)])
def test_cpu_kernel_matches_reference(m, n, k, group_size, bits, dtype):
    codes, scales, offsets, _ = random_packed(n, k, group_size, bits, seed=m * 7 + n, device="cpu")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    kw = {"bits": bits, "group_size": group_size}
    assert cpu_quant_matmul.usable(x, **kw)
    actual = cpu_quant_matmul.cpu_quant_matmul(x, codes, scales, offsets, **kw)
    assert actual.dtype == dtype and actual.shape == (m, n)
    if dtype == torch.bfloat16 and cpu_quant_matmul.load_kernel(dtype, **kw).x_bf16:
        # The AVX-512 BF16 build rounds each dequantized weight to bfloat16, as a bfloat16 model
        # dequantized at load holds it: the reference does the same. Other builds (AVX2) multiply
        # in float32 with float32 weights, as the reference below.
        weight = dequantize(codes, scales, offsets, **kw).to(dtype).float()
        assert_close(actual, (x.float() @ weight.T).to(dtype))
    else:
        assert_close(actual, quant_matmul_reference(x, codes, scales, offsets, **kw))


@pytest.mark.skipif(ON_CUDA, reason="the CPU kernel")
def test_cpu_kernel_handles_an_empty_batch():
    codes, scales, offsets, _ = random_packed(16, 64, 32, 4, seed=0, device="cpu")
    out = cpu_quant_matmul.cpu_quant_matmul(torch.zeros(0, 64), codes, scales, offsets, bits=4, group_size=32)
    assert out.shape == (0, 16)


def test_four_bit_layout_is_runs_of_32_low_nibbles_first():
    values = torch.arange(64).remainder(16).view(1, 64)  # inputs 0..15, 0..15, 0..15, 0..15
    codes = pack_codes(values, 4)
    assert codes.shape == (1, 32)
    # byte i of a run: input i (low nibble) and input i + 16 (high nibble)
    assert codes[0, 0].item() == 0x00 and codes[0, 1].item() == 0x11 and codes[0, 15].item() == 0xFF
    assert torch.equal(unpack_codes(codes, 4).long(), values)


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_is_code_times_scale_plus_offset_per_group(bits):
    codes, scales, offsets, values = random_packed(3, 128, 64, bits, seed=1, device="cpu")
    weight = dequantize(codes, scales, offsets, bits=bits, group_size=64)
    for row in range(3):
        for column in (0, 63, 64, 127):
            group = column // 64
            expected = values[row, column].item() * scales[row, group].float().item()
            if offsets is not None:
                expected += offsets[row, group].float().item()
            assert weight[row, column].item() == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_check_packed_names_what_does_not_fit():
    codes, scales, offsets, _ = random_packed(8, 64, 32, 4, seed=2, device="cpu")
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 32"):
        check_packed(codes, scales, offsets, bits=4, group_size=48)
    with pytest.raises(ValueError, match="scales must be contiguous"):
        check_packed(codes, scales.float(), offsets, bits=4, group_size=32)
    with pytest.raises(ValueError, match="need offsets"):
        check_packed(codes, scales, None, bits=4, group_size=32)
    with pytest.raises(ValueError, match="8-bit codes must be torch.int8"):
        check_packed(codes, scales, None, bits=8, group_size=32)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_codes(torch.zeros(2, 48, dtype=torch.long), 4)

# The int8-activation kernel (cpu_int8_matmul.c), on each instruction set it builds for. With x
# whose runs of 32 are already int8 values times a power of two (rounding x to 8 bits changes
# nothing) it must give the reference's product to float32 rounding; with Gaussian x, the
# reference's product of x rounded to 8 bits a run, to float32 rounding.
INT8_NEEDS = {"avx512_vnni": "AVX-512 VNNI and BF16", "avx2": "AVX2, FMA and F16C"}
INT8_DTYPES = [torch.float32, torch.bfloat16]
# (atol as a fraction of the largest output, rtol): x of the exact case is exact in both dtypes, so
# what is left is float32 summation order (measured 5e-7) and a bfloat16 output's rounding (3e-3).
INT8_EXACT_TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-3, 8e-3)}

# (M rows, N out features (a multiple of 16), K in features, group size): one decode row, rows
# short of a row tile (8) and past it, a prefill; K of one run, of an odd number of runs, of one
# group and of many; every group size the loaders produce (GGUF 32, AWQ 32-128).
INT8_CASES = [(1, 16, 32, 32), (3, 48, 128, 64), (6, 16, 192, 64), (8, 96, 256, 128), (9, 64, 512, 256),
              (13, 32, 96, 32), (37, 576, 1536, 32)]


@pytest.fixture(params=list(INT8_NEEDS))
def int8_isa(request, cpu_without) -> str:
    """The test runs on this instruction set of the int8-activation kernel: an AVX-512 VNNI machine
    runs both (without AVX-512, as KVPILOT_CPU_FEATURES=-avx512f does, the AVX2 build is made), an
    AVX2 one the AVX2 path only; skipped where the CPU lacks the instruction set."""
    if ON_CUDA:
        pytest.skip("the CPU kernel")
    if request.param == "avx2":
        cpu_without("avx512f")
    features = cpu_features.detect()
    if features.int8_matmul_isa != request.param:
        pytest.skip(f"needs {INT8_NEEDS[request.param]} (this CPU: {features.summary()})")
    kernel = cpu_int8_matmul.load_kernel(4, 32)
    assert kernel is not None and kernel.isa == request.param  # the build really took that path
    return request.param


def int8_bound(n: int, k: int, group_size: int, bits: int, seed: int, dtype: torch.dtype):
    codes, scales, offsets, _ = random_packed(n, k, group_size, bits, seed=seed, device="cpu")
    tiled = cpu_int8_matmul.interleave(codes, scales, offsets, bits=bits, group_size=group_size)
    kernel = cpu_int8_matmul.Int8Kernel(cpu_int8_matmul.load_kernel(bits, group_size), *tiled, dtype)
    return kernel, (codes, scales, offsets)


@pytest.mark.parametrize("dtype", INT8_DTYPES, ids=str)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k,group_size", INT8_CASES)
def test_int8_kernel_exact_when_x_is_already_eight_bit(m, n, k, group_size, bits, dtype, int8_isa):
    kernel, packed = int8_bound(n, k, group_size, bits, seed=m + n, dtype=dtype)
    gen = torch.Generator().manual_seed(m)
    x = torch.randint(-127, 128, (m, k), generator=gen).float()
    x.view(m, k // 32, 32)[..., 0] = 127  # every run's largest magnitude is 127: its scale is a power of two
    x = (x.view(m, k // 32, 32) * 2.0 ** torch.randint(-6, 3, (m, k // 32, 1), generator=gen)).view(m, k)
    x = x.to(dtype)
    expected = quant_matmul_reference(x.float(), *packed, bits=bits, group_size=group_size)
    actual = kernel(x)
    assert actual.dtype == dtype and actual.shape == (m, n)
    atol, rtol = INT8_EXACT_TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected, atol=atol * expected.abs().max().item(), rtol=rtol)


@pytest.mark.parametrize("dtype", INT8_DTYPES, ids=str)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k,group_size", INT8_CASES)
def test_int8_kernel_gaussian_x_is_the_weight_times_x_rounded_to_eight_bits(m, n, k, group_size, bits, dtype,
                                                                           int8_isa):
    kernel, packed = int8_bound(n, k, group_size, bits, seed=m * 7 + n, dtype=dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    runs = x.float().view(m, k // 32, 32)
    step = runs.abs().amax(-1, keepdim=True) / 127
    rounded = (torch.round(runs / step) * step).view(m, k)  # what the kernel multiplies: x in 8 bits a run
    expected = quant_matmul_reference(rounded, *packed, bits=bits, group_size=group_size)
    actual = kernel(x).float()
    # The dequantized weight times the rounded x, to float32 summation (a bfloat16 output's rounding:
    # 0.2-0.3 %). Rounding x itself moves a product by 0.5-1 %, and so did taking the offsets' share
    # from x's exact sum (the codes' rounding errors, about -8 scales' worth, left uncancelled).
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 4e-3}[dtype]
    assert ((actual - expected).norm() / expected.norm()).item() < tolerance


@pytest.mark.parametrize("dtype", INT8_DTYPES, ids=str)
@pytest.mark.parametrize("bits", [4, 8])
def test_int8_kernel_all_zero_runs_and_an_empty_batch(bits, dtype, int8_isa):
    kernel, packed = int8_bound(32, 64, 32, bits, seed=1, dtype=dtype)
    x = torch.zeros(2, 64, dtype=dtype)
    x[1, 32:] = 1.0  # row 0 all zero, row 1's first run zero: scale 0, no division by it
    expected = quant_matmul_reference(x.float(), *packed, bits=bits, group_size=32)
    torch.testing.assert_close(kernel(x).float(), expected, atol=1e-3, rtol=8e-3)
    assert kernel(torch.zeros(0, 64, dtype=dtype)).shape == (0, 32)


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_layout_keeps_the_bytes_and_gives_rows_back(bits):
    codes, scales, offsets, _ = random_packed(48, 128, 64, bits, seed=0, device="cpu")
    tiled = cpu_int8_matmul.interleave(codes, scales, offsets, bits=bits, group_size=64)
    assert tuple(tiled[0].shape) == (3, 4, bits, 16, 4) and tiled[0].numel() == codes.numel()
    assert tuple(tiled[1].shape) == (3, 2, 16) and torch.equal(tiled[1][1, :, 3], scales[19])
    index = torch.tensor([19, 0, 47, 19])
    picked = cpu_int8_matmul.rows(*tiled, index, bits=bits)
    expected = (codes[index], scales[index], None if offsets is None else offsets[index])
    for got, want in zip(picked, expected, strict=True):
        assert (got is None and want is None) or (got.dtype == want.dtype and torch.equal(got, want))


def test_int8_layout_and_kernel_refuse_what_they_do_not_take(int8_isa):
    odd = random_packed(40, 128, 64, 4, seed=0, device="cpu")[:3]
    with pytest.raises(ValueError, match="out_features .40. must be a multiple of 16"):
        cpu_int8_matmul.interleave(*odd, bits=4, group_size=64)
    with pytest.raises(ValueError, match="float32"):
        int8_bound(16, 64, 32, 4, seed=0, dtype=torch.float32)[0](torch.zeros(1, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float32 or bfloat16 x, not torch.float16"):
        int8_bound(16, 64, 32, 4, seed=0, dtype=torch.float16)
