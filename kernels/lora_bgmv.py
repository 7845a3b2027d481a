"""LoRA for a batch whose rows use different adapters: ``y[i] += (x[i] · A[s]ᵀ) · B[s]ᵀ`` with
``s = row_slots[i]`` (rows with slot -1 untouched), in the style of Punica's BGMV: one kernel
launched twice, to shrink (x · Aᵀ into a narrow intermediate) and to expand (that · Bᵀ added to
y), each program gathering its row's adapter by slot, so one launch pair serves any mix of adapters.

Layouts (engine/lora/layer.py): lora_a [num_slots, width, in_features], lora_b [num_slots,
out_features, width]; widths [num_slots] int32, the columns each slot's adapter uses (the rest of
its width is zero and skipped).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bgmv_kernel(
    v_ptr, m_ptr, out_ptr, row_slots_ptr, widths_ptr,
    num_outputs, num_inputs, v_stride_row, m_stride_slot, m_stride_row, out_stride_row,
    SHRINK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[row, n] (+)= sum_k M[slot, n, k] * v[row, k], slot = row_slots[row]. SHRINK: M is A, the
    slot's width bounds n and out is written; else M is B, the width bounds k and out (y) is added to."""
    row = tl.program_id(0)
    slot = tl.load(row_slots_ptr + row)
    if slot < 0:
        return
    width = tl.load(widths_ptr + slot)
    n_limit = width if SHRINK else num_outputs
    k_limit = num_inputs if SHRINK else width
    if tl.program_id(1) * BLOCK_N >= n_limit:
        return
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    m_rows = m_ptr + slot.to(tl.int64) * m_stride_slot + outs[:, None] * m_stride_row
    for k0 in range(0, k_limit, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(v_ptr + row * v_stride_row + ks, mask=ks < k_limit, other=0.0).to(tl.float32)
        m = tl.load(m_rows + ks[None, :], mask=(outs[:, None] < n_limit) & (ks[None, :] < k_limit),
                    other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        acc += tl.sum(m * v[None, :], axis=1)
    out_at = out_ptr + row * out_stride_row + outs
    mask = outs < n_limit
    if not SHRINK:
        acc += tl.load(out_at, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=mask)


def lora_bgmv(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              row_slots: torch.Tensor, widths: torch.Tensor) -> None:
    """y [num_rows, out_features] += each row's x [num_rows, in_features] · A[slot]ᵀ · B[slot]ᵀ, in place."""
    _check_args(x, y, lora_a, lora_b, row_slots, widths)
    num_rows, in_features = x.shape
    if num_rows == 0:
        return
    max_width, out_features = lora_a.shape[1], y.shape[1]
    shrunk = torch.empty(num_rows, max_width, dtype=torch.float32, device=x.device)  # [num_rows, width]
    block_n = min(64, triton.next_power_of_2(max_width))
    _bgmv_kernel[(num_rows, triton.cdiv(max_width, block_n))](
        x, lora_a, shrunk, row_slots, widths,
        max_width, in_features, x.stride(0), lora_a.stride(0), lora_a.stride(1), shrunk.stride(0),
        SHRINK=True, BLOCK_N=block_n, BLOCK_K=min(128, triton.next_power_of_2(in_features)),
    )
    block_n = min(128, triton.next_power_of_2(out_features))
    _bgmv_kernel[(num_rows, triton.cdiv(out_features, block_n))](
        shrunk, lora_b, y, row_slots, widths,
        out_features, max_width, shrunk.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        SHRINK=False, BLOCK_N=block_n, BLOCK_K=min(64, triton.next_power_of_2(max_width)),
    )


def lora_bgmv_reference(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                        row_slots: torch.Tensor, widths: torch.Tensor) -> None:
    """Plain-torch lora_bgmv, one row at a time, in float32."""
    for row, slot in enumerate(row_slots.tolist()):
        if slot < 0:
            continue
        width = int(widths[slot])
        a, b = lora_a[slot, :width].float(), lora_b[slot, :, :width].float()
        y[row] = (y[row].float() + (x[row].float() @ a.T) @ b.T).to(y.dtype)


def _check_args(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                row_slots: torch.Tensor, widths: torch.Tensor) -> None:
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must be [num_rows, features] with the same rows; got {tuple(x.shape)}, {tuple(y.shape)}")
    if lora_a.dim() != 3 or tuple(lora_a.shape[2:]) != (x.shape[1],):
        raise ValueError(f"lora_a must be [num_slots, width, in_features={x.shape[1]}]; got {tuple(lora_a.shape)}")
    if lora_b.shape != (lora_a.shape[0], y.shape[1], lora_a.shape[1]):
        raise ValueError(f"lora_b must be [num_slots, out_features={y.shape[1]}, width={lora_a.shape[1]}]; "
                         f"got {tuple(lora_b.shape)}")
    if row_slots.shape != (x.shape[0],) or row_slots.dtype != torch.int32:
        raise ValueError(f"row_slots must be int32 [num_rows={x.shape[0]}]; got {row_slots.dtype} {tuple(row_slots.shape)}")
    if widths.shape != (lora_a.shape[0],) or widths.dtype != torch.int32:
        raise ValueError(f"widths must be int32 [num_slots={lora_a.shape[0]}]; got {widths.dtype} {tuple(widths.shape)}")
    if x.stride(1) != 1 or y.stride(1) != 1 or lora_a.stride(2) != 1 or lora_b.stride(2) != 1:
        raise ValueError("x, y, lora_a and lora_b must be contiguous in their last dimension")
    devices = {t.device for t in (x, y, lora_a, lora_b, row_slots, widths)}
    if len(devices) != 1:
        raise ValueError(f"every tensor must be on one device; got {devices}")
