"""How responsive the GUI thread stays while the engine generates.

A QTimer pings every 10 ms and records how late each ping fires. The figures are printed (run with ``-s`` to see
them; the README quotes them); the only assertion on time is a generous sanity bound (< 1 s), since a shared CI
machine makes tighter timing assertions flaky.
"""

from __future__ import annotations

import statistics
import time

from fakes_ui import FakeEngineClient
from fixtures_tiny import tiny_clover_dir  # noqa: F401 (session fixture)
from PySide6.QtCore import QObject, Qt, QTimer

from clover_desk.engine.decode.events import BlockStep
from clover_desk.qt_compat import guard_pyside_bool_refcounts

guard_pyside_bool_refcounts()  # PySide6 6.12 refcount leak on CPython < 3.12 (see there)

PING_MS = 10
SANITY_BOUND_S = 1.0


class LatencyProbe(QObject):
    """Records the lateness of a ``PING_MS`` precise timer (seconds past the due time, one per ping)."""

    def __init__(self) -> None:
        super().__init__()
        self.lateness: list[float] = []
        self._timer = QTimer(self)
        self._timer.setTimerType(Qt.TimerType.PreciseTimer)
        self._timer.setInterval(PING_MS)
        self._timer.timeout.connect(self.on_ping)
        self._last = 0.0

    def start(self) -> None:
        self._last = time.perf_counter()
        self._timer.start()

    def stop(self) -> None:
        self._timer.stop()

    def on_ping(self) -> None:
        now = time.perf_counter()
        self.lateness.append(max(0.0, now - self._last - PING_MS / 1000))
        self._last = now

    def report(self, label: str) -> tuple[float, float]:
        data = sorted(self.lateness)
        p95 = data[int(0.95 * (len(data) - 1))]
        worst = data[-1]
        print(
            f"\n[event-loop latency] {label}: {len(data)} pings, mean {statistics.mean(data) * 1000:.1f} ms, "
            f"p95 {p95 * 1000:.1f} ms, max {worst * 1000:.1f} ms"
        )
        return p95, worst


def test_latency_during_a_real_generation(qtbot, tiny_clover_dir, tmp_path) -> None:  # noqa: F811
    from clover_desk.app import AppSettings, CloverDeskApp

    desk = CloverDeskApp(tmp_path, settings=AppSettings(model_dir=str(tiny_clover_dir)), with_preview=False,
                         with_model_manager=False, start_engine=False)
    window = desk.window
    qtbot.addWidget(window)
    window.resize(1400, 860)
    window.show()
    try:
        with qtbot.waitSignal(desk.client.loaded, timeout=60_000):
            desk.client.start()
        window.drawer.threshold.setValue(0.5)
        window.drawer.max_tokens.setValue(64)
        steps: list[object] = []
        desk.client.event.connect(lambda _rid, ev: steps.append(ev) if isinstance(ev, BlockStep) else None)
        probe = LatencyProbe()
        probe.start()
        window.composer.input.setPlainText("Measure me")
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
        # sample for the whole generation, or 8 s of it (then stop it: the figures are what matter)
        deadline = time.monotonic() + 8.0
        qtbot.waitUntil(lambda: not window.is_generating() or time.monotonic() > deadline, timeout=60_000)
        if window.is_generating():
            with qtbot.waitSignal(window.generationFinished, timeout=30_000):
                window.chat_actions.on_stop_requested()
        probe.stop()
        assert steps, "the generation produced no denoising passes"
        p95, worst = probe.report(f"real engine, {len(steps)} passes")
        assert worst < SANITY_BOUND_S
    finally:
        desk.shutdown(wait_ms=5000)


def test_latency_under_a_flood_of_steps(qtbot, tmp_path) -> None:
    """A scripted engine that sends a pass every millisecond (far faster than any real one)."""
    from clover_desk.storage.recorder import StreamRecorder
    from clover_desk.storage.store import ChatStore
    from clover_desk.ui.main_window import MainWindow

    store = ChatStore(tmp_path / "chats.sqlite3")
    client = FakeEngineClient(blocks=60, pass_ms=1)
    window = MainWindow(client, store, StreamRecorder, model_dir="/models/tiny")
    qtbot.addWidget(window)
    window.resize(1400, 860)
    window.show()
    probe = LatencyProbe()
    probe.start()
    window.composer.input.setPlainText("flood")
    with qtbot.waitSignal(window.generationFinished, timeout=60_000):
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    probe.stop()
    passes = window.denoise.model.total_steps
    paints = window.denoise.throttle.calls
    p95, worst = probe.report(f"scripted flood, {passes} passes, {paints} denoise refreshes")
    assert passes > 200 and paints < passes
    assert worst < SANITY_BOUND_S
    store.close()
