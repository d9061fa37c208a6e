"""Colours, fonts and the application style sheet, in a dark and a light palette.

One palette at a time, used both by the QSS in ``assets/style.qss`` (through ``@name`` placeholders) and by the
custom-painted widgets (denoising view, VRAM bar) and the Markdown renderer, which read :data:`COLORS` when they
paint, so every surface shares the same colours. :func:`apply_theme` switches the palette in place: "system"
follows the desktop's colour scheme (``QStyleHints.colorScheme``, Qt 6.5+), "light" and "dark" force one.

Style classes are a dynamic property, not the object name (object names identify widgets for tests and
accessibility tools): ``set_style_class(button, "ghost")`` and ``[class~="ghost"]`` in the QSS.
"""

from __future__ import annotations

import logging
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QFont, QFontDatabase, QIcon, QPalette
from PySide6.QtWidgets import QApplication, QWidget

log = logging.getLogger(__name__)

SCHEMES = ("system", "light", "dark")


def _assets_dir() -> Path:
    """The assets folder beside the ui package: the repository's assets/ (an editable install) or the installed
    ``clover_desk.assets`` data package (a wheel, the bundle), which sit in the same place relative to ui."""
    return Path(__file__).resolve().parent.parent / "assets"


ASSETS = _assets_dir()

# VRAM bar segments: the same in both palettes (they are data colours, legible on either background).
_SEGMENTS = {
    "seg_non_expert": "#6ea8fe",
    "seg_resident": "#46c98b",
    "seg_slots": "#b98cf7",
    "seg_kv": "#f2b544",
    "seg_state": "#e38b5a",
    "seg_workspace": "#8d96a7",
    "seg_reserve": "#4a5160",
}

DARK: dict[str, str] = {
    "bg": "#111318",  # window background
    "surface": "#171a21",  # panels, sidebar
    "surface2": "#1f232c",  # cards, inputs
    "surface3": "#2a2f3a",  # hover, pressed
    "border": "#2c313c",
    "text": "#e7e9ee",
    "muted": "#8d96a7",
    "faint": "#5d6574",
    "accent": "#46c98b",  # clover green
    "accent_hover": "#5bd69b",
    "accent_dim": "#2c7d58",
    "on_accent": "#0b1410",  # text on an accent fill
    "accent_soft": "#193b2b",  # a checked chip
    "accent2": "#6ea8fe",  # blue: links, committed-earlier cells
    "warn": "#f2b544",
    "danger": "#ef6161",
    "danger_hover": "#f27a7a",
    "on_danger": "#1a0b0b",
    "danger_bg": "#3a1a1d",  # the crash banner
    "danger_border": "#6b2a30",
    "info_bg": "#2f2714",  # the info banner
    "info_border": "#5a4a1e",
    "user_bubble": "#1d2a3a",
    "code_bg": "#0c0e12",
    "inline_code": "#f0c987",  # `code` in prose
    "mask": "#343a46",
    # code blocks' syntax colours (ui.highlight)
    "syn_keyword": "#c792ea",
    "syn_string": "#a5d6a7",
    "syn_number": "#f78c6c",
    "syn_comment": "#6f7a8c",
    "syn_function": "#82aaff",
    "syn_builtin": "#ffcb6b",
    "syn_type": "#ffcb6b",
    "syn_constant": "#f78c6c",
    "syn_deleted": "#ef6161",
    "syn_inserted": "#46c98b",
    **_SEGMENTS,
}

