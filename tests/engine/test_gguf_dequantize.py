"""Each supported GGUF tensor type, through a file and the engine's dequantize, against a decoder
written here from ggml's block layouts (ggml-common.h / ggml-quants.c), one block at a time.

The blocks are random bytes with finite scales, so every bit of every field matters; the
matrices are 3 x 512 so row/column order and the block order within a row are checked too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from kvpilot.engine.models.gguf_file import SUPPORTED_TENSOR_TYPES, GGUFFile  # noqa: E402
from kvpilot.engine.models.gguf_weights import dequantize  # noqa: E402

ROWS, COLS = 3, 512


def _f16(block: np.ndarray, start: int) -> float:
    return float(block[start : start + 2].view(np.float16)[0])


def decode_q8_0(block: np.ndarray) -> np.ndarray:
    d = _f16(block, 0)
    return d * block[2:34].view(np.int8).astype(np.float64)


def decode_q4_0(block: np.ndarray) -> np.ndarray:
    d, qs = _f16(block, 0), block[2:18].astype(np.int64)
    return d * np.concatenate([(qs & 0xF) - 8, (qs >> 4) - 8])


def decode_q4_1(block: np.ndarray) -> np.ndarray:
    d, m, qs = _f16(block, 0), _f16(block, 2), block[4:20].astype(np.int64)
    return d * np.concatenate([qs & 0xF, qs >> 4]) + m


def _five_bit(qh: int, qs: np.ndarray) -> np.ndarray:
    """Low nibbles for values 0..15 and high nibbles for 16..31; bit j of qh is value j's fifth bit."""
    high = np.array([(qh >> j) & 1 for j in range(32)], dtype=np.int64) << 4
    return np.concatenate([qs & 0xF, qs >> 4]) | high


def decode_q5_0(block: np.ndarray) -> np.ndarray:
    d, qh = _f16(block, 0), int(block[2:6].view(np.uint32)[0])
    return d * (_five_bit(qh, block[6:22].astype(np.int64)) - 16)


def decode_q5_1(block: np.ndarray) -> np.ndarray:
    d, m, qh = _f16(block, 0), _f16(block, 2), int(block[4:8].view(np.uint32)[0])
    return d * _five_bit(qh, block[8:24].astype(np.int64)) + m


def decode_q4_k(block: np.ndarray) -> np.ndarray:
    """256 values in 8 sub-blocks of 32, each with a 6-bit scale and min packed into 12 bytes."""
    d, dmin = _f16(block, 0), _f16(block, 2)
    scales, qs = block[4:16].astype(np.int64), block[16:144].astype(np.int64)

    def scale_min(j: int) -> tuple[int, int]:
        if j < 4:
            return scales[j] & 63, scales[j + 4] & 63
        return (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)

    out = []
    for chunk in range(4):  # each 32 bytes hold two sub-blocks: low nibbles, then high nibbles
        q = qs[32 * chunk : 32 * chunk + 32]
        (sc1, m1), (sc2, m2) = scale_min(2 * chunk), scale_min(2 * chunk + 1)
        out += [d * sc1 * (q & 0xF) - dmin * m1, d * sc2 * (q >> 4) - dmin * m2]
    return np.concatenate(out)


def decode_q6_k(block: np.ndarray) -> np.ndarray:
    """256 values: low 4 bits in ql, high 2 bits in qh, 16 int8 scales, one f16 super-scale."""
    ql, qh = block[0:128].astype(np.int64), block[128:192].astype(np.int64)
    scales, d = block[192:208].view(np.int8).astype(np.int64), _f16(block, 208)
    out = np.empty(256)
    for half in range(2):
        lo, hi, sc = ql[64 * half : 64 * half + 64], qh[32 * half : 32 * half + 32], scales[8 * half : 8 * half + 8]
        for i in range(32):
            s = i // 16
            q1 = ((lo[i] & 0xF) | (((hi[i] >> 0) & 3) << 4)) - 32
            q2 = ((lo[i + 32] & 0xF) | (((hi[i] >> 2) & 3) << 4)) - 32
            q3 = ((lo[i] >> 4) | (((hi[i] >> 4) & 3) << 4)) - 32
            q4 = ((lo[i + 32] >> 4) | (((hi[i] >> 6) & 3) << 4)) - 32
            base = 128 * half
            out[base + i] = d * sc[s] * q1
            out[base + i + 32] = d * sc[s + 2] * q2
            out[base + i + 64] = d * sc[s + 4] * q3
            out[base + i + 96] = d * sc[s + 6] * q4
    return out


