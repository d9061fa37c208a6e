"""Colours, fonts and the application style sheet (dark theme).

One palette, used both by the QSS in ``assets/style.qss`` (through ``@name`` placeholders) and by the custom
painted widgets (denoising view, VRAM bar), so every surface shares the same colours.
"""

from __future__ import annotations

import logging
import importlib.util
from pathlib import Path

from PySide6.QtGui import QColor, QFont, QFontDatabase, QIcon, QPalette
from PySide6.QtWidgets import QApplication

log = logging.getLogger(__name__)

def _assets_dir() -> Path:
    """The repository's assets/ folder, or the installed ``clover_desk_assets`` data package (a wheel install)."""
    source = Path(__file__).resolve().parent.parent / "assets"
    if source.is_dir():
        return source
    spec = importlib.util.find_spec("clover_desk_assets")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return source  # missing: callers log and fall back to Qt's defaults


ASSETS = _assets_dir()

COLORS: dict[str, str] = {
    "bg": "#111318",  # window background
    "surface": "#171a21",  # panels, sidebar
    "surface2": "#1f232c",  # cards, inputs
    "surface3": "#2a2f3a",  # hover, pressed
    "border": "#2c313c",
    "text": "#e7e9ee",
    "muted": "#8d96a7",
    "faint": "#5d6574",
    "accent": "#46c98b",  # clover green
    "accent_dim": "#2c7d58",
    "accent2": "#6ea8fe",  # blue: links, committed-earlier cells
    "warn": "#f2b544",
    "danger": "#ef6161",
    "user_bubble": "#1d2a3a",
    "code_bg": "#0c0e12",
    "mask": "#343a46",
    # VRAM bar segments
    "seg_non_expert": "#6ea8fe",
    "seg_resident": "#46c98b",
    "seg_slots": "#b98cf7",
    "seg_kv": "#f2b544",
    "seg_state": "#e38b5a",
    "seg_workspace": "#8d96a7",
    "seg_reserve": "#4a5160",
}


def color(name: str) -> QColor:
    return QColor(COLORS[name])


def confidence_color(conf: float) -> QColor:
    """Red (unsure) → amber → green (sure), as in the LLaDA demo's scale but continuous."""
    c = max(0.0, min(1.0, conf))
    stops = ((0.0, (239, 97, 97)), (0.6, (242, 181, 68)), (1.0, (70, 201, 139)))
    for (x0, c0), (x1, c1) in zip(stops, stops[1:]):
        if c <= x1:
            t = (c - x0) / (x1 - x0) if x1 > x0 else 0.0
            return QColor(*(round(a + (b - a) * t) for a, b in zip(c0, c1)))
    return QColor(*stops[-1][1])


def stylesheet() -> str:
    """``assets/style.qss`` with ``@name`` replaced by palette colours (longest names first)."""
    text = (ASSETS / "style.qss").read_text(encoding="utf-8")
    for name in sorted(COLORS, key=len, reverse=True):
        text = text.replace("@" + name, COLORS[name])
    return text.replace("@icons", (ASSETS / "icons").as_posix())


def icon(name: str) -> QIcon:
    path = ASSETS / "icons" / f"{name}.svg"
    if not path.exists():
        log.warning("missing icon %s", path)
        return QIcon()
    return QIcon(str(path))


def mono_font(point_size: float = 10.0) -> QFont:
    font = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
    font.setPointSizeF(point_size)
    return font


def apply_theme(app: QApplication) -> None:
    """Fusion style, a dark palette (for dialogs and native bits) and the style sheet."""
    app.setStyle("Fusion")
    pal = QPalette()
    roles = {
        QPalette.ColorRole.Window: "bg",
        QPalette.ColorRole.WindowText: "text",
        QPalette.ColorRole.Base: "surface2",
        QPalette.ColorRole.AlternateBase: "surface",
        QPalette.ColorRole.Text: "text",
        QPalette.ColorRole.Button: "surface2",
        QPalette.ColorRole.ButtonText: "text",
        QPalette.ColorRole.Highlight: "accent_dim",
        QPalette.ColorRole.HighlightedText: "text",
        QPalette.ColorRole.ToolTipBase: "surface3",
        QPalette.ColorRole.ToolTipText: "text",
        QPalette.ColorRole.PlaceholderText: "faint",
        QPalette.ColorRole.Link: "accent2",
    }
    for role, name in roles.items():
        pal.setColor(role, color(name))
    app.setPalette(pal)
    font = app.font()
    if font.pointSizeF() < 10:
        font.setPointSizeF(10)
        app.setFont(font)
    app.setStyleSheet(stylesheet())
