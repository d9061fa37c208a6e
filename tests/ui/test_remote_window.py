"""Model ▸ Backend…: the real window (built by the composition root) answering through a remote OpenAI-compatible
server: a real ``clover-desk serve`` (OpenAIServer over a scripted tiny model, tests/server_fixtures.py) stands in
for SGLang, and a bare OpenAI-style server that reports nothing but text stands in for one that sends no figures.

The local engine is never started here: a remote answer needs no local model.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtCore import QSettings, Qt
from server_fixtures import (  # noqa: F401 (session fixtures)
    chat_model,
    chat_server,
    endless_model,
    endless_server,
    running_server,
    wait_idle,
)

from clover_desk.engine.decode.events import TextDelta
from clover_desk.qt_compat import guard_pyside_bool_refcounts
from clover_desk.ui.chat_view import stats_line
from clover_desk.ui.contracts import EngineState
from clover_desk.ui.remote_chat import DENOISING_UNAVAILABLE, remote_stats_line
from clover_desk.worker.remote import RemoteFinished

guard_pyside_bool_refcounts()

GEN_MS = 60_000


def _make_app(home: Path) -> Any:
    from clover_desk.app import AppSettings, CloverDeskApp

    app = CloverDeskApp(home, settings=AppSettings(), with_preview=False, with_model_manager=False,
                        start_engine=False)
    app.window.resize(1200, 800)
    app.window.show()
    return app


@pytest.fixture
def desk(qapp, tmp_path) -> Iterator[Any]:
    app = _make_app(tmp_path / "home")
    yield app
    app.shutdown(wait_ms=2000)
    app.window.close()


def _choose_remote(qtbot, window, url: str, key: str = "", model: str = "") -> Any:
    window.menus.backend_action.trigger()
    dialog = window.remote.dialog
    assert dialog.isVisible()
    qtbot.mouseClick(dialog.remote, Qt.MouseButton.LeftButton)
    for field, text in ((dialog.url, url), (dialog.api_key, key)):
        field.setText(text)
        field.editingFinished.emit()
    dialog.model.setEditText(model)
    return dialog


def _test_connection(qtbot, window) -> tuple[bool, str]:
    dialog = window.remote.dialog
    with qtbot.waitSignal(window.remote.runner.connectionTested, timeout=30_000) as blocker:
        qtbot.mouseClick(dialog.test_button, Qt.MouseButton.LeftButton)
    return blocker.args[0], dialog.status.text()


def _send(qtbot, window, text: str) -> tuple[str, str]:
    window.composer.input.setPlainText(text)
    with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS) as blocker:
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    return blocker.args[0], blocker.args[1]


def test_remote_settings_are_remembered_and_tested(qtbot, tmp_path, chat_server, chat_model) -> None:  # noqa: F811
    home = tmp_path / "home"
    app = _make_app(home)
    window = app.window
    assert window.engine_status.state is EngineState.NO_MODEL and not window.composer.send_button.isEnabled()
    dialog = _choose_remote(qtbot, window, chat_server.url, key="k1", model="")
    ok, status = _test_connection(qtbot, window)
    assert ok and "Connected: 1 model" in status and chat_model.path.name in status
    assert [dialog.model.itemText(i) for i in range(dialog.model.count())] == [chat_model.path.name]
    dialog.model.setCurrentIndex(0)
    ini = QSettings(str(home / "window.ini"), QSettings.Format.IniFormat)
    assert (ini.value("backend"), ini.value("remote_url"), ini.value("remote_api_key"), ini.value("remote_model")) \
        == ("remote", chat_server.url, "k1", chat_model.path.name)
    # no local model, yet Send works: the remote answers
    assert window.composer.send_button.isEnabled() and window.engine_status.engine_label.text().startswith("● Remote: 127.0.0.1:")
    app.shutdown(wait_ms=2000)
    window.close()

    again = _make_app(home)  # the next run of the app
    try:
        assert again.window.remote.dialog.values() == {"backend": "remote", "remote_url": chat_server.url,
                                                       "remote_api_key": "k1", "remote_model": chat_model.path.name}
        assert again.window.composer.send_button.isEnabled()
        qtbot.mouseClick(again.window.remote.dialog.local, Qt.MouseButton.LeftButton)  # back to the local engine
        assert not again.window.composer.send_button.isEnabled()
        assert QSettings(str(home / "window.ini"), QSettings.Format.IniFormat).value("backend") == "local"
    finally:
        again.shutdown(wait_ms=2000)
        again.window.close()


def test_test_connection_shows_the_servers_refusal(qtbot, desk, chat_model) -> None:  # noqa: F811
    window = desk.window
    with running_server(chat_model.path, api_key="right") as server:
        _choose_remote(qtbot, window, server.url, key="wrong")
        ok, status = _test_connection(qtbot, window)
        assert not ok and "Cannot use this server" in status and "HTTP 401" in status and "API key" in status
        _choose_remote(qtbot, window, server.url, key="right", model="no-such-model")
        ok, status = _test_connection(qtbot, window)
        assert not ok and "no-such-model" in status and chat_model.path.name in status
    _choose_remote(qtbot, window, server.url, key="right")  # the server is gone now
    ok, status = _test_connection(qtbot, window)
    assert not ok and "cannot reach" in status


def test_a_message_streams_from_the_remote_server(qtbot, desk, chat_server) -> None:  # noqa: F811
    window = desk.window
    _choose_remote(qtbot, window, chat_server.url).hide()
    shown: list[tuple[str, str]] = []  # what the chat showed after each delta the window was handed

    def on_event(rid: str, event: object) -> None:
        if isinstance(event, TextDelta) and window.reply_data is not None and rid == window.request_id:
            shown.append((window.reply_data.thinking, window.reply_data.content))

    window.remote.runner.event.connect(on_event)
    rid, reason = _send(qtbot, window, "Hello there")
    assert rid.startswith("remote-") and reason == "eos"
    assert len(shown) >= 2 and shown[-1] == ("Let me think", "Sure thing.")  # streamed, not delivered at the end
    message = desk.store.messages(window.conversation_id)[-1]
    assert (message.status, message.content, message.thinking) == ("complete", "Sure thing.", "Let me think")
    stats = message.stats
    assert stats["backend"] == "remote" and stats["model"] == Path(chat_server.service.model_id).name
    assert isinstance(stats["passes"], int) and isinstance(stats["tokens"], int) and stats["tokens"] > 0
    assert window.chat.widgets[-1].data.stats == stats
    assert window.denoise.position_label.text() == DENOISING_UNAVAILABLE
    assert window.engine_status.speed_label.text().endswith("tok/s (remote)")
    assert window.engine_status.hit_label.text() == "Expert cache unavailable (remote)"
    assert stats_line(stats).startswith("remote (") and "unavailable" not in stats_line(stats)


def test_esc_cancels_a_remote_answer_and_the_server_stops(qtbot, desk, endless_server) -> None:  # noqa: F811
    window = desk.window
    _choose_remote(qtbot, window, endless_server.url).hide()
    window.drawer.thinking.setChecked(False)  # "tick tock tick tock ..." for ever
    window.drawer.max_tokens.setValue(2000)
    before = wait_idle(endless_server)["cancelled"]
    window.composer.input.setPlainText("Go on forever")
    qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: window.reply_data is not None and "tick tock" in window.reply_data.content,
                    timeout=GEN_MS)
    with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS) as blocker:
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Escape)
    assert blocker.args[1] == "cancelled"
    message = desk.store.messages(window.conversation_id)[-1]
    assert message.status == "stopped" and message.content.startswith("tick tock")
    assert wait_idle(endless_server, timeout_s=30)["cancelled"] == before + 1  # the server stopped generating
    # Continue is the local engine's (a remote server would start a new answer): not offered for this one
    widget = window.chat.widgets[-1]
    assert widget.regen_button.isVisible() and not widget.continue_button.isVisible()
    assert not window.menus.continue_action.isEnabled()
    window.menus.continue_action.trigger()
    widget.continueRequested.emit(widget)
    assert not window.is_generating() and desk.store.messages(window.conversation_id)[-1].status == "stopped"


def test_an_unreachable_server_ends_the_answer_with_its_reason(qtbot, desk) -> None:
    import socket

    window = desk.window
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    _choose_remote(qtbot, window, f"http://127.0.0.1:{port}/v1").hide()
    _, reason = _send(qtbot, window, "Anyone?")
    assert reason == "error"
    message = desk.store.messages(window.conversation_id)[-1]
    assert message.status == "error" and "RemoteError" in message.stats["error"]
    assert "cannot reach" in message.stats["error"]
    assert window.composer.send_button.isEnabled()  # ready for the next try


class _PlainOpenAI(BaseHTTPRequestHandler):
    """An OpenAI-style server that streams text only: no usage, no "clover" object (as many servers do)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        return

    def _send(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        self._send(json.dumps({"object": "list", "data": [{"id": "plain-model", "object": "model"}]}).encode(),
                   "application/json")

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        chunks = [{"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
                  for piece in ("Hel", "lo ", "there")]
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
        self._send(body, "text/event-stream")


def test_figures_a_server_does_not_report_show_as_unavailable(qtbot, desk) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _PlainOpenAI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        window = desk.window
        _choose_remote(qtbot, window, f"http://127.0.0.1:{server.server_address[1]}/v1").hide()
        _, reason = _send(qtbot, window, "Hi")
    finally:
        server.shutdown()
        server.server_close()
    assert reason == "eos"
    message = desk.store.messages(window.conversation_id)[-1]
    assert message.content == "Hello there" and message.status == "complete"
    stats = message.stats
    assert stats["model"] == "plain-model"
    for key in ("tokens", "prompt_tokens", "passes", "tokens_per_pass", "tokens_per_s", "mode"):
        assert stats[key] is None, key  # not reported: never estimated
    line = stats_line(stats)
    assert "tokens unavailable" in line and "tok/s unavailable" in line and "tok/pass unavailable" in line
    assert window.engine_status.speed_label.text() == "tok/s unavailable (remote)"
    assert window.denoise.position_label.text() == DENOISING_UNAVAILABLE


def test_remote_stats_keep_what_was_reported() -> None:
    done = RemoteFinished(text="x", thinking="", tool_calls=(), finish_reason="length", model="m", prompt_tokens=5,
                          completion_tokens=7, passes=None, tokens_per_pass=None, mode="ar", client_elapsed_s=1.25,
                          client_first_token_s=0.5)
    stats = done.stats()
    assert stats["stop_reason"] == "max_new_tokens" and stats["tokens"] == 7 and stats["passes"] is None
    assert remote_stats_line(stats) == ("remote (m) · 7 tokens · tok/s unavailable · first text 0.50 s (measured "
                                        "here) · hit the token limit")
