"""LoRA BGMV kernels vs their torch reference: rows with different adapters, rows without one,
adapters of different widths, odd feature counts, a strided input."""

from __future__ import annotations

import os

import pytest
import torch

from kvpilot.kernels.lora_bgmv import lora_bgmv, lora_bgmv_reference

ON_CUDA = os.environ.get("KVPILOT_TEST_DEVICE", "cpu") == "cuda"
# (num_rows, in_features, out_features, num_slots, max_width)
CASES = ([(256, 4096, 6144, 4, 192), (7, 4096, 14336, 2, 32), (64, 14336, 4096, 8, 64)] if ON_CUDA
         else [(9, 96, 160, 3, 24), (4, 33, 70, 2, 8), (1, 128, 48, 1, 16)])


@pytest.mark.parametrize("num_rows,in_features,out_features,num_slots,max_width", CASES)
def test_matches_reference(num_rows, in_features, out_features, num_slots, max_width, dtype, device, assert_close):
    gen = torch.Generator().manual_seed(num_rows + in_features)
    wide = torch.randn(num_rows, in_features + 5, generator=gen).to(dtype).to(device)
    x = wide[:, 2 : 2 + in_features]  # rows strided, as a view into a larger activation
    lora_a = (torch.randn(num_slots, max_width, in_features, generator=gen) * in_features**-0.5).to(dtype).to(device)
    lora_b = (torch.randn(num_slots, out_features, max_width, generator=gen) * max_width**-0.5).to(dtype).to(device)
    widths = torch.tensor([max_width - 3 * s for s in range(num_slots)], dtype=torch.int32)
    row_slots = torch.randint(-1, num_slots, (num_rows,), generator=gen, dtype=torch.int32)
    y = torch.randn(num_rows, out_features, generator=gen).to(dtype).to(device)
    expected = y.clone()
    lora_bgmv_reference(x, expected, lora_a, lora_b, row_slots.to(device), widths.to(device))
    lora_bgmv(x, y, lora_a, lora_b, row_slots.to(device), widths.to(device))
    assert_close(y, expected)
    untouched = (row_slots < 0).to(device)
    assert torch.equal(y[untouched], expected[untouched])


def test_rejects_mismatched_shapes(device):
    x, y = torch.zeros(3, 16, device=device), torch.zeros(3, 8, device=device)
    a, b = torch.zeros(2, 4, 16, device=device), torch.zeros(2, 8, 4, device=device)
    slots, widths = torch.zeros(3, dtype=torch.int32, device=device), torch.full((2,), 4, dtype=torch.int32, device=device)
    lora_bgmv(x, y, a, b, slots, widths)
    with pytest.raises(ValueError, match="lora_b must be"):
        lora_bgmv(x, y, a, b[:, :4], slots, widths)
    with pytest.raises(ValueError, match="row_slots must be int32"):
        lora_bgmv(x, y, a, b, slots.long(), widths)
    with pytest.raises(ValueError, match="lora_a must be"):
        lora_bgmv(x[:, :8], y, a, b, slots, widths)
