"""Chat persistence in SQLite: conversations, messages, search, export, crash recovery.

Durability model
    The database runs in WAL mode with ``synchronous=NORMAL``: every committed transaction survives a crash or a
    ``kill -9`` of the application (only a power cut can lose the last few). :meth:`ChatStore.append_streaming` is
    one committed transaction per call, and the chat view calls it each time the engine commits a block, so a crash
    loses at most the block in flight. A message still marked ``streaming`` when the database is next opened was
    interrupted: :class:`ChatStore` marks it ``stopped`` (``stats["stop_reason"] == "interrupted"``) and keeps its
    text; the ids are in :attr:`ChatStore.recovered_message_ids`.

Threading
    A :class:`ChatStore` belongs to the thread that opened it (the GUI thread). sqlite3's ``check_same_thread``
    guard turns a call from any other thread into ``sqlite3.ProgrammingError`` instead of silent corruption. The
    calls are small single-row statements (well under a millisecond), which is why they may run on the GUI thread.
    One application instance opens a given database at a time, and this is enforced: :class:`ChatStore` takes an
    exclusive OS lock (:class:`StoreLock`: ``fcntl.flock`` on Linux/macOS, ``msvcrt.locking`` on Windows) on
    ``<database>.lock`` beside the database *before* anything else, crash recovery included, and holds it until
    :meth:`ChatStore.close`. A second instance is refused with :class:`StoreLockedError` (the GUI says "Clover Desk
    is already running with this data folder" and exits with status 2); it never opens the database read-only, so
    it can never mark the first instance's streaming answer "stopped". The OS drops the lock when its process ends,
    however it ends, so a crash or ``kill -9`` never leaves a stale lock.

Write failures
    Every change runs in one transaction (:meth:`ChatStore._tx`). When the disk is full (``database or disk is
    full``, ``ENOSPC``), the folder is read-only or the disk reports an I/O error, the transaction is rolled back
    (nothing of that change is kept, the database stays usable) and :class:`StorageWriteError` is raised with one
    line that names the file and what to do; :class:`StreamRecorder` stops saving the answer on the first failure.
    A data folder where the lock file cannot be created (read-only) is refused at open with a
    :class:`StorageWriteError` that says to make it writable or to set ``CLOVER_DESK_HOME``.

Schema
    Versioned by the ``schema_migrations`` table (one row per applied migration; ``PRAGMA user_version`` mirrors the
    latest). :data:`MIGRATIONS` is append-only; each migration runs in its own transaction together with its row.
    Since schema 4 a chat's messages form a tree: each hangs under the one it follows (``parent_id``), a
    regenerated answer or an edited message is a sibling (a *version*), one version per place is chosen
    (``selected``), and :meth:`ChatStore.messages` (what is shown, sent to the engine, exported) is the chosen path.
    A database written by a newer Clover Desk (unknown version) is refused with :class:`StorageError`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets
import sqlite3
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from clover_desk.worker.remote import RemoteFinished
from engine.decode.events import BlockCommitted, EngineError, Event, Finished, PromptInfo, TextDelta, continued_stats

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
STATUSES = ("complete", "streaming", "stopped", "error")
FINAL_STATUSES = ("complete", "stopped", "error")
DEFAULT_TITLE = "New chat"
EXPORT_FORMAT = "clover-desk-chat"
EXPORT_VERSION = 1
EXPORT_MODE = 0o666  # exported files: a normal document (less the umask), not a private 0600 file


class StorageError(Exception):
    """The chat database cannot be opened or changed as asked (the message says which file / row / value)."""


class NotFoundError(StorageError, LookupError):
    """No conversation or message with that id."""


class StoreLockedError(StorageError):
    """Another running Clover Desk holds this chat database (its lock file is locked)."""


class StorageWriteError(StorageError):
    """A change could not be written (disk full, read-only folder, I/O error); it was rolled back.

    ``reason`` is "disk-full", "read-only", "io" or "busy"."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


LOCK_SUFFIX = ".lock"
HOME_HINT = "set CLOVER_DESK_HOME to a writable folder"


def write_failure_reason(exc: BaseException) -> str | None:
    """What kind of write failure ``exc`` is: "disk-full", "read-only", "io", "busy", or None (not one)."""
    if isinstance(exc, OSError):
        if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            return "disk-full"
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return "read-only"
        if exc.errno == errno.EIO:
            return "io"
        return None
    if not isinstance(exc, sqlite3.Error):
        return None
    name = str(getattr(exc, "sqlite_errorname", "") or "")
    text = str(exc).lower()
    if name == "SQLITE_FULL" or "database or disk is full" in text:
        return "disk-full"
    if name.startswith("SQLITE_READONLY") or "readonly database" in text or name == "SQLITE_CANTOPEN" or (
        "unable to open database file" in text
    ):
        return "read-only"
    if name.startswith("SQLITE_IOERR") or "disk i/o error" in text:
        return "io"
    if name.startswith("SQLITE_BUSY") or "database is locked" in text:
        return "busy"
    return None


