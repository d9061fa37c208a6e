"""The real app for window tests that need the real engine: ``CloverDeskApp`` (window, EngineClient, worker process)
shown, its worker started, until a signal says it is ready. Shared by the module-scoped ``desk`` fixtures."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def running_desk(home: Path, settings: Any, *, until: str = "loaded", load_ms: int = 60_000,
                 size: tuple[int, int] = (1400, 860), prepare: Callable[[Any], None] | None = None,
                 **app_options: Any) -> Iterator[Any]:
    """A ``CloverDeskApp`` in ``home`` with ``settings`` (no preview), its window shown at ``size``, ``prepare(app)``
    run, then its engine worker started; yields once ``app.client``'s ``until`` signal came ("loaded": the model in
    ``settings`` is loaded; "ready": the worker runs), within ``load_ms``. Shut down when the block ends."""
    from pytestqt.wait_signal import SignalBlocker

    from clover_desk.app import CloverDeskApp

    app = CloverDeskApp(home, settings=settings, with_preview=False, start_engine=False, **app_options)
    try:
        app.window.resize(*size)
        app.window.show()
        if prepare is not None:
            prepare(app)
        blocker = SignalBlocker(timeout=load_ms, raising=True)
        blocker.connect(getattr(app.client, until))
        app.client.start()
        blocker.wait()
        yield app
    finally:
        app.shutdown(wait_ms=5000)
        app.window.close()
