"""The message box under the chat: the text, the Think switch, Attach, and one button that is Send (or Stop while an
answer streams). Send is disabled, with the reason shown beside it, while the engine cannot answer (starting,
loading, stopped): the typed text stays in the box and goes once the model is ready. Text files attached (the
button, or dropped or pasted on the box) go into the message as fenced blocks (:mod:`ui.attachments`)."""

from __future__ import annotations

from PySide6.QtCore import QEvent, QMimeData, Qt, Signal
from PySide6.QtGui import QKeyEvent, QKeySequence
from PySide6.QtWidgets import (
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from clover_desk.ui.attachments import LANGUAGES, AttachmentError, read_attachment
from clover_desk.ui.chat_view import MessageData
from clover_desk.ui.theme import set_style_class
from clover_desk.ui.widgets import accessible, push_button

ATTACH_FILTERS = ("Text files (" + " ".join(f"*{ext}" for ext in sorted({".txt", ".log", *LANGUAGES})) + ")",
                  "All files (*)")


def ask_open_paths(parent: QWidget) -> list[str]:
    """The file dialog of Attach (a seam: tests replace it). Returns the files chosen (none: cancelled)."""
    paths, _ = QFileDialog.getOpenFileNames(parent, "Attach text files", "", ";;".join(ATTACH_FILTERS))
    return list(paths)


def local_files(mime: QMimeData) -> list[str]:
    """The local files a drop or a paste carries (none when it carries anything else, e.g. a web link)."""
    if not mime.hasUrls():
        return []
    urls = mime.urls()
    return [u.toLocalFile() for u in urls] if urls and all(u.isLocalFile() for u in urls) else []


class PromptEdit(QPlainTextEdit):
    """The message box: Enter sends, Shift+Enter adds a line, Esc stops (or cancels an edit).

    The window's own shortcuts win over the text box's editing keys where they collide (Ctrl+K is also "delete to
    the end of the line", Ctrl+E "end of line" on Linux): :meth:`set_window_shortcuts` names them."""

    submitted = Signal()  # Enter pressed: send the text
    escapePressed = Signal()  # Esc pressed: stop the generation / leave edit mode
    filesDropped = Signal(list)  # local file paths dropped or pasted on the box: to attach

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._window_keys: set[int] = set()

    def set_window_shortcuts(self, sequences: list[QKeySequence]) -> None:
        """Single-chord shortcuts of the window that this box must not swallow."""
        self._window_keys = {seq[0].toCombined() for seq in sequences if seq.count() == 1}

    def window_shortcuts(self) -> list[QKeySequence]:
        return [QKeySequence(key) for key in sorted(self._window_keys)]

    def event(self, event: QEvent) -> bool:
        if event.type() == QEvent.Type.ShortcutOverride and isinstance(event, QKeyEvent):
            if event.keyCombination().toCombined() in self._window_keys and event.key() != Qt.Key.Key_Escape:
                event.ignore()  # not ours: the window's shortcut runs
                return True
        return super().event(event)

    def canInsertFromMimeData(self, source: QMimeData) -> bool:  # noqa: N802
        return bool(local_files(source)) or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source: QMimeData) -> None:  # noqa: N802
        files = local_files(source)
        if files:
            self.filesDropped.emit(files)  # the files' text, not their paths
        else:
            super().insertFromMimeData(source)

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
            else:
                self.submitted.emit()
            return
        if event.key() == Qt.Key.Key_Escape:
            self.escapePressed.emit()
            return
        super().keyPressEvent(event)


