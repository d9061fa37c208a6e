"""Model ▸ Backend…: answer from a remote OpenAI-compatible server (SGLang running Clover, another ``clover-desk
serve``, ...) instead of the local engine.

The remote client is a service handed in by the composition root (a :data:`~ui.contracts.RemoteFactory`, i.e.
``clover_desk.worker.remote.RemoteBackend``); ui never imports it. :class:`RemoteRunner` runs its blocking calls on Python
threads and posts what they yield to the GUI thread through a :class:`~ui.thread_bridge.ThreadBridge` (a thread never
touches a Qt object, so closing the window mid-answer cannot crash), where its signals speak like the engine client
(``event(request_id, event)``: ``TextDelta`` ..., then one remote finish or an ``EngineError``), so the window
streams a remote answer with the code that streams a local one. :class:`RemoteSettingsDialog` edits the settings,
remembered in the window's ``QSettings``: ``backend`` ("local" | "remote"), ``remote_url``, ``remote_api_key``,
``remote_model`` (empty: the first model the server lists); "Test connection" asks the server for its models.

What a remote server does not report is shown as "unavailable", never estimated: per-pass denoising never crosses an
OpenAI API, and passes, tokens per pass and the mode come only from a Clover Desk server (:func:`remote_stats_line`).
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from PySide6.QtCore import QObject, QSettings, Signal
from PySide6.QtWidgets import (
    QButtonGroup,
    QComboBox,
    QDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QRadioButton,
    QVBoxLayout,
    QWidget,
)

from clover_desk.engine.decode.events import EngineError, GenerationParams
from clover_desk.engine.errors import CloverError
from clover_desk.ui.contracts import RemoteFactory
from clover_desk.ui.messages import is_remote_finished  # noqa: F401 (re-exported; it moved there)
from clover_desk.ui.theme import set_style_class
from clover_desk.ui.thread_bridge import ThreadBridge
from clover_desk.ui.widgets import connect_each, named, push_button

log = logging.getLogger(__name__)

BACKENDS = ("local", "remote")
KEYS = ("backend", "remote_url", "remote_api_key", "remote_model")  # in the window's QSettings
DENOISING_UNAVAILABLE = ("Denoising unavailable (remote): a remote server sends the answer's text only; its "
                         "passes never cross the API.")
UNAVAILABLE = "unavailable"


def remote_stats_line(stats: dict[str, Any]) -> str:
    """"remote · 12 tokens · tok/s unavailable · tok/pass unavailable · first text 0.21 s here" from
    ``RemoteFinished.stats()``: every figure the server did not report is named as unavailable."""
    model = stats.get("model")
    parts = [f"remote ({model})" if model else "remote"]
    tokens = stats.get("tokens")
    parts.append(f"{tokens} tokens" if isinstance(tokens, int) else f"tokens {UNAVAILABLE}")
    rate = stats.get("tokens_per_s")
    parts.append(f"{rate:.1f} tok/s" if isinstance(rate, (int, float)) else f"tok/s {UNAVAILABLE}")
    per_pass = stats.get("tokens_per_pass")
    if stats.get("mode") != "ar":
        parts.append(f"{per_pass:.1f} tok/pass" if isinstance(per_pass, (int, float)) else f"tok/pass {UNAVAILABLE}")
    first = stats.get("client_first_token_s")
    if isinstance(first, (int, float)):
        parts.append(f"first text {first:.2f} s (measured here)")
    reason = stats.get("stop_reason")
    if reason == "cancelled":
        parts.append("stopped")
    elif reason in ("max_new_tokens", "context"):
        parts.append("hit the token limit" if reason == "max_new_tokens" else "hit the context limit")
    return " · ".join(parts)


class RemoteRunner(QObject):
    """Remote calls off the GUI thread. One answer at a time (the window sends one at a time).

    The threads run module functions (:func:`_run_chat`, :func:`_run_test`) handed plain Python objects only: what
    they yield goes through :attr:`bridge`, which emits the signals on the GUI thread, in order, while this runner
    lives (and drops it once the runner is deleted)."""

    event = Signal(str, object)  # (request id, TextDelta | remote finish | EngineError): as the engine client's
    connectionTested = Signal(bool, str, list)  # (ok, message, model ids) answering test_connection()

    def __init__(self, factory: RemoteFactory, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._factory = factory
        self.url = ""
        self.api_key = ""
        self.model = ""
        self._cancels: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self.bridge = ThreadBridge(self)

    def configure(self, url: str, api_key: str = "", model: str = "") -> None:
        self.url, self.api_key, self.model = url.strip(), api_key.strip(), model.strip()

    def generate(self, messages: Sequence[dict[str, Any]], params: GenerationParams,
                 tools: Sequence[dict[str, Any]] | None = None) -> str:
        """Start streaming an answer; returns its request id (its events arrive as ``event(id, ...)``)."""
        request_id = "remote-" + uuid.uuid4().hex[:12]
        cancel = threading.Event()
        with self._lock:
            self._cancels[request_id] = cancel
        self.bridge.spawn(_run_chat, functools.partial(self.bridge.post, self.event, request_id), self._factory,
                          (self.url, self.api_key, self.model), list(messages), params, tools, cancel,
                          functools.partial(_forget, self._lock, self._cancels, request_id), name="clover-remote")
        return request_id

    def cancel(self, request_id: str | None = None) -> None:
        """Stop an answer (default: every one running): the connection is closed, which makes a Clover Desk server
        stop generating; the answer ends with its remote finish, ``finish_reason`` "cancelled"."""
        with self._lock:
            targets = [self._cancels[request_id]] if request_id in self._cancels else (
                list(self._cancels.values()) if request_id is None else [])
        for cancel in targets:
            cancel.set()

    def test_connection(self, url: str, api_key: str = "", model: str = "") -> None:
        """Ask the server for its models; the answer is ``connectionTested``."""
        self.bridge.spawn(_run_test, functools.partial(self.bridge.post, self.connectionTested), self._factory,
                          url.strip(), api_key.strip(), model.strip(), name="clover-remote")

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Cancel what runs and wait (briefly) for the threads (on quit)."""
        self.cancel()
        self.bridge.join(timeout_s)


