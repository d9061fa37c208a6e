"""Hang-ups (issue 31): when the window stops reading the worker's records (it closed, or crashed), the worker says so
in one short line, rate-limited, never a traceback, and exits once its commands are read; the rate limit itself is
checked on a fake clock."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from clover_desk.worker.hangup import HangUpLog, is_hang_up

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_hang_ups_are_one_line_at_most_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    logger = logging.getLogger("test.hangup")
    note = HangUpLog(logger, interval_s=30.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.hangup"):
        for _ in range(100):
            note("request r1", BrokenPipeError(32, "Broken pipe"))
        clock.now += 29.0
        note("request r2", ConnectionResetError(104, "Connection reset by peer"))
        clock.now += 1.0
        note("request r3", ConnectionResetError(104, "Connection reset by peer"))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["request r1: the other end hung up (BrokenPipeError)",
                     "request r3: the other end hung up (ConnectionResetError) (100 more hang-ups since the last line)"]
    assert all(r.exc_info is None for r in caplog.records)


def test_what_counts_as_a_hang_up() -> None:
    assert is_hang_up(BrokenPipeError()) and is_hang_up(ConnectionResetError()) and is_hang_up(OSError(32, "EPIPE"))
    assert not is_hang_up(OSError(28, "No space left on device")) and not is_hang_up(ValueError("x"))


def _send(proc: subprocess.Popen[bytes], **command: Any) -> None:
    assert proc.stdin is not None
    try:
        proc.stdin.write((json.dumps(command) + "\n").encode())
        proc.stdin.flush()
    except BrokenPipeError:
        pass  # the worker may have gone already: what it logged is what is checked


def _until(proc: subprocess.Popen[bytes], event: str) -> dict[str, Any]:
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        assert line, "the worker ended early"
        record = json.loads(line)
        if record["event"] == event:
            return record


def test_a_window_that_stops_reading_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    err_path = tmp_path / "worker.err"
    with err_path.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "clover_desk.worker.process", "--engine-factory", "tests.fake_engine:make"],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
    watchdog = threading.Timer(TIMEOUT_S, proc.kill)
    watchdog.start()
    try:
        _until(proc, "ready")
        _send(proc, cmd="load", model_dir="tiny")
        _until(proc, "loaded")
        _send(proc, cmd="generate", id="g1", messages=[{"role": "user", "content": "endless"}])
        _until(proc, "block_step")
        assert proc.stdout is not None
        proc.stdout.close()  # the window stops reading, mid-answer
        for i in range(20):  # commands whose answers can reach no one
            _send(proc, cmd="nope", id=f"x{i}")
        assert proc.stdin is not None
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass
        rc = proc.wait(TIMEOUT_S)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
    stderr = err_path.read_text()
    assert rc == 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    hang_up_lines = [line for line in stderr.splitlines() if "hung up" in line]
    assert len(hang_up_lines) == 1, stderr[-3000:]
    assert "the other end hung up (BrokenPipeError)" in hang_up_lines[0]
