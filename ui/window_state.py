"""What the window remembers and how its columns give way: size and position, the splitter and the widths the side
columns return to, the side tab, the panels shown or not, the height of the preview's log under its page, the theme,
and the last export folder.

:class:`WindowState` keeps them in the ``QSettings`` handed to the window (none: nothing is remembered) for
:class:`ui.main_window.MainWindow`, which calls it on start, on close, when the splitter moves or the window
resizes, and from View ▸ Theme.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from PySide6.QtCore import QSettings, QSize
from PySide6.QtWidgets import QApplication

from clover_desk.ui.theme import SCHEMES, apply_theme, current_preference

log = logging.getLogger(__name__)

DEFAULT_SIZE = QSize(1480, 900)
MIN_CHAT_WIDTH = 360
MIN_SIDE_WIDTH = 320
MIN_SIDEBAR_WIDTH = 190
COMFORT_CHAT_WIDTH = 480  # below this the side panel, then the sidebar, give way (down to their minimum + a bit)
PREFERRED_WIDTHS = (260, 460)  # (sidebar, panels) when there is room; see WindowState.fit_splitter


class StateWindowLike(Protocol):
    """What :class:`WindowState` uses of its window (``ui.main_window.MainWindow``)."""

    splitter: Any  # QSplitter: chats | chat | panels
    side: Any  # the right column (panels or settings drawer)
    tabs: Any  # the side tabs
    panel_button: Any
    menus: Any  # ui.window_menus.WindowMenus: .theme_actions
    chat: Any
    denoise: Any
    preview: Any  # the HTML preview (ui.preview.PreviewPane: its log_splitter, the page over the log), or None
    themeChanged: Any  # noqa: N815 - a Qt signal

    def saveGeometry(self) -> Any: ...  # noqa: N802 - Qt's names

    def restoreGeometry(self, geometry: Any) -> bool: ...  # noqa: N802

    def screen(self) -> Any: ...

    def resize(self, size: QSize) -> None: ...


class WindowState:
    """The remembered state of one window, and its theme."""

    def __init__(self, window: StateWindowLike, settings: QSettings | None) -> None:
        self.window = window
        self.settings = settings
        self.preferred_widths = PREFERRED_WIDTHS  # what the side columns return to when there is room
        self.theme_preference = str(self.value("theme", "system"))

    def value(self, key: str, default: Any = None) -> Any:
        return self.settings.value(key, default) if self.settings is not None else default

    def set_value(self, key: str, value: Any) -> None:
        if self.settings is not None:
            self.settings.setValue(key, value)

    # ----------------------------------------------------------------- size, columns, tab
    def restore(self) -> None:
        w = self.window
        geometry = self.value("window/geometry")
        if geometry is None or not w.restoreGeometry(geometry):
            screen = w.screen().availableGeometry() if w.screen() is not None else None
            size = DEFAULT_SIZE
            if screen is not None and screen.width() > 0:
                size = size.boundedTo(QSize(int(screen.width() * 0.92), int(screen.height() * 0.92)))
            w.resize(size)
        splitter = self.value("window/splitter")
        if splitter is not None and w.splitter.restoreState(splitter):
            sizes = w.splitter.sizes()
            self.preferred_widths = (sizes[0], sizes[2])
        preferred = self.value("window/preferredWidths")
        if isinstance(preferred, (list, tuple)) and len(preferred) == 2:
            self.preferred_widths = (int(preferred[0]), int(preferred[1]))
        log = self._preview_log_splitter()
        log_sizes = self.value("window/previewLogSplitter")
        if log is not None and log_sizes is not None:
            log.restoreState(log_sizes)
        tab = self.value("window/sideTab")
        if tab is not None and 0 <= int(tab) < w.tabs.count():
            w.tabs.setCurrentIndex(int(tab))
        panels = self.value("window/panels")
        if panels is not None:
            w.panel_button.setChecked(str(panels).lower() in ("true", "1"))

    def save(self) -> None:
        """Remember size, position, splitter and side tab (called on close)."""
        if self.settings is None:
            return
        w = self.window
        self.set_value("window/geometry", w.saveGeometry())
        self.set_value("window/splitter", w.splitter.saveState())
        self.set_value("window/preferredWidths", list(self.preferred_widths))
        log = self._preview_log_splitter()
        if log is not None:
            self.set_value("window/previewLogSplitter", log.saveState())
        self.set_value("window/sideTab", w.tabs.currentIndex())
        self.set_value("window/panels", w.panel_button.isChecked())
        self.settings.sync()

    def _preview_log_splitter(self) -> Any:
        """The preview's page | log splitter, or None (no preview, or the one-line placeholder of a preview that is
        off)."""
        return getattr(self.window.preview, "log_splitter", None)

    def on_splitter_moved(self, *_args: object) -> None:
        """The user dragged a handle: these are the widths the side columns return to when there is room."""
        sizes = self.window.splitter.sizes()
        if len(sizes) == 3 and sizes[2] > 0:
            self.preferred_widths = (sizes[0], sizes[2])

    def fit_splitter(self) -> None:
        """Keep the chat at least COMFORT_CHAT_WIDTH wide by narrowing the panels, then the sidebar (a 1,024 px
        window), and give them back their preferred widths when the window grows again."""
        splitter = self.window.splitter
        sizes = splitter.sizes()
        total = sum(sizes)
        if len(sizes) != 3 or total <= 0 or not self.window.side.isVisible():
            return
        pref_bar, pref_side = self.preferred_widths
        room = total - COMFORT_CHAT_WIDTH  # for the sidebar and the panels together
        side = max(MIN_SIDE_WIDTH + 20, min(pref_side, room - (MIN_SIDEBAR_WIDTH + 20)))
        bar = max(MIN_SIDEBAR_WIDTH + 20, min(pref_bar, room - side))
        fitted = [bar, total - bar - side, side]
        if fitted != sizes:
            splitter.setSizes(fitted)

    # ----------------------------------------------------------------- theme
    def apply_theme_preference(self) -> str:
        """Apply the remembered theme ("system" follows the desktop) to the application; returns the palette."""
        app = QApplication.instance()
        if not isinstance(app, QApplication):
            return "dark"
        scheme = apply_theme(app, self.theme_preference)
        self.window.chat.restyle()
        self.window.denoise.canvas.update()
        self.window.themeChanged.emit(scheme)
        return scheme

    def set_theme_preference(self, preference: str) -> None:
        if preference not in SCHEMES:
            raise ValueError(f"theme must be one of {', '.join(SCHEMES)}, got {preference!r}")
        self.theme_preference = preference
        self.set_value("theme", preference)
        self.window.menus.theme_actions[preference].setChecked(True)
        self.apply_theme_preference()

    def on_system_scheme_changed(self, *_args: object) -> None:
        # the application's theme, last set by any window: a window that still says "system" (an older one, or
        # one whose choice another window has since overridden) does not take it back
        if self.theme_preference == "system" and current_preference() == "system":
            self.apply_theme_preference()
