"""Model ▸ Serve over HTTP… in the real window: the composition root's window over a real EngineClient, whose worker
process serves the scripted tiny model it loaded; the official ``openai`` client talks to it over 127.0.0.1.

What is checked: Start shows the address (status bar, copyable), an HTTP client gets answers while the window is
open, the window's answer and an HTTP answer take turns and keep their own text, Stop frees the port, a port in
use is said plainly, a restarted engine serves again, and listening beyond this machine without a key is warned
about.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
from gui_desk import running_desk
from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication
from server_fixtures import endless_model, port_is_free  # noqa: F401 (session fixture)

from clover_desk.engine.decode.events import Finished, PromptInfo, TextDelta
from clover_desk.qt_compat import guard_pyside_bool_refcounts
from clover_desk.ui.serve_panel import ServeDialog, exposure_warning, is_loopback

guard_pyside_bool_refcounts()

LOAD_MS = 90_000
GEN_MS = 90_000
USER = [{"role": "user", "content": "hello"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def desk(qapp, endless_model, tmp_path_factory):  # noqa: F811
    from clover_desk.app import AppSettings

    def prepare(app: Any) -> None:
        d = app.window.drawer  # short answers in AR mode, thinking off: "tick tock tick tock ..."
        d.thinking.setChecked(False)
        d.mode.setCurrentIndex(d.mode.findData("ar"))
        d.max_tokens.setValue(16)
        app.events = []
        app.client.event.connect(lambda rid, ev: app.events.append((time.monotonic(), rid, ev)))

    with running_desk(tmp_path_factory.mktemp("serve_home"), AppSettings(model_dir=str(endless_model.path)),
                      load_ms=LOAD_MS, size=(1200, 800), prepare=prepare, with_model_manager=False) as app:
        yield app


def _start(qtbot, window, port: int = 0, key: str = "", host: str = "127.0.0.1") -> str:
    dialog = window.serve.dialog
    window.menus.serve_action.trigger()
    assert dialog.isVisible()
    dialog.host.setText(host)
    dialog.port.setValue(port)
    dialog.api_key.setText(key)
    with qtbot.waitSignal(window.client.serving, timeout=30_000) as blocker:
        qtbot.mouseClick(dialog.start_button, Qt.MouseButton.LeftButton)
    return blocker.args[0]


def _stop(qtbot, window) -> None:
    with qtbot.waitSignal(window.client.serveStopped, timeout=30_000):
        qtbot.mouseClick(window.serve.dialog.stop_button, Qt.MouseButton.LeftButton)


def _openai(url: str, key: str = "unused") -> Any:
    import openai

    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)


def test_serve_from_the_window_answers_http_and_takes_turns_with_the_window(qtbot, desk) -> None:
    import openai

    window = desk.window
    url = _start(qtbot, window, key="k3y")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    assert url == f"http://127.0.0.1:{port}/v1"
    # the address: in the dialog and the status bar, copyable
    assert window.serve.dialog.address.text() == url
    assert window.serve.button.isVisible() and url in window.serve.button.text()
    qtbot.mouseClick(window.serve.button, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text() == url
    assert not window.serve.dialog.warning.isVisible()  # loopback: nothing to warn about
    policy = window.serve.dialog.policy  # whom it answers (issue 31), as the worker says
    assert policy.isVisible() and "loopback names" in policy.text() and "pages on this machine" in policy.text()

    # an HTTP answer streams while the window is open ...
    http: dict[str, Any] = {"times": [], "text": [], "error": None}
    first = threading.Event()

    def stream() -> None:
        try:
            chunks = _openai(url, "k3y").chat.completions.create(
                model="any", messages=USER, max_tokens=120, stream=True,
                extra_body={**NO_THINKING, "clover": {"mode": "ar"}})
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    http["times"].append(time.monotonic())
                    http["text"].append(chunk.choices[0].delta.content)
                    first.set()
        except Exception as exc:  # noqa: BLE001 - reported below
            http["error"] = exc
        finally:
            first.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    qtbot.waitUntil(first.is_set, timeout=GEN_MS)
    assert http["error"] is None, http["error"]
    # ... and the window's message, sent meanwhile, waits for it, then gets its own answer
    window.composer.input.setPlainText("Your turn")
    with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS) as finished:
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    thread.join(60)
    assert http["error"] is None
    rid, reason = finished.args
    assert reason == "max_new_tokens"
    began = min(t for t, r, ev in desk.events if r == rid and isinstance(ev, (PromptInfo, TextDelta)))
    before = sum(1 for t in http["times"] if t < began)
    print(f"\nHTTP answer: {len(http['times'])} chunks, {before} of them before the window's answer began")
    assert len(http["times"]) > 30 and before >= len(http["times"]) - 3
    answer = desk.store.messages(window.conversation_id)[-1]
    done = [ev for _, r, ev in desk.events if r == rid and isinstance(ev, Finished)][0]
    assert answer.content == done.text and answer.content.startswith("tick tock")
    assert "".join(http["text"]).startswith("tick tock tick tock")
    with pytest.raises(openai.AuthenticationError):
        _openai(url, "wrong").models.list()

    # Stop frees the port
    _stop(qtbot, window)
    assert not window.serve.button.isVisible() and window.serve.dialog.address.text() == ""
    assert window.client.server_url is None
    assert port_is_free(port)
    with pytest.raises(openai.APIConnectionError):
        _openai(url, "k3y").models.list()


def test_a_port_in_use_is_said_plainly(qtbot, desk) -> None:
    window = desk.window
    dialog = window.serve.dialog
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        window.menus.serve_action.trigger()
        dialog.port.setValue(port)
        with qtbot.waitSignal(window.client.serveFailed, timeout=30_000):
            qtbot.mouseClick(dialog.start_button, Qt.MouseButton.LeftButton)
    assert dialog.isVisible() and str(port) in dialog.status.text() and "Not serving" in dialog.status.text()
    assert dialog.start_button.isEnabled() and not window.serve.button.isVisible()
    assert window.engine_status.engine_label.text() == "● Ready"  # the engine itself is fine


def test_a_restarted_engine_serves_again(qtbot, desk) -> None:
    window = desk.window
    port = _free_port()
    url = _start(qtbot, window, port=port)
    with qtbot.waitSignal(window.client.loaded, timeout=LOAD_MS):
        with qtbot.waitSignals([window.client.serveStopped, window.client.serving], timeout=LOAD_MS, order="strict"):
            window.engine_status.on_restart_clicked()
    assert window.client.server_url == url and window.serve.button.isVisible()
    assert [m.id for m in _openai(url).models.list().data] == [desk.settings.model_dir.rsplit("/", 1)[1]]
    _stop(qtbot, window)
    assert port_is_free(port)


def test_listening_beyond_this_machine_without_a_key_is_warned_about(qtbot) -> None:
    dialog = ServeDialog()
    qtbot.addWidget(dialog)
    dialog.show()
    dialog.host.setText("0.0.0.0")
    assert dialog.warning.isVisible() and "anyone who can reach this computer" in dialog.warning.text()
    qtbot.mouseClick(dialog.new_key_button, Qt.MouseButton.LeftButton)
    assert len(dialog.api_key.text()) >= 24 and not dialog.warning.isVisible()
    dialog.api_key.clear()
    dialog.host.setText("localhost")
    assert not dialog.warning.isVisible()
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("[::1]") and is_loopback("127.8.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.20") and not is_loopback("example.org")
    assert exposure_warning("192.168.1.20", "") and not exposure_warning("192.168.1.20", "key")


def test_the_client_answers_every_serve_request(qtbot) -> None:
    """start_server / stop_server always end in a signal, also without a worker or without a server."""
    from clover_desk.worker.client import EngineClient

    client = EngineClient(worker_args=["--engine-factory", "tests.fake_engine:make"])
    try:
        with qtbot.waitSignal(client.serveFailed, timeout=5000) as failed:
            client.start_server("127.0.0.1", 0)  # no worker yet
        assert "not running" in failed.args[0]
        with qtbot.waitSignal(client.ready, timeout=60_000):
            client.start()
        with qtbot.assertNotEmitted(client.serving, wait=300):  # the refused request is not sent later
            pass
        assert client.server_url is None
        with qtbot.waitSignal(client.serveStopped, timeout=10_000):
            client.stop_server()  # nothing serves: still answered
        with qtbot.waitSignal(client.serving, timeout=10_000) as serving:
            client.start_server("127.0.0.1", 0)  # no model loaded: the server answers 503 until one is
        assert client.server_url == serving.args[0]
        with qtbot.waitSignal(client.serveStopped, timeout=15_000):
            client.shutdown()  # the worker takes its server with it
        assert client.server_url is None
    finally:
        if client.state != "stopped":
            client.shutdown(wait_ms=5000)
