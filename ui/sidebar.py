"""The conversation sidebar: New chat, search, the list of chats (rename in place with F2, Delete key, a context
menu with Export), and the Models button."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QPoint, Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (
    QFrame,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QWidget,
)

from clover_desk.ui.theme import set_style_class
from clover_desk.ui.widgets import accessible, named, push_button, vbox


class ChatList(QListWidget):
    """The list of chats: Delete asks to delete the current one (F2 renames it: QListWidget's edit key)."""

    deletePressed = Signal()  # the Delete key on the list

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802
        if event.key() == Qt.Key.Key_Delete and self.currentItem() is not None:
            self.deletePressed.emit()
            return
        super().keyPressEvent(event)


class ConversationSidebar(QFrame):
    """New chat, search, and the list of conversations (rename in place, delete and export from the menu)."""

    newRequested = Signal()  # start a new conversation
    selected = Signal(int)  # conversation id chosen
    renameRequested = Signal(int, str)  # (conversation id, new title)
    deleteRequested = Signal(int)  # conversation id to delete (after confirmation)
    exportRequested = Signal(int, str)  # (conversation id, "markdown" | "json")
    searchChanged = Signal(str)  # the search text
    modelsRequested = Signal()  # open the model manager page

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("sidebar")
        self.setMinimumWidth(190)  # = main_window.MIN_SIDEBAR_WIDTH
        title = QLabel("☘ Clover Desk")
        title.setObjectName("appTitle")
        self.new_button = push_button("+  New chat", "newChat", tip="New chat (Ctrl+N)", name="New chat",
                                      clicked=self.newRequested)
        self.search = named(QLineEdit(), "chatSearch", "Search chats")
        self.search.setPlaceholderText("Search chats  (Ctrl+K)")
        self.search.setClearButtonEnabled(True)
        self.list = ChatList()
        self.list.setObjectName("chatList")
        accessible(self.list, "Chats", "F2 renames, Delete deletes, the context menu (Menu key) exports")
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.setEditTriggers(QListWidget.EditTrigger.EditKeyPressed)
        self.list.setWordWrap(True)
        # titles wrap inside the sidebar's width; never a horizontal scroll bar under the list
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setResizeMode(QListWidget.ResizeMode.Adjust)
        self.models_button = push_button("Models", "modelsButton", style="ghost", name="Models",
                                         tip="Download, choose and quantize models (Ctrl+Shift+M)",
                                         clicked=self.modelsRequested)
        layout = vbox(title, self.new_button, self.search, margins=(12, 14, 12, 10), spacing=10, parent=self)
        recent = QLabel("CHATS")
        set_style_class(recent, "sectionTitle")
        layout.addWidget(recent)
        layout.addWidget(self.list, 1)
        layout.addWidget(self.models_button, 0, Qt.AlignmentFlag.AlignLeft)
        self._filling = False
        self._connect_signals()

    def _connect_signals(self) -> None:
        self.search.textChanged.connect(self.searchChanged)
        self.list.currentItemChanged.connect(self.on_current_changed)
        self.list.itemChanged.connect(self.on_item_changed)
        self.list.customContextMenuRequested.connect(self.on_context_menu)
        self.list.deletePressed.connect(self.on_delete_pressed)

    def set_items(self, items: list[tuple[int, str, str]], current: int | None) -> None:
        """``items``: (conversation id, title, snippet or ""). ``current`` is selected (no :attr:`selected`)."""
        self._filling = True
        self.list.clear()
        for cid, title, snippet in items:
            item = QListWidgetItem(title)
            item.setData(Qt.ItemDataRole.UserRole, cid)
            item.setToolTip(snippet or title)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
            self.list.addItem(item)
            if cid == current:
                self.list.setCurrentItem(item)
        self._filling = False

    def select(self, cid: int | None) -> None:
        """Highlight chat ``cid`` (None: no chat) without emitting :attr:`selected`."""
        self._filling = True
        item = self.item_for(cid) if cid is not None else None
        if item is None:
            self.list.clearSelection()
            self.list.setCurrentItem(None)
        else:
            self.list.setCurrentItem(item)
            self.list.scrollToItem(item)
        self._filling = False

    def current_id(self) -> int | None:
        item = self.list.currentItem()
        return None if item is None else int(item.data(Qt.ItemDataRole.UserRole))

    def item_for(self, cid: int) -> QListWidgetItem | None:
        for i in range(self.list.count()):
            if self.list.item(i).data(Qt.ItemDataRole.UserRole) == cid:
                return self.list.item(i)
        return None

    def start_rename(self, cid: int) -> None:
        item = self.item_for(cid)
        if item is not None:
            self.list.editItem(item)

    def on_current_changed(self, current: QListWidgetItem | None, _previous: QListWidgetItem | None) -> None:
        if current is not None and not self._filling:
            self.selected.emit(int(current.data(Qt.ItemDataRole.UserRole)))

    def on_item_changed(self, item: QListWidgetItem) -> None:
        if not self._filling and item.text().strip():
            self.renameRequested.emit(int(item.data(Qt.ItemDataRole.UserRole)), item.text().strip())

    def on_delete_pressed(self) -> None:
        cid = self.current_id()
        if cid is not None:
            self.deleteRequested.emit(cid)

    def on_context_menu(self, pos: QPoint | Any) -> None:
        item = self.list.itemAt(pos) or self.list.currentItem()
        if item is None:
            return
        cid = int(item.data(Qt.ItemDataRole.UserRole))
        menu = QMenu(self)
        rename = menu.addAction("Rename\tF2")
        export_md = menu.addAction("Export as Markdown…")
        export_json = menu.addAction("Export as JSON…")
        menu.addSeparator()
        delete = menu.addAction("Delete…\tDel")
        chosen = menu.exec(self.list.viewport().mapToGlobal(pos))
        if chosen is rename:
            self.list.editItem(item)
        elif chosen is export_md:
            self.exportRequested.emit(cid, "markdown")
        elif chosen is export_json:
            self.exportRequested.emit(cid, "json")
        elif chosen is delete:
            self.deleteRequested.emit(cid)
