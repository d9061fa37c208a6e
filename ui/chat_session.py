"""The chat session: the open conversation's controller, without widgets.

:class:`ChatSession` holds what a window's chat does between the user and the engine: it saves the message (or the
edit, a new version of the message) and starts the answer, routes the engine client's events for that answer (the
recorder first, so what is saved never lags what is shown; then the plain :class:`~ui.messages.StreamingReply`), and
ends every request through one path (:meth:`ChatSession.end`) with an :class:`Ending` that says why: the engine's
``Finished``, a remote server's ``RemoteFinished``, a failure (an ``EngineError``, a crash, an error line) or a save
that failed mid-answer. Stop, Regenerate (a new version of the answer; the old one stays), Continue (the engine goes
on with an answer cut short), Branch and the version arrows are here too.

It talks to the disk only through the chat store (:class:`~ui.contracts.ChatStoreLike`), to the engine through the
engine client or the remote runner the view hands it (:meth:`SessionView.request_source`), and to the screen only
through :class:`SessionView`, a handful of plain calls that :class:`ui.main_window.MainWindow` implements and the
tests fake. It imports no Qt module, so its tests run without widgets.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Protocol

from clover_desk.engine.decode.events import EngineError, Finished, TextDelta, continued_stats
from clover_desk.ui.context_window import Messages
from clover_desk.ui.contracts import ChatStoreLike, EngineClientLike, Recorder, RecorderFactory
from clover_desk.ui.generation import GenerationSettings, finished_stats
from clover_desk.ui.messages import MessageData, StreamingReply, continuable, is_remote_finished

log = logging.getLogger(__name__)

FAILED_CONTINUATION_REASON = {"crashed": "interrupted", "cancelled": "cancelled"}  # else "error"
NOT_SAVED = "not-saved"


class SessionView(Protocol):
    """What :class:`ChatSession` asks of the window that shows it."""

    def generation_settings(self) -> GenerationSettings: ...  # the chat's settings (the drawer)

    def system_prompt_text(self) -> str: ...

    def messages_to_send(self, conversation_id: int) -> Messages: ...  # the chat as the engine gets it

    def request_source(self) -> Any: ...  # what answers: the engine client or the remote runner (generate/cancel)

    def shown_messages(self) -> list[MessageData]: ...  # the messages on show, in order

    def show_message(self, data: MessageData) -> None: ...  # add at the end

    def remove_from(self, data: MessageData) -> None: ...  # remove this message and every one after it

    def resume_stream(self, data: MessageData) -> None: ...  # this (last) answer streams again

    def show_chosen_versions(self) -> None: ...  # show the chat again as the store has it now

    def conversation_created(self, conversation_id: int, title: str) -> None: ...

    def answer_started(self, request_id: str, data: MessageData, mode: str, remote: bool) -> None: ...

    def answer_event(self, event: object) -> None: ...  # the answer's data took this event in: repaint, panels

    def answer_ended(self, request_id: str, reason: str, data: MessageData) -> None: ...

    def save_failed(self, error: BaseException, what: str) -> None: ...

    def notice(self, text: str) -> None: ...


@dataclass(frozen=True)
class Ending:
    """How a request ended, as :meth:`ChatSession.end` applies it to the answer: the one end-of-request path."""

    reason: str  # what the window reports: the stop reason | "error" | "crashed" | "cancelled" | "not-saved"
    status: str  # the answer's: complete | stopped | error
    content: str
    thinking: str
    thinking_seconds: float | None
    stats: dict[str, Any]
    tok_s: float | None = None
    remote: bool | None = None  # whose figures these are (a remote server's or the engine's); None: none (a failure)


def finished_ending(event: Finished, reply: StreamingReply, mode: str) -> Ending:
    """The engine's answer ended (its token limit, EOS, Stop). The deltas are authoritative for what was shown;
    Finished carries the same text (used if they differ). A continued answer: the figures of both together."""
    reply.finish()
    stats = finished_stats(event, mode)
    if reply.carried_stats is not None:
        stats = continued_stats(reply.carried_stats, stats)
    return Ending(event.stop_reason, "stopped" if event.stop_reason == "cancelled" else "complete",
                  reply.carried_answer + event.text if event.text else reply.answer,
                  reply.carried_thinking + event.thinking if event.thinking else reply.thinking,
                  reply.thinking_seconds(), stats, event.tokens_per_s, remote=False)


def remote_ending(event: Any, reply: StreamingReply) -> Ending:
    """A remote answer ended (``RemoteFinished``): its figures as the server reported them, None elsewhere."""
    reply.finish()
    stats = event.stats()
    return Ending(str(stats.get("stop_reason") or "eos"), "stopped" if event.finish_reason == "cancelled" else "complete",
                  event.text or reply.answer, event.thinking or reply.thinking, reply.thinking_seconds(), stats,
                  stats.get("tokens_per_s"), remote=True)


def failed_ending(message: str, reason: str, reply: StreamingReply, data: MessageData) -> Ending:
    """The request failed (``reason``: "error", "crashed", "cancelled"): the answer keeps what was shown. A failed
    continuation leaves the answer as it was, cut short (as the recorder saved it: ``StreamRecorder``)."""
    if reply.carried_stats is not None:
        status, stop = "stopped", FAILED_CONTINUATION_REASON.get(reason, "error")
    else:
        status, stop = ("stopped" if reason == "cancelled" else "error"), reason
    return Ending(reason, status, data.content, data.thinking, data.thinking_seconds,
                  {**data.stats, "error": message, "stop_reason": stop})


def unsaved_ending(event: object, error: Exception, reply: StreamingReply, data: MessageData) -> Ending:
    """A save failed mid-answer: the answer stays on screen, this event's text included, marked as not saved."""
    if isinstance(event, TextDelta):
        reply.add(event.text, event.channel)
    reply.finish()
    done = event if isinstance(event, Finished) else None
    return Ending(NOT_SAVED, "error",
                  reply.carried_answer + done.text if done is not None and done.text else reply.answer,
                  reply.carried_thinking + done.thinking if done is not None and done.thinking else reply.thinking,
                  reply.thinking_seconds(), {**data.stats, "stop_reason": NOT_SAVED, "error": f"not saved: {error}"})


