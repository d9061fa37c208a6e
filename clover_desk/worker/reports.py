"""What the worker says when something goes wrong, and the JSON-safe form of what it reports.

:class:`ErrorRecords` writes the protocol's ``error`` records: a refusal or a failure the worker survives, or a
fatal one (out of memory, a CUDA error, judged by :func:`classify_fatal`), after which the process exits with
:data:`FATAL_EXIT_CODE`. A window that hung up gets one short log line (:data:`hang_ups`), never a traceback.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

from clover_desk.engine.errors import CancelledError, CloverError
from clover_desk.worker.hangup import HangUpLog, is_hang_up
from clover_desk.worker.protocol import ProtocolError

log = logging.getLogger(__name__)
hang_ups = HangUpLog(log)  # the window hung up (it closed or stopped reading): one short line, not a traceback

FATAL_EXIT_CODE = 3


def classify_fatal(exc: BaseException) -> str | None:
    """The error kind when ``exc`` leaves the process or its device unusable (so the worker must exit), else None.

    Judged by type name and message, so this module does not import torch: ``torch.cuda.OutOfMemoryError`` and
    ``MemoryError`` are "OutOfMemory"; ``torch.AcceleratorError`` and RuntimeErrors from CUDA / cuBLAS / cuDNN are
    "CudaError".
    """
    names = {cls.__name__ for cls in type(exc).__mro__}
    text = str(exc)
    if "OutOfMemoryError" in names or isinstance(exc, MemoryError):
        return "OutOfMemory"
    if isinstance(exc, RuntimeError) and ("out of memory" in text.lower() and "CUDA" in text):
        return "OutOfMemory"
    if "AcceleratorError" in names:
        return "CudaError"
    if isinstance(exc, RuntimeError) and any(k in text for k in ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "cuDNN error")):
        return "CudaError"
    return None


def json_safe(value: Any) -> Any:
    """Dataclasses, mappings and sequences of JSON scalars, recursively; anything else becomes its ``str``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: json_safe(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class ErrorRecords:
    """The worker's ``error`` records, written with ``emit`` (thread-safe)."""

    def __init__(self, emit: Callable[[dict[str, Any]], None]) -> None:
        self._emit = emit

    def error(
        self, kind: str, message: str, *, request_id: str | None = None, op: str | None = None, fatal: bool = False
    ) -> None:
        record: dict[str, Any] = {"event": "error", "kind": kind, "message": message, "fatal": fatal}
        if request_id is not None:
            record["id"] = request_id
        if op is not None:
            record["op"] = op
        self._emit(record)

    def report(self, exc: BaseException, *, request_id: str | None = None, op: str | None = None) -> None:
        """Report ``exc``; exit the process when it is fatal (OOM / CUDA) or not an Exception (e.g. SystemExit)."""
        fatal_kind = classify_fatal(exc)
        if fatal_kind is not None or not isinstance(exc, Exception):
            log.critical("fatal error, the worker exits", exc_info=exc)
            kind = fatal_kind or type(exc).__name__
            self.error(kind, str(exc) or kind, request_id=request_id, op=op, fatal=True)
            logging.shutdown()
            os._exit(FATAL_EXIT_CODE)
        if is_hang_up(exc):  # the window stopped reading: nothing can reach it, and nothing here is wrong
            hang_ups(f"request {request_id}" if request_id is not None else op or "a command", exc)
            return
        if isinstance(exc, ProtocolError):
            self.error("ProtocolError", str(exc), request_id=request_id, op=op)
            return
        if isinstance(exc, CloverError):
            log.info("%s: %s", type(exc).__name__, exc)
            kind = "CancelledError" if isinstance(exc, CancelledError) else type(exc).__name__
            self.error(kind, str(exc), request_id=request_id, op=op)
            return
        log.error("unexpected error (the worker keeps running)", exc_info=exc)
        self.error(type(exc).__name__, f"internal error: {exc}", request_id=request_id, op=op)


def hang_up_safe(run: Callable[..., None], what: str) -> Callable[..., None]:
    """``run`` as a thread's target that ends in one short line when the window hangs up, not a traceback."""

    def target(*args: Any) -> None:
        try:
            run(*args)
        except OSError as exc:
            if not is_hang_up(exc):
                raise
            hang_ups(what, exc)

    return target


def plan_dict(plan: Any) -> Any:
    if plan is None:
        return None
    to_dict_method = getattr(plan, "to_dict", None)
    return to_dict_method() if callable(to_dict_method) else plan
