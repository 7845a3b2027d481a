"""A pytest run ended by SIGTERM still tears its fixtures down, so the processes they started in their own
sessions (the local cluster's, tests/conftest.py's local_cluster) do not outlive it.

The run under test is a real pytest process with tests/conftest.py's hooks and one session fixture that
starts a long-lived child the way the local cluster starts its components (processes.spawn)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from kvpilot.localcluster import processes

CONFTEST = Path(__file__).with_name("conftest.py")


def _write_run(folder: Path, child_file: Path) -> None:
    (folder / "conftest.py").write_text(textwrap.dedent(f"""
        import importlib.util
        import sys

        spec = importlib.util.spec_from_file_location("kvpilot_tests_conftest", {str(CONFTEST)!r})
        tests_conftest = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tests_conftest)
        pytest_configure = tests_conftest.pytest_configure
    """))
    (folder / "test_held.py").write_text(textwrap.dedent(f"""
        import pathlib, sys, time

        import pytest

        from kvpilot.localcluster import processes


        @pytest.fixture(scope="session")
        def long_lived_child(tmp_path_factory):
            log = tmp_path_factory.mktemp("child") / "child.log"
            pid, start = processes.spawn([sys.executable, "-c", "import time; time.sleep(600)"], log)
            yield pid, start
            processes.stop(pid, start)


        def test_runs_until_stopped(long_lived_child):
            pid, start = long_lived_child
            pathlib.Path({str(child_file)!r}).write_text(f"{{pid}} {{start}}")
            time.sleep(600)
    """))


def test_sigterm_tears_down_fixtures_and_their_processes(tmp_path):
    child_file = tmp_path / "child"
    _write_run(tmp_path, child_file)
    run = subprocess.Popen(
        [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_held.py"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    child: tuple[int, int] | None = None
    try:
        deadline = time.monotonic() + 120  # only a guard against a hang
        while not (child_file.exists() and child_file.read_text()):
            assert run.poll() is None, f"the run ended early:\n{run.communicate()[0]}"
            assert time.monotonic() < deadline, "the run never reached its test"
            time.sleep(0.05)
        pid, start = (int(field) for field in child_file.read_text().split())
        child = (pid, start)
        assert processes.is_alive(pid, start)
        run.send_signal(signal.SIGTERM)
        output = run.communicate(timeout=120)[0]
        assert run.returncode == 2, output  # pytest's "interrupted"
        assert "KeyboardInterrupt: SIGTERM" in output
        assert not processes.is_alive(pid, start), "the fixture's process outlived the run"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        if child is not None:
            processes.stop(*child)
