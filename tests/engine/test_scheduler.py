"""Scheduler: budgets, chunked prefill, mixed steps, preemption, live limit changes."""

from __future__ import annotations

import pytest

from kvpilot.engine.kv_cache_manager import KVCacheManager
from kvpilot.engine.request import Request, RequestStatus
from kvpilot.engine.scheduler import Scheduler, SchedulerOutput


def make_scheduler(
    *, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, chunked=True, caching=False
) -> Scheduler:
    manager = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(
        manager,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=64,
        enable_chunked_prefill=chunked,
    )


def add(scheduler: Scheduler, request_id: str, prompt_len: int, first_token: int = 1) -> Request:
    request = Request(request_id, list(range(first_token, first_token + prompt_len)), params=None, arrival_time=0.0)
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler, max_output: int = 1000) -> SchedulerOutput:
    """Schedule, then play the runner: every sequence that caught up gets a token; long ones finish."""
    out = scheduler.schedule()
    done = []
    for request in out.requests:
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(7)
            if len(request.output_token_ids) >= max_output:
                done.append(request)
    scheduler.finish_requests(done, RequestStatus.FINISHED_LENGTH)
    return out


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(out.requests, out.num_scheduled_tokens)}


def test_token_budget_is_respected_and_prompts_are_chunked():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    a = add(scheduler, "a", 7)
    add(scheduler, "b", 7)
    out = step(scheduler)
    assert scheduled(out) == {"a": 7, "b": 3}
    assert out.total_num_scheduled_tokens == 10
    assert out.num_computed_before == [0, 0]
    assert len(a.output_token_ids) == 1  # a's prompt completed: it sampled
    out = step(scheduler)
    # Mixed step: a decodes one token while b's prefill continues.
    assert scheduled(out) == {"a": 1, "b": 4}
    assert out.num_computed_before == [7, 3]
    assert scheduler.get_request("b").output_token_ids == [7]


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole():
    scheduler = make_scheduler(max_num_batched_tokens=64, chunked=False)
    scheduler.set_limits(max_num_batched_tokens=64)
    add(scheduler, "a", 40)
    add(scheduler, "b", 30)
    out = step(scheduler)
    assert scheduled(out) == {"a": 40}
    out = step(scheduler)
    assert scheduled(out) == {"a": 1, "b": 30}


def test_max_num_seqs_is_respected():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(4):
        add(scheduler, f"r{i}", 3)
    for _ in range(3):
        out = step(scheduler)
        assert len(out.requests) <= 2
    assert scheduler.num_running == 2 and scheduler.num_waiting == 2


def test_finished_requests_make_room_for_waiting_ones():
    scheduler = make_scheduler(max_num_seqs=1)
    add(scheduler, "a", 3)
    add(scheduler, "b", 3)
    assert scheduled(step(scheduler, max_output=2)) == {"a": 3}
    assert scheduled(step(scheduler, max_output=2)) == {"a": 1}  # a finishes here
    assert scheduled(step(scheduler, max_output=2)) == {"b": 3}
    assert scheduler.kv_cache_manager.holds("b") and not scheduler.kv_cache_manager.holds("a")


def test_preemption_takes_the_newest_running_request_and_recomputes_it():
    # 4 blocks of 4 tokens: two sequences of 7 tokens fit, the 9th token does not.
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    old = add(scheduler, "old", 7)
    new = add(scheduler, "new", 7)
    step(scheduler)  # both prefilled; each sampled one token -> 8 tokens, 2 blocks each
    out = step(scheduler)  # each computes its 8th token: still 2 blocks
    assert scheduled(out) == {"old": 1, "new": 1}
    out = step(scheduler)  # old's 9th token needs a third block: new is preempted
    assert [r.request_id for r in out.preempted] == ["new"]
    assert scheduled(out) == {"old": 1}
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert not scheduler.kv_cache_manager.holds("new")
    assert scheduler.num_preemptions == 1
    assert list(scheduler.waiting) == [new]
    scheduler.finish_requests([old], RequestStatus.FINISHED_ABORTED)
    out = step(scheduler)
    # Recompute: prompt plus the tokens it had generated, all at once.
    assert scheduled(out) == {"new": 9}
    assert new.status is RequestStatus.RUNNING


