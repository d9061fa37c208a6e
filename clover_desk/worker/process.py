"""The engine worker process: ``python -m clover_desk.worker.process``.

The GUI never runs the model itself: it starts this process (see :mod:`clover_desk.worker.client`) and talks to
it in JSON lines, so a crash, a CUDA error or an out-of-memory kills only the worker and never the window.

Commands, one JSON object per line on stdin::

    {"cmd": "load", "model_dir": "...", "device": "cuda", "dtype": "bfloat16", "precision": "nf4",
     "plan": {Plan.to_dict()} | null}
        ("precision": Engine.load's, "nf4" with a plan for a folder; the plan the user saw, placed as is after a
        check against the model and the machine; "vram_budget_bytes": 15032385536 (bytes) and
        "ctx_tokens": 16384 instead of a plan make it here with engine.placement.planner.plan_model; "model_dir" may be a
        .gguf file, with "gguf_layout": "auto" | "fork" | "upstream"; "compile": true compiles the decoder layers
        and warms them up before "loaded", its stages reported as load_progress: engine.decode.events.COMPILE_STAGES)
    {"cmd": "cancel_load"}
    {"cmd": "generate", "id": "r1", "messages": [...], "params": {GenerationParams fields}, "tools": [...] | null}
        ("prompt": "text" or "prompt_ids": [..] with "raw": true may replace "messages")
    {"cmd": "cancel", "id": "r1"}
    {"cmd": "read_chat", "id": "w1", "messages": [...], "params": {GenerationParams fields}, "tools": [...] | null}
        (engine.api.Engine.read_chat: a chat so far read into the prompt cache while the engine is idle, so its
        next turn reads only the new message; anything that needs the engine stops it first: a generate, an HTTP
        answer, a load, another read_chat. Answered by one "chat_read" record, never an error record)
    {"cmd": "plan", "id": "p1", "model_dir": "...", "vram_budget_bytes": 17179869184 | null, "ram_gb": 64 | null, "ctx": 16384, ...}
        (engine.placement.planner.plan_model; null budgets: what this machine has free; other keys go to make_plan)
    {"cmd": "serve", "host": "127.0.0.1", "port": 8000, "api_key": "KEY" | null, ["allowed_hosts": [..],
     "allowed_origins": [..], "insecure_no_api_key": false]}
        (clover_desk.worker.server.OpenAIServer over the loaded model, serving from a thread of this process, with
        the same Host / Origin policy as ``clover-desk serve``; a non-loopback host needs a key or insecure_no_api_key)
    {"cmd": "serve_stop"}
    {"cmd": "shutdown"}

Replies, one JSON object per line on stdout (one flush per line; logs go to stderr)::

    {"event": "ready", "pid": .., "protocol": 1}              once, when commands are accepted
    {"event": "load_progress", ...}                            engine.decode.events.LoadProgress (throttled)
    {"event": "loaded", "model_dir": .., "config": {..}, ..}   the model is ready ("precision": how its weights are
                                                               held, "nf4" for a folder's quantized cache;
                                                               "compiled": whether its layers
                                                               are; "compile_skipped": why a compile was not done;
                                                               "cpu_kernels_missing": why quantized weights on the
                                                               CPU run without the CPU kernels;
                                                               "gpu_paths": the opt-in GPU paths switched on)
    {"event": <engine event>, ..., "id": "r1"}                 every generation event (engine.decode.events.to_dict)
    {"event": "chat_read", "id": "w1", "stop_reason": "prefilled" | "cancelled" | "busy" | "refused",
     "prompt_tokens": .., "cached_tokens": .., "prefill_s": .., ["message": why refused]}
    {"event": "plan", "id": "p1", "plan": {Plan.to_dict()}, "hardware": {Hardware fields}}
    {"event": "plan", "op": "load", "plan": {Plan.to_dict()}}  a load under a plan: the plan being placed, before
                                                               the weights are read (same form as plan --json)
    {"event": "error", "kind": .., "message": .., "fatal": false, ["id": "r1" | "op": "load" | "plan"]}
    {"event": "serving", "url": .., "host": .., "port": .., "auth": bool, "policy": ..}   the HTTP server listens
                                                               (policy: whom it answers, one line for people)
    {"event": "serve_stopped"}                                 it stopped (serve_stop, shutdown); the port is free
    {"event": "bye"}                                           after "shutdown", just before exiting

Every generate request ends with exactly one ``finished`` or ``error`` record carrying its id. A
:class:`~engine.errors.CloverError` (bad prompt, bad checkpoint, cancelled load...) is reported and the worker keeps
serving. An out-of-memory or CUDA error leaves the device unusable: the worker reports it with ``"fatal": true`` and
exits with :data:`~clover_desk.worker.reports.FATAL_EXIT_CODE`; the client then offers a restart. Loading and generating run on their own
threads, so ``cancel`` / ``cancel_load`` are read while they work (the engine checks its flag between passes).

``serve`` puts the OpenAI-compatible server in this process, over the same engine (a second process would load a
second copy of the model). Window and HTTP requests never overlap: a generation holds :attr:`Worker.engine_lock`
from its first pass to its last, and the server takes the same lock for each of its turns (a window request that
waits for an HTTP answer can still be cancelled). A load detaches the model from the server first (its requests
get 503 "loading", an HTTP answer in progress is cancelled) and attaches the new one once it is ready. A port that
cannot be bound is an ``error`` record with ``"op": "serve"`` naming the address.

Every line gets an answer, however malformed: a line that is not JSON, not an object, nested deeper than
:data:`~clover_desk.worker.protocol.MAX_NESTING` levels, longer than :data:`~clover_desk.worker.protocol.MAX_LINE_BYTES` (the rest of such a line is skipped unread into
memory), with an unknown or non-string ``cmd``, or with a field of the wrong type or out of range is refused with
one ``{"event": "error", "kind": "ProtocolError", "message": .., "fatal": false}`` record (plus ``id`` / ``op``
when known) whose message names the field and what is allowed, and the worker keeps serving. ``load``,
``generate`` and generate's ``params`` are checked whole before anything starts (unknown fields included: a
misspelt option is refused, never silently ignored), so a refused load never leaves the worker "loading".
``cancel``, ``cancel_load`` and ``shutdown`` ignore extra fields.

``--engine-factory MODULE:CALLABLE`` replaces ``clover_desk.engine.api:Engine.load`` (same signature); the tests use it to
inject failures the real engine cannot be made to produce on demand. The default is the real engine.

The GPU paths and kernel switches (``engine.settings.GpuPaths``) are read from the environment once, when the
worker starts (the window writes them: ``GpuPaths.to_env``), and passed to every load (``gpu_paths=``); a refused
value ends the worker at once with a fatal StartupError naming the switch.
"""

