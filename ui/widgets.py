"""Small shared widgets and helpers: a label that elides instead of widening the window, one whose wrapped text sets
its height, accessible names, buttons made and wired in one place, one slot for several signals, box layouts built
from one list of what they hold."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from PySide6.QtCore import QCoreApplication, QEvent, QObject, QSize, QStandardPaths, Qt, QTimer, SignalInstance
from PySide6.QtGui import QResizeEvent
from PySide6.QtWidgets import (
    QAbstractScrollArea,
    QAbstractSpinBox,
    QBoxLayout,
    QComboBox,
    QHBoxLayout,
    QLabel,
    QLayout,
    QPushButton,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from clover_desk.ui.theme import set_style_class

W = TypeVar("W", bound=QWidget)
B = TypeVar("B", bound=QBoxLayout)
Slot = Callable[..., object] | SignalInstance  # what a signal connects to: a callable, or a signal it relays to
# What a box holds: a widget or a nested layout, with its stretch factor when given as (item, stretch).
BoxItem = QWidget | QLayout | tuple[QWidget | QLayout, int]
Margins = tuple[int, int, int, int]  # left, top, right, bottom


class ElidedLabel(QLabel):
    """One line of text that is cut with "…" when there is no room (the full text is in the tooltip), so a long
    chat title or GPU name never sets the window's minimum width. ``text()`` is the full text."""

    def __init__(self, text: str = "", style_class: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._full = ""
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)
        self.setTextFormat(Qt.TextFormat.PlainText)
        if style_class:
            set_style_class(self, style_class)
        self.setText(text)

    def setText(self, text: str) -> None:  # noqa: N802 (Qt name)
        self._full = text
        self._elide()
        self.updateGeometry()

    def text(self) -> str:
        return self._full

    def sizeHint(self) -> QSize:  # noqa: N802
        hint = super().sizeHint()
        margins = self.contentsMargins()
        width = self.fontMetrics().horizontalAdvance(self._full) + margins.left() + margins.right() + 4
        return QSize(width, hint.height())

    def minimumSizeHint(self) -> QSize:  # noqa: N802
        return QSize(min(48, self.sizeHint().width()), super().minimumSizeHint().height())

    def resizeEvent(self, event: QResizeEvent) -> None:  # noqa: N802
        super().resizeEvent(event)
        self._elide()

    def _elide(self) -> None:
        room = max(0, self.contentsRect().width())
        shown = self.fontMetrics().elidedText(self._full, Qt.TextElideMode.ElideRight, room) if room else self._full
        super().setText(shown)
        self.setToolTip(self._full if shown != self._full else "")

    def is_elided(self) -> bool:
        return super().text() != self._full


class WrapLabel(QLabel):
    """Word-wrapped text whose height is what its width needs. A plain wrapped QLabel in a form row is given the
    height of its preferred (narrow) width, several empty lines' worth of gap under the text at the width it gets."""

    def __init__(self, text: str = "", parent: QWidget | None = None) -> None:
        super().__init__(text, parent)
        self.setWordWrap(True)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Minimum)

    def _fit(self, hint: QSize) -> QSize:
        if self.width() > 0 and self.text():
            return QSize(hint.width(), self.heightForWidth(self.width()))
        return hint

    def sizeHint(self) -> QSize:  # noqa: N802
        return self._fit(super().sizeHint())

    def minimumSizeHint(self) -> QSize:  # noqa: N802
        return self._fit(super().minimumSizeHint())

    def setText(self, text: str) -> None:  # noqa: N802 (Qt name)
        super().setText(text)
        self.updateGeometry()

    def resizeEvent(self, event: QResizeEvent) -> None:  # noqa: N802
        super().resizeEvent(event)
        if event.size().width() != event.oldSize().width():
            self.updateGeometry()  # the height follows the new width at the layout's next pass


def documents_dir() -> Path:
    """The user's Documents folder (home when the platform has none): where save dialogs start the first time."""
    location = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation)
    return Path(location) if location else Path.home()


