"""Where Clover Desk keeps its files (stdlib only: no Qt, so the CLI and the worker can use it too).

The application-data folder is, in order of precedence:

* ``$CLOVER_DESK_HOME`` when set (tests and portable installs point it at a folder of their choice);
* Windows: ``%APPDATA%\\Clover Desk``;
* macOS: ``~/Library/Application Support/Clover Desk``;
* elsewhere: ``$XDG_DATA_HOME/clover-desk``, ``~/.local/share/clover-desk`` when XDG_DATA_HOME is unset or not
  absolute (the XDG spec says to ignore relative values).

Nothing is created at import time; :func:`app_data_dir` creates the folder when asked to, and
:func:`writable_app_data_dir` also checks that files can be created there (the GUI refuses to start otherwise).
"""

from __future__ import annotations

import errno
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

HOME_ENV = "CLOVER_DESK_HOME"
CHATS_DB_NAME = "chats.sqlite3"
SETTINGS_NAME = "settings.json"  # the app's settings (clover_desk.app.AppSettings: the model it loads, ...)


def default_app_data_dir(
    env: Mapping[str, str] | None = None, platform: str | None = None, home: Path | None = None
) -> Path:
    """The application-data folder for ``platform`` (default: this one), without creating it.

    ``env``, ``platform`` and ``home`` default to ``os.environ``, ``sys.platform`` and ``Path.home()``; tests pass
    them to check every platform's rule on any machine.
    """
    env = os.environ if env is None else env
    platform = sys.platform if platform is None else platform
    override = env.get(HOME_ENV, "").strip()
    if override:
        return Path(override).expanduser()
    home = Path.home() if home is None else home
    if platform.startswith("win"):
        appdata = env.get("APPDATA", "").strip()
        base = Path(appdata) if appdata else home / "AppData" / "Roaming"
        return base / "Clover Desk"
    if platform == "darwin":
        return home / "Library" / "Application Support" / "Clover Desk"
    xdg = env.get("XDG_DATA_HOME", "").strip()
    base = Path(xdg) if xdg and os.path.isabs(xdg) else home / ".local" / "share"
    return base / "clover-desk"


def app_data_dir(create: bool = True) -> Path:
    """This machine's application-data folder (see the module docstring), created when ``create``."""
    path = default_app_data_dir()
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


class DataDirError(Exception):
    """The application-data folder cannot be created or written; the message names it and says what to do."""


def writable_app_data_dir(path: Path | None = None) -> Path:
    """``path`` (default: :func:`default_app_data_dir`) created, after checking that a file can be created there
    (a probe file, removed at once; ``os.access`` alone misses read-only mounts for root). Raises DataDirError."""
    path = default_app_data_dir() if path is None else Path(path)
    hint = f"make it writable or set {HOME_ENV} to a writable folder"
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".clover-desk-write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except FileExistsError:
        raise DataDirError(f"the data folder {path} is a file, not a folder; set {HOME_ENV} to a folder") from None
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            raise DataDirError(f"the disk holding the data folder {path} is full; free some space or set "
                               f"{HOME_ENV} to a folder on another disk") from None
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise DataDirError(f"the data folder {path} is read-only ({exc.strerror}); {hint}") from None
        raise DataDirError(f"the data folder {path} cannot be used ({exc.strerror or exc}); {hint}") from None
    return path


def chats_db_path(create_dir: bool = True) -> Path:
    """The chat database file (``chats.sqlite3`` in the application-data folder)."""
    return app_data_dir(create=create_dir) / CHATS_DB_NAME


def models_dir(create: bool = True) -> Path:
    """Where downloaded and converted models live by default (``models/`` in the application-data folder)."""
    path = app_data_dir(create=create) / "models"
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def logs_dir(create: bool = True) -> Path:
    """Where log files go (``logs/`` in the application-data folder)."""
    path = app_data_dir(create=create) / "logs"
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path
