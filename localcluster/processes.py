"""Background processes identified by pid *and* start time, so a recycled pid is never ours."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks since boot); None if the pid is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie has exited; it only waits to be reaped
        return None
    return int(fields[19])


def is_alive(pid: int, start_time: int) -> bool:
    return proc_start_time(pid) == start_time


def spawn(command: list[str], log_path: Path, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> tuple[int, int]:  # fmt: skip
    """Starts ``command`` detached (own session, output to ``log_path``); returns (pid, start time)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
        )
    start_time = proc_start_time(process.pid)
    if start_time is None:
        raise RuntimeError(f"{command[0]} exited at once; see {log_path}")
    return process.pid, start_time


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child (started by another `kvpilot` process): init reaps it


def stop(pid: int, start_time: int, timeout: float = 10.0) -> bool:
    """SIGTERM, then SIGKILL after ``timeout``; only if the pid is still the process we started.

    Returns True if it was running."""
    if not is_alive(pid, start_time):
        _reap(pid)
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap(pid)
        if not is_alive(pid, start_time):
            return True
        time.sleep(0.05)
    if is_alive(pid, start_time):
        os.kill(pid, signal.SIGKILL)
        while is_alive(pid, start_time):
            _reap(pid)
            time.sleep(0.02)
    return True


def free_port() -> int:
    """A port free on 127.0.0.1 right now; callers retry if another process takes it first."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
