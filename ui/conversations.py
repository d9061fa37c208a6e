"""The window's conversations: opening one, the list in the sidebar (and its search), rename, delete and export.

:class:`Conversations` acts on the chat store for :class:`ui.main_window.MainWindow`, which wires the sidebar's and
the menus' signals here. Opening a chat (:meth:`Conversations.open`; none: a new chat) stops an answer in flight,
shows the chosen version of each message, the chat's settings and title, and has the engine read it ahead. Export asks where to save with
:func:`ask_save_path` (a seam: tests replace it) in the folder used last (remembered in the window's settings,
:class:`ui.window_state.WindowState`), else Documents.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QFileDialog, QMessageBox, QStatusBar, QWidget

from clover_desk.ui.contracts import ChatStoreLike, ChatWindowParts
from clover_desk.ui.generation import export_file_name
from clover_desk.ui.messages import MessageData
from clover_desk.ui.widgets import documents_dir

log = logging.getLogger(__name__)

EXPORT_FILTERS = {"markdown": "Markdown (*.md)", "json": "JSON (*.json)"}


def ask_save_path(parent: QWidget, caption: str, start: str, filters: list[str], selected: str) -> tuple[str, str]:
    """The save dialog (a seam: tests replace it). Returns (path or "", the filter chosen)."""
    return QFileDialog.getSaveFileName(parent, caption, start, ";;".join(filters), selected)


class ConversationsWindowLike(ChatWindowParts, Protocol):
    """What :class:`Conversations` uses of its window (``ui.main_window.MainWindow``), besides its shared parts."""

    store: ChatStoreLike
    sidebar: Any  # ui.sidebar.ConversationSidebar
    title_label: Any
    conversation_id: int | None
    session: Any  # ui.chat_session.ChatSession
    state: Any  # ui.window_state.WindowState
    chat_settings: Any  # ui.chat_settings.ChatSettings
    conversationChanged: Any  # noqa: N815 - a Qt signal

    def is_generating(self) -> bool: ...

    def show_chat_page(self) -> None: ...

    def statusBar(self) -> QStatusBar: ...  # noqa: N802 - Qt's name


class Conversations:
    """List, search, rename, delete and export the chats of one window."""

    def __init__(self, window: ConversationsWindowLike) -> None:
        self.window = window
        self._save_error: type[Exception] = getattr(window.store, "Error", OSError)

    # ----------------------------------------------------------------- opening one
    def open(self, conversation_id: int | None) -> None:
        """Show a chat (None: a new one), stopping the answer in flight."""
        w = self.window
        if w.is_generating():
            w.chat_actions.on_stop_requested()
        w.conversation_id = conversation_id
        w.engine_status.clear_load_notice()
        w.composer.end_edit()
        w.sidebar.select(conversation_id)
        if conversation_id is None:
            w.chat.clear()
            w.chat_settings.show_new_chat()
            w.title_label.setText("New chat")
            w.long_chats.on_conversation_opened(None)
            w.chat_actions.update_send_state()
            return
        conv = w.store.get_conversation(conversation_id)
        w.title_label.setText(conv.title)
        w.chat_settings.show_saved(conv.settings, conv.system_prompt)
        w.chat.set_messages(self.shown_messages(conversation_id))
        w.long_chats.on_conversation_opened(conv.settings)
        w.chat_actions.update_send_state()  # Continue: whether this chat's last answer was cut short
        w.show_chat_page()
        w.chat_actions.read_ahead_timer.start()
        w.conversationChanged.emit(conversation_id)

    def shown_messages(self, conversation_id: int) -> list[MessageData]:
        """The chat as the view shows it: the chosen version of each message, each knowing how many there are."""
        store = self.window.store
        counts = store.version_counts(conversation_id)
        return [
            MessageData(m.role, m.content, m.thinking, m.thinking_seconds, m.status, dict(m.stats), m.id,
                        *counts.get(m.id, (1, 1)))
            for m in store.messages(conversation_id)
            if m.role in ("user", "assistant")
        ]

    def show_chosen_versions(self) -> None:
        """Show the open chat again as the store has it now (another version chosen, an edit taken back); the
        engine reads the chat it now shows ahead of the next message."""
        w = self.window
        if w.conversation_id is None:
            return
        w.chat.set_messages(self.shown_messages(w.conversation_id))
        w.chat_actions.update_send_state()
        w.chat_actions.read_ahead_timer.start()

    def on_new(self) -> None:
        self.open(None)
        self.window.show_chat_page()
        self.window.composer.input.setFocus()

    def on_selected(self, conversation_id: int) -> None:
        if conversation_id != self.window.conversation_id:
            self.open(conversation_id)
        else:
            self.window.show_chat_page()

    def on_created(self, conversation_id: int, title: str) -> None:
        """The session saved the first message of a new chat in a new conversation."""
        self.window.title_label.setText(title)
        self.reload()
        self.window.conversationChanged.emit(conversation_id)

    # ----------------------------------------------------------------- the list
    def reload(self, query: str | None = None) -> None:
        """Fill the sidebar: every chat, or those matching ``query`` (None: the sidebar's search text)."""
        w = self.window
        query = w.sidebar.search.text() if query is None else query
        if query.strip():
            items = [(h.conversation.id, h.conversation.title, h.snippet) for h in w.store.search(query)]
        else:
            items = [(c.id, c.title, "") for c in w.store.list_conversations()]
        w.sidebar.set_items(items, w.conversation_id)

    def on_search_changed(self, text: str) -> None:
        self.reload(text)

    def on_find_chats(self) -> None:
        self.window.sidebar.search.setFocus()
        self.window.sidebar.search.selectAll()

    # ----------------------------------------------------------------- rename, delete
    def on_rename_requested(self, conversation_id: int, title: str) -> None:
        w = self.window
        try:
            w.store.rename_conversation(conversation_id, title)
        except self._save_error as exc:
            w.show_save_error(exc, "The chat was not renamed")
            QTimer.singleShot(0, lambda: self.reload())
            return
        if conversation_id == w.conversation_id:
            w.title_label.setText(title)
        QTimer.singleShot(0, lambda: self.reload())

    def on_rename_current(self) -> None:
        if self.window.conversation_id is not None:
            self.window.sidebar.start_rename(self.window.conversation_id)

    def on_delete_current(self) -> None:
        if self.window.conversation_id is not None:
            self.on_delete_requested(self.window.conversation_id)

    def on_delete_requested(self, conversation_id: int) -> None:
        answer = QMessageBox.question(self.window, "Delete chat",  # type: ignore[arg-type]
                                      "Delete this chat and all its messages?")
        if answer == QMessageBox.StandardButton.Yes:
            self.delete(conversation_id)

    def delete(self, conversation_id: int) -> None:
        w = self.window
        if conversation_id == w.conversation_id and w.is_generating():
            w.session.drop_recorder()  # its message is about to go: nothing more to save
        if conversation_id == w.conversation_id:
            self.open(None)
        try:
            w.store.delete_conversation(conversation_id)
        except self._save_error as exc:
            w.show_save_error(exc, "The chat was not deleted")
        self.reload()

    # ----------------------------------------------------------------- export
    def on_export_current(self, fmt: str) -> None:
        if self.window.conversation_id is None:
            self.window.statusBar().showMessage("Nothing to export yet: send a message first", 4000)
            return
        self.on_export_requested(self.window.conversation_id, fmt)

    def on_export_requested(self, conversation_id: int, fmt: str) -> None:
        """Ask where to save (the last folder used, else Documents; a file name from the title) and export."""
        w = self.window
        title = w.store.get_conversation(conversation_id).title
        folder = Path(str(w.state.value("export/dir", "") or documents_dir()))
        start = folder / export_file_name(title, fmt)
        filters = [EXPORT_FILTERS[fmt], EXPORT_FILTERS["json" if fmt == "markdown" else "markdown"], "All files (*)"]
        path, chosen = ask_save_path(w, "Export chat", str(start), filters, EXPORT_FILTERS[fmt])  # type: ignore[arg-type]
        if not path:
            return
        chosen_fmt = next((f for f, label in EXPORT_FILTERS.items() if label == chosen), fmt)
        suffix = ".md" if chosen_fmt == "markdown" else ".json"
        if not Path(path).suffix:
            path += suffix
        if self.export(conversation_id, chosen_fmt, path) is not None:
            w.state.set_value("export/dir", str(Path(path).parent))

    def export(self, conversation_id: int, fmt: str, path: str) -> Path | None:
        w = self.window
        try:
            out = (w.store.export_markdown if fmt == "markdown" else w.store.export_json)(conversation_id, path)
        except (OSError, self._save_error) as exc:
            w.show_save_error(exc, f"The chat was not exported to {path}")
            return None
        w.statusBar().showMessage(f"Exported to {out}", 5000)
        return out