from __future__ import annotations

import argparse
import errno
import gc
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from clover_desk.engine.decode.events import EngineError, Finished, GenerationParams, to_dict
from clover_desk.engine.errors import CloverError
from clover_desk.engine.settings import GpuPaths, SettingsError
from clover_desk.worker.hangup import is_hang_up
from clover_desk.worker.loading import load_engine, loaded_record, plan_record
from clover_desk.worker.protocol import (
    COMMANDS,
    MAX_LINE_BYTES,
    ProtocolError,
    check_generate,
    check_load,
    check_plan_command,
    check_prompt_ids,
    check_read_chat,
    parse_command,
    read_lines,
    refused,
    request_id_of,
    show_value,
)
from clover_desk.worker.reports import FATAL_EXIT_CODE, ErrorRecords, classify_fatal, hang_up_safe, hang_ups
from clover_desk.worker.serving import WorkerServer

log = logging.getLogger("clover_desk.worker.process")

PROTOCOL_VERSION = 1
DEFAULT_ENGINE_FACTORY = "clover_desk.engine.api:Engine.load"
_JOIN_ON_EXIT_S = 5.0
_LOCK_POLL_S = 0.05  # a generate waiting for the engine (held by an HTTP answer) checks its cancel flag this often


def resolve(spec: str) -> Callable[..., Any]:
    """``"package.module:Attr.path"`` -> the object it names."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"expected MODULE:CALLABLE, got {spec!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


class _PreemptingLock:
    """The engine lock as everything but a ``read_chat`` takes it: taking it (or waiting for it) first stops a
    ``read_chat`` that holds it, which then hands it over within a prefill segment."""

    def __init__(self, lock: threading.Lock, preempt: Callable[[], None]) -> None:
        self._lock = lock
        self._preempt = preempt

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        self._preempt()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class Worker:
    """Command dispatch and the load / generate threads. ``emit`` writes one record (thread-safe)."""

    def __init__(
        self, emit: Callable[[dict[str, Any]], None], engine_factory: Callable[..., Any],
        gpu_paths: GpuPaths | None = None,
    ) -> None:
        self._emit = emit
        self._engine_factory = engine_factory
        self._gpu_paths = gpu_paths or GpuPaths()  # what this process was started with (main: GpuPaths.from_env)
        self._lock = threading.Lock()  # guards the fields below
        self._engine: Any = None
        self._state = "idle"  # idle | loading | generating; back to idle *before* the final record goes out
        self._load_thread: threading.Thread | None = None
        self._load_cancel = threading.Event()
        self._gen_thread: threading.Thread | None = None
        self._gen_id: str | None = None
        self._gen_cancel = threading.Event()
        # Held for a whole generation, by this worker's generate thread or the HTTP server's turn: never two at once.
        # A read_chat holds the lock itself underneath; taking engine_lock stops it first (_PreemptingLock).
        self._engine_lock = threading.Lock()
        self.engine_lock = _PreemptingLock(self._engine_lock, self._stop_reading)
        self._read_thread: threading.Thread | None = None
        self._read_cancel = threading.Event()
        self._errors = ErrorRecords(emit)
        self._serving = WorkerServer(emit, self._errors, self.engine_lock, self._lock)  # the HTTP server, if any

    # ----------------------------------------------------------------- dispatch (main thread)

    def handle(self, command: dict[str, Any]) -> bool:
        """Act on one command (a parsed object; see :func:`parse_command`). Returns False when the worker should
        exit. Never raises: a command it cannot act on is answered with an error record."""
        name = command.get("cmd")
        if name == "shutdown":
            self.stop()
            return False
        handlers: dict[str, Callable[[dict[str, Any]], None]] = {
            "load": self._cmd_load,
            "cancel_load": self._cmd_cancel_load,
            "generate": self._cmd_generate,
            "cancel": self._cmd_cancel,
            "read_chat": self._cmd_read_chat,
            "plan": self._cmd_plan,
            "serve": self._cmd_serve,
            "serve_stop": self._cmd_serve_stop,
        }
        handler = handlers.get(name) if isinstance(name, str) else None
        if handler is None:
            what = "missing" if "cmd" not in command else f"got {show_value(name)}"
            self._errors.error(
                "ProtocolError", f"field 'cmd' must be one of {', '.join(repr(c) for c in COMMANDS)}; {what}",
                request_id=request_id_of(command),
            )
            return True
        try:
            handler(command)
        except Exception as exc:  # noqa: BLE001 - a bug in a handler must not end the worker: report it
            if is_hang_up(exc):
                raise  # the window is gone: main() says so in one line and exits
            log.error("command %s failed (the worker keeps running)", name, exc_info=exc)
            self._errors.error(type(exc).__name__, f"internal error: {exc}", request_id=request_id_of(command))
        return True

    def stop(self) -> None:
        """Stop serving, cancel what runs and wait (briefly) for it to end."""
        self._serving.stop()
        self._load_cancel.set()
        self._gen_cancel.set()
        self._read_cancel.set()
        for thread in (self._gen_thread, self._load_thread, self._read_thread):
            if thread is not None:
                thread.join(_JOIN_ON_EXIT_S)

    def _busy(self) -> str | None:
        if self._state == "loading":
            return "a model is loading"
        if self._state == "generating":
            return f"generation {self._gen_id} is running"
        return None

    def _set_idle(self) -> None:
        with self._lock:
            self._state = "idle"
            self._gen_id = None

    def _cmd_load(self, command: dict[str, Any]) -> None:
        try:
            check_load(command)  # refused whole before anything starts: the state never sticks at "loading"
        except ProtocolError as exc:
            self._errors.error("ProtocolError", str(exc), op="load")
            return
        with self._lock:
            busy = self._busy()
            if busy:
                self._errors.error("Busy", f"cannot load: {busy}", op="load")
                return
            self._load_cancel = threading.Event()
            self._load_thread = self._start_locked("loading", self._run_load, (command, self._load_cancel), "clover-load")

    def _cmd_cancel_load(self, command: dict[str, Any]) -> None:
        self._load_cancel.set()

    def _cmd_generate(self, command: dict[str, Any]) -> None:
        request_id = command.get("id")
        if not isinstance(request_id, str) or not request_id:
            self._errors.error("ProtocolError", str(refused("generate: field 'id'", "a non-empty string", request_id)))
            return
        try:
            params = check_generate(command)  # types and ranges first: a malformed request is refused as such
        except ProtocolError as exc:
            self._errors.error("ProtocolError", str(exc), request_id=request_id)
            return
        with self._lock:
            busy = self._busy()
            if busy:
                self._errors.error("Busy", f"cannot generate: {busy}", request_id=request_id)
                return
            if self._engine is None:
                self._errors.error("NotLoaded", "no model is loaded", request_id=request_id)
                return
            try:  # the loaded model's vocabulary bounds prompt_ids (past it: a device-side assert on a GPU)
                vocab_size = getattr(getattr(self._engine, "config", None), "vocab_size", None)
                check_prompt_ids(command.get("prompt_ids"), vocab_size)
            except ProtocolError as exc:
                self._errors.error("ProtocolError", str(exc), request_id=request_id)
                return
            self._gen_cancel = threading.Event()
            self._gen_thread = self._start_locked(
                "generating", self._run_generate, (self._engine, request_id, command, params, self._gen_cancel),
                f"clover-generate-{request_id}", gen_id=request_id)

    def _start_locked(self, state: str, run: Callable[..., None], args: tuple[Any, ...], name: str,
                      gen_id: str | None = None) -> threading.Thread:
        """Enter ``state`` and run ``run(*args)`` on a daemon thread of its own (the caller holds the lock); a thread
        that cannot start leaves the worker idle, never stuck in ``state``."""
        self._state, self._gen_id = state, gen_id
        thread = threading.Thread(target=hang_up_safe(run, state), args=args, name=name, daemon=True)
        try:
            thread.start()
        except BaseException:
            self._state, self._gen_id = "idle", None
            raise
        return thread

    def _cmd_read_chat(self, command: dict[str, Any]) -> None:
        request_id = request_id_of(command) or ""
        try:
            params = check_read_chat(command)
        except ProtocolError as exc:
            self._emit({"event": "chat_read", "id": request_id, "stop_reason": "refused", "message": str(exc)})
            return
        with self._lock:
            engine = self._engine
            if self._busy() or engine is None:
                self._emit({"event": "chat_read", "id": request_id, "stop_reason": "busy"})
                return
            self._read_cancel.set()  # the one running (another chat's) stops: this one takes its place
            self._read_cancel = cancel = threading.Event()
            # the one before, and a generate or load thread past its final record (it may still hold the engine
            # for a moment): this read waits for them to end rather than answering "busy"
            ending = [t for t in (self._read_thread, self._gen_thread, self._load_thread) if t is not None]
            self._read_thread = threading.Thread(
                target=hang_up_safe(self._run_read_chat, "reading a chat ahead"), args=(engine, request_id, command, params, cancel, ending),
                name=f"clover-read-{request_id}", daemon=True)
            self._read_thread.start()

    def _stop_reading(self) -> None:
        self._read_cancel.set()

    def _run_read_chat(self, engine: Any, request_id: str, command: dict[str, Any], params: GenerationParams,
                       cancel: threading.Event, ending: list[threading.Thread]) -> None:
        """Read the chat holding the engine (its raw lock: whatever takes ``engine_lock`` stops this first)."""
        record: dict[str, Any] = {"event": "chat_read", "id": request_id, "stop_reason": "cancelled"}
        for thread in ending:
            thread.join()
        if cancel.is_set() or not self._engine_lock.acquire(blocking=False):
            self._emit({**record, "stop_reason": "busy" if not cancel.is_set() else "cancelled"})
            return
        try:
            for event in engine.read_chat(command["messages"], params, command.get("tools"), cancel):
                if isinstance(event, Finished):
                    record.update(stop_reason=event.stop_reason, prompt_tokens=event.prompt_tokens,
                                  cached_tokens=event.cached_tokens, prefill_s=round(event.prefill_s, 4))
        except CloverError as exc:  # a chat the engine would refuse (too long...): its send will say why
            record.update(stop_reason="refused", message=str(exc))
        except BaseException as exc:  # noqa: BLE001
            if classify_fatal(exc) is not None or not isinstance(exc, Exception):
                self._errors.report(exc, op="read_chat")  # OOM, CUDA: the process ends here, as in a generate
            if is_hang_up(exc):
                hang_ups("reading a chat ahead", exc)
                return
            log.error("reading a chat ahead failed (the worker keeps running)", exc_info=exc)
            record.update(stop_reason="refused", message=f"internal error: {exc}")
        finally:
            self._engine_lock.release()
        self._emit(record)

    def _cmd_cancel(self, command: dict[str, Any]) -> None:
        request_id = command.get("id")
        if not isinstance(request_id, str):
            self._errors.error("ProtocolError", str(refused("cancel: field 'id'", "the string id of a generate", request_id)))
            return
        with self._lock:
            if request_id == self._gen_id:
                self._gen_cancel.set()

    def _cmd_plan(self, command: dict[str, Any]) -> None:
        try:
            check_plan_command(command)
        except ProtocolError as exc:
            self._errors.error("ProtocolError", str(exc), request_id=request_id_of(command), op="plan")
            return
        threading.Thread(target=hang_up_safe(self._run_plan, "planning"), args=(command,), name="clover-plan", daemon=True).start()

    def _cmd_serve(self, command: dict[str, Any]) -> None:
        self._serving.start(command, lambda: self._engine)

    def _cmd_serve_stop(self, command: dict[str, Any]) -> None:
        if not self._serving.stop():
            self._emit({"event": "serve_stopped"})  # nothing was serving: already stopped

    # ----------------------------------------------------------------- work (own threads)

    def _run_load(self, command: dict[str, Any], cancel: threading.Event) -> None:
        try:
            self._load(command, cancel)
        finally:
            with self._lock:  # whatever happened, a finished load thread never leaves the worker "loading"
                if self._state == "loading" and self._load_cancel is cancel:
                    log.error("load thread ended without a result: back to idle")
                    self._state = "idle"

    def _load(self, command: dict[str, Any], cancel: threading.Event) -> None:
        self._serving.detach()
        self._release_engine()
        started = time.monotonic()
        log.info("loading %s (%s, vram_budget_bytes=%s, compile=%s)", command["model_dir"],
                 command.get("device") or "cpu", command.get("vram_budget_bytes"), bool(command.get("compile")))
        try:
            engine = load_engine(command, cancel, self._engine_factory, self._gpu_paths, self._emit)
        except BaseException as exc:  # noqa: BLE001 - every failure is reported; fatal ones end the process
            self._set_idle()
            self._errors.report(exc, op="load")
            return
        if cancel.is_set() and not getattr(engine, "compile_cancelled", False):
            # the engine may finish its last step after the flag was set: honour the cancel (a cancel during the
            # compile's warm-up kept the model, uncompiled: that is what the cancel asked for)
            del engine
            self._release_engine()
            self._set_idle()
            self._errors.error("CancelledError", "loading was cancelled", op="load")
            return
        with self._lock:
            self._engine = engine
            self._state = "idle"
            self._serving.attach_locked(engine)
        self._emit(loaded_record(command, engine, time.monotonic() - started, self._gpu_paths))

    def _run_generate(self, engine: Any, request_id: str, command: dict[str, Any], params: GenerationParams,
                      cancel: threading.Event) -> None:
        """Wait for the engine (an HTTP answer may hold it), then generate holding it to the end."""
        while not self.engine_lock.acquire(timeout=_LOCK_POLL_S):
            if cancel.is_set():  # cancelled while an HTTP answer ran: it ends here, as cancelled, having done nothing
                self._set_idle()
                self._emit({**to_dict(_cancelled_before_start()), "id": request_id})
                return
        try:
            self._generate(engine, request_id, command, params, cancel)
        finally:
            self.engine_lock.release()

    def _generate(self, engine: Any, request_id: str, command: dict[str, Any], params: GenerationParams,
                  cancel: threading.Event) -> None:
        finished = False
        try:
            events = engine.generate(
                messages=command.get("messages"),
                prompt=command.get("prompt"),
                prompt_ids=command.get("prompt_ids"),
                raw=bool(command.get("raw", False)),
                tools=command.get("tools"),
                params=params,
                cancel=cancel,
            )
            for event in events:
                if finished:
                    continue  # nothing may follow the final record
                record = to_dict(event)
                record["id"] = request_id
                if isinstance(event, (Finished, EngineError)):
                    finished = True
                    self._set_idle()  # the client may send the next generate as soon as it reads this
                self._emit(record)
            if not finished:
                self._set_idle()
                self._errors.error("InternalError", "generation ended without a finished event", request_id=request_id)
        except BaseException as exc:  # noqa: BLE001 - every failure is reported; fatal ones end the process
            if finished:
                if is_hang_up(exc):
                    hang_ups(f"request {request_id}", exc)
                else:
                    log.warning("error after the final event of %s", request_id, exc_info=exc)
                return
            self._set_idle()
            self._errors.report(exc, request_id=request_id)

    def _run_plan(self, command: dict[str, Any]) -> None:
        try:
            record = plan_record(command)
        except BaseException as exc:  # noqa: BLE001 - reported; fatal ones end the process
            self._errors.report(exc, request_id=command.get("id"), op="plan")
            return
        self._emit(record)

    def _release_engine(self) -> None:
        """Drop the loaded model before loading another, so two never sit in VRAM at once (an HTTP answer still
        running on it ends first: it holds the engine lock)."""
        with self.engine_lock, self._lock:
            had = self._engine is not None
            self._engine = None
        if had:
            gc.collect()
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_available():
                torch.cuda.empty_cache()

def _cancelled_before_start() -> Finished:
    """The end of a request cancelled before it had the engine: nothing generated, nothing measured."""
    return Finished(token_ids=(), text="", thinking="", stop_reason="cancelled", tokens=0, passes=0,
                    tokens_per_pass=0.0, tokens_per_s=0.0, time_to_first_token_s=None, prompt_tokens=0,
                    prefill_s=0.0, decode_s=0.0)


class LineWriter:
    """Writes one JSON record per line to the protocol stream, flushing each; safe from any thread. Once the window
    has hung up (a write failed with a broken pipe), every later record raises the same at once, unwritten: the
    thread that emits it stops, and says so in one line (:data:`~clover_desk.worker.reports.hang_ups`)."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self._gone: BaseException | None = None

    def __call__(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record, ensure_ascii=True, separators=(",", ":")) + "\n").encode("ascii")
        with self._lock:
            if self._gone is not None:
                raise BrokenPipeError(errno.EPIPE, "the window stopped reading the worker's records")
            try:
                self._stream.write(data)
                self._stream.flush()
            except OSError as exc:
                if is_hang_up(exc):
                    self._gone = exc
                raise


