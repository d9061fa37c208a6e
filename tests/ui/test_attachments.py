"""Attaching text files to a message: the files are real, written by the tests; the message box is the real
composer in the real window (drops and pastes go through Qt's own mime handling)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDragEnterEvent, QDropEvent, QGuiApplication
from PySide6.QtWidgets import QApplication

from clover_desk.qt_compat import guard_pyside_bool_refcounts
from clover_desk.ui import composer as composer_module
from clover_desk.ui.attachments import ATTACH_MAX_BYTES, AttachmentError, attachment_markdown, read_attachment

guard_pyside_bool_refcounts()

PAGE = "<!DOCTYPE html>\n<html><body><h1>Hi</h1></body></html>\n"


def test_a_text_file_becomes_a_fenced_block_tagged_with_its_language(tmp_path: Path) -> None:
    page = tmp_path / "index.html"
    page.write_text(PAGE, encoding="utf-8")
    assert read_attachment(page) == f"**index.html**\n\n```html\n{PAGE}```\n"
    script = tmp_path / "tool.py"
    script.write_bytes(b"\xef\xbb\xbfprint(1)\r\nprint(2)")  # a BOM, Windows line ends, no final newline
    assert read_attachment(script) == "**tool.py**\n\n```python\nprint(1)\nprint(2)\n```\n"
    notes = tmp_path / "NOTES"
    notes.write_text("plain", encoding="utf-8")
    assert read_attachment(notes) == "**NOTES**\n\n```\nplain\n```\n"


def test_a_markdown_file_keeps_its_own_fences_inside() -> None:
    text = "# Title\n\n```python\nx = 1\n```\n\n````\nfour\n````\n"
    block = attachment_markdown("README.md", text)
    assert block.startswith("**README.md**\n\n`````markdown\n") and block.endswith(text + "`````\n")


def test_what_cannot_be_attached_is_one_line_naming_the_file(tmp_path: Path) -> None:
    cases = {
        "logo.png": (b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR", "logo.png: not a text file (it holds NUL bytes)"),
        "old.txt": ("café".encode("latin-1"), "old.txt: not UTF-8 text (byte 0xe9 at offset 3)"),
        "big.log": (b"x" * (ATTACH_MAX_BYTES + 1), "big.log: 1.0 MiB, more than the 1.0 MiB a message can attach"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(AttachmentError) as exc:
            read_attachment(tmp_path / name)
        assert str(exc.value).startswith(message) and "\n" not in str(exc.value), exc.value
    with pytest.raises(AttachmentError, match="^docs: a folder"):
        (tmp_path / "docs").mkdir()
        read_attachment(tmp_path / "docs")
    with pytest.raises(AttachmentError, match=r"^gone\.txt: cannot be read \(No such file"):
        read_attachment(tmp_path / "gone.txt")


def test_a_huge_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    huge = tmp_path / "dump.sql"
    with open(huge, "wb") as f:
        f.truncate(8 << 30)  # 8 GiB, sparse: reading it whole would take minutes and all the memory
    start = time.monotonic()
    with pytest.raises(AttachmentError, match=r"^dump\.sql: 8\.0 GiB, more than the 1\.0 MiB"):
        read_attachment(huge)
    assert time.monotonic() - start < 2


# ---------------------------------------------------------------------------------------------------------------
# the window


@pytest.fixture
def window(qtbot, tmp_path):  # noqa: ANN001, ANN201
    from fakes_ui import FakeEngineClient

    from clover_desk.storage.recorder import StreamRecorder
    from clover_desk.storage.store import ChatStore
    from clover_desk.ui.main_window import MainWindow

    store = ChatStore(tmp_path / "chats.sqlite3")
    w = MainWindow(FakeEngineClient(blocks=2, pass_ms=2), store, StreamRecorder, model_dir="/models/tiny")
    qtbot.addWidget(w)
    w.resize(1200, 800)
    w.show()
    yield w
    store.close()


def _files(tmp_path: Path) -> tuple[Path, Path]:
    page = tmp_path / "index.html"
    page.write_text(PAGE, encoding="utf-8")
    image = tmp_path / "photo.jpg"
    image.write_bytes(b"\xff\xd8\xff\xe0\0\x10JFIF")
    return page, image


def test_attach_puts_the_files_text_in_the_message_and_says_what_it_left_out(qtbot, window, tmp_path,
                                                                              monkeypatch) -> None:  # noqa: ANN001
    page, image = _files(tmp_path)
    monkeypatch.setattr(composer_module, "ask_open_paths", lambda parent: [str(page), str(image)])
    box = window.composer.input
    box.setPlainText("Make the heading red:")
    box.moveCursor(box.textCursor().MoveOperation.End)
    qtbot.mouseClick(window.composer.attach_button, Qt.MouseButton.LeftButton)
    assert box.toPlainText() == "Make the heading red:\n\n" + read_attachment(page)
    note = window.composer.attach_note
    assert note.isVisible() and note.text() == "photo.jpg: not a text file (it holds NUL bytes); attach UTF-8 text " \
                                               "such as code, Markdown, HTML or CSV"
    with qtbot.waitSignal(window.generationFinished, timeout=5000):
        qtbot.keyClick(box, Qt.Key.Key_Return)
    sent = window.chat.widgets[0].data
    assert sent.role == "user" and sent.content == ("Make the heading red:\n\n" + read_attachment(page)).strip()
    assert "<h1>Hi</h1>" in window.chat.widgets[0].body.toPlainText()  # shown as a code block
    assert not note.isVisible()  # the note was about the message just sent


def test_files_dropped_on_the_box_are_attached_a_link_stays_text(qtbot, window, tmp_path) -> None:  # noqa: ANN001
    page, _ = _files(tmp_path)
    box = window.composer.input
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(page))])
    target = box.viewport()
    center = QPointF(target.rect().center())
    enter = QDragEnterEvent(center, Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                            Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(target, enter)
    assert enter.isAccepted()
    drop = QDropEvent(center, Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                      Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(target, drop)
    assert box.toPlainText() == read_attachment(page)
    # a pasted file (copied in a file manager) too; a web link is pasted as its text
    box.clear()
    QGuiApplication.clipboard().setMimeData(mime)
    box.paste()
    assert box.toPlainText() == read_attachment(page)
    box.clear()
    web = QMimeData()
    web.setUrls([QUrl("https://example.com/page.html")])
    web.setText("https://example.com/page.html")
    QGuiApplication.clipboard().setMimeData(web)
    box.paste()
    assert box.toPlainText() == "https://example.com/page.html"
