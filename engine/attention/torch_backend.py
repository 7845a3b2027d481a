"""Reference attention over the paged KV cache in plain torch: the CPU path.

Decode rows (one new token per sequence) dominate a serving step, so they are attended
together: their paged contexts are gathered into one padded batch and masked by length,
one ``scaled_dot_product_attention`` call for all of them. Sequences with several new
tokens (prefill chunks) are attended one by one with a causal mask offset by their
cached prefix.

Grouped-query attention needs no copy of K/V: query heads that share a KV head are folded
into the query-length dimension, since HF's ``repeat_kv`` maps query head h to KV head
``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpilot.engine.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class _StepPlan:
    """How one step's sequences are attended; built once per step, shared by every layer."""

    decode_seqs: torch.Tensor | None  # [num_decode] int64 sequence indices with q_len == 1
    decode_rows: torch.Tensor | None  # [num_decode] int64 their rows in the flat batch
    decode_blocks: torch.Tensor | None  # [num_decode, num_blocks_needed] block ids
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, num_blocks_needed * block_size] bool
    # (seq index, first row, q_len, seq_len) of every sequence with q_len > 1
    multi_token_seqs: tuple[tuple[int, int, int, int], ...]
    store_all_rows: bool  # no padding rows: slot_mapping can be used as is
    decode_only: bool  # every row is one sequence's single new token, in order (a pure decode step)


class TorchAttentionBackend:
    name = "torch"

    def __init__(self) -> None:
        # The plan depends only on the (immutable) metadata, so every layer of a step reuses it.
        self._plan_metadata: AttentionMetadata | None = None
        self._plan: _StepPlan | None = None

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        block_size = kv_cache.shape[2]
        plan = self._plan_for(metadata, block_size)
        store_kv(key, value, kv_cache, metadata.slot_mapping, plan.store_all_rows)

        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = key.shape[1]
        group = num_heads // num_kv_heads
        if plan.decode_only:
            return _attend_decode(query, kv_cache, plan, group, scale)
        out = query.new_zeros(num_tokens, num_heads, head_dim)

        if plan.decode_seqs is not None:
            out[plan.decode_rows] = _attend_decode(query, kv_cache, plan, group, scale)

        key_cache, value_cache = kv_cache[0], kv_cache[1]
        for seq, start, q_len, seq_len in plan.multi_token_seqs:
            q = query[start : start + q_len]
            if seq_len == q_len:
                # Nothing cached before this chunk: its own keys are the whole context.
                k = key[start : start + q_len]
                v = value[start : start + q_len]
            else:
                num_blocks = -(-seq_len // block_size)
                blocks = metadata.block_tables[seq, :num_blocks].long()
                k = key_cache[blocks].flatten(0, 1)[:seq_len]
                v = value_cache[blocks].flatten(0, 1)[:seq_len]
            out[start : start + q_len] = _attend_causal(q, k, v, group, scale)
        return out

    def _plan_for(self, metadata: AttentionMetadata, block_size: int) -> _StepPlan:
        if metadata is not self._plan_metadata:
            self._plan = _build_plan(metadata, block_size)
            self._plan_metadata = metadata
        assert self._plan is not None
        return self._plan


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding
    all_rows_valid: bool | None = None,
) -> None:
    """Write each token's K/V into its slot; rows whose slot is -1 are skipped."""
    if all_rows_valid is None:
        all_rows_valid = bool((slot_mapping >= 0).all())
    if not all_rows_valid:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slot_mapping] = key
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slot_mapping] = value


def _build_plan(metadata: AttentionMetadata, block_size: int) -> _StepPlan:
    starts = metadata.query_start_loc_cpu
    seq_lens = metadata.seq_lens_cpu
    decode: list[int] = []
    multi: list[tuple[int, int, int, int]] = []
    for i, seq_len in enumerate(seq_lens):
        q_len = starts[i + 1] - starts[i]
        if q_len == 1:
            decode.append(i)
        elif q_len > 1:
            multi.append((i, starts[i], q_len, seq_len))

    device = metadata.block_tables.device
    decode_seqs = decode_rows = decode_blocks = decode_mask = None
    if decode:
        max_len = max(seq_lens[i] for i in decode)
        num_blocks = -(-max_len // block_size)
        decode_seqs = torch.tensor(decode, dtype=torch.int64, device=device)
        decode_rows = torch.tensor([starts[i] for i in decode], dtype=torch.int64, device=device)
        decode_blocks = metadata.block_tables[decode_seqs, :num_blocks].long()
        lens = torch.tensor([seq_lens[i] for i in decode], device=device)
        positions = torch.arange(num_blocks * block_size, device=device)
        decode_mask = (positions[None, :] < lens[:, None])[:, None, None, :]

    num_tokens = metadata.slot_mapping.shape[0]
    no_padding = num_tokens == starts[-1]
    return _StepPlan(
        decode_seqs=decode_seqs,
        decode_rows=decode_rows,
        decode_blocks=decode_blocks,
        decode_mask=decode_mask,
        multi_token_seqs=tuple(multi),
        store_all_rows=no_padding and bool((metadata.slot_mapping >= 0).all()),
        decode_only=no_padding and len(decode) == len(seq_lens) > 0,
    )


def _attend_decode(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    plan: _StepPlan,
    group: int,
    scale: float,
) -> torch.Tensor:  # [num_decode, num_heads, head_dim]
    assert plan.decode_rows is not None and plan.decode_blocks is not None
    num_decode = plan.decode_rows.shape[0]
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    # q: [num_decode, num_kv_heads, group, head_dim]: the group's heads act as query rows
    rows = query if plan.decode_only else query[plan.decode_rows]
    q = rows.reshape(num_decode, num_kv_heads, group, head_dim)
    # k, v: [num_decode, num_kv_heads, padded_len, head_dim]
    k = kv_cache[0][plan.decode_blocks].flatten(1, 2).transpose(1, 2)
    v = kv_cache[1][plan.decode_blocks].flatten(1, 2).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.decode_mask, scale=scale)
    return out.reshape(num_decode, num_kv_heads * group, head_dim)


def _attend_causal(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    k: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    v: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    group: int,
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    q_len, num_heads, head_dim = q.shape
    seq_len, num_kv_heads, _ = k.shape
    # [num_kv_heads, group * q_len, head_dim]; row g * q_len + j is head (kv, g), query j
    qg = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim)
    kt = k.transpose(0, 1)  # [num_kv_heads, seq_len, head_dim]
    vt = v.transpose(0, 1)
    # Query j sits at position seq_len - q_len + j and sees keys up to and including it.
    query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]  # [q_len, seq_len]
    mask = mask.repeat(group, 1)  # [group * q_len, seq_len]
    out = F.scaled_dot_product_attention(qg, kt, vt, attn_mask=mask, scale=scale)
    return out.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)
