"""KVCacheManager: slot allocation, prefix-cache hits, freeing, usage and utilization figures."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.kv_cache_manager import KVCacheManager
from kvpilot.engine.request import Request


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, params=None, arrival_time=0.0)


def admit(manager: KVCacheManager, request: Request, num_new: int | None = None):
    computed = manager.get_computed_blocks(request)
    if num_new is None:
        num_new = request.num_tokens - computed.num_tokens
    blocks = manager.allocate_slots(request, num_new, computed)
    if blocks is not None:
        request.num_computed_tokens = computed.num_tokens + num_new
    return computed, blocks


def test_allocation_grows_a_block_at_a_time():
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    request = make_request("a", list(range(6)))
    _, blocks = admit(manager, request)
    assert len(blocks) == 2 and manager.get_block_ids("a") == [b.block_id for b in blocks]
    for expected_new in (0, 0, 1, 0):  # tokens 7, 8 fit in block 2; token 9 opens block 3
        request.append_output_token(1)
        new = manager.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        assert len(new) == expected_new
    assert len(manager.get_block_ids("a")) == 3
    manager.free(request)
    assert manager.num_free_blocks == 10


def test_allocate_returns_none_when_blocks_run_out_and_changes_nothing():
    manager = KVCacheManager(num_blocks=3, block_size=4, enable_caching=False)
    first = make_request("a", list(range(8)))
    admit(manager, first)
    second = make_request("b", list(range(8)))
    assert manager.allocate_slots(second, 8) is None
    assert manager.num_free_blocks == 1 and not manager.holds("b")


def test_prefix_hit_shares_full_blocks_but_never_the_last_token():
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    prompt = list(range(100, 112))  # exactly three full blocks
    first = make_request("a", prompt)
    admit(manager, first)
    second = make_request("b", prompt)
    computed, blocks = admit(manager, second)
    # The last token must be computed to get logits, so the third block is not a hit.
    assert computed.num_tokens == 8
    assert manager.get_block_ids("b")[:2] == manager.get_block_ids("a")[:2]
    assert manager.get_block_ids("b")[2] != manager.get_block_ids("a")[2]
    assert len(blocks) == 1
    assert manager.prefix_cache_queries == 24 and manager.prefix_cache_hits == 8

    manager.free(first)
    manager.free(second)
    assert manager.num_free_blocks == 16
    # Freed cached blocks still serve hits.
    third = make_request("c", prompt + [1, 2])
    computed, _ = admit(manager, third)
    assert computed.num_tokens == 12


def test_diverging_prompts_share_only_the_common_blocks():
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    admit(manager, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    computed, _ = admit(manager, make_request("b", [1, 2, 3, 4, 5, 6, 7, 0, 9]))
    assert computed.num_tokens == 4


def test_caching_disabled_never_hits():
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False)
    admit(manager, make_request("a", list(range(9))))
    computed, _ = admit(manager, make_request("b", list(range(9))))
    assert computed.num_tokens == 0 and manager.prefix_cache_queries == 0


def test_usage_and_utilization():
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    assert manager.usage() == 0.0 and manager.utilization() is None
    admit(manager, make_request("a", list(range(5))))  # 2 blocks, 5 of 8 slots
    admit(manager, make_request("b", list(range(3))))  # 1 block, 3 of 4 slots
    assert manager.usage() == 0.3
    assert manager.utilization() == 8 / 12
    assert manager.utilization_counts() == (8, 12)


prompt_strategy = st.lists(st.integers(0, 2), min_size=1, max_size=20)  # tiny vocab: many shared prefixes


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("arrive"), prompt_strategy),
            st.tuples(st.just("step"), st.integers(1, 6)),
            st.tuples(st.just("abort"), st.integers(0, 50)),
            st.tuples(st.just("preempt"), st.integers(0, 50)),
        ),
        max_size=60,
    ),
    st.sampled_from([True, False]),
)
def test_block_accounting_under_random_arrivals_lengths_and_aborts(ops, enable_caching):
    manager = KVCacheManager(num_blocks=12, block_size=4, enable_caching=enable_caching)
    waiting: list[Request] = []
    running: list[Request] = []
    counter = 0

    def check() -> None:
        owners: dict[int, list[tuple[Request, int]]] = {}
        for request in running:
            ids = manager.get_block_ids(request.request_id)
            assert len(ids) == len(set(ids)), "a sequence holds one block twice"
            assert len(ids) * manager.block_size >= request.num_computed_tokens
            for index, block_id in enumerate(ids):
                owners.setdefault(block_id, []).append((request, index))
        free = {block.block_id for block in manager.pool.free_queue}
        for block in manager.pool.blocks:
            holders = owners.get(block.block_id, [])
            assert block.ref_cnt == len(holders)
            assert (block.ref_cnt == 0) == (block.block_id in free)
            if len(holders) > 1:
                # Only a cached full block may be shared, and only by sequences with the same prefix.
                assert block.block_hash is not None
                (first, index), *rest = holders
                prefix = first.all_token_ids[: (index + 1) * manager.block_size]
                for other, other_index in rest:
                    assert other_index == index
                    assert other.all_token_ids[: len(prefix)] == prefix
        assert manager.num_free_blocks + len(owners) == manager.num_blocks

    for op, arg in ops:
        if op == "arrive":
            waiting.append(make_request(f"r{counter}", arg))
            counter += 1
        elif op == "step":
            for request in list(running):
                if request.num_computed_tokens == request.num_tokens:
                    request.append_output_token(request.num_tokens % 3)
                num_new = min(arg, request.num_tokens - request.num_computed_tokens)
                if manager.allocate_slots(request, num_new) is None:
                    manager.free(request)
                    request.num_computed_tokens = 0
                    running.remove(request)
                    waiting.insert(0, request)
                else:
                    request.num_computed_tokens += num_new
            while waiting:
                computed, blocks = admit(manager, waiting[0], num_new=None)
                if blocks is None:
                    break
                running.append(waiting.pop(0))
        elif op in ("abort", "preempt") and running:
            request = running.pop(arg % len(running))
            manager.free(request)
            if op == "preempt":
                request.num_computed_tokens = 0
                waiting.append(request)
        check()

    for request in running:
        manager.free(request)
    running.clear()
    check()
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.usage() == 0.0 and manager.utilization() is None
