"""The chat database: :class:`ChatStore` (see the package docstring for durability, threading and schema)."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from clover_desk.storage.errors import (
    NotFoundError,
    StorageError,
    StorageWriteError,
    write_error,
)
from clover_desk.storage.files import atomic_write_text
from clover_desk.storage.lock import LOCK_SUFFIX, StoreLock
from clover_desk.storage.records import (
    DEFAULT_TITLE,
    FINAL_STATUSES,
    ROLES,
    STATUSES,
    Conversation,
    Message,
    SearchHit,
    _chosen_path,
    branch_title,
    title_from_text,
)
from clover_desk.storage.schema import MIGRATIONS, SCHEMA_VERSION

log = logging.getLogger(__name__)


EXPORT_FORMAT = "clover-desk-chat"
EXPORT_VERSION = 1
EXPORT_MODE = 0o666  # exported files: a normal document (less the umask), not a private 0600 file


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


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="seconds")


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
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise write_error(self.path, exc, "create") or StorageError(
                f"cannot create the folder of the chat database {self.path}: {exc}"
            ) from exc
        # First the lock: nothing below (crash recovery least of all) may touch a database another instance holds.
        self._lock = StoreLock(self.path.with_name(self.path.name + LOCK_SUFFIX))
        self._lock.acquire()
        try:
            self._conn = sqlite3.connect(self.path, isolation_level=None, timeout=10.0)
        except sqlite3.Error as exc:
            self._lock.release()
            raise write_error(self.path, exc, "open") or StorageError(
                f"cannot open chat database {self.path}: {exc}"
            ) from exc
        self._conn.row_factory = sqlite3.Row
        self._last_ts = 0.0
        # Each chat's chosen path (message ids), once read: this store is the only writer of its database (the
        # lock), so it stays right until this store changes the chat's tree (dropped there, or extended by an
        # append). Appending a message then costs no walk of the whole chat.
        self._paths: dict[int, list[int]] = {}
        try:
            self._conn.execute("PRAGMA foreign_keys = ON")
            mode = self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                log.warning("chat database %s runs in %s journal mode (WAL unavailable)", self.path, mode)
            self._conn.execute("PRAGMA synchronous = NORMAL")
            self._migrate()
            self.recovered_message_ids: tuple[int, ...] = self._recover_interrupted()
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            self._lock.release()
            raise write_error(self.path, exc, "open") or StorageError(
                f"chat database {self.path} is unreadable: {exc}"
            ) from exc
        except BaseException:
            self._conn.close()
            self._lock.release()
            raise

    # ----------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Close the database and release its lock (idempotent)."""
        self._conn.close()
        self._lock.release()

    def __enter__(self) -> ChatStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, committed on success and rolled back on any exception (the COMMIT's included).

        A disk-full / read-only / I/O failure becomes :class:`StorageWriteError`; the store stays usable."""
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise (write_error(self.path, exc) or exc) from exc
        try:
            yield self._conn
            self._conn.execute("COMMIT")
        except BaseException as exc:
            self._rollback()
            error = write_error(self.path, exc) if isinstance(exc, (sqlite3.Error, OSError)) else None
            if error is not None:
                log.warning("%s", error)
                raise error from exc
            raise

    def _rollback(self) -> None:
        """Roll back the open transaction, if any (SQLite may already have rolled it back itself on SQLITE_FULL)."""
        if not self._conn.in_transaction:
            return
        try:
            self._conn.execute("ROLLBACK")
        except sqlite3.Error as exc:
            log.error("chat database %s: rollback failed: %s", self.path, exc)

    def _now(self) -> float:
        """Wall-clock seconds, strictly increasing within this store (so "most recent first" has no ties)."""
        now = max(time.time(), self._last_ts + 1e-6)
        self._last_ts = now
        return now

    @property
    def schema_version(self) -> int:
        row = self._conn.execute("SELECT MAX(version) FROM schema_migrations").fetchone()
        return int(row[0] or 0)

    def _migrate(self) -> None:
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            "version INTEGER PRIMARY KEY, description TEXT NOT NULL, applied REAL NOT NULL)"
        )
        current = self.schema_version
        if current > SCHEMA_VERSION:
            raise StorageError(
                f"chat database {self.path} has schema version {current}, newer than this Clover Desk "
                f"understands ({SCHEMA_VERSION}); open it with a newer version"
            )
        for version, description, statements in MIGRATIONS:
            if version <= current:
                continue
            log.info("chat database %s: migrating to schema %d (%s)", self.path, version, description)
            with self._tx() as conn:
                for statement in statements:
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO schema_migrations (version, description, applied) VALUES (?, ?, ?)",
                    (version, description, time.time()),
                )
                conn.execute(f"PRAGMA user_version = {int(version)}")

    def _recover_interrupted(self) -> tuple[int, ...]:
        rows = self._conn.execute("SELECT id, stats FROM messages WHERE status = 'streaming' ORDER BY id").fetchall()
        if not rows:
            return ()
        try:
            with self._tx() as conn:
                for row in rows:
                    stats = json.loads(row["stats"] or "{}")
                    stats["stop_reason"] = "interrupted"
                    conn.execute(
                        "UPDATE messages SET status = 'stopped', stats = ? WHERE id = ?", (json.dumps(stats), row["id"])
                    )
        except StorageWriteError as exc:  # e.g. a full disk: open anyway (chats stay readable); next open retries
            log.warning("chat database %s: cannot mark interrupted answers as stopped yet: %s", self.path, exc)
            return ()
        ids = tuple(int(r["id"]) for r in rows)
        log.warning("chat database %s: %d message(s) interrupted by a crash kept as stopped", self.path, len(ids))
        return ids

    # ----------------------------------------------------------------- rows -> objects

    @staticmethod
    def _conversation(row: sqlite3.Row) -> Conversation:
        return Conversation(
            id=int(row["id"]),
            title=row["title"],
            created=float(row["created"]),
            updated=float(row["updated"]),
            system_prompt=row["system_prompt"],
            settings=json.loads(row["settings"] or "{}"),
        )

    @staticmethod
    def _message(row: sqlite3.Row) -> Message:
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
        return self._conversation(row)

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
        return [self._conversation(r) for r in rows]

    def search(self, query: str, limit: int = 50) -> list[SearchHit]:
        """Conversations whose title or message text (answer or thinking) contains ``query``, most recent first.

        Case-insensitive substring match (SQLite LIKE: case folding covers ASCII only). A blank query lists every
        conversation.
        """
        query = query.strip()
        if not query:
            return [SearchHit(c, None, "") for c in self.list_conversations(limit=limit)]
        pattern = f"%{_escape_like(query)}%"
        rows = self._conn.execute(
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
            conversation = self._conversation(row)
            hit_id = row["hit_id"]
            if query.casefold() in conversation.title.casefold() or hit_id is None:
                hits.append(SearchHit(conversation, None if hit_id is None else int(hit_id), conversation.title))
                continue
            message = self.get_message(int(hit_id))
            text = message.content if query.casefold() in message.content.casefold() else message.thinking
            hits.append(SearchHit(conversation, message.id, _snippet(text, query)))
        return hits

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
        return self._message(row)

    def messages(self, conversation_id: int) -> list[Message]:
        """A conversation's messages in order: the chosen version of each (the path :meth:`select_version` set)."""
        rows = self._conn.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        ).fetchall()
        by_id = {int(r["id"]): r for r in rows}
        return [self._message(by_id[i]) for i in self._path_ids(conversation_id)]

    def all_messages(self, conversation_id: int) -> list[Message]:
        """Every message of a conversation, every version, in the order they were written."""
        rows = self._conn.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        ).fetchall()
        return [self._message(r) for r in rows]

    def _path_ids(self, conversation_id: int) -> list[int]:
        """The chosen path's ids (a copy of the cached list, else read: :meth:`_read_path`)."""
        path = self._paths.get(conversation_id)
        if path is None:
            path = self._paths[conversation_id] = self._read_path(conversation_id)
        return list(path)

    def _read_path(self, conversation_id: int) -> list[int]:
        """The chosen path's ids, followed in SQLite (one index lookup per message); should the tree break the rule
        of one chosen version per place (two, or none), it is walked in Python instead (:func:`_chosen_path`)."""
        rows = self._conn.execute(
            "WITH RECURSIVE path(id, depth) AS ("
            "SELECT id, 0 FROM messages WHERE conversation_id = :c AND parent_id IS NULL AND selected = 1 "
            "UNION ALL SELECT m.id, path.depth + 1 FROM path JOIN messages m "
            "ON m.conversation_id = :c AND m.parent_id = path.id AND m.selected = 1"
            ") SELECT id, depth FROM path ORDER BY depth",
            {"c": conversation_id},
        ).fetchall()
        ids = [int(r[0]) for r in rows]
        forked = any(r[1] != n for n, r in enumerate(rows))
        ends_early = ids and self._conn.execute(
            "SELECT 1 FROM messages WHERE conversation_id = ? AND parent_id = ? LIMIT 1", (conversation_id, ids[-1])
        ).fetchone() is not None  # (children, none of them chosen)
        if not forked and not ends_early and (ids or not self._has_messages(conversation_id)):
            return ids
        log.warning("chat %s: its versions are not one chosen per place; showing the newest", conversation_id)
        every = self._conn.execute(
            "SELECT id, parent_id, selected FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        ).fetchall()
        return _chosen_path((int(r[0]), r[1], r[2]) for r in every)

    def _has_messages(self, conversation_id: int) -> bool:
        return self._conn.execute(
            "SELECT 1 FROM messages WHERE conversation_id = ? LIMIT 1", (conversation_id,)
        ).fetchone() is not None

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
            deleted = self._delete_below(conn, current.conversation_id, message_id)
            conn.execute("UPDATE conversations SET updated = ? WHERE id = ?", (self._now(), current.conversation_id))
        return deleted

    def truncate_after(self, message_id: int, include: bool = False) -> int:
        """Delete the messages after ``message_id`` (every version below it), and that one too when ``include``
        (taking back a message that could not be answered): its newest remaining version is then shown. Returns
        how many were deleted."""
        current = self.get_message(message_id)
        self._paths.pop(current.conversation_id, None)
        with self._tx() as conn:
            deleted = self._delete_below(conn, current.conversation_id, message_id)
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

    @staticmethod
    def _delete_below(conn: sqlite3.Connection, conversation_id: int, message_id: int) -> int:
        """Delete every message under ``message_id`` (all versions, all depths); returns how many."""
        cur = conn.execute(
            "DELETE FROM messages WHERE id IN (WITH RECURSIVE below(id) AS ("
            "SELECT id FROM messages WHERE conversation_id = :c AND parent_id = :m "
            "UNION ALL SELECT m.id FROM messages m JOIN below ON m.conversation_id = :c AND m.parent_id = below.id"
            ") SELECT id FROM below)",
            {"c": conversation_id, "m": message_id},
        )
        return int(cur.rowcount)

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

    # ----------------------------------------------------------------- export

    def conversation_to_dict(self, conversation_id: int) -> dict[str, Any]:
        """A self-describing JSON-safe dict of a conversation and its messages."""
        c = self.get_conversation(conversation_id)
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
                for m in self.messages(conversation_id)
            ],
        }

    def conversation_to_markdown(self, conversation_id: int) -> str:
        """The conversation as Markdown: one ``##`` section per message, thinking in a collapsed ``<details>``."""
        c = self.get_conversation(conversation_id)
        parts = [f"# {c.title}", "", f"*Clover Desk chat, created {_iso(c.created)}, updated {_iso(c.updated)}.*", ""]
        if c.system_prompt:
            parts += ["**System prompt**", ""]
            parts += [f"> {line}" if line else ">" for line in c.system_prompt.splitlines()]
            parts.append("")
        for m in self.messages(conversation_id):
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

    def export_json(self, conversation_id: int, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`conversation_to_dict` to ``path`` atomically; returns the path."""
        text = json.dumps(self.conversation_to_dict(conversation_id), ensure_ascii=False, indent=2) + "\n"
        atomic_write_text(path, text, mode=EXPORT_MODE)
        return Path(path)

    def export_markdown(self, conversation_id: int, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`conversation_to_markdown` to ``path`` atomically; returns the path."""
        atomic_write_text(path, self.conversation_to_markdown(conversation_id), mode=EXPORT_MODE)
        return Path(path)

