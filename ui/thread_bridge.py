"""Hand work from Python threads to the GUI thread without a thread ever touching a Qt object.

A thread that calls ``signal.emit(...)`` on a QObject that was deleted meanwhile (the window closed, the widget was
replaced, the job's parent went away) fails: PySide raises in the thread ("Signal source has been deleted") when it
sees the deletion first, and the app segfaults when the deletion races the emit. A
:class:`ThreadBridge` belongs to one QObject on the GUI thread (its *owner*). Threads :meth:`~ThreadBridge.post`
``(callable or signal, *args)`` to it: that appends to a plain Python deque under a lock, nothing else. A ``QTimer``
(a child of the owner) drains the deque on the GUI thread, in the order of the posts, and there calls the callable or
emits the signal. The timer runs (every ``interval_ms``) only while a thread started by :meth:`~ThreadBridge.spawn`
is alive or posts wait; otherwise it is stopped. When the owner is destroyed the timer goes with it, what waits is
dropped and every later post is dropped at once (``post`` returns False) without any Qt call.

Targets are resolved on the GUI thread before the thread starts (``functools.partial(bridge.post, self.done)``), so
the thread does not even read the owner's Python wrapper. A target must live as long as the owner (its signals, its
methods, or a plain function).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import shiboken6
from PySide6.QtCore import QObject, QTimer, SignalInstance

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_MS = 20


class ThreadBridge:
    """Posts from any thread, delivered in order on the GUI thread while the owner lives; dropped after."""

    def __init__(self, owner: QObject, interval_ms: int = DEFAULT_INTERVAL_MS) -> None:
        """Create on the GUI thread (the owner's thread)."""
        self._gui_thread = threading.get_ident()
        self._lock = threading.Lock()
        self._items: deque[tuple[Callable[..., Any] | SignalInstance, tuple[Any, ...]]] = deque()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.delivered = 0  # calls made on the GUI thread (for tests and diagnostics)
        self.dropped = 0  # posts dropped because the owner was gone (or the bridge closed)
        self._timer = QTimer(owner)
        self._timer.setInterval(interval_ms)
        self._timer.timeout.connect(self.drain)
        owner.destroyed.connect(self._on_owner_destroyed)

    # ---- any thread ----------------------------------------------------------------------------------------

    def post(self, target: Callable[..., Any] | SignalInstance, *args: Any) -> bool:
        """Call ``target(*args)`` (or ``target.emit(*args)`` for a signal) on the GUI thread, after every earlier
        post. Safe from any thread; makes no Qt call off the GUI thread. False: dropped (the owner is gone)."""
        with self._lock:
            if self._closed:
                self.dropped += 1
                return False
            self._items.append((target, args))
        if threading.get_ident() == self._gui_thread:
            self._wake()
        return True

    @property
    def closed(self) -> bool:
        return self._closed

    def pending(self) -> int:
        """Posts waiting for the GUI thread."""
        with self._lock:
            return len(self._items)

    # ---- GUI thread ----------------------------------------------------------------------------------------

    def spawn(self, target: Callable[..., Any], *args: Any, name: str = "clover-worker") -> threading.Thread:
        """Run ``target(*args)`` on a daemon thread; the timer runs until it has ended and its posts are in."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        self._wake()
        return thread

    def busy(self) -> bool:
        """A spawned thread still runs."""
        with self._lock:
            return any(t.is_alive() for t in self._threads)

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` in all for the spawned threads (on quit); True if they all ended."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    def drain(self) -> None:
        """Deliver what was posted, in order (the timer calls this; tests may too)."""
        while not self._closed:
            with self._lock:
                if not self._items:
                    break
                target, args = self._items.popleft()
            self.delivered += 1
            if isinstance(target, SignalInstance):
                target.emit(*args)
            else:
                target(*args)  # (it may spawn or post again: looked at below)
        with self._lock:
            # Threads first, then the items: a thread seen ended has already posted all it ever will.
            running = any(t.is_alive() for t in self._threads)
            idle = not running and not self._items
        if idle and not self._closed and shiboken6.isValid(self._timer):
            self._timer.stop()
        elif not idle:
            self._wake()  # (drain called by hand while a thread runs)

    def close(self) -> None:
        """Stop: what waits and every later post is dropped."""
        self._shut()
        if shiboken6.isValid(self._timer):
            self._timer.stop()

    # ---- internals -----------------------------------------------------------------------------------------

    def _wake(self) -> None:
        if not self._closed and shiboken6.isValid(self._timer) and not self._timer.isActive():
            self._timer.start()

    def _on_owner_destroyed(self, *_args: object) -> None:
        self._shut()  # the timer, the owner's child, is being deleted with it: not touched

    def _shut(self) -> None:
        with self._lock:
            self._closed = True
            self.dropped += len(self._items)
            self._items.clear()
