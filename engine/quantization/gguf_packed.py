"""GGUF's Q4_0, Q4_1 and Q8_0 tensors as PackedWeight, without dequantizing them.

llama.cpp stores a [rows, cols] tensor of these types as rows of 32-input blocks:
- Q4_0 (18 bytes): float16 d, then 16 bytes of nibbles; input i = (nibble - 8) * d;
- Q4_1 (20 bytes): float16 d, float16 m, then 16 bytes of nibbles; input i = nibble * d + m;
- Q8_0 (34 bytes): float16 d, then 32 int8; input i = q * d.
The nibble bytes are already kvpilot's 4-bit run order (byte i: input i low, input i + 16 high),
so they are copied as they are; the scales and offsets become one [rows, cols // 32] table each.
"""

from __future__ import annotations

import numpy as np
import torch

from kvpilot.engine.quantization.packed import PackedWeight

BLOCK = 32
# type name -> (bytes per block, bits, float16 header fields)
PACKED_GGUF_TYPES = {"Q4_0": (18, 4, 1), "Q4_1": (20, 4, 2), "Q8_0": (34, 8, 1)}


def is_packable(type_name: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of this GGML type and numpy shape [rows, cols] stays packed (a 2-D weight)."""
    return type_name in PACKED_GGUF_TYPES and len(shape) == 2 and shape[1] % BLOCK == 0


def gguf_to_packed(type_name: str, data: np.ndarray, shape: tuple[int, int]) -> PackedWeight:
    """``data``: the tensor's raw bytes (the gguf reader's [rows, bytes per row] uint8); ``shape``: [rows, cols]."""
    block_bytes, bits, header_fields = PACKED_GGUF_TYPES[type_name]
    rows, cols = shape
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, cols // BLOCK, block_bytes)
    header = np.array(blocks[..., : 2 * header_fields])  # an owned copy of the float16 fields
    halves = header.view(np.float16)  # [rows, cols // 32, header_fields]
    scales = torch.from_numpy(np.ascontiguousarray(halves[..., 0]))  # [rows, cols // 32] float16
    payload = np.array(blocks[..., 2 * header_fields :]).reshape(rows, -1)  # owned, [rows, cols // 2 or cols]
    if type_name == "Q8_0":
        return PackedWeight(bits, BLOCK, torch.from_numpy(payload.view(np.int8)), scales, None)
    if type_name == "Q4_1":
        offsets = torch.from_numpy(np.ascontiguousarray(halves[..., 1]))
    else:  # Q4_0: (nibble - 8) * d = nibble * d - 8 d, exact in float16
        offsets = scales * -8
    return PackedWeight(bits, BLOCK, torch.from_numpy(payload), scales, offsets.contiguous())
