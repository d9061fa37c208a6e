"""Notices across the top of the chat: a one-line banner with an action (engine stopped, an error, a failed save)
and the model-loading progress with Cancel."""

from __future__ import annotations

import time
from collections.abc import Callable

from PySide6.QtCore import QTimer, Signal
from PySide6.QtGui import QHideEvent
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QProgressBar, QPushButton, QVBoxLayout, QWidget

from clover_desk.engine.decode.events import LoadProgress
from clover_desk.ui.theme import set_style_class
from clover_desk.ui.widgets import ElidedLabel, accessible

GIB = 1024**3

STAGES = {"reading": "Reading weights", "quantizing": "Quantizing", "writing-cache": "Writing cache",
          "placing": "Placing on the GPU", "done": "Loaded",
          # engine.decode.events.COMPILE_STAGES: the event's ``current`` (the detail) says which warm-up runs, or why not
          "compiling-ar": "Compiling the layers", "compiling-diffusion": "Compiling the layers",
          "compile-skipped": "Not compiling"}


class Banner(QFrame):
    """A notice across the chat with an optional action button and a close button."""

    actionClicked = Signal()  # the banner's action (e.g. "Restart engine")

    def __init__(self, object_name: str, action_text: str = "", what: str = "Notice",
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName(object_name)
        self.label = QLabel()
        self.label.setWordWrap(True)
        accessible(self.label, what)
        self.action = QPushButton(action_text)
        self.action.setObjectName(f"{object_name}Action")
        set_style_class(self.action, "primary")
        accessible(self.action, action_text or what)
        self.action.setVisible(bool(action_text))
        self.close_button = QPushButton("✕")
        self.close_button.setObjectName(f"{object_name}Close")
        set_style_class(self.close_button, "ghost")
        self.close_button.setFixedWidth(30)
        self.close_button.setToolTip("Dismiss")
        accessible(self.close_button, f"Dismiss {what.lower()}")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(14, 8, 8, 8)
        layout.addWidget(self.label, 1)
        layout.addWidget(self.action)
        layout.addWidget(self.close_button)
        self.action.clicked.connect(self.actionClicked)
        self.close_button.clicked.connect(self.hide)
        self.hide()

    def set_action(self, text: str) -> None:
        self.action.setText(text)
        accessible(self.action, text)

    def show_message(self, text: str) -> None:
        self.label.setText(text)
        if self.action.text():
            accessible(self.action, self.action.text())
        self.show()


class LoadBanner(QFrame):
    """Model loading progress with a Cancel button."""

    cancelRequested = Signal()  # stop loading the model

    def __init__(self, parent: QWidget | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(parent)
        self.setObjectName("loadBanner")
        self.clock = clock
        self._busy: tuple[str, str, float] | None = None  # (stage, detail, since) of a stage with no byte counts
        self.ticker = QTimer(self)  # a warm-up says nothing for minutes: its elapsed time runs on each second
        self.ticker.setInterval(1000)
        self.ticker.timeout.connect(self.on_tick)
        self.label = QLabel("Loading model…")
        self.detail = ElidedLabel("", "muted")
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.bar.setFixedHeight(8)
        accessible(self.bar, "Model loading progress")
        self.cancel = QPushButton("Cancel")
        self.cancel.setObjectName("cancelLoad")
        accessible(self.cancel, "Cancel loading the model")
        top = QHBoxLayout()
        top.addWidget(self.label)
        top.addWidget(self.detail, 1)
        top.addWidget(self.cancel)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(14, 8, 10, 10)
        layout.addLayout(top)
        layout.addWidget(self.bar)
        self.cancel.clicked.connect(self.cancelRequested)
        self.hide()

    def set_progress(self, event: LoadProgress) -> None:
        stage = STAGES.get(event.stage, event.stage)
        self.label.setText(f"{stage}…" if event.stage != "done" else stage)
        if event.total_bytes > 0:
            self.bar.setRange(0, 1000)
            self.bar.setValue(int(1000 * event.done_bytes / event.total_bytes))
            detail = f"{event.done_bytes / GIB:.1f} / {event.total_bytes / GIB:.1f} GiB"
            if event.eta_s:
                detail += f" · {int(event.eta_s)} s left"
            self.detail.setText(detail)
            self._busy = None
            self.ticker.stop()
        else:
            self.bar.setRange(0, 0)  # busy indicator
            if self._busy is None or self._busy[:2] != (event.stage, event.current):
                self._busy = (event.stage, event.current, self.clock())
            self.on_tick()
            if event.stage != "done":
                self.ticker.start()
        self.show()

    def on_tick(self) -> None:
        """The busy stage's detail after the time it has run ("2 min 05 s · …": first, so eliding keeps it),
        refreshed every second."""
        if self._busy is None:
            return
        stage, current, since = self._busy
        seconds = int(self.clock() - since)
        elapsed = f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"
        self.detail.setText(f"{elapsed} · {current}" if current and stage != "done" else current)

    def hideEvent(self, event: QHideEvent) -> None:  # noqa: N802 (Qt override)
        self.ticker.stop()
        self._busy = None
        super().hideEvent(event)
