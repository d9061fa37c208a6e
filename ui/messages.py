"""The plain data of the chat (no Qt): a message as the view shows it (:class:`MessageData`), a reply as it streams
(:class:`StreamingReply`), a request to preview a page (:class:`PreviewRequest`), whether a growing answer holds a
page (:class:`HtmlWatch`), and whether an answer can be continued (:func:`continuable`).

Moved out of :mod:`ui.chat_view` so that :mod:`ui.chat_session` (the chat's controller) and its tests need no widget
module; :mod:`ui.chat_view` re-exports every name.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HtmlExtractor = Callable[[str], "str | None"]  # message Markdown -> the HTML app it contains, or None


# --------------------------------------------------------------------------------------------- plain data


@dataclass
class MessageData:
    """One message as the view shows it. ``message_id`` is the ChatStore id (None before it is saved).
    ``version`` of ``versions``: which of its place's versions it is (a regenerated answer, an edited message)."""

    role: str  # "user" | "assistant" | "system"
    content: str = ""
    thinking: str = ""
    thinking_seconds: float | None = None
    status: str = "complete"  # complete | streaming | stopped | error
    stats: dict[str, Any] = field(default_factory=dict)
    message_id: int | None = None
    version: int = 1
    versions: int = 1


@dataclass(frozen=True, eq=False)
class PreviewRequest:
    """Show ``html`` in the preview: the page of ``message`` (its Preview button), or one of its code blocks."""

    html: str
    message: MessageData  # the very object the view shows (the window compares it with the streaming reply)
    block: int | None = None  # index of the code block whose own "Preview" link was clicked; None: the page

    @property
    def document_id(self) -> str:
        return preview_document_id(self.message, self.block)


def preview_document_id(message: MessageData, block: int | None = None) -> str:
    """The preview's document id for a message's page (or one of its code blocks): one origin per message, so
    pages never share storage, and the reloads of a streaming page keep theirs."""
    base = f"message-{message.message_id}" if message.message_id is not None else f"message-unsaved-{id(message):x}"
    return base if block is None else f"{base}-block-{block}"


class HtmlWatch:
    """Whether a growing answer holds an HTML document, without parsing the whole text again on every delta.

    Committed text is never retracted, so once a document is found it stays found. Until then the extractor runs
    only when a hint of one arrives: every document the extractors find has "htm" (a ```html fence,
    ``<!DOCTYPE html>``, ``<html>``) or "svg" (an ```svg fence) in its text; only the new text is scanned. A hint
    that was not a document yet stays worth a look while little has followed it: a few characters on its own line
    (``<htm`` waiting for ``l>``, a fence's info string) or only blank space after that line (a ```html fence
    waiting for its first line). Once more text came and still no document, the hint was prose ("an HTML form").
    """

    HINTS = ("htm", "svg")
    _OVERLAP = max(len(h) for h in HINTS) - 1  # a hint split across two deltas
    _SAME_LINE = 120  # characters after a hint, on its line, that may still complete a document's first line

    def __init__(self, extractor: HtmlExtractor) -> None:
        self._extract = extractor
        self.found = False
        self.extractions = 0  # how many times the extractor ran (tests, diagnostics)
        self._scanned = 0  # length of the text already scanned for hints
        self._last_hint = -1  # where the latest hint starts
        self._open = False  # the latest hint may still become a document: look again next time

    def check(self, text: str) -> bool:
        """True when ``text`` (the latest state of the growing answer) contains a document."""
        if self.found:
            return True
        if len(text) < self._scanned:  # not the same growing text (e.g. replaced by Finished): start again
            self._scanned, self._last_hint, self._open = 0, -1, False
        start = max(0, self._scanned - self._OVERLAP)
        new = text[start:].lower()
        self._scanned = len(text)
        hint = max(new.rfind(h) for h in self.HINTS)
        if hint >= 0:
            self._last_hint = start + hint
        elif not self._open:
            return False
        self.extractions += 1
        self.found = self._extract(text) is not None
        if not self.found:
            after = text[self._last_hint :]
            line_end = after.find("\n")
            self._open = len(after) <= self._SAME_LINE if line_end < 0 else not after[line_end:].strip()
        return self.found


