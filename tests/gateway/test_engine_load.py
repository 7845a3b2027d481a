"""A pod's load: this gateway's requests in flight to it, plus what the engine last reported beyond them."""

from __future__ import annotations

from kvpilot import engine_contract as names
from kvpilot.gateway.engine_load import LoadBoard, parse_load

EXPOSITION = f"""# HELP {names.REQUESTS_RUNNING} running
# TYPE {names.REQUESTS_RUNNING} gauge
{names.REQUESTS_RUNNING}{{model_name="m"}} 3.0
# HELP {names.REQUESTS_WAITING} waiting
# TYPE {names.REQUESTS_WAITING} gauge
{names.REQUESTS_WAITING}{{model_name="m"}} 2.0
# HELP {names.KV_CACHE_USAGE} usage
# TYPE {names.KV_CACHE_USAGE} gauge
{names.KV_CACHE_USAGE}{{model_name="m"}} 0.42
# HELP {names.counter_base_name(names.PREEMPTIONS)} preemptions
# TYPE {names.counter_base_name(names.PREEMPTIONS)} counter
{names.PREEMPTIONS}{{model_name="m"}} 7.0
"""


def test_the_engines_gauges_are_read():
    load = parse_load(EXPOSITION, at=1.0)
    assert (load.running, load.waiting, load.kv_cache_usage, load.at) == (3.0, 2.0, 0.42, 1.0)


def test_an_exposition_without_the_gauges_reads_as_idle():
    load = parse_load("", at=0.0)
    assert (load.running, load.waiting, load.kv_cache_usage) == (0.0, 0.0, None)


def test_load_is_the_requests_in_flight_here_plus_what_others_had_on_the_engine():
    board = LoadBoard()
    board.started("ns/a")
    board.record("ns/a", parse_load(EXPOSITION, at=0.0))  # 5 on the engine, 1 of them from here
    assert board.load("ns/a") == 5.0
    for _ in range(3):
        board.started("ns/a")
    assert board.load("ns/a") == 8.0  # sent since the scrape: the engine has not reported them yet
    for _ in range(4):
        board.finished("ns/a")
    # Finished here since the scrape: gone at once, not counted until the next scrape.
    assert board.load("ns/a") == 4.0 and board.in_flight == {}
    assert board.load("ns/unknown") == 0.0


def test_gone_pods_are_forgotten():
    board = LoadBoard()
    board.record("ns/a", parse_load(EXPOSITION, at=0.0))
    board.record("ns/b", parse_load(EXPOSITION, at=0.0))
    board.forget_all_but({"ns/b"})
    assert list(board.scraped) == ["ns/b"] and list(board.in_flight_at_scrape) == ["ns/b"]
