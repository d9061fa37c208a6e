"""Coalesce expensive refreshes: many requests, at most one call per interval.

Events from the engine can arrive hundreds of times a second (one ``BlockStep`` per denoising pass, one
``TextDelta`` per committed block). Widgets record the data in a plain model at once and ask a :class:`Throttle`
to repaint; the throttle calls the refresh on the leading edge and then at most once per ``interval_ms``, and
always once more after the last request, so the final state is never lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from PySide6.QtCore import QObject, QTimer


class Throttle(QObject):
    """Call ``func`` at most once every ``interval_ms``; requests in between are merged into one trailing call."""

    def __init__(self, func: Callable[[], None], interval_ms: int, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._func = func
        self._interval_ms = interval_ms
        self._last_call = 0.0  # time.monotonic() of the last call
        self._pending = False
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self.on_timeout)
        self.calls = 0  # how many times func ran (for tests and diagnostics)
        self.requests = 0

    @property
    def interval_ms(self) -> int:
        return self._interval_ms

    def request(self) -> None:
        """Ask for a refresh. Runs now if the last call is older than the interval, otherwise schedules it."""
        self.requests += 1
        if self._timer.isActive():
            self._pending = True
            return
        elapsed_ms = (time.monotonic() - self._last_call) * 1000.0
        if elapsed_ms >= self._interval_ms:
            self._call()
            self._timer.start(self._interval_ms)  # a window in which further requests are merged
        else:
            self._pending = True
            self._timer.start(max(1, int(self._interval_ms - elapsed_ms)))

    def flush(self) -> None:
        """Run a pending refresh now (e.g. when a generation finishes)."""
        if self._pending:
            self._timer.stop()
            self._call()

    def cancel(self) -> None:
        self._pending = False
        self._timer.stop()

    def on_timeout(self) -> None:
        if self._pending:
            self._call()
            self._timer.start(self._interval_ms)

    def _call(self) -> None:
        self._pending = False
        self._last_call = time.monotonic()
        self.calls += 1
        self._func()
