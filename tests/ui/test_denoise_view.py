"""The denoising view: model bookkeeping, painting, replay, and a flood of steps coalesced by the throttle."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QPoint, Qt

from clover_desk.engine.decode.events import BlockCommitted, BlockStep, Finished, PromptInfo
from clover_desk.qt_compat import guard_pyside_bool_refcounts  # noqa: E402
from clover_desk.ui.denoise_view import DenoiseModel, DenoiseView, committed_per_pass, display_text

# PySide6 6.12 on CPython < 3.12 drops a reference to None/True on every void call or emit (see there);
# without this the process aborts after some thousands of paints. Must run before the first widget exists.
guard_pyside_bool_refcounts()


def block_steps(block: int, per_pass: int = 4, size: int = 32, prompt_slots: int = 0) -> list[BlockStep]:
    """Scripted passes that commit ``per_pass`` slots each, left to right, with rising confidence."""
    masked = [i >= prompt_slots for i in range(size)]
    conf = [1.0 if i < prompt_slots else 0.0 for i in range(size)]
    texts = ["p" if i < prompt_slots else "" for i in range(size)]
    steps = []
    p = 0
    while any(masked):
        now = [False] * size
        todo = [i for i in range(size) if masked[i]][:per_pass]
        for i in todo:
            masked[i], now[i], conf[i], texts[i] = False, True, 0.5 + i / (2 * size), f" t{i}"
        steps.append(BlockStep(block, p, tuple(range(size)), tuple(texts), tuple(masked), tuple(conf), tuple(now),
                               prompt_slots))
        p += 1
    return steps


def finished(tokens: int, passes: int) -> Finished:
    return Finished((), "", "", "eos", tokens, passes, tokens / passes, 50.0, 0.1, 5, 0.01, 1.0)


def test_model_keeps_history_and_counts_per_pass() -> None:
    model = DenoiseModel(history_blocks=2)
    model.on_prompt(PromptInfo(10, 32, 0, 10))
    for b in range(3):
        steps = block_steps(b, per_pass=8, prompt_slots=10 if b == 0 else 0)
        for s in steps:
            model.on_step(s)
        model.on_committed(BlockCommitted(b, len(steps), tuple(range(32 - (10 if b == 0 else 0)))))
    assert [r.block_index for r in model.blocks] == [1, 2]  # only the last two blocks kept
    assert model.step_count() == 8  # 4 passes each
    assert committed_per_pass(model.blocks[-1]) == [8, 8, 8, 8]
    assert model.tokens_committed == 22 + 32 + 32
    assert model.tokens_per_pass() == pytest.approx(86 / 11)
    record, index = model.step_at(5)
    assert (record.block_index, index) == (2, 1)
    assert model.latest()[1] == 3


def test_prompt_slots_are_not_counted_as_committed() -> None:
    steps = block_steps(0, per_pass=11, prompt_slots=10)
    assert sum(committed_per_pass_from(steps)) == 22


def committed_per_pass_from(steps: list[BlockStep]) -> list[int]:
    model = DenoiseModel()
    for s in steps:
        model.on_step(s)
    return committed_per_pass(model.blocks[0])


def test_display_text_shows_whitespace() -> None:
    assert display_text(" a\nb\t") == "·a⏎b→"
    assert display_text("") == "∅"


def test_view_paints_cells_and_replays(qtbot, tmp_path) -> None:
    view = DenoiseView(fps=60)
    qtbot.addWidget(view)
    view.resize(440, 560)
    view.show()
    view.add_event(PromptInfo(10, 32, 0, 0))
    for s in block_steps(0):
        view.add_event(s)
    view.add_event(BlockCommitted(0, 8, tuple(range(32))))
    for s in block_steps(1)[:3]:
        view.add_event(s)
    qtbot.waitUntil(lambda: view.slider.maximum() == 10, timeout=2000)
    assert view.canvas.shown is not None and view.canvas.shown[0].block_index == 1
    assert "block 1, pass 3" in view.position_label.text()
    assert view.position_label.text().endswith("· 1 block, 32 tokens")  # block 0 committed, block 1 in flight
    view.grab().save(str(tmp_path / "denoise.png"))
    assert (tmp_path / "denoise.png").stat().st_size > 1000

    with qtbot.waitSignal(view.replayChanged, timeout=1000) as blocker:
        view.slider.setValue(2)
    assert blocker.args == [0, 2]
    assert not view.following and not view.live_button.isChecked()
    assert "replay · block 0, pass 3 of 8" in view.position_label.text()
    # new steps do not move a replaying view
    view.add_event(block_steps(1)[3])
    view.throttle.flush()
    assert view.canvas.shown[0].block_index == 0
    qtbot.mouseClick(view.live_button, Qt.MouseButton.LeftButton, pos=QPoint(5, 5))
    assert view.following and view.canvas.shown[0].block_index == 1


def test_flood_of_steps_is_coalesced(qtbot) -> None:
    """5,000 BlockSteps in one go cost one or two repaints, and the view ends on the newest step."""
    view = DenoiseView(history_blocks=64, fps=30)
    qtbot.addWidget(view)
    view.resize(420, 520)
    view.show()
    qtbot.waitExposed(view)
    paints_before = view.canvas.paint_count
    steps = []
    for b in range(625):
        steps.extend(block_steps(b))
    assert len(steps) == 5000
    for s in steps:
        view.add_event(s)
    view.add_event(finished(5000 * 4, 5000))
    qtbot.waitUntil(lambda: view.canvas.shown is not None and view.canvas.shown[0].block_index == 624, timeout=3000)
    qtbot.wait(100)  # let a trailing refresh (if any) run
    refreshes = view.throttle.calls
    paints = view.canvas.paint_count - paints_before
    print(f"\n5000 steps -> {refreshes} throttled refreshes, {paints} paints")
    assert refreshes <= 5
    assert paints <= 10
    assert view.model.step_count() == 64 * 8  # history bounded
    assert view.slider.maximum() == 64 * 8 - 1


def test_a_verify_pass_shows_accepted_verifier_and_rejected_slots(qtbot) -> None:
    """Spec mode: after the drafting passes, the verify pass's slots are painted by their verdict: accepted drafts
    green, rejected ones red (the verifier's own token in between), the legend naming both."""
    view = DenoiseView(fps=60)
    qtbot.addWidget(view)
    view.resize(440, 560)
    view.show()
    view.add_event(PromptInfo(10, 8, 1, 2))
    tokens = tuple(range(8))
    texts = tuple(f"t{i}" for i in range(8))
    view.add_event(BlockStep(1, 0, tokens, texts, (False,) * 8, (1.0,) * 8, (False, False) + (True,) * 6, 2))
    verdict = ("", "", "accepted", "accepted", "verifier", "rejected", "rejected", "rejected")
    view.add_event(BlockStep(1, 1, tokens, texts, (False,) * 8, (1.0,) * 8,
                             tuple(v in ("accepted", "verifier") for v in verdict), 2, verdict))
    qtbot.waitUntil(lambda: view.canvas.shown is not None and view.canvas.shown[1] == 1, timeout=2000)
    assert committed_per_pass(view.model.blocks[-1]) == [6, 3]
    image = view.canvas.grab().toImage()
    width = view.canvas.width() - 28
    cell_w = (width - 5 * 7) / 8

    def fill(slot: int) -> tuple[int, int, int]:
        c = image.pixelColor(int(14 + slot * (cell_w + 5) + 6), int(14 + 54 + 6))
        return c.red(), c.green(), c.blue()

    accepted, rejected = fill(2), fill(6)
    assert accepted[1] > accepted[0] + 40, accepted  # green
    assert rejected[0] > rejected[1] + 20, rejected  # red
