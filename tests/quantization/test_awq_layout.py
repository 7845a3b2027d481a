"""AWQ's tensor layout: nibble order, unpacking into the packed layout, round-to-nearest quantization."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.checkpoint import ModelLoadError
from kvpilot.engine.quantization.awq import awq_to_packed, pack_int4, quantize_rtn, unpack_int4


def test_nibble_i_holds_feature_awq_order_i():
    # Features 0..7 of one word are stored in the nibble order 0, 2, 4, 6, 1, 3, 5, 7 (AutoAWQ's GEMM packing).
    word = pack_int4(torch.arange(8).view(1, 8))
    assert word.dtype == torch.int32 and word.shape == (1, 1)
    assert word.item() & 0xFFFFFFFF == 0x75316420
    assert unpack_int4(word).tolist() == [list(range(8))]


def test_pack_unpack_round_trip_with_the_sign_bit_set():
    codes = torch.randint(0, 16, (5, 24), generator=torch.Generator().manual_seed(0))
    codes[:, 7] = 15  # the top nibble of a word: the int32 goes negative
    assert torch.equal(unpack_int4(pack_int4(codes)), codes.to(torch.int32))


def test_awq_tensors_become_the_weight_they_stand_for():
    gen = torch.Generator().manual_seed(1)
    in_features, out_features, group = 64, 16, 32
    codes = torch.randint(0, 16, (in_features, out_features), generator=gen)  # [K, N], AWQ's orientation
    zeros = torch.randint(0, 16, (in_features // group, out_features), generator=gen)
    scales = (torch.rand(in_features // group, out_features, generator=gen) * 0.1).to(torch.float16)
    packed = awq_to_packed("layer", pack_int4(codes), pack_int4(zeros), scales, group_size=group,
                           shape=(out_features, in_features))
    # W[k, n] = (code - zero) * scale, used as x @ W: our weight is its transpose.
    expected = ((codes - zeros.repeat_interleave(group, 0)) * scales.float().repeat_interleave(group, 0)).T
    # The offset -zero * scale (here up to 1.5) is stored in float16: within half its unit in the last place.
    torch.testing.assert_close(packed.dequantize(), expected, atol=2.0**-11, rtol=0)
    assert packed.shape == (out_features, in_features) and packed.bits == 4


def test_awq_shape_mismatch_names_the_tensor():
    tensors = quantize_rtn(torch.randn(16, 64), 32)
    with pytest.raises(ModelLoadError, match=r"layer.qweight has shape \(64, 2\)"):
        awq_to_packed("layer", **tensors, group_size=32, shape=(32, 64))


def test_round_to_nearest_error_is_about_half_a_step():
    weight = torch.randn(24, 256, generator=torch.Generator().manual_seed(2))
    weight[0, :64] = torch.linspace(0.1, 0.9, 64)  # a group entirely above zero: 0 must stay representable
    tensors = quantize_rtn(weight, 64)
    packed = awq_to_packed("w", **tensors, group_size=64, shape=(24, 256))
    step = packed.scales.float().repeat_interleave(64, 1)
    error = (packed.dequantize() - weight).abs()
    # Half a step from rounding; at a group's ends the rounded zero point can push a code past 15 (clamped).
    assert (error <= step + 1e-6).all()
    assert (error <= step * 0.5 + 1e-4).float().mean() > 0.99
    assert error.mean() < step.mean() * 0.3
    assert packed.dequantize()[0, :64].min() >= -1e-4  # the all-positive group decodes to no negative weight
