"""Qt helpers for fixtures: a widget shown for a test and destroyed at once afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

from PySide6.QtCore import QCoreApplication, QEvent
from PySide6.QtWidgets import QWidget

W = TypeVar("W", bound=QWidget)


def shown(widget: W, width: int, height: int) -> Iterator[W]:
    """Show ``widget`` at ``width`` x ``height`` while the caller holds it (``yield from`` in a fixture); then close
    it and destroy it at once, while the QApplication is alive (a QtWebEngine page must go before its profile, and
    both before the application)."""
    widget.resize(width, height)
    widget.show()
    yield widget
    widget.close()
    widget.deleteLater()
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete.value)
