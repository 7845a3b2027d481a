"""A decode step's decoder layers in one C call: cpu_decode_layers.c's glue over the CPU kernels.

The C side calls the same kernels the layer-by-layer Python path calls (cpu_fused_ops,
cpu_int8_matmul, cpu_paged_decode), in the same order, through function pointers taken here from
their libraries; so its reference is that path itself (engine/models/llama.py's DecoderLayer with
the torch attention backend), which the tests compare it with bit for bit.

``DecodeModel`` and ``DecodeLayer`` mirror the C structs; whoever fills them (engine/cpu_decode.py)
keeps the tensors they point into alive.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kvpilot.kernels.cpu_build import DTYPE_CODES, load_library

SOURCE = Path(__file__).with_name("cpu_decode_layers.c")
_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64
__all__ = ["DecodeLayer", "DecodeModel", "DecodeStep", "Linear", "address", "load_kernel"]


class Linear(ctypes.Structure):
    _fields_ = [("matmul", _ptr), ("codes", _ptr), ("scales", _ptr), ("offsets", _ptr), ("bias", _ptr),
                ("n", _i64), ("k", _i64)]  # fmt: skip


class DecodeLayer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_attention_norm", _ptr), ("qkv", Linear), ("o", Linear),
                ("gate_up", Linear), ("down", Linear), ("kv_cache", _ptr)]  # fmt: skip


class DecodeModel(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                    "intermediate", "num_blocks", "block_size")),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("bf16", ctypes.c_int),
        ("add_rms_norm", _ptr), ("silu_mul", _ptr), ("rope", _ptr), ("attention", _ptr),
        ("layers", ctypes.POINTER(DecodeLayer)),
    ]  # fmt: skip


class DecodeStep(ctypes.Structure):
    _fields_ = [
        ("n", _i64),
        *((name, _ptr) for name in ("delta", "residual", "normed", "qkv", "attn", "gate_up", "act", "cos",
                                    "signed_sin", "slot_mapping", "block_tables")),
        ("table_stride", _i64), ("seq_lens", _ptr), ("index", _ptr),
    ]  # fmt: skip


def address(function: ctypes._CFuncPtr) -> int:
    """A loaded C function's address, for a function-pointer field."""
    return ctypes.cast(function, ctypes.c_void_p).value


@functools.cache
def load_kernel(dtype: torch.dtype) -> ctypes._CFuncPtr:
    """``kvpilot_decode_layers(model, step) -> 0 | -1`` for dtype (built once per machine); raises
    KernelBuildError without a working compiler."""
    function = load_library(SOURCE, {"DTYPE": DTYPE_CODES[dtype]}).kvpilot_decode_layers
    function.argtypes = [ctypes.POINTER(DecodeModel), ctypes.POINTER(DecodeStep)]
    function.restype = ctypes.c_int
    return function
