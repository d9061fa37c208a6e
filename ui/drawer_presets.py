"""The settings drawer's "Presets and new chats" section: named presets and the default system prompt of new chats.

:class:`DrawerPresets` builds the section's widgets for :class:`ui.settings_drawer.SettingsDrawer` (which lays them
out with :meth:`DrawerPresets.add_to`) and acts on a :class:`ui.chat_presets.ChatPresets` store (the app's settings):
save the chat's settings and system prompt under a name, load one into the chat on show (the drawer then says it
changed, so the chat saves it), delete one, and keep the default system prompt as it is typed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit, QPushButton, QVBoxLayout

from clover_desk.ui.chat_presets import ChatPresets
from clover_desk.ui.generation import GenerationSettings
from clover_desk.ui.theme import set_style_class
from clover_desk.ui.widgets import accessible, named


class PresetsDrawerLike(Protocol):
    """What :class:`DrawerPresets` uses of its drawer (``ui.settings_drawer.SettingsDrawer``)."""

    expand_thinking: Any  # QCheckBox: a loaded preset keeps the drawer's own choice
    changed: Any  # Qt signal: the user changed a setting

    def settings(self) -> GenerationSettings: ...

    def system_prompt_text(self) -> str: ...

    def set_settings(self, s: GenerationSettings, system_prompt: str) -> None: ...


class DrawerPresets:
    """Presets and the new chats' system prompt, in one settings drawer."""

    def __init__(self, drawer: PresetsDrawerLike) -> None:
        self.drawer = drawer
        self.presets = ChatPresets(None)  # until the window hands the app's (set_store)
        self._build()
        self.preset_load.clicked.connect(self.on_load_preset)
        self.preset_save.clicked.connect(self.on_save_preset)
        self.preset_delete.clicked.connect(self.on_delete_preset)
        self.default_system_prompt.textChanged.connect(self.on_default_prompt_edited)

    def _build(self) -> None:
        self.preset_choice = named(QComboBox(), "presetChoice", "Preset")
        self.preset_load = QPushButton("Load")
        self.preset_load.setObjectName("presetLoad")
        self.preset_load.setToolTip("Apply this preset's settings and system prompt to the chat on show")
        self.preset_delete = QPushButton("Delete")
        self.preset_delete.setObjectName("presetDelete")
        accessible(self.preset_load, "Load the preset")
        accessible(self.preset_delete, "Delete the preset")
        for b in (self.preset_load, self.preset_delete):
            set_style_class(b, "ghost")
        self.presets_row = QHBoxLayout()
        self.presets_row.addWidget(self.preset_choice, 1)
        self.presets_row.addWidget(self.preset_load)
        self.presets_row.addWidget(self.preset_delete)
        self.preset_name = named(QLineEdit(), "presetName", "Preset name")
        self.preset_name.setPlaceholderText("Preset name")
        self.preset_save = named(
            QPushButton("Save as preset"), "presetSave", "Save as preset", tip="Keep this chat's settings and system prompt under that name (for any chat)",
        )
        set_style_class(self.preset_save, "ghost")
        self.preset_save_row = QHBoxLayout()
        self.preset_save_row.addWidget(self.preset_name, 1)
        self.preset_save_row.addWidget(self.preset_save)
        self.preset_status = QLabel()
        self.preset_status.setObjectName("presetStatus")
        set_style_class(self.preset_status, "faint")
        self.preset_status.setWordWrap(True)
        self.default_system_prompt = named(
            QPlainTextEdit(), "defaultSystemPrompt", "Default system prompt for new chats",
        )
        self.default_system_prompt.setPlaceholderText("Empty: new chats start without one")
        self.default_system_prompt.setFixedHeight(64)
        self.default_system_prompt.setTabChangesFocus(True)

    def add_to(self, layout: QVBoxLayout) -> None:
        """The section, under its title, at the end of the drawer's column."""
        presets_title = QLabel("PRESETS AND NEW CHATS")
        set_style_class(presets_title, "sectionTitle")
        layout.addWidget(presets_title)
        layout.addLayout(self.presets_row)
        layout.addLayout(self.preset_save_row)
        layout.addWidget(self.preset_status)
        default_label = QLabel("Default system prompt for new chats")
        default_label.setBuddy(self.default_system_prompt)
        set_style_class(default_label, "muted")
        layout.addWidget(default_label)
        layout.addWidget(self.default_system_prompt)

    def set_store(self, presets: ChatPresets) -> None:
        """Where presets and the default system prompt are kept (the app's settings)."""
        self.presets = presets
        self.default_system_prompt.blockSignals(True)
        self.default_system_prompt.setPlainText(presets.default_system_prompt())
        self.default_system_prompt.blockSignals(False)
        self._refresh_presets()

    def new_chat_system_prompt(self) -> str:
        return self.presets.default_system_prompt()

    def _refresh_presets(self, select: str = "") -> None:
        names = self.presets.names()
        self.preset_choice.clear()
        self.preset_choice.addItems(names)
        if select in names:
            self.preset_choice.setCurrentIndex(names.index(select))
        for w in (self.preset_choice, self.preset_load, self.preset_delete):
            w.setEnabled(bool(names))
        if not names:
            self.preset_choice.setPlaceholderText("No presets yet")

    def on_save_preset(self) -> None:
        d = self.drawer
        try:
            name = self.presets.save(self.preset_name.text(), d.settings(), d.system_prompt_text())
        except ValueError as exc:
            self.preset_status.setText(f"Not saved: {exc}.")
            return
        self.preset_name.clear()
        self._refresh_presets(select=name)
        self.preset_status.setText(f"Saved “{name}”.")

    def on_load_preset(self) -> None:
        d = self.drawer
        name = self.preset_choice.currentText()
        found = self.presets.get(name, d.settings()) if name else None
        if found is None:
            return
        settings, prompt = found
        d.set_settings(replace(settings, expand_thinking=d.expand_thinking.isChecked()), prompt)
        self.preset_status.setText(f"Loaded “{name}” into this chat.")
        d.changed.emit()

    def on_delete_preset(self) -> None:
        name = self.preset_choice.currentText()
        if name and self.presets.delete(name):
            self._refresh_presets()
            self.preset_status.setText(f"Deleted “{name}”.")

    def on_default_prompt_edited(self) -> None:
        self.presets.set_default_system_prompt(self.default_system_prompt.toPlainText())
