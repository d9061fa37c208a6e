"""The window's menu bar, its keyboard shortcuts and the Help menu's dialogs.

:class:`WindowMenus` builds File, Edit, View, Model and Help for :class:`ui.main_window.MainWindow` and keeps their
actions (the window and its helpers enable them: Stop while an answer streams, Continue while the last answer was cut
short, Cancel loading while a model loads). Every action is also the window's own, so that its shortcut works with
the menu bar hidden; the composer is told which keys are the window's so that it does not swallow them. The Model
menu takes "Serve over HTTP…" and "Backend…" once the app hands the window what they need (:meth:`add_model_action`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, cast

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QActionGroup, QKeySequence
from PySide6.QtWidgets import QMenu, QMenuBar, QMessageBox, QWidget

from clover_desk.ui.gpu_check import GpuCheckDialog
from clover_desk.ui.theme import SCHEMES

log = logging.getLogger(__name__)

APP_NAME = "Clover Desk"
ABOUT_TEXT = (
    "<h3>Clover Desk</h3>"
    "<p>A desktop app for the Clover block-diffusion mixture-of-experts model: chat, watch each block being "
    "denoised, fit the model to your GPU's memory, and preview the HTML apps it writes in a sandbox.</p>"
    "<p>The model runs on this computer, in its own process. Nothing is sent anywhere.</p>"
)


class MenusWindowLike(Protocol):
    """What :class:`WindowMenus` uses of its window (``ui.main_window.MainWindow``); the window is also the
    ``QWidget`` the actions and dialogs belong to."""

    client: Any  # ui.contracts.EngineClientLike (its ``env``: the engine's switches, for the GPU check)
    composer: Any  # ui.composer.Composer
    conversations: Any  # ui.conversations.Conversations
    chat_actions: Any  # ui.chat_actions.ChatActions
    engine_status: Any  # ui.engine_status.EngineStatus
    state: Any  # ui.window_state.WindowState
    tabs: Any  # the side tabs
    settings_button: Any
    panel_button: Any
    model_manager: QWidget | None
    vram_panel: QWidget | None

    def on_focus_composer(self) -> None: ...

    def show_panel(self, widget: QWidget | None) -> None: ...

    def show_models_page(self) -> None: ...

    def close(self) -> bool: ...

    def menuBar(self) -> QMenuBar: ...  # noqa: N802 - Qt's names

    def addAction(self, action: QAction) -> None: ...  # noqa: N802

    def actions(self) -> list[QAction]: ...


class WindowMenus:
    """The menus and actions of one window, and its Help dialogs."""

    def __init__(self, window: MenusWindowLike) -> None:
        self.window = window
        self.owner = cast(QWidget, window)  # the window, as the QWidget the actions and dialogs belong to
        self.gpu_check_dialog: GpuCheckDialog | None = None
        self.by_name: dict[str, QMenu] = {}
        self._build()

    def _action(self, menu: QMenu, text: str, slot: Any, shortcut: str | QKeySequence.StandardKey | None = None,
                tip: str = "", checkable: bool = False) -> QAction:
        action = QAction(text, self.owner)
        if shortcut is not None:
            action.setShortcut(QKeySequence(shortcut))
            action.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
        if tip:
            action.setStatusTip(tip)
            action.setToolTip(tip)
        action.setCheckable(checkable)
        action.triggered.connect(slot)
        menu.addAction(action)
        self.window.addAction(action)  # shortcuts work with the menu bar hidden (and on every platform)
        return action

    def _build(self) -> None:
        bar = self.window.menuBar()
        bar.setObjectName("menuBar")
        self._build_file(bar.addMenu("&File"))
        self._build_edit(bar.addMenu("&Edit"))
        self._build_view(bar.addMenu("&View"))
        self._build_model(bar.addMenu("&Model"))
        self._build_help(bar.addMenu("&Help"))
        w = self.window
        w.composer.input.set_window_shortcuts([a.shortcut() for a in w.actions() if not a.shortcut().isEmpty()])

    def _build_file(self, file_menu: QMenu) -> None:
        w = self.window
        self.by_name["File"] = file_menu
        self.new_action = self._action(file_menu, "&New chat", w.conversations.on_new, "Ctrl+N")
        file_menu.addSeparator()
        self.export_md_action = self._action(file_menu, "&Export chat as Markdown…",
                                             lambda: w.conversations.on_export_current("markdown"), "Ctrl+E",
                                             "Save the chat on show as a Markdown file")
        self.export_json_action = self._action(file_menu, "Export chat as &JSON…",
                                               lambda: w.conversations.on_export_current("json"), "Ctrl+Shift+E",
                                               "Save the chat on show as JSON (messages, thinking, statistics)")
        file_menu.addSeparator()
        self.quit_action = self._action(file_menu, "&Quit", w.close, "Ctrl+Q")
        self.quit_action.setMenuRole(QAction.MenuRole.QuitRole)

    def _build_edit(self, edit_menu: QMenu) -> None:
        w = self.window
        self.by_name["Edit"] = edit_menu
        self.find_action = self._action(edit_menu, "&Find chats…", w.conversations.on_find_chats, "Ctrl+K")
        self.focus_action = self._action(edit_menu, "Go to the &message box", w.on_focus_composer, "Ctrl+L")
        edit_menu.addSeparator()
        self.rename_action = self._action(edit_menu, "&Rename chat", w.conversations.on_rename_current, "F2")
        # F2 anywhere in the window (the composer's focus included) renames the open chat, as the menu says
        self.rename_action.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
        self.delete_action = self._action(edit_menu, "&Delete chat…", w.conversations.on_delete_current)
        edit_menu.addSeparator()
        self.regenerate_action = self._action(edit_menu, "Re&generate last answer", w.chat_actions.on_regenerate_last,
                                              "Ctrl+Shift+R")
        self.continue_action = self._action(edit_menu, "Co&ntinue last answer", w.chat_actions.on_continue_last,
                                            "Ctrl+Shift+Return", "Go on writing the last answer where the token "
                                            "limit or Stop cut it off")
        self.continue_action.setEnabled(False)  # only while the last answer was cut short (ChatActions.update_send_state)
        self.stop_action = self._action(edit_menu, "&Stop generating", w.chat_actions.on_stop_requested, "Esc")
        self.stop_action.setEnabled(False)  # enabled only while an answer streams (Esc is free otherwise)

    def _build_view(self, view_menu: QMenu) -> None:
        w = self.window
        self.by_name["View"] = view_menu
        self.settings_action = self._action(
            view_menu, "Chat &settings", lambda: w.settings_button.setChecked(self.settings_action.isChecked()),
            "Ctrl+,", checkable=True)
        self.panels_action = self._action(
            view_menu, "Side &panels", lambda: w.panel_button.setChecked(self.panels_action.isChecked()),
            "Ctrl+Shift+P", checkable=True)
        self.panels_action.setChecked(True)
        view_menu.addSeparator()
        self.tab_actions: list[QAction] = []
        for i in range(w.tabs.count()):
            widget = w.tabs.widget(i)
            self.tab_actions.append(self._action(view_menu, f"&{i + 1}  {w.tabs.tabText(i)} panel",
                                                 lambda _=False, tab=widget: w.show_panel(tab), f"Ctrl+{i + 1}"))
        view_menu.addSeparator()
        theme_menu = view_menu.addMenu("&Theme")
        self.theme_group = QActionGroup(self.owner)
        self.theme_actions: dict[str, QAction] = {}
        for scheme, label in zip(SCHEMES, ("Follow the &system", "&Light", "&Dark")):
            action = self._action(theme_menu, label, lambda _=False, s=scheme: w.state.set_theme_preference(s),
                                  checkable=True)
            self.theme_group.addAction(action)
            self.theme_actions[scheme] = action
        self.theme_actions.get(w.state.theme_preference, self.theme_actions["system"]).setChecked(True)

    def _build_model(self, model_menu: QMenu) -> None:
        w = self.window
        self.by_name["Model"] = model_menu
        self.models_action = self._action(model_menu, "&Models…", w.show_models_page, "Ctrl+Shift+M",
                                          "Open, download or create a model")
        self.models_action.setEnabled(w.model_manager is not None)
        self.vram_action = self._action(model_menu, "&VRAM budget…", w.engine_status.on_open_vram_tab)
        self.vram_action.setEnabled(w.vram_panel is not None)
        model_menu.addSeparator()
        self.cancel_load_action = self._action(model_menu, "&Cancel loading", w.engine_status.on_cancel_load)
        self.restart_action = self._action(model_menu, "&Restart engine", w.engine_status.on_restart_clicked)

    def _build_help(self, help_menu: QMenu) -> None:
        self.by_name["Help"] = help_menu
        self.shortcuts_action = self._action(help_menu, "&Keyboard shortcuts", self.on_show_shortcuts, "F1")
        self.gpu_check_action = self._action(help_menu, "Check this machine's &GPU…", self.on_check_gpu,
                                             tip="What torch, the NVIDIA driver and bitsandbytes allow here, and what "
                                                 "to install if the GPU cannot be used")
        self.about_action = self._action(help_menu, f"&About {APP_NAME}", self.on_about)
        self.about_action.setMenuRole(QAction.MenuRole.AboutRole)

    def add_model_action(self, text: str, name: str, tip: str, slot: Any) -> QAction:
        """An action of the Model menu, after "VRAM budget…" (before Cancel loading / Restart engine)."""
        action = QAction(text, self.owner)
        action.setObjectName(name)
        action.setStatusTip(tip)
        action.triggered.connect(slot)
        menu = self.by_name["Model"]
        actions = menu.actions()
        position = actions.index(self.vram_action) + 1 if self.vram_action in actions else len(actions)
        if position < len(actions):
            menu.insertAction(actions[position], action)
        else:
            menu.addAction(action)
        self.window.addAction(action)
        return action

    def add_serve_action(self, slot: Any) -> None:
        """Model ▸ Serve over HTTP… (the app handed the window the worker's server)."""
        self.serve_action = self.add_model_action(
            "Serve over &HTTP…", "serveAction", "Let other programs use the model through an OpenAI-compatible API",
            slot)

    def add_backend_action(self, slot: Any) -> None:
        """Model ▸ Backend… (the app handed the window a way to reach a remote server)."""
        self.backend_action = self.add_model_action(
            "&Backend: local or remote…", "backendAction",
            "Answer with the local engine or a remote OpenAI-compatible server", slot)

    # ----------------------------------------------------------------- help
    def shortcuts(self) -> list[tuple[str, str]]:
        """(action, key) for every menu action that has a shortcut, in menu order."""
        out = []
        for menu in self.by_name.values():
            for action in menu.actions():
                children = action.menu().actions() if action.menu() is not None else [action]
                for a in children:
                    if not a.shortcut().isEmpty():
                        text = a.text().replace("&", "").split("  ", 1)[-1]
                        out.append((text, a.shortcut().toString(QKeySequence.SequenceFormat.NativeText)))
        out.append(("Send the message", "Enter"))
        out.append(("New line in the message", "Shift+Enter"))
        return out

    def on_show_shortcuts(self) -> None:
        rows = "".join(f"<tr><td>{what}</td><td>&nbsp;&nbsp;<b>{key}</b></td></tr>" for what, key in self.shortcuts())
        box = QMessageBox(QMessageBox.Icon.NoIcon, "Keyboard shortcuts", f"<table>{rows}</table>",
                          QMessageBox.StandardButton.Close, self.owner)
        box.setObjectName("shortcutsBox")
        box.exec()

    def on_check_gpu(self) -> None:
        """Help ▸ Check this machine's GPU: ``clover-desk doctor`` in a child process, shown in a dialog (kept, so
        that reopening it shows the last result; "Check again" reruns it)."""
        if self.gpu_check_dialog is None:
            # the check sees the engine's switches (the GPU paths chosen on the models page), not only the app's
            self.gpu_check_dialog = GpuCheckDialog(
                self.owner, env=lambda: dict(getattr(self.window.client, "env", None) or {}))
        self.gpu_check_dialog.show()
        self.gpu_check_dialog.raise_()

    def on_about(self) -> None:
        box = QMessageBox(QMessageBox.Icon.NoIcon, f"About {APP_NAME}", ABOUT_TEXT, QMessageBox.StandardButton.Ok,
                          self.owner)
        box.setObjectName("aboutBox")
        icon = self.owner.windowIcon()
        if not icon.isNull():
            box.setIconPixmap(icon.pixmap(64, 64))
        box.exec()
