"""The window's side of :class:`ui.chat_session.ChatSession`: where the chat session's calls land on screen.

:class:`AnswerDisplay` implements :class:`ui.chat_session.SessionView` over a window's widgets: the chat column (the
messages, the streaming one repainted through its throttle), the denoising panel, the "Reading your message…" bar,
the composer's Send / Stop, and the preview that follows the answer being streamed (every answer delta hands the page
so far to the preview, whose own throttle coalesces the reloads; the end of the answer flushes the last one; opening
another message's preview stops following).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, cast

from PySide6.QtWidgets import QWidget

from clover_desk.engine.decode.events import BlockCommitted, BlockStep, Finished, PrefillProgress, PromptInfo, TextDelta
from clover_desk.ui.context_window import Messages
from clover_desk.ui.contracts import ChatWindowParts, HtmlPreview
from clover_desk.ui.generation import GenerationSettings
from clover_desk.ui.messages import MessageData, PreviewRequest, preview_document_id
from clover_desk.ui.remote_chat import DENOISING_UNAVAILABLE

log = logging.getLogger(__name__)


class AnswerWindowLike(ChatWindowParts, Protocol):
    """What :class:`AnswerDisplay` uses of its window (``ui.main_window.MainWindow``), besides its shared parts."""

    drawer: Any  # ui.settings_drawer.SettingsDrawer
    denoise: Any  # ui.denoise_view.DenoiseView
    prompt_progress: Any  # ui.prompt_progress.PromptProgress
    info_banner: Any  # ui.banners.Banner
    preview: QWidget | None
    tabs: Any
    side: Any
    menus: Any  # ui.window_menus.WindowMenus: .stop_action
    generationStarted: Any  # noqa: N815 - Qt signal names
    generationFinished: Any  # noqa: N815
    conversations: Any  # ui.conversations.Conversations

    def show_panel(self, widget: QWidget | None) -> None: ...


class AnswerDisplay:
    """The chat session's view (:class:`ui.chat_session.SessionView`) on one window."""

    def __init__(self, window: AnswerWindowLike) -> None:
        self.window = window
        self.preview_follows: MessageData | None = None  # the streaming answer the preview shows as it grows
        self.streaming: MessageData | None = None  # the answer in flight (the session's reply_data)

    # ----------------------------------------------------------------- what the session reads
    def generation_settings(self) -> GenerationSettings:
        return cast(GenerationSettings, self.window.drawer.settings())

    def system_prompt_text(self) -> str:
        return str(self.window.drawer.system_prompt_text())

    def messages_to_send(self, conversation_id: int) -> Messages:
        return cast(Messages, self.window.long_chats.messages_to_send(conversation_id))

    def request_source(self) -> Any:
        return self.window.chat_actions.request_source()

    def shown_messages(self) -> list[MessageData]:
        return cast("list[MessageData]", self.window.chat.messages())

    # ----------------------------------------------------------------- the chat column
    def show_message(self, data: MessageData) -> None:
        self.window.chat.add_message(data)

    def remove_from(self, data: MessageData) -> None:
        self.window.chat.remove_from(self.window.chat.index_of(data))

    def resume_stream(self, data: MessageData) -> None:
        self.window.chat.resume_stream(data)

    def show_chosen_versions(self) -> None:
        self.window.conversations.show_chosen_versions()

    def conversation_created(self, conversation_id: int, title: str) -> None:
        self.window.conversations.on_created(conversation_id, title)

    def save_failed(self, error: BaseException, what: str) -> None:
        self.window.show_save_error(error, what)

    def notice(self, text: str) -> None:
        self.window.info_banner.action.setVisible(False)
        self.window.info_banner.show_message(text)

    # ----------------------------------------------------------------- the answer in flight
    def answer_started(self, request_id: str, data: MessageData, mode: str, remote: bool) -> None:
        w = self.window
        self.streaming = data
        w.denoise.start(mode)  # a new answer: the view follows its live pass
        w.denoise.set_unavailable(DENOISING_UNAVAILABLE if remote else "")
        w.composer.set_generating(True)
        w.menus.stop_action.setEnabled(True)
        if w.side.currentWidget() is w.tabs and w.tabs.currentWidget() is not w.preview:
            w.tabs.setCurrentWidget(w.denoise)
        w.generationStarted.emit(request_id)
        w.engine_status.refresh()

    def answer_event(self, event: object) -> None:
        """The answer took ``event`` in: repaint it and feed the panels."""
        w = self.window
        if w.prompt_progress.active and isinstance(event, (TextDelta, BlockStep, BlockCommitted)):
            w.prompt_progress.end()  # the prompt is read: the answer has started
            w.engine_status.throttle.request()
        if isinstance(event, TextDelta):
            w.chat.stream_changed()
            w.denoise.add_event(event)  # autoregressive mode shows the token stream
            if event.channel != "thinking" and self.preview_follows is not None \
                    and self.preview_follows is self.streaming:
                self.feed_preview()
        elif isinstance(event, (BlockStep, Finished)):
            w.denoise.add_event(event)
        elif isinstance(event, BlockCommitted):
            w.denoise.add_event(event)
            w.engine_status.throttle.request()
        elif isinstance(event, PromptInfo):
            w.denoise.add_event(event)
            w.prompt_progress.begin(event.prompt_tokens)
            w.engine_status.refresh()  # "Reading your message…" (once per answer)
        elif isinstance(event, PrefillProgress):
            w.prompt_progress.set_progress(event)
            w.engine_status.throttle.request()

    def answer_ended(self, request_id: str, reason: str, data: MessageData) -> None:
        w = self.window
        preview = self.html_preview()
        if preview is not None and self.preview_follows is not None and self.preview_follows is data:
            self.feed_preview()  # the final text (Finished's, when it differs from the deltas)
            preview.flush()
        self.preview_follows = None
        self.streaming = None
        w.prompt_progress.end()
        w.chat.end_stream()
        w.long_chats.throttle.request()  # the chat grew: count it again
        w.composer.set_generating(False)
        w.menus.stop_action.setEnabled(False)
        w.conversations.reload()
        w.engine_status.refresh()
        w.chat_actions.read_ahead_timer.start()
        w.generationFinished.emit(request_id, reason)

    # ----------------------------------------------------------------- the preview
    def html_preview(self) -> HtmlPreview | None:
        return cast("HtmlPreview | None", self.window.preview)

    def on_preview_requested(self, request: PreviewRequest) -> None:
        preview = self.html_preview()
        if preview is None:
            return
        streaming = self.streaming is not None and request.message is self.streaming
        self.preview_follows = request.message if streaming and request.block is None else None
        preview.set_html(request.html, request.document_id)
        preview.flush()
        self.window.show_panel(self.window.preview)

    def feed_preview(self) -> None:
        """Hand the followed answer's page so far to the preview (throttled there)."""
        data, preview = self.preview_follows, self.html_preview()
        if data is None or preview is None:
            return
        html = self.window.chat.extract_html(data.content)
        if html is not None:
            preview.set_html(html, preview_document_id(data))
