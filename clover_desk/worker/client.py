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
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal

from clover_desk.engine.decode.events import EngineError, GenerationParams, from_dict
from clover_desk.worker.load_tracker import COMPILE_CANCEL_GRACE_MS, LoadTracker
from clover_desk.worker.process_handle import WorkerProcess
from clover_desk.worker.requests import GenerationRequests, generate_command, new_request_id
from clover_desk.worker.serve_request import ServeRequest

log = logging.getLogger(__name__)
DEFAULT_PARAMS = GenerationParams()  # frozen: one shared default is safe


class EngineClient(QObject):
    """Runs the engine in a worker process and speaks to it without ever blocking the GUI thread."""

    ready = Signal()  # the worker started and accepts commands (after start() or restart())
    stateChanged = Signal(str)  # new state: "stopped" | "starting" | "idle" | "loading" | "generating" | "stopping"
    loadProgress = Signal(object)  # engine.decode.events.LoadProgress while a model loads
    loaded = Signal(dict)  # the model is ready: {"model_dir", "device", "dtype", "vram_budget_bytes", "load_s",
    #                        "config", "generation_defaults", "plan"} (config & co. as JSON dicts)
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
        self._process = WorkerProcess(self, python=python, worker_args=worker_args, env=env, grace_ms=grace_ms)
        self._process.record.connect(self._on_record)
        self._process.ended.connect(self.on_ended)
        self._process.crashed.connect(self.on_crashed)
        self._process.failedToStart.connect(self.on_failed_to_start)
        self._state = "stopped"
        self._requests = GenerationRequests(self.event.emit, lambda: self._set_state("idle"))  # the one in flight
        self._loads = LoadTracker(self, compile_cancel_grace_ms)  # the load in flight
        self._loads.overdue.connect(self.on_compile_cancel_overdue)
        self._latest_plan: str | None = None
        self._model_info: dict[str, Any] | None = None
        self._serve = ServeRequest()  # the HTTP server asked for, and where it listens

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
        return self._requests.current

    @property
    def pid(self) -> int | None:
        """The worker's process id while it runs."""
        return self._process.pid

    @property
    def server_url(self) -> str | None:
        """The HTTP server's base URL while the worker serves, else None."""
        return self._serve.url

    @property
    def server_policy(self) -> str:
        """Whom the HTTP server answers (its Host / Origin policy), one line; "" while it does not serve."""
        return self._serve.policy

    @property
    def env(self) -> dict[str, str]:
        """The extra environment the worker starts with."""
        return self._process.env

    # ----------------------------------------------------------------- commands

    def set_env(self, env: Mapping[str, str]) -> bool:
        """Set extra environment variables for the worker's next start (a running worker keeps its own); returns
        whether that changes the environment a running worker was started with, i.e. whether it must be restarted
        for them to apply."""
        return self._process.set_env(env)

    def start(self) -> None:
        """Start the worker (no-op when one is running). ``ready`` follows once it accepts commands."""
        if self._process.running:
            return
        self._model_info = None
        self._requests.current = None
        self._loads.ended()
        self._set_state("starting")
        self._process.start()
        again = self._serve.again()
        if again is not None:  # serving was on when the last worker ended (a restart): serve again
            self._process.send(again)

    def load(
        self,
        model_dir: str | os.PathLike[str],
        device: str = "cpu",
        dtype: str = "float32",
        vram_budget_bytes: int | None = None,
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
        placed as is; ``vram_budget_bytes`` / ``ctx_tokens`` without a plan let the worker make it with the same planning
        function. ``gguf_layout`` ("auto" | "fork" | "upstream"; None: auto) overrides a GGUF file's layout
        detection. ``compile``: compile the decoder layers and warm them up before ``loaded`` (the warm-up's stages
        arrive as ``loadProgress``; see Engine.load)."""
        if self._state in ("loading", "generating"):
            busy = "a model is loading" if self._state == "loading" else "a generation is running; cancel it first"
            self._later(lambda: self._refuse_load("Busy", f"cannot load: {busy}"))
            return
        self._model_info = None
        command = {"cmd": "load", "model_dir": str(model_dir), "device": device, "dtype": dtype,
                   "vram_budget_bytes": vram_budget_bytes, "ctx_tokens": ctx_tokens, "plan": plan}
        if gguf_layout is not None:
            command["gguf_layout"] = gguf_layout
        if precision is not None:
            command["precision"] = precision
        if compile:
            command["compile"] = True
        self._loads.sent(command)
        self._send(command, new_state="loading")

    def cancel_load(self) -> None:
        """Stop a load in progress (it ends with ``loadFailed("CancelledError", ...)``). During the compile's
        warm-up the model stays, uncompiled (``loaded`` with ``"compile_cancelled": true``), within
        ``compile_cancel_grace_ms`` plus an uncompiled load's time (see the module's docstring)."""
        self._send({"cmd": "cancel_load"})
        self._loads.cancel_asked(self._process.running)

    def generate(
        self,
        messages: list[dict[str, Any]],
        params: GenerationParams = DEFAULT_PARAMS,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Start a chat generation; returns its request id. Its events arrive as ``event(request_id, ...)``."""
        request_id = new_request_id()
        refusal = self._requests.refusal(self._state, self._model_info is not None)
        if refusal is not None:
            kind, message = refusal
            self._later(lambda: self.event.emit(request_id, EngineError(kind=kind, message=message)))
            return request_id
        self._requests.current = request_id
        self._send(generate_command(request_id, messages, params, tools), new_state="generating")
        return request_id

    def read_chat(self, messages: list[dict[str, Any]], params: GenerationParams = DEFAULT_PARAMS) -> str:
        """Have the idle engine read a chat so far into its prompt cache (``Engine.read_chat``), so that the chat's
        next turn reads only the new message; a generate (or anything else needing the engine) stops it at once.
        Returns its id ("" when the engine is not idle with a model: nothing is sent); ``chatRead`` answers."""
        if self._state != "idle" or self._model_info is None or not self._process.running:
            return ""
        request_id = new_request_id("read-")
        self._send({"cmd": "read_chat", "id": request_id, "messages": messages, "params": dataclasses.asdict(params)})
        return request_id

    def cancel(self, request_id: str | None = None) -> None:
        """Ask a generation (default: the current one) to stop; the engine stops within one pass and sends
        ``Finished`` with stop_reason "cancelled". A request that already ended is left alone."""
        request_id = request_id or self._requests.current
        if request_id is None or not self._process.running:
            return
        self._send({"cmd": "cancel", "id": request_id})

    def start_server(self, host: str, port: int, api_key: str | None = None) -> None:
        """Serve the loaded model over HTTP from the worker (OpenAI-compatible; ``clover_desk.worker.server``). Answer:
        ``serving(url)`` or ``serveFailed(message)``. Serving goes on across model loads (requests get 503 while one
        loads) and is started again after a restart, until :meth:`stop_server`."""
        if not self._process.running or self._state == "stopping":
            self._later(lambda: self.serveFailed.emit("the engine is not running; restart it"))
            return
        self._send(self._serve.ask(host, port, api_key))

    def stop_server(self) -> None:
        """Stop serving (``serveStopped`` follows once the port is free)."""
        self._serve.command = None
        if not self._process.running or self._state == "stopping":  # no worker: nothing serves
            self._serve.stopped()
            self._later(self.serveStopped.emit)
            return
        self._send({"cmd": "serve_stop"})

    def request_plan(self, model_dir: str | os.PathLike[str], vram_budget_bytes: int | None = None,
                     ram_gb: float | None = None, **options: Any) -> str:
        """Ask the worker's planner for a placement plan (``None`` budgets: probe this machine). Answer:
        ``planReady`` for the latest request only; failures: ``errorMessage``. ``options`` go to ``make_plan``
        (e.g. ``ctx=8192``)."""
        request_id = self._latest_plan = new_request_id()
        self._send({"cmd": "plan", "id": request_id, "model_dir": str(model_dir),
                    "vram_budget_bytes": vram_budget_bytes, "ram_gb": ram_gb, **options})
        return request_id

    def restart(self) -> None:
        """Kill the worker if it runs (no ``crashed``), then start a fresh one (``ready`` follows)."""
        if not self._process.running:
            self.start()
            return
        self._end_pending("WorkerStopped", "the engine was restarted")
        self._set_state("stopping")
        self._process.end(restart=True)

    def shutdown(self, wait_ms: int = 0) -> None:
        """Ask the worker to exit (cancelling what runs); kill it after ``grace_ms``. ``stopped`` follows.

        ``wait_ms`` > 0 blocks up to that long for the exit, then kills: for application exit (aboutToQuit) only.
        """
        if not self._process.running:
            return
        self._loads.forget_uncompiled()  # (a worker ended for an uncompiled load is not started again)
        self._end_pending("WorkerStopped", "the engine was shut down")
        self._set_state("stopping")
        self._process.shutdown(wait_ms)

    # ----------------------------------------------------------------- process signals

    def on_ended(self, restart: bool) -> None:
        """The worker exited as asked (its last records were read): stopped, or started again."""
        self._worker_gone()
        self._set_state("stopped")
        if not restart:
            self.stopped.emit()
            return
        self.start()
        again = self._loads.take_uncompiled()
        if again is not None:  # the compile cancelled by ending the worker: the same model, uncompiled
            self._loads.sent(again, fallback=True)
            self._send(again, new_state="loading")

    def on_crashed(self, reason: str) -> None:
        self._worker_gone()
        self._crash(reason)

    def on_compile_cancel_overdue(self) -> None:
        """A cancel during the compile's warm-up got no answer in time (inductor is compiling a pass, which nothing
        interrupts): end the worker and its compile workers, and load the same model uncompiled in a fresh one."""
        if not (self._loads.stuck_in_warm_up() and self._process.running and self._state == "loading"):
            return  # the worker answered (loaded, uncompiled, or the load ended) in the meantime
        log.warning("the compile's warm-up did not stop within %d ms of Cancel: ending the engine worker and "
                    "loading %s again, uncompiled", self._loads.grace_ms, self._loads.model_dir)
        self._loads.replace_uncompiled()
        self._process.drop_queued()
        self._set_state("stopping")
        self._process.end(restart=True)

    def on_failed_to_start(self, message: str) -> None:
        if self._serve.command is not None:
            self.serveFailed.emit("the engine worker could not start")
        self._crash(message)

    # ----------------------------------------------------------------- internals

    def _set_state(self, state: str) -> None:
        if state != self._state:
            self._state = state
            self.stateChanged.emit(state)

    def _send(self, command: dict[str, Any], new_state: str | None = None) -> None:
        if not self._process.running or self._state == "stopping":
            log.warning("engine worker not running; dropped command %s", command.get("cmd"))
            message = "the engine is not running; restart it"
            if command.get("cmd") == "load":
                self._later(lambda: self._load_failed("WorkerStopped", message))
            elif command.get("cmd") == "plan":
                self._later(lambda: self.errorMessage.emit("WorkerStopped", message))
            return
        if new_state is not None:
            self._set_state(new_state)
        self._process.send(command)

    def _later(self, fn: Any) -> None:
        """Run ``fn`` from the event loop, after the current call returns (so callers can connect first)."""
        QTimer.singleShot(0, self, fn)

    def _end_pending(self, kind: str, message: str) -> None:
        """End the generation and load in flight (the worker will not answer them any more)."""
        self._requests.end(kind, message)
        if self._loads.pending:
            self._loads.ended()
            self.loadFailed.emit(kind, message)
        self._process.drop_queued()

    def _refuse_load(self, kind: str, message: str) -> None:
        """A load() that was never sent (the one in progress, if any, goes on)."""
        self.errorMessage.emit(kind, message)
        self.loadFailed.emit(kind, message)

    def _load_failed(self, kind: str, message: str, show: bool = True) -> None:
        self._loads.ended()
        if show:
            self.errorMessage.emit(kind, message)
        self.loadFailed.emit(kind, message)

    def _worker_gone(self) -> None:
        """The worker ended: its model and its server went with it (a restart serves again if serving was on)."""
        self._model_info = None
        if self._serve.stopped():
            self.serveStopped.emit()

    def _crash(self, reason: str) -> None:
        log.error("engine worker crashed: %s", reason)
        self._end_pending("WorkerCrashed", reason.splitlines()[0])
        self._set_state("stopped")
        self.crashed.emit(reason)

    def _on_record(self, record: dict[str, Any]) -> None:
        name = record["event"]
        if self._state == "stopping":  # shutdown()/restart() already ended what was pending
            log.debug("engine worker is stopping; ignored %s", name)
            return
        if name == "ready":
            self._process.pid = record.get("pid")
            if self._state == "starting":  # else a queued load already moved it on
                self._set_state("idle")
            self._process.mark_ready()
            if not self._loads.fallback:  # (a worker started for the uncompiled load: to the window, a load going on)
                self.ready.emit()
        elif name == "load_progress":
            self._loads.progress(record.get("stage"))
            self.loadProgress.emit(from_dict(record))
        elif name == "loaded":
            record = self._loads.loaded(record)
            self._model_info = record
            self._set_state("idle")
            self.loaded.emit(record)
        elif name == "plan":
            if record.get("op") == "load":
                self.planInUse.emit(record.get("plan") or {})
            elif record.get("id") == self._latest_plan:
                self.planReady.emit(record.get("plan") or {})
        elif name == "serving":
            self.serving.emit(self._serve.listening(record))
        elif name == "serve_stopped":  # also the answer to a stop sent before the server was up
            self._serve.stopped()
            self.serveStopped.emit()
        elif name == "bye":
            log.info("engine worker said goodbye")
        elif name == "error":
            self._on_error(record)
        elif name == "chat_read":
            self.chatRead.emit(str(record.get("id") or ""), record)
        elif "id" in record:
            self._requests.on_event(record)
        else:
            log.warning("engine worker sent an unknown record %r", name)

    def _on_error(self, record: dict[str, Any]) -> None:
        kind, message = str(record.get("kind", "Error")), str(record.get("message", ""))
        if record.get("fatal"):
            self._process.fatal = (kind, message)  # the exit that follows is reported by crashed, with this reason
        request_id = record.get("id")
        if request_id is not None and record.get("op") != "plan":
            self._requests.on_error(request_id, kind, message, fatal=bool(record.get("fatal")))
            return
        if record.get("op") == "serve":
            self._serve.refused(kind)
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

