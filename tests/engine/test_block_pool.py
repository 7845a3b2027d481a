"""BlockPool: the free queue, reference counts and LRU eviction of cached blocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_queue]


def test_allocate_and_free_round_trip():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == 4
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_asking_for_more_than_free_raises():
    pool = BlockPool(2, enable_caching=False)
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.get_new_blocks(3)


def test_free_queue_remove_from_middle_is_linked_correctly():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    queue.appendleft(blocks[2])
    assert [b.block_id for b in queue] == [2, 0, 1, 3, 4]
    assert queue.popleft() is blocks[2]
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4, 2]
    assert len(queue) == 5
    for _ in range(5):
        queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


def test_cached_blocks_survive_free_and_are_evicted_last_and_lru():
    pool = BlockPool(4, enable_caching=True)
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_full_block(a, 111)
    pool.cache_full_block(b, 222)
    pool.free_blocks([a])  # cached, freed first: least recently used
    pool.free_blocks([b])
    pool.free_blocks([c])  # uncached: handed out before any cached block
    assert free_ids(pool) == [c.block_id, a.block_id, b.block_id]
    assert pool.get_cached_block(111) is a

    (first,) = pool.get_new_blocks(1)
    assert first is c and pool.get_cached_block(111) is a
    (second,) = pool.get_new_blocks(1)
    assert second is a  # LRU cached block evicted
    assert pool.get_cached_block(111) is None and a.block_hash is None
    assert pool.get_cached_block(222) is b


def test_touch_takes_a_cached_free_block_out_of_the_queue():
    pool = BlockPool(3, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, 7)
    pool.free_blocks([a])
    assert pool.num_free_blocks == 3
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2 and a not in list(pool.free_queue)
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a, a])
    assert a.ref_cnt == 0 and pool.get_cached_block(7) is a


def test_duplicate_content_registers_only_the_first_block():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 5)
    pool.cache_full_block(b, 5)
    assert pool.get_cached_block(5) is a and b.block_hash is None


def test_double_free_is_caught():
    pool = BlockPool(1, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(AssertionError):
        pool.free_blocks(blocks)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "touch"]), st.integers(0, 7)), max_size=80))
def test_pool_accounting_under_random_operations(ops):
    pool = BlockPool(8, enable_caching=True)
    held: list[KVBlock] = []  # one entry per reference taken
    for op, arg in ops:
        if op == "alloc" and arg <= pool.num_free_blocks:
            held.extend(pool.get_new_blocks(arg))
        elif op == "free" and held:
            pool.free_blocks([held.pop(arg % len(held))])
        elif op == "cache" and held:
            pool.cache_full_block(held[arg % len(held)], arg)
        elif op == "touch":
            block = pool.get_cached_block(arg)
            if block is not None:
                pool.touch([block])
                held.append(block)
        in_queue = list(pool.free_queue)
        assert len(in_queue) == pool.num_free_blocks == len(set(map(id, in_queue)))
        for block in pool.blocks:
            assert block.ref_cnt == sum(1 for h in held if h is block)
            assert (block.ref_cnt == 0) == (block in in_queue)
        for block_hash, block in pool.cached.items():
            assert block.block_hash == block_hash
    pool.free_blocks(held)
    assert pool.num_free_blocks == 8
