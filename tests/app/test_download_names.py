"""File names from the Hub (issue 31): a name that is absolute or leaves the model folder under POSIX *or* Windows
rules is refused with one line naming it, checked with PureWindowsPath and PurePosixPath as well as through the real
downloader against the Hub stand-in."""

from __future__ import annotations

import ntpath
import posixpath
from pathlib import PurePosixPath, PureWindowsPath

import pytest

from clover_desk.downloads import DownloadError, ModelDownloader, _safe_relative, unsafe_name_reason
from tests.hf_test_server import FakeHub

BAD = [
    "..\\..\\AppData\\Roaming\\Microsoft\\Windows\\Start Menu\\Programs\\Startup\\x.bat",
    "C:\\x", "C:x", "c:/x", "\\\\server\\share\\x", "//server/share/x", "\\x", "/etc/passwd",
    "a/../../b", "../b", "a/..", "..", ".", "./a", "a/./b", "a//b", "a/", "",
    "CON", "con.txt", "sub/NUL.safetensors", "aux.tar.gz", "COM1", "lpt9.json", "Com\u00b9.txt", "prn ", "nul .txt",
    "name.", "name ", "sub./x", "x\x00y", "x\ny", "tab\there", "del\x7f",
    "a<b", "a>b", 'a"b', "a|b", "a?b", "a*b", "file.txt:stream",
]
GOOD = ["config.json", "model-00001-of-00002.safetensors", "sub/model-00002-of-00002.safetensors", "original/params.json",
        ".gitattributes", "clover-Q4_K_M.gguf", "consolidated.00.pth", "Comet.txt", "console.log", "nul_x.bin",
        "COM10.txt", "a..b", "dir.v2/file"]


def _stays_inside(name: str) -> bool:
    """Whether ``name`` joined below a folder stays below it, on Windows and on POSIX."""
    win = ntpath.normpath(ntpath.join("C:\\models\\m", name))
    posix = posixpath.normpath(posixpath.join("/models/m", name))
    return win.startswith("C:\\models\\m\\") and posix.startswith("/models/m/")


@pytest.mark.parametrize("name", BAD)
def test_unsafe_names_are_refused_naming_the_file(name: str) -> None:
    with pytest.raises(DownloadError) as err:
        _safe_relative(name)
    message = str(err.value)
    assert message.startswith(f"refusing unsafe file name from the Hub: {name!r} (") and "\n" not in message.replace(
        repr(name), "")


@pytest.mark.parametrize("name", GOOD)
def test_ordinary_names_pass(name: str) -> None:
    assert _safe_relative(name) == PurePosixPath(name)
    assert _stays_inside(name)
    assert not PureWindowsPath(name).anchor and not PureWindowsPath(name).is_absolute()


def test_every_accepted_name_stays_inside_under_both_rules() -> None:
    """Names of every short mix of the characters that matter: each one accepted stays in the folder (and is
    relative) under Windows and POSIX rules; those that escape are all refused."""
    alphabet = ["a", ".", "/", "\\", ":", "C", " ", "..", "con"]
    names = [""]
    for _ in range(4):
        names = [n + c for n in names for c in alphabet]
    accepted = [n for n in names if unsafe_name_reason(n) is None]
    assert accepted  # the check is not refusing everything
    for name in accepted:
        assert _stays_inside(name), name
        assert not PureWindowsPath(name).anchor and not PurePosixPath(name).is_absolute(), name
        assert ".." not in PureWindowsPath(name).parts and ".." not in PurePosixPath(name).parts, name


def test_the_downloader_refuses_a_repository_with_an_unsafe_name(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    bad = "..\\..\\AppData\\Startup\\x.bat"
    with FakeHub() as hub:
        hub.add_repo("Diffuspace/Evil", {"config.json": b"{}", bad: b"@echo off"})
        downloader = ModelDownloader(tmp_path / "m", "Diffuspace/Evil", endpoint=hub.endpoint, token=False,
                                     reserve_bytes=0)
        with pytest.raises(DownloadError, match=r"refusing unsafe file name from the Hub: .*x\.bat.*backslash"):
            downloader.plan()
    assert not (tmp_path / "m").exists() or not any((tmp_path / "m").rglob("*.bat"))
