"""The OpenAI-compatible server inside the worker process (``serve`` / ``serve_stop``).

:class:`WorkerServer` starts :class:`~clover_desk.worker.server.OpenAIServer` on a thread of the worker over the
engine the worker holds, with the same Host / Origin policy as ``clover-desk serve``. It shares the worker's engine
lock (window and HTTP requests never overlap) and its state lock (the engine a server answers with changes with
the worker's, atomically): a load detaches the model first and attaches the new one once it is ready.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from clover_desk.worker.http_guards import is_loopback
from clover_desk.worker.protocol import ProtocolError, check_serve
from clover_desk.worker.reports import ErrorRecords
from clover_desk.worker.server import OpenAIServer

log = logging.getLogger(__name__)


class WorkerServer:
    """The worker's one HTTP server, or none. ``state_lock`` is the worker's (it guards which engine is loaded)."""

    def __init__(
        self, emit: Callable[[dict[str, Any]], None], errors: ErrorRecords, engine_lock: Any,
        state_lock: threading.Lock,
    ) -> None:
        self._emit = emit
        self._errors = errors
        self._engine_lock = engine_lock
        self._lock = state_lock
        self._server: OpenAIServer | None = None

    def start(self, command: dict[str, Any], current_engine: Callable[[], Any]) -> None:
        """Act on a ``serve`` command: listen, and answer with ``serving`` or an error record (``op: serve``).
        ``current_engine`` is read under the state lock (None: requests get 503 until a model is attached)."""
        try:
            check_serve(command)
        except ProtocolError as exc:
            self._errors.error("ProtocolError", str(exc), op="serve")
            return
        if self._server is not None:
            self._errors.error("AlreadyServing", f"already serving at {self._server.url}; send serve_stop first",
                               op="serve")
            return
        server = self._listen(command)
        if server is None:
            return
        with self._lock:
            self._server = server
            server.attach(current_engine())  # None while no model is loaded (or one loads): requests get 503
        server.start()
        log.info("serving %s", server.url)
        self._emit({"event": "serving", "url": server.url, "host": server.host, "port": server.port,
                    "policy": server.policy.describe(),
                    "auth": bool(command.get("api_key"))})

    def _listen(self, command: dict[str, Any]) -> OpenAIServer | None:
        """The server bound to the command's address, or None after an error record saying why not."""
        host, port = command["host"], command["port"]
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if not is_loopback(host) and not command.get("api_key") and not command.get("insecure_no_api_key"):
            self._errors.error("ServeError", f"{host} is reachable from other machines: set an API key to serve there",
                               op="serve")
            return None
        try:
            return OpenAIServer(None, host=host, port=port, api_key=command.get("api_key"), lock=self._engine_lock,
                                allowed_hosts=command.get("allowed_hosts") or (),
                                allowed_origins=command.get("allowed_origins") or ())
        except ValueError as exc:  # a bad allowed host or origin
            self._errors.error("ServeError", str(exc), op="serve")
        except OSError as exc:  # in use, not an address of this machine, a name that does not resolve
            self._errors.error("ServeError", f"cannot listen on {where} (port {port}): {exc.strerror or exc}",
                               op="serve")
        return None

    def stop(self) -> bool:
        """Close the HTTP server (its generation in progress is cancelled, its port freed); False when none ran."""
        with self._lock:
            server, self._server = self._server, None
        if server is None:
            return False
        server.close()
        log.info("stopped serving %s", server.url)
        self._emit({"event": "serve_stopped"})
        return True

    def detach(self) -> None:
        """Before the model is dropped: the server answers 503 "loading" and its answer in progress is cancelled (it
        ends within a pass and hands back the engine lock, which the worker's release of the model waits for)."""
        with self._lock:
            server = self._server
        if server is not None:
            server.attach(None)
            server.service.cancel_all()

    def attach_locked(self, engine: Any) -> None:
        """Serve ``engine`` from now on (the caller holds the state lock, and has just made it the loaded one)."""
        if self._server is not None:
            self._server.attach(engine)
