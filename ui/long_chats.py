"""Chats longer than the model's context, in the window: the context meter beside Send, the check before a message
goes, and the two ways on when it does not fit (``ui.context_window`` has the rules; ``ui.context_meter`` the
widgets).

* The meter counts the chat plus the message being typed, as the engine will read it, through the token counter the
  composition root hands in (the model folder's tokenizer, off the GUI thread, coalesced while typing).
* Send first checks that the chat with the message leaves room for an answer. If not, a dialog offers: leave the
  oldest turns out (this chat then drops the oldest turns when needed on every send; the system prompt stays, the chat
  keeps them on screen and on disk), or start a new chat carrying a summary of this one, written by the model,
  which then sends the message; or keep editing. Nothing is sent, and nothing typed is lost, until one is chosen.
* A chat that leaves turns out starts at the same message on every send while it fits from there (so the engine's
  prompt cache reads only the new turn instead of the whole context again); when the start has to move, it moves
  until a quarter of the chat's room is free for the next turns, as llama.cpp's context shift frees half of it at once
  (``ui.context_window.fit_messages``).

:class:`LongChats` holds this state for :class:`ui.main_window.MainWindow`, which calls it at the few points where
a chat opens, a message goes or an answer ends.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QStatusBar

from clover_desk.engine.decode.events import EngineError, Finished, TextDelta
from clover_desk.ui.context_meter import CANCEL, DROP, SUMMARY, ContextFullDialog, ContextMeter
from clover_desk.ui.context_window import (
    DROP_OLDEST,
    OVERFLOW_KEY,
    SUMMARY_TOKENS,
    Messages,
    answer_reserve,
    context_limit,
    continued_system_prompt,
    continued_title,
    fit_messages,
    fits,
    shift_slack,
    summary_request,
)
from clover_desk.ui.contracts import ChatStoreLike, EngineClientLike, TokenCounterLike
from clover_desk.ui.throttle import Throttle

log = logging.getLogger(__name__)

COUNT_DELAY_MS = 300  # the meter recounts at most this often while the user types


class ChatWindowLike(Protocol):
    """What :class:`LongChats` reads of its window (``ui.main_window.MainWindow``), declared here so the window
    imports this module and not the other way round."""

    drawer: Any  # ui.settings_drawer.SettingsDrawer: .settings()
    composer: Any  # ui.composer.Composer: .input
    conversation_id: int | None
    store: ChatStoreLike
    client: EngineClientLike

    def statusBar(self) -> QStatusBar: ...  # noqa: N802 - Qt's name


@dataclass
class PendingSummary:
    """A new chat being prepared: the summary of chat ``source`` streams in, then ``text`` is sent in the new chat."""

    text: str
    source: int
    request_id: str = ""
    summary: str = ""


class LongChats(QObject):
    """The context meter, the check at Send and the overflow choice of one window."""

    summaryStarted = Signal(str)  # request id of the summary generation
    summaryEnded = Signal(str)  # "done" (the new chat was opened and the message sent) | "cancelled" | "error"
    dialogOpened = Signal(object)  # the ContextFullDialog just opened (tests, accessibility tools)

    def __init__(self, window: ChatWindowLike, counter: TokenCounterLike | None) -> None:
        super().__init__(window)  # type: ignore[arg-type]  # the window (a QObject) owns it
        self.window = window
        self.counter = counter
        self.limit: int | None = None  # the context a send is held to: the model's, or the chat's smaller one
        self.model_limit: int | None = None  # the loaded model's (context_limit)
        self.overflow = ""  # the chat's choice once made: DROP_OLDEST, else ask
        self.meter = ContextMeter()
        self.meter.set_active(counter is not None)
        self._save_error: type[Exception] = getattr(window.store, "Error", OSError)
        self.dialog: ContextFullDialog | None = None
        self.summary: PendingSummary | None = None
        self.left_out = 0  # messages the last send left out
        self._starts: dict[int, int] = {}  # per chat this session: the messages its last send left out
        self._key = 0
        self.throttle = Throttle(self.request_count, COUNT_DELAY_MS, self)
        if counter is not None:
            counter.counted.connect(self.on_counted)

    # ----------------------------------------------------------------- state from the window
    def set_model_info(self, info: Mapping[str, Any] | None) -> None:
        self.model_limit = context_limit(info)
        self._refresh_limit()
        self.throttle.request()

    def on_conversation_opened(self, settings: Mapping[str, Any] | None) -> None:
        self.overflow = str((settings or {}).get(OVERFLOW_KEY) or "")
        self.left_out = 0
        self.throttle.request()

    def local(self) -> bool:
        """The answer comes from the local engine (a remote server has its own tokenizer and context: nothing here
        counts for it)."""
        remote = getattr(self.window, "remote", None)
        return not (remote is not None and remote.selected)

    def applies(self) -> bool:
        """Counting can decide: a counter, a known context, the local engine."""
        return self.counter is not None and bool(self.limit) and self.local()

    def chat_settings(self, settings: dict[str, Any]) -> dict[str, Any]:
        """The chat's settings to save: the drawer's, plus the overflow choice once made."""
        return {**settings, OVERFLOW_KEY: self.overflow} if self.overflow else settings

    def _refresh_limit(self) -> None:
        settings = self.window.drawer.settings()
        chat = settings.context_length  # the chat's own context length (the drawer), within the model's
        self.limit = min(self.model_limit, chat) if self.model_limit and chat > 0 else self.model_limit
        reserve = answer_reserve(self.limit, settings.max_new_tokens) if self.limit else 0
        self.meter.set_limit(self.limit, reserve)

    # ----------------------------------------------------------------- the meter
    def outgoing(self, text: str) -> Messages:
        """What Send would hand the engine: the system prompt, the chat (without failed or streaming answers; up to
        the message being edited), and ``text`` as the new user message."""
        w = self.window
        shown = w.chat.messages()
        editing = w.composer.editing
        if editing is not None and editing in shown:
            shown = shown[: shown.index(editing)]
        out: Messages = []
        system = w.drawer.system_prompt_text()
        if system:
            out.append({"role": "system", "content": system})
        out += [{"role": m.role, "content": m.content} for m in shown if m.status not in ("streaming", "error")]
        if text:
            out.append({"role": "user", "content": text})
        return out

    def request_count(self) -> None:
        """Count the chat and the typed message on the counter's thread (the answer: on_counted)."""
        self.meter.set_active(self.counter is not None and self.local())
        if self.counter is None or not self.local():
            return
        self._refresh_limit()
        messages = self.outgoing(self.window.composer.input.toPlainText().strip())
        self._key += 1
        if not messages:
            self.meter.set_count(0)
            return
        self.counter.count(self._key, messages, self.window.drawer.settings().enable_thinking)

    def on_counted(self, key: int, tokens: int) -> None:
        if key != self._key:
            return  # an older request: a newer count is on its way
        dropping = self.overflow == DROP_OLDEST and self.limit is not None and tokens > self.meter.limit_room()
        self.meter.set_count(None if tokens < 0 else tokens, dropping=dropping)

    # ----------------------------------------------------------------- Send
    def blocks_send(self, text: str) -> bool:
        """True when ``text`` does not fit: the choice is offered (the text stays in the box), and Send waits."""
        self._refresh_limit()  # the chat's context length may have changed since the last count
        if not self.applies() or self.counter is None or not self.limit:
            return False
        settings = self.window.drawer.settings()
        limit, reserve = self.limit, answer_reserve(self.limit, settings.max_new_tokens)
        messages = self.outgoing(text)

        def count(m: Messages) -> int | None:
            return self.counter.count_now(m, settings.enable_thinking) if self.counter is not None else None

        if self.overflow == DROP_OLDEST:
            if fit_messages(messages, count, limit, reserve) is not None:
                return False
            tokens = count(messages)
            self._offer(text, tokens or 0, limit, reserve, can_drop=False, alone=self._alone(messages, count))
            return True
        tokens = count(messages)
        if tokens is None or fits(tokens, limit, reserve):
            return False
        alone = self._alone(messages, count)
        self._offer(text, tokens, limit, reserve, can_drop=alone is not None and fits(alone, limit, reserve),
                    alone=alone)
        return True

    @staticmethod
    def _alone(messages: Messages, count: Any) -> int | None:
        """Tokens of the system prompt and the new message alone."""
        system = messages[:1] if messages and messages[0]["role"] == "system" else []
        return count(system + messages[-1:])

    def _offer(self, text: str, tokens: int, limit: int, reserve: int, *, can_drop: bool,
               alone: int | None) -> None:
        if self.dialog is not None:
            self.dialog.close()
        dialog = ContextFullDialog(tokens, limit, reserve, message_tokens=alone, can_drop=can_drop,
                                   parent=self.window)
        dialog.summary_button.setEnabled(self.window.conversation_id is not None)
        dialog.chosen.connect(lambda answer: self.on_choice(answer, text))
        self.dialog = dialog
        dialog.open()
        self.dialogOpened.emit(dialog)

    def on_choice(self, answer: str, text: str) -> None:
        self.dialog = None
        w = self.window
        if answer == DROP:
            self.overflow = DROP_OLDEST
            if w.conversation_id is not None:
                try:
                    w.store.update_conversation(w.conversation_id,
                                                settings=self.chat_settings(w.drawer.settings().to_dict()))
                except self._save_error as exc:
                    w.show_save_error(exc, "The choice was not saved with the chat")
            w.chat_actions.on_send_requested(text)
        elif answer == SUMMARY:
            self.start_summary(text)
        else:
            assert answer == CANCEL
            w.composer.input.setFocus()

    def messages_to_read(self, conversation_id: int) -> Messages:
        """What the chat's next send will start with, to read ahead (``ChatActions.read_ahead``): the chat as
        :meth:`messages_to_send` gives it, from the start its last send used; nothing changes here."""
        messages = self.window.store.chat_messages(conversation_id)
        start = self._starts.get(conversation_id, 0)
        if not start or self.overflow != DROP_OLDEST:
            return messages
        system = messages[:1] if messages and messages[0].get("role") == "system" else []
        return system + messages[len(system) + start:]

    def messages_to_send(self, conversation_id: int) -> Messages:
        """The chat as the engine gets it: whole, or (once the user chose so) without the oldest turns that do
        not fit."""
        messages = self.window.store.chat_messages(conversation_id)
        last, self.left_out = self._starts.pop(conversation_id, 0), 0
        self._refresh_limit()
        if self.overflow != DROP_OLDEST or not self.applies() or self.counter is None or not self.limit:
            return messages
        settings = self.window.drawer.settings()
        counter = self.counter
        reserve = answer_reserve(self.limit, settings.max_new_tokens)
        # the same start as the last send while the chat fits from there (the engine's prompt cache then reads only
        # the new turn); when it must move, it moves a quarter of the context further (ui.context_window)
        fitted = fit_messages(messages, lambda m: counter.count_now(m, settings.enable_thinking), self.limit,
                              reserve, keep=last, slack=shift_slack(self.limit, reserve))
        if fitted is None:
            return messages  # the engine says why (blocks_send let it through only if it fitted a moment ago)
        self.left_out = self._starts[conversation_id] = fitted[1]
        if self.left_out:
            self.window.statusBar().showMessage(
                f"The {self.left_out} oldest messages were left out to fit the model's context", 6000)
        return fitted[0]

    # ----------------------------------------------------------------- a new chat with a summary
    def start_summary(self, text: str) -> None:
        """Ask the model for a summary of this chat (thinking off, at most SUMMARY_TOKENS tokens); the new chat
        follows when it is done."""
        w = self.window
        source = w.conversation_id
        if source is None or not self.limit or self.counter is None:
            return
        settings = w.drawer.settings()
        room = min(SUMMARY_TOKENS, answer_reserve(self.limit, SUMMARY_TOKENS))
        counter = self.counter
        fitted = fit_messages(summary_request(w.store.chat_messages(source)),
                              lambda m: counter.count_now(m, False), self.limit, room)
        if fitted is None:
            w.info_banner.action.setVisible(False)
            w.info_banner.show_message("This chat cannot be summarized within the model's context.")
            return
        params = replace(settings, enable_thinking=False, max_new_tokens=room).to_params()
        self.summary = PendingSummary(text, source)
        self.summary.request_id = str(w.client.generate(fitted[0], params, None))
        w.composer.set_generating(True)
        w.menus.stop_action.setEnabled(True)
        w.prompt_progress.busy("Summarizing this chat for a new one…")
        w.engine_status.refresh()
        self.summaryStarted.emit(self.summary.request_id)

    def owns(self, request_id: str) -> bool:
        return self.summary is not None and request_id == self.summary.request_id

    def cancel_summary(self) -> None:
        if self.summary is not None:
            self.window.client.cancel(self.summary.request_id)

    def on_summary_event(self, event: object) -> None:
        summary = self.summary
        assert summary is not None
        if isinstance(event, TextDelta) and event.channel == "answer":
            summary.summary += event.text
        elif isinstance(event, Finished):
            text = (event.text or summary.summary).strip()
            if event.stop_reason == "cancelled":
                self._end_summary("cancelled", "The summary was stopped; your message is still in the box.")
            elif not text:
                self._end_summary("error", "The model wrote no summary; your message is still in the box.")
            else:
                self._open_continued_chat(summary, text)
        elif isinstance(event, EngineError):
            self._end_summary("error", f"The summary failed ({event.kind}: {event.message}); your message is still "
                                       "in the box.")

    def _end_summary(self, how: str, message: str = "") -> None:
        w = self.window
        self.summary = None
        w.prompt_progress.end()
        w.composer.set_generating(False)
        w.menus.stop_action.setEnabled(False)
        if message:
            w.info_banner.action.setVisible(False)
            w.info_banner.show_message(message)
        w.engine_status.refresh()
        self.summaryEnded.emit(how)

    def _open_continued_chat(self, summary: PendingSummary, text: str) -> None:
        w = self.window
        try:
            old = w.store.get_conversation(summary.source)
            settings = {k: v for k, v in old.settings.items() if k != OVERFLOW_KEY}
            new = w.store.create_conversation(title=continued_title(old.title),
                                              system_prompt=continued_system_prompt(old.system_prompt, text),
                                              settings=settings)
        except self._save_error as exc:
            self._end_summary("error")
            w.show_save_error(exc, "The new chat was not created (your message is still in the box)")
            return
        self._end_summary("done")
        w.conversations.reload()
        w.conversations.open(new.id)
        w.chat_actions.on_send_requested(summary.text)