# ---- threads (no Qt here: ``post`` hands the GUI thread what to emit) ----


def _backend(factory: RemoteFactory, url: str, api_key: str, model: str) -> Any:
    return factory(url, api_key or None, model or None)


def _forget(lock: threading.Lock, cancels: dict[str, threading.Event], request_id: str) -> None:
    with lock:
        cancels.pop(request_id, None)


def _run_chat(post: Any, factory: RemoteFactory, where: tuple[str, str, str], messages: list[dict[str, Any]],
              params: GenerationParams, tools: Any, cancel: threading.Event, forget: Any) -> None:
    """Stream one answer: ``post(event)`` for each event, in order, ending with the finish or an ``EngineError``."""
    try:
        backend = _backend(factory, *where)
        for event in backend.chat(messages, params, tools, cancel):
            post(event)
    except CloverError as exc:  # RemoteError: cannot reach, refused, not an answer
        post(EngineError("RemoteError", str(exc)))
    except Exception as exc:  # noqa: BLE001 - a bug must end the answer, not hang it
        log.exception("remote answer failed")
        post(EngineError(type(exc).__name__, f"remote answer failed: {exc}"))
    finally:
        forget()


def _run_test(post: Any, factory: RemoteFactory, url: str, api_key: str, model: str) -> None:
    """Ask for the models: ``post(ok, message, model ids)`` once."""
    try:
        models = list(_backend(factory, url, api_key, model).models())
    except CloverError as exc:
        post(False, str(exc), [])
        return
    except Exception as exc:  # noqa: BLE001 - reported to the user
        log.exception("testing the remote connection failed")
        post(False, f"{type(exc).__name__}: {exc}", [])
        return
    if not models:
        post(False, f"{url} answers, but lists no model", [])
        return
    if model and model not in models:
        post(False, f"connected, but the server has no model {model!r} (it has: {', '.join(models)})", models)
        return
    shown = ", ".join(models[:5]) + (" …" if len(models) > 5 else "")
    post(True, f"Connected: {len(models)} model{'s' if len(models) != 1 else ''} ({shown})", models)


