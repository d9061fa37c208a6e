"""End to end: the real window over the real engine (EngineClient → worker process → Engine on a tiny random
Clover checkpoint), built by the composition root. The tiny model's output is noise; what is checked is the
plumbing: deltas stream into the chat and the store, the denoising view follows the passes, Stop ends within a
pass, Regenerate replaces the answer, a killed worker leaves the chat and offers a restart, Apply reloads.
"""

from __future__ import annotations

import os
import signal

import pytest
from fixtures_tiny import tiny_clover_dir  # noqa: F401 (session fixture)
from PySide6.QtCore import Qt

from clover_desk.engine.decode.events import BlockStep, Finished, TextDelta
from clover_desk.qt_compat import guard_pyside_bool_refcounts
from clover_desk.ui.contracts import EngineState

guard_pyside_bool_refcounts()  # PySide6 6.12 refcount leak on CPython < 3.12 (see there)

LOAD_MS = 60_000
GEN_MS = 60_000


@pytest.fixture(scope="module")
def desk(qapp, tiny_clover_dir, tmp_path_factory):  # noqa: F811
    from clover_desk.app import AppSettings, CloverDeskApp

    home = tmp_path_factory.mktemp("desk_home")
    model = tiny_model_with_own_defaults(tiny_clover_dir, tmp_path_factory.mktemp("tiny_own") / "model")
    settings = AppSettings(model_dir=str(model))
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
    with _wait(app.client.loaded, LOAD_MS) as loaded:
        app.client.start()
    app.loaded_info = loaded.args[0]
    yield app
    app.shutdown(wait_ms=5000)
    window.close()


OWN_THRESHOLD = 0.85  # the e2e model's config.json: not the window's nor the engine's fallback
OWN_MAX_NEW_TOKENS = 3000  # its generation_config.json


def tiny_model_with_own_defaults(src, dst):  # noqa: ANN001, ANN201
    """A copy of the tiny model whose config and generation config say something no code path would invent."""
    import json

    from fixtures_tiny import copy_model

    model = copy_model(src, dst)
    config = json.loads((model / "config.json").read_text())
    config["threshold"] = OWN_THRESHOLD
    (model / "config.json").write_text(json.dumps(config))
    generation = json.loads((model / "generation_config.json").read_text())
    generation["max_new_tokens"] = OWN_MAX_NEW_TOKENS
    (model / "generation_config.json").write_text(json.dumps(generation))
    return model


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


def test_a_folder_on_the_cpu_loaded_through_its_quantized_cache(desk) -> None:
    """The window's default without a GPU ("4-bit weights"): the real worker built the folder's cache beside it and
    holds the model in it."""
    from clover_desk.engine.weights.formats import policy_for
    from clover_desk.engine.weights.quant_cache_files import cache_dir_for

    assert desk.loaded_info["precision"] == "nf4" and desk.loaded_info["device"] == "cpu"
    assert (cache_dir_for(desk.settings.model_dir, policy_for("cpu")) / "manifest.json").is_file()
    desk.window.engine_status.refresh()  # (the status bar's timer does this too)
    assert desk.window.engine_status.gpu_label.text() == "No GPU (CPU) · 4-bit weights"  # what the engine holds


def test_prompt_streams_into_chat_store_and_denoise_view(qtbot, desk) -> None:
    window = desk.window
    assert window.engine_status.engine_label.text() == "● Ready"
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
    assert "tok/s" in window.engine_status.speed_label.text() and window.engine_status.speed_label.text() != "– tok/s"


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
    panel.set_vram_budget_bytes(panel.slider.maximum() * 128 * 1024**2 - 1024**3)
    assert panel.plan.fits and panel.apply_button.isEnabled()
    pid, state = desk.client.pid, desk.client.state
    with qtbot.assertNotEmitted(desk.client.loaded, wait=300):
        panel.apply_button.click()
    assert desk.settings.vram_budget_bytes == panel.vram_budget_bytes()
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
    assert not window.composer.send_button.isEnabled()  # no model: Send waits, and says why
    window.crash_banner.action.click()
    # the worker restarts and loads the model again: until then a message waits in the box (never "NotLoaded")
    assert not window.composer.send_button.isEnabled() and window.composer.blocked_label.text()
    window.composer.input.setPlainText("too early")
    qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    assert window.request_id is None and window.composer.input.toPlainText() == "too early"
    assert len(window.chat.widgets) == count
    qtbot.waitUntil(lambda: window.engine_status.state is EngineState.READY, timeout=LOAD_MS)
    assert window.composer.send_button.isEnabled() and not window.composer.blocked_label.isVisible()
    assert not window.crash_banner.isVisible() and window.engine_status.engine_label.text() == "● Ready"
    with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS) as blocker:
        window.composer.input.setPlainText("still there?")
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    assert blocker.args[1] in ("eos", "max_new_tokens")


def test_new_chats_start_from_the_tiny_models_own_settings(qtbot, desk) -> None:
    """The drawer's defaults are the model folder's (config.json / generation_config.json), as the worker reported
    them with its load answer and as the app read them before: nothing hard-coded in the window."""
    window = desk.window
    assert desk.client.model_info["config"]["threshold"] == OWN_THRESHOLD  # what the worker said
    assert window.chat_settings.model_defaults.threshold == OWN_THRESHOLD
    assert window.chat_settings.model_defaults.max_new_tokens == OWN_MAX_NEW_TOKENS
    window.conversations.on_new()
    d = window.drawer
    assert d.threshold.value() == pytest.approx(OWN_THRESHOLD) and d.max_tokens.value() == OWN_MAX_NEW_TOKENS
    assert "threshold 0.85" in d.defaults_label.text() and "model" in d.defaults_label.text()
    d.threshold.setValue(0.0)  # the next tests: short answers
    d.max_tokens.setValue(16)


def test_replay_then_the_next_answer_is_live_again(qtbot, desk) -> None:
    window = desk.window
    view = window.denoise
    d = window.drawer
    d.threshold.setValue(0.999)  # about one slot per pass: several passes to replay
    d.max_tokens.setValue(16)
    try:
        with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS):
            window.composer.input.setPlainText("first")
            qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
        view.throttle.flush()
        assert view.slider.maximum() >= 2
        view.slider.setValue(1)  # dragged back
        assert not view.live_button.isChecked() and view.position_label.text().startswith("replay")
        with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS):
            window.composer.input.setPlainText("second")
            qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
            assert view.live_button.isChecked()  # from the first pass of the new answer
        view.throttle.flush()
        assert view.following and view.canvas.shown == view.model.latest()
        assert view.position_label.text().startswith("live · block")
    finally:
        d.threshold.setValue(0.0)


def test_autoregressive_answers_show_the_token_stream(qtbot, desk) -> None:
    window = desk.window
    view = window.denoise
    d = window.drawer
    d.mode.setCurrentIndex(d.mode.findData("ar"))
    try:
        with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS) as blocker:
            window.composer.input.setPlainText("one token at a time")
            qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
        finished = of_request(desk, blocker.args[0], Finished)[0]
        deltas = of_request(desk, blocker.args[0], TextDelta)
        view.throttle.flush()
        assert view.model.mode == "ar" and view.model.pieces_seen == len([x for x in deltas if x.text])
        assert view.model.tokens() == finished.tokens
        assert view.position_label.text().startswith(f"autoregressive · finished · {finished.tokens} tokens")
        view.canvas.grab()
        assert view.canvas.painted == "token stream" and not view.slider.isEnabled()
    finally:
        d.mode.setCurrentIndex(d.mode.findData("diffusion"))
