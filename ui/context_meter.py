"""The context meter beside the message box ("1,234 / 16,384 tokens") and the choice offered when a message would
not fit (see ``ui.context_window`` for the rules)."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QCommandLinkButton, QDialog, QLabel, QVBoxLayout, QWidget

from clover_desk.ui.theme import set_style_class
from clover_desk.ui.widgets import accessible

WARN_SHARE = 0.8  # the meter turns amber past this share of the room left for the prompt

DROP, SUMMARY, CANCEL = "drop", "summary", "cancel"


def meter_text(tokens: int | None, limit: int | None) -> str:
    """"1,234 / 16,384 tokens"; "– / 16,384 tokens" while counting; "1,234 tokens" without a known context."""
    used = "–" if tokens is None else f"{tokens:,}"
    return f"{used} / {limit:,} tokens" if limit else f"{used} tokens"


class ContextMeter(QLabel):
    """How much of the model's context the chat and the message being typed take."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("contextMeter")
        self.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        accessible(self, "Context used")
        self.tokens: int | None = None
        self.limit: int | None = None
        self.reserve = 0
        self.dropping = False  # over the context, and the chat leaves the oldest turns out to fit
        self.level = "ok"  # ok | warn | over
        self.active = False  # there is a token counter (the window has one to ask)
        self._refresh()

    def set_active(self, on: bool) -> None:
        self.active = on
        self._refresh()

    def set_limit(self, limit: int | None, reserve: int = 0) -> None:
        self.limit, self.reserve = limit, reserve
        self._refresh()

    def set_count(self, tokens: int | None, dropping: bool = False) -> None:
        self.tokens, self.dropping = tokens, dropping
        self._refresh()

    def limit_room(self) -> int:
        """Tokens the chat and the message may take (the context less the answer's room)."""
        return max(0, (self.limit or 0) - self.reserve)

    def _refresh(self) -> None:
        self.setVisible(self.active and (self.tokens is not None or bool(self.limit)))  # nothing known: nothing shown
        text = meter_text(self.tokens, self.limit)
        if self.dropping:
            text += " · oldest left out"
        self.setText(text)
        room = self.limit_room()
        level = "ok"
        if self.tokens is not None and self.limit:
            level = "over" if self.tokens > room else "warn" if self.tokens > WARN_SHARE * room else "ok"
            if level == "over" and self.dropping:
                level = "warn"  # it will fit: the oldest turns go
        self.level = level
        set_style_class(self, {"ok": "faint", "warn": "warnText", "over": "dangerText"}[level])
        if self.limit:
            tip = (f"The chat and your message, as the model reads them: {text}. The model reads at most "
                   f"{self.limit:,} tokens and {self.reserve:,} are kept for the answer.")
            if self.dropping:
                tip += " The oldest messages are no longer sent, as far as needed (they stay in the chat)."
        else:
            tip = "The chat and your message, as the model reads them (the model's context is not known yet)."
        self.setToolTip(tip)


class ContextFullDialog(QDialog):
    """A message does not fit: leave the oldest turns out, or start a new chat carrying a summary, or keep editing.
    Opened window-modal with ``open()``; the answer is :attr:`chosen` (DROP, SUMMARY or CANCEL)."""

    chosen = Signal(str)

    def __init__(self, tokens: int, limit: int, reserve: int, *, message_tokens: int | None = None,
                 can_drop: bool = True, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("contextFullDialog")
        self.setWindowTitle("The chat is longer than the model's context")
        self.setWindowModality(Qt.WindowModality.WindowModal)
        self.answer = CANCEL
        title = QLabel("This message does not fit in the model's context")
        set_style_class(title, "title")
        room = f"{limit:,} tokens, {reserve:,} of them kept for the answer"
        if can_drop:
            text = f"With your message the chat is {tokens:,} tokens; the model reads at most {room}."
        else:
            alone = f"{message_tokens:,} tokens" if message_tokens is not None else "too long"
            text = (f"Your message alone (with the system prompt) is {alone}; the model reads at most {room}. "
                    "Shorten it, or load the model with a longer context (VRAM tab).")
        body = QLabel(text)
        body.setObjectName("contextFullText")
        body.setWordWrap(True)
        self.drop_button = QCommandLinkButton(
            "Leave out the oldest messages",
            "They are no longer sent to the model, oldest first, as far as needed (the system prompt stays). "
            "They stay in this chat.")
        self.drop_button.setObjectName("contextDropOldest")
        self.summary_button = QCommandLinkButton(
            "Start a new chat with a summary",
            "Clover summarizes this chat; a new chat starts from that summary and sends your message.")
        self.summary_button.setObjectName("contextSummarize")
        self.cancel_button = QCommandLinkButton("Keep editing", "Nothing is sent; your message stays in the box.")
        self.cancel_button.setObjectName("contextKeepEditing")
        for button, name in ((self.drop_button, "Leave out the oldest messages"),
                             (self.summary_button, "Start a new chat with a summary"),
                             (self.cancel_button, "Keep editing")):
            accessible(button, name)
        for button in (self.drop_button, self.summary_button, self.cancel_button):
            button.setIcon(QIcon())  # the style's arrow is drawn dark on the dark palette: the titles say enough
        self.drop_button.setVisible(can_drop)
        self.summary_button.setVisible(can_drop)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(20, 18, 20, 16)
        layout.setSpacing(8)
        layout.addWidget(title)
        layout.addWidget(body)
        layout.addSpacing(4)
        layout.addWidget(self.drop_button)
        layout.addWidget(self.summary_button)
        layout.addWidget(self.cancel_button)
        self.setMinimumWidth(460)
        self.drop_button.clicked.connect(lambda: self._choose(DROP))
        self.summary_button.clicked.connect(lambda: self._choose(SUMMARY))
        self.cancel_button.clicked.connect(lambda: self._choose(CANCEL))
        self.rejected.connect(self.on_rejected)

    def _choose(self, answer: str) -> None:
        self.answer = answer
        self.accept()
        self.chosen.emit(answer)

    def on_rejected(self) -> None:  # Esc or the window's close button
        self.answer = CANCEL
        self.chosen.emit(CANCEL)
