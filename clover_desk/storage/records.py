"""What the chat store hands out: conversations, messages, search hits, and the rules for a chat's title."""

from __future__ import annotations

import re
from collections.abc import Iterable
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


def _chosen_path(rows: Iterable[tuple[int, int | None, int]]) -> list[int]:
    """The ids of the chosen path through a chat's message tree, from ``(id, parent_id, selected)`` rows in id
    order: from the first message, at each place the chosen version (the newest chosen one should two be; the
    newest when none is), until a message with nothing after it."""
    children: dict[int | None, list[tuple[int, int]]] = {}
    for message_id, parent_id, selected in rows:
        children.setdefault(parent_id, []).append((message_id, int(selected)))
    path: list[int] = []
    at: int | None = None
    while at in children:
        options = children[at]
        chosen = [i for i, sel in options if sel]
        at = chosen[-1] if chosen else options[-1][0]
        path.append(at)
    return path
