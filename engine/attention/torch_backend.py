"""Attention over the paged KV cache on the CPU, in torch plus one C kernel.

Decode rows (one new token per sequence) dominate a serving step. On the CPU they go to the C
kernel in ``kvpilot.kernels.cpu_paged_decode``, which reads each context straight from its
cache blocks. Where that kernel cannot be built (no C compiler) or does not fit the shape, and
on other devices, they are attended in plain torch, in batches: sequences are sorted by context
length and cut into a few groups, each group's paged contexts are gathered into one buffer
padded to the group's longest context and masked by length, one
``scaled_dot_product_attention`` call per group. Grouping by length keeps the padding (wasted
reads) small when short and long contexts mix. Sequences with several new tokens (prefill
chunks) are attended one by one with a causal mask offset by their cached prefix.

Grouped-query attention needs no copy of K/V: query heads that share a KV head are folded
into the query-length dimension, since HF's ``repeat_kv`` maps query head h to KV head
``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.kernels import cpu_paged_decode

logger = logging.getLogger(__name__)

# A new decode group starts once contexts have shrunk to this fraction of the group's longest
# and the group already holds enough sequences to amortise one more gather + attention call.
_REGROUP_BLOCK_RATIO = 0.75
_MIN_GROUP_SIZE = 8


@dataclass(frozen=True)
class _DecodeGroup:
    rows: torch.Tensor  # [n] int64 rows in the flat batch of sequences with q_len == 1
    blocks: torch.Tensor  # [n, num_blocks] int64 block ids covering the group's longest context
    mask: torch.Tensor  # [n, 1, 1, num_blocks * block_size] additive: 0 = a real key, -inf = padding


@dataclass(frozen=True)
class _StepPlan:
    """How one step's sequences are attended; built once per step, shared by every layer."""

    # Decode rows for the C kernel: (sequence indices, their rows), both [n] int32; None = no kernel.
    kernel_decode: tuple[torch.Tensor, torch.Tensor] | None
    decode_groups: tuple[_DecodeGroup, ...]  # decode rows attended in torch
    # (seq index, first row, q_len, seq_len) of every sequence with q_len > 1
    multi_token_seqs: tuple[tuple[int, int, int, int], ...]
    store_all_rows: bool  # no padding rows: slot_mapping can be used as is
    writes_all_rows: bool  # every output row is computed, so it need not be zeroed first


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, *, decode_kernel: bool = True) -> None:
        # False keeps decode rows in plain torch everywhere (the reference the kernel is tested against).
        self.decode_kernel = decode_kernel
        self._kernel_ok: dict[tuple, bool] = {}  # per (dtype, shape): did the kernel build?
        # The plan depends only on the (immutable) metadata, so every layer of a step reuses it.
        self._plan_metadata: AttentionMetadata | None = None
        self._plan: _StepPlan | None = None
        # Reused gather buffer for decode K/V: a fresh multi-MB tensor per layer costs more in page
        # faults than the copy itself.
        self._workspace: torch.Tensor | None = None

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
        plan = self._plan_for(metadata, kv_cache, query)
        store_kv(key, value, kv_cache, metadata.slot_mapping, plan.store_all_rows)

        num_tokens, num_heads, head_dim = query.shape
        group = num_heads // key.shape[1]
        out = query.new_empty if plan.writes_all_rows else query.new_zeros
        out = out(num_tokens, num_heads, head_dim)

        if plan.kernel_decode is not None:
            seqs, rows = plan.kernel_decode
            cpu_paged_decode.paged_decode_attention(
                query, kv_cache, metadata.block_tables, metadata.seq_lens, seqs, rows, scale, out
            )

        for decode_group in plan.decode_groups:
            gathered = self._gather(kv_cache, decode_group.blocks)
            out[decode_group.rows] = _attend_decode(query[decode_group.rows], gathered, decode_group.mask, group, scale)

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
                k = _select_blocks(key_cache, blocks)[:seq_len]
                v = _select_blocks(value_cache, blocks)[:seq_len]
            out[start : start + q_len] = _attend_causal(q, k, v, group, scale)
        return out

    def _gather(self, kv_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Blocks [n, b] of K and V -> [2, n, b * block_size, num_kv_heads, head_dim] (a reused buffer).

        The cache is indexed as rows of whole blocks ([2 * num_blocks, block bytes]), K's rows
        then V's: ``index_select`` copies such rows at memcpy speed, about three times faster
        than selecting along dim 1 of the 5-d cache.
        """
        n, blocks_per_seq = blocks.shape
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        row = block_size * num_kv_heads * head_dim
        numel = 2 * n * blocks_per_seq * row
        workspace = self._workspace
        if (
            workspace is None
            or workspace.numel() < numel
            or workspace.dtype != kv_cache.dtype
            or workspace.device != kv_cache.device
        ):
            workspace = self._workspace = torch.empty(numel, dtype=kv_cache.dtype, device=kv_cache.device)
        flat = blocks.flatten()
        rows = torch.cat((flat, flat + num_blocks))  # [2 * n * b]: K rows, then V rows
        gathered = workspace[:numel].view(2 * n * blocks_per_seq, row)
        torch.index_select(kv_cache.view(2 * num_blocks, row), 0, rows, out=gathered)
        return gathered.view(2, n, blocks_per_seq * block_size, num_kv_heads, head_dim)

    def _plan_for(self, metadata: AttentionMetadata, kv_cache: torch.Tensor, query: torch.Tensor) -> _StepPlan:
        if metadata is not self._plan_metadata:
            block_size = kv_cache.shape[2]
            use_kernel = self._kernel_usable(query, kv_cache)
            self._plan = _build_plan(metadata, block_size, query.dtype, use_kernel=use_kernel)
            self._plan_metadata = metadata
        assert self._plan is not None
        return self._plan

    def _kernel_usable(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether decode rows of this dtype and shape go to the C kernel; builds it on first use."""
        if not self.decode_kernel or kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
            return False
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_heads = query.shape[1]
        key = (query.dtype, num_heads, num_kv_heads, head_dim, block_size)
        if key not in self._kernel_ok:
            ok = cpu_paged_decode.supports(
                dtype=query.dtype, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                block_size=block_size,
            )
            if ok:
                try:
                    cpu_paged_decode.kernel_for(query, kv_cache)
                except cpu_paged_decode.KernelBuildError as exc:
                    logger.warning("CPU decode attention falls back to plain torch (slower): %s", exc)
                    ok = False
            self._kernel_ok[key] = ok
        return self._kernel_ok[key]


def _select_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, num_kv_heads, head_dim], blocks [b] -> [b * block_size, num_kv_heads, head_dim].

    Selected as 2-d rows of whole blocks, the fast path of ``index_select``.
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    rows = cache.view(num_blocks, -1).index_select(0, blocks)
    return rows.view(-1, num_kv_heads, head_dim)


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