class RemoteSettingsDialog(QDialog):
    """Local engine or remote server, where the server is, and a connection test."""

    changed = Signal()  # a setting changed (read them back with values())
    testRequested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("remoteDialog")
        self.setWindowTitle("Backend: local engine or remote server")
        self.setModal(False)
        self.local = QRadioButton("&Local engine (the model runs on this computer)")
        self.local.setObjectName("backendLocal")
        self.remote = QRadioButton("&Remote server (OpenAI-compatible: SGLang, vLLM, clover-desk serve …)")
        self.remote.setObjectName("backendRemote")
        self.group = QButtonGroup(self)
        self.group.addButton(self.local)
        self.group.addButton(self.remote)
        self.local.setChecked(True)
        self.url = named(QLineEdit(), "remoteUrl", "Remote server URL")
        self.url.setPlaceholderText("http://127.0.0.1:30000/v1")
        self.api_key = named(QLineEdit(), "remoteKey", "Remote API key")
        self.api_key.setEchoMode(QLineEdit.EchoMode.PasswordEchoOnEdit)
        self.api_key.setPlaceholderText("none")
        self.model = named(QComboBox(), "remoteModel", "Remote model")
        self.model.setEditable(True)
        self.model.lineEdit().setPlaceholderText("the first model the server lists")
        self.test_button = push_button("Test connection", "remoteTest", clicked=self.testRequested)
        self.status = QLabel()
        self.status.setObjectName("remoteStatus")
        self.status.setWordWrap(True)
        note = QLabel("A remote server sends the answer's text; the denoising view and any figure it does not "
                      "report (passes, tokens per pass, speed) show as unavailable.")
        note.setWordWrap(True)
        set_style_class(note, "muted")
        self.close_button = push_button("Close", "remoteClose", style="ghost", clicked=self.hide)
        form = QFormLayout()
        form.addRow("&URL", self.url)
        form.addRow("API &key", self.api_key)
        form.addRow("&Model", self.model)
        buttons = QHBoxLayout()
        buttons.addWidget(self.test_button)
        buttons.addStretch(1)
        buttons.addWidget(self.close_button)
        layout = QVBoxLayout(self)
        layout.addWidget(self.local)
        layout.addWidget(self.remote)
        layout.addLayout(form)
        layout.addWidget(self.status)
        layout.addWidget(note)
        layout.addLayout(buttons)
        self._connect_signals()
        self._update_enabled()

    def _connect_signals(self) -> None:
        connect_each(self.on_any_changed, self.remote.toggled, self.url.editingFinished, self.api_key.editingFinished,
                     self.model.currentTextChanged)

    def values(self) -> dict[str, str]:
        return {"backend": "remote" if self.remote.isChecked() else "local", "remote_url": self.url.text().strip(),
                "remote_api_key": self.api_key.text().strip(), "remote_model": self.model.currentText().strip()}

    def set_values(self, values: dict[str, str]) -> None:
        """Show ``values`` without emitting :attr:`changed` (they are not an edit)."""
        widgets = (self.remote, self.local, self.url, self.api_key, self.model)
        for w in widgets:
            w.blockSignals(True)
        (self.remote if values.get("backend") == "remote" else self.local).setChecked(True)
        self.url.setText(values.get("remote_url", ""))
        self.api_key.setText(values.get("remote_api_key", ""))
        self.model.setEditText(values.get("remote_model", ""))
        for w in widgets:
            w.blockSignals(False)
        self._update_enabled()

    def set_models(self, models: Sequence[str]) -> None:
        current = self.model.currentText()
        self.model.blockSignals(True)
        self.model.clear()
        self.model.addItems(list(models))
        self.model.setEditText(current)
        self.model.blockSignals(False)

    def _update_enabled(self) -> None:
        on = self.remote.isChecked()
        for widget in (self.url, self.api_key, self.model):
            widget.setEnabled(on)

    def on_any_changed(self, *_args: object) -> None:
        self._update_enabled()
        self.changed.emit()


class RemoteBackendControl(QObject):
    """The remote settings (remembered), their dialog and the runner, for the window."""

    changed = Signal()  # the backend or the server changed: Send's state and the status bar follow

    def __init__(self, factory: RemoteFactory, settings: QSettings | None = None, parent: QWidget | None = None
                 ) -> None:
        super().__init__(parent)
        self.settings = settings
        self.runner = RemoteRunner(factory, self)
        self.dialog = RemoteSettingsDialog(parent)
        self.dialog.set_values(self._stored())
        self._apply()
        self.dialog.changed.connect(self.on_dialog_changed)
        self.dialog.testRequested.connect(self.on_test_requested)
        self.runner.connectionTested.connect(self.on_connection_tested)

    def _stored(self) -> dict[str, str]:
        if self.settings is None:
            return {}
        values = {key: str(self.settings.value(key, "") or "") for key in KEYS}
        if values["backend"] not in BACKENDS:
            values["backend"] = "local"
        return values

    def _apply(self) -> None:
        v = self.dialog.values()
        self.runner.configure(v["remote_url"], v["remote_api_key"], v["remote_model"])

    @property
    def selected(self) -> bool:
        """The user chose the remote server (Send goes there, whatever the local engine does)."""
        return self.dialog.values()["backend"] == "remote"

    def why_not_ready(self) -> str:
        """Why a remote Send cannot go out ("" when it can)."""
        if not self.dialog.values()["remote_url"]:
            return "Set the remote server's URL first (Model ▸ Backend…), or switch back to the local engine."
        return ""

    def model_name(self) -> str:
        """The model asked of the server ("" when the server picks)."""
        return self.dialog.values()["remote_model"]

    def host(self) -> str:
        url = self.dialog.values()["remote_url"]
        return urlsplit(url).netloc or url

    def open(self) -> None:
        self.dialog.show()
        self.dialog.raise_()
        self.dialog.activateWindow()

    def shutdown(self) -> None:
        self.runner.shutdown()

    def on_dialog_changed(self) -> None:
        values = self.dialog.values()
        if self.settings is not None:
            for key, value in values.items():
                self.settings.setValue(key, value)
            self.settings.sync()
        self._apply()
        self.changed.emit()

    def on_test_requested(self) -> None:
        v = self.dialog.values()
        if not v["remote_url"]:
            self.dialog.status.setText("Enter the server's URL first (for example http://127.0.0.1:30000/v1).")
            return
        self.on_dialog_changed()  # what is tested is what is kept
        self.dialog.test_button.setEnabled(False)
        self.dialog.status.setText(f"Connecting to {v['remote_url']} …")
        self.runner.test_connection(v["remote_url"], v["remote_api_key"], v["remote_model"])

    def on_connection_tested(self, ok: bool, message: str, models: list) -> None:
        self.dialog.test_button.setEnabled(True)
        if models:
            self.dialog.set_models([str(m) for m in models])
        self.dialog.status.setText(message if ok else f"Cannot use this server: {message}")
        set_style_class(self.dialog.status, "okText" if ok else "dangerText")