class Composer(QFrame):
    """Input box with the Think switch (the chat's setting, the same one as in the settings drawer) and the
    Send / Stop button."""

    sendRequested = Signal(str)  # text to send (already stripped, never empty)
    stopRequested = Signal()  # stop the running generation
    editCancelled = Signal()  # the user left edit mode without sending
    thinkToggled = Signal(bool)  # the user switched Think (the window saves it with the chat)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("composerBox")
        self.generating = False
        self.blocked_reason = ""  # why Send is disabled now ("" when it is not)
        self.editing: MessageData | None = None
        self.input = PromptEdit()
        self.input.setObjectName("composer")
        self.input.setPlaceholderText("Message Clover…  (Enter sends, Shift+Enter adds a line)")
        self.input.setFixedHeight(72)
        self.input.setTabChangesFocus(True)  # Tab moves on (to Think, Send): keyboard-only use
        accessible(self.input, "Message", "Type a message; Enter sends it, Shift+Enter adds a line, Esc stops")
        self.edit_note = QLabel()
        set_style_class(self.edit_note, "warnText")
        self.edit_note.setWordWrap(True)
        self.edit_note.setVisible(False)
        self.attach_note = QLabel()  # why a file was not attached
        self.attach_note.setObjectName("attachNote")
        set_style_class(self.attach_note, "warnText")
        self.attach_note.setWordWrap(True)
        self.attach_note.setVisible(False)
        accessible(self.attach_note, "Files not attached")
        self.attach_button = push_button(
            "Attach", "attachButton", style="chip", name="Attach text files", clicked=self.on_attach_clicked,
            tip="Add text files (code, Markdown, HTML, CSV) to the message; dropping them on the box works too",
        )
        self.think_button = push_button(
            "Think", "thinkToggle", style="chip", checked=True, name="Think before answering",
            tip="Let the model think before answering (saved with this chat, as in Settings)", toggled=self.thinkToggled,
        )
        self.mode_label = QLabel()
        set_style_class(self.mode_label, "faint")
        self.blocked_label = QLabel("")  # wraps: cut to "Send works once it is re…" it said too little
        set_style_class(self.blocked_label, "muted")
        self.blocked_label.setTextFormat(Qt.TextFormat.PlainText)
        self.blocked_label.setWordWrap(True)
        self.blocked_label.setObjectName("sendBlockedReason")
        accessible(self.blocked_label, "Why Send is unavailable")
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("sendButton")
        self.send_button.setProperty("generating", False)
        self.send_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.send_button.setMinimumWidth(72)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 8)
        layout.setSpacing(4)
        layout.addWidget(self.edit_note)
        layout.addWidget(self.input)
        layout.addWidget(self.attach_note)
        row = QHBoxLayout()
        self._row = row
        row.addWidget(self.think_button)
        row.addWidget(self.attach_button)
        row.addWidget(self.mode_label)
        row.addSpacing(6)
        row.addWidget(self.blocked_label, 1)
        row.addStretch(0)  # takes the room only while the reason is hidden (the label has stretch 1)
        row.addWidget(self.send_button)
        layout.addLayout(row)
        self._refresh_button()
        self._connect_signals()

    def _connect_signals(self) -> None:
        self.input.submitted.connect(self.on_submit)
        self.input.escapePressed.connect(self.on_escape)
        self.send_button.clicked.connect(self.on_send_clicked)
        self.input.filesDropped.connect(self.attach_files)
        self.input.textChanged.connect(self.on_text_changed)

    def add_status_widget(self, widget: QWidget) -> None:
        """A small status (the context meter) on the button row, just before Send."""
        self._row.insertWidget(self._row.indexOf(self.send_button), widget)

    # -- state
    def set_generating(self, on: bool) -> None:
        self.generating = on
        self._refresh_button()

    def set_blocked(self, reason: str) -> None:
        """Disable Send and say why (``reason``), or enable it again (``""``). Stop is never blocked."""
        self.blocked_reason = reason
        self._refresh_button()

    def can_send(self) -> bool:
        return not self.generating and not self.blocked_reason

    def _refresh_button(self) -> None:
        button = self.send_button
        button.setText("Stop" if self.generating else "Send")
        accessible(button, "Stop generating" if self.generating else "Send message")
        tip = "Stop the answer (Esc)" if self.generating else self.blocked_reason or "Send the message (Enter)"
        button.setToolTip(tip)
        button.setEnabled(self.generating or not self.blocked_reason)
        self.blocked_label.setText("" if self.generating else self.blocked_reason)
        self.blocked_label.setVisible(bool(self.blocked_reason) and not self.generating)
        if button.property("generating") != self.generating:
            button.setProperty("generating", self.generating)
            button.style().unpolish(button)
            button.style().polish(button)

    def begin_edit(self, data: MessageData) -> None:
        self.editing = data
        self.input.setPlainText(data.content)
        self.edit_note.setText("Editing a message: Enter resends it (later messages are replaced), Esc cancels")
        self.edit_note.setVisible(True)
        self.input.setFocus()

    def end_edit(self) -> None:
        self.editing = None
        self.edit_note.setVisible(False)

    def attach_files(self, paths: list[str]) -> int:
        """Put the text of each file at the cursor, as fenced blocks; say in one line per file which could not be
        attached and why. Returns how many were."""
        blocks, errors = [], []
        for path in paths:
            try:
                blocks.append(read_attachment(path))
            except AttachmentError as exc:
                errors.append(str(exc))
        self.attach_note.setText("\n".join(errors))
        self.attach_note.setVisible(bool(errors))
        if blocks:
            cursor = self.input.textCursor()
            before = self.input.toPlainText()[: cursor.position()]
            gap = 0 if not before.strip() else 2 - (len(before) - len(before.rstrip("\n")))  # a blank line before
            cursor.insertText("\n" * max(0, gap) + "\n".join(blocks))
            self.input.setTextCursor(cursor)  # after what was inserted
            self.input.setFocus()
        return len(blocks)

    # -- slots
    def on_attach_clicked(self) -> None:
        paths = ask_open_paths(self)
        if paths:
            self.attach_files(paths)

    def on_text_changed(self) -> None:
        if not self.input.toPlainText() and self.attach_note.isVisible():
            self.attach_note.setVisible(False)  # sent (or cleared): the note was about that message

    def on_send_clicked(self) -> None:
        if self.generating:
            self.stopRequested.emit()
        else:
            self.on_submit()

    def on_submit(self) -> None:
        if not self.can_send():
            return  # the text stays in the box; the reason is shown beside Send
        text = self.input.toPlainText().strip()
        if not text:
            return
        self.sendRequested.emit(text)  # the window clears the box once the message is saved (kept if not)

    def on_escape(self) -> None:
        if self.generating:
            self.stopRequested.emit()
        elif self.editing is not None:
            self.end_edit()
            self.input.clear()
            self.editCancelled.emit()
