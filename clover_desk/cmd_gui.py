"""``clover-desk gui``: open the Clover Desk window."""

from __future__ import annotations

import argparse
import logging
import os
import sys

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="DIR", help="model folder to load (remembered for the next start)")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="where the engine runs (default: cuda if found)")
    parser.add_argument("--dtype", help="weights dtype for the engine (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--vram-gb", type=float, help="VRAM budget in GiB (default: the last applied one)")
    parser.add_argument("--home", metavar="DIR", help="app-data folder (default: $CLOVER_DESK_HOME or per-OS)")


def run(args: argparse.Namespace) -> int:
    if args.home:
        os.environ["CLOVER_DESK_HOME"] = args.home
    # PySide6 6.12 on CPython < 3.12 leaks references to None/True on void calls (see guard's docstring); the
    # preview's URL scheme must be registered before the QApplication exists.
    from clover_desk.qt_compat import guard_pyside_bool_refcounts
    from ui.preview import register_schemes

    guard_pyside_bool_refcounts()
    register_schemes()
    from PySide6.QtWidgets import QApplication

    from clover_desk.app import AppSettings, CloverDeskApp
    from clover_desk.paths import app_data_dir
    from ui.theme import apply_theme, icon

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Clover Desk")
    app.setOrganizationName("Clover Desk")
    app.setDesktopFileName("clover-desk")
    app.setWindowIcon(icon("clover-desk"))
    apply_theme(app)
    home = app_data_dir()
    settings = AppSettings.load(home / "settings.json")
    if args.model:
        settings.model_dir = os.path.abspath(args.model)
    if args.device:
        settings.device = args.device
    if args.dtype:
        settings.dtype = args.dtype
    if args.vram_gb:
        settings.vram_budget_bytes = int(args.vram_gb * 1024**3)
    desk = CloverDeskApp(home, settings=settings)
    desk.save_settings()
    desk.window.show()
    return int(app.exec())
