"""Finding chats: a case-insensitive substring search over titles and message text, with a snippet per hit."""

from __future__ import annotations

import sqlite3

from clover_desk.storage.records import SearchHit, conversation_from_row, message_from_row


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _snippet(text: str, query: str, width: int = 80) -> str:
    """About ``width`` characters of ``text`` around the first case-insensitive occurrence of ``query``."""
    flat = " ".join(text.split())
    at = flat.casefold().find(query.casefold())
    if at < 0:
        return flat[:width]
    start = max(0, at - width // 3)
    end = min(len(flat), start + width)
    return ("…" if start > 0 else "") + flat[start:end] + ("…" if end < len(flat) else "")


def search(conn: sqlite3.Connection, query: str, limit: int = 50) -> list[SearchHit]:
    """Conversations whose title or message text (answer or thinking) contains ``query``, most recent first.

    Case-insensitive substring match (SQLite LIKE: case folding covers ASCII only). A blank query lists every
    conversation.
    """
    query = query.strip()
    if not query:
        rows = conn.execute("SELECT * FROM conversations ORDER BY updated DESC, id DESC LIMIT ?", (limit,)).fetchall()
        return [SearchHit(conversation_from_row(r), None, "") for r in rows]
    pattern = f"%{_escape_like(query)}%"
    rows = conn.execute(
        """
        SELECT c.*, (
            SELECT m.id FROM messages m
            WHERE m.conversation_id = c.id
              AND (m.content LIKE :p ESCAPE '\\' OR m.thinking LIKE :p ESCAPE '\\')
            ORDER BY m.id LIMIT 1
        ) AS hit_id
        FROM conversations c
        WHERE c.title LIKE :p ESCAPE '\\' OR hit_id IS NOT NULL
        ORDER BY c.updated DESC, c.id DESC
        LIMIT :limit
        """,
        {"p": pattern, "limit": limit},
    ).fetchall()
    hits: list[SearchHit] = []
    for row in rows:
        conversation = conversation_from_row(row)
        hit_id = row["hit_id"]
        if query.casefold() in conversation.title.casefold() or hit_id is None:
            hits.append(SearchHit(conversation, None if hit_id is None else int(hit_id), conversation.title))
            continue
        message = message_from_row(conn.execute("SELECT * FROM messages WHERE id = ?", (int(hit_id),)).fetchone())
        text = message.content if query.casefold() in message.content.casefold() else message.thinking
        hits.append(SearchHit(conversation, message.id, _snippet(text, query)))
    return hits