def test_a_request_preempts_itself_when_it_is_the_newest():
    scheduler = make_scheduler(num_blocks=2, block_size=4)
    only = add(scheduler, "only", 8)
    step(scheduler)
    out = step(scheduler)  # token 9 needs a third block; nobody else to preempt
    assert out.preempted == [only] and out.requests == []
    assert only.status is RequestStatus.PREEMPTED


def test_lowering_max_num_seqs_live_preempts_the_newest_in_the_next_step():
    scheduler = make_scheduler(max_num_seqs=4, caching=True)
    requests = [add(scheduler, f"r{i}", 6, first_token=10 * i) for i in range(6)]
    step(scheduler)
    assert scheduler.num_running == 4
    scheduler.set_limits(max_num_seqs=2)
    out = step(scheduler)
    assert out.preempted == [requests[3], requests[2]]  # newest first
    assert scheduled(out) == {"r0": 1, "r1": 1}  # the batch obeys the new limit at once
    assert [r.request_id for r in scheduler.waiting] == ["r2", "r3", "r4", "r5"]  # first in line again
    assert scheduler.num_preemptions == 0  # not the KV cache's pressure
    scheduler.finish_requests(requests[:2], RequestStatus.FINISHED_LENGTH)
    out = step(scheduler)
    # Re-admitted with their full prompt block from the prefix cache: only the rest is recomputed.
    assert scheduled(out) == {"r2": 3, "r3": 3}
    assert requests[2].num_computed_tokens == 7
    scheduler.set_limits(max_num_batched_tokens=3)
    add(scheduler, "big", 10)
    out = step(scheduler)
    assert out.total_num_scheduled_tokens <= 3


def test_set_limits_rejects_bad_values_with_the_field_name():
    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="max_num_seqs"):
        scheduler.set_limits(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        scheduler.set_limits(max_num_batched_tokens=2)
    assert scheduler.limits.max_num_seqs == 4


def test_prefix_cache_hits_skip_computation():
    scheduler = make_scheduler(caching=True)
    add(scheduler, "a", 9)
    step(scheduler)
    b = add(scheduler, "b", 9)
    out = step(scheduler)
    assert scheduled(out) == {"a": 1, "b": 1}  # b's first 8 tokens were cached
    assert b.num_cached_tokens == 8
    assert out.num_computed_before == [9, 8]


def test_abort_of_waiting_and_running_requests_frees_everything():
    scheduler = make_scheduler(max_num_seqs=1)
    a = add(scheduler, "a", 5)
    b = add(scheduler, "b", 5)
    step(scheduler)
    scheduler.finish_requests([a, b], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == 64
    assert step(scheduler).is_empty


def test_duplicate_request_id_is_refused():
    scheduler = make_scheduler()
    add(scheduler, "a", 3)
    with pytest.raises(ValueError, match="already"):
        add(scheduler, "a", 3)


def test_runner_inputs_of_a_mixed_step():
    import torch

    from kvpilot.engine.model_runner import ModelRunner

    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=9, caching=True)
    a = add(scheduler, "a", 6, first_token=100)
    step(scheduler)  # a: 6 prompt tokens computed, one sampled
    b = add(scheduler, "b", 10, first_token=200)
    out = scheduler.schedule()  # a decodes 1 token, b prefills a first chunk of 8
    assert scheduled(out) == {"a": 1, "b": 8}
    runner = ModelRunner(None, device=torch.device("cpu"), block_size=4, backend=None, sampler=None)
    inputs = runner.prepare_inputs(out)
    a_blocks, b_blocks = out.block_ids
    assert inputs.input_ids.tolist() == [a.all_token_ids[6]] + b.all_token_ids[:8]
    assert inputs.positions.tolist() == [6] + list(range(8))
    expected_slots = [a_blocks[1] * 4 + 2] + [b_blocks[p // 4] * 4 + p % 4 for p in range(8)]
    assert inputs.metadata.slot_mapping.tolist() == expected_slots
    assert inputs.metadata.query_start_loc_cpu == [0, 1, 9]
    assert inputs.metadata.seq_lens_cpu == [7, 8]
    assert inputs.metadata.block_tables.shape == (2, 2)
    # Only a samples: b's chunk stops short of its prompt's end.
    assert inputs.sampled_requests == [a] and inputs.logits_indices.tolist() == [0]
    assert not inputs.is_decode_only
