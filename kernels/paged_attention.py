"""Paged attention over variable-length queries: one kernel for prefill chunks and decode.

A batch holds num_seqs sequences; sequence i's new query tokens are rows
query_start_loc[i]:query_start_loc[i+1] of `query` and are the LAST q_len_i positions of its context
of seq_lens[i] tokens, whose K/V live in the paged cache through block_tables[i]. Query j of sequence
i sits at position seq_len_i - q_len_i + j and attends causally to keys 0 .. that position. This one
rule covers a whole prompt, a prefill chunk on top of a cached prefix, and decode (q_len = 1).

Work split. A program owns one KV head of one sequence and a tile of BLOCK_M query rows: BLOCK_Q
consecutive query tokens x the QUERIES_PER_KV query heads that share that KV head (GQA packing). So a
decode program reads each K/V tile once for all its query heads, which is what keeps decode at HBM
speed. Programs map to sequences without any host work: sequence i's tiles start at global tile index
query_start_loc[i] // BLOCK_Q + i (monotonic, and leaves room for ceil(q_len_i / BLOCK_Q) tiles), and a
program finds its sequence by binary search; surplus programs exit at once. The grid therefore depends
only on num_tokens and num_seqs, which is what CUDA-graph replay needs.

The inner loop streams TILE_N keys at a time through the block table (TILE_N need not equal the cache
block size), with an online softmax in float32 (base 2; the scale folded with log2(e)), never
materialising the score matrix. With NUM_SPLITS > 1 each program does one split of the context and
writes a partial result that kernels/split_kv_decode.py merges (flash-decoding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .split_kv_decode import choose_num_splits, merge_splits

_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_loc_ptr, tile_global, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest i with query_start_loc[i] // BLOCK_Q + i <= tile_global (binary search)."""
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        mid_start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if mid_start <= tile_global:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr, query_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    partial_out_ptr, partial_lse_ptr,
    qk_scale_log2, num_seqs,
    q_stride_tok, q_stride_head, o_stride_tok, o_stride_head,
    k_stride_block, k_stride_slot, k_stride_head,
    v_stride_block, v_stride_slot, v_stride_head,
    bt_stride_seq,
    NUM_HEADS: tl.constexpr, QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tile_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(query_start_loc_ptr, tile_global, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile_global - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len  # tokens before this step's first query

    # Row r of the tile is query token q_tile * BLOCK_Q + r // QUERIES_PER_KV, head r % QUERIES_PER_KV
    # of this KV head's group.
    rows = tl.arange(0, BLOCK_M)
    q_tok = q_tile * BLOCK_Q + rows // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (q_tok < q_len)
    q_pos = prefix_len + q_tok  # absolute position of each row's query
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    # q: [BLOCK_M, HEAD_DIM_PAD]
    q_offsets = (q_start + q_tok).to(tl.int64)[:, None] * q_stride_tok + head[:, None] * q_stride_head
    q = tl.load(query_ptr + q_offsets + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    # Keys any row of this tile may see: 0 .. position of its last query.
    last_q_tok = tl.minimum((q_tile + 1) * BLOCK_Q, q_len) - 1
    num_keys = prefix_len + last_q_tok + 1
    num_tiles = tl.cdiv(num_keys, TILE_N)
    if NUM_SPLITS == 1:
        tile_lo = 0
        tile_hi = num_tiles
    else:
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of scaled scores
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * bt_stride_seq
    for tile in range(tile_lo, tile_hi):
        keys = tile * TILE_N + tl.arange(0, TILE_N)
        key_valid = keys < num_keys
        block_ids = tl.load(block_table_row + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        in_block = keys % BLOCK_SIZE
        k_offsets = block_ids * k_stride_block + in_block * k_stride_slot + kv_head * k_stride_head
        # k: [HEAD_DIM_PAD, TILE_N]
        k = tl.load(k_cache_ptr + k_offsets[None, :] + dims[:, None],
                    mask=key_valid[None, :] & dim_valid[:, None], other=0.0)
        # s: [BLOCK_M, TILE_N], in log2 units
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale_log2
        visible = (keys[None, :] <= q_pos[:, None]) & key_valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead of -inf there.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_offsets = block_ids * v_stride_block + in_block * v_stride_slot + kv_head * v_stride_head
        # v: [TILE_N, HEAD_DIM_PAD]
        v = tl.load(v_cache_ptr + v_offsets[:, None] + dims[None, :],
                    mask=key_valid[:, None] & dim_valid[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Rows without any visible key (only padding: seq_len 0) produce zeros, not 0/0.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if NUM_SPLITS == 1:
        o_offsets = (q_start + q_tok).to(tl.int64)[:, None] * o_stride_tok + head[:, None] * o_stride_head
        tl.store(out_ptr + o_offsets + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & dim_valid[None, :])
    else:
        # partial_out: [num_tokens, NUM_HEADS, NUM_SPLITS, HEAD_DIM_PAD]; partial_lse: [.., NUM_SPLITS]
        partial_row = ((q_start + q_tok).to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(partial_out_ptr + partial_row[:, None] * HEAD_DIM_PAD + dims[None, :], out,
                 mask=row_valid[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(partial_lse_ptr + partial_row, lse, mask=row_valid)


@dataclass(frozen=True)
class AttentionLaunchConfig:
    """Tile sizes and Triton launch options (benchmarks/gpu_attention.py sweeps these)."""

    block_m: int  # query rows per program: query tokens x the query heads sharing one KV head
    tile_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int


def default_launch_config(max_query_len: int, queries_per_kv: int, head_dim: int,
                          device: torch.device) -> AttentionLaunchConfig:
    """Decode batches pack a KV head's query heads into a minimal 16-row tile; prefill uses 64 rows."""
    group_rows = triton.next_power_of_2(queries_per_kv)
    head_dim_pad = padded_head_dim(head_dim)
    if device.type != "cuda":
        # The interpreter runs tiles as numpy arrays: fewer, larger programs are faster.
        return AttentionLaunchConfig(block_m=max(16 if max_query_len == 1 else 32, group_rows),
                                     tile_n=32, num_warps=4, num_stages=1)
    if max_query_len == 1:
        return AttentionLaunchConfig(block_m=max(16, group_rows), tile_n=64 if head_dim_pad <= 128 else 32,
                                     num_warps=4, num_stages=3)
    return AttentionLaunchConfig(block_m=max(64, group_rows), tile_n=64 if head_dim_pad <= 128 else 32,
                                 num_warps=4, num_stages=2)


def padded_head_dim(head_dim: int) -> int:
    """Tiles span a power of two >= 16 along head_dim (tl.dot needs K >= 16); extra lanes are masked."""
    return max(16, triton.next_power_of_2(head_dim))


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    *,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: AttentionLaunchConfig | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged KV; returns out [num_tokens, num_heads, head_dim].

    max_query_len / max_seq_len are host-side bounds used only to pick tile sizes and the split count
    (no device sync). num_splits None lets the launcher choose split-KV by shape.
    """
    _check_attention_args(query, kv_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = kv_cache.shape[3]
    block_size = kv_cache.shape[2]
    queries_per_kv = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(f"out must match query ({tuple(query.shape)}, {query.dtype}) and be contiguous "
                         f"in head_dim; got {tuple(out.shape)}, {out.dtype}")
    if num_tokens == 0 or num_seqs == 0:
        return out
    if config is None:
        config = default_launch_config(max_query_len, queries_per_kv, head_dim, query.device)
    _check_config(config, queries_per_kv)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_query_len, max_seq_len, query.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    head_dim_pad = padded_head_dim(head_dim)
    block_q = config.block_m // queries_per_kv
    num_q_tiles = num_tokens // block_q + num_seqs
    if num_splits > 1:
        # partial_out: [num_tokens, num_heads, num_splits, head_dim_pad]; partial_lse: [num_tokens, num_heads, num_splits]
        partial_out = torch.empty(num_tokens, num_heads, num_splits, head_dim_pad,
                                  dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        partial_out = partial_lse = out  # unused by the single-pass variant
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _paged_attention_kernel[(num_q_tiles, num_kv_heads, num_splits)](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        partial_out, partial_lse,
        scale * _LOG2E, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        NUM_HEADS=num_heads, QUERIES_PER_KV=queries_per_kv,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=config.block_m, BLOCK_Q=block_q, TILE_N=config.tile_n, BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits, DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_splits > 1:
        merge_splits(partial_out, partial_lse, out)
    return out


def paged_attention_reference(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Plain torch, one sequence at a time: gather the context's K/V, then masked softmax in float32."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q = query[starts[i]:starts[i + 1]].float()  # [q_len, num_heads, head_dim]
        q_len = q.shape[0]
        blocks = block_tables[i, :triton.cdiv(seq_len, block_size)].long()
        # k, v: [seq_len, num_heads, head_dim] after repeating each KV head for its query heads
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [num_heads, q_len, seq_len]
        q_pos = seq_len - q_len + torch.arange(q_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def _check_config(config: AttentionLaunchConfig, queries_per_kv: int) -> None:
    for name in ("block_m", "tile_n"):
        value = getattr(config, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"AttentionLaunchConfig.{name} must be a power of two >= 16, got {value}")
    if config.block_m < queries_per_kv:
        raise ValueError(f"AttentionLaunchConfig.block_m={config.block_m} must hold all "
                         f"{queries_per_kv} query heads of a KV head")


def _check_attention_args(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                          seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError("kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(kv_cache.shape)}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != head_dim:
        raise ValueError(f"kv_cache head_dim {kv_cache.shape[4]} != query head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32) or kv_cache.dtype != query.dtype:
        raise ValueError(f"query and kv_cache must share one of float16/bfloat16/float32; "
                         f"got {query.dtype} and {kv_cache.dtype}")
    if query.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("query and kv_cache must be contiguous in head_dim (last stride 1)")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if num_seqs < 0 or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [num_seqs], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if query_start_loc.shape != (num_seqs + 1,) or query_start_loc.dtype != torch.int32:
        raise ValueError(f"query_start_loc must be int32 [num_seqs + 1 = {num_seqs + 1}], "
                         f"got {query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32 [num_seqs = {num_seqs}, max_blocks_per_seq], "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    if block_tables.stride(1) != 1 or not seq_lens.is_contiguous() or not query_start_loc.is_contiguous():
        raise ValueError("block_tables rows, seq_lens and query_start_loc must be contiguous")
    devices = {query.device, kv_cache.device, block_tables.device, seq_lens.device, query_start_loc.device}
    if len(devices) != 1:
        raise ValueError(f"all attention inputs must share one device; got {devices}")
