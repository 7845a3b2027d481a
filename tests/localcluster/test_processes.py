"""Processes are ours by pid *and* start time; stop escalates to SIGKILL."""

from __future__ import annotations

import os
import signal
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
    deadline = time.monotonic() + 60  # only a guard against a hang
    while text not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert text in log.read_text()


class SteppedClock:
    """Stands in for the ``time`` module in processes.py: ``sleep`` moves ``monotonic`` on by exactly the
    time asked for (and yields the CPU briefly), so what stop() does at which point of its own clock is the
    same however loaded the machine is."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        time.sleep(0.001)


def test_stop_kills_a_process_that_ignores_sigterm(tmp_path, monkeypatch):
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        "print('ready', flush=True); time.sleep(60)"
    )
    log = tmp_path / "stubborn.log"
    pid, start = processes.spawn([sys.executable, "-c", code], log)
    _wait_for(log, "ready")
    clock = SteppedClock()
    signals: list[tuple[signal.Signals, float]] = []
    real_kill = os.kill

    def recording_kill(target: int, sig: int) -> None:
        if target == pid:
            signals.append((signal.Signals(sig), clock.now))
        real_kill(target, sig)

    monkeypatch.setattr(processes, "time", clock)
    monkeypatch.setattr(os, "kill", recording_kill)
    assert processes.stop(pid, start, timeout=0.5)
    assert not processes.is_alive(pid, start)
    (term, term_at), (kill, kill_at) = signals
    assert (term, term_at) == (signal.SIGTERM, 0.0)
    # SIGKILL once the timeout is over, not before and not one poll (0.05 s) later.
    assert kill is signal.SIGKILL and 0.5 <= kill_at < 0.55


def test_free_port_is_bindable():
    import socket

    port = processes.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
