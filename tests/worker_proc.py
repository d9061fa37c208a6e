"""The engine worker as a child process for tests: send protocol commands, wait for its records (a reader thread
drains stdout). Shared by the worker, limits, template and window tests, whatever folder they sit in."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FAKE = ["--engine-factory", "tests.fake_engine:make"]
TIMEOUT = 30.0

Record = dict[str, Any]


class WorkerProc:
    """The worker as a child process: send commands, wait for records (a reader thread drains stdout)."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "clover_desk.worker.process", "--log-level", "DEBUG", *args],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.records: queue.Queue[Record | None] = queue.Queue()
        self.seen: list[Record] = []
        self.stderr = b""
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._drain_stderr, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.records.put(json.loads(line))
        self.records.put(None)

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        self.stderr = self.proc.stderr.read()

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        self.proc.stdin.flush()

    def expect(self, pred: Callable[[Record], bool], timeout: float = TIMEOUT) -> Record:
        """The next record matching ``pred`` (the ones before it are kept in ``seen``)."""
        while True:
            record = self.records.get(timeout=timeout)
            if record is None:
                raise AssertionError(f"worker ended before the expected record; stderr:\n{self.stderr.decode()[-2000:]}")
            self.seen.append(record)
            if pred(record):
                return record

    def expect_event(self, name: str, **fields: Any) -> Record:
        return self.expect(lambda r: r["event"] == name and all(r.get(k) == v for k, v in fields.items()))

    def load(self, model_dir: str = "/models/fake") -> Record:
        """Load ``model_dir`` (by default the fake engine's model) and wait for its ``loaded`` record."""
        self.send(cmd="load", model_dir=model_dir)
        return self.expect_event("loaded")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
