"""The conversation column: messages rendered from Markdown, thinking in a collapsible section, per-message
actions (copy, edit-and-resend, regenerate, preview HTML).

Plain data (:class:`MessageData`, :class:`StreamingReply`) carries the state; the widgets only draw it. While a
reply streams, its widget is re-rendered through one :class:`~ui.throttle.Throttle` (Markdown → HTML of a growing
text is the expensive part), so deltas arriving faster than the screen refreshes cost almost nothing.

A message that contains an HTML document gets a Preview button (an answer's, or a page the user pasted, fenced or
not), the streaming one too, as soon as the document starts (:class:`HtmlWatch` decides that cheaply); the button
asks for the page with a :class:`PreviewRequest`.
"""

from __future__ import annotations

import logging
from typing import Any

from PySide6.QtCore import QSize, Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QGuiApplication, QResizeEvent
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QTextBrowser,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from clover_desk.ui.html_extract import extract_html
from clover_desk.ui.markdown import CodeBlock, RenderedMarkdown, render
from clover_desk.ui.messages import (  # the plain data (re-exported: callers import it from here too)
    CONTINUABLE_REASONS,  # noqa: F401
    HtmlExtractor,
    HtmlWatch,
    MessageData,
    PreviewRequest,
    StreamingReply,  # noqa: F401
    continuable,
    format_seconds,
    preview_document_id,  # noqa: F401
    thinking_only_note,
)
from clover_desk.ui.remote_chat import remote_stats_line
from clover_desk.ui.theme import set_style_class
from clover_desk.ui.throttle import Throttle
from clover_desk.ui.widgets import ElidedLabel, accessible

log = logging.getLogger(__name__)





def stats_details(stats: dict[str, Any]) -> str:
    """The figures behind an answer's stats line (its tooltip): how the prompt was read, what the answer took."""
    if stats.get("backend") == "remote" or not stats.get("tokens"):
        return ""
    lines = []
    if stats.get("prompt_tokens"):
        cached = int(stats.get("cached_tokens") or 0)
        read = f"prompt: {stats['prompt_tokens']:,} tokens"
        if cached:
            read += f", {cached:,} of them already read (the prompt cache)"
        if stats.get("prefill_s") is not None:
            read += f"; the rest read in {float(stats['prefill_s']):.2f} s" if cached else \
                f"; read in {float(stats['prefill_s']):.2f} s"
        lines.append(read)
    answer = f"answer: {stats['tokens']:,} tokens"
    if stats.get("passes"):
        answer += f" in {stats['passes']:,} " + {"diffusion": "passes", "spec": "forwards"}.get(
            stats.get("mode", "diffusion"), "steps")
    if stats.get("decode_s"):
        answer += f", {float(stats['decode_s']):.2f} s"
    lines.append(answer)
    if stats.get("expert_hit_rate") is not None:
        lines.append(f"experts found on the GPU: {100 * float(stats['expert_hit_rate']):.0f}%")
    return "\n".join(lines)


def stats_line(stats: dict[str, Any]) -> str:
    """"42 tokens · 38.5 tok/s · 3.1 tok/pass · stopped" from a Finished-derived stats dict."""
    if stats.get("backend") == "remote":  # a remote server's answer: what it did not report is named unavailable
        return remote_stats_line(stats)
    parts = []
    if stats.get("tokens"):
        parts.append(f"{stats['tokens']} tokens")
    if stats.get("tokens_per_s"):
        parts.append(f"{stats['tokens_per_s']:.1f} tok/s")
    if stats.get("tokens_per_pass") and stats.get("mode", "diffusion") == "diffusion":
        parts.append(f"{stats['tokens_per_pass']:.1f} tok/pass")
    if stats.get("mode") == "spec" and stats.get("verify_passes"):  # self-speculative: AR's tokens, drafted
        parts.append(f"{float(stats.get('accepted_per_verify') or 0):.1f} drafts accepted/verify")
    if stats.get("time_to_first_token_s"):
        parts.append(f"first token {stats['time_to_first_token_s']:.2f} s")
    if stats.get("continued"):
        parts.append("continued" if stats["continued"] == 1 else f"continued {stats['continued']}×")
    reason = stats.get("stop_reason")
    if reason in ("cancelled", "interrupted"):
        parts.append("stopped" if reason == "cancelled" else "interrupted")
    elif reason in ("max_new_tokens", "context"):
        parts.append("hit the token limit" if reason == "max_new_tokens" else "hit the context limit")
    return " · ".join(parts)


