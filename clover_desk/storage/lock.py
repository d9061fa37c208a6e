"""The single-instance lock beside the chat database (``fcntl.flock`` on Linux/macOS, ``msvcrt.locking`` on Windows)."""

from __future__ import annotations

import errno
import logging
import os
import sys
from pathlib import Path

from clover_desk.storage.errors import (
    HOME_HINT,
    StorageError,
    StorageWriteError,
    StoreLockedError,
    write_error,
)

log = logging.getLogger(__name__)


LOCK_SUFFIX = ".lock"


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

