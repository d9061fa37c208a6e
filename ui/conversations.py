"""The window's conversations: the list in the sidebar (and its search), rename, delete and export.

:class:`Conversations` acts on the chat store for :class:`ui.main_window.MainWindow`, which opens the chats (the
list hands it the one chosen) and wires the sidebar's and the menus' signals here. Export asks where to save with
:func:`ask_save_path` (a seam: tests replace it) in the folder used last (remembered in the window's settings,
:class:`ui.window_state.WindowState`), else Documents.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QFileDialog, QMessageBox, QStatusBar, QWidget

from ui.contracts import ChatStoreLike
from ui.generation import export_file_name
from ui.widgets import documents_dir

log = logging.getLogger(__name__)

EXPORT_FILTERS = {"markdown": "Markdown (*.md)", "json": "JSON (*.json)"}


def ask_save_path(parent: QWidget, caption: str, start: str, filters: list[str], selected: str) -> tuple[str, str]:
    """The save dialog (a seam: tests replace it). Returns (path or "", the filter chosen)."""
    return QFileDialog.getSaveFileName(parent, caption, start, ";;".join(filters), selected)


class ConversationsWindowLike(Protocol):
    """What :class:`Conversations` uses of its window (``ui.main_window.MainWindow``)."""

    store: ChatStoreLike
    sidebar: Any  # ui.sidebar.ConversationSidebar
    title_label: Any
    conversation_id: int | None
    session: Any  # ui.chat_session.ChatSession
    state: Any  # ui.window_state.WindowState

    def is_generating(self) -> bool: ...

    def open_conversation(self, conversation_id: int | None) -> None: ...

    def show_save_error(self, error: BaseException, what: str) -> None: ...

    def statusBar(self) -> QStatusBar: ...  # noqa: N802 - Qt's name


class Conversations:
    """List, search, rename, delete and export the chats of one window."""

    def __init__(self, window: ConversationsWindowLike) -> None:
        self.window = window
        self._save_error: type[Exception] = getattr(window.store, "Error", OSError)

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
            w.open_conversation(None)
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
