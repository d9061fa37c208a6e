"""One rule for the HTML page of an answer (ui.html_extract): the chat's Preview button, the preview pane and the
streaming follow all use it."""

from __future__ import annotations

import pytest

from clover_desk.qt_compat import guard_pyside_bool_refcounts  # noqa: E402
from clover_desk.ui.html_extract import extract_html

guard_pyside_bool_refcounts()


@pytest.mark.parametrize(("answer", "page"), [
    pytest.param("Here you go:\n\n```html\n<!DOCTYPE html>\n<html><body>hi</body></html>\n```\n\nEnjoy.",
                 "<!DOCTYPE html>\n<html><body>hi</body></html>", id="fenced block"),
    pytest.param("```html\n<b>x</b>\n```\ntext\n~~~HTML\n<html><body>the whole app</body></html>\n~~~\n",
                 "<html><body>the whole app</body></html>", id="the longest block, tildes too"),
    pytest.param("Sure!\n```html\n<!DOCTYPE html>\n<html><body><h1>Desk",
                 "<!DOCTYPE html>\n<html><body><h1>Desk", id="an unfinished fence while streaming"),
])
def test_extract_the_page_of_a_fence(answer: str, page: str) -> None:
    assert extract_html(answer) == page


def test_extract_bare_page_and_its_end() -> None:
    answer = "Some words.\n<!doctype html>\n<html><body>x</body></html>\nAfterword."
    assert extract_html(answer) == "<!doctype html>\n<html><body>x</body></html>"
    assert extract_html("<html lang='en'><body>streaming") == "<html lang='en'><body>streaming"


def test_extract_none_when_no_document() -> None:
    assert extract_html("Use a <div> and an <html> element inline in prose.") is None
    assert extract_html("```python\nprint('<html>')\n```") is None
    assert extract_html("") is None


TWO_BLOCKS = ("First the page:\n\n```html\n<!DOCTYPE html>\n<html><body><h1>The whole app</h1><p>with a body</p>"
              "</body></html>\n```\n\nand the one line to change:\n\n```html\n<b>x</b>\n```\n")


def test_the_longest_block_wins_even_when_it_comes_first() -> None:
    assert extract_html(TWO_BLOCKS).startswith("<!DOCTYPE html>")


def test_the_chat_preview_button_uses_the_same_rule(qtbot) -> None:
    """A chat view built without an extractor (as in tests and the CLI) sends the page the pane would pick."""
    from clover_desk.ui.chat_view import ChatView, MessageData

    view = ChatView()
    qtbot.addWidget(view)
    widget = view.add_message(MessageData("assistant", TWO_BLOCKS))
    with qtbot.waitSignal(view.previewRequested, timeout=1000) as blocker:
        widget.preview_button.click()
    assert blocker.args[0].html == extract_html(TWO_BLOCKS)
    assert "The whole app" in blocker.args[0].html
