"""`kvpilot serve` as a real process: start-up logs, tuning file, SIGTERM drain, exit code."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import httpx


API_KEY = "client-key-9f2c41d7e0b3a6c85d17"
ADMIN_TOKEN = "admin-token-4b8e2a91c6f05d3e7a2b"


def test_sigterm_drains_in_flight_requests_then_exits(tiny_model_dir, tmp_path, serve_process):
    tuning = tmp_path / "tuning.json"
    tuning.write_text(json.dumps({"maxNumSeqs": 3}))
    # The secrets come from the environment, as the operator's pods pass them (from Secrets).
    env = {**os.environ, "KVPILOT_ADMIN_TOKEN": ADMIN_TOKEN, "KVPILOT_API_KEY": API_KEY,
           "KVPILOT_MAX_MODEL_LEN": "512", "KVPILOT_DEVICE": "cpu"}
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
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 120, "ignore_eos": True, "stream": True}
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
    while httpx.get(f"{url}/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "readiness did not fail after SIGTERM"
        time.sleep(0.05)
    assert httpx.get(f"{url}/health").json() == {"status": "draining"}
    refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=key)
    assert refused.status_code == 503 and "Retry-After" in refused.headers
    # No keep-alive to a server about to exit: a request sent on it later would be reset.
    assert refused.headers["Connection"] == "close"

    reader.join(timeout=120)
    assert proc.wait(timeout=60) == 0
    # The in-flight request ran to its end after the signal instead of being cut off.
    assert len(events) > events_at_signal + 1
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    logs = log_path.read_text()
    for expected in ("KV cache:", "listening on http://127.0.0.1", f"admin API on port {admin_port}",
                     "overrides the flags", "draining", "drained"):
        assert expected in logs, f"{expected!r} missing from the start-up/shutdown logs:\n{logs}"
    # Debug logs of a run with good and bad keys sent hold neither secret.
    assert API_KEY not in logs and ADMIN_TOKEN not in logs
