"""The GUI's handle on the engine worker process (:mod:`clover_desk.worker.process`).

:class:`EngineClient` starts ``python -m clover_desk.worker.process`` through a :class:`QProcess`, writes commands to its
stdin and turns the JSON lines it prints into Qt signals. Everything is asynchronous: no call waits for the worker
(the one exception, ``shutdown(wait_ms=...)``, is meant for application exit only), so the window stays responsive
whatever the engine does, and a worker that crashes, runs out of memory or hits a CUDA error is reported with
``crashed`` while the window, and every chat, stays. ``restart()`` starts a fresh worker.

This module imports only the standard library, PySide6 and the engine's stdlib-only ``events`` module: the GUI
process never imports torch.

Lifecycle of :attr:`EngineClient.state` (announced by ``stateChanged``)::

    stopped --start()--> starting --ready--> idle --load()--> loading --loaded / loadFailed--> idle
    idle --generate()--> generating --event(id, Finished | EngineError)--> idle
    any --crashed--> stopped          any --shutdown()--> stopping --stopped--> stopped

A cancel during a compiled load's warm-up (``cancel_load()`` while a ``compiling-*`` stage runs) keeps the model,
uncompiled. The worker checks the cancel between passes, but a pass that inductor is compiling cannot be interrupted
(30 s to minutes): when the worker has not answered within ``compile_cancel_grace_ms`` the client ends it, with the
compile workers it started (its process group), and starts a fresh worker that loads the same model uncompiled. To
the window that is one load going on: no ``ready`` from that worker, and the load ends with ``loaded`` whose record
says ``"compiled": false, "compile_cancelled": true`` as the worker's own cancelled warm-up does.

Every ``generate`` request ends with exactly one ``event(request_id, Finished)`` or
``event(request_id, EngineError)``, also when the worker dies (kind ``"WorkerCrashed"``) or was not running
(kind ``"WorkerStopped"``), so a chat view has one place to end its streaming state.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, QTimer, Signal

from clover_desk.engine.decode.events import COMPILE_STAGES, EngineError, Finished, GenerationParams, from_dict

log = logging.getLogger(__name__)
DEFAULT_PARAMS = GenerationParams()  # frozen: one shared default is safe
worker_log = logging.getLogger("clover_desk.worker.process.stderr")

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds clover_desk/ and engine/
STDERR_LINES_KEPT = 40
CRASH_REASON_STDERR_LINES = 12
# How long a cancel during the compile's warm-up waits for the worker to stop at a pass boundary before it ends the
# worker and loads the model again uncompiled (a pass being compiled does not stop: 30 s to minutes with inductor).
COMPILE_CANCEL_GRACE_MS = 3000
WARM_UP_STAGES = tuple(stage for stage in COMPILE_STAGES if stage.startswith("compiling-"))
# engine.api.COMPILE_CANCELLED, the engine's own words for it (the window's process does not import engine.api)
COMPILE_CANCELLED = "compiling was cancelled: the model runs uncompiled"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class EngineClient(QObject):
    """Runs the engine in a worker process and speaks to it without ever blocking the GUI thread."""

    ready = Signal()  # the worker started and accepts commands (after start() or restart())
    stateChanged = Signal(str)  # new state: "stopped" | "starting" | "idle" | "loading" | "generating" | "stopping"
    loadProgress = Signal(object)  # engine.decode.events.LoadProgress while a model loads
    loaded = Signal(dict)  # the model is ready: {"model_dir", "device", "dtype", "vram_gb", "load_s", "config",
    #                        "generation_defaults", "plan"} (config & co. as JSON dicts)
    loadFailed = Signal(str, str)  # (kind, message): a load ended without a model (also sent as errorMessage)
    event = Signal(str, object)  # (request_id, engine event): PromptInfo, PrefillProgress, BlockStep, TextDelta,
    #                              BlockCommitted, Finished, or EngineError (the request failed; always its last event)
    errorMessage = Signal(str, str)  # (kind, message): an error not tied to a generate request (load, plan,
    #                                  protocol) for the user to see; generate errors arrive as event(id, EngineError)
    crashed = Signal(str)  # the worker ended unexpectedly: exit code or signal, fatal error, last stderr lines
    planReady = Signal(dict)  # Plan.to_dict() answering the latest request_plan() (older answers are dropped)
    planInUse = Signal(dict)  # Plan.to_dict() a load is placing (sent before its weights are read)
    stopped = Signal()  # the worker exited after shutdown()
    serving = Signal(str)  # the worker's OpenAI-compatible server listens at this base URL (".../v1")
    serveStopped = Signal()  # it stopped (stop_server, or the worker exited); its port is free
    serveFailed = Signal(str)  # start_server() could not listen (the message names the address and port)
    chatRead = Signal(str, dict)  # (request id, the worker's chat_read record) answering read_chat()

    def __init__(
        self,
        parent: QObject | None = None,
        *,
        python: str | None = None,
        worker_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        grace_ms: int = 3000,
        compile_cancel_grace_ms: int = COMPILE_CANCEL_GRACE_MS,
    ) -> None:
        """``python``: interpreter for the worker (default: this one). ``worker_args``: extra worker command-line
        arguments. ``env``: extra environment variables for the worker (e.g. CUDA_VISIBLE_DEVICES). ``grace_ms``:
        how long shutdown() lets the worker exit cleanly before killing it. ``compile_cancel_grace_ms``: how long a
        cancel during the compile's warm-up waits for the worker before loading the model again uncompiled in a
        fresh one."""
        super().__init__(parent)
        self._python = python or sys.executable
        self._worker_args = list(worker_args)
        self._env = dict(env or {})
        self._started_env = dict(self._env)  # the extra environment of the running worker (set_env: the next one's)
        self._grace_ms = grace_ms
        self._proc: QProcess | None = None
        self._state = "stopped"
        self._stdout_buf = bytearray()
        self._stderr_buf = bytearray()
        self._stderr_lines: deque[str] = deque(maxlen=STDERR_LINES_KEPT)
        self._ready = False  # the worker said "ready": commands before that wait in _queued
        self._queued: list[dict[str, Any]] = []
        self._expected_exit = False  # shutdown() / restart() asked for the exit: not a crash
        self._restart_after_exit = False
        self._fatal: tuple[str, str] | None = None  # the fatal error the worker reported before exiting
        self._current_request: str | None = None
        self._load_pending = False  # a load was sent and has not ended (loaded / loadFailed) yet
        self._latest_plan: str | None = None
        self._model_info: dict[str, Any] | None = None
        self._pid: int | None = None
        self._serve: dict[str, Any] | None = None  # the serve command asked for (sent again after a restart)
        self._server_url: str | None = None
        self._server_policy = ""  # whom the server answers (its "serving" record's policy line)
        self._load_command: dict[str, Any] | None = None  # the load in flight as sent
        self._warming_up = False  # its latest progress is a compile warm-up stage (a cancel may not stop it soon)
        self._uncompiled_again: dict[str, Any] | None = None  # the load to send the worker started in its place
        self._compile_fallback = False  # the load in flight is that one: its "loaded" says the compile was cancelled
        self._compile_cancel_timer = QTimer(self)
        self._compile_cancel_timer.setSingleShot(True)
        self._compile_cancel_timer.setInterval(compile_cancel_grace_ms)
        self._compile_cancel_timer.timeout.connect(self.on_compile_cancel_overdue)

    # ----------------------------------------------------------------- properties

    @property
    def state(self) -> str:
        return self._state

    @property
    def model_info(self) -> dict[str, Any] | None:
        """The last ``loaded`` record of the running worker (None: no model loaded)."""
        return self._model_info

    @property
    def current_request(self) -> str | None:
        """The id of the generation in progress, if any."""
        return self._current_request

    @property
    def pid(self) -> int | None:
        """The worker's process id while it runs."""
        return self._pid

    @property
    def server_url(self) -> str | None:
        """The HTTP server's base URL while the worker serves, else None."""
        return self._server_url

    @property
    def server_policy(self) -> str:
        """Whom the HTTP server answers (its Host / Origin policy), one line; "" while it does not serve."""
        return self._server_policy if self._server_url else ""

    @property
    def last_stderr(self) -> list[str]:
        """The worker's last stderr lines (its log), newest last."""
        return list(self._stderr_lines)

    @property
    def env(self) -> dict[str, str]:
        """The extra environment the worker starts with."""
        return dict(self._env)

    # ----------------------------------------------------------------- commands

    def set_env(self, env: Mapping[str, str]) -> bool:
        """Set extra environment variables for the worker's next start (a running worker keeps its own); returns
        whether that changes the environment a running worker was started with, i.e. whether it must be restarted
        for them to apply."""
        self._env.update(env)
        return self._proc is not None and self._env != self._started_env

    def start(self) -> None:
        """Start the worker (no-op when one is running). ``ready`` follows once it accepts commands."""
        if self._proc is not None:
            return
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
        proc.setProgram(self._python)
        proc.setArguments(["-m", "clover_desk.worker.process", *self._worker_args])
        self._connect_signals(proc)
        self._proc = proc
        self._ready = False
        self._queued.clear()
        self._stdout_buf.clear()
        self._stderr_buf.clear()
        self._stderr_lines.clear()
        self._expected_exit = False
        self._restart_after_exit = False
        self._fatal = None
        self._model_info = None
        self._current_request = None
        self._load_pending = False
        self._warming_up = False
        self._compile_cancel_timer.stop()
        self._set_state("starting")
        log.info("starting engine worker: %s %s", self._python, " ".join(proc.arguments()))
        proc.start()
        if self._serve is not None:  # serving was on when the last worker ended (a restart): serve again
            self._queued.append(dict(self._serve))

    def load(
        self,
        model_dir: str | os.PathLike[str],
        device: str = "cpu",
        dtype: str = "float32",
        vram_gb: float | None = None,
        ctx_tokens: int | None = None,
        plan: dict[str, Any] | None = None,
        gguf_layout: str | None = None,
        compile: bool = False,
        precision: str | None = None,
    ) -> None:
        """Load a model folder or a ``.gguf`` file (replacing the loaded model). Progress: ``loadProgress``; end:
        ``loaded`` or ``loadFailed``. May be called right after start(): it is sent once the worker is ready.

        ``precision``: how the weights are held (engine.api.Engine.load; "nf4" with a plan for a model folder; None:
        ``dtype``'s, or a .gguf file's own blocks). ``plan`` (``Plan.to_dict()``, as the VRAM panel showed it) is
        placed as is; ``vram_gb`` / ``ctx_tokens``
        without a plan let the worker make it with the same planning function. ``gguf_layout`` ("auto" | "fork" |
        "upstream"; None: auto) overrides a GGUF file's layout detection. ``compile``: compile the decoder layers
        and warm them up before ``loaded`` (the warm-up's stages arrive as ``loadProgress``; see Engine.load)."""
        if self._state in ("loading", "generating"):
            busy = "a model is loading" if self._state == "loading" else "a generation is running; cancel it first"
            self._later(lambda: self._refuse_load("Busy", f"cannot load: {busy}"))
            return
        self._model_info = None
        self._load_pending = True
        command = {"cmd": "load", "model_dir": str(model_dir), "device": device, "dtype": dtype, "vram_gb": vram_gb,
                   "ctx_tokens": ctx_tokens, "plan": plan}
        if gguf_layout is not None:
            command["gguf_layout"] = gguf_layout
        if precision is not None:
            command["precision"] = precision
        if compile:
            command["compile"] = True
        self._compile_fallback = False
        self._send_load(command)

    def _send_load(self, command: dict[str, Any]) -> None:
        self._load_command = command
        self._warming_up = False
        self._send(command, new_state="loading")

    def cancel_load(self) -> None:
        """Stop a load in progress (it ends with ``loadFailed("CancelledError", ...)``). During the compile's
        warm-up the model stays, uncompiled (``loaded`` with ``"compile_cancelled": true``), within
        ``compile_cancel_grace_ms`` plus an uncompiled load's time (see the module's docstring)."""
        self._send({"cmd": "cancel_load"})
        if self._load_pending and self._warming_up and self._proc is not None:
            self._compile_cancel_timer.start()

    def generate(
        self,
        messages: list[dict[str, Any]],
        params: GenerationParams = DEFAULT_PARAMS,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Start a chat generation; returns its request id. Its events arrive as ``event(request_id, ...)``."""
        request_id = uuid.uuid4().hex[:12]
        refusal = {
            "stopped": ("WorkerStopped", "the engine is not running; restart it"),
            "stopping": ("WorkerStopped", "the engine is shutting down"),
            "starting": ("NotLoaded", "no model is loaded yet"),
            "loading": ("Busy", "a model is loading"),
            "generating": ("Busy", "another answer is being generated"),
        }.get(self._state)
        if refusal is None and self._model_info is None:
            refusal = ("NotLoaded", "no model is loaded")
        if refusal is not None:
            self._fail_later(request_id, *refusal)
            return request_id
        self._current_request = request_id
        self._send(
            {
                "cmd": "generate",
                "id": request_id,
                "messages": messages,
                "params": dataclasses.asdict(params),
                "tools": tools,
            },
            new_state="generating",
        )
        return request_id

    def read_chat(self, messages: list[dict[str, Any]], params: GenerationParams = DEFAULT_PARAMS) -> str:
        """Have the idle engine read a chat so far into its prompt cache (``Engine.read_chat``), so that the chat's
        next turn reads only the new message; a generate (or anything else needing the engine) stops it at once.
        Returns its id ("" when the engine is not idle with a model: nothing is sent); ``chatRead`` answers."""
        if self._state != "idle" or self._model_info is None or self._proc is None:
            return ""
        request_id = "read-" + uuid.uuid4().hex[:12]
        self._send({"cmd": "read_chat", "id": request_id, "messages": messages, "params": dataclasses.asdict(params)})
        return request_id

    def cancel(self, request_id: str | None = None) -> None:
        """Ask a generation (default: the current one) to stop; the engine stops within one pass and sends
        ``Finished`` with stop_reason "cancelled". A request that already ended is left alone."""
        request_id = request_id or self._current_request
        if request_id is None or self._proc is None:
            return
        self._send({"cmd": "cancel", "id": request_id})

    def start_server(self, host: str, port: int, api_key: str | None = None) -> None:
        """Serve the loaded model over HTTP from the worker (OpenAI-compatible; ``clover_desk.worker.server``). Answer:
        ``serving(url)`` or ``serveFailed(message)``. Serving goes on across model loads (requests get 503 while one
        loads) and is started again after a restart, until :meth:`stop_server`."""
        if self._proc is None or self._state == "stopping":
            self._later(lambda: self.serveFailed.emit("the engine is not running; restart it"))
            return
        self._serve = {"cmd": "serve", "host": host, "port": int(port), "api_key": api_key or None}
        self._send(dict(self._serve))

    def stop_server(self) -> None:
        """Stop serving (``serveStopped`` follows once the port is free)."""
        self._serve = None
        if self._proc is None or self._state == "stopping":  # no worker: nothing serves
            self._server_url = None
            self._later(self.serveStopped.emit)
            return
        self._send({"cmd": "serve_stop"})

    def request_plan(
        self,
        model_dir: str | os.PathLike[str],
        vram_gb: float | None = None,
        ram_gb: float | None = None,
        **options: Any,
    ) -> str:
        """Ask the worker's planner for a placement plan (``None`` budgets: probe this machine). Answer:
        ``planReady`` for the latest request only; failures: ``errorMessage``. ``options`` go to ``make_plan``
        (e.g. ``ctx=8192``)."""
        request_id = uuid.uuid4().hex[:12]
        self._latest_plan = request_id
        self._send(
            {"cmd": "plan", "id": request_id, "model_dir": str(model_dir), "vram_gb": vram_gb, "ram_gb": ram_gb,
             **options}
        )
        return request_id

    def restart(self) -> None:
        """Kill the worker if it runs (no ``crashed``), then start a fresh one (``ready`` follows)."""
        if self._proc is None:
            self.start()
            return
        self._expected_exit = True
        self._restart_after_exit = True
        self._end_pending("WorkerStopped", "the engine was restarted")
        self._set_state("stopping")
        _kill_group(self._proc)

    def shutdown(self, wait_ms: int = 0) -> None:
        """Ask the worker to exit (cancelling what runs); kill it after ``grace_ms``. ``stopped`` follows.

        ``wait_ms`` > 0 blocks up to that long for the exit, then kills: for application exit (aboutToQuit) only.
        """
        proc = self._proc
        if proc is None:
            return
        self._expected_exit = True
        self._restart_after_exit = False  # (a worker ended for an uncompiled load is not started again)
        self._uncompiled_again = None
        self._end_pending("WorkerStopped", "the engine was shut down")
        self._set_state("stopping")
        if proc.state() == QProcess.ProcessState.Running:
            proc.write(b'{"cmd": "shutdown"}\n')
            proc.closeWriteChannel()
        QTimer.singleShot(self._grace_ms, lambda p=proc: self._kill_if_running(p))
        if wait_ms > 0:
            if not proc.waitForFinished(wait_ms):
                _kill_group(proc)
                proc.waitForFinished(1000)

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
        self._pid = None
        self._model_info = None
        proc.deleteLater()
        self._server_gone()
        if self._expected_exit:
            log.info("engine worker exited (code %d)", exit_code)
            restart = self._restart_after_exit
            self._set_state("stopped")
            if restart:
                self.start()
                again, self._uncompiled_again = self._uncompiled_again, None
                if again is not None:  # the compile cancelled by ending the worker: the same model, uncompiled
                    self._load_pending = True
                    self._compile_fallback = True
                    self._send_load(again)
            else:
                self.stopped.emit()
            return
        self._crash(self._describe_exit(exit_code, exit_status))

    def on_compile_cancel_overdue(self) -> None:
        """A cancel during the compile's warm-up got no answer in time (inductor is compiling a pass, which nothing
        interrupts): end the worker and its compile workers, and load the same model uncompiled in a fresh one."""
        if not (self._load_pending and self._warming_up and self._proc is not None and self._state == "loading"):
            return  # the worker answered (loaded, uncompiled, or the load ended) in the meantime
        assert self._load_command is not None
        log.warning("the compile's warm-up did not stop within %d ms of Cancel: ending the engine worker and "
                    "loading %s again, uncompiled", self._compile_cancel_timer.interval(),
                    self._load_command.get("model_dir"))
        self._uncompiled_again = {k: v for k, v in self._load_command.items() if k != "compile"}
        self._expected_exit = True
        self._restart_after_exit = True
        self._queued.clear()
        self._set_state("stopping")
        _kill_group(self._proc)

    def on_process_error(self, error: QProcess.ProcessError) -> None:
        proc = self._proc
        if proc is None or self.sender() is not proc:
            return
        if error == QProcess.ProcessError.FailedToStart:  # no finished() will follow
            self._proc = None
            proc.deleteLater()
            if self._serve is not None:
                self.serveFailed.emit("the engine worker could not start")
            self._crash(f"the engine worker could not start ({self._python}): {proc.errorString()}")

    # ----------------------------------------------------------------- internals

    def _connect_signals(self, proc: QProcess) -> None:
        """Wire one worker process (a fresh QProcess per start; slots ignore a process that is not current)."""
        proc.readyReadStandardOutput.connect(self.on_stdout)
        proc.readyReadStandardError.connect(self.on_stderr)
        proc.finished.connect(self.on_finished)
        proc.errorOccurred.connect(self.on_process_error)

    def _set_state(self, state: str) -> None:
        if state != self._state:
            self._state = state
            self.stateChanged.emit(state)

    def _send(self, command: dict[str, Any], new_state: str | None = None) -> None:
        if self._proc is None or self._state == "stopping":
            log.warning("engine worker not running; dropped command %s", command.get("cmd"))
            message = "the engine is not running; restart it"
            if command.get("cmd") == "load":
                self._later(lambda: self._load_failed("WorkerStopped", message))
            elif command.get("cmd") == "plan":
                self._later(lambda: self.errorMessage.emit("WorkerStopped", message))
            return
        if new_state is not None:
            self._set_state(new_state)
        if not self._ready:
            self._queued.append(command)
            return
        self._write(command)

    def _write(self, command: dict[str, Any]) -> None:
        assert self._proc is not None
        self._proc.write((json.dumps(command, ensure_ascii=True) + "\n").encode("ascii"))

    def _later(self, fn: Any) -> None:
        """Run ``fn`` from the event loop, after the current call returns (so callers can connect first)."""
        QTimer.singleShot(0, self, fn)

    def _fail_later(self, request_id: str, kind: str, message: str) -> None:
        self._later(lambda: self.event.emit(request_id, EngineError(kind=kind, message=message)))

    def _end_pending(self, kind: str, message: str) -> None:
        """End the generation and load in flight (the worker will not answer them any more)."""
        request_id, self._current_request = self._current_request, None
        if request_id is not None:
            self.event.emit(request_id, EngineError(kind=kind, message=message))
        if self._load_pending:
            self._load_pending = False
            self._compile_cancel_timer.stop()
            self._compile_fallback = False
            self.loadFailed.emit(kind, message)
        self._queued.clear()

    def _refuse_load(self, kind: str, message: str) -> None:
        """A load() that was never sent (the one in progress, if any, goes on)."""
        self.errorMessage.emit(kind, message)
        self.loadFailed.emit(kind, message)

    def _load_failed(self, kind: str, message: str, show: bool = True) -> None:
        self._load_pending = False
        self._compile_cancel_timer.stop()
        self._compile_fallback = False
        if show:
            self.errorMessage.emit(kind, message)
        self.loadFailed.emit(kind, message)

    def _server_gone(self) -> None:
        """The worker ended: its server went with it (a restart serves again when serving was asked for)."""
        if self._server_url is not None:
            self._server_url = None
            self.serveStopped.emit()

    def _kill_if_running(self, proc: QProcess) -> None:
        if proc is self._proc and proc.state() != QProcess.ProcessState.NotRunning:
            log.warning("engine worker did not exit within %d ms; killing it", self._grace_ms)
            _kill_group(proc)

    def _describe_exit(self, exit_code: int, exit_status: QProcess.ExitStatus) -> str:
        if exit_status == QProcess.ExitStatus.CrashExit:
            # On POSIX, Qt reports the terminating signal as the exit code of a crashed process.
            how = f"was killed by {_signal_name(exit_code)}" if os.name == "posix" and exit_code else "crashed"
        else:
            how = f"exited with code {exit_code}"
        parts = [f"The engine worker {how}."]
        if self._fatal is not None:
            parts.append(f"{self._fatal[0]}: {self._fatal[1]}")
        tail = list(self._stderr_lines)[-CRASH_REASON_STDERR_LINES:]
        if tail:
            parts.append("Last log lines:\n" + "\n".join(tail))
        return "\n".join(parts)

    def _crash(self, reason: str) -> None:
        log.error("engine worker crashed: %s", reason)
        self._end_pending("WorkerCrashed", reason.splitlines()[0])
        self._pid = None
        self._set_state("stopped")
        self.crashed.emit(reason)

    def _on_line(self, line: bytes) -> None:
        try:
            record = json.loads(line)
            name = record["event"]
        except (ValueError, KeyError, TypeError):
            log.warning("engine worker sent a line that is not a record: %r", line[:200])
            return
        if self._state == "stopping":  # shutdown()/restart() already ended what was pending
            log.debug("engine worker is stopping; ignored %s", name)
            return
        if name == "ready":
            self._pid = record.get("pid")
            self._ready = True
            if self._state == "starting":  # else a queued load already moved it on
                self._set_state("idle")
            queued, self._queued = self._queued, []
            for command in queued:
                self._write(command)
            if not self._compile_fallback:  # (a worker started for the uncompiled load: to the window, a load going on)
                self.ready.emit()
        elif name == "load_progress":
            self._warming_up = record.get("stage") in WARM_UP_STAGES
            self.loadProgress.emit(from_dict(record))
        elif name == "loaded":
            self._load_pending = False
            self._compile_cancel_timer.stop()
            self._warming_up = False
            if self._compile_fallback:  # what the worker's own cancelled warm-up says
                self._compile_fallback = False
                record = {**record, "compiled": False, "compile_cancelled": True, "compile_skipped": COMPILE_CANCELLED}
            self._model_info = record
            self._set_state("idle")
            self.loaded.emit(record)
        elif name == "plan":
            if record.get("op") == "load":
                self.planInUse.emit(record.get("plan") or {})
            elif record.get("id") == self._latest_plan:
                self.planReady.emit(record.get("plan") or {})
        elif name == "serving":
            self._server_url = str(record.get("url") or "")
            self._server_policy = str(record.get("policy") or "")
            self.serving.emit(self._server_url)
        elif name == "serve_stopped":  # also the answer to a stop sent before the server was up
            self._server_url = None
            self.serveStopped.emit()
        elif name == "bye":
            log.info("engine worker said goodbye")
        elif name == "error":
            self._on_error(record)
        elif name == "chat_read":
            self.chatRead.emit(str(record.get("id") or ""), record)
        elif "id" in record:
            self._on_event(record)
        else:
            log.warning("engine worker sent an unknown record %r", name)

    def _on_event(self, record: dict[str, Any]) -> None:
        request_id = str(record["id"])
        try:
            event = from_dict(record)
        except (ValueError, TypeError) as exc:
            log.warning("engine worker sent an undecodable event: %s", exc)
            return
        if request_id != self._current_request:  # ended already (e.g. restart): one end per request
            log.debug("dropped a late %s event of request %s", record["event"], request_id)
            return
        if isinstance(event, Finished):
            self._current_request = None
            self._set_state("idle")
        self.event.emit(request_id, event)

    def _on_error(self, record: dict[str, Any]) -> None:
        kind = str(record.get("kind", "Error"))
        message = str(record.get("message", ""))
        if record.get("fatal"):
            self._fatal = (kind, message)  # the exit that follows is reported by crashed, with this reason
        request_id = record.get("id")
        if request_id is not None and record.get("op") != "plan":
            if request_id != self._current_request:
                log.debug("dropped a late error of request %s: %s", request_id, kind)
                return
            self._current_request = None
            if not record.get("fatal"):
                self._set_state("idle")
            self.event.emit(str(request_id), EngineError(kind=kind, message=message))
            return
        if record.get("op") == "serve":
            if record.get("kind") != "AlreadyServing":
                self._serve = None  # not listening: nothing to start again after a restart
            self.serveFailed.emit(message)
            return
        if record.get("op") == "load":
            if self._state == "loading" and not record.get("fatal"):
                self._set_state("idle")
            # A fatal one is shown by the crashed signal that follows, not as a second message.
            self._load_failed(kind, message, show=not record.get("fatal"))
            return
        if record.get("op") == "plan" and request_id != self._latest_plan:
            return
        if not record.get("fatal"):
            self.errorMessage.emit(kind, message)


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
