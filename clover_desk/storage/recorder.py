"""Saving a streaming answer as its events arrive: :class:`StreamRecorder`."""

from __future__ import annotations

import logging
import time
from typing import Any

from clover_desk.engine.decode.events import (
    BlockCommitted,
    EngineError,
    Event,
    Finished,
    PromptInfo,
    TextDelta,
    continued_stats,
)
from clover_desk.storage.errors import (
    StorageError,
)
from clover_desk.storage.store import ChatStore
from clover_desk.worker.remote import RemoteFinished

log = logging.getLogger(__name__)


class StreamRecorder:
    """Saves one streaming answer as the engine's events for it arrive (GUI thread, like the store).

    Feed it every event of one generate request with :meth:`on_event`. Committed text is buffered per channel and
    written with :meth:`ChatStore.append_streaming` whenever a block commits (diffusion) or, in AR mode where no
    block events come, at most every ``flush_interval_s``; so a crash loses at most the block in flight.
    ``Finished`` ends the message (``complete``, or ``stopped`` when cancelled) with the engine's figures as stats
    and the final text; ``EngineError`` ends it as ``error`` (``stopped`` for a cancellation or a worker restart)
    keeping the text saved so far.

    A save that fails (:class:`StorageError`, e.g. a full disk) ends the recording: :meth:`on_event` re-raises it
    after marking the message ``error`` with ``stats["error"]`` saying what was not saved (best effort: on a full
    disk that may fail too, and the next open then keeps the message as interrupted). ``save_error`` keeps it.

    A message that already holds text (:meth:`ChatStore.reopen_message`, an answer being continued) keeps it: the
    new text is appended, ``Finished`` writes the whole answer, and its figures are
    :func:`engine.decode.events.continued_stats` of the stored ones and the new ones.
    """

    def __init__(
        self, store: ChatStore, message_id: int, flush_interval_s: float = 0.5, clock: Any = time.monotonic
    ) -> None:
        self.store = store
        self.message_id = message_id
        self.flush_interval_s = flush_interval_s
        self._clock = clock
        self._answer: list[str] = []
        self._thinking: list[str] = []
        self._last_flush = clock()
        self._started = clock()
        self._thinking_started: float | None = None
        self._thinking_seconds: float | None = None
        self.done = False
        self.blocks_saved = 0
        self.save_error: StorageError | None = None
        before = store.get_message(message_id)  # an answer being continued: what it says so far
        self._before = before if before.content or before.thinking else None

    def on_event(self, event: Event) -> bool:
        """Record one event; returns True when it ended the message. Raises StorageError when the save failed
        (the recording has then ended: later events are ignored)."""
        if self.done:
            return True
        try:
            return self._record(event)
        except StorageError as exc:
            self.done = True
            self.save_error = exc
            self._mark_not_saved(exc)
            raise

    def _mark_not_saved(self, exc: StorageError) -> None:
        stats = {"stop_reason": "error", "error": f"not saved: {exc}"}
        try:
            self.store.finish_message(self.message_id, "error", stats=stats, thinking_seconds=self._thinking_seconds)
        except StorageError as again:
            log.warning("cannot mark message %s as not saved either: %s", self.message_id, again)

    def _record(self, event: Event) -> bool:
        if isinstance(event, PromptInfo):
            self._started = self._clock()
        elif isinstance(event, TextDelta):
            self._on_delta(event)
            if self._clock() - self._last_flush >= self.flush_interval_s:
                self.flush()
        elif isinstance(event, BlockCommitted):
            self.flush()
            self.blocks_saved += 1
        elif isinstance(event, Finished):
            self.flush()
            self._end_thinking()
            stats = {
                "stop_reason": event.stop_reason,
                "tokens": event.tokens,
                "passes": event.passes,
                "tokens_per_pass": event.tokens_per_pass,
                "tokens_per_s": event.tokens_per_s,
                "time_to_first_token_s": event.time_to_first_token_s,
                "prompt_tokens": event.prompt_tokens,
                "cached_tokens": event.cached_tokens,
                "prefill_s": event.prefill_s,
                "decode_s": event.decode_s,
            }
            if event.accounting:
                stats["accounting"] = event.accounting
            status = "stopped" if event.stop_reason == "cancelled" else "complete"
            content, thinking, seconds = event.text, event.thinking, self._thinking_seconds
            if self._before is not None:
                before = self._before
                stats = continued_stats(before.stats, stats)
                content, thinking = before.content + content, before.thinking + thinking
                if before.thinking_seconds is not None:
                    seconds = before.thinking_seconds + (seconds or 0.0)
            self.store.finish_message(
                self.message_id, status, stats=stats, thinking_seconds=seconds, content=content, thinking=thinking,
            )
            self.done = True
        elif isinstance(event, RemoteFinished):  # a remote server's answer: its unreported figures stay None
            self.flush()
            self._end_thinking()
            self.store.finish_message(
                self.message_id, "stopped" if event.finish_reason == "cancelled" else "complete", stats=event.stats(),
                thinking_seconds=self._thinking_seconds, content=event.text, thinking=event.thinking,
            )
            self.done = True
        elif isinstance(event, EngineError):
            self.flush()
            self._end_thinking()
            stopped = event.kind in ("CancelledError", "WorkerStopped")
            reason, status = ("cancelled", "stopped") if stopped else ("error", "error")
            if self._before is not None and not stopped:  # a continuation that failed (a prompt now over the
                # context, a crash): the answer it went on with stays what it was, cut short, in the chat's context
                reason, status = ("interrupted" if event.kind == "WorkerCrashed" else "error"), "stopped"
            stats = {"stop_reason": reason, "error": f"{event.kind}: {event.message}"}
            self.store.finish_message(self.message_id, status, stats=stats, thinking_seconds=self._thinking_seconds)
            self.done = True
        return self.done

    def flush(self) -> None:
        """Write the buffered text now (one committed transaction)."""
        answer, thinking = "".join(self._answer), "".join(self._thinking)
        self._answer.clear()
        self._thinking.clear()
        self._last_flush = self._clock()
        if answer or thinking:
            self.store.append_streaming(self.message_id, answer, thinking)

    def _on_delta(self, delta: TextDelta) -> None:
        if delta.channel == "thinking":
            if self._thinking_started is None:
                self._thinking_started = self._clock()
            self._thinking.append(delta.text)
        else:
            self._end_thinking()
            self._answer.append(delta.text)

    def _end_thinking(self) -> None:
        if self._thinking_started is not None and self._thinking_seconds is None:
            self._thinking_seconds = round(self._clock() - self._started, 3)
