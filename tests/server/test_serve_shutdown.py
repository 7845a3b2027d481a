"""`kvpilot serve` as a real process: start-up logs, tuning file, SIGTERM drain, exit code."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot import engine_contract as names

API_KEY = "client-key-9f2c41d7e0b3a6c85d17"
ADMIN_TOKEN = "admin-token-4b8e2a91c6f05d3e7a2b"
# Far more than the tiny model writes while the test sends SIGTERM and sees the drain start.
MAX_TOKENS = 1000


def _health_status(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def _generated_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return next(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                if sample.name == names.GENERATION_TOKENS)


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits(tiny_model_dir, tmp_path, serve_process):
    tuning = tmp_path / "tuning.json"
    tuning.write_text(json.dumps({"maxNumSeqs": 3}))
    # The secrets come from the environment, as the operator's pods pass them (from Secrets).
    env = {**os.environ, "KVPILOT_ADMIN_TOKEN": ADMIN_TOKEN, "KVPILOT_API_KEY": API_KEY,
           "KVPILOT_MAX_MODEL_LEN": "1024", "KVPILOT_DEVICE": "cpu"}
    server = serve_process([sys.executable, "-m", "kvpilot"], [
        str(tiny_model_dir), "--served-model-name", "tiny", "--max-num-seqs", "8",
        "--shutdown-grace-period", "60", "--tuning-file", str(tuning), "--log-level", "debug",
    ], env)  # fmt: skip
    proc, url, admin_port, log_path = server.proc, server.url, server.admin_port, server.log_path
    key = {"Authorization": f"Bearer {API_KEY}"}
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    scheduler = httpx.get(f"http://127.0.0.1:{admin_port}/admin/v1/scheduler", headers=admin)
    assert scheduler.json()["max_num_seqs"] == 3  # the file won
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401

    events: list[str] = []
    first_chunk = threading.Event()

    def stream() -> None:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=key, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    first_chunk.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_chunk.wait(60)
    proc.send_signal(signal.SIGTERM)
    events_at_signal = len(events)

    deadline = time.monotonic() + 10
    while (status := _health_status(url)) != 503:
        assert status is not None, f"kvpilot serve stopped answering at SIGTERM:\n{log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "readiness did not fail after SIGTERM"
        time.sleep(0.05)
    assert httpx.get(f"{url}/health").json() == {"status": "draining"}
    # The server drains now, and the request had not finished: it was in flight at the signal.
    generated_at_drain = _generated_tokens(url)
    assert generated_at_drain < MAX_TOKENS, "the request finished before SIGTERM: nothing was left to drain"
    refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=key)
    assert refused.status_code == 503 and "Retry-After" in refused.headers
    # No keep-alive to a server about to exit: a request sent on it later would be reset.
    assert refused.headers["Connection"] == "close"

    reader.join(timeout=120)
    assert proc.wait(timeout=60) == 0
    # The in-flight request ran to its end after the signal instead of being cut off: all its tokens,
    # of which the server wrote MAX_TOKENS - generated_at_drain after the drain began.
    assert len(events) > events_at_signal + 1
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    logs = log_path.read_text()
    for expected in ("KV cache:", "listening on http://127.0.0.1", f"admin API on port {admin_port}",
                     "overrides the flags", "waiting up to 60s for 1 in-flight request(s)", "drained"):
        assert expected in logs, f"{expected!r} missing from the start-up/shutdown logs:\n{logs}"
    # Debug logs of a run with good and bad keys sent hold neither secret.
    assert API_KEY not in logs and ADMIN_TOKEN not in logs
