"""``clover-desk gui``: open the Clover Desk window.

Before the window opens, the data folder must be writable and its chat database free: a read-only folder, a full
disk at creation, or a database another running Clover Desk holds (single-instance lock, see
:mod:`clover_desk.storage`) ends the command with one line on stderr (and a message box on a desktop) naming the
folder and what to do, and exit status :data:`EXIT_DATA_DIR` (2).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from clover_desk.cli import flags
from clover_desk.cli.qt_deps import webengine_problem, xcb_problem

if TYPE_CHECKING:
    from collections.abc import Callable

    from PySide6.QtWidgets import QApplication, QWidget

log = logging.getLogger(__name__)

EXIT_DATA_DIR = 2  # the data folder is unusable or another instance holds it
# CLOVER_DESK_SMOKE=1 (packaging/smoke_test.sh, on a built bundle): once the main window is shown, print SMOKE_MARKER
# on stdout and quit with status 0, so a headless run proves the app reaches its first window.
SMOKE_ENV = "CLOVER_DESK_SMOKE"
SMOKE_MARKER = "clover-desk smoke: main window shown"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="DIR", help="model folder to load (remembered for the next start)")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="where the engine runs (default: cuda if found)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="weights dtype for the engine (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--vram-gb", dest="vram_budget_bytes", type=flags.vram_budget, help="VRAM budget in GiB (default: the last applied one)")
    parser.add_argument("--home", metavar="DIR", help="app-data folder (default: $CLOVER_DESK_HOME or per-OS)")
    parser.add_argument("--preview-without-sandbox", action="store_true",
                        help="as root, run the HTML preview without Chromium's sandbox (weaker isolation of the "
                             "pages the model writes; sets QTWEBENGINE_DISABLE_SANDBOX=1); without it, root gets "
                             "no preview")


def preview_off_reason(euid: int | None, env: dict[str, str], without_sandbox: bool) -> str | None:
    """Why the HTML preview stays off, in one line; None when it can run. As root Chromium's sandbox cannot run and
    QtWebEngine aborts the process at its first page, so root gets no preview unless the weaker isolation was asked
    for by name: ``--preview-without-sandbox``, or QTWEBENGINE_DISABLE_SANDBOX / ``--no-sandbox`` in
    QTWEBENGINE_CHROMIUM_FLAGS already in the environment. ``euid``: None where there are no user ids (Windows)."""
    if euid != 0 or without_sandbox or env.get("QTWEBENGINE_DISABLE_SANDBOX"):
        return None
    if "--no-sandbox" in env.get("QTWEBENGINE_CHROMIUM_FLAGS", "").split():
        return None
    return ("the HTML preview is off: Clover Desk runs as root, where Chromium's sandbox cannot run (start it as a "
            "normal user, or pass --preview-without-sandbox to preview with weaker isolation)")


SHM_DIR = "/dev/shm"


def shared_memory_problem(shm_dir: str = SHM_DIR, platform: str = sys.platform,
                          usable: "Callable[[str], bool] | None" = None) -> str | None:
    """Why the HTML preview stays off on this Linux machine, in one line; None when it can run. Chromium keeps its
    shared memory in /dev/shm and aborts the whole process (SIGTRAP, a FATAL line) when it cannot write there, as
    in a chroot whose /dev/shm is a plain root-owned folder (a booted system mounts a tmpfs with mode 1777).
    ``usable``: whether a folder can be written and entered by this user (default: ``os.access``)."""
    if not platform.startswith("linux"):
        return None
    check = usable or (lambda path: os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK))
    if check(shm_dir):
        return None
    return (f"the HTML preview is off: {shm_dir} is missing or not writable by this user, and Chromium keeps its "
            f"shared memory there (a normal system mounts it as a tmpfs with mode 1777: sudo chmod 1777 {shm_dir})")


def display_problem(env: dict[str, str], platform: str,
                    xcb_check: "Callable[[dict[str, str]], str | None]") -> str | None:
    """Why the window cannot open here, as one line naming what to install or set; None when it can (as far as can
    be told before Qt starts). ``xcb_check`` is :func:`clover_desk.cli.qt_deps.xcb_problem`: the libraries Qt's
    X11 plugin links and this machine lacks, with their Debian packages."""
    chosen = env.get("QT_QPA_PLATFORM", "")
    if chosen.startswith(("offscreen", "minimal", "vnc", "eglfs", "linuxfb", "wayland")) or not platform.startswith("linux"):
        return None
    if not chosen and env.get("WAYLAND_DISPLAY"):
        return None  # Qt takes Wayland
    if not env.get("DISPLAY"):
        return ("no display: DISPLAY and WAYLAND_DISPLAY are unset (a headless machine runs the window with "
                "QT_QPA_PLATFORM=offscreen, as `make test` does)")
    return xcb_check(env)


def run(args: argparse.Namespace) -> int:
    if args.home:
        os.environ["CLOVER_DESK_HOME"] = args.home
    problem = display_problem(dict(os.environ), sys.platform, xcb_problem)
    if problem is None and sys.platform.startswith("linux"):
        problem = webengine_problem(dict(os.environ))  # imported by the window whatever the platform plugin
    if problem is not None:
        print(f"clover-desk gui: {problem}", file=sys.stderr)
        return EXIT_DATA_DIR
    preview_off = preview_off_reason(os.geteuid() if hasattr(os, "geteuid") else None, dict(os.environ),
                                     args.preview_without_sandbox) or shared_memory_problem()
    if preview_off is not None:
        print(f"clover-desk gui: {preview_off}", file=sys.stderr)
    elif args.preview_without_sandbox:
        os.environ["QTWEBENGINE_DISABLE_SANDBOX"] = "1"  # read by QtWebEngine when it starts (the first page)
    # PySide6 6.12 on CPython < 3.12 leaks references to None/True on void calls (see guard's docstring); the
    # preview's URL scheme must be registered before the QApplication exists.
    from clover_desk.qt_compat import guard_pyside_bool_refcounts
    from clover_desk.ui.preview_sandbox import register_schemes

    guard_pyside_bool_refcounts()
    register_schemes()
    from PySide6.QtWidgets import QApplication

    from clover_desk.app import AppSettings, CloverDeskApp
    from clover_desk.paths import CHATS_DB_NAME, DataDirError, writable_app_data_dir
    from clover_desk.storage.errors import StorageError
    from clover_desk.storage.store import ChatStore
    from clover_desk.ui.theme import apply_theme, icon

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Clover Desk")
    app.setOrganizationName("Clover Desk")
    app.setDesktopFileName("clover-desk")
    app.setWindowIcon(icon("clover-desk"))
    apply_theme(app)
    try:
        home = writable_app_data_dir()
        store = ChatStore(home / CHATS_DB_NAME)  # takes the single-instance lock, held until the app shuts down
    except (DataDirError, StorageError) as exc:
        return _refuse(str(exc))
    settings = AppSettings.load(home / "settings.json")
    if args.model:
        settings.model_dir = os.path.abspath(args.model)
    if args.device:
        settings.device = args.device
    if args.dtype:
        settings.dtype = args.dtype
    if args.vram_budget_bytes:
        settings.vram_budget_bytes = args.vram_budget_bytes
    try:
        desk = CloverDeskApp(home, settings=settings, store=store, preview_off=preview_off, gpu_paths=args.gpu_paths)
    except BaseException:
        store.close()
        raise
    desk.save_settings()
    desk.window.show()
    close_on_signals(desk.window, app)
    if os.environ.get(SMOKE_ENV) == "1":
        from PySide6.QtCore import QTimer

        QTimer.singleShot(0, lambda: _smoke_shown(desk.window, app))  # runs once the event loop has shown it
    return int(app.exec())


def close_on_signals(window: QWidget, app: QApplication) -> None:
    """SIGINT (Ctrl+C in the terminal that started the app), SIGTERM (a logout, ``kill``) and SIGHUP (that terminal
    closed) close the window as its close button does, then quit: the answer being written is kept, the window's
    state saved, the engine worker shut down. Python runs a signal's handler only once it runs bytecode, which Qt's idle event loop never does, so
    the signal also writes a byte to a socket (``signal.set_wakeup_fd``) whose notifier wakes the loop into Python.
    (Before this, Ctrl+C raised KeyboardInterrupt inside whichever slot ran next and left the window open.) POSIX
    only: on Windows the console's Ctrl+C stays Python's default."""
    import signal
    import socket

    from PySide6.QtCore import QSocketNotifier, QTimer

    if not hasattr(signal, "SIGTERM") or sys.platform == "win32":
        return
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    notifier = QSocketNotifier(reader.fileno(), QSocketNotifier.Type.Read, window)

    def drain() -> None:  # (Python's pending signal handlers run around this slot)
        try:
            reader.recv(64)
        except OSError:
            pass

    def close(signum: int, _frame: object) -> None:
        log.info("signal %d: closing the window", signum)
        QTimer.singleShot(0, window.close)  # from the event loop, not from inside whatever was running
        QTimer.singleShot(0, app.quit)  # a dialog or a preview window left open must not keep the app alive

    notifier.activated.connect(drain)
    notifier.setProperty("sockets", (reader, writer))  # (kept alive with the notifier)
    signal.set_wakeup_fd(writer.fileno())
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):  # SIGHUP: the terminal that started it was closed
        signal.signal(getattr(signal, name), close)


def _smoke_shown(window: QWidget, app: QApplication) -> None:
    if not window.isVisible():
        print("clover-desk smoke: the main window is not visible", file=sys.stderr)
        app.exit(1)
        return
    preview = "preview off" if getattr(window, "preview_off", None) else "preview on"
    print(f"{SMOKE_MARKER} ({window.width()}x{window.height()}, {type(window).__name__}, {preview})", flush=True)
    app.quit()


def _refuse(message: str) -> int:
    """Say why the window cannot open (stderr, and a message box unless Qt runs headless); the exit status."""
    print(f"clover-desk: {message}", file=sys.stderr)
    from PySide6.QtGui import QGuiApplication

    if QGuiApplication.platformName() not in ("offscreen", "minimal"):
        from PySide6.QtWidgets import QMessageBox

        QMessageBox.critical(None, "Clover Desk", message)
    return EXIT_DATA_DIR
