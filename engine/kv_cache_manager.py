"""The scheduler's only view of the KV cache: look up cached prefixes, allocate slots, free.

The scheduler asks ``allocate_slots(request, n)`` and gets blocks or ``None``
(meaning: preempt someone and ask again); it never sees the free queue, the
reference counts or the prefix-cache table, which live in block_pool.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpilot.engine.block_pool import BlockPool, KVBlock
from kvpilot.engine.request import Request


@dataclass(frozen=True)
class ComputedBlocks:
    """A prefix-cache hit: blocks already holding the first ``num_tokens`` tokens' KV."""

    blocks: tuple[KVBlock, ...]
    num_tokens: int


NO_HIT = ComputedBlocks(blocks=(), num_tokens=0)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # leading full blocks already in the prefix cache
        self._num_slots: dict[str, int] = {}  # tokens with a slot assigned
        self._slots_assigned = 0  # summed over live sequences
        self._blocks_held = 0  # summed over live sequences (a shared block counts once per holder)
        self.prefix_cache_queries = 0  # tokens looked up when a sequence is admitted
        self.prefix_cache_hits = 0  # of those, tokens found cached

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences."""
        return (self.pool.num_blocks - self.pool.num_free_blocks) / self.pool.num_blocks

    def utilization(self) -> float | None:
        """Tokens stored / token slots in the blocks live sequences hold; None with no live sequence."""
        if self._blocks_held == 0:
            return None
        return self._slots_assigned / (self._blocks_held * self.block_size)

    def utilization_counts(self) -> tuple[int, int]:
        """(tokens stored, token slots held), for averaging utilization over time."""
        return self._slots_assigned, self._blocks_held * self.block_size

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest cached prefix of the request's tokens, in whole blocks.

        Never the whole sequence: its last token must be computed so the model
        has logits to sample the next token from.
        """
        if not self.enable_caching:
            return NO_HIT
        self._hash_full_blocks(request, request.num_tokens)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return ComputedBlocks(blocks=tuple(hits), num_tokens=len(hits) * self.block_size)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks = NO_HIT
    ) -> list[KVBlock] | None:
        """Give the request slots for ``num_new_tokens`` more tokens (after ``computed``, if admitting).

        Returns the newly allocated blocks (possibly none), or None when the
        free blocks do not suffice — the caller preempts and retries.
        """
        request_id = request.request_id
        blocks = self._blocks.get(request_id)
        first_allocation = blocks is None
        if first_allocation:
            blocks, block_ids = [], []
        elif computed.blocks:
            raise ValueError(f"{request_id}: prefix-cache hits can only be taken at admission")
        total_tokens = request.num_computed_tokens + computed.num_tokens + num_new_tokens
        num_needed = -(-total_tokens // self.block_size) - len(blocks) - len(computed.blocks)
        # Hit blocks nobody references sit in the free queue; taking them shrinks it.
        num_reclaimed = sum(1 for block in computed.blocks if block.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_reclaimed:
            return None

        if first_allocation:
            self._blocks[request_id] = blocks
            self._block_ids[request_id] = block_ids
            self._num_registered[request_id] = 0
            self._num_slots[request_id] = 0
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += computed.num_tokens
        else:
            block_ids = self._block_ids[request_id]
        if computed.blocks:
            self.pool.touch(computed.blocks)
            blocks.extend(computed.blocks)
            block_ids.extend(block.block_id for block in computed.blocks)
            self._num_registered[request_id] = len(computed.blocks)
        new_blocks = self.pool.get_new_blocks(num_needed) if num_needed > 0 else []
        if new_blocks:
            blocks.extend(new_blocks)
            block_ids.extend(block.block_id for block in new_blocks)
        self._blocks_held += len(computed.blocks) + len(new_blocks)
        self._slots_assigned += total_tokens - self._num_slots[request_id]
        self._num_slots[request_id] = total_tokens

        if self.enable_caching:
            # A block whose slots are all assigned is registered now: its KV is
            # written in this step's forward, before any later step can read it.
            # Slots of proposed tokens (past num_tokens) may still be rejected: a
            # block holding any of them is registered once they are verified.
            num_verified = min(total_tokens, request.num_tokens)
            num_full = num_verified // self.block_size
            num_registered = self._num_registered[request_id]
            if num_full > num_registered:
                self._hash_full_blocks(request, num_verified)
                for i in range(num_registered, num_full):
                    self.pool.cache_full_block(blocks[i], request.block_hashes[i])
                self._num_registered[request_id] = num_full
        return new_blocks

    def free(self, request: Request) -> None:
        """Release every block the request holds (tail first, so its tail is evicted first)."""
        request_id = request.request_id
        blocks = self._blocks.pop(request_id, None)
        if blocks is None:
            return
        del self._block_ids[request_id]
        del self._num_registered[request_id]
        self._slots_assigned -= self._num_slots.pop(request_id)
        self._blocks_held -= len(blocks)
        self.pool.free_blocks(reversed(blocks))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Keep slots for the request's first ``num_tokens`` tokens only; blocks past them are freed
        (tail first). Undoes slots of rejected proposals, which are never in the prefix cache."""
        request_id = request.request_id
        blocks = self._blocks[request_id]
        block_ids = self._block_ids[request_id]
        num_kept = -(-num_tokens // self.block_size)
        assert num_kept >= self._num_registered[request_id], f"{request_id}: trimming a block in the prefix cache"
        assert num_tokens <= self._num_slots[request_id], f"{request_id}: trim can only shrink"
        dropped = blocks[num_kept:]
        if dropped:
            del blocks[num_kept:]
            del block_ids[num_kept:]
            self._blocks_held -= len(dropped)
            self.pool.free_blocks(reversed(dropped))
        self._slots_assigned -= self._num_slots[request_id] - num_tokens
        self._num_slots[request_id] = num_tokens

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the manager's own list: read it, never change it)."""
        return self._block_ids[request_id]

    def holds(self, request_id: str) -> bool:
        return request_id in self._blocks

    def owned_blocks(self) -> dict[str, Sequence[KVBlock]]:
        """Every live sequence's blocks, for accounting checks."""
        return dict(self._blocks)

    def _hash_full_blocks(self, request: Request, num_tokens: int) -> None:
        hashes = request.block_hashes
        tokens = request.all_token_ids
        size = self.block_size
        parent = hashes[-1] if hashes else request.lora_int_id
        for i in range(len(hashes), num_tokens // size):
            parent = hash((parent, tuple(tokens[i * size : (i + 1) * size])))
            hashes.append(parent)
