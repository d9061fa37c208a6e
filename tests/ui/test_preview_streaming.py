"""The preview follows a streaming answer: the window, a scripted engine client and the real QtWebEngine pane."""

from __future__ import annotations

import pytest

pytest.importorskip("PySide6.QtWebEngineWidgets", exc_type=ImportError)

from fakes_ui import FakeEngineClient  # noqa: E402
from PySide6.QtCore import Qt  # noqa: E402

from clover_desk.engine.decode.events import Finished, TextDelta  # noqa: E402
from clover_desk.qt_compat import guard_pyside_bool_refcounts  # noqa: E402
from clover_desk.storage.recorder import StreamRecorder  # noqa: E402
from clover_desk.storage.store import ChatStore  # noqa: E402
from clover_desk.ui.html_extract import extract_html  # noqa: E402
from clover_desk.ui.main_window import MainWindow  # noqa: E402
from clover_desk.ui.messages import preview_document_id  # noqa: E402
from clover_desk.ui.preview import PreviewPane  # noqa: E402
from clover_desk.ui.preview_sandbox import register_schemes  # noqa: E402
from tests.qt_helpers import shown  # noqa: E402

# Before the QApplication exists (conftest does it too; idempotent).
guard_pyside_bool_refcounts()
register_schemes()

LOAD_TIMEOUT_MS = 30_000
RELOAD_MS = 150  # the pane's throttle, shorter than the app's 500 ms to keep the test quick
# FakeEngineClient splits the answer on spaces into 6 deltas of 2 words: the ```html block grows over 5 of them.
ANSWER = ("Here is the page:\n\n```html\n<!DOCTYPE html>\n<html><body>\n<h1 id=t>Shopping list</h1>\n<ul>\n"
          "<li>apples</li> <li>pears</li> <li>plums</li> <li>figs</li>\n</ul>\n<script>document.title "
          "= 'done'</script>\n</body></html>\n```\nEnjoy!")
BODY_TEXT = "document.body ? document.body.innerText : ''"


@pytest.fixture
def window(qtbot, tmp_path):
    store = ChatStore(tmp_path / "chats.sqlite3")
    client = FakeEngineClient(blocks=6, pass_ms=1, answer=ANSWER)
    client.paused = True  # the test hands out the events
    pane = PreviewPane(reload_interval_ms=RELOAD_MS)
    win = MainWindow(client, store, StreamRecorder, model_dir="/models/tiny", preview=pane,
                     html_extractor=extract_html)
    # the window (and with it the pane, its page and profile) is destroyed while the QApplication is alive
    yield from shown(win, 1300, 800)
    store.close()


def js(qtbot, pane: PreviewPane, source: str):
    with qtbot.waitCallback(timeout=LOAD_TIMEOUT_MS) as callback:
        pane.page.runJavaScript(source, 0, callback)
    return callback.args[0]


@pytest.mark.webengine
def test_preview_follows_a_streaming_html_answer(qtbot, window: MainWindow) -> None:
    pane: PreviewPane = window.preview  # type: ignore[assignment]
    client: FakeEngineClient = window.client
    window.composer.input.setPlainText("a shopping list page")
    qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    message = window.chat.widgets[-1]
    client.emit_until(TextDelta)  # "Here is": no page yet
    window.chat.on_stream_refresh()
    assert not message.preview_button.isVisible()

    # The button appears on the streaming message, before Finished.
    client.emit_until(TextDelta, 2)  # ... "```html\n<!DOCTYPE html>\n<html><body>\n<h1 id=t>Shopping"
    qtbot.waitUntil(message.preview_button.isVisible, timeout=2000)
    assert window.is_generating() and message.data.status == "streaming"

    # Opened while streaming: the page so far, in its own origin.
    with qtbot.waitSignal(pane.loadFinished, timeout=LOAD_TIMEOUT_MS) as blocker:
        message.preview_button.click()
    assert blocker.args == [True]
    assert window.tabs.currentWidget() is pane
    assert pane.document_id() == f"message-{message.data.message_id}"
    assert "Shopping" in js(qtbot, pane, BODY_TEXT) and "apples" not in js(qtbot, pane, BODY_TEXT)

    # More deltas: the document follows (one throttled reload).
    client.emit_until(TextDelta)  # "... <li>apples</li> <li>pears</li>"
    assert pane.html() == extract_html(message.data.content) and pane.html().endswith("<li>pears</li>")
    qtbot.waitUntil(lambda: "pears" in js(qtbot, pane, BODY_TEXT), timeout=LOAD_TIMEOUT_MS)
    assert js(qtbot, pane, "document.querySelectorAll('li').length") == 2

    # The rest at once, within one throttle window: Finished shows the final page now, not a throttle tick later.
    final = extract_html(ANSWER)
    with qtbot.waitSignal(pane.loadFinished, timeout=LOAD_TIMEOUT_MS):
        with qtbot.waitSignal(window.generationFinished, timeout=2000):
            client.emit_until(Finished)
        assert pane.html() == final and final.endswith("</html>")
        assert pane.shown_html() == final  # flushed: no reload left pending
    assert js(qtbot, pane, "document.title") == "done"
    assert js(qtbot, pane, "document.querySelectorAll('li').length") == 4
    assert window.preview_follows is None and message.data.status == "complete"


PASTED = ("Why is my heading not red?\n\n<!DOCTYPE html>\n<html><head><style>h1 {color: red}</style></head>"
          "<body><h1 id=u>mine</h1></body></html>")


@pytest.mark.webengine
def test_a_page_the_user_pasted_previews_and_the_streaming_answer_does_not_take_it_over(qtbot, window) -> None:
    """Before: a user message had no Preview button. Opening it stops the preview following the answer in flight;
    the answer's next deltas and its end leave the user's page in place."""
    pane: PreviewPane = window.preview  # type: ignore[assignment]
    client: FakeEngineClient = window.client
    window.composer.input.setPlainText(PASTED)
    qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    question, answer = window.chat.widgets[-2], window.chat.widgets[-1]
    assert question.data.role == "user" and answer.data.status == "streaming"
    qtbot.waitUntil(question.preview_button.isVisible, timeout=2000)
    client.emit_until(TextDelta, 3)  # the answer's page has started
    window.chat.on_stream_refresh()
    qtbot.waitUntil(answer.preview_button.isVisible, timeout=2000)
    with qtbot.waitSignal(pane.loadFinished, timeout=LOAD_TIMEOUT_MS):
        answer.preview_button.click()
    assert window.preview_follows is answer.data

    with qtbot.waitSignal(pane.loadFinished, timeout=LOAD_TIMEOUT_MS) as blocker:
        question.preview_button.click()
    assert blocker.args == [True] and window.tabs.currentWidget() is pane
    assert window.preview_follows is None  # the user's page, not the answer, from now on
    assert pane.document_id() == preview_document_id(question.data) != preview_document_id(answer.data)
    assert js(qtbot, pane, "document.getElementById('u').innerText") == "mine"
    client.emit_until(TextDelta)
    with qtbot.waitSignal(window.generationFinished, timeout=2000):
        client.emit_until(Finished)
    assert pane.html() == extract_html(PASTED) and pane.document_id() == preview_document_id(question.data)
