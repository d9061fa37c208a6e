"""The chat database: :class:`ChatStore` (see the package docstring for durability, threading and schema)."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from clover_desk.storage import export, search
from clover_desk.storage.database import Database
from clover_desk.storage.errors import (
    NotFoundError,
    StorageError,
)
from clover_desk.storage.records import (
    DEFAULT_TITLE,
    FINAL_STATUSES,
    ROLES,
    STATUSES,
    Conversation,
    Message,
    SearchHit,
    branch_title,
    conversation_from_row,
    message_from_row,
    title_from_text,
)
from clover_desk.storage.tree import delete_below, read_chosen_path

log = logging.getLogger(__name__)


class ChatStore:
    """The chat database. Open one per application instance, on the GUI thread (see the module docstring)."""

    # For callers that may not import this module (the Qt window): the error every failed change raises, as
    # sqlite3.Connection.Error, and the one rule for a chat's title from its first message.
    Error = StorageError
    title_for = staticmethod(title_from_text)

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Open (creating when needed) the database at ``path``, after taking its single-instance lock.

        Raises StoreLockedError when another running instance holds it, StorageWriteError when its folder is
        read-only (or the disk is full while creating or migrating it), StorageError when it is unreadable."""
        self._db = Database(path)
        self.path = self._db.path
        self._conn = self._db.conn
        self._tx = self._db.transaction
        self.recovered_message_ids: tuple[int, ...] = self._db.recovered_message_ids
        self._last_ts = 0.0
        # Each chat's chosen path (message ids), once read: this store is the only writer of its database (the
        # lock), so it stays right until this store changes the chat's tree (dropped there, or extended by an
        # append). Appending a message then costs no walk of the whole chat.
        self._paths: dict[int, list[int]] = {}

    def close(self) -> None:
        """Close the database and release its lock (idempotent)."""
        self._db.close()

    def __enter__(self) -> ChatStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _now(self) -> float:
        """Wall-clock seconds, strictly increasing within this store (so "most recent first" has no ties)."""
        now = max(time.time(), self._last_ts + 1e-6)
        self._last_ts = now
        return now

    @property
    def schema_version(self) -> int:
        return self._db.schema_version

    # ----------------------------------------------------------------- conversations

    def create_conversation(
        self, title: str = DEFAULT_TITLE, system_prompt: str = "", settings: dict[str, Any] | None = None
    ) -> Conversation:
        now = self._now()
        with self._tx() as conn:
            cur = conn.execute(
                "INSERT INTO conversations (title, created, updated, system_prompt, settings) VALUES (?, ?, ?, ?, ?)",
                (title, now, now, system_prompt, json.dumps(settings or {})),
            )
        return self.get_conversation(int(cur.lastrowid))

    def branch_conversation(self, message_id: int) -> Conversation:
        """A new chat that starts as this message's chat did, up to and including the message: the same system
        prompt and settings, copies of the messages that lead to it (its versions' path; an answer still being
        written is left out; the other versions are not copied), titled after the original. One transaction: the
        branch is there whole or not at all; the original is not touched."""
        current = self.get_message(message_id)
        source = self.get_conversation(current.conversation_id)
        chain = [m for m in self._ancestors(current) if m.status != "streaming"]
        now = self._now()
        with self._tx() as conn:
            cur = conn.execute(
                "INSERT INTO conversations (title, created, updated, system_prompt, settings) VALUES (?, ?, ?, ?, ?)",
                (branch_title(source.title), now, now, source.system_prompt, json.dumps(source.settings)),
            )
            new_id = int(cur.lastrowid)
            parent: int | None = None
            for m in chain:
                parent = int(conn.execute(
                    "INSERT INTO messages (conversation_id, role, content, thinking, thinking_seconds, status, stats, "
                    "created, parent_id, selected) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 1)",
                    (new_id, m.role, m.content, m.thinking, m.thinking_seconds, m.status, json.dumps(m.stats),
                     m.created, parent),
                ).lastrowid)
        return self.get_conversation(new_id)

    def get_conversation(self, conversation_id: int) -> Conversation:
        row = self._conn.execute("SELECT * FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"no conversation with id {conversation_id}")
        return conversation_from_row(row)

    def update_conversation(
        self,
        conversation_id: int,
        *,
        title: str | None = None,
        system_prompt: str | None = None,
        settings: dict[str, Any] | None = None,
    ) -> Conversation:
        """Change any of title / system prompt / settings (settings are replaced whole); bumps ``updated``."""
        sets: list[str] = ["updated = ?"]
        values: list[Any] = [self._now()]
        if title is not None:
            sets.append("title = ?")
            values.append(title)
        if system_prompt is not None:
            sets.append("system_prompt = ?")
            values.append(system_prompt)
        if settings is not None:
            sets.append("settings = ?")
            values.append(json.dumps(settings))
        with self._tx() as conn:
            cur = conn.execute(f"UPDATE conversations SET {', '.join(sets)} WHERE id = ?", (*values, conversation_id))
            if cur.rowcount == 0:
                raise NotFoundError(f"no conversation with id {conversation_id}")
        return self.get_conversation(conversation_id)

    def rename_conversation(self, conversation_id: int, title: str) -> Conversation:
        return self.update_conversation(conversation_id, title=title)

    def delete_conversation(self, conversation_id: int) -> None:
        """Delete a conversation and (by cascade) its messages."""
        self._paths.pop(conversation_id, None)
        with self._tx() as conn:
            cur = conn.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
            if cur.rowcount == 0:
                raise NotFoundError(f"no conversation with id {conversation_id}")

    def list_conversations(self, limit: int | None = None, offset: int = 0) -> list[Conversation]:
        """Conversations, most recently updated first."""
        rows = self._conn.execute(
            "SELECT * FROM conversations ORDER BY updated DESC, id DESC LIMIT ? OFFSET ?",
            (-1 if limit is None else limit, offset),
        ).fetchall()
        return [conversation_from_row(r) for r in rows]

    def search(self, query: str, limit: int = 50) -> list[SearchHit]:
        """Conversations whose title or message text contains ``query``, most recent first (:func:`search.search`)."""
        return search.search(self._conn, query, limit)

    # ----------------------------------------------------------------- messages

    def add_message(
        self,
        conversation_id: int,
        role: str,
        content: str = "",
        *,
        thinking: str = "",
        thinking_seconds: float | None = None,
        status: str = "complete",
        stats: dict[str, Any] | None = None,
        version_of: int | None = None,
    ) -> Message:
        """Append a message after the chat's last one (on the chosen path), or, with ``version_of``, as a new
        version of that message (same place in the chat: a regenerated answer, an edited message): the new one is
        chosen, the old ones stay. For an answer being generated use ``role="assistant", status="streaming"``."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, not {status!r}")
        path: list[int] | None = None
        if version_of is None:
            path = self._path_ids(conversation_id)
            parent = path[-1] if path else None
        else:
            other = self.get_message(version_of)
            if other.conversation_id != conversation_id:
                raise StorageError(f"message {version_of} is not in conversation {conversation_id}")
            parent = other.parent_id
        now = self._now()
        with self._tx() as conn:
            conn.execute(
                "UPDATE messages SET selected = 0 WHERE conversation_id = ? AND parent_id IS ?", (conversation_id, parent)
            )
            try:
                cur = conn.execute(
                    "INSERT INTO messages (conversation_id, role, content, thinking, thinking_seconds, status, stats,"
                    " created, parent_id, selected) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 1)",
                    (conversation_id, role, content, thinking, thinking_seconds, status, json.dumps(stats or {}), now,
                     parent),
                )
            except sqlite3.IntegrityError as exc:
                raise NotFoundError(f"no conversation with id {conversation_id}") from exc
            conn.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
        if path is None:  # a new version: the path below its place changed
            self._paths.pop(conversation_id, None)
        else:
            self._paths[conversation_id] = [*path, int(cur.lastrowid)]
        return self.get_message(int(cur.lastrowid))

    def get_message(self, message_id: int) -> Message:
        row = self._conn.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"no message with id {message_id}")
        return message_from_row(row)

    def messages(self, conversation_id: int) -> list[Message]:
        """A conversation's messages in order: the chosen version of each (the path :meth:`select_version` set)."""
        rows = self._conn.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        ).fetchall()
        by_id = {int(r["id"]): r for r in rows}
        return [message_from_row(by_id[i]) for i in self._path_ids(conversation_id)]

    def all_messages(self, conversation_id: int) -> list[Message]:
        """Every message of a conversation, every version, in the order they were written."""
        rows = self._conn.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        ).fetchall()
        return [message_from_row(r) for r in rows]

    def _path_ids(self, conversation_id: int) -> list[int]:
        """The chosen path's ids (a copy of the cached list, else read: :func:`tree.read_chosen_path`)."""
        path = self._paths.get(conversation_id)
        if path is None:
            path = self._paths[conversation_id] = read_chosen_path(self._conn, conversation_id)
        return list(path)

    def _ancestors(self, message: Message) -> list[Message]:
        """The messages that lead to ``message``, from the chat's first, ``message`` last."""
        chain = [message]
        while chain[-1].parent_id is not None:
            chain.append(self.get_message(chain[-1].parent_id))
        return chain[::-1]

    def versions(self, message_id: int) -> list[int]:
        """The ids of a message's versions (itself and its siblings: the same place in the chat), oldest first."""
        m = self.get_message(message_id)
        rows = self._conn.execute(
            "SELECT id FROM messages WHERE conversation_id = ? AND parent_id IS ? ORDER BY id",
            (m.conversation_id, m.parent_id),
        ).fetchall()
        return [int(r[0]) for r in rows]

    def version_counts(self, conversation_id: int) -> dict[int, tuple[int, int]]:
        """For every message of a conversation: (which version it is, 1-based; how many versions its place has)."""
        rows = self._conn.execute(
            "SELECT id, parent_id FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        ).fetchall()
        siblings: dict[int | None, list[int]] = {}
        for r in rows:
            siblings.setdefault(r[1], []).append(int(r[0]))
        return {i: (n + 1, len(ids)) for ids in siblings.values() for n, i in enumerate(ids)}

    def select_version(self, message_id: int) -> None:
        """Show this version of its place in the chat (its siblings stay, not shown); the messages after it are
        the ones chosen under it last time (each version keeps its own continuation)."""
        m = self.get_message(message_id)
        self._paths.pop(m.conversation_id, None)
        with self._tx() as conn:
            conn.execute(
                "UPDATE messages SET selected = (id = ?) WHERE conversation_id = ? AND parent_id IS ?",
                (message_id, m.conversation_id, m.parent_id),
            )

    def append_streaming(self, message_id: int, answer_delta: str = "", thinking_delta: str = "") -> None:
        """Append committed text to a ``streaming`` message: one committed transaction per call.

        Call it each time the engine commits a block, with the text that block added to each channel
        (:class:`StreamRecorder` does exactly that).
        """
        if not answer_delta and not thinking_delta:
            return
        now = self._now()
        with self._tx() as conn:
            cur = conn.execute(
                "UPDATE messages SET content = content || ?, thinking = thinking || ? "
                "WHERE id = ? AND status = 'streaming'",
                (answer_delta, thinking_delta, message_id),
            )
            if cur.rowcount == 0:
                raise StorageError(f"message {message_id} does not exist or is not streaming")
            conn.execute(
                "UPDATE conversations SET updated = ? "
                "WHERE id = (SELECT conversation_id FROM messages WHERE id = ?)",
                (now, message_id),
            )

    def finish_message(
        self,
        message_id: int,
        status: str = "complete",
        *,
        stats: dict[str, Any] | None = None,
        thinking_seconds: float | None = None,
        content: str | None = None,
        thinking: str | None = None,
    ) -> Message:
        """End a streaming message: final status (complete | stopped | error), stats (merged into any already
        stored), optional thinking time, and optionally the full final text (the engine's ``Finished`` carries it)."""
        if status not in FINAL_STATUSES:
            raise ValueError(f"a finished message's status must be one of {FINAL_STATUSES}, not {status!r}")
        current = self.get_message(message_id)
        merged = {**current.stats, **(stats or {})}
        with self._tx() as conn:
            conn.execute(
                "UPDATE messages SET status = ?, stats = ?, thinking_seconds = COALESCE(?, thinking_seconds), "
                "content = COALESCE(?, content), thinking = COALESCE(?, thinking) WHERE id = ?",
                (status, json.dumps(merged), thinking_seconds, content, thinking, message_id),
            )
            conn.execute(
                "UPDATE conversations SET updated = ? WHERE id = ?", (self._now(), current.conversation_id)
            )
        return self.get_message(message_id)

    def reopen_message(self, message_id: int) -> Message:
        """Make a finished answer ``streaming`` again, to continue it (``GenerationParams.continue_final_message``):
        only the last message of its conversation, an assistant answer that is ``complete`` or ``stopped`` (not
        one that failed). Its text stays; :class:`StreamRecorder` appends to it, and a crash keeps it (as stopped,
        interrupted) like any answer being written."""
        current = self.get_message(message_id)
        path = self._path_ids(current.conversation_id)
        last = path[-1] if path else None
        if current.role != "assistant" or current.status not in ("complete", "stopped") or last != message_id:
            raise StorageError(
                f"message {message_id} cannot be continued: only the last answer of a chat, complete or stopped, can "
                f"(this one: role {current.role!r}, status {current.status!r}"
                f"{'' if last == message_id else ', not the last'})")
        with self._tx() as conn:
            conn.execute("UPDATE messages SET status = 'streaming' WHERE id = ?", (message_id,))
            conn.execute("UPDATE conversations SET updated = ? WHERE id = ?", (self._now(), current.conversation_id))
        return self.get_message(message_id)

    def edit_message(self, message_id: int, content: str) -> int:
        """Replace a message's text in place and delete everything after it (every version below it). The window
        keeps the old text instead (``add_message(..., version_of=...)``); this is for rewriting history.

        Returns how many later messages were deleted.
        """
        current = self.get_message(message_id)
        self._paths.pop(current.conversation_id, None)
        with self._tx() as conn:
            conn.execute("UPDATE messages SET content = ?, status = 'complete' WHERE id = ?", (content, message_id))
            deleted = delete_below(conn, current.conversation_id, message_id)
            conn.execute("UPDATE conversations SET updated = ? WHERE id = ?", (self._now(), current.conversation_id))
        return deleted

    def truncate_after(self, message_id: int, include: bool = False) -> int:
        """Delete the messages after ``message_id`` (every version below it), and that one too when ``include``
        (taking back a message that could not be answered): its newest remaining version is then shown. Returns
        how many were deleted."""
        current = self.get_message(message_id)
        self._paths.pop(current.conversation_id, None)
        with self._tx() as conn:
            deleted = delete_below(conn, current.conversation_id, message_id)
            if include:
                deleted += conn.execute("DELETE FROM messages WHERE id = ?", (message_id,)).rowcount
                conn.execute(
                    "UPDATE messages SET selected = 1 WHERE id = (SELECT MAX(id) FROM messages "
                    "WHERE conversation_id = ? AND parent_id IS ?) AND NOT EXISTS (SELECT 1 FROM messages "
                    "WHERE conversation_id = ? AND parent_id IS ? AND selected = 1)",
                    (current.conversation_id, current.parent_id, current.conversation_id, current.parent_id),
                )
            conn.execute("UPDATE conversations SET updated = ? WHERE id = ?", (self._now(), current.conversation_id))
        return int(deleted)

    def chat_messages(self, conversation_id: int) -> list[dict[str, str]]:
        """The conversation as engine ``messages`` (system prompt first; failed answers left out)."""
        conversation = self.get_conversation(conversation_id)
        out: list[dict[str, str]] = []
        if conversation.system_prompt:
            out.append({"role": "system", "content": conversation.system_prompt})
        for m in self.messages(conversation_id):
            if m.status in ("streaming", "error"):
                continue
            out.append({"role": m.role, "content": m.content})
        return out

    # ----------------------------------------------------------------- export (clover_desk.storage.export)

    def export_json(self, conversation_id: int, path: str | os.PathLike[str]) -> Path:
        """Write the chat as JSON to ``path`` atomically (:func:`export.write_json`); returns the path."""
        return export.write_json(self.get_conversation(conversation_id), self.messages(conversation_id), path)

    def export_markdown(self, conversation_id: int, path: str | os.PathLike[str]) -> Path:
        """Write the chat as Markdown to ``path`` atomically (:func:`export.write_markdown`); returns the path."""
        return export.write_markdown(self.get_conversation(conversation_id), self.messages(conversation_id), path)
