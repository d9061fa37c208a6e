"""End to end: the real window over the real engine (EngineClient → worker process → Engine on a tiny random
Clover checkpoint), built by the composition root. The tiny model's output is noise; what is checked is the
plumbing: deltas stream into the chat and the store, the denoising view follows the passes, Stop ends within a
pass, Regenerate replaces the answer, a killed worker leaves the chat and offers a restart, Apply reloads.
"""

from __future__ import annotations

import os
import signal

import pytest
from PySide6.QtCore import Qt

from clover_desk.qt_compat import guard_pyside_bool_refcounts
from engine.events import BlockStep, Finished, TextDelta
from fixtures_tiny import tiny_clover_dir  # noqa: F401 (session fixture)

guard_pyside_bool_refcounts()  # PySide6 6.12 refcount leak on CPython < 3.12 (see there)

LOAD_MS = 60_000
GEN_MS = 60_000


@pytest.fixture(scope="module")
def desk(qapp, tiny_clover_dir, tmp_path_factory):  # noqa: F811
    from clover_desk.app import AppSettings, CloverDeskApp

    home = tmp_path_factory.mktemp("desk_home")
    settings = AppSettings(model_dir=str(tiny_clover_dir))
    app = CloverDeskApp(home, settings=settings, with_preview=False, with_model_manager=False, start_engine=False)
    window = app.window
    window.resize(1400, 860)
    window.show()
    d = window.drawer  # keep the tiny model's passes few: commit every slot each pass, short answers
    d.threshold.setValue(0.0)
    d.max_tokens.setValue(16)
    events: list[tuple[str, object]] = []
    app.client.event.connect(lambda rid, ev: events.append((rid, ev)))
    app.events = events
    with _wait(app.client.loaded, LOAD_MS):
        app.client.start()
    yield app
    app.shutdown(wait_ms=5000)
    window.close()


class _wait:
    """``qtbot.waitSignal`` for a module-scoped fixture (no qtbot there)."""

    def __init__(self, signal, timeout_ms: int) -> None:
        from pytestqt.wait_signal import SignalBlocker

        self._blocker = SignalBlocker(timeout=timeout_ms, raising=True)
        self._blocker.connect(signal)

    def __enter__(self):
        return self._blocker

    def __exit__(self, *exc):
        if exc[0] is None:
            self._blocker.wait()
        return False


def of_request(desk, rid: str, kind: type) -> list:
    return [ev for r, ev in desk.events if r == rid and isinstance(ev, kind)]


def test_prompt_streams_into_chat_store_and_denoise_view(qtbot, desk) -> None:
    window = desk.window
    assert window.engine_label.text() == "● Ready"
    window.composer.input.setPlainText("Say something")
    with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS) as blocker:
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
        qtbot.waitUntil(lambda: window.is_generating(), timeout=1000)
        assert window.composer.send_button.text() == "Stop"
    rid, reason = blocker.args
    assert reason in ("eos", "max_new_tokens")
    deltas = of_request(desk, rid, TextDelta)
    steps = of_request(desk, rid, BlockStep)
    finished = of_request(desk, rid, Finished)[0]
    assert deltas and steps
    # what streamed is what the chat shows and what the store kept
    answer = desk.store.messages(window.conversation_id)[-1]
    streamed_answer = "".join(d.text for d in deltas if d.channel == "answer")
    streamed_thinking = "".join(d.text for d in deltas if d.channel == "thinking")
    assert answer.status == "complete"
    assert answer.content == (finished.text or streamed_answer)
    assert answer.thinking == (finished.thinking or streamed_thinking)
    assert answer.stats["tokens"] == finished.tokens and answer.stats["passes"] == finished.passes
    widget = window.chat.widgets[-1]
    assert widget.data is not None and widget.data.content == answer.content
    # the denoising view saw every pass and the final figures
    view = window.denoise
    assert view.model.total_steps == len(steps)
    assert view.model.finished is not None and view.canvas.shown is not None
    assert view.slider.maximum() == view.model.step_count() - 1
    assert "tok/s" in window.speed_label.text() and window.speed_label.text() != "– tok/s"


def test_stop_ends_within_one_pass(qtbot, desk) -> None:
    window = desk.window
    d = window.drawer
    d.threshold.setValue(0.999)  # one slot per pass: a long generation to interrupt
    d.max_tokens.setValue(256)
    try:
        window.composer.input.setPlainText("A long one")
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
        rid = window.request_id
        qtbot.waitUntil(lambda: len(of_request(desk, rid, BlockStep)) >= 1, timeout=GEN_MS)
        steps_at_stop = len(of_request(desk, rid, BlockStep))
        with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS) as blocker:
            qtbot.keyClick(window.composer.input, Qt.Key.Key_Escape)
        after = len(of_request(desk, rid, BlockStep)) - steps_at_stop
        print(f"\nstop: {after} pass(es) after Esc")
        assert blocker.args[1] == "cancelled"
        assert after <= 2  # the pass in flight (and at most one already in the pipe)
        answer = desk.store.messages(window.conversation_id)[-1]
        assert answer.status == "stopped"
    finally:
        d.threshold.setValue(0.0)
        d.max_tokens.setValue(16)


def test_regenerate_replaces_the_answer(qtbot, desk) -> None:
    window = desk.window
    before = desk.store.messages(window.conversation_id)
    last = window.chat.widgets[-1]
    assert last.regen_button.isVisible()
    with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS) as blocker:
        last.regen_button.click()
    assert blocker.args[1] in ("eos", "max_new_tokens")
    after = desk.store.messages(window.conversation_id)
    assert len(after) == len(before)
    assert after[-1].status == "complete" and [m.role for m in after[-2:]] == ["user", "assistant"]


def test_vram_apply_on_the_cpu_saves_the_budget_and_says_the_model_runs_from_ram(qtbot, desk) -> None:
    """No GPU here: nothing is reloaded (the model already runs from system RAM); the choice is kept for a GPU.
    The reload under a plan is tested with a GPU's hardware facts in test_main_window and in test_worker."""
    window, panel = desk.window, desk.vram_panel
    window.tabs.setCurrentWidget(panel)
    panel.set_budget_bytes(panel.slider.maximum() * 128 * 1024**2 - 1024**3)
    assert panel.plan.fits and panel.apply_button.isEnabled()
    pid, state = desk.client.pid, desk.client.state
    with qtbot.assertNotEmitted(desk.client.loaded, wait=300):
        panel.apply_button.click()
    assert desk.settings.vram_budget_bytes == panel.budget_bytes()
    assert desk.client.pid == pid and desk.client.state == state
    assert "system RAM" in panel.status_label.text() and "runs under this plan" not in panel.status_label.text()
    assert '"vram_budget_bytes"' in desk.settings_path.read_text()


def test_worker_crash_keeps_chat_and_restarts(qtbot, desk) -> None:
    window = desk.window
    count = len(window.chat.widgets)
    with qtbot.waitSignal(desk.client.crashed, timeout=10_000):
        os.kill(desk.client.pid, signal.SIGKILL)
    assert window.crash_banner.isVisible() and "Restart engine" == window.crash_banner.action.text()
    assert len(window.chat.widgets) == count
    with qtbot.waitSignal(desk.client.loaded, timeout=LOAD_MS):
        window.crash_banner.action.click()
    assert not window.crash_banner.isVisible() and window.engine_label.text() == "● Ready"
    with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS) as blocker:
        window.composer.input.setPlainText("still there?")
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    assert blocker.args[1] in ("eos", "max_new_tokens")
