"""What the chat store hands out: conversations, messages, search hits, and the rules for a chat's title."""

from __future__ import annotations

import json
import re
import sqlite3
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
STATUSES = ("complete", "streaming", "stopped", "error")
FINAL_STATUSES = ("complete", "stopped", "error")
DEFAULT_TITLE = "New chat"


@dataclass(frozen=True)
class Conversation:
    """One chat. Times are Unix seconds; ``settings`` is free-form JSON the UI owns (generation params, model)."""

    id: int
    title: str
    created: float
    updated: float
    system_prompt: str = ""
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Message:
    """One turn. ``status``: complete | streaming (being generated) | stopped (by the user or a crash) | error.

    ``parent_id``: the message it follows (None: the chat's first); its siblings are its other versions."""

    id: int
    conversation_id: int
    role: str
    content: str
    thinking: str
    thinking_seconds: float | None
    status: str
    stats: dict[str, Any]
    created: float
    parent_id: int | None = None


@dataclass(frozen=True)
class SearchHit:
    """A conversation matching a search: ``message_id`` is the first matching message (None: the title matched)."""

    conversation: Conversation
    message_id: int | None
    snippet: str


def title_from_text(text: str, max_chars: int = 60) -> str:
    """A chat title from the first user message: its first non-empty line, cut at a word near ``max_chars``."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if not line:
        return DEFAULT_TITLE
    if len(line) <= max_chars:
        return line
    cut = line[:max_chars].rsplit(" ", 1)[0] if " " in line[:max_chars] else line[:max_chars]
    return cut.rstrip(" ,.;:") + "…"


def branch_title(title: str) -> str:
    """"Trip plan" -> "Trip plan (branch)", then "(branch 2)", "(branch 3)" for branches of branches."""
    match = re.fullmatch(r"(.*) \(branch(?: (\d+))?\)", title, re.DOTALL)
    if match is None:
        return f"{title} (branch)"
    return f"{match[1]} (branch {int(match[2] or 1) + 1})"


def conversation_from_row(row: sqlite3.Row) -> Conversation:
    """A conversations row as a :class:`Conversation`."""
    return Conversation(
        id=int(row["id"]),
        title=row["title"],
        created=float(row["created"]),
        updated=float(row["updated"]),
        system_prompt=row["system_prompt"],
        settings=json.loads(row["settings"] or "{}"),
    )


def message_from_row(row: sqlite3.Row) -> Message:
    """A messages row as a :class:`Message`."""
    return Message(
        id=int(row["id"]),
        conversation_id=int(row["conversation_id"]),
        role=row["role"],
        content=row["content"],
        thinking=row["thinking"],
        thinking_seconds=None if row["thinking_seconds"] is None else float(row["thinking_seconds"]),
        status=row["status"],
        stats=json.loads(row["stats"] or "{}"),
        created=float(row["created"]),
        parent_id=None if row["parent_id"] is None else int(row["parent_id"]),
    )
