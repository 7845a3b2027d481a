"""Processes are ours by pid *and* start time; stop escalates to SIGKILL."""

from __future__ import annotations

import sys
import time

from kvpilot.localcluster import processes


def test_spawn_stop_and_recycled_pid_guard(tmp_path):
    log = tmp_path / "sleep.log"
    pid, start = processes.spawn(
        [sys.executable, "-c", "import time; print('hi', flush=True); time.sleep(60)"], log
    )
    _wait_for(log, "hi")
    assert processes.is_alive(pid, start)
    assert not processes.is_alive(pid, start + 1)  # same pid, other start time: not ours
    assert not processes.stop(pid, start + 1)  # and so never signalled
    assert processes.is_alive(pid, start)
    assert processes.stop(pid, start)
    assert not processes.is_alive(pid, start)


def _wait_for(log, text):
    deadline = time.monotonic() + 10
    while text not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert text in log.read_text()


def test_stop_kills_a_process_that_ignores_sigterm(tmp_path):
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        "print('ready', flush=True); time.sleep(60)"
    )
    log = tmp_path / "stubborn.log"
    pid, start = processes.spawn([sys.executable, "-c", code], log)
    _wait_for(log, "ready")
    began = time.monotonic()
    assert processes.stop(pid, start, timeout=0.5)
    assert not processes.is_alive(pid, start)
    assert time.monotonic() - began < 5


def test_free_port_is_bindable():
    import socket

    port = processes.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
