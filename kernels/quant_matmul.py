"""Weight-only quantized matmul on CUDA: ``x @ W.T`` with W's 4- or 8-bit codes dequantized tile by
tile inside the GEMM (a Triton kernel), never as a whole.

The layout is quant_layout.py's; its ``quant_matmul_reference`` (dequantize to float32, multiply)
is this kernel's reference. The launcher checks shapes and dtypes and picks the grid. Tested on the
CPU under TRITON_INTERPRET=1 and on a GPU with KVPILOT_TEST_DEVICE=cuda.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.quant_layout import check_packed


@triton.jit
def _quant_matmul_kernel(
    x_ptr, codes_ptr, scales_ptr, offsets_ptr, out_ptr,
    M, N, K, stride_xm, stride_om,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]: output features
    row_mask = rows < M
    col_mask = cols < N
    num_groups = K // GROUP_SIZE
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_mask = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w_mask = k_mask[:, None] & col_mask[None, :]
        if BITS == 4:
            # Input k sits in byte (k // 32) * 16 + k % 16 of its row, high nibble when k % 32 >= 16.
            byte_index = (ks // 32) * 16 + ks % 16
            packed = tl.load(codes_ptr + cols[None, :].to(tl.int64) * (K // 2) + byte_index[:, None],
                             mask=w_mask, other=0)  # [BLOCK_K, BLOCK_N] uint8
            codes = (packed >> (((ks % 32) // 16) * 4)[:, None].to(tl.uint8)) & 0xF
        else:
            codes = tl.load(codes_ptr + cols[None, :].to(tl.int64) * K + ks[:, None],
                            mask=w_mask, other=0)  # [BLOCK_K, BLOCK_N] int8
        group_index = cols[None, :] * num_groups + (ks // GROUP_SIZE)[:, None]  # [BLOCK_K, BLOCK_N]
        scales = tl.load(scales_ptr + group_index, mask=w_mask, other=0.0).to(tl.float32)
        w = codes.to(tl.float32) * scales
        if HAS_OFFSETS:
            w += tl.load(offsets_ptr + group_index, mask=w_mask, other=0.0).to(tl.float32)
        # Half-precision inputs multiply on the tensor cores in their own dtype, accumulating in float32.
        acc += tl.dot(x, w.to(x_ptr.dtype.element_ty))
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def quant_matmul(
    x: torch.Tensor,  # [M, K]
    codes: torch.Tensor,  # 4 bits: [N, K // 2] uint8; 8 bits: [N, K] int8
    scales: torch.Tensor,  # [N, K // group_size] float16
    offsets: torch.Tensor | None,  # [N, K // group_size] float16 (4 bits); None (8 bits)
    *,
    bits: int,
    group_size: int,
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ dequantize(codes, scales, offsets).T`` with the weight dequantized tile by tile."""
    n, k = check_packed(codes, scales, offsets, bits=bits, group_size=group_size)
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x must be [M, {k}] with contiguous rows, got {tuple(x.shape)} strides {x.stride()}")
    if x.device != codes.device:
        raise ValueError(f"x is on {x.device} but the weight on {codes.device}")
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else 64
    block_n, block_k = 64, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _quant_matmul_kernel[grid](
        x, codes, scales, scales if offsets is None else offsets, out,
        m, n, k, x.stride(0), out.stride(0),
        BITS=bits, GROUP_SIZE=group_size, HAS_OFFSETS=offsets is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out