LIGHT: dict[str, str] = {
    "bg": "#f6f7f9",
    "surface": "#ffffff",
    "surface2": "#eef0f4",
    "surface3": "#e1e5eb",
    "border": "#d3d8e0",
    "text": "#1b1f27",
    "muted": "#596272",
    "faint": "#8a93a3",
    "accent": "#17915a",
    "accent_hover": "#1ca566",
    "accent_dim": "#9ed9bd",
    "on_accent": "#ffffff",
    "accent_soft": "#dff3e9",
    "accent2": "#2f6bd8",
    "warn": "#a86a00",
    "danger": "#d23f3f",
    "danger_hover": "#e05353",
    "on_danger": "#ffffff",
    "danger_bg": "#fdecec",
    "danger_border": "#f1b9b9",
    "info_bg": "#fff6e0",
    "info_border": "#ecd49a",
    "user_bubble": "#e5eefc",
    "code_bg": "#f1f3f6",
    "inline_code": "#9a4d00",
    "mask": "#dde1e8",
    "syn_keyword": "#8839b8",
    "syn_string": "#2f7d32",
    "syn_number": "#b5501c",
    "syn_comment": "#6b7485",
    "syn_function": "#2456b8",
    "syn_builtin": "#8a5a00",
    "syn_type": "#8a5a00",
    "syn_constant": "#b5501c",
    "syn_deleted": "#c62828",
    "syn_inserted": "#17915a",
    **_SEGMENTS,
}

PALETTES = {"dark": DARK, "light": LIGHT}

# The palette in use: mutated in place by apply_theme, so every reader sees the current colours.
COLORS: dict[str, str] = dict(DARK)
_current = {"scheme": "dark", "preference": "dark"}


def current_scheme() -> str:
    """"light" or "dark": the palette in :data:`COLORS` now."""
    return _current["scheme"]


def current_preference() -> str:
    """The preference last applied to the application ("system" | "light" | "dark"): the theme is the
    application's, so only while it is "system" does a change of the desktop's scheme matter."""
    return _current["preference"]


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


def stylesheet(colors: dict[str, str] | None = None) -> str:
    """``assets/style.qss`` with ``@name`` replaced by palette colours (longest names first)."""
    palette = COLORS if colors is None else colors
    text = (ASSETS / "style.qss").read_text(encoding="utf-8")
    for name in sorted(palette, key=len, reverse=True):
        text = text.replace("@" + name, palette[name])
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


def set_style_class(widget: QWidget, *classes: str) -> None:
    """Give ``widget`` the QSS style classes ``classes`` (``[class~="name"]`` selectors) and re-polish it."""
    value = " ".join(c for c in classes if c)
    if widget.property("class") == value:
        return
    widget.setProperty("class", value)
    style = widget.style()
    style.unpolish(widget)
    style.polish(widget)
    widget.update()


def system_scheme(app: QApplication) -> str:
    """The desktop's colour scheme: "light" or "dark" (dark when the platform does not say)."""
    scheme = app.styleHints().colorScheme()
    return "light" if scheme == Qt.ColorScheme.Light else "dark"


def resolve_scheme(app: QApplication, preference: str) -> str:
    """``preference`` ("system" | "light" | "dark") as the palette to use."""
    if preference in PALETTES:
        return preference
    return system_scheme(app)


def apply_theme(app: QApplication, preference: str = "dark") -> str:
    """Fusion style, the palette for ``preference`` (for dialogs and native bits) and the style sheet. Returns the
    palette applied ("light" | "dark")."""
    scheme = resolve_scheme(app, preference)
    _current["preference"] = preference
    COLORS.clear()
    COLORS.update(PALETTES[scheme])
    _current["scheme"] = scheme
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
        QPalette.ColorRole.Mid: "border",
        QPalette.ColorRole.Dark: "border",
        QPalette.ColorRole.Light: "surface",
    }
    for role, name in roles.items():
        pal.setColor(role, color(name))
    pal.setColor(QPalette.ColorGroup.Disabled, QPalette.ColorRole.Text, color("faint"))
    pal.setColor(QPalette.ColorGroup.Disabled, QPalette.ColorRole.ButtonText, color("faint"))
    pal.setColor(QPalette.ColorGroup.Disabled, QPalette.ColorRole.WindowText, color("faint"))
    app.setPalette(pal)
    font = app.font()
    if font.pointSizeF() < 10:
        font.setPointSizeF(10)
        app.setFont(font)
    app.setStyleSheet(stylesheet())
    return scheme
