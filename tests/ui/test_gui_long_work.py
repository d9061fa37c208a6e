"""Long work in the real window always shows progress and can be stopped (issue 10): reading a long prompt (the
prefill, through the real worker and a tiny real model whose passes are short and slow: tests/small_pass_engine.py),
loading and quantizing a model (the real engine), and cancelling a load (the worker's scripted slow load)."""

from __future__ import annotations

import pytest
from fixtures_tiny import copy_model, tiny_clover_dir  # noqa: F401 (session fixture)
from PySide6.QtCore import Qt

from clover_desk.engine.decode.events import BlockStep, Finished, LoadProgress, PrefillProgress, TextDelta
from clover_desk.qt_compat import guard_pyside_bool_refcounts
from clover_desk.ui.contracts import EngineState

guard_pyside_bool_refcounts()

LOAD_MS = 60_000
GEN_MS = 60_000
LONG = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. " * 30


class _wait:
    """``qtbot.waitSignal`` for a module-scoped fixture (no qtbot there)."""

    def __init__(self, signal, timeout_ms: int) -> None:  # noqa: ANN001
        from pytestqt.wait_signal import SignalBlocker

        self._blocker = SignalBlocker(timeout=timeout_ms, raising=True)
        self._blocker.connect(signal)

    def __enter__(self):  # noqa: ANN204
        return self._blocker

    def __exit__(self, *exc):  # noqa: ANN002, ANN204
        if exc[0] is None:
            self._blocker.wait()
        return False


@pytest.fixture(scope="module")
def desk(qapp, tiny_clover_dir, tmp_path_factory):  # noqa: ANN001, ANN201, F811
    from clover_desk.app import AppSettings, CloverDeskApp
    from clover_desk.worker.client import EngineClient

    home = tmp_path_factory.mktemp("desk_long_work")
    client = EngineClient(worker_args=["--engine-factory", "tests.small_pass_engine:load"])
    app = CloverDeskApp(home, client=client, settings=AppSettings(model_dir=str(tiny_clover_dir)),
                        with_preview=False, with_model_manager=False, start_engine=False)
    window = app.window
    window.resize(1200, 800)
    window.show()
    window.drawer.threshold.setValue(0.0)  # one pass per block, a few tokens: the prompt is what takes time
    window.drawer.max_tokens.setValue(8)
    events: list[tuple[str, object]] = []
    client.event.connect(lambda rid, ev: events.append((rid, ev)))
    app.events = events
    with _wait(client.loaded, LOAD_MS):
        client.start()
    yield app
    app.shutdown(wait_ms=5000)
    window.close()


def of_request(desk, rid: str, kind: type) -> list:  # noqa: ANN001
    return [ev for r, ev in desk.events if r == rid and isinstance(ev, kind)]


def test_a_long_prompt_shows_reading_progress_then_the_answer(qtbot, desk) -> None:  # noqa: ANN001
    window = desk.window
    strip = window.prompt_progress
    seen: list[tuple[bool, str, str]] = []  # (strip visible, its text, the status bar) at each segment

    def watch(_rid: str, event: object) -> None:
        if isinstance(event, PrefillProgress) and event.done:
            seen.append((strip.isVisible(), strip.label.text(), window.engine_status.engine_label.text()))

    desk.client.event.connect(watch)
    try:
        window.composer.input.setPlainText(LONG)
        with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS) as blocker:
            qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    finally:
        desk.client.event.disconnect(watch)
    rid, reason = blocker.args
    assert reason in ("eos", "max_new_tokens")
    progress = of_request(desk, rid, PrefillProgress)
    total = progress[-1].total
    assert len(progress) > 5 and progress[-1].done == total
    visible, text, status = seen[0]
    assert visible and text == f"Reading your message… {progress[1].done:,} / {total:,} tokens"
    assert status == "● Reading your message…"
    assert seen[-1][1] == f"Reading your message… {total:,} / {total:,} tokens"
    assert not strip.isVisible() and window.engine_status.engine_label.text() == "● Ready"
    assert of_request(desk, rid, BlockStep)


def test_stop_while_the_prompt_is_read_ends_it_before_the_answer(qtbot, desk) -> None:  # noqa: ANN001
    window = desk.window
    strip = window.prompt_progress

    def stop_at_first_segment(_rid: str, event: object) -> None:
        if isinstance(event, PrefillProgress) and event.done and strip.stop_button.isEnabled():
            assert strip.isVisible()
            strip.stop_button.click()

    desk.client.event.connect(stop_at_first_segment)
    try:
        window.composer.input.setPlainText("Summarize this:\n" + LONG)
        with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS) as blocker:
            qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    finally:
        desk.client.event.disconnect(stop_at_first_segment)
    rid, reason = blocker.args
    assert reason == "cancelled"
    progress = of_request(desk, rid, PrefillProgress)
    assert progress[-1].done < progress[-1].total  # stopped part-way through the prompt
    assert not of_request(desk, rid, BlockStep) and not of_request(desk, rid, TextDelta)
    assert of_request(desk, rid, Finished)[0].stop_reason == "cancelled"
    assert not strip.isVisible() and window.composer.send_button.text() == "Send"
    assert desk.store.messages(window.conversation_id)[-1].status == "stopped"


