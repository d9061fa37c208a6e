"""Render the app icon's PNG sizes from its SVG (Qt's SVG renderer, headless).

    python packaging/make_icons.py [--check]

Reads ``assets/icons/clover-desk.svg`` and writes ``assets/icons/clover-desk-<N>.png`` for every size in
:data:`SIZES` (transparent background, square). ``--check`` writes nothing and exits 1 when a PNG is missing or has
the wrong size (re-run without it after editing the SVG). Bad arguments: one line, exit 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ICONS = ROOT / "assets" / "icons"
SVG = ICONS / "clover-desk.svg"
SIZES = (16, 32, 48, 64, 128, 256, 512)


def png_path(size: int) -> Path:
    return ICONS / f"clover-desk-{size}.png"


def render(svg: Path, size: int, out: Path) -> None:
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise SystemExit(f"make_icons: {svg} is not an SVG Qt can render")
    image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform)
    renderer.render(painter)
    painter.end()
    if not image.save(str(out), "PNG"):
        raise SystemExit(f"make_icons: cannot write {out}")


def check() -> list[str]:
    """What is wrong with the PNGs now (empty: all present at their sizes)."""
    from PySide6.QtGui import QImage

    problems = []
    for size in SIZES:
        path = png_path(size)
        image = QImage(str(path))
        if image.isNull():
            problems.append(f"{path.relative_to(ROOT)} is missing or unreadable")
        elif (image.width(), image.height()) != (size, size):
            problems.append(f"{path.relative_to(ROOT)} is {image.width()}x{image.height()}, not {size}x{size}")
    return problems


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        print(f"make_icons: unknown arguments {' '.join(argv)!r}; the only option is --check", file=sys.stderr)
        return 2
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtGui import QGuiApplication

    app = QGuiApplication.instance() or QGuiApplication([sys.argv[0]])  # noqa: F841 - QImage/QPainter need one
    if argv == ["--check"]:
        problems = check()
        for line in problems:
            print(f"make_icons: {line}", file=sys.stderr)
        return 1 if problems else 0
    for size in SIZES:
        render(SVG, size, png_path(size))
        print(f"wrote {png_path(size).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
