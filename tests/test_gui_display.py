"""``clover-desk gui`` on a machine where Qt cannot open a window: one line naming what to set or install, exit 2,
instead of Qt aborting the process (no display; an X11 desktop without libxcb-cursor0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from clover_desk.cli.gui import display_problem

ROOT = Path(__file__).resolve().parents[1]


def _found(*missing: str):
    return lambda name: None if name in missing else f"lib{name}.so"


def test_the_display_problems_name_what_to_do() -> None:
    assert display_problem({"QT_QPA_PLATFORM": "offscreen"}, "linux", _found("xcb-cursor")) is None
    assert display_problem({"WAYLAND_DISPLAY": "wayland-0"}, "linux", _found("xcb-cursor")) is None
    assert display_problem({}, "win32", _found("xcb-cursor")) is None
    assert display_problem({"DISPLAY": ":0"}, "linux", _found()) is None
    headless = display_problem({}, "linux", _found())
    assert headless is not None and "QT_QPA_PLATFORM=offscreen" in headless
    no_cursor = display_problem({"DISPLAY": ":0"}, "linux", _found("xcb-cursor"))
    assert no_cursor is not None and "sudo apt install libxcb-cursor0" in no_cursor
    forced_x11 = display_problem({"DISPLAY": ":0", "WAYLAND_DISPLAY": "w", "QT_QPA_PLATFORM": "xcb"}, "linux",
                                 _found("xcb-cursor", "EGL"))
    assert forced_x11 is not None and "libxcb-cursor0, libegl1" in forced_x11


def test_gui_without_a_display_is_one_line_and_exit_2(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    done = subprocess.run([sys.executable, "-m", "clover_desk.cli.main", "gui", "--home", str(tmp_path)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no display" in lines[0] and "QT_QPA_PLATFORM=offscreen" in lines[0]