# type -> (decoder, byte offsets of the block's f16 scale fields)
BLOCK_DECODERS = {
    "Q8_0": (decode_q8_0, (0,)),
    "Q4_0": (decode_q4_0, (0,)),
    "Q4_1": (decode_q4_1, (0, 2)),
    "Q5_0": (decode_q5_0, (0,)),
    "Q5_1": (decode_q5_1, (0, 2)),
    "Q4_K": (decode_q4_k, (0, 2)),
    "Q6_K": (decode_q6_k, (208,)),
}


def write_one_tensor(path: Path, values: np.ndarray, qtype) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    if values.dtype == np.uint8:
        writer.add_tensor("t", values, raw_dtype=qtype)
    else:
        writer.add_tensor("t", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_one_tensor(path: Path) -> np.ndarray:
    gguf_file = GGUFFile(path)
    return dequantize(gguf_file, gguf_file.tensors["t"])


def random_blocks(type_name: str, rng: np.random.Generator) -> np.ndarray:
    """[ROWS, bytes per row] of random blocks whose f16 scales are finite and modest."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(ROWS * COLS // block_size, type_size), dtype=np.uint8)
    for offset in BLOCK_DECODERS[type_name][1]:
        scales = rng.uniform(-0.05, 0.05, size=len(blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(ROWS, -1)


def test_every_supported_type_is_covered_here():
    assert set(SUPPORTED_TENSOR_TYPES) == {"F32", "F16", "BF16", *BLOCK_DECODERS}


@pytest.mark.parametrize("type_name", sorted(BLOCK_DECODERS))
def test_quantized_blocks_decode_as_ggml_lays_them_out(type_name, tmp_path):
    decoder = BLOCK_DECODERS[type_name][0]
    raw = random_blocks(type_name, np.random.default_rng(sorted(BLOCK_DECODERS).index(type_name)))
    block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][1]
    expected = np.stack([
        np.concatenate([decoder(row[i : i + block_bytes]) for i in range(0, row.size, block_bytes)]) for row in raw
    ])
    got = load_one_tensor(write_one_tensor(tmp_path / "t.gguf", raw, gguf.GGMLQuantizationType[type_name]))
    assert got.dtype == np.float32 and got.shape == (ROWS, COLS)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_float_types_decode_bit_for_bit(type_name, tmp_path):
    rng = np.random.default_rng(7)
    values = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    if type_name == "BF16":
        # bfloat16 is the upper half of a float32's bits.
        bits = (values.view(np.uint32) >> 16).astype(np.uint16)
        path = write_one_tensor(tmp_path / "t.gguf", bits.view(np.uint8).reshape(ROWS, -1),
                                gguf.GGMLQuantizationType.BF16)
        expected = (bits.astype(np.uint32) << 16).view(np.float32)
    elif type_name == "F16":
        path = write_one_tensor(tmp_path / "t.gguf", values.astype(np.float16), None)
        expected = values.astype(np.float16).astype(np.float32)
    else:
        path = write_one_tensor(tmp_path / "t.gguf", values, None)
        expected = values
    got = load_one_tensor(path)
    assert got.shape == (ROWS, COLS)
    np.testing.assert_array_equal(got, expected)


# type -> largest error allowed, as a fraction of the largest |value| (about one quantization step)
ROUND_TRIP_TOLERANCE = {"Q8_0": 1 / 127, "Q5_1": 1 / 31, "Q5_0": 1 / 15, "Q4_1": 1 / 15, "Q4_0": 1 / 7}


@pytest.mark.parametrize("type_name", sorted(ROUND_TRIP_TOLERANCE))
def test_values_quantized_by_gguf_come_back_within_one_step(type_name, tmp_path):
    qtype = gguf.GGMLQuantizationType[type_name]
    values = np.random.default_rng(3).standard_normal((ROWS, COLS)).astype(np.float32)
    got = load_one_tensor(write_one_tensor(tmp_path / "t.gguf", gguf.quants.quantize(values, qtype), qtype))
    error = np.abs(got - values).max()
    assert 0 < error <= ROUND_TRIP_TOLERANCE[type_name] * np.abs(values).max()