def write_error(path: Path, exc: BaseException, doing: str = "save to") -> StorageWriteError | None:
    """The one-line :class:`StorageWriteError` for a write failure ``exc`` on ``path`` (None: not one)."""
    reason = write_failure_reason(exc)
    if reason is None:
        return None
    what = {
        "disk-full": f"the disk is full ({exc}); free some space and try again",
        "read-only": f"the folder {path.parent} is read-only ({exc}); make it writable or {HOME_HINT}",
        "io": f"the disk reported an I/O error ({exc}); check the disk, or {HOME_HINT}",
        "busy": f"another program is writing to it ({exc}); try again",
    }[reason]
    return StorageWriteError(f"cannot {doing} the chat database {path}: {what}", reason)


class StoreLock:
    """An exclusive lock on ``path`` (a small file beside the database holding the owner's pid), so one Clover Desk
    at a time uses a chat database. ``fcntl.flock`` on Linux/macOS, ``msvcrt.locking`` on Windows: the OS drops
    it when the owning process ends, so a crash never leaves it stale. The descriptor is not inherited by child
    processes (the engine worker never holds it)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or raise StoreLockedError (held elsewhere) / StorageWriteError (cannot create the file)."""
        if self._fd is not None:
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            error = write_error(self.path, exc, "lock")
            if error is not None and error.reason == "read-only":
                raise StorageWriteError(
                    f"the data folder {self.path.parent} is read-only: cannot write {self.path.name} there "
                    f"({exc.strerror}); make it writable or {HOME_HINT}",
                    "read-only",
                ) from exc
            raise error or StorageError(f"cannot create the lock file {self.path}: {exc}") from exc
        try:
            locked = _try_lock(fd)
        except OSError as exc:  # e.g. a network file system without locks: run, but say so
            log.warning("cannot lock %s (%s): running without the single-instance guard", self.path, exc)
            locked = True
        if not locked:
            holder = _read_pid(fd)
            os.close(fd)
            by = f" (process {holder})" if holder else ""
            raise StoreLockedError(
                f"Clover Desk is already running with this data folder {self.path.parent}{by}; close it first, "
                f"or set CLOVER_DESK_HOME to another folder"
            )
        self._fd = fd
        try:  # the pid is only a hint for the message above: a full disk must not stop the app here
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, f"{os.getpid()}\n".encode("ascii"))
        except OSError as exc:
            log.debug("cannot write the pid into %s: %s", self.path, exc)

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays: removing it could race with another instance taking it."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            _unlock(fd)
        except OSError:
            pass
        os.close(fd)

    def __del__(self) -> None:  # a store dropped without close() must not keep its database locked
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter teardown: the OS drops the lock with the process anyway
            pass


if sys.platform == "win32":  # pragma: no cover - exercised on Windows only
    import msvcrt

    def _try_lock(fd: int) -> bool:
        os.lseek(fd, 0, os.SEEK_SET)
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EDEADLK):
                return False
            raise
        return True

    def _unlock(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)

else:
    import fcntl

    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0) if hasattr(os, "pread") else b""
        return int(text.decode("ascii").strip() or 0) or None
    except (OSError, ValueError):
        return None


