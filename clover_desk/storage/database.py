"""Opening the chat database: its single-instance lock, the connection (WAL), migrations, crash recovery, and the one
way to write (:meth:`Database.transaction`). See the package docstring for the durability and threading model."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from clover_desk.storage.errors import StorageError, StorageWriteError, write_error
from clover_desk.storage.lock import LOCK_SUFFIX, StoreLock
from clover_desk.storage.schema import MIGRATIONS, SCHEMA_VERSION

log = logging.getLogger(__name__)


class Database:
    """The open chat database of one :class:`clover_desk.storage.store.ChatStore`: ``conn`` to read,
    :meth:`transaction` to write; ``recovered_message_ids`` are the answers a crash interrupted (now stopped)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Open (creating when needed) the database at ``path``, after taking its single-instance lock; migrate it
        and keep the answers a crash interrupted as stopped.

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
            self.conn = sqlite3.connect(self.path, isolation_level=None, timeout=10.0)
        except sqlite3.Error as exc:
            self._lock.release()
            raise write_error(self.path, exc, "open") or StorageError(
                f"cannot open chat database {self.path}: {exc}"
            ) from exc
        self.conn.row_factory = sqlite3.Row
        try:
            self.conn.execute("PRAGMA foreign_keys = ON")
            mode = self.conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                log.warning("chat database %s runs in %s journal mode (WAL unavailable)", self.path, mode)
            self.conn.execute("PRAGMA synchronous = NORMAL")
            self._migrate()
            self.recovered_message_ids: tuple[int, ...] = self._recover_interrupted()
        except sqlite3.DatabaseError as exc:
            self.conn.close()
            self._lock.release()
            raise write_error(self.path, exc, "open") or StorageError(
                f"chat database {self.path} is unreadable: {exc}"
            ) from exc
        except BaseException:
            self.conn.close()
            self._lock.release()
            raise

    def close(self) -> None:
        """Close the database and release its lock (idempotent)."""
        self.conn.close()
        self._lock.release()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (the only way the store changes the database), committed on success and rolled
        back on any exception (the COMMIT's included).

        A disk-full / read-only / I/O failure becomes :class:`StorageWriteError`; the store stays usable."""
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise (write_error(self.path, exc) or exc) from exc
        try:
            yield self.conn
            self.conn.execute("COMMIT")
        except BaseException as exc:
            self._rollback()
            error = write_error(self.path, exc) if isinstance(exc, (sqlite3.Error, OSError)) else None
            if error is not None:
                log.warning("%s", error)
                raise error from exc
            raise

    def _rollback(self) -> None:
        """Roll back the open transaction, if any (SQLite may already have rolled it back itself on SQLITE_FULL)."""
        if not self.conn.in_transaction:
            return
        try:
            self.conn.execute("ROLLBACK")
        except sqlite3.Error as exc:
            log.error("chat database %s: rollback failed: %s", self.path, exc)

    @property
    def schema_version(self) -> int:
        row = self.conn.execute("SELECT MAX(version) FROM schema_migrations").fetchone()
        return int(row[0] or 0)

    def _migrate(self) -> None:
        self.conn.execute(
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
            with self.transaction() as conn:
                for statement in statements:
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO schema_migrations (version, description, applied) VALUES (?, ?, ?)",
                    (version, description, time.time()),
                )
                conn.execute(f"PRAGMA user_version = {int(version)}")

    def _recover_interrupted(self) -> tuple[int, ...]:
        rows = self.conn.execute("SELECT id, stats FROM messages WHERE status = 'streaming' ORDER BY id").fetchall()
        if not rows:
            return ()
        try:
            with self.transaction() as conn:
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