class StreamingReply:
    """Accumulates one reply's deltas for display: text per channel and how long the thinking took.

    (Saving is the store's recorder's job: ``clover_desk.storage.recorder.StreamRecorder``.)
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.answer = ""
        self.thinking = ""
        self.thinking_started: float | None = None
        self.thinking_ended: float | None = None
        self.started = clock()
        # An answer being continued (continue_final_message): what it said before, its thinking time and figures.
        self.carried_answer = ""
        self.carried_thinking = ""
        self.carried_thinking_s: float | None = None
        self.carried_stats: dict[str, Any] | None = None

    @classmethod
    def resuming(cls, data: MessageData, clock: Callable[[], float] = time.monotonic) -> StreamingReply:
        """The reply that goes on with ``data`` (an answer cut short): its text so far, then the new deltas."""
        reply = cls(clock)
        reply.answer = reply.carried_answer = data.content
        reply.thinking = reply.carried_thinking = data.thinking
        reply.carried_thinking_s = data.thinking_seconds
        reply.carried_stats = dict(data.stats)
        return reply

    def add(self, text: str, channel: str) -> None:
        if channel == "thinking":
            if self.thinking_started is None:
                # The model thinks from its first generated token; in diffusion mode text only arrives when a
                # whole block commits, so the first delta's arrival would under-count the thinking time.
                self.thinking_started = self.started
            self.thinking += text
        else:
            if self.thinking_started is not None and self.thinking_ended is None:
                self.thinking_ended = self._clock()
            self.answer += text

    @property
    def is_thinking(self) -> bool:
        return self.thinking_started is not None and self.thinking_ended is None

    def thinking_seconds(self) -> float | None:
        if self.thinking_started is None:
            return self.carried_thinking_s
        end = self.thinking_ended if self.thinking_ended is not None else self._clock()
        return (self.carried_thinking_s or 0.0) + max(0.0, end - self.thinking_started)

    def finish(self) -> None:
        if self.thinking_started is not None and self.thinking_ended is None:
            self.thinking_ended = self._clock()


def format_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"


def thinking_only_note(data: MessageData) -> str:
    """What to say under an answer that ended while the model was still thinking (empty answer, thinking shown
    collapsed above): why there is no answer and what to change; "" for any other message. A reasoning model often
    spends a small token limit on its thinking alone, and a bare "Thought for 20 s" then reads as a failure."""
    if data.role != "assistant" or data.status not in ("complete", "stopped") or data.content.strip() \
            or not data.thinking.strip():
        return ""
    reason = data.stats.get("stop_reason")
    if reason == "max_new_tokens":
        return ("No answer: the token limit ran out while Clover was still thinking. Continue lets it think on; or "
                "raise Max tokens in the chat settings, or switch Think off, then Regenerate.")
    if reason == "context":
        return ("No answer: the context filled up while Clover was still thinking. Start a new chat, or switch "
                "Think off, then Regenerate.")
    if reason in ("cancelled", "interrupted"):
        return "Stopped while Clover was still thinking: no answer yet. Continue lets it think on, or Regenerate."
    return "Clover ended its reply while still thinking, without an answer. Regenerate to try again."


CONTINUABLE_REASONS = ("max_new_tokens", "cancelled", "interrupted")  # an answer cut short, not one that ended


def continuable(data: MessageData) -> bool:
    """Whether Continue can go on with this answer: one the local engine wrote that was cut short (the token limit,
    Stop, a crash) and has some text; not one that failed, ended on its own or filled the context."""
    return (data.role == "assistant" and data.status in ("complete", "stopped") and data.message_id is not None
            and data.stats.get("stop_reason") in CONTINUABLE_REASONS and data.stats.get("backend") != "remote"
            and bool(data.content or data.thinking))


def is_remote_finished(event: object) -> bool:
    """Whether ``event`` is the last event of a remote answer (``RemoteFinished``: it has no engine counterpart)."""
    return hasattr(event, "finish_reason") and hasattr(event, "denoising_available") and callable(
        getattr(event, "stats", None))
