"""Syntax highlighting of fenced code (ui.highlight through ui.markdown), down to the real window's chat view."""

from __future__ import annotations

import time

from fakes_ui import FakeEngineClient
from PySide6.QtGui import QTextCursor

from clover_desk.qt_compat import guard_pyside_bool_refcounts
from clover_desk.storage.recorder import StreamRecorder
from clover_desk.ui import highlight as hl
from clover_desk.ui.main_window import MainWindow
from clover_desk.ui.markdown import render
from clover_desk.ui.theme import COLORS, DARK, LIGHT

guard_pyside_bool_refcounts()

PY = 'def greet(name):\n    # say hello\n    return "<script>alert(1)</script>" + name * 2\n'
ANSWER = f"Here:\n\n```python\n{PY}```\n\nand a tag <b>bold?</b> & more."


def test_a_python_block_gets_palette_colours_and_escaped_text() -> None:
    html = render(f"```python\n{PY}```").html
    assert f'<span style="color: {COLORS["syn_keyword"]};">def </span>' in html
    assert f'<span style="color: {COLORS["syn_comment"]};"># say hello' in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<script" not in html


def test_unknown_language_short_unlabelled_and_open_fences_stay_plain() -> None:
    for text in ("```nosuchlang\ndef f(): pass\n```", "```\ndef f(): pass\n```", f"```python\n{PY}"):
        html = render(text).html
        assert "<span" not in html, text
    assert "def f(): pass" in render("```nosuchlang\ndef f(): pass\n```").html


def test_a_long_block_without_a_language_is_guessed() -> None:
    code = "\n".join(f"def f{i}(x):\n    return x + {i}  # step {i}" for i in range(12))
    html = render(f"```\n{code}\n```").html
    assert f'color: {COLORS["syn_keyword"]}' in html


def test_colours_follow_the_theme() -> None:
    saved = dict(COLORS)
    try:
        COLORS.clear(), COLORS.update(LIGHT)
        light = render(f"```python\n{PY}```").html
        COLORS.clear(), COLORS.update(DARK)
        dark = render(f"```python\n{PY}```").html
    finally:
        COLORS.clear(), COLORS.update(saved)
    assert LIGHT["syn_keyword"] in light and DARK["syn_keyword"] not in light
    assert DARK["syn_keyword"] in dark and LIGHT["syn_keyword"] not in dark


def test_hostile_code_never_becomes_markup() -> None:
    hostile = '<img src=x onerror=alert(1)>\n"</pre><script>x()</script>\n<!-- -->&amp;'
    for lang in ("html", "python", "js", "nosuchlang"):
        html = render(f"```{lang}\n{hostile}\n```").html
        assert "<img" not in html and "<script" not in html and "</pre><script" not in html, lang
        assert "&amp;amp;" in html, lang


def test_a_finished_block_is_highlighted_once_while_a_long_answer_streams() -> None:
    hl._highlight_cached.cache_clear()
    code = "\n".join(f"def f{i}(x):\n    return x * {i}" for i in range(400))
    answer = f"```python\n{code}\n```\n\n" + " ".join(["word"] * 50)
    first = time.perf_counter()
    render(answer)
    first = time.perf_counter() - first
    again = time.perf_counter()
    for n in range(1, 21):  # the answer grows after the block: the block comes from the cache
        render(answer + " more" * n)
    again = (time.perf_counter() - again) / 20
    info = hl._highlight_cached.cache_info()
    assert info.misses == 1 and info.hits == 20
    assert again < first


def _colours_of(browser, word: str) -> set[str]:
    """The foreground colours of ``word`` where it shows in a QTextBrowser (what the user sees)."""
    doc = browser.document()
    found: set[str] = set()
    cursor = doc.find(word)
    while not cursor.isNull():
        probe = QTextCursor(cursor)
        probe.setPosition(cursor.selectionEnd())
        found.add(probe.charFormat().foreground().color().name())
        cursor = doc.find(word, cursor)
    return found


def test_the_window_shows_a_python_answer_coloured_and_its_tags_as_text(qtbot, store) -> None:
    client = FakeEngineClient(blocks=2, pass_ms=2, answer=ANSWER)
    window = MainWindow(client, store, StreamRecorder, model_dir="/models/tiny")
    qtbot.addWidget(window)
    window.show()
    window.composer.input.setPlainText("write greet")
    with qtbot.waitSignal(window.generationFinished, timeout=5000):
        window.composer.on_send_clicked()
    body = window.chat.widgets[-1].body
    assert COLORS["syn_keyword"] in _colours_of(body, "def")
    assert COLORS["syn_comment"] in _colours_of(body, "say hello")
    text = body.toPlainText()
    assert "<script>alert(1)</script>" in text and "<b>bold?</b>" in text  # shown as the text it is
    html = body.rendered.html
    assert "<script" not in html and "<b>bold" not in html
