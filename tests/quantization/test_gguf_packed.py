"""GGUF Q4_0, Q4_1 and Q8_0 blocks kept packed decode to exactly what the gguf package dequantizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpilot.engine.quantization.gguf_packed import gguf_to_packed, is_packable

gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_packed_blocks_decode_like_the_gguf_package(type_name):
    qtype = gguf.GGMLQuantizationType[type_name]
    values = np.random.default_rng(0).standard_normal((40, 96)).astype(np.float32)
    values[3, :32] = np.linspace(0.2, 1.0, 32)  # a block without negatives (Q4_1's min above 0)
    blocks = gguf.quants.quantize(values, qtype)  # [40, bytes per row] uint8, as the reader maps it
    expected = gguf.quants.dequantize(blocks, qtype)  # [40, 96] float32
    packed = gguf_to_packed(type_name, blocks, (40, 96))
    assert packed.shape == (40, 96) and packed.group_size == 32
    assert packed.bits == (8 if type_name == "Q8_0" else 4)
    assert torch.equal(packed.dequantize(), torch.from_numpy(expected))
    # The packed copy owns its memory: the reader's map can close.
    assert not np.shares_memory(packed.codes.numpy(), blocks)


def test_rows_reorder_a_packed_weight_like_a_dense_one():
    values = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    packed = gguf_to_packed("Q4_1", gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_1), (8, 64))
    order = torch.tensor([3, 1, 0, 7, 2, 6, 5, 4])
    assert torch.equal(packed.rows(order).dequantize(), packed.dequantize()[order])


def test_only_2d_weights_of_the_three_types_stay_packed():
    assert is_packable("Q4_1", (576, 1536))
    assert is_packable("Q8_0", (49152, 576))
    assert not is_packable("Q6_K", (576, 1536))
    assert not is_packable("F32", (576, 576))
    assert not is_packable("Q8_0", (576,))