def _build_plan(
    metadata: AttentionMetadata, block_size: int, dtype: torch.dtype, *, use_kernel: bool = False
) -> _StepPlan:
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

    kernel_decode = None
    groups: tuple[_DecodeGroup, ...] = ()
    if use_kernel and decode:
        device = metadata.block_tables.device
        kernel_decode = (
            torch.tensor(decode, dtype=torch.int32, device=device),
            torch.tensor([starts[i] for i in decode], dtype=torch.int32, device=device),
        )
    elif decode:
        groups = tuple(
            _decode_group(members, metadata, block_size, dtype)
            for members in _split_by_length(decode, seq_lens, block_size)
        )
    num_tokens = metadata.slot_mapping.shape[0]
    no_padding = num_tokens == starts[-1]
    return _StepPlan(
        kernel_decode=kernel_decode,
        decode_groups=groups,
        multi_token_seqs=tuple(multi),
        store_all_rows=no_padding and bool((metadata.slot_mapping >= 0).all()),
        writes_all_rows=no_padding,
    )


def _split_by_length(decode: list[int], seq_lens: list[int], block_size: int) -> list[list[int]]:
    """Decode sequences, longest context first, cut where padding to the group's longest gets wasteful."""
    groups: list[list[int]] = []
    group_blocks = 0
    for i in sorted(decode, key=lambda i: seq_lens[i], reverse=True):
        blocks = -(-seq_lens[i] // block_size)
        if not groups or (len(groups[-1]) >= _MIN_GROUP_SIZE and blocks <= group_blocks * _REGROUP_BLOCK_RATIO):
            groups.append([])
            group_blocks = blocks
        groups[-1].append(i)
    return groups


def _decode_group(
    members: list[int], metadata: AttentionMetadata, block_size: int, dtype: torch.dtype
) -> _DecodeGroup:
    device = metadata.block_tables.device
    lens = [metadata.seq_lens_cpu[i] for i in members]
    num_blocks = -(-max(lens) // block_size)
    seqs = torch.tensor(members, dtype=torch.int64, device=device)
    positions = torch.arange(num_blocks * block_size, device=device)
    lens_tensor = torch.tensor(lens, device=device)
    return _DecodeGroup(
        rows=torch.tensor([metadata.query_start_loc_cpu[i] for i in members], dtype=torch.int64, device=device),
        blocks=metadata.block_tables[seqs, :num_blocks].long(),
        mask=_additive((positions[None, :] < lens_tensor[:, None])[:, None, None, :], dtype),
    )


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean mask -> 0 / -inf in the query dtype: CPU SDPA runs faster with an additive mask."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, -float("inf"))


def _attend_decode(
    query: torch.Tensor,  # [n, num_heads, head_dim]
    gathered_kv: torch.Tensor,  # [2, n, padded_len, num_kv_heads, head_dim]
    mask: torch.Tensor,  # [n, 1, 1, padded_len] additive
    group: int,
    scale: float,
) -> torch.Tensor:  # [n, num_heads, head_dim]
    _, n, _, num_kv_heads, head_dim = gathered_kv.shape
    # q: [n, num_kv_heads, group, head_dim]: the group's heads act as query rows
    q = query.reshape(n, num_kv_heads, group, head_dim)
    # k, v: [n, num_kv_heads, padded_len, head_dim]
    k = gathered_kv[0].transpose(1, 2)
    v = gathered_kv[1].transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(n, num_kv_heads * group, head_dim)


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
    mask = _additive(mask.repeat(group, 1), q.dtype)  # [group * q_len, seq_len]
    out = F.scaled_dot_product_attention(qg, kt, vt, attn_mask=mask, scale=scale)
    return out.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)