def test_quantizing_for_a_plan_shows_in_the_load_banner(qtbot, desk, tiny_clover_dir, tmp_path) -> None:  # noqa: ANN001, F811
    """A load under a VRAM plan converts the model to its quantized cache first: the banner says so, with bytes.
    (A copy of the model: the desk's own CPU load built the shared folder's cache already.)"""
    from clover_desk.engine.placement.planner import plan_model

    window = desk.window
    model = copy_model(tiny_clover_dir, tmp_path / "tiny")
    shown: list[tuple[str, str, bool]] = []
    desk.client.loadProgress.connect(
        lambda p: shown.append((p.stage, window.load_banner.label.text(), window.load_banner.isVisible())))
    floor = plan_model(model, 0, 512).min_vram_bytes
    plan = plan_model(model, floor, 512).to_dict()
    with qtbot.waitSignal(desk.client.loaded, timeout=LOAD_MS):
        desk.client.load(str(model), device="cpu", dtype="bfloat16", precision="nf4", plan=plan)
    stages = {stage: (text, visible) for stage, text, visible in shown}
    assert stages["quantizing"] == ("Quantizing…", True)
    assert "reading" in stages and stages["reading"] == ("Reading weights…", True)
    assert not window.load_banner.isVisible() and window.engine_status.state is EngineState.READY


def test_a_chat_longer_than_the_planned_context_goes_on_in_a_new_chat_with_a_summary(
        qtbot, desk, tiny_clover_dir) -> None:  # noqa: ANN001, F811
    """The real engine under a 512-token plan: the meter counts what the engine prefills, a message that does not fit
    is held back with the choice, and the summary (written by the model) starts a new chat that sends it."""
    from clover_desk.engine.placement.planner import plan_model
    from clover_desk.ui.context_window import SUMMARY_HEADER

    window, store = desk.window, desk.store
    floor = plan_model(tiny_clover_dir, 0, 512).min_vram_bytes
    with qtbot.waitSignal(desk.client.loaded, timeout=LOAD_MS):
        desk.client.load(str(tiny_clover_dir), device="cpu", dtype="bfloat16", precision="nf4",
                         plan=plan_model(tiny_clover_dir, floor, 512).to_dict())
    assert window.long_chats.limit == 512
    conv = store.create_conversation("Keepers", system_prompt="Answer briefly.",
                                     settings={"threshold": 0.0, "max_new_tokens": 8, "enable_thinking": False,
                                               "temperature": 0.0})
    for _ in range(3):
        store.add_message(conv.id, "user", LONG[:600])
        store.add_message(conv.id, "assistant", LONG[:400])
    window.conversations.open(conv.id)
    qtbot.waitUntil(lambda: window.long_chats.meter.level == "over", timeout=10_000)
    window.composer.input.setPlainText("What did the keepers eat?")
    with qtbot.waitSignal(window.long_chats.dialogOpened, timeout=10_000) as opened:
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    assert window.request_id is None
    started: list[str] = []
    window.long_chats.summaryStarted.connect(started.append)
    with qtbot.waitSignal(window.long_chats.summaryEnded, timeout=GEN_MS) as ended:
        opened.args[0].summary_button.click()
    assert ended.args == ["done"]
    summary = of_request(desk, started[0], Finished)[0]
    assert summary.stop_reason in ("eos", "max_new_tokens") and summary.text.strip()
    new = store.get_conversation(window.conversation_id)
    assert new.id != conv.id and new.title == "Keepers (continued)"
    assert new.system_prompt.startswith("Answer briefly.") and SUMMARY_HEADER in new.system_prompt
    assert summary.text.strip() in new.system_prompt
    with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS) as answered:
        pass
    rid, reason = answered.args
    assert reason in ("eos", "max_new_tokens")
    sent = store.chat_messages(new.id)[:-1]
    assert sent[-1] == {"role": "user", "content": "What did the keepers eat?"}
    # the meter's count is the engine's: the prompt the worker prefilled is the count of what was sent
    assert of_request(desk, rid, Finished)[0].prompt_tokens == desk.token_counter.count_now(sent, False)


def test_a_load_shows_progress_and_cancel_stops_it(qtbot, qapp, tmp_path) -> None:  # noqa: ANN001
    """The window's Cancel reaches the worker, which stops the load between two steps (scripted slow load)."""
    from clover_desk.app import AppSettings, CloverDeskApp
    from clover_desk.worker.client import EngineClient

    client = EngineClient(worker_args=["--engine-factory", "tests.fake_engine:make"])
    app = CloverDeskApp(tmp_path / "home", client=client, settings=AppSettings(model_dir=str(tmp_path / "slow")),
                        with_preview=False, with_model_manager=False, start_engine=False)
    window = app.window
    qtbot.addWidget(window)
    window.show()
    try:
        progress: list[LoadProgress] = []
        client.loadProgress.connect(progress.append)
        with qtbot.waitSignal(client.loadProgress, timeout=LOAD_MS):
            client.start()
        qtbot.waitUntil(lambda: len(progress) >= 3, timeout=LOAD_MS)
        banner = window.load_banner
        assert banner.isVisible() and banner.label.text() == "Reading weights…"
        assert banner.bar.value() > 0 and "GiB" in banner.detail.text()
        assert window.engine_status.state is EngineState.LOADING and not window.composer.send_button.isEnabled()
        with qtbot.waitSignal(client.loadFailed, timeout=LOAD_MS) as failed:
            banner.cancel.click()
        assert failed.args[0] == "CancelledError"
        qtbot.waitUntil(lambda: window.info_banner.isVisible(), timeout=5000)
        assert window.info_banner.label.text() == "Loading cancelled."
        assert not banner.isVisible() and window.engine_status.state is EngineState.NO_MODEL
        assert client.state == "idle"  # the worker keeps serving: another model can be chosen
    finally:
        app.shutdown(wait_ms=5000)
