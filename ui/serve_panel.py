"""Model ▸ Serve over HTTP…: the engine worker's OpenAI-compatible server, started and stopped from the window.

The server runs inside the engine worker, over the model the window uses (a second process would load a second copy
of it); window and HTTP answers take turns. :class:`ServeDialog` edits where it listens (host, port, optional API
key) and warns when it would be reachable from other machines without a key; :class:`ServeController` wires it to
a :class:`~ui.contracts.ServerControl` (the engine client) and keeps the status-bar button that shows the address
(click: copied to the clipboard).

Host and port are remembered in the window's ``QSettings`` (``serve/host``, ``serve/port``); the key is not.
"""

from __future__ import annotations

import ipaddress
import secrets

from PySide6.QtCore import QObject, QSettings, Qt, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from clover_desk.ui.contracts import ServerControl
from clover_desk.ui.theme import set_style_class
from clover_desk.ui.widgets import accessible, connect_each, named, push_button

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (127.0.0.0/8, ::1, "localhost")."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, api_key: str) -> str:
    """The warning for a server other machines can reach without a key ("" when there is none to give)."""
    if not host.strip() or is_loopback(host) or api_key.strip():
        return ""
    return (f"Listening on {host.strip()} needs an API key: without one, anyone who can reach this computer could use "
            "the model. Set a key (New key), or listen on 127.0.0.1 (this computer only).")


class ServeDialog(QDialog):
    """Where to listen, Start / Stop, and the address once serving. Not modal: the chat stays usable."""

    startRequested = Signal(str, int, str)  # (host, port, api_key or "")
    stopRequested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("serveDialog")
        self.setWindowTitle("Serve over HTTP")
        self.setModal(False)
        intro = QLabel("Other programs can use the loaded model through an OpenAI-compatible API "
                       "(<code>/v1/chat/completions</code>, <code>/v1/completions</code>, <code>/v1/models</code>) "
                       "while this window stays open. The window's answers and theirs take turns.")
        intro.setWordWrap(True)
        self.host = named(
            QLineEdit(DEFAULT_HOST), "serveHost", "Listen on host", tip="127.0.0.1: this computer only; 0.0.0.0: every network interface",
        )
        self.port = named(QSpinBox(), "servePort", "Port")
        self.port.setRange(0, 65535)
        self.port.setValue(DEFAULT_PORT)
        self.port.setSpecialValueText("any free port")
        self.api_key = named(
            QLineEdit(), "serveKey", "API key", tip="Clients then send 'Authorization: Bearer KEY' (the api_key of the openai client)",
        )
        self.api_key.setEchoMode(QLineEdit.EchoMode.PasswordEchoOnEdit)
        self.api_key.setPlaceholderText("none")
        self.new_key_button = push_button("New key", "serveNewKey", style="ghost", name="Make a random API key",
                                          clicked=self.on_new_key)
        self.warning = QLabel()
        self.warning.setObjectName("serveWarning")
        self.warning.setWordWrap(True)
        set_style_class(self.warning, "warnText")
        self.policy = QLabel()  # whom the server answers (its Host / Origin policy), while it serves
        self.policy.setObjectName("servePolicy")
        self.policy.setWordWrap(True)
        self.policy.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.status = QLabel("Not serving.")
        self.status.setObjectName("serveStatus")
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.address = named(QLineEdit(), "serveAddress", "Server address")
        self.address.setReadOnly(True)
        self.address.setPlaceholderText("the base URL appears here once serving")
        self.copy_button = push_button("Copy", "serveCopy", name="Copy the server address", clicked=self.on_copy)
        self.start_button = push_button("Start serving", "serveStart", style="primary", clicked=self.on_start_clicked)
        self.stop_button = push_button("Stop", "serveStop", clicked=self.stopRequested)
        self.close_button = push_button("Close", "serveClose", style="ghost", clicked=self.hide)

        key_row = QHBoxLayout()
        key_row.addWidget(self.api_key, 1)
        key_row.addWidget(self.new_key_button)
        address_row = QHBoxLayout()
        address_row.addWidget(self.address, 1)
        address_row.addWidget(self.copy_button)
        form = QFormLayout()
        form.addRow("&Host", self.host)
        form.addRow("&Port", self.port)
        key_label = QLabel("API &key")  # (a row of a layout gets no buddy from addRow: the "&" would show)
        key_label.setBuddy(self.api_key)
        form.addRow(key_label, key_row)
        form.addRow("Address", address_row)
        buttons = QHBoxLayout()
        buttons.addWidget(self.start_button)
        buttons.addWidget(self.stop_button)
        buttons.addStretch(1)
        buttons.addWidget(self.close_button)
        layout = QVBoxLayout(self)
        layout.addWidget(intro)
        layout.addLayout(form)
        layout.addWidget(self.warning)
        layout.addWidget(self.status)
        layout.addWidget(self.policy)
        layout.addLayout(buttons)
        self._connect_signals()
        self.set_state("stopped")
        self.on_fields_changed()

    def _connect_signals(self) -> None:
        connect_each(self.on_fields_changed, self.host.textChanged, self.api_key.textChanged)

    def set_state(self, state: str, text: str = "", url: str = "", policy: str = "") -> None:
        """``state``: "stopped" | "starting" | "serving" | "stopping"; ``text`` replaces the default status line;
        ``policy``: whom the server answers (shown while serving)."""
        self.policy.setText(f"Answers: {policy}" if state == "serving" and policy else "")
        self.policy.setVisible(state == "serving" and bool(policy))
        editable = state == "stopped"
        for widget in (self.host, self.port, self.api_key, self.new_key_button):
            widget.setEnabled(editable)
        self.start_button.setEnabled(editable)
        self.stop_button.setEnabled(state in ("serving", "starting"))
        self.address.setText(url if state == "serving" else "")
        self.copy_button.setEnabled(state == "serving")
        default = {"stopped": "Not serving.", "starting": "Starting…", "serving": f"Serving at {url}",
                   "stopping": "Stopping…"}[state]
        self.status.setText(text or default)

    def on_fields_changed(self, *_args: object) -> None:
        text = exposure_warning(self.host.text(), self.api_key.text())
        self.warning.setText(text)
        self.warning.setVisible(bool(text))

    def on_new_key(self) -> None:
        self.api_key.setText(secrets.token_urlsafe(24))

    def on_copy(self) -> None:
        if self.address.text():
            QGuiApplication.clipboard().setText(self.address.text())
            self.status.setText(f"Copied {self.address.text()}")

    def on_start_clicked(self) -> None:
        host = self.host.text().strip() or DEFAULT_HOST
        self.host.setText(host)
        self.startRequested.emit(host, int(self.port.value()), self.api_key.text().strip())


