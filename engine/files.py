"""Writing a file whole or not at all."""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path


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
