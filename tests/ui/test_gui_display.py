"""``clover-desk gui`` on a machine where Qt cannot open a window: one line naming what to set or install, exit 2,
instead of Qt aborting the process (no display; an X11 desktop without a library Qt's xcb plugin links, found by
reading the plugin's ELF dynamic section, see clover_desk/cli/qt_deps.py); and as root, where Chromium's sandbox
cannot run: the window opens with the preview off and one line saying why, unless --preview-without-sandbox."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from clover_desk.cli import qt_deps
from clover_desk.cli.gui import display_problem, preview_off_reason, shared_memory_problem

ROOT = Path(__file__).resolve().parents[2]
X86_64, I386 = 62, 3


def _lacking(line: str | None):
    return lambda env: line


def test_the_display_problems_name_what_to_do() -> None:
    lacking = _lacking("Qt's X11 platform plugin P needs libxcb-icccm.so.4 (libxcb-icccm4), not installed")
    assert display_problem({"QT_QPA_PLATFORM": "offscreen"}, "linux", lacking) is None
    assert display_problem({"WAYLAND_DISPLAY": "wayland-0"}, "linux", lacking) is None
    assert display_problem({}, "win32", lacking) is None
    assert display_problem({"DISPLAY": ":0"}, "linux", _lacking(None)) is None
    headless = display_problem({}, "linux", _lacking(None))
    assert headless is not None and "QT_QPA_PLATFORM=offscreen" in headless
    assert display_problem({"DISPLAY": ":0"}, "linux", lacking) == lacking({})
    forced_x11 = display_problem({"DISPLAY": ":0", "WAYLAND_DISPLAY": "w", "QT_QPA_PLATFORM": "xcb"}, "linux", lacking)
    assert forced_x11 == lacking({})


def write_elf(path: Path, needed: list[str], runpath: str = "", machine: int = X86_64, wide: bool = True) -> Path:
    """A minimal ELF shared object: one PT_LOAD over the whole file at address 0, one PT_DYNAMIC whose DT_NEEDED
    and DT_RUNPATH name strings in its DT_STRTAB (what the loader, and qt_deps, read)."""
    strings = b"\0"
    offsets = []
    for name in [*needed, runpath]:
        offsets.append(len(strings))
        strings += name.encode() + b"\0"
    ehsize, phentsize = (64, 56) if wide else (52, 32)
    dyn_fmt = "<qQ" if wide else "<iI"
    entries = [(1, off) for off in offsets[:-1]] + ([(29, offsets[-1])] if runpath else [])
    strtab_at = ehsize + 2 * phentsize
    entries += [(5, strtab_at), (0, 0)]
    dynamic_at = strtab_at + len(strings)
    dynamic = b"".join(struct.pack(dyn_fmt, tag, value) for tag, value in entries)
    size = dynamic_at + len(dynamic)
    ident = b"\x7fELF" + bytes([2 if wide else 1, 1, 1]) + bytes(9)
    if wide:
        header = ident + struct.pack("<HHIQQQIHHHHHH", 3, machine, 1, 0, ehsize, 0, 0, ehsize, phentsize, 2, 64, 0, 0)
        phdrs = (struct.pack("<IIQQQQQQ", 1, 5, 0, 0, 0, size, size, 4096)
                 + struct.pack("<IIQQQQQQ", 2, 6, dynamic_at, dynamic_at, dynamic_at, len(dynamic), len(dynamic), 8))
    else:
        header = ident + struct.pack("<HHIIIIIHHHHHH", 3, machine, 1, 0, ehsize, 0, 0, ehsize, phentsize, 2, 40, 0, 0)
        phdrs = (struct.pack("<IIIIIIII", 1, 0, 0, 0, size, size, 5, 4096)
                 + struct.pack("<IIIIIIII", 2, dynamic_at, dynamic_at, dynamic_at, len(dynamic), len(dynamic), 6, 4))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + phdrs + strings + dynamic)
    return path


@pytest.fixture
def fake_qt(tmp_path: Path) -> dict[str, Path]:
    """PySide6's layout in miniature: the xcb plugin links Qt's own XcbQpa (found through $ORIGIN/../../lib), which
    links libxcb-icccm.so.4 and libxcb.so.1; the 'system' folder has libxcb.so.1 only, and a 32-bit
    libxcb-icccm.so.4 the loader would skip."""
    qt = tmp_path / "Qt"
    plugin = write_elf(qt / "plugins" / "platforms" / "libqxcb.so", ["libQt6XcbQpa.so.6", "libc.so.6"],
                       runpath="$ORIGIN/../../lib")
    write_elf(qt / "lib" / "libQt6XcbQpa.so.6", ["libxcb-icccm.so.4", "libxcb.so.1"], runpath="$ORIGIN")
    system = tmp_path / "system"
    write_elf(system / "libxcb.so.1", ["libc.so.6"])
    write_elf(system / "libc.so.6", [])
    write_elf(system / "libxcb-icccm.so.4", ["libc.so.6"], machine=I386, wide=False)
    return {"plugin": plugin, "system": system, "root": tmp_path}


def test_a_library_the_plugin_links_through_qt_is_named_with_its_debian_package(fake_qt: dict[str, Path]) -> None:
    deps = qt_deps.read_elf_deps(fake_qt["plugin"])
    assert deps.needed == ("libQt6XcbQpa.so.6", "libc.so.6") and deps.runpath == ("$ORIGIN/../../lib",)
    assert deps.kind == (2, 1, X86_64)
    assert qt_deps.missing_libraries(fake_qt["plugin"], {}, [str(fake_qt["system"])]) == ["libxcb-icccm.so.4"]
    line = qt_deps.xcb_problem({}, fake_qt["plugin"], [str(fake_qt["system"])])
    assert line is not None and "\n" not in line
    assert "libxcb-icccm.so.4 (libxcb-icccm4)" in line and line.endswith("sudo apt install libxcb-icccm4")
    # found where the loader would find it (LD_LIBRARY_PATH, 64-bit): nothing to say
    extra = fake_qt["root"] / "extra"
    write_elf(extra / "libxcb-icccm.so.4", ["libc.so.6"])
    assert qt_deps.xcb_problem({"LD_LIBRARY_PATH": f"/nonexistent:{extra}"}, fake_qt["plugin"],
                               [str(fake_qt["system"])]) is None
    # Qt's own library gone as well: both named, the one no table knows with how to find its package
    (fake_qt["plugin"].parents[2] / "lib" / "libQt6XcbQpa.so.6").unlink()
    line = qt_deps.xcb_problem({}, fake_qt["plugin"], [str(fake_qt["system"])])
    assert line is not None and "libQt6XcbQpa.so.6 (package unknown: apt-file search libQt6XcbQpa.so.6)" in line


def test_not_an_elf_file_is_refused_not_guessed(tmp_path: Path) -> None:
    text = tmp_path / "libqxcb.so"
    text.write_text("not a library")
    with pytest.raises(qt_deps.NotELF):
        qt_deps.read_elf_deps(text)
    assert qt_deps.xcb_problem({}, text, []) is None  # nothing known: the window is tried


def test_ld_so_conf_includes_are_followed(tmp_path: Path) -> None:
    (tmp_path / "ld.so.conf.d").mkdir()
    (tmp_path / "ld.so.conf").write_text("include ld.so.conf.d/*.conf\n/opt/first # comment\n")
    (tmp_path / "ld.so.conf.d" / "a.conf").write_text("# multiarch\n/lib/x86_64-linux-gnu\n")
    assert qt_deps.ld_so_conf_dirs(tmp_path / "ld.so.conf") == ["/lib/x86_64-linux-gnu", "/opt/first"]


@pytest.mark.skipif(shutil.which("ldd") is None or qt_deps.xcb_plugin({}) is None, reason="needs ldd and PySide6")
def test_the_real_plugin_lacks_what_ldd_says_it_lacks() -> None:
    """On this machine, the check agrees with the dynamic loader itself about PySide6's real libqxcb.so."""
    plugin = qt_deps.xcb_plugin({})
    assert plugin is not None
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    done = subprocess.run(["ldd", str(plugin)], capture_output=True, text=True, env=env, timeout=60, check=True)
    not_found = {line.split()[0] for line in done.stdout.splitlines() if "not found" in line}
    system = [*qt_deps.ld_so_conf_dirs(), *qt_deps.DEFAULT_DIRS]
    assert set(qt_deps.missing_libraries(plugin, {}, system)) == not_found
    assert all(soname in qt_deps.DEBIAN_PACKAGES for soname in not_found)