class ServeController(QObject):
    """The dialog, the status-bar address button and the engine client's server, kept in step."""

    def __init__(self, control: ServerControl, dialog: ServeDialog, status_button: QPushButton,
                 settings: QSettings | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.control = control
        self.dialog = dialog
        self.button = status_button
        self.settings = settings
        self._asked: tuple[str, str] = ("", "")  # (host, key) of the last start: for the exposure note
        self.button.setObjectName("serveStatusButton")
        set_style_class(self.button, "ghost")
        self.button.setToolTip("The HTTP server's address (click to copy it)")
        accessible(self.button, "HTTP server address")
        self.button.hide()
        if settings is not None:
            self.dialog.host.setText(str(settings.value("serve/host", DEFAULT_HOST)) or DEFAULT_HOST)
            try:
                self.dialog.port.setValue(int(settings.value("serve/port", DEFAULT_PORT)))
            except (TypeError, ValueError):
                self.dialog.port.setValue(DEFAULT_PORT)
        self._connect_signals()
        if control.server_url:
            self.on_serving(control.server_url)

    def _connect_signals(self) -> None:
        self.dialog.startRequested.connect(self.on_start_requested)
        self.dialog.stopRequested.connect(self.on_stop_requested)
        self.button.clicked.connect(self.on_copy_clicked)
        self.control.serving.connect(self.on_serving)
        self.control.serveStopped.connect(self.on_stopped)
        self.control.serveFailed.connect(self.on_failed)

    @property
    def url(self) -> str:
        return self.dialog.address.text()

    def open(self) -> None:
        self.dialog.show()
        self.dialog.raise_()
        self.dialog.activateWindow()

    def on_start_requested(self, host: str, port: int, api_key: str) -> None:
        if self.settings is not None:
            self.settings.setValue("serve/host", host)
            self.settings.setValue("serve/port", port)
        self._asked = (host, api_key)
        self.dialog.set_state("starting")
        self.control.start_server(host, port, api_key or None)

    def on_stop_requested(self) -> None:
        self.dialog.set_state("stopping")
        self.control.stop_server()

    def on_serving(self, url: str) -> None:
        self.dialog.set_state("serving", url=url, policy=self.control.server_policy)
        warning = exposure_warning(*self._asked)
        self.button.setText(f"⇄ Serving {url}" + ("  (no API key)" if warning else ""))
        self.button.setToolTip(f"{warning}\n\nClick to copy the address." if warning else
                               "The HTTP server's address (click to copy it)")
        self.button.show()

    def on_stopped(self) -> None:
        self.dialog.set_state("stopped")
        self.button.hide()

    def on_failed(self, message: str) -> None:
        self.dialog.set_state("stopped", f"Not serving: {message}")
        self.button.hide()
        self.open()

    def on_copy_clicked(self) -> None:
        if self.url:
            QGuiApplication.clipboard().setText(self.url)
            window = self.button.window()
            status_bar = getattr(window, "statusBar", None)
            if callable(status_bar):
                status_bar().showMessage(f"Copied {self.url}", 3000)
