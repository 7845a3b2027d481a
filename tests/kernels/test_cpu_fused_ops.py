"""The fused CPU ops (residual add + RMSNorm, SiLU-and-mul, RoPE, the token bitmask) against their torch
references."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import cpu_fused_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The kernels round where the references round; what is left is float32 summation order and expf,
# a unit or two in the last place of the element type (a product of two rounded values).
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}
ROWS = [1, 3, 37]  # one decode row, a few, more than the threads


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
def test_add_rms_norm_matches_reference(dtype, rows, with_residual):
    gen = torch.Generator().manual_seed(rows)
    hidden = 576  # SmolLM2's width: not a power of two
    delta = torch.randn(rows, hidden, generator=gen).to(dtype)
    residual = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    expected, expected_residual = cpu_fused_ops.add_rms_norm_reference(
        delta, None if residual is None else residual.clone(), weight, 1e-5)
    out, new_residual = cpu_fused_ops.add_rms_norm(delta, residual, weight, 1e-5)
    _assert_close(out, expected)
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)  # one rounding, as torch
    if with_residual:
        assert new_residual.data_ptr() == residual.data_ptr()  # updated in place
    else:
        assert new_residual is delta


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_matches_reference(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    gate_up = (4 * torch.randn(rows, 2 * 1536, generator=gen)).to(dtype)
    _assert_close(cpu_fused_ops.silu_mul(gate_up), cpu_fused_ops.silu_mul_reference(gate_up))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
def test_rope_rotates_the_q_and_k_heads_inside_a_qkv_row_in_place(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    heads, kv_heads, head_dim = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 100
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
    cos, signed_sin = angles.cos().to(dtype), angles.sin().to(dtype)
    signed_sin[..., : head_dim // 2].neg_()
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)  # rows strided
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    expected = cpu_fused_ops.rope_reference(qk.clone(), cos, signed_sin)
    assert cpu_fused_ops.rope_(qk, cos, signed_sin) is qk
    _assert_close(qk, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


def test_misuse_is_refused_with_what_is_wrong():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        cpu_fused_ops.add_rms_norm(x, None, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="must match"):
        cpu_fused_ops.add_rms_norm(x, torch.randn(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_fused_ops.silu_mul(torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="cos must be"):
        cpu_fused_ops.rope_(torch.randn(2, 3, 8), torch.randn(2, 8), torch.randn(2, 1, 8))


def test_without_a_compiler_the_model_falls_back_to_the_references(monkeypatch, tmp_path):
    cpu_fused_ops.load_ops.cache_clear()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("KVPILOT_KERNEL_CACHE", str(tmp_path))
    try:
        assert not cpu_fused_ops.usable(torch.randn(2, 4))
    finally:
        cpu_fused_ops.load_ops.cache_clear()


@pytest.mark.parametrize("vocab", [49152, 1000, 33])
def test_the_token_bitmask_kernel_matches_the_reference_in_place(vocab):
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # every token allowed
    bitmask[2] = 0  # none
    bitmask[3, ::2] = -1  # whole words allowed beside partial ones
    wide = torch.randn(5, vocab + 7, generator=gen)
    before = wide.clone()
    logits = wide[:, 3 : 3 + vocab]  # rows strided
    expected = cpu_fused_ops.apply_token_bitmask_reference(logits, bitmask)
    assert cpu_fused_ops.apply_token_bitmask_(logits, bitmask) is logits
    assert torch.equal(logits, expected)
    assert torch.isinf(expected[2]).all() and torch.equal(expected[1], before[1, 3 : 3 + vocab])
    assert torch.equal(wide[:, :3], before[:, :3]) and torch.equal(wide[:, 3 + vocab :], before[:, 3 + vocab :])
