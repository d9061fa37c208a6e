"""``clover-desk preview FILE.html``: open an HTML file in the sandboxed preview (the same view as the chat's).

With ``--screenshot OUT.png`` it waits for the page to load plus ``--wait-ms``, saves a PNG of the pane and
exits 0; this works headless with ``QT_QPA_PLATFORM=offscreen``. Without it, a window opens until closed.
"Loaded" means the load of this document finished: a single-page app that sets ``location.hash`` or calls
``history.replaceState`` while it loads still counts (the pane matches its own load, not the URL). What the sandbox
blocked, and the pane's own errors, are logged as warnings; console lines and answered dialogs with ``-v``.
Exit status 2: the file is missing or unreadable, or the screenshot cannot be written; 1: the page did not load.

The engine's offline switches and the preview scheme are set up by ``ui.preview.register_schemes()`` before the
QApplication exists, exactly as for the GUI.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from clover_desk.cli import flags
from clover_desk.qt_compat import guard_pyside_bool_refcounts  # noqa: F401 (re-exported for callers)

log = logging.getLogger(__name__)

LOAD_TIMEOUT_MS = 60_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE.html", help="the HTML file to show")
    parser.add_argument("--screenshot", metavar="OUT.png", help="save a PNG once the page has loaded, then exit")
    parser.add_argument("--wait-ms", type=flags.integer(0, 60_000), default=500, metavar="N",
                        help="with --screenshot: wait N ms after the page loaded (default 500) for scripts to draw")
    parser.add_argument("--size", default="1024x768", metavar="WxH", help="window size (default 1024x768)")


def _parse_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"clover-desk preview: --size must look like 1024x768, got {text!r}") from None
    return max(w, 100), max(h, 100)


def run(args: argparse.Namespace) -> int:
    path = Path(args.file)
    try:
        html = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        print(f"clover-desk preview: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if args.wait_ms < 0:
        print("clover-desk preview: --wait-ms must be >= 0", file=sys.stderr)
        return 2
    width, height = _parse_size(args.size)
    guard_pyside_bool_refcounts()

    from clover_desk.ui.preview_sandbox import register_schemes  # Qt only when this command runs

    register_schemes()
    from PySide6.QtWidgets import QApplication

    from clover_desk.ui.preview import PreviewPane
    from clover_desk.ui.theme import apply_theme

    app = QApplication.instance() or QApplication([sys.argv[0]])
    apply_theme(app, "system")  # the app's own look (light or dark, as the desktop), not Qt's default style
    pane = PreviewPane()
    try:
        return _show(app, pane, path, html, args, width, height)
    finally:
        _dispose(pane)


def _show(app, pane, path: Path, html: str, args: argparse.Namespace, width: int, height: int) -> int:  # noqa: ANN001
    from PySide6.QtCore import QTimer

    pane.setWindowTitle(f"{path.name} — Clover Desk preview (sandboxed)")
    pane.resize(width, height)
    pane.show()
    if not args.screenshot:
        pane.set_html(html, document_id=str(path.resolve()))
        pane.flush()
        return int(app.exec())

    out = Path(args.screenshot)
    result = {"code": 1, "loaded": False}

    def on_timeout() -> None:
        print(f"clover-desk preview: {path} did not finish loading in {LOAD_TIMEOUT_MS // 1000} s", file=sys.stderr)
        app.exit(1)

    def on_loaded(ok: bool) -> None:
        if result["loaded"]:
            return  # a later load (the page was put back after navigating itself away): the first one counts
        result["loaded"] = True
        if not ok:
            print(f"clover-desk preview: {path} failed to load", file=sys.stderr)
            app.exit(1)
            return
        QTimer.singleShot(args.wait_ms, save)

    def save() -> None:
        pane.strip.flush()  # the screenshot shows the strip as it is now
        if not pane.grab().save(str(out), "PNG"):
            print(f"clover-desk preview: cannot write {out}", file=sys.stderr)
            app.exit(2)
            return
        for entry in pane.strip.entries:
            important = entry.kind == "blocked" or entry.source == "pane"
            log.log(logging.WARNING if important else logging.INFO, "preview %s: %s", entry.kind, entry.text)
        print(f"saved {out}")
        result["code"] = 0
        app.exit(0)

    pane.loadFinished.connect(on_loaded)
    QTimer.singleShot(LOAD_TIMEOUT_MS, on_timeout)
    pane.set_html(html, document_id=str(path.resolve()))
    pane.flush()
    code = int(app.exec())
    return code if code else result["code"]


def _dispose(pane) -> None:  # noqa: ANN001
    """Delete the pane while the QApplication lives (its pages before their profile, as Qt wants)."""
    from PySide6.QtCore import QCoreApplication, QEvent

    pane.close()
    pane.deleteLater()
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete.value)