class ChatSession:
    """The open conversation, its answer in flight and the figures of the last one."""

    def __init__(self, client: EngineClientLike, store: ChatStoreLike, recorder_factory: RecorderFactory,
                 view: SessionView) -> None:
        self.client = client
        self.store = store
        self.view = view
        self.save_error: type[Exception] = getattr(store, "Error", OSError)
        self._new_recorder = recorder_factory
        self.recorder: Recorder | None = None  # saves the streaming answer
        self.conversation_id: int | None = None
        self.request_id: str | None = None
        self.reply: StreamingReply | None = None
        self.reply_data: MessageData | None = None
        self.reply_mode = "diffusion"
        self.source: Any = client  # what answers the request in flight: the engine client or the remote runner
        self.last_tok_s: float | None = None
        self.last_tok_s_remote = False  # whose figure last_tok_s is: the remote server's (True) or the local engine's
        self.last_hit_rate: float | None = None

    # ----------------------------------------------------------------- state
    @property
    def generating(self) -> bool:
        return self.request_id is not None

    def local_request(self) -> bool:
        """An answer is in flight from the local engine (its errors and crashes end it)."""
        return self.request_id is not None and self.source is self.client

    def editable(self, data: MessageData | None) -> bool:
        """Whether sending now saves a new version of ``data`` (a saved message still on show) instead of a new
        message."""
        return data is not None and data.message_id is not None and data in self.view.shown_messages()

    def answer_to_continue(self) -> MessageData | None:
        """The chat's last message when it is an answer Continue can go on with (``continuable``), else None."""
        messages = self.view.shown_messages()
        last = messages[-1] if messages else None
        return last if last is not None and continuable(last) else None

    def ensure_conversation(self, first_text: str) -> int:
        """The open conversation's id; a new one (titled from ``first_text``) when none is open."""
        if self.conversation_id is None:
            title_for = getattr(self.store, "title_for", None)
            conv = self.store.create_conversation(
                title=title_for(first_text) if title_for else first_text.strip()[:60] or "New chat",
                system_prompt=self.view.system_prompt_text(),
                settings=self.view.generation_settings().to_dict(),
            )
            self.conversation_id = conv.id
            self.view.conversation_created(conv.id, conv.title)
        return self.conversation_id

    # ----------------------------------------------------------------- the user's requests
    def send(self, text: str, editing: MessageData | None = None) -> bool:
        """Save the message (a new version of ``editing`` when that is :meth:`editable`) and start the answer.
        False when a save failed: said in the view, nothing left half-done (the message is taken back)."""
        sent: MessageData | None = None
        edited: int | None = None  # the message an edit is a new version of (it stays, as the older version)
        try:
            cid = self.ensure_conversation(text)
            if editing is not None and self.editable(editing):
                edited = editing.message_id
                saved = self.store.add_message(cid, "user", text, version_of=edited)
                versions = len(self.store.versions(saved.id))
                self.view.remove_from(editing)
                sent = MessageData("user", text, message_id=saved.id, version=versions, versions=versions)
            else:
                saved = self.store.add_message(cid, "user", text)
                sent = MessageData("user", text, message_id=saved.id)
            self.view.show_message(sent)
            self.start()
        except self.save_error as exc:
            if sent is not None:  # saved, but no answer could be started: take it back so a retry sends it once
                self._take_back(sent, edited)
            self.view.save_failed(exc, "Your message was not sent (it is still in the box)")
            return False
        return True

    def _take_back(self, sent: MessageData, edited: int | None = None) -> None:
        """Delete a message that could not be answered; for an edit (a new version of ``edited``), show the
        version that was edited again."""
        assert sent.message_id is not None
        try:
            self.store.truncate_after(sent.message_id, include=True)
            if edited is not None:
                self.store.select_version(edited)
        except self.save_error as exc:
            log.warning("cannot take back message %s after a failed send: %s", sent.message_id, exc)
            return
        if edited is not None:
            self.view.show_chosen_versions()
        elif sent in self.view.shown_messages():
            self.view.remove_from(sent)

    def start(self, resume: MessageData | None = None, version_of: int | None = None) -> None:
        """Start the answer to the chat's last message (with ``version_of``: a new version of that answer, which
        stays), or go on with ``resume`` (the last answer, reopened in the store: ``ChatStore.reopen_message``),
        which the engine continues (``continue_final_message``)."""
        cid = self.conversation_id
        assert cid is not None
        settings = self.view.generation_settings()
        params = settings.to_params()
        self.reply_mode = settings.mode
        if resume is None:
            saved = self.store.add_message(cid, "assistant", "", status="streaming", stats={"mode": settings.mode},
                                           version_of=version_of)
            versions = len(self.store.versions(saved.id)) if version_of is not None else 1
            self.reply = StreamingReply()
            self.reply_data = MessageData("assistant", status="streaming", stats={"mode": settings.mode},
                                          message_id=saved.id, version=versions, versions=versions)
            self.view.show_message(self.reply_data)
        # the chat as the store now has it, the chosen versions: without the new answer or the reopened one (both
        # are streaming); the engine's prompt cache reads only what differs from what it read last
        messages = self.view.messages_to_send(cid)
        if resume is not None:
            assert resume.message_id is not None
            messages = [*messages, {"role": "assistant", "content": resume.content,
                                    "reasoning_content": resume.thinking}]
            params = replace(params, continue_final_message=True)
            self.reply = StreamingReply.resuming(resume)
            self.reply_data = resume
            self.view.resume_stream(resume)
        assert self.reply_data is not None
        self.recorder = self._new_recorder(self.store, self.reply_data.message_id)
        self.source = self.view.request_source()
        self.request_id = str(self.source.generate(messages, params, None))
        self.view.answer_started(self.request_id, self.reply_data, settings.mode, self.source is not self.client)

    def stop(self) -> bool:
        """Ask what answers to stop (its ``Finished`` or error then ends the request); False: nothing in flight."""
        if self.request_id is None:
            return False
        self.source.cancel(self.request_id)
        return True

    def regenerate(self, data: MessageData) -> None:
        """A new version of the answer ``data`` (which stays, as the version before)."""
        if self.generating or data.message_id is None:
            return
        try:
            self.view.remove_from(data)
            self.start(version_of=data.message_id)
        except self.save_error as exc:
            self.view.save_failed(exc, "The answer was not regenerated")
            self.view.show_chosen_versions()

    def continue_answer(self, data: MessageData) -> None:
        """Go on writing ``data``, the last answer, cut short (:meth:`answer_to_continue`)."""
        if self.generating or self.answer_to_continue() is not data:
            return
        assert data.message_id is not None
        try:
            self.store.reopen_message(data.message_id)
        except self.save_error as exc:
            self.view.save_failed(exc, "The answer was not continued")
            return
        self.start(resume=data)

    def branch(self, data: MessageData) -> Any | None:
        """A new conversation with this one's messages up to ``data`` and its settings (the store's; None: not
        branched, said in the view)."""
        if self.generating or data.message_id is None:
            return None
        try:
            return self.store.branch_conversation(data.message_id)
        except self.save_error as exc:
            self.view.save_failed(exc, "The chat was not branched")
            return None

    def step_version(self, data: MessageData, step: int) -> bool:
        """Choose the previous (-1) / next (+1) version of ``data`` in the store; True when another was chosen."""
        if data.message_id is None or self.generating:
            return False
        try:
            ids = self.store.versions(data.message_id)
            at = ids.index(data.message_id) + step
            if not 0 <= at < len(ids):
                return False
            self.store.select_version(ids[at])
        except self.save_error as exc:
            self.view.save_failed(exc, "The other version was not shown")
            return False
        return True

    def drop_recorder(self) -> None:
        """The answer's message is about to be deleted: nothing more to save."""
        self.recorder = None

    def flush(self) -> None:
        """Save what streamed so far (the app closes; the store marks it interrupted on next open)."""
        flush = getattr(self.recorder, "flush", None) if self.generating else None
        if flush is None:
            return
        try:
            flush()
        except self.save_error as exc:
            log.warning("the answer being generated was not saved at close: %s", exc)

    # ----------------------------------------------------------------- engine events
    def on_event(self, request_id: str, event: object) -> None:
        """One event of the request in flight (others are ignored): saved, then taken into the answer."""
        if request_id != self.request_id or self.reply is None or self.reply_data is None:
            return
        if self.recorder is not None:
            try:
                self.recorder.on_event(event)  # the store first: what is saved never lags what is shown
            except self.save_error as exc:
                self._stop_unsaved(event, exc)
                return
        if isinstance(event, TextDelta):
            self.reply.add(event.text, event.channel)
            self.reply_data.content = self.reply.answer
            self.reply_data.thinking = self.reply.thinking
            self.reply_data.thinking_seconds = self.reply.thinking_seconds()
        self.view.answer_event(event)
        if isinstance(event, Finished):
            self.end(finished_ending(event, self.reply, self.reply_mode))
        elif is_remote_finished(event):
            self.end(remote_ending(event, self.reply))
        elif isinstance(event, EngineError):  # a restart or a cancel ends it stopped, as the recorder saves it
            stopped = event.kind in ("CancelledError", "WorkerStopped")
            self.fail(f"{event.kind}: {event.message}", "cancelled" if stopped else "error")

    def fail(self, message: str, reason: str) -> None:
        """End the request in flight as failed (``reason``: "error", "crashed", "cancelled")."""
        if self.reply is None or self.reply_data is None:
            return
        if self.recorder is not None and not self.recorder.done:  # e.g. a crash reported before its EngineError
            self.recorder.on_event(EngineError("WorkerCrashed" if reason == "crashed" else "Error", message))
        if self.reply.carried_stats is not None:
            self.view.notice(f"The answer was not continued: {message}")
        self.end(failed_ending(message, reason, self.reply, self.reply_data))

    def _stop_unsaved(self, event: object, error: Exception) -> None:
        """A save failed mid-answer: stop the generation (cancel sent unless this event ended it), say so, and end
        the request keeping the answer on screen."""
        assert self.reply is not None and self.reply_data is not None
        if not isinstance(event, (Finished, EngineError)) and self.request_id is not None:
            self.source.cancel(self.request_id)  # its remaining events are ignored: the request ends here
        self.recorder = None
        ending = unsaved_ending(event, error, self.reply, self.reply_data)
        self.view.save_failed(error, "The answer is shown but was not saved; generation stopped")
        self.end(ending)

    def end(self, ending: Ending) -> None:
        """The one end of a request: the answer takes the ending's text, status and figures, the session goes back
        to idle, and the view hears it last."""
        data = self.reply_data
        if data is None:
            return
        data.content, data.thinking, data.thinking_seconds = ending.content, ending.thinking, ending.thinking_seconds
        data.status, data.stats = ending.status, ending.stats
        if ending.remote is not None:
            self.last_tok_s, self.last_tok_s_remote = ending.tok_s, ending.remote
            if not ending.remote:
                self.last_hit_rate = ending.stats.get("expert_hit_rate", self.last_hit_rate)
        request_id = self.request_id or ""
        self.request_id = None
        self.reply = None
        self.reply_data = None
        self.recorder = None
        self.view.answer_ended(request_id, ending.reason, data)
