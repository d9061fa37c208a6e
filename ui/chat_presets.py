"""Chat presets and the default system prompt for new chats, kept with the app's settings (no widgets).

A preset is a name for a chat's generation settings and system prompt (``GenerationSettings.to_dict()`` plus
``system_prompt``), as LM Studio's presets are. They live in the window's settings file (``window.ini``, a
``QSettings``; any object with ``value(key, default)`` / ``setValue(key, value)`` will do): ``chat/presets`` is one
JSON object ``{name: preset}``, ``chat/default_system_prompt`` the text a new chat starts with. A file edited by hand
into something else is ignored with a logged warning, never an error.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from clover_desk.ui.generation import GenerationSettings

log = logging.getLogger(__name__)

PRESETS_KEY = "chat/presets"
DEFAULT_PROMPT_KEY = "chat/default_system_prompt"
MAX_NAME_CHARS = 60


class SettingsLike(Protocol):
    def value(self, key: str, default: Any = None) -> Any: ...
    def setValue(self, key: str, value: Any) -> None: ...  # noqa: N802 - QSettings' name


class MemorySettings:
    """A ``SettingsLike`` in memory (a window built without a settings file: tests, tools)."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def value(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def setValue(self, key: str, value: Any) -> None:  # noqa: N802
        self.values[key] = value


class ChatPresets:
    """Named presets and the default system prompt, read from and written to ``settings`` at once."""

    def __init__(self, settings: SettingsLike | None) -> None:
        self.settings: SettingsLike = settings if settings is not None else MemorySettings()

    # -- presets
    def _all(self) -> dict[str, dict[str, Any]]:
        raw = self.settings.value(PRESETS_KEY, "") or ""
        try:
            data = json.loads(str(raw)) if raw else {}
        except ValueError as exc:
            log.warning("ignoring unreadable chat presets (%s): %s", PRESETS_KEY, exc)
            return {}
        if not isinstance(data, dict):
            log.warning("ignoring chat presets that are not a JSON object (%s)", PRESETS_KEY)
            return {}
        return {str(k): v for k, v in data.items() if isinstance(v, dict)}

    def names(self) -> list[str]:
        return sorted(self._all(), key=str.casefold)

    def get(self, name: str, base: GenerationSettings) -> tuple[GenerationSettings, str] | None:
        """The preset ``name`` over ``base`` (for keys it lacks) and its system prompt; None when there is none."""
        preset = self._all().get(name)
        if preset is None:
            return None
        prompt = preset.get("system_prompt")
        return GenerationSettings.from_dict(preset, base), prompt if isinstance(prompt, str) else ""

    def save(self, name: str, settings: GenerationSettings, system_prompt: str) -> str:
        """Save (or replace) a preset; returns the name as kept. ValueError (one line) for an empty name."""
        name = " ".join(name.split())[:MAX_NAME_CHARS]
        if not name:
            raise ValueError("a preset needs a name")
        presets = self._all()
        presets[name] = {**settings.to_dict(), "system_prompt": system_prompt}
        self._write(presets)
        return name

    def delete(self, name: str) -> bool:
        presets = self._all()
        if presets.pop(name, None) is None:
            return False
        self._write(presets)
        return True

    def _write(self, presets: Mapping[str, Any]) -> None:
        self.settings.setValue(PRESETS_KEY, json.dumps(presets, ensure_ascii=False, sort_keys=True))

    # -- the default system prompt
    def default_system_prompt(self) -> str:
        value = self.settings.value(DEFAULT_PROMPT_KEY, "")
        return value if isinstance(value, str) else ""

    def set_default_system_prompt(self, text: str) -> None:
        self.settings.setValue(DEFAULT_PROMPT_KEY, text.strip())