# Append-only: (version, description, statements). Never edit a released migration; add a new one.
MIGRATIONS: tuple[tuple[int, str, tuple[str, ...]], ...] = (
    (
        1,
        "conversations and messages",
        (
            """CREATE TABLE conversations (
                id INTEGER PRIMARY KEY,
                title TEXT NOT NULL,
                created REAL NOT NULL,
                updated REAL NOT NULL,
                system_prompt TEXT NOT NULL DEFAULT '',
                settings TEXT NOT NULL DEFAULT '{}'
            )""",
            """CREATE TABLE messages (
                id INTEGER PRIMARY KEY,
                conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
                role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
                content TEXT NOT NULL DEFAULT '',
                thinking TEXT NOT NULL DEFAULT '',
                thinking_seconds REAL,
                status TEXT NOT NULL DEFAULT 'complete'
                    CHECK (status IN ('complete', 'streaming', 'stopped', 'error')),
                stats TEXT NOT NULL DEFAULT '{}',
                created REAL NOT NULL
            )""",
        ),
    ),
    (
        2,
        "indexes for the chat list and message order",
        (
            "CREATE INDEX messages_by_conversation ON messages(conversation_id, id)",
            "CREATE INDEX conversations_by_updated ON conversations(updated DESC, id DESC)",
            "CREATE INDEX messages_streaming ON messages(status) WHERE status = 'streaming'",
        ),
    ),
    (
        3,
        "message ids are never reused (AUTOINCREMENT)",
        # A message id names things outside the database (the preview's document, whose origin holds the page's
        # storage): a plain rowid is handed out again after the newest row is deleted. SQLite cannot add
        # AUTOINCREMENT to a table, so the table is rebuilt with the same rows and ids; the sequence then starts
        # after the largest id kept (ids deleted in an earlier run cannot be known, and nothing outside the
        # database outlives a run).
        (
            """CREATE TABLE messages_v3 (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
                role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
                content TEXT NOT NULL DEFAULT '',
                thinking TEXT NOT NULL DEFAULT '',
                thinking_seconds REAL,
                status TEXT NOT NULL DEFAULT 'complete'
                    CHECK (status IN ('complete', 'streaming', 'stopped', 'error')),
                stats TEXT NOT NULL DEFAULT '{}',
                created REAL NOT NULL
            )""",
            "INSERT INTO messages_v3 (id, conversation_id, role, content, thinking, thinking_seconds, status, stats,"
            " created) SELECT id, conversation_id, role, content, thinking, thinking_seconds, status, stats, created"
            " FROM messages ORDER BY id",
            "DROP TABLE messages",
            "ALTER TABLE messages_v3 RENAME TO messages",
            "CREATE INDEX messages_by_conversation ON messages(conversation_id, id)",
            "CREATE INDEX messages_streaming ON messages(status) WHERE status = 'streaming'",
        ),
    ),
    (
        4,
        "answer versions: messages form a tree (parent_id), one chosen child per message (selected)",
        # A chat was a list; now every message hangs under the one before it (parent_id; NULL: the chat's first),
        # and a regenerated answer or an edited message is a sibling: a new version beside the old. Among siblings
        # the one with selected = 1 is on show, and the chat is the path of chosen messages from the first. A chat
        # written before is one path: each message's parent is the message before it, every one chosen.
        (
            "ALTER TABLE messages ADD COLUMN parent_id INTEGER",
            "ALTER TABLE messages ADD COLUMN selected INTEGER NOT NULL DEFAULT 1",
            "UPDATE messages SET parent_id = (SELECT MAX(p.id) FROM messages p "
            "WHERE p.conversation_id = messages.conversation_id AND p.id < messages.id)",
            "CREATE INDEX messages_by_parent ON messages(conversation_id, parent_id, selected)",
        ),
    ),
)
SCHEMA_VERSION = MIGRATIONS[-1][0]


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