def test_gui_on_x11_without_a_plugin_library_is_one_line_and_exit_2(tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    write_elf(plugins / "platforms" / "libqxcb.so", ["libclover-test-absent.so.7"])
    env = {k: v for k, v in os.environ.items() if k not in ("WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    env.update(DISPLAY=":99", QT_PLUGIN_PATH=str(plugins))
    done = subprocess.run([sys.executable, "-m", "clover_desk.cli.main", "gui", "--home", str(tmp_path / "home")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("clover-desk gui: Qt's X11 platform plugin ")
    assert "libclover-test-absent.so.7 (package unknown: apt-file search libclover-test-absent.so.7)" in lines[0]


def test_root_gets_no_preview_unless_the_weaker_isolation_is_named() -> None:
    off = preview_off_reason(0, {}, without_sandbox=False)
    assert off is not None and "root" in off and "--preview-without-sandbox" in off
    assert preview_off_reason(0, {}, without_sandbox=True) is None
    assert preview_off_reason(0, {"QTWEBENGINE_DISABLE_SANDBOX": "1"}, without_sandbox=False) is None
    assert preview_off_reason(0, {"QTWEBENGINE_CHROMIUM_FLAGS": "--foo --no-sandbox"}, without_sandbox=False) is None
    assert preview_off_reason(1000, {}, without_sandbox=False) is None
    assert preview_off_reason(None, {}, without_sandbox=False) is None  # Windows


def test_a_dev_shm_chromium_cannot_write_turns_the_preview_off(tmp_path: Path) -> None:
    """Issue 32, in a Debian 12 chroot: /dev/shm a plain root-owned folder, so a normal user's window died at start
    (Chromium: "Creating shared memory in /dev/shm ... Permission denied", FATAL, SIGTRAP). Now the window opens
    with the preview off and one line naming the folder and the fix."""
    assert shared_memory_problem(str(tmp_path)) is None  # a folder this user can write
    missing = shared_memory_problem(str(tmp_path / "absent"))
    assert missing is not None and missing.startswith("the HTML preview is off: ") and str(tmp_path / "absent") in missing
    denied = shared_memory_problem("/dev/shm", usable=lambda path: False)  # what a normal user met in the chroot
    assert denied is not None and "sudo chmod 1777 /dev/shm" in denied and "\n" not in denied
    assert shared_memory_problem(str(tmp_path / "absent"), platform="win32") is None  # no /dev/shm to need


def test_the_window_factory_builds_the_preview_off_tab(qtbot, tmp_path: Path) -> None:
    from fakes_ui import FakeEngineClient

    from clover_desk.app import AppSettings, CloverDeskApp

    reason = preview_off_reason(0, {}, without_sandbox=False)
    desk = CloverDeskApp(tmp_path, client=FakeEngineClient(), settings=AppSettings(model_dir="/models/tiny"),
                         preview_off=reason, with_model_manager=False)
    qtbot.addWidget(desk.window)
    window = desk.window
    window.show()
    assert window.preview_off == reason
    tab = window.tabs.indexOf(window.preview)
    assert tab >= 0 and window.tabs.tabText(tab) == "Preview"
    assert "--preview-without-sandbox" in window.preview.text() and not window.info_banner.isHidden()
    assert "root" in window.info_banner.label.text()
    request = SimpleNamespace(html="<html></html>", document_id="d", message=None, block=None)  # a Preview click
    window.answers.on_preview_requested(request)
    assert window.tabs.currentWidget() is window.preview  # asking for a preview shows why there is none
    desk.shutdown()


def _smoke(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("QTWEBENGINE_DISABLE_SANDBOX",
                                                            "QTWEBENGINE_CHROMIUM_FLAGS")}
    env.update(QT_QPA_PLATFORM="offscreen", CLOVER_DESK_SMOKE="1")
    return subprocess.run([sys.executable, "-m", "clover_desk.cli.main", "gui", "--home", str(tmp_path), *flags],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)


@pytest.mark.slow
@pytest.mark.webengine
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="runs as root only")
def test_as_root_the_window_opens_without_preview_or_with_it_by_the_flag(tmp_path: Path) -> None:
    """Before: QtWebEngine aborted the process ("Running as root without --no-sandbox is not supported")."""
    done = _smoke(tmp_path / "a")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "main window shown" in done.stdout and "preview off" in done.stdout
    ours = [line for line in done.stderr.splitlines() if line.startswith("clover-desk")]
    assert len(ours) == 1 and "--preview-without-sandbox" in ours[0]
    done = _smoke(tmp_path / "b", "--preview-without-sandbox")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "main window shown" in done.stdout and "preview on" in done.stdout
    assert not [line for line in done.stderr.splitlines() if line.startswith("clover-desk")]


def test_gui_without_a_display_is_one_line_and_exit_2(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    done = subprocess.run([sys.executable, "-m", "clover_desk.cli.main", "gui", "--home", str(tmp_path)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no display" in lines[0] and "QT_QPA_PLATFORM=offscreen" in lines[0]


def test_a_library_qtwebengine_lacks_is_named_too(fake_qt: dict[str, Path]) -> None:
    """The window imports QtWebEngine on every platform plugin (offscreen too): a module whose libraries are missing
    (libnspr4 on a minimal Debian) is one line naming the packages, as for the xcb plugin."""
    module = write_elf(fake_qt["root"] / "PySide6" / "QtWebEngineCore.abi3.so", ["libnss3.so", "libnspr4.so",
                                                                                 "libxcb.so.1"])
    line = qt_deps.webengine_problem({}, [module], [str(fake_qt["system"])])
    assert line is not None and line.startswith("QtWebEngine (the HTML preview) needs libnss3.so (libnss3), ")
    assert line.endswith("sudo apt install libnss3 libnspr4")
    assert qt_deps.webengine_problem({}, [], [str(fake_qt["system"])]) is None  # a PySide6 without QtWebEngine
