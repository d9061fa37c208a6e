"""The window's side of the worker's operating-system process: start, read, write, end.

:class:`WorkerProcess` starts ``python -m clover_desk.worker.process`` through a fresh :class:`QProcess` per start,
with the extra environment asked for and the package root on ``PYTHONPATH``; it cuts the worker's stdout into lines
(``record``: one JSON record a line), keeps its last stderr lines (its log) for a crash report, and ends it with its whole process group (the
worker leads one: :func:`clover_desk.worker.process.lead_own_process_group`). What the lines mean is
:class:`~clover_desk.worker.client.EngineClient`'s business.

Standard library and PySide6 only: the GUI process never imports torch.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, QTimer, Signal

log = logging.getLogger(__name__)
worker_log = logging.getLogger("clover_desk.worker.process.stderr")

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds clover_desk/ and engine/
STDERR_LINES_KEPT = 40
CRASH_REASON_STDERR_LINES = 12


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class WorkerProcess(QObject):
    """One worker process at a time. Signals come only from the current process (an ended one is ignored)."""

    record = Signal(object)  # one record of the worker (a JSON object with an "event"), from one stdout line
    ended = Signal(bool)  # it exited as asked (end / shutdown), after its last lines were read: restart or not
    crashed = Signal(str)  # it exited unasked: how (exit code or signal, fatal error, last log lines) for people
    failedToStart = Signal(str)  # the program could not be started (no ``exited`` follows)

    def __init__(
        self, parent: QObject | None = None, *, python: str | None = None, worker_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None, grace_ms: int = 3000,
    ) -> None:
        super().__init__(parent)
        self.python = python or sys.executable
        self._worker_args = list(worker_args)
        self._env = dict(env or {})
        self._started_env = dict(self._env)  # the extra environment of the running worker (set_env: the next one's)
        self.grace_ms = grace_ms
        self._proc: QProcess | None = None
        self._stdout_buf = bytearray()
        self._stderr_buf = bytearray()
        self._stderr_lines: deque[str] = deque(maxlen=STDERR_LINES_KEPT)
        self._ready = False  # the worker said "ready": commands before that wait in _queued
        self._queued: list[dict[str, Any]] = []
        self.pid: int | None = None  # the worker's process id, as its "ready" record says
        self.fatal: tuple[str, str] | None = None  # the fatal error (kind, message) it reported before exiting
        self._expected_exit = False  # end() / shutdown() asked for the exit: not a crash
        self._restart_after_exit = False

    @property
    def running(self) -> bool:
        """A process was started and has not ended (or failed to start) yet."""
        return self._proc is not None

    @property
    def env(self) -> dict[str, str]:
        """The extra environment the worker starts with."""
        return dict(self._env)

    def set_env(self, env: Mapping[str, str]) -> bool:
        """Extra environment for the next start; whether a running worker was started with a different one."""
        self._env.update(env)
        return self._proc is not None and self._env != self._started_env

    def start(self) -> None:
        """Start a fresh worker process (the caller makes sure none runs)."""
        proc = QProcess(self)
        environment = QProcessEnvironment.systemEnvironment()
        python_path = environment.value("PYTHONPATH", "")
        root = str(_PACKAGE_ROOT)
        # The worker imports the very clover_desk/engine this GUI runs, installed or from a source checkout.
        environment.insert("PYTHONPATH", root + (os.pathsep + python_path if python_path else ""))
        for key, value in self._env.items():
            environment.insert(key, value)
        self._started_env = dict(self._env)
        proc.setProcessEnvironment(environment)
        proc.setWorkingDirectory(root)
        proc.setProgram(self.python)
        proc.setArguments(["-m", "clover_desk.worker.process", *self._worker_args])
        proc.readyReadStandardOutput.connect(self.on_stdout)
        proc.readyReadStandardError.connect(self.on_stderr)
        proc.finished.connect(self.on_finished)
        proc.errorOccurred.connect(self.on_process_error)
        self._proc = proc
        self.pid = self.fatal = None
        self._expected_exit = self._restart_after_exit = False
        self._ready = False
        self._queued.clear()
        self._stdout_buf.clear()
        self._stderr_buf.clear()
        self._stderr_lines.clear()
        log.info("starting engine worker: %s %s", self.python, " ".join(proc.arguments()))
        proc.start()

    def send(self, command: dict[str, Any]) -> None:
        """Send one command line (the process must be running); until the worker is ready, it waits in a queue."""
        if not self._ready:
            self._queued.append(command)
            return
        assert self._proc is not None
        self._proc.write((json.dumps(command, ensure_ascii=True) + "\n").encode("ascii"))

    def mark_ready(self) -> None:
        """The worker said "ready": the queued commands go out, in order, and later ones at once."""
        self._ready = True
        queued, self._queued = self._queued, []
        for command in queued:
            self.send(command)

    def drop_queued(self) -> None:
        """Forget the commands not sent yet (what was pending ended: they would act on nothing)."""
        self._queued.clear()

    def end(self, *, restart: bool) -> None:
        """End the worker and its process group at once; ``ended(restart)`` follows."""
        self._expected_exit, self._restart_after_exit = True, restart
        if self._proc is not None:
            _kill_group(self._proc)

    def shutdown(self, wait_ms: int = 0) -> None:
        """Send ``shutdown`` and close its stdin; kill it after ``grace_ms``. ``wait_ms`` > 0 blocks up to that long
        for the exit, then kills (application exit only)."""
        proc = self._proc
        if proc is None:
            return
        self._expected_exit, self._restart_after_exit = True, False
        if proc.state() == QProcess.ProcessState.Running:
            proc.write(b'{"cmd": "shutdown"}\n')
            proc.closeWriteChannel()
        QTimer.singleShot(self.grace_ms, lambda p=proc: self._kill_if_running(p))
        if wait_ms > 0 and not proc.waitForFinished(wait_ms):
            _kill_group(proc)
            proc.waitForFinished(1000)

    def describe_exit(self, exit_code: int, exit_status: QProcess.ExitStatus) -> str:
        """How the worker ended, for people: the exit or signal, the fatal error it reported, its last log lines."""
        if exit_status == QProcess.ExitStatus.CrashExit:
            # On POSIX, Qt reports the terminating signal as the exit code of a crashed process.
            how = f"was killed by {_signal_name(exit_code)}" if os.name == "posix" and exit_code else "crashed"
        else:
            how = f"exited with code {exit_code}"
        parts = [f"The engine worker {how}."]
        if self.fatal is not None:
            parts.append(f"{self.fatal[0]}: {self.fatal[1]}")
        tail = list(self._stderr_lines)[-CRASH_REASON_STDERR_LINES:]
        if tail:
            parts.append("Last log lines:\n" + "\n".join(tail))
        return "\n".join(parts)

    # ----------------------------------------------------------------- process signals

    def on_stdout(self) -> None:
        if self._proc is None:
            return
        self._stdout_buf += bytes(self._proc.readAllStandardOutput().data())
        while True:
            end = self._stdout_buf.find(b"\n")
            if end < 0:
                break
            line = bytes(self._stdout_buf[:end]).strip()
            del self._stdout_buf[: end + 1]
            if line:
                self._on_line(line)

    def _on_line(self, line: bytes) -> None:
        try:
            record = json.loads(line)
            record["event"]  # noqa: B018 - a record names its event
        except (ValueError, KeyError, TypeError):
            log.warning("engine worker sent a line that is not a record: %r", line[:200])
            return
        self.record.emit(record)

    def on_stderr(self) -> None:
        if self._proc is None:
            return
        self._stderr_buf += bytes(self._proc.readAllStandardError().data())
        *lines, rest = bytes(self._stderr_buf).split(b"\n")
        self._stderr_buf = bytearray(rest)
        for raw in lines:
            text = raw.decode("utf-8", "replace").rstrip()
            if text:
                self._stderr_lines.append(text)
                worker_log.debug("%s", text)

    def on_finished(self, exit_code: int, exit_status: QProcess.ExitStatus) -> None:
        proc = self._proc
        if proc is None or self.sender() is not proc:
            return
        self.on_stdout()  # the last records (e.g. a fatal error) may still be unread
        self.on_stderr()
        if self._stderr_buf:
            self._stderr_lines.append(self._stderr_buf.decode("utf-8", "replace").rstrip())
            self._stderr_buf.clear()
        self._proc = None
        self.pid = None
        proc.deleteLater()
        if self._expected_exit:
            log.info("engine worker exited (code %d)", exit_code)
            self.ended.emit(self._restart_after_exit)
        else:
            self.crashed.emit(self.describe_exit(exit_code, exit_status))

    def on_process_error(self, error: QProcess.ProcessError) -> None:
        proc = self._proc
        if proc is None or self.sender() is not proc:
            return
        if error == QProcess.ProcessError.FailedToStart:  # no finished() will follow
            self._proc = None
            proc.deleteLater()
            self.failedToStart.emit(f"the engine worker could not start ({self.python}): {proc.errorString()}")

    def _kill_if_running(self, proc: QProcess) -> None:
        if proc is self._proc and proc.state() != QProcess.ProcessState.NotRunning:
            log.warning("engine worker did not exit within %d ms; killing it", self.grace_ms)
            _kill_group(proc)


def _kill_group(proc: QProcess) -> None:
    """SIGKILL the worker and every process it started: it leads its own process group
    (``clover_desk.worker.process.lead_own_process_group``), so inductor's compile workers and their compilers go
    with it instead of outliving it. Only the worker itself where it leads no group (Windows, a worker of an older
    version)."""
    pid = int(proc.processId())
    if pid > 0 and hasattr(os, "killpg"):
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
                return
        except OSError as exc:  # it is gone already, or not ours to signal
            log.debug("cannot end the worker's process group %d: %s", pid, exc)
    proc.kill()
