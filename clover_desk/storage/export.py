"""Exporting a chat: a self-describing JSON document or Markdown, written atomically as a normal document."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from clover_desk.engine.files import atomic_write_text
from clover_desk.storage.records import Conversation, Message

EXPORT_FORMAT = "clover-desk-chat"
EXPORT_VERSION = 1
EXPORT_MODE = 0o666  # exported files: a normal document (less the umask), not a private 0600 file


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="seconds")


def conversation_to_dict(c: Conversation, messages: list[Message]) -> dict[str, Any]:
    """A self-describing JSON-safe dict of a conversation and its messages (those on show: ``ChatStore.messages``)."""
    return {
        "format": EXPORT_FORMAT,
        "version": EXPORT_VERSION,
        "exported": _iso(time.time()),
        "conversation": {
            "id": c.id,
            "title": c.title,
            "created": _iso(c.created),
            "updated": _iso(c.updated),
            "system_prompt": c.system_prompt,
            "settings": c.settings,
        },
        "messages": [
            {
                "id": m.id,
                "role": m.role,
                "content": m.content,
                "thinking": m.thinking,
                "thinking_seconds": m.thinking_seconds,
                "status": m.status,
                "stats": m.stats,
                "created": _iso(m.created),
            }
            for m in messages
        ],
    }

def conversation_to_markdown(c: Conversation, messages: list[Message]) -> str:
    """The conversation as Markdown: one ``##`` section per message, thinking in a collapsed ``<details>``."""
    parts = [f"# {c.title}", "", f"*Clover Desk chat, created {_iso(c.created)}, updated {_iso(c.updated)}.*", ""]
    if c.system_prompt:
        parts += ["**System prompt**", ""]
        parts += [f"> {line}" if line else ">" for line in c.system_prompt.splitlines()]
        parts.append("")
    for m in messages:
        parts += [f"## {m.role.capitalize()}", ""]
        if m.thinking:
            took = f" ({m.thinking_seconds:.1f} s)" if m.thinking_seconds is not None else ""
            parts += ["<details>", f"<summary>Thinking{took}</summary>", "", m.thinking.strip("\n"), "", "</details>", ""]
        if m.content:
            parts += [m.content.strip("\n"), ""]
        if m.status != "complete":
            reason = m.stats.get("stop_reason") or m.stats.get("error")
            parts += [f"*[{m.status}{f': {reason}' if reason else ''}]*", ""]
    return "\n".join(parts)

def write_json(c: Conversation, messages: list[Message], path: str | os.PathLike[str]) -> Path:
    """Write :meth:`conversation_to_dict` to ``path`` atomically; returns the path."""
    text = json.dumps(conversation_to_dict(c, messages), ensure_ascii=False, indent=2) + "\n"
    atomic_write_text(path, text, mode=EXPORT_MODE)
    return Path(path)

def write_markdown(c: Conversation, messages: list[Message], path: str | os.PathLike[str]) -> Path:
    """Write :meth:`conversation_to_markdown` to ``path`` atomically; returns the path."""
    atomic_write_text(path, conversation_to_markdown(c, messages), mode=EXPORT_MODE)
    return Path(path)