def accessible(widget: QWidget, name: str, description: str = "") -> QWidget:
    """Set ``widget``'s accessible name (and description): what a screen reader says for it."""
    widget.setAccessibleName(name)
    if description:
        widget.setAccessibleDescription(description)
    return widget


def named(widget: W, object_name: str, name: str, tip: str = "") -> W:
    """``widget`` with its object name (for styles and tests), its accessible name and, if given, its tooltip."""
    widget.setObjectName(object_name)
    accessible(widget, name)
    if tip:
        widget.setToolTip(tip)
    return widget


def spread_row(left: QWidget, right: QWidget) -> QHBoxLayout:
    """A row with ``left`` at its start and ``right`` at its end (a stretch takes the room between them)."""
    row = QHBoxLayout()
    row.addWidget(left)
    row.addStretch(1)
    row.addWidget(right)
    return row


def _fill(box: B, items: tuple[BoxItem, ...], margins: Margins, spacing: int | None) -> B:
    box.setContentsMargins(*margins)
    if spacing is not None:
        box.setSpacing(spacing)
    for item in items:
        thing, stretch = item if isinstance(item, tuple) else (item, 0)
        if isinstance(thing, QLayout):
            box.addLayout(thing, stretch)
        else:
            box.addWidget(thing, stretch)
    return box


def vbox(*items: BoxItem, margins: Margins = (0, 0, 0, 0), spacing: int | None = None,
         parent: QWidget | None = None) -> QVBoxLayout:
    """A column of ``items`` top to bottom (set on ``parent`` when given); more can be added to it afterwards."""
    return _fill(QVBoxLayout(parent) if parent is not None else QVBoxLayout(), items, margins, spacing)


def hbox(*items: BoxItem, margins: Margins = (0, 0, 0, 0), spacing: int | None = None,
         parent: QWidget | None = None) -> QHBoxLayout:
    """A row of ``items`` left to right (set on ``parent`` when given)."""
    return _fill(QHBoxLayout(parent) if parent is not None else QHBoxLayout(), items, margins, spacing)


def connect_each(slot: Slot, *signals: SignalInstance) -> None:
    """Connect every one of ``signals`` to ``slot``: the several edits that mean one thing to a widget, said once."""
    for signal in signals:
        signal.connect(slot)


def push_button(text: str, object_name: str = "", *, style: str = "", checked: bool | None = None, tip: str = "",
                name: str = "", clicked: Slot | None = None, toggled: Slot | None = None) -> QPushButton:
    """A push button made and wired in one place: its object name (for styles and tests), QSS style class, tooltip
    and accessible name where given; ``checked`` (True or False) makes it checkable, in that state. ``clicked`` and
    ``toggled`` are connected last, so setting the initial state calls neither."""
    button = QPushButton(text)
    if object_name:
        button.setObjectName(object_name)
    if style:
        set_style_class(button, style)
    if checked is not None:
        button.setCheckable(True)
        button.setChecked(checked)
    if tip:
        button.setToolTip(tip)
    if name:
        accessible(button, name)
    _wire(button, clicked, toggled)
    return button


def tool_button(parent: QWidget, text: str, tip: str, *, clicked: Slot | None = None,
                toggled: Slot | None = None) -> QToolButton:
    """A short-labelled tool button whose tooltip (and accessible name) tells the whole story; ``toggled`` makes it
    checkable. ``clicked`` / ``toggled`` are connected to it."""
    button = QToolButton(parent)
    button.setText(text)
    button.setToolTip(tip)
    button.setAccessibleName(tip)
    button.setCheckable(toggled is not None)
    _wire(button, clicked, toggled)
    return button


def _wire(button: QPushButton | QToolButton, clicked: Slot | None, toggled: Slot | None) -> None:
    if clicked is not None:
        button.clicked.connect(clicked)
    if toggled is not None:
        button.toggled.connect(toggled)


