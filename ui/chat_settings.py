"""The open chat's generation settings, kept in step: the drawer, the composer, the chat store, the model's defaults.

:class:`ChatSettings` does this for :class:`ui.main_window.MainWindow`: a chat opened shows its saved settings (a
new chat, the model's own defaults); the composer's Think switch and mode note and the chat's thinking sections
follow the drawer, and the drawer's Think box follows the composer's switch; a change is saved with the chat at once
(a new chat's settings only with its first message). The defaults a new chat starts from come from the model folder
(handed in by the composition root) and again from the engine's ``loaded`` answer (:meth:`set_model_info`): a new
chat on show takes them unless the user already changed its settings; saved chats keep theirs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from clover_desk.ui.context_window import context_limit
from clover_desk.ui.contracts import ChatStoreLike
from clover_desk.ui.generation import GenerationSettings, defaults_from_model

log = logging.getLogger(__name__)

MODE_NOTES = {"diffusion": "", "spec": "self-speculative"}  # the composer's note for each mode (else autoregressive)


class SettingsWindowLike(Protocol):
    """What :class:`ChatSettings` uses of its window (``ui.main_window.MainWindow``)."""

    store: ChatStoreLike
    model_dir: str | None
    drawer: Any  # ui.settings_drawer.SettingsDrawer
    composer: Any  # ui.composer.Composer: .think_button, .mode_label
    chat: Any  # ui.chat_view.ChatView
    long_chats: Any  # ui.long_chats.LongChats
    conversation_id: int | None

    def show_save_error(self, error: BaseException, what: str) -> None: ...


class ChatSettings:
    """The settings of the chat on show, and the model defaults new chats start from, in one window."""

    def __init__(self, window: SettingsWindowLike, model_defaults: GenerationSettings | None) -> None:
        self.window = window
        self._save_error: type[Exception] = getattr(window.store, "Error", OSError)
        self.model_defaults = model_defaults or GenerationSettings()
        self.fresh_touched = False  # the user edited a new chat's settings: model defaults no longer replace them

    def show_new_chat(self) -> None:
        """A new chat: the model's defaults and the new chats' system prompt."""
        self.fresh_touched = False
        self.window.drawer.set_settings(self.model_defaults, self.window.drawer.new_chat_system_prompt())
        self.sync()

    def show_saved(self, settings: Mapping[str, Any], system_prompt: str) -> None:
        """A saved chat: its own settings (what it does not say, the model's defaults) and system prompt."""
        self.window.drawer.set_settings(GenerationSettings.from_dict(settings, self.model_defaults), system_prompt)
        self.sync()

    def sync(self) -> None:
        """The composer's Think switch and mode note, and the chat's thinking sections, follow the drawer."""
        w = self.window
        settings = w.drawer.settings()
        w.composer.think_button.blockSignals(True)
        w.composer.think_button.setChecked(settings.enable_thinking)
        w.composer.think_button.blockSignals(False)
        w.chat.set_expand_thinking(settings.expand_thinking)
        w.composer.mode_label.setText(MODE_NOTES.get(settings.mode, "autoregressive"))

    def on_settings_changed(self) -> None:
        w = self.window
        settings = w.drawer.settings()
        self.sync()
        if w.conversation_id is None:
            self.fresh_touched = True
            return
        try:
            w.store.update_conversation(
                w.conversation_id, system_prompt=w.drawer.system_prompt_text(),
                settings=w.long_chats.chat_settings(settings.to_dict()),
            )
        except self._save_error as exc:
            w.show_save_error(exc, "The chat settings were not saved")

    def on_think_toggled(self, on: bool) -> None:
        """The composer's Think is the chat's setting: the drawer's box follows (and the chat saves it)."""
        self.window.drawer.thinking.setChecked(on)

    def set_model_defaults(self, defaults: GenerationSettings, model_name: str = "") -> None:
        """The settings a new chat starts from (the model folder's own). A new chat on show takes them unless the
        user already changed its settings; saved chats keep theirs."""
        w = self.window
        self.model_defaults = defaults
        w.drawer.set_model_defaults_text(model_name, defaults)
        if w.conversation_id is None and not self.fresh_touched:
            w.drawer.set_settings(defaults, w.drawer.system_prompt.toPlainText())
            self.sync()

    def set_model_info(self, info: Mapping[str, Any]) -> None:
        """Take the model's defaults and context from a ``loaded`` record (or the same keys read from its folder)."""
        w = self.window
        w.long_chats.set_model_info(info)
        w.drawer.set_model_context(context_limit(info))
        config = info.get("config") if isinstance(info.get("config"), Mapping) else None
        generation = info.get("generation_defaults") if isinstance(info.get("generation_defaults"), Mapping) else None
        if config is None and generation is None:
            return
        name = Path(str(info.get("model_dir") or w.model_dir or "")).name
        self.set_model_defaults(defaults_from_model(config, generation), name)
