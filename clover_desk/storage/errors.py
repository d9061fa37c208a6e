"""The chat store's errors, and the one-line message for a failed write (disk full, read-only, I/O)."""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path


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