class PreviewOff(QLabel):
    """The preview tab when the HTML preview cannot run here (as root, Chromium's sandbox cannot): the one line
    saying why, in place of the web view. It takes the pages the window hands a preview and shows none of them."""

    def __init__(self, reason: str, parent: QWidget | None = None) -> None:
        super().__init__(reason[:1].upper() + reason[1:] + ".", parent)
        self.off_reason = reason
        self.setObjectName("previewOff")
        self.setWordWrap(True)
        self.setTextFormat(Qt.TextFormat.PlainText)
        self.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.setMargin(16)
        set_style_class(self, "muted")
        accessible(self, "Preview off", reason)

    def set_html(self, text: str, document_id: str | None = None) -> None:
        """Nothing to show the page in (the HtmlPreview contract)."""

    def flush(self) -> None:
        """Nothing to flush (the HtmlPreview contract)."""


class WheelGuard(QObject):
    """Event filter on the window's combo boxes and spin boxes: the mouse wheel over one that does not have the
    keyboard focus scrolls what is around it (the page) instead of changing the value the pointer happens to pass
    over. Click (or Tab to) the box first and the wheel changes it as before. (Installed on the boxes themselves, not
    on the application: an application-wide Python filter sees every event of every object, QtWebEngine's own and
    objects being destroyed included, and crashed the preview's pages.)

    It also watches the window itself (``root``) and the dialogs it owns: a child added to the window later (a dialog,
    a panel) has its boxes guarded once it is built (on the next turn of the event loop, not while it is still being
    constructed), and a window or dialog being shown guards every box it holds then (boxes added since included)."""

    def __init__(self, root: QWidget) -> None:
        super().__init__(root)
        self.root = root
        self._scan_pending = False

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:  # noqa: N802 (Qt override)
        kind = event.type()
        if kind == QEvent.Type.Wheel:
            return self._on_wheel(watched, event)
        if kind == QEvent.Type.ChildAdded and watched is self.root and not self._scan_pending:
            self._scan_pending = True  # (the child is still being constructed: look at it once it is built)
            QTimer.singleShot(0, self, self.guard_all)
        elif kind == QEvent.Type.Show and isinstance(watched, QWidget):
            guard_boxes(watched, self)
        return False

    def _on_wheel(self, watched: QObject, event: QEvent) -> bool:
        if not isinstance(watched, (QComboBox, QAbstractSpinBox)) or watched.hasFocus():
            return False
        area = watched.parentWidget()
        while area is not None and not isinstance(area, QAbstractScrollArea):
            area = area.parentWidget()
        event.ignore()
        if area is not None:  # (Qt propagates no synthesized wheel event: hand it to the scroll area itself)
            QCoreApplication.sendEvent(area.viewport(), event)
        return True

    def guard_all(self) -> None:
        """Guard every box under the root, and watch the dialogs it owns (they are guarded again when shown)."""
        self._scan_pending = False
        guard_boxes(self.root, self)
        for child in self.root.children():
            if isinstance(child, QWidget) and child.isWindow():
                child.removeEventFilter(self)  # (installed once per dialog)
                child.installEventFilter(self)


def guard_boxes(root: QWidget, guard: WheelGuard) -> None:
    """Install ``guard`` on every combo box and spin box under ``root`` (once each)."""
    for box in [*root.findChildren(QComboBox), *root.findChildren(QAbstractSpinBox)]:
        box.setFocusPolicy(Qt.FocusPolicy.StrongFocus)  # the wheel alone no longer gives them the focus
        box.removeEventFilter(guard)  # (installed once per box)
        box.installEventFilter(guard)


def install_wheel_guard(root: QWidget) -> WheelGuard:
    """Guard every combo box and spin box under ``root``, now and as boxes, panels and dialogs are added later
    (again: the guard already there)."""
    guard = root.findChild(WheelGuard, "wheelGuard")
    if guard is None:
        guard = WheelGuard(root)
        guard.setObjectName("wheelGuard")
        root.installEventFilter(guard)
    guard.guard_all()
    return guard
