"""Hang-ups: the other end of a pipe or socket went away (the window closed, a client left). Expected, so never a
traceback in the log: one short line, at most one per :data:`INTERVAL_S` per place, the others counted in the next.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable

HANG_UPS = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)
_HANG_UP_ERRNOS = {errno.EPIPE, errno.ECONNRESET, errno.ECONNABORTED}
INTERVAL_S = 30.0


def is_hang_up(exc: BaseException) -> bool:
    """Whether ``exc`` says the other end went away (and not that something is wrong here)."""
    return isinstance(exc, HANG_UPS) or (isinstance(exc, OSError) and exc.errno in _HANG_UP_ERRNOS)


class HangUpLog:
    """Logs hang-ups as one warning line each, at most one per ``interval_s`` (the ones in between are counted and
    said in the next line). Thread-safe."""

    def __init__(self, logger: logging.Logger, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self._held = 0

    def __call__(self, what: str, exc: BaseException) -> None:
        """``what`` stopped because the other end hung up (``exc``)."""
        with self._lock:
            now = self._clock()
            if self._last is not None and now - self._last < self._interval_s:
                self._held += 1
                return
            held, self._held, self._last = self._held, 0, now
        more = f" ({held} more hang-up{'s' if held != 1 else ''} since the last line)" if held else ""
        self._log.warning("%s: the other end hung up (%s)%s", what, type(exc).__name__, more)