def atomic_write_text(path: str | os.PathLike[str], text: str, mode: int | None = None) -> None:
    """Write ``text`` (UTF-8) to ``path`` so that readers see the old file or the new one, never a partial one.

    Writes a temporary file in the same folder, fsyncs it, renames it over ``path`` and fsyncs the folder (POSIX).
    ``mode`` None: the file is private (0600, the app's own files); else it is created with ``mode`` less the umask,
    as any program writes a user's document (exports: 0o666, so 0644 under the usual umask).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if mode is None:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    else:
        tmp_name = str(target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp")
        fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)  # the kernel applies the umask
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    if os.name == "posix":
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


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



class StreamRecorder:
    """Saves one streaming answer as the engine's events for it arrive (GUI thread, like the store).

    Feed it every event of one generate request with :meth:`on_event`. Committed text is buffered per channel and
    written with :meth:`ChatStore.append_streaming` whenever a block commits (diffusion) or, in AR mode where no
    block events come, at most every ``flush_interval_s``; so a crash loses at most the block in flight.
    ``Finished`` ends the message (``complete``, or ``stopped`` when cancelled) with the engine's figures as stats
    and the final text; ``EngineError`` ends it as ``error`` (``stopped`` for a cancellation or a worker restart)
    keeping the text saved so far.

    A save that fails (:class:`StorageError`, e.g. a full disk) ends the recording: :meth:`on_event` re-raises it
    after marking the message ``error`` with ``stats["error"]`` saying what was not saved (best effort: on a full
    disk that may fail too, and the next open then keeps the message as interrupted). ``save_error`` keeps it.

    A message that already holds text (:meth:`ChatStore.reopen_message`, an answer being continued) keeps it: the
    new text is appended, ``Finished`` writes the whole answer, and its figures are
    :func:`engine.decode.events.continued_stats` of the stored ones and the new ones.
    """

    def __init__(
        self, store: ChatStore, message_id: int, flush_interval_s: float = 0.5, clock: Any = time.monotonic
    ) -> None:
        self.store = store
        self.message_id = message_id
        self.flush_interval_s = flush_interval_s
        self._clock = clock
        self._answer: list[str] = []
        self._thinking: list[str] = []
        self._last_flush = clock()
        self._started = clock()
        self._thinking_started: float | None = None
        self._thinking_seconds: float | None = None
        self.done = False
        self.blocks_saved = 0
        self.save_error: StorageError | None = None
        before = store.get_message(message_id)  # an answer being continued: what it says so far
        self._before = before if before.content or before.thinking else None

    def on_event(self, event: Event) -> bool:
        """Record one event; returns True when it ended the message. Raises StorageError when the save failed
        (the recording has then ended: later events are ignored)."""
        if self.done:
            return True
        try:
            return self._record(event)
        except StorageError as exc:
            self.done = True
            self.save_error = exc
            self._mark_not_saved(exc)
            raise

    def _mark_not_saved(self, exc: StorageError) -> None:
        stats = {"stop_reason": "error", "error": f"not saved: {exc}"}
        try:
            self.store.finish_message(self.message_id, "error", stats=stats, thinking_seconds=self._thinking_seconds)
        except StorageError as again:
            log.warning("cannot mark message %s as not saved either: %s", self.message_id, again)

    def _record(self, event: Event) -> bool:
        if isinstance(event, PromptInfo):
            self._started = self._clock()
        elif isinstance(event, TextDelta):
            self._on_delta(event)
            if self._clock() - self._last_flush >= self.flush_interval_s:
                self.flush()
        elif isinstance(event, BlockCommitted):
            self.flush()
            self.blocks_saved += 1
        elif isinstance(event, Finished):
            self.flush()
            self._end_thinking()
            stats = {
                "stop_reason": event.stop_reason,
                "tokens": event.tokens,
                "passes": event.passes,
                "tokens_per_pass": event.tokens_per_pass,
                "tokens_per_s": event.tokens_per_s,
                "time_to_first_token_s": event.time_to_first_token_s,
                "prompt_tokens": event.prompt_tokens,
                "cached_tokens": event.cached_tokens,
                "prefill_s": event.prefill_s,
                "decode_s": event.decode_s,
            }
            if event.accounting:
                stats["accounting"] = event.accounting
            status = "stopped" if event.stop_reason == "cancelled" else "complete"
            content, thinking, seconds = event.text, event.thinking, self._thinking_seconds
            if self._before is not None:
                before = self._before
                stats = continued_stats(before.stats, stats)
                content, thinking = before.content + content, before.thinking + thinking
                if before.thinking_seconds is not None:
                    seconds = before.thinking_seconds + (seconds or 0.0)
            self.store.finish_message(
                self.message_id, status, stats=stats, thinking_seconds=seconds, content=content, thinking=thinking,
            )
            self.done = True
        elif isinstance(event, RemoteFinished):  # a remote server's answer: its unreported figures stay None
            self.flush()
            self._end_thinking()
            self.store.finish_message(
                self.message_id, "stopped" if event.finish_reason == "cancelled" else "complete", stats=event.stats(),
                thinking_seconds=self._thinking_seconds, content=event.text, thinking=event.thinking,
            )
            self.done = True
        elif isinstance(event, EngineError):
            self.flush()
            self._end_thinking()
            stopped = event.kind in ("CancelledError", "WorkerStopped")
            reason, status = ("cancelled", "stopped") if stopped else ("error", "error")
            if self._before is not None and not stopped:  # a continuation that failed (a prompt now over the
                # context, a crash): the answer it went on with stays what it was, cut short, in the chat's context
                reason, status = ("interrupted" if event.kind == "WorkerCrashed" else "error"), "stopped"
            stats = {"stop_reason": reason, "error": f"{event.kind}: {event.message}"}
            self.store.finish_message(self.message_id, status, stats=stats, thinking_seconds=self._thinking_seconds)
            self.done = True
        return self.done

    def flush(self) -> None:
        """Write the buffered text now (one committed transaction)."""
        answer, thinking = "".join(self._answer), "".join(self._thinking)
        self._answer.clear()
        self._thinking.clear()
        self._last_flush = self._clock()
        if answer or thinking:
            self.store.append_streaming(self.message_id, answer, thinking)

    def _on_delta(self, delta: TextDelta) -> None:
        if delta.channel == "thinking":
            if self._thinking_started is None:
                self._thinking_started = self._clock()
            self._thinking.append(delta.text)
        else:
            self._end_thinking()
            self._answer.append(delta.text)

    def _end_thinking(self) -> None:
        if self._thinking_started is not None and self._thinking_seconds is None:
            self._thinking_seconds = round(self._clock() - self._started, 3)
