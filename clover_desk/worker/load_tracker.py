"""The load in flight, as the window's engine client tracks it, and its way out of a compile that will not stop.

A cancel during a compiled load's warm-up (``cancel_load()`` while a ``compiling-*`` stage runs) keeps the model,
uncompiled. The worker checks the cancel between passes, but a pass that inductor is compiling cannot be interrupted
(30 s to minutes): when the worker has not answered within the grace the :attr:`LoadTracker.overdue` signal fires;
the client then ends the worker (with its compile workers) and sends :meth:`LoadTracker.uncompiled` to a fresh one,
whose ``loaded`` record :meth:`LoadTracker.loaded` rewrites to say what the worker's own cancelled warm-up says.

Standard library, PySide6 and the engine's stdlib-only ``events`` module only (the GUI process never imports torch).
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal

from clover_desk.engine.decode.events import COMPILE_STAGES

# How long a cancel during the compile's warm-up waits for the worker to stop at a pass boundary before it ends the
# worker and loads the model again uncompiled (a pass being compiled does not stop: 30 s to minutes with inductor).
COMPILE_CANCEL_GRACE_MS = 3000
WARM_UP_STAGES = tuple(stage for stage in COMPILE_STAGES if stage.startswith("compiling-"))
# engine.api.COMPILE_CANCELLED, the engine's own words for it (the window's process does not import engine.api)
COMPILE_CANCELLED = "compiling was cancelled: the model runs uncompiled"


class LoadTracker(QObject):
    """Whether a load was sent and has not ended (``pending``), the command it was, and its compile warm-up."""

    overdue = Signal()  # a cancel during the warm-up got no answer within the grace

    def __init__(self, parent: QObject | None = None, grace_ms: int = COMPILE_CANCEL_GRACE_MS) -> None:
        super().__init__(parent)
        self.pending = False  # a load was sent and has not ended (loaded / loadFailed) yet
        self._command: dict[str, Any] | None = None  # the load in flight as sent
        self._warming_up = False  # its latest progress is a compile warm-up stage (a cancel may not stop it soon)
        self._uncompiled_again: dict[str, Any] | None = None  # the load to send the worker started in its place
        self.fallback = False  # the load in flight is that one: its "loaded" says the compile was cancelled
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(grace_ms)
        self._timer.timeout.connect(self.overdue.emit)

    @property
    def grace_ms(self) -> int:
        return self._timer.interval()

    @property
    def model_dir(self) -> Any:
        """The model the load in flight loads (None: none was sent)."""
        return None if self._command is None else self._command.get("model_dir")

    def sent(self, command: dict[str, Any], *, fallback: bool = False) -> None:
        """A load goes out (``fallback``: the uncompiled one sent in place of a compile that did not stop)."""
        self.pending = True
        self.fallback = fallback
        self._command = command
        self._warming_up = False

    def progress(self, stage: Any) -> None:
        self._warming_up = stage in WARM_UP_STAGES

    def cancel_asked(self, running: bool) -> None:
        """A cancel went out: during the warm-up, the grace starts."""
        if self.pending and self._warming_up and running:
            self._timer.start()

    def stuck_in_warm_up(self) -> bool:
        """Still pending in the warm-up (the worker has not answered the cancel)."""
        return self.pending and self._warming_up

    def replace_uncompiled(self) -> None:
        """The worker is being ended: the same load without ``compile`` goes to the next one."""
        assert self._command is not None
        self._uncompiled_again = {k: v for k, v in self._command.items() if k != "compile"}

    def take_uncompiled(self) -> dict[str, Any] | None:
        """The load to send the freshly started worker (once), or None."""
        again, self._uncompiled_again = self._uncompiled_again, None
        return again

    def forget_uncompiled(self) -> None:
        self._uncompiled_again = None

    def ended(self) -> None:
        """The load ended without a model (failed, cancelled, the worker gone) or the worker restarted."""
        self.pending = False
        self._warming_up = False
        self._timer.stop()
        self.fallback = False

    def loaded(self, record: dict[str, Any]) -> dict[str, Any]:
        """The load ended with a model: its ``loaded`` record as the window gets it."""
        fallback = self.fallback
        self.ended()
        if fallback:  # what the worker's own cancelled warm-up says
            return {**record, "compiled": False, "compile_cancelled": True, "compile_skipped": COMPILE_CANCELLED}
        return record
