"""The message tree of a chat: each message hangs under the one it follows, versions are siblings, one chosen per
place; the chat on show is the chosen path from the first message."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable

log = logging.getLogger(__name__)


def chosen_path(rows: Iterable[tuple[int, int | None, int]]) -> list[int]:
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


def read_chosen_path(conn: sqlite3.Connection, conversation_id: int) -> list[int]:
    """The chosen path's ids, followed in SQLite (one index lookup per message); should the tree break the rule
    of one chosen version per place (two, or none), it is walked in Python instead (:func:`chosen_path`)."""
    rows = conn.execute(
        "WITH RECURSIVE path(id, depth) AS ("
        "SELECT id, 0 FROM messages WHERE conversation_id = :c AND parent_id IS NULL AND selected = 1 "
        "UNION ALL SELECT m.id, path.depth + 1 FROM path JOIN messages m "
        "ON m.conversation_id = :c AND m.parent_id = path.id AND m.selected = 1"
        ") SELECT id, depth FROM path ORDER BY depth",
        {"c": conversation_id},
    ).fetchall()
    ids = [int(r[0]) for r in rows]
    forked = any(r[1] != n for n, r in enumerate(rows))
    ends_early = ids and conn.execute(
        "SELECT 1 FROM messages WHERE conversation_id = ? AND parent_id = ? LIMIT 1", (conversation_id, ids[-1])
    ).fetchone() is not None  # (children, none of them chosen)
    if not forked and not ends_early and (ids or not _has_messages(conn, conversation_id)):
        return ids
    log.warning("chat %s: its versions are not one chosen per place; showing the newest", conversation_id)
    every = conn.execute(
        "SELECT id, parent_id, selected FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
    ).fetchall()
    return chosen_path((int(r[0]), r[1], r[2]) for r in every)

def _has_messages(conn: sqlite3.Connection, conversation_id: int) -> bool:
    return conn.execute(
        "SELECT 1 FROM messages WHERE conversation_id = ? LIMIT 1", (conversation_id,)
    ).fetchone() is not None


def delete_below(conn: sqlite3.Connection, conversation_id: int, message_id: int) -> int:
    """Delete every message under ``message_id`` (all versions, all depths); returns how many."""
    cur = conn.execute(
        "DELETE FROM messages WHERE id IN (WITH RECURSIVE below(id) AS ("
        "SELECT id FROM messages WHERE conversation_id = :c AND parent_id = :m "
        "UNION ALL SELECT m.id FROM messages m JOIN below ON m.conversation_id = :c AND m.parent_id = below.id"
        ") SELECT id FROM below)",
        {"c": conversation_id, "m": message_id},
    )
    return int(cur.rowcount)
