"""The window started from a terminal: Ctrl+C there (SIGINT to the whole process group, the engine worker included)
SIGTERM and SIGHUP (the terminal closed) close it as its close button does: exit status 0, no traceback, the engine worker gone with it. Before,
Ctrl+C raised KeyboardInterrupt in whichever slot ran next, killed the worker and left the window open."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from fixtures_tiny import tiny_clover_dir  # noqa: F401 (session fixture)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def start_window(home: Path, model: Path) -> tuple[subprocess.Popen[str], psutil.Process]:
    """The real ``clover-desk gui`` in its own session (a group signal reaches it and its worker, not pytest),
    once its engine worker runs: (the window's process, the worker's)."""
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "QTWEBENGINE_DISABLE_SANDBOX": "1",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "clover_desk.cli.main", "gui", "--home", str(home), "--model",
                             str(model)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the window exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        workers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                   if "clover_desk.worker.process" in " ".join(c.cmdline())]
        if workers:
            time.sleep(3)  # the window's event loop runs and the worker is loading the model
            return proc, workers[0]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail("the engine worker never started")


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sighup"])
def test_a_signal_closes_the_window_and_its_worker(how: str, tmp_path: Path, tiny_clover_dir: Path) -> None:  # noqa: F811
    proc, worker = start_window(tmp_path / "home", tiny_clover_dir)
    try:
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: the whole foreground group
        elif how == "sighup":  # the terminal closed: the session's processes get SIGHUP
            os.killpg(proc.pid, signal.SIGHUP)
        else:
            proc.send_signal(signal.SIGTERM)  # the window's process only
        _, err = proc.communicate(timeout=60)
        worker.wait(timeout=30)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "crashed" not in err, err[-3000:]
    assert not worker.is_running()
