"""The strip above the message box while the model reads a long prompt (the prefill), before the answer's first
pass: "Reading your message… 3,072 / 12,288 tokens", a progress bar and Stop.

The engine reports the prefill of a prompt longer than one pass segment by segment (``engine.decode.events.
PrefillProgress``) and checks the cancel flag between segments, so Stop takes effect within one segment. A short
prompt is read in one pass: the strip shows only if that pass takes longer than :data:`SHOW_AFTER_MS`, so a quick
answer never flashes it.
"""

from __future__ import annotations

from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import QFrame, QLabel, QProgressBar, QPushButton, QWidget

from clover_desk.engine.decode.events import PrefillProgress
from clover_desk.ui.theme import set_style_class
from clover_desk.ui.widgets import accessible, hbox, vbox

SHOW_AFTER_MS = 400


def reading_text(done: int | None, total: int) -> str:
    """"Reading your message… 3,072 / 12,288 tokens" (``done`` None: not counted yet)."""
    if done is None:
        return f"Reading your message… {total:,} tokens"
    return f"Reading your message… {done:,} / {total:,} tokens"


class PromptProgress(QFrame):
    """Progress of the prompt's prefill, with a Stop button (the same stop as the composer's Stop and Esc)."""

    stopRequested = Signal()  # stop the generation whose prompt is being read

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("promptProgress")
        self.active = False  # between the prompt's PromptInfo and the answer's first event
        self.done: int | None = None
        self.total = 0
        self.label = QLabel()
        self.label.setObjectName("promptProgressText")
        accessible(self.label, "Reading your message")
        self.bar = QProgressBar()
        self.bar.setObjectName("promptProgressBar")
        self.bar.setTextVisible(False)
        self.bar.setFixedHeight(6)
        accessible(self.bar, "Prompt reading progress")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setObjectName("promptProgressStop")
        set_style_class(self.stop_button, "ghost")
        self.stop_button.setToolTip("Stop before the answer starts (Esc)")
        accessible(self.stop_button, "Stop reading the message")
        top = hbox((self.label, 1), self.stop_button)
        vbox(top, self.bar, margins=(12, 6, 8, 8), spacing=4, parent=self)
        self.show_timer = QTimer(self)
        self.show_timer.setSingleShot(True)
        self.show_timer.setInterval(SHOW_AFTER_MS)
        self.show_timer.timeout.connect(self.on_show_timeout)
        self.stop_button.clicked.connect(self.on_stop_clicked)
        self.hide()

    def begin(self, prompt_tokens: int) -> None:
        """The engine laid out a prompt of ``prompt_tokens`` tokens and starts reading it."""
        self.active = True
        self.done, self.total = None, prompt_tokens
        self.stop_button.setEnabled(True)
        self._refresh()
        self.show_timer.start()

    def set_progress(self, event: PrefillProgress) -> None:
        """A segment was read: show the figures now (a long prompt)."""
        if not self.active:
            self.begin(event.total)
        self.done, self.total = event.done, event.total
        self._refresh()
        self.show_timer.stop()
        self.show()

    def busy(self, text: str) -> None:
        """Other long work of the same kind, without figures (summarizing a chat): ``text``, a busy bar and Stop."""
        self.active = False
        self.show_timer.stop()
        self.label.setText(text)
        self.bar.setRange(0, 0)
        self.stop_button.setEnabled(True)
        self.show()

    def end(self) -> None:
        """The answer started (or the request ended): the strip goes."""
        self.active = False
        self.show_timer.stop()
        self.hide()

    def _refresh(self) -> None:
        self.label.setText(reading_text(self.done, self.total))
        if self.done is None or self.total <= 0:
            self.bar.setRange(0, 0)  # busy: one pass, no figures until it ends
        else:
            self.bar.setRange(0, 1000)
            self.bar.setValue(int(1000 * self.done / self.total))

    def on_show_timeout(self) -> None:
        if self.active:
            self.show()

    def on_stop_clicked(self) -> None:
        self.label.setText("Stopping…")
        self.stop_button.setEnabled(False)
        self.stopRequested.emit()
