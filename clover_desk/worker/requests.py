"""The engine client's generate requests: a fresh id each, the one in flight, and exactly one end for each.

Every ``generate`` ends with one ``event(request_id, Finished)`` or ``event(request_id, EngineError)``: from the
worker, from a refusal before anything was sent, or from the worker's end (a crash, a restart, a shutdown). Events
of a request that already ended are dropped. Standard library and the engine's stdlib-only ``events`` module only.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Callable
from typing import Any

from clover_desk.engine.decode.events import EngineError, Finished, GenerationParams, from_dict

log = logging.getLogger(__name__)

# why generate() is refused in each client state (None: it may be sent)
REFUSALS = {
    "stopped": ("WorkerStopped", "the engine is not running; restart it"),
    "stopping": ("WorkerStopped", "the engine is shutting down"),
    "starting": ("NotLoaded", "no model is loaded yet"),
    "loading": ("Busy", "a model is loading"),
    "generating": ("Busy", "another answer is being generated"),
}


def new_request_id(prefix: str = "") -> str:
    return prefix + uuid.uuid4().hex[:12]


def generate_command(request_id: str, messages: list[dict[str, Any]], params: GenerationParams,
                     tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"cmd": "generate", "id": request_id, "messages": messages, "params": dataclasses.asdict(params),
            "tools": tools}


class GenerationRequests:
    """The generate request in flight (``current``); ``emit(request_id, event)`` hands each event to the window, and
    ``ended()`` runs just before a request's end from the worker goes out (the client is idle again by the time the
    window hears of it, and may send the next generate at once)."""

    def __init__(self, emit: Callable[[str, object], None], ended: Callable[[], None]) -> None:
        self._emit = emit
        self._ended = ended
        self.current: str | None = None

    @staticmethod
    def refusal(state: str, loaded: bool) -> tuple[str, str] | None:
        """(kind, message) when a generate cannot be sent in ``state``, else None."""
        refusal = REFUSALS.get(state)
        if refusal is None and not loaded:
            return ("NotLoaded", "no model is loaded")
        return refusal

    def end(self, kind: str, message: str) -> None:
        """End the request in flight, if any, with an EngineError (the worker will not answer it any more)."""
        request_id, self.current = self.current, None
        if request_id is not None:
            self._emit(request_id, EngineError(kind=kind, message=message))

    def on_event(self, record: dict[str, Any]) -> None:
        """An engine event record of a request: to the window unless undecodable or late (a Finished ends it)."""
        request_id = str(record["id"])
        try:
            event = from_dict(record)
        except (ValueError, TypeError) as exc:
            log.warning("engine worker sent an undecodable event: %s", exc)
            return
        if request_id != self.current:  # ended already (e.g. restart): one end per request
            log.debug("dropped a late %s event of request %s", record["event"], request_id)
            return
        if isinstance(event, Finished):
            self.current = None
            self._ended()
        self._emit(request_id, event)

    def on_error(self, request_id: Any, kind: str, message: str, fatal: bool) -> None:
        """An error record of a request: its end unless it ended already (a fatal one: the worker's crash follows,
        and says the rest)."""
        if request_id != self.current:
            log.debug("dropped a late error of request %s: %s", request_id, kind)
            return
        self.current = None
        if not fatal:
            self._ended()
        self._emit(str(request_id), EngineError(kind=kind, message=message))
