"""The engine client against a real engine: the walk from a tuner's settings to the engine's scheduler.

A real `kvpilot serve` app (the generated tiny model, on the CPU, in a uvicorn thread) with
its admin API on; the client scrapes it, pushes settings and LoRA adapters to it, and fails per engine.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvpilot import engine_contract as contract
from kvpilot.kube_contract import pod_url
from kvpilot.operator.engine_client import EngineClient, admin_url
from kvpilot.operator.engine_metrics import MetricsCollector, parse_snapshot
from kvpilot.operator.spec import EngineSettings

TOKEN = "t" * 40


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listening_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """The app `kvpilot serve` runs, on 127.0.0.1, admin API on its own port; yields (base URL, admin base URL,
    the LLMEngine)."""
    import uvicorn

    from kvpilot.engine.config import EngineConfig
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.server.api_server import DrainingServer, ServerSettings, build_app

    llm_engine = LLMEngine.from_config(EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=256,
                                                    max_num_seqs=4, enable_lora=True))
    sockets = [_listening_socket(), _listening_socket()]
    port, admin_port = (sock.getsockname()[1] for sock in sockets)
    app = build_app(llm_engine, ServerSettings(served_model_name="tiny", admin_token=TOKEN, admin_port=admin_port))
    server = DrainingServer(uvicorn.Config(app, log_level="warning"), app.state.kvpilot)
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the engine's server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}", llm_engine
    server.should_exit = True
    thread.join(timeout=30)


def test_pod_urls_use_the_engine_port_and_the_admin_port():
    assert pod_url("10.1.2.3") == f"http://10.1.2.3:{contract.ENGINE_PORT}"
    assert admin_url("10.1.2.3") == f"http://10.1.2.3:{contract.ADMIN_PORT}"


def test_new_settings_reach_the_engines_scheduler(engine):
    url, admin, llm_engine = engine
    client = EngineClient(timeout_seconds=5.0)
    failed = client.set_scheduler_limits({"pod-a": admin}, EngineSettings(max_num_seqs=3, max_num_batched_tokens=96),
                                         TOKEN)
    assert failed == {}
    stats = llm_engine.stats()
    assert (stats.max_num_seqs, stats.max_num_batched_tokens) == (3, 96)
    # ... and the engine reports them where the operator reads them.
    snapshot = parse_snapshot(client.scrape({"pod-a": url})["pod-a"], 0.0)
    assert snapshot.gauges[contract.MAX_NUM_SEQS] == 3 and snapshot.gauges[contract.MAX_NUM_BATCHED_TOKENS] == 96


def test_an_unset_token_budget_is_left_to_the_engine(engine):
    _, admin, llm_engine = engine
    before = llm_engine.stats().max_num_batched_tokens
    assert EngineClient().set_scheduler_limits({"pod-a": admin}, EngineSettings(max_num_seqs=2), TOKEN) == {}
    assert (llm_engine.stats().max_num_seqs, llm_engine.stats().max_num_batched_tokens) == (2, before)


def test_failures_are_per_engine_and_say_why(engine):
    url, admin, llm_engine = engine
    dead = f"http://127.0.0.1:{_free_port()}"
    client = EngineClient(timeout_seconds=2.0)
    before = llm_engine.stats().max_num_seqs
    settings = EngineSettings(max_num_seqs=before + 1)
    failed = client.set_scheduler_limits({"live": admin, "dead": dead, "api-port": url}, settings, "wrong-token")
    assert failed["live"].startswith("HTTP 401") and "ConnectionRefusedError" in failed["dead"]
    assert failed["api-port"].startswith("HTTP 404")  # the OpenAI port has no admin API
    assert client.set_scheduler_limits({"live": admin}, settings, None) == {"live": "the admin token Secret is missing"}
    assert llm_engine.stats().max_num_seqs == before

    scraped = client.scrape({"live": url, "dead": dead})
    assert isinstance(scraped["dead"], OSError)
    collector = MetricsCollector(window_seconds=30.0)
    collector.ingest(scraped, 0.0)
    result = collector.ingest(client.scrape({"live": url, "dead": dead}), 5.0)
    assert result.unreachable == ["dead"] and result.pods["live"].error is None


def test_adapters_are_brought_to_the_desired_set(engine, tiny_model_dir, tmp_path):
    from kvpilot.engine.model_files import make_lora_adapter

    _, admin, llm_engine = engine
    paths = {name: str(make_lora_adapter(tmp_path / name, tiny_model_dir, rank=4, seed=seed))
             for seed, name in enumerate(("a", "b", "a2"))}
    client = EngineClient(timeout_seconds=30.0)

    def loaded() -> dict[str, str]:
        return {adapter.name: adapter.request.lora_path for adapter in llm_engine.list_loras()}

    assert client.sync_loras({"pod": admin}, {"a": paths["a"], "b": paths["b"]}, TOKEN) == {"pod": {"a": None, "b": None}}
    assert loaded() == {"a": paths["a"], "b": paths["b"]}
    assert client.sync_loras({"pod": admin}, {"a": paths["a2"]}, TOKEN) == {"pod": {"a": None}}
    assert loaded() == {"a": paths["a2"]}  # b unloaded, a reloaded from its new folder
    result = client.sync_loras({"pod": admin}, {"a": paths["a2"], "c": str(tmp_path / "missing")}, TOKEN)
    assert result["pod"]["a"] is None and result["pod"]["c"].startswith("HTTP 400") and "not a folder" in result["pod"]["c"]
    dead = f"http://127.0.0.1:{_free_port()}"
    assert "ConnectionRefusedError" in client.sync_loras({"dead": dead}, {"a": paths["a"]}, TOKEN)["dead"]["a"]
    assert client.sync_loras({"pod": admin}, {"a": paths["a"]}, None) == {"pod": {"a": "the admin token Secret is missing"}}