def _take_stdout() -> IO[bytes]:
    """Claim the real stdout for the protocol and point fd 1 (and ``sys.stdout``) at stderr, so a stray print or
    a native library writing to stdout can never corrupt the JSON stream."""
    sys.stdout.flush()
    protocol_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(protocol_fd, "wb")


def lead_own_process_group() -> None:
    """Become the leader of a process group of its own (POSIX), before "ready": the window can then end this worker
    together with every process it started (inductor's compile workers and the compilers they run, which would
    otherwise outlive it by up to a minute) with one signal to the group (``EngineClient``'s forced ends: a compile
    that does not stop when cancelled, a restart, a shutdown that ran past its grace)."""
    if not hasattr(os, "setpgid"):
        return
    try:
        os.setpgid(0, 0)
    except OSError as exc:  # e.g. already a session leader: the window then ends this process alone
        log.info("cannot lead a process group of its own (%s): a forced end stops this process only", exc)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clover_desk.worker.process", description=__doc__.split("\n")[0])
    parser.add_argument("--engine-factory", default=DEFAULT_ENGINE_FACTORY, help="MODULE:CALLABLE that loads a model")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    # Ctrl+C in the terminal that started the window goes to the whole process group, this worker included, and so
    # does the SIGHUP of that terminal closing: the window decides when the engine stops (it closes, then sends
    # shutdown or closes stdin), not the terminal
    for name in ("SIGINT", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    logging.basicConfig(
        stream=sys.stderr, level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    lead_own_process_group()
    emit = LineWriter(_take_stdout())
    try:
        gpu_paths = GpuPaths.from_env()  # once, here: every load gets this object
    except SettingsError as exc:
        log.critical("%s", exc)
        emit({"event": "error", "kind": "StartupError", "message": str(exc), "fatal": True})
        return FATAL_EXIT_CODE
    try:
        factory = resolve(args.engine_factory)
    except (ImportError, AttributeError, ValueError) as exc:
        log.critical("cannot use engine factory %s: %s", args.engine_factory, exc)
        emit({"event": "error", "kind": "StartupError", "message": str(exc), "fatal": True})
        return FATAL_EXIT_CODE
    worker = Worker(emit, factory, gpu_paths)
    try:
        _serve_commands(worker, emit)
    except OSError as exc:
        if not is_hang_up(exc):
            raise
        hang_ups("the worker's records", exc)
        log.info("the window stopped reading: exiting")
        worker.stop()
    logging.shutdown()
    # Daemon threads may still sit inside a native call; leave without running interpreter teardown under them.
    os._exit(0)


def _serve_commands(worker: Worker, emit: LineWriter) -> None:
    """Read commands from stdin until ``shutdown`` or its end (a hang-up of the protocol stream propagates)."""
    emit({"event": "ready", "pid": os.getpid(), "protocol": PROTOCOL_VERSION})
    for line in read_lines(sys.stdin.buffer):
        if line is None:
            message = f"bad command line: longer than {MAX_LINE_BYTES} bytes (skipped); a command line is at most that"
            emit({"event": "error", "kind": "ProtocolError", "message": message, "fatal": False})
            continue
        if not line.strip():
            continue
        try:
            command = parse_command(line)
        except ProtocolError as exc:
            emit({"event": "error", "kind": "ProtocolError", "message": str(exc), "fatal": False})
            continue
        if not worker.handle(command):
            emit({"event": "bye"})
            break
    else:
        log.info("stdin closed (the GUI went away): exiting")
        worker.stop()


if __name__ == "__main__":
    sys.exit(main())
