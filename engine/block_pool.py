"""The pool of KV cache blocks: O(1) allocate and free, reference counts, prefix-cache lookups.

Every block is either referenced (ref_cnt > 0, owned by one or more sequences)
or in the free queue. A free block may still hold a cached prefix (it keeps its
hash): a later request with the same prefix takes it straight out of the
queue. New allocations pop from the queue's head, evicting whatever cached
content that block had. A freed block without cached content goes to the head
(used first); a freed cached block goes to the tail — so cached blocks are
evicted in least-recently-used order, and only when no other free block is left.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None  # set while the block is registered in the prefix cache
        # Links of the free queue; both None while the block is not in it.
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks themselves: O(1) pop, append and remove-from-middle."""

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: no None checks on the hot path
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def appendleft(self, block: KVBlock) -> None:
        first = self._head.next_free
        first.prev_free = block
        block.next_free = first
        block.prev_free = self._head
        self._head.next_free = block
        self.num_free += 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}  # block hash -> the block holding that content

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references, cached content or not: all can be handed out."""
        return self.free_queue.num_free

    def get_new_blocks(self, count: int) -> list[KVBlock]:
        if count > self.free_queue.num_free:
            raise ValueError(f"asked for {count} KV blocks but only {self.free_queue.num_free} are free")
        blocks = []
        for _ in range(count):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling unreferenced ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_block(self, block: KVBlock, block_hash: int) -> None:
        """Register a block whose slots are all assigned; a second copy of the same content stays unregistered."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; pass a sequence's blocks tail first so its tail is evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"{block} freed more often than it was taken"
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)  # holds nothing reusable: hand it out first
                else:
                    self.free_queue.append(block)  # most recently used cached block: evicted last

    def reset_prefix_cache(self) -> None:
        for block in list(self.cached.values()):
            self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
