"""The VRAM budget panel over the real planner (engine.planner, stdlib only) for the published model shape."""

from __future__ import annotations

import re

import pytest

from engine import planner
from fakes_ui import fake_plan
from ui.vram_panel import GIB, MIB, STEP_MIB, VramPanel, layer_count, summarize

from clover_desk.qt_compat import guard_pyside_bool_refcounts  # noqa: E402

# PySide6 6.12 on CPython < 3.12 drops a reference to None/True on every void call or emit (see there);
# without this the process aborts after some thousands of paints. Must run before the first widget exists.
guard_pyside_bool_refcounts()

CARD = 16 * GIB


@pytest.fixture(scope="module")
def plan_fn():
    manifest = planner.manifest_for_shape("clover-35b-a3b")

    def plan(vram_bytes: int, ctx_tokens: int):
        return planner.make_plan(manifest, vram_bytes, ctx_tokens, 64 * GIB)

    return plan


def resident_of(panel: VramPanel) -> int:
    m = re.match(r"(\d+) of (\d+) layers|All (\d+) layers", panel.layers_label.text())
    assert m, panel.layers_label.text()
    return int(m.group(1) or m.group(3))


def test_slider_spans_minimum_to_card_and_updates_plan(qtbot, plan_fn) -> None:
    panel = VramPanel(plan_fn, CARD, "NVIDIA GeForce RTX 4070 Ti SUPER", 64 * GIB)
    qtbot.addWidget(panel)
    minimum = plan_fn(CARD, 8192).min_vram_bytes
    assert panel.slider.minimum() * STEP_MIB * MIB >= minimum
    assert panel.slider.minimum() * STEP_MIB * MIB - minimum < STEP_MIB * MIB
    assert panel.slider.maximum() * STEP_MIB * MIB == CARD

    with qtbot.waitSignal(panel.planChanged, timeout=1000) as blocker:
        panel.set_budget_bytes(6 * GIB)
    low_plan = blocker.args[0]
    assert low_plan.fits and panel.plan is low_plan
    low = resident_of(panel)
    assert "streamed from RAM" in panel.layers_label.text()
    assert panel.budget_label.text() == "6.0 GiB"
    assert panel.ram_label.text().startswith("RAM needed:")
    assert "tok/s diffusion" in panel.speed_label.text()

    panel.set_budget_bytes(15 * GIB)
    high = resident_of(panel)
    assert high > low  # a bigger budget keeps more layers' experts on the GPU
    assert panel.bar.budget_bytes == 15 * GIB
    legend_total = sum(n for *_rest, n in panel.summary.segments)
    assert legend_total == sum(panel.plan.vram_breakdown.get(k, 0) for k in panel.plan.vram_breakdown)
    assert panel.apply_button.isEnabled()


def test_a_longer_context_raises_the_minimum(qtbot, plan_fn) -> None:
    panel = VramPanel(plan_fn, CARD, "RTX", 64 * GIB, ctx_tokens=8192)
    qtbot.addWidget(panel)
    panel.slider.setValue(panel.slider.minimum())
    assert panel.plan.fits
    low_floor = panel.slider.minimum()
    panel.ctx_combo.setCurrentIndex(panel.ctx_combo.findData(131072))  # a longer context needs more KV cache
    need = plan_fn(CARD, 131072).min_vram_bytes
    assert panel.slider.minimum() > low_floor
    assert panel.slider.minimum() * STEP_MIB * MIB >= need  # the slider starts where the new context fits
    assert panel.plan.fits and panel.min_label.text() == f"min {panel.budget_label.text()}"


def test_wont_fit_shows_reason_and_blocks_apply(qtbot, plan_fn) -> None:
    small = 8 * GIB  # an 8 GiB card cannot hold a 128K context's KV cache and workspace with this model
    panel = VramPanel(plan_fn, small, "RTX 8 GB", 64 * GIB, ctx_tokens=8192)
    qtbot.addWidget(panel)
    panel.show()
    assert panel.plan.fits
    panel.ctx_combo.setCurrentIndex(panel.ctx_combo.findData(131072))
    assert plan_fn(small, 131072).min_vram_bytes > small
    assert not panel.plan.fits
    assert "Won't fit" in panel.state_label.text()
    assert panel.reason_label.isVisible() and panel.reason_label.text()
    assert not panel.apply_button.isEnabled()


def test_apply_emits_budget_and_context(qtbot, plan_fn) -> None:
    panel = VramPanel(plan_fn, CARD, "RTX", 64 * GIB)
    qtbot.addWidget(panel)
    panel.set_budget_bytes(10 * GIB)
    panel.ctx_combo.setCurrentIndex(panel.ctx_combo.findData(16384))
    with qtbot.waitSignal(panel.applyRequested, timeout=1000) as blocker:
        panel.apply_button.click()
    assert blocker.args == [10 * GIB, 16384]
    panel.set_applied(10 * GIB, 16384)
    assert not panel.apply_button.isEnabled()  # nothing new to apply
    assert "runs under this plan" in panel.applied_label.text()
    panel.set_budget_bytes(12 * GIB)
    assert panel.apply_button.isEnabled()
    assert "Apply to reload" in panel.applied_label.text()


def test_without_gpu_the_slider_goes_to_24_gib(qtbot, plan_fn) -> None:
    panel = VramPanel(plan_fn, None, None, None)
    qtbot.addWidget(panel)
    assert panel.slider.maximum() * STEP_MIB * MIB == 24 * GIB
    assert "No NVIDIA GPU" in panel.gpu_label.text()
    assert "no GPU found" in panel.max_label.text()


def test_planner_failure_is_shown_not_raised(qtbot) -> None:
    calls = []

    def broken(vram: int, ctx: int):
        calls.append(vram)
        if len(calls) > 1:
            raise ValueError("manifest has no expert layers")
        return fake_plan(vram, ctx)

    panel = VramPanel(broken, CARD, "RTX", None)
    qtbot.addWidget(panel)
    assert "no expert layers" in panel.reason_label.text()
    assert not panel.apply_button.isEnabled()


def test_set_planner_switches_model(qtbot, plan_fn) -> None:
    panel = VramPanel(plan_fn, CARD, "RTX", 64 * GIB)
    qtbot.addWidget(panel)
    panel.set_budget_bytes(10 * GIB)
    panel.set_applied(10 * GIB, 8192)
    with qtbot.waitSignal(panel.planChanged, timeout=1000) as blocker:
        panel.set_planner(fake_plan)  # another model: its own minimum, the budget kept
    assert blocker.args[0].min_vram_bytes == fake_plan(CARD, 8192).min_vram_bytes
    assert panel.budget_bytes() == 10 * GIB and panel.applied is None
    assert panel.slider.minimum() * STEP_MIB * MIB >= fake_plan(CARD, 8192).min_vram_bytes


def test_summary_words() -> None:
    s = summarize(fake_plan(8 * GIB, 8192), 8 * GIB, 32 * GIB)
    assert s.fits and s.headline.startswith("Fits")
    assert "of 40 layers' experts on GPU" in s.layers_line
    assert s.ram_line.endswith("of 32.0 GiB")
    assert layer_count([1, 2, 3]) == 3 and layer_count(7) == 7
