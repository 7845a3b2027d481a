"""The decoder layer's small operations, fused for the CPU (cpu_fused_ops.c), beside their torch references.

- ``add_rms_norm``: the residual add before a norm and the RMSNorm itself, in one pass;
- ``silu_mul``: SiLU of the gate half times the up half of a fused gate/up projection;
- ``rope_``: rotary embeddings applied in place to the q and k heads of a fused qkv projection;
- ``apply_token_bitmask_``: structured outputs' allowed-token bitmask applied to logits in place
  (torch's masked_fill over the unpacked mask took ~1.5 ms for 16 rows of a 49k vocabulary).

The references are the model's definition of these operations (transformers' numerics: RMSNorm
in float32 rounded before the weight, RoPE in the model dtype) and run wherever the kernel does
not: other devices, or no C compiler. ``usable`` says which applies to a tensor.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from kvpilot.kernels.cpu_build import DTYPE_CODES, KernelBuildError, load_library

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_fused_ops.c")


# ---------------------------------------------------------------------------------- references


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalised in float32 and rounded before the weight, as transformers does.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_rms_norm_reference(
    delta: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + delta), residual + delta); no residual: (rms_norm(delta), delta)."""
    residual = delta if residual is None else residual + delta
    return rms_norm_reference(residual, weight, eps), residual


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos, signed_sin: [num_tokens, 1, head_dim] (halves repeated,
    sin's first half negated). The "rotate half" form ``x * cos + cat(-x2, x1) * sin``: swapping the
    halves is a roll and the negation lives in ``signed_sin``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] with every token whose bit is clear in bitmask [rows, ceil(vocab / 32)]
    int32 (bit t of word w: token 32 w + t) at -inf; a new tensor."""
    allowed = (bitmask.unsqueeze(-1) & _BIT_VALUES.to(bitmask.device)) != 0  # [rows, words, 32]
    allowed = allowed.reshape(bitmask.shape[0], -1)[:, : logits.shape[1]]
    return logits.masked_fill(~allowed, -float("inf"))


# 1 << t for each bit of an int32 word (bit 31 is the sign bit: -2**31).
_BIT_VALUES = torch.tensor([1 << t for t in range(32)], dtype=torch.int64).to(torch.int32)


# ---------------------------------------------------------------------------------- kernels


def usable(x: torch.Tensor) -> bool:
    """Whether the fused kernels run for tensors like x (CPU, a supported dtype, the kernel built)."""
    return x.device.type == "cpu" and x.dtype in DTYPE_CODES and load_ops(x.dtype) is not None


@functools.cache
def load_ops(dtype: torch.dtype) -> ctypes.CDLL | None:
    """The kernels for dtype, built on first use; None (after one warning) when they cannot be built."""
    try:
        library = load_library(SOURCE, {"DTYPE": DTYPE_CODES[dtype]})
    except KernelBuildError as exc:
        logger.warning("fused CPU ops fall back to plain torch (slower): %s", exc)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.kvpilot_add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float]
    library.kvpilot_silu_mul.argtypes = [ptr, ptr, i64, i64]
    library.kvpilot_rope.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr]
    library.kvpilot_apply_token_bitmask.argtypes = [ptr, i64, ptr, i64, i64, i64]
    for function in (library.kvpilot_add_rms_norm, library.kvpilot_silu_mul, library.kvpilot_rope,
                     library.kvpilot_apply_token_bitmask):
        function.restype = None
    return library


def add_rms_norm(
    delta: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor | None,  # [num_tokens, hidden], updated in place; None: delta is the residual
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [num_tokens, hidden], the residual)
    _check_rows("delta", delta, weight.dtype)
    if residual is not None:
        _check_rows("residual", residual, weight.dtype)
        if residual.shape != delta.shape:
            raise ValueError(f"residual {tuple(residual.shape)} and delta {tuple(delta.shape)} must match")
    if weight.shape != (delta.shape[1],) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{delta.shape[1]}], got {tuple(weight.shape)}")
    out = torch.empty_like(delta)
    _ops(weight).kvpilot_add_rms_norm(
        delta.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
        delta.shape[0], delta.shape[1], eps,
    )  # fmt: skip
    return out, delta if residual is None else residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * inter] -> [num_tokens, inter]
    _check_rows("gate_up", gate_up, gate_up.dtype)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must have an even number of columns, got {gate_up.shape[1]}")
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    _ops(gate_up).kvpilot_silu_mul(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1])
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [num_tokens, heads, head_dim] in place (heads contiguous, rows may be strided, as
    the q and k heads inside a qkv row are) by cos, signed_sin [num_tokens, 1, head_dim]."""
    num_tokens, heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim or head_dim % 2:
        raise ValueError("x must be [num_tokens, heads, head_dim] with contiguous heads and an even head_dim")
    for name, table in (("cos", cos), ("signed_sin", signed_sin)):
        if table.shape != (num_tokens, 1, head_dim) or not table.is_contiguous() or table.dtype != x.dtype:
            raise ValueError(f"{name} must be contiguous [{num_tokens}, 1, {head_dim}] {x.dtype}, "
                             f"got {tuple(table.shape)} {table.dtype}")
    _ops(x).kvpilot_rope(x.data_ptr(), x.stride(0), num_tokens, heads, head_dim, cos.data_ptr(),
                         signed_sin.data_ptr())
    return x


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Sets logits [rows, vocab] (rows may be strided) to -inf in place where bitmask [rows,
    ceil(vocab / 32)] int32 has the token's bit clear."""
    rows, vocab = logits.shape
    words = (vocab + 31) // 32
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous within a row")
    if bitmask.shape != (rows, words) or bitmask.dtype != torch.int32 or not bitmask.is_contiguous() \
            or bitmask.device.type != "cpu":
        raise ValueError(f"bitmask must be a contiguous CPU int32 [{rows}, {words}], got {tuple(bitmask.shape)} "
                         f"{bitmask.dtype}")
    _ops(logits).kvpilot_apply_token_bitmask(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), rows, vocab,
                                             words)
    return logits


def _ops(x: torch.Tensor) -> ctypes.CDLL:
    library = load_ops(x.dtype) if x.device.type == "cpu" and x.dtype in DTYPE_CODES else None
    if library is None:
        raise ValueError(f"no fused CPU kernel for a {x.dtype} tensor on {x.device}; check usable() first")
    return library


def _check_rows(name: str, x: torch.Tensor, dtype: torch.dtype) -> None:
    if x.dim() != 2 or not x.is_contiguous() or x.dtype != dtype:
        raise ValueError(f"{name} must be a contiguous [num_tokens, columns] {dtype} tensor, "
                         f"got {tuple(x.shape)} {x.dtype} (contiguous: {x.is_contiguous()})")
