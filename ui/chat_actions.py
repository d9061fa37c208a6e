"""The user's chat actions, guarded: what may reach the chat session now, and what answers it.

:class:`ChatActions` stands between the window's buttons, menus and message actions and
:class:`ui.chat_session.ChatSession` for :class:`ui.main_window.MainWindow`: Send waits for a model (or a remote
server set up), nothing starts while an answer streams, Continue is the local engine's only, a version switch waits
for the answer in flight. It says why in the composer (Send disabled, the text kept) or in the status bar, enables
Regenerate, Continue and Cancel loading to match, picks what answers (the engine client or the remote runner), and has
the idle local engine read the open chat ahead of the next message (:meth:`ChatActions.read_ahead`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from PySide6.QtCore import QObject, QTimer
from PySide6.QtWidgets import QStatusBar

from clover_desk.ui.contracts import EngineState
from clover_desk.ui.messages import MessageData

log = logging.getLogger(__name__)

READ_AHEAD_MS = 400  # the engine reads the open chat ahead this long after it opens or an answer ends (read_ahead)


class ActionsWindowLike(Protocol):
    """What :class:`ChatActions` uses of its window (``ui.main_window.MainWindow``)."""

    client: Any  # ui.contracts.EngineClientLike
    remote: Any  # ui.remote_chat.RemoteBackendControl | None
    session: Any  # ui.chat_session.ChatSession
    long_chats: Any  # ui.long_chats.LongChats
    composer: Any  # ui.composer.Composer
    chat: Any  # ui.chat_view.ChatView
    drawer: Any  # ui.settings_drawer.SettingsDrawer
    conversations: Any  # ui.conversations.Conversations: .open(), .reload(), .show_chosen_versions()
    engine_status: Any  # ui.engine_status.EngineStatus: .state, .engine_label
    menus: Any  # ui.window_menus.WindowMenus: .regenerate_action, .continue_action, .cancel_load_action
    conversation_id: int | None

    def is_generating(self) -> bool: ...

    def statusBar(self) -> QStatusBar: ...  # noqa: N802 - Qt's name


class ChatActions:
    """Send, stop, regenerate, continue, branch, edit and switch versions, each when it may; and the read-ahead."""

    def __init__(self, window: ActionsWindowLike, parent: QObject) -> None:
        self.window = window
        # the open chat read ahead while the engine is idle (after an answer, on opening it, once a model loads)
        self.read_ahead_timer = QTimer(parent)
        self.read_ahead_timer.setSingleShot(True)
        self.read_ahead_timer.setInterval(READ_AHEAD_MS)
        self.read_ahead_timer.timeout.connect(self.read_ahead)
        self.read_ahead_id = ""  # the last read_chat request sent

    # ----------------------------------------------------------------- what answers, and whether it can
    def uses_remote(self) -> bool:
        """Send goes to the remote server (Model ▸ Backend…), not the local engine."""
        return self.window.remote is not None and self.window.remote.selected

    def request_source(self) -> Any:
        """What answers the next request: the remote runner (Model ▸ Backend…) or the engine client."""
        w = self.window
        return w.remote.runner if self.uses_remote() and w.remote is not None else w.client

    def why_not_ready(self) -> str:
        """Why Send is disabled ("" when it is not): the remote's settings, else the engine's state."""
        if self.uses_remote() and self.window.remote is not None:
            return str(self.window.remote.why_not_ready())
        return str(self.window.engine_status.state.why_not_ready)

    def can_send(self) -> bool:
        return not self.why_not_ready()

    def update_send_state(self) -> None:
        w = self.window
        ready = self.can_send()
        w.composer.set_blocked(self.why_not_ready())
        w.menus.regenerate_action.setEnabled(ready)
        w.menus.continue_action.setEnabled(ready and not self.uses_remote() and not w.is_generating()
                                           and w.session.answer_to_continue() is not None)
        w.menus.cancel_load_action.setEnabled(w.engine_status.state is EngineState.LOADING)

    # ----------------------------------------------------------------- the user's actions
    def on_send_requested(self, text: str) -> None:
        """Save the message (or the edit) and start the answer; the composer is cleared only when both were saved.
        A failed save leaves the typed text (and edit mode) in the composer and says why in the banner."""
        w = self.window
        if w.is_generating() or not self.can_send():
            return
        if w.long_chats.blocks_send(text):
            return  # it does not fit: the choice is offered, the text stays in the box
        editing = w.composer.editing
        if editing is not None and not w.session.editable(editing):
            w.composer.end_edit()
            editing = None
        if w.session.send(text, editing):
            w.composer.end_edit()
            w.composer.input.clear()

    def on_stop_requested(self) -> None:
        w = self.window
        if w.long_chats.summary is not None:
            w.long_chats.cancel_summary()
            w.engine_status.engine_label.setText("● Stopping…")
        if w.session.stop():
            w.engine_status.engine_label.setText("● Stopping…")

    def on_regenerate_last(self) -> None:
        last = self.window.chat.last_assistant()
        if last is not None:
            self.on_regenerate_requested(last.data)

    def on_regenerate_requested(self, data: MessageData) -> None:
        w = self.window
        if w.is_generating() or data.message_id is None:
            return
        if not self.can_send():
            w.statusBar().showMessage(self.why_not_ready(), 4000)
            return
        w.session.regenerate(data)

    def on_continue_last(self) -> None:
        answer = self.window.session.answer_to_continue()
        if answer is not None:
            self.on_continue_requested(answer)

    def on_continue_requested(self, data: MessageData) -> None:
        """Go on writing an answer that was cut short (the last one: its Continue button, Edit ▸ Continue)."""
        w = self.window
        if w.is_generating() or w.session.answer_to_continue() is not data:
            return
        if self.uses_remote():
            w.statusBar().showMessage("Continue needs the local engine: a remote server starts a new answer", 5000)
            return
        if not self.can_send():
            w.statusBar().showMessage(self.why_not_ready(), 4000)
            return
        w.session.continue_answer(data)

    def on_branch_requested(self, data: MessageData) -> None:
        """A new chat with this one's messages up to ``data`` and its settings; it opens, the original stays."""
        w = self.window
        if w.is_generating():
            return
        branch = w.session.branch(data)
        if branch is None:
            return
        w.conversations.open(branch.id)
        w.conversations.reload()
        w.statusBar().showMessage(f"Branched into “{branch.title}”: the original chat is unchanged", 5000)

    def on_edit_requested(self, data: MessageData) -> None:
        if self.window.is_generating():
            return
        self.window.composer.begin_edit(data)

    def on_version_requested(self, data: MessageData, step: int) -> None:
        """‹ / › on a message: show its previous / next version, and below it the chat that version led to."""
        w = self.window
        if data.message_id is not None and w.is_generating():
            w.statusBar().showMessage("Wait for the answer (or stop it) before switching versions", 4000)
            return
        if w.session.step_version(data, step):
            w.conversations.show_chosen_versions()

    # ----------------------------------------------------------------- the engine's idle time
    def read_ahead(self) -> None:
        """Have the idle local engine read the open chat, its last answer included, into its prompt cache
        (``EngineClient.read_chat``), so that the next message is all it reads when it is sent: the first token
        comes as fast as in a chat that never paused. Sending (or anything else that needs the engine) stops it at
        once. Only for a chat whose last message is a finished answer."""
        w = self.window
        read = getattr(w.client, "read_chat", None)
        cid = w.conversation_id
        if (read is None or cid is None or w.is_generating() or self.uses_remote()
                or w.engine_status.state is not EngineState.READY):
            return
        try:
            messages = w.long_chats.messages_to_read(cid)
        except Exception as exc:  # noqa: BLE001 - best effort: a chat deleted elsewhere, a store closing at exit
            log.info("not reading chat %s ahead: %s", cid, exc)
            return
        last = w.chat.messages()[-1] if w.chat.messages() else None
        if not messages or messages[-1]["role"] != "assistant" or last is None or last.status != "complete":
            return
        self.read_ahead_id = str(read(messages, w.drawer.settings().to_params()))