# --------------------------------------------------------------------------------------------- widgets


class MarkdownBrowser(QTextBrowser):
    """A read-only rich-text block whose height follows its content (no inner scroll bar)."""

    codeCopied = Signal(int)  # index of the code block copied to the clipboard
    previewRequested = Signal(int, str)  # (index, HTML) of a code block to show in the preview tab

    def __init__(self, style_class: str = "messageBody", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        set_style_class(self, style_class)
        self.setOpenLinks(False)
        self.setReadOnly(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setTextInteractionFlags(
            Qt.TextInteractionFlag.TextBrowserInteraction | Qt.TextInteractionFlag.TextSelectableByKeyboard
        )
        self.document().setDocumentMargin(2)
        self.rendered = RenderedMarkdown("")
        self._source = None  # the Markdown last rendered
        self.document().documentLayout().documentSizeChanged.connect(self.on_size_changed)
        self.anchorClicked.connect(self.on_anchor_clicked)

    def set_markdown(self, text: str, force: bool = False) -> None:
        if text == self._source and not force:
            return
        self._source = text
        self.rendered = render(text)
        self.setHtml(self.rendered.html)

    def rerender(self) -> None:
        """Render the same Markdown again (after a theme change: the HTML carries palette colours)."""
        if self._source is not None:
            self.set_markdown(self._source, force=True)

    def code_blocks(self) -> list[CodeBlock]:
        return self.rendered.code_blocks

    def on_size_changed(self, *_args: object) -> None:
        chrome = max(0, self.height() - self.viewport().height())  # frame and the style sheet's padding
        height = int(self.document().size().height()) + chrome + 2
        if self.height() != height:
            self.setFixedHeight(height)

    def resizeEvent(self, event: QResizeEvent) -> None:  # noqa: N802
        super().resizeEvent(event)
        self.document().setTextWidth(self.viewport().width())
        self.on_size_changed()

    def on_anchor_clicked(self, url: QUrl) -> None:
        scheme = url.scheme()
        if scheme in ("copy", "preview"):
            try:
                block = self.rendered.code_blocks[int(url.path())]
            except (ValueError, IndexError):
                log.warning("bad code block link %s", url.toString())
                return
            if scheme == "copy":
                QGuiApplication.clipboard().setText(block.code)
                self.codeCopied.emit(int(url.path()))
            else:
                self.previewRequested.emit(int(url.path()), block.code)
        elif scheme in ("http", "https", "mailto"):
            QDesktopServices.openUrl(url)


class MessageWidget(QFrame):
    """One message: role + meta line + actions, a collapsible thinking section, the Markdown body."""

    copyRequested = Signal()  # (handled here; emitted for tests and status messages)
    editRequested = Signal(object)  # MessageWidget: the user wants to edit this prompt and resend
    regenerateRequested = Signal(object)  # MessageWidget: answer this prompt again
    continueRequested = Signal(object)  # MessageWidget: go on writing this answer (it was cut short)
    branchRequested = Signal(object)  # MessageWidget: a new chat that starts as this one, up to this message
    previewRequested = Signal(object)  # PreviewRequest: this message's page (or one of its code blocks) to show
    versionRequested = Signal(object, int)  # (MessageWidget, -1 | +1): show its previous / next version

    def __init__(
        self, data: MessageData, html_extractor: HtmlExtractor, expand_thinking: bool = False,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.data = data
        self._extract_html = html_extractor
        self.html_watch = HtmlWatch(html_extractor)  # while streaming: has a document begun yet?
        self._html_checked: tuple[str, bool] | None = None  # (content, has a document) once it stopped streaming
        is_user = data.role == "user"
        set_style_class(self, "message", "user" if is_user else "assistant")
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground, True)

        who = "You" if is_user else "Clover" if data.role == "assistant" else data.role.title()
        self.role_label = QLabel(who)
        set_style_class(self.role_label, "role")
        self.meta_label = ElidedLabel("", "meta")  # the statistics line never widens the chat column
        accessible(self.meta_label, "Statistics")
        self.copy_button = self._action("Copy", "Copy the message as Markdown", f"Copy {who.lower()} message")
        self.edit_button = self._action("Edit", "Edit this message and send it again", "Edit and resend")
        self.regen_button = self._action("Regenerate", "Answer this prompt again (Ctrl+Shift+R)", "Regenerate answer")
        self.continue_button = self._action("Continue", "Let Clover go on writing this answer where it was cut off "
                                            "(Ctrl+Shift+Enter)", "Continue the answer")
        self.branch_button = self._action("Branch", "Start a new chat from this answer: the messages up to it, the "
                                          "same settings (this chat stays as it is)", "Branch the chat from here")
        self.preview_button = self._action("Preview", "Open the HTML this message contains in the preview tab",
                                           "Preview the page")
        self.edit_button.setVisible(is_user)
        self.version_prev = self._action("‹", "Previous version", "Previous version")
        self.version_label = QLabel()
        set_style_class(self.version_label, "meta")
        accessible(self.version_label, "Version")
        self.version_next = self._action("›", "Next version", "Next version")
        self.regen_button.setVisible(False)
        self.continue_button.setVisible(False)
        self.preview_button.setVisible(False)

        self.thinking_toggle = QToolButton()
        set_style_class(self.thinking_toggle, "thinkingToggle")
        accessible(self.thinking_toggle, "Show the thinking")
        self.thinking_toggle.setCheckable(True)
        self.thinking_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.thinking_toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.thinking_body = MarkdownBrowser("thinkingBody")
        accessible(self.thinking_body, "Thinking")
        self.thinking_body.setVisible(False)
        self.body = MarkdownBrowser("messageBody")
        accessible(self.body, f"{who} said")
        self.note = QLabel()  # why an answer is empty (thinking_only_note)
        set_style_class(self.note, "muted")
        self.note.setWordWrap(True)
        self.note.setVisible(False)
        accessible(self.note, "No answer")

        header = QHBoxLayout()
        header.setSpacing(8)
        header.addWidget(self.role_label)
        for w in (self.version_prev, self.version_label, self.version_next):
            header.addWidget(w)
        header.addStretch(1)
        for b in (self.preview_button, self.continue_button, self.regen_button, self.branch_button, self.edit_button,
                  self.copy_button):
            header.addWidget(b)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(14, 10, 14, 10)
        layout.setSpacing(4)
        layout.addLayout(header)
        layout.addWidget(self.thinking_toggle, 0, Qt.AlignmentFlag.AlignLeft)
        layout.addWidget(self.thinking_body)
        layout.addWidget(self.body)
        layout.addWidget(self.note)
        layout.addWidget(self.meta_label)  # under the answer: the header's actions leave it no room at 1,024 px
        self._connect_signals()
        self.thinking_toggle.setChecked(expand_thinking)
        self.refresh()

    def _action(self, text: str, tip: str, name: str) -> QPushButton:
        button = QPushButton(text, self)  # a parent from the start: shown before the layout takes it, a parentless
        #                                   button would flash up as a window of its own (and steal the focus)
        set_style_class(button, "ghost")
        button.setToolTip(tip)
        accessible(button, name)
        button.setCursor(Qt.CursorShape.PointingHandCursor)
        return button

    def _connect_signals(self) -> None:
        self.copy_button.clicked.connect(self.on_copy_clicked)
        self.edit_button.clicked.connect(lambda: self.editRequested.emit(self))
        self.regen_button.clicked.connect(lambda: self.regenerateRequested.emit(self))
        self.continue_button.clicked.connect(lambda: self.continueRequested.emit(self))
        self.branch_button.clicked.connect(lambda: self.branchRequested.emit(self))
        self.version_prev.clicked.connect(lambda: self.versionRequested.emit(self, -1))
        self.version_next.clicked.connect(lambda: self.versionRequested.emit(self, 1))
        self.preview_button.clicked.connect(self.on_preview_clicked)
        self.thinking_toggle.toggled.connect(self.on_thinking_toggled)
        self.body.previewRequested.connect(self.on_block_preview_requested)

    # -- state → widgets
    def refresh(self) -> None:
        d = self.data
        streaming = d.status == "streaming"
        has_thinking = bool(d.thinking.strip())
        self.thinking_toggle.setVisible(has_thinking)
        if has_thinking:
            if streaming and not d.content:
                secs = f" {format_seconds(d.thinking_seconds)}" if d.thinking_seconds else ""
                label = f"Thinking…{secs}"
            elif d.thinking_seconds is not None:
                label = f"Thought for {format_seconds(d.thinking_seconds)}"
            else:
                label = "Thoughts"
            self.thinking_toggle.setText(label)
            if self.thinking_toggle.isChecked():
                self.thinking_body.set_markdown(d.thinking)
        self.thinking_body.setVisible(has_thinking and self.thinking_toggle.isChecked())
        content = d.content
        if streaming and not content and not has_thinking:
            content = "*…*"
        if d.status == "error":
            content = (content + "\n\n" if content else "") + f"**Error:** {d.stats.get('error', 'generation failed')}"
        self.body.set_markdown(content)
        self.body.setVisible(bool(content))
        note = thinking_only_note(d)
        self.note.setText(note)
        self.note.setVisible(bool(note))
        meta = stats_line(d.stats) if d.role == "assistant" else ""
        details = stats_details(d.stats) if d.role == "assistant" else ""
        if streaming:
            meta, details = "generating…", ""
        self.meta_label.setText(meta)
        self.meta_label.setToolTip(details)
        self.meta_label.setVisible(bool(meta))
        self.copy_button.setEnabled(not streaming)
        self.branch_button.setVisible(d.role == "assistant" and not streaming and d.message_id is not None)
        self.preview_button.setVisible(self._has_html())
        self._refresh_versions(streaming)

    def _refresh_versions(self, streaming: bool) -> None:
        """‹ 2/3 › beside the role when this place in the chat has more than one version (none while streaming)."""
        d = self.data
        many = d.versions > 1
        for w in (self.version_prev, self.version_label, self.version_next):
            w.setVisible(many)
        self.version_label.setText(f"{d.version}/{d.versions}")
        self.version_label.setToolTip(f"Version {d.version} of {d.versions}")
        self.version_prev.setEnabled(many and not streaming and d.version > 1)
        self.version_next.setEnabled(many and not streaming and d.version < d.versions)

    def _has_html(self) -> bool:
        d = self.data
        if d.role not in ("assistant", "user"):  # a page the model wrote, or one the user pasted (fenced or not)
            return False
        if d.status == "streaming":
            return self.html_watch.check(d.content)  # cheap: runs the extractor only until a document shows up
        if self._html_checked is None or self._html_checked[0] != d.content:
            self._html_checked = (d.content, self._extract_html(d.content) is not None)
        return self._html_checked[1]

    def set_regenerable(self, on: bool) -> None:
        """The last answer's actions: Regenerate, and Continue when it was cut short."""
        self.regen_button.setVisible(on and self.data.role == "assistant")
        self.continue_button.setVisible(on and continuable(self.data))

    # -- slots
    def on_copy_clicked(self) -> None:
        QGuiApplication.clipboard().setText(self.data.content)
        self.copyRequested.emit()

    def on_preview_clicked(self) -> None:
        html = self._extract_html(self.data.content)
        if html:
            self.previewRequested.emit(PreviewRequest(html, self.data))

    def on_block_preview_requested(self, index: int, html: str) -> None:
        self.previewRequested.emit(PreviewRequest(html, self.data, block=index))

    def on_thinking_toggled(self, shown: bool) -> None:
        self.thinking_toggle.setArrowType(Qt.ArrowType.DownArrow if shown else Qt.ArrowType.RightArrow)
        if shown:
            self.thinking_body.set_markdown(self.data.thinking)
        self.thinking_body.setVisible(shown)


class ChatView(QWidget):
    """A scrolling column of :class:`MessageWidget`; follows the bottom while a reply streams."""

    editRequested = Signal(object)  # MessageData of a user message to edit and resend
    regenerateRequested = Signal(object)  # MessageData of the assistant message to answer again
    continueRequested = Signal(object)  # MessageData of the assistant message to go on with
    branchRequested = Signal(object)  # MessageData of the message a new chat branches from
    versionRequested = Signal(object, int)  # (MessageData, -1 | +1): show the previous / next version of it
    previewRequested = Signal(object)  # PreviewRequest: HTML of a message to show in the preview tab
    copied = Signal(str)  # what was copied ("message" | "code"), for a status-bar note

    def __init__(self, html_extractor: HtmlExtractor | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._extract_html = html_extractor or extract_html
        self.expand_thinking = False  # new messages open their thinking section
        self.widgets: list[MessageWidget] = []
        self._stick_to_bottom = True
        self.scroll = QScrollArea()
        self.scroll.setObjectName("chatScroll")
        self.scroll.setWidgetResizable(True)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.column = QWidget()
        self.column.setObjectName("chatColumn")
        self.column_layout = QVBoxLayout(self.column)
        self.column_layout.setContentsMargins(16, 16, 16, 16)
        self.column_layout.setSpacing(10)
        self.empty = self._empty_state()
        self.column_layout.addWidget(self.empty)
        self.column_layout.addStretch(1)
        self.scroll.setWidget(self.column)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.scroll)
        self.stream_throttle = Throttle(self.on_stream_refresh, 80, self)
        self._streaming: MessageWidget | None = None
        self._connect_signals()

    def _connect_signals(self) -> None:
        bar = self.scroll.verticalScrollBar()
        bar.rangeChanged.connect(self.on_scroll_range_changed)
        bar.valueChanged.connect(self.on_scroll_value_changed)

    def _empty_state(self) -> QWidget:
        box = QWidget()
        lay = QVBoxLayout(box)
        lay.setContentsMargins(0, 60, 0, 0)
        title = QLabel("☘  Clover Desk")
        title.setObjectName("emptyTitle")
        title.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.empty_hint = QLabel(
            "Ask anything. Clover writes 32 tokens at a time, denoising each block in parallel: watch it happen "
            "in the Denoising tab. Enter sends, Shift+Enter adds a line, Esc stops."
        )
        self.empty_hint.setObjectName("emptyHint")
        self.empty_hint.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.empty_hint.setWordWrap(True)  # never wider than the chat column (1,024 px windows)
        self.empty_hint.setMinimumWidth(200)
        lay.addWidget(title)
        lay.addWidget(self.empty_hint)
        return box

    def restyle(self) -> None:
        """The theme changed: render every message again (the Markdown HTML carries palette colours)."""
        for w in self.widgets:
            w.body.rerender()
            w.thinking_body.rerender()

    def extract_html(self, markdown: str) -> str | None:
        """The HTML document in a message's Markdown (the same rule the Preview buttons use), or None."""
        return self._extract_html(markdown)

    # -- content
    def clear(self) -> None:
        for w in self.widgets:
            w.setParent(None)
            w.deleteLater()
        self.widgets.clear()
        self._streaming = None
        self.empty.setVisible(True)

    def set_messages(self, messages: list[MessageData]) -> None:
        self.clear()
        for m in messages:
            self.add_message(m)
        self._stick_to_bottom = True

    def add_message(self, data: MessageData) -> MessageWidget:
        widget = MessageWidget(data, self._extract_html, self.expand_thinking)
        widget.editRequested.connect(self.on_edit_requested)
        widget.regenerateRequested.connect(self.on_regenerate_requested)
        widget.continueRequested.connect(lambda w: self.continueRequested.emit(w.data))
        widget.branchRequested.connect(lambda w: self.branchRequested.emit(w.data))
        widget.versionRequested.connect(lambda w, step: self.versionRequested.emit(w.data, step))
        widget.previewRequested.connect(self.previewRequested)
        widget.copyRequested.connect(lambda: self.copied.emit("message"))
        widget.body.codeCopied.connect(lambda _i: self.copied.emit("code"))
        self.column_layout.insertWidget(self.column_layout.count() - 1, widget)
        widget.show()  # now, not on the next event-loop turn (the layout's deferred show)
        self.widgets.append(widget)
        self.empty.setVisible(False)
        if data.status == "streaming":
            self._streaming = widget
        self._stick_to_bottom = True
        self._update_regenerable()
        return widget

    def set_expand_thinking(self, on: bool) -> None:
        """Open (or close) the thinking section of every message, and of new ones."""
        self.expand_thinking = on
        for w in self.widgets:
            w.thinking_toggle.setChecked(on)

    def remove_from(self, index: int) -> None:
        """Drop messages ``index`` and later (edit-and-resend, regenerate)."""
        for w in self.widgets[index:]:
            w.setParent(None)
            w.deleteLater()
        del self.widgets[index:]
        self.empty.setVisible(not self.widgets)
        self._update_regenerable()

    def index_of(self, data: MessageData) -> int:
        return next(i for i, w in enumerate(self.widgets) if w.data is data)

    def messages(self) -> list[MessageData]:
        return [w.data for w in self.widgets]

    def last_assistant(self) -> MessageWidget | None:
        return next((w for w in reversed(self.widgets) if w.data.role == "assistant"), None)

    # -- streaming
    def resume_stream(self, data: MessageData) -> MessageWidget:
        """Stream into the message that shows ``data`` again (an answer being continued)."""
        widget = self.widgets[self.index_of(data)]
        data.status = "streaming"
        self._streaming = widget
        self._stick_to_bottom = True
        widget.refresh()
        self._update_regenerable()
        return widget

    def stream_changed(self) -> None:
        """The streaming message's data changed; redraw it soon (throttled)."""
        self.stream_throttle.request()

    def end_stream(self) -> None:
        self.stream_throttle.flush()
        if self._streaming is not None:
            self._streaming.refresh()
        self._streaming = None
        self._update_regenerable()

    def on_stream_refresh(self) -> None:
        if self._streaming is not None:
            self._streaming.refresh()

    def _update_regenerable(self) -> None:
        last = self.last_assistant()
        for w in self.widgets:
            w.set_regenerable(w is last and w.data.status != "streaming")

    # -- slots
    def on_edit_requested(self, widget: MessageWidget) -> None:
        self.editRequested.emit(widget.data)

    def on_regenerate_requested(self, widget: MessageWidget) -> None:
        self.regenerateRequested.emit(widget.data)

    def on_scroll_range_changed(self, _lo: int, hi: int) -> None:
        if self._stick_to_bottom:
            self.scroll.verticalScrollBar().setValue(hi)

    def on_scroll_value_changed(self, value: int) -> None:
        bar = self.scroll.verticalScrollBar()
        self._stick_to_bottom = value >= bar.maximum() - 40

    def sizeHint(self) -> QSize:
        return QSize(640, 600)
