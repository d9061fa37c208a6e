"""The VRAM budget panel over the real planner (engine.placement.planner, stdlib only) for the published model shape."""

from __future__ import annotations

import re

import pytest
from fakes_ui import fake_plan
from PySide6.QtWidgets import QComboBox, QLabel, QPushButton, QSlider

from clover_desk.engine.defaults import CARD_CHOICES_GIB, DEFAULT_CARD_GIB, DEFAULT_CTX_TOKENS
from clover_desk.engine.placement import planner
from clover_desk.qt_compat import guard_pyside_bool_refcounts  # noqa: E402
from clover_desk.ui.vram_panel import GIB, MIB, STEP_MIB, VramPanel, in_use_line, layer_count, plan_as_dict, summarize

# PySide6 6.12 on CPython < 3.12 drops a reference to None/True on every void call or emit (see there);
# without this the process aborts after some thousands of paints. Must run before the first widget exists.
guard_pyside_bool_refcounts()

CARD = 16 * GIB


@pytest.fixture(scope="module")
def plan_fn():
    manifest = planner.manifest_for_shape("clover-35b-a3b")

    def plan(vram_budget_bytes: int, ctx_tokens: int):
        return planner.make_plan(manifest, vram_budget_bytes, ctx_tokens, 64 * GIB)

    return plan


def resident_of(panel: VramPanel) -> int:
    m = re.match(r"(\d+) of (\d+) layers|All (\d+) layers", panel.breakdown.layers_label.text())
    assert m, panel.breakdown.layers_label.text()
    return int(m.group(1) or m.group(3))


def test_slider_spans_minimum_to_card_and_updates_plan(qtbot, plan_fn) -> None:
    panel = VramPanel(plan_fn, CARD, "NVIDIA GeForce RTX 4070 Ti SUPER", 64 * GIB)
    qtbot.addWidget(panel)
    assert panel.ctx_tokens() == DEFAULT_CTX_TOKENS
    minimum = plan_fn(CARD, DEFAULT_CTX_TOKENS).min_vram_bytes
    assert panel.slider.minimum() * STEP_MIB * MIB >= minimum
    assert panel.slider.minimum() * STEP_MIB * MIB - minimum < STEP_MIB * MIB
    assert panel.slider.maximum() * STEP_MIB * MIB == CARD

    with qtbot.waitSignal(panel.planChanged, timeout=1000) as blocker:
        panel.set_vram_budget_bytes(6 * GIB)
    low_plan = blocker.args[0]
    assert low_plan.fits and panel.plan is low_plan
    low = resident_of(panel)
    assert "streamed from RAM" in panel.breakdown.layers_label.text()
    assert panel.budget_label.text() == "6.0 GiB"
    assert panel.breakdown.ram_label.text().startswith("RAM needed:")
    assert "tok/s diffusion" in panel.breakdown.speed_label.text()
    assert panel.breakdown.speed_label.text().startswith("≈ ") and panel.breakdown.speed_label.text().endswith("(estimate)")
    assert panel.breakdown.speed_label.isVisibleTo(panel)

    panel.set_vram_budget_bytes(15 * GIB)
    high = resident_of(panel)
    assert high > low  # a bigger budget keeps more layers' experts on the GPU
    assert panel.breakdown.bar.vram_budget_bytes == 15 * GIB
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
    small = 6 * GIB  # a 6 GiB card cannot hold a 128K context's KV cache and workspace with this model
    panel = VramPanel(plan_fn, small, "RTX 6 GB", 64 * GIB, ctx_tokens=8192)
    qtbot.addWidget(panel)
    panel.show()
    assert panel.plan.fits
    panel.ctx_combo.setCurrentIndex(panel.ctx_combo.findData(131072))
    assert plan_fn(small, 131072).min_vram_bytes > small
    assert not panel.plan.fits
    assert "Won't fit" in panel.state_label.text()
    assert panel.breakdown.reason_label.isVisible() and panel.breakdown.reason_label.text()
    assert not panel.apply_button.isEnabled()


def test_apply_emits_budget_and_context_and_the_plan_in_use_is_shown(qtbot, plan_fn) -> None:
    panel = VramPanel(plan_fn, CARD, "RTX", 64 * GIB)
    qtbot.addWidget(panel)
    assert "nothing yet" in panel.in_use_label.text() and panel.apply_button.isEnabled()
    panel.set_vram_budget_bytes(10 * GIB)
    panel.ctx_combo.setCurrentIndex(panel.ctx_combo.findData(8192))
    with qtbot.waitSignal(panel.applyRequested, timeout=1000) as blocker:
        panel.apply_button.click()
    assert blocker.args == [10 * GIB, 8192]
    placed = plan_fn(10 * GIB, 8192)
    panel.set_in_use(placed.to_dict(), "cuda")  # the app, after the reload: what the engine placed
    resident, streamed = len(placed.resident_expert_layers), len(placed.streamed_expert_layers)
    assert streamed  # 10 GiB streams some layers' experts, so the line names slots too
    assert panel.in_use_label.text() == (
        f"In use: {resident} resident / {streamed} streamed layers, {placed.slot_pool_experts:,} slots, "
        f"{placed.vram_used_bytes / GIB:.2f} GiB of 10.00 GiB, 8K context"
    )
    assert panel.applied == (10 * GIB, 8192) and panel.in_use()["slot_pool_experts"] == placed.slot_pool_experts
    assert not panel.is_dirty() and not panel.apply_button.isEnabled()  # nothing new to apply
    assert "plan in use" in panel.status_label.text() and "Apply" not in panel.status_label.text()

    panel.set_vram_budget_bytes(12 * GIB)  # the slider moves away from the plan in use
    assert panel.is_dirty() and panel.apply_button.isEnabled()
    assert "Apply to reload under this plan" in panel.status_label.text()
    assert panel.in_use_label.text().startswith(f"In use: {resident} resident")  # still the placed plan
    panel.set_vram_budget_bytes(10 * GIB)
    assert not panel.is_dirty()
    panel.ctx_combo.setCurrentIndex(panel.ctx_combo.findData(16384))  # the context counts too
    assert panel.is_dirty() and "Apply to reload" in panel.status_label.text()


def test_in_use_takes_plan_objects_and_no_plan(qtbot) -> None:
    panel = VramPanel(fake_plan, CARD, "RTX", None)
    qtbot.addWidget(panel)
    placed = fake_plan(12 * GIB, 8192)
    panel.set_in_use(placed, "cuda")  # a Plan made without a budget or context
    assert panel.in_use_label.text() == (
        f"In use: {len(placed.resident_expert_layers)} resident / {len(placed.streamed_expert_layers)} streamed layers, "
        f"64 slots, {placed.vram_used_bytes / GIB:.2f} GiB"
    )
    assert panel.applied == (0, 0) and panel.is_dirty()  # a plan without a budget never matches the slider
    panel.set_in_use(None, "cpu")
    assert panel.in_use_label.text() == "In use: no plan, the model runs from system RAM on the CPU"
    assert panel.in_use() is None and panel.applied is None
    assert panel.apply_button.text() == "Save for a GPU"  # the engine runs on the CPU: a budget is only saved
    panel.set_in_use(None, "cuda")
    assert "without a VRAM budget" in panel.in_use_label.text()
    assert "Apply to reload under this plan" in panel.status_label.text()


def test_in_use_words() -> None:
    whole = {"resident_expert_layers": list(range(40)), "streamed_expert_layers": [], "slot_pool_experts": 0,
             "vram_used_bytes": int(15.99 * GIB), "vram_budget_bytes": 16 * GIB, "ctx_tokens": 16384}
    assert in_use_line(whole, "cuda") == "In use: all 40 layers resident, 15.99 GiB of 16.00 GiB, 16K context"
    split = dict(whole, resident_expert_layers=list(range(18)), streamed_expert_layers=list(range(18, 40)),
                 slot_pool_experts=2096)
    assert in_use_line(split, "cuda") == (
        "In use: 18 resident / 22 streamed layers, 2,096 slots, 15.99 GiB of 16.00 GiB, 16K context"
    )
    assert plan_as_dict(split) == split and plan_as_dict(None) is None
    placed = fake_plan(12 * GIB, 8192)  # the planner's own Plan: the panel reads no restatement of its fields
    assert isinstance(placed, planner.Plan) and plan_as_dict(placed) == placed.to_dict()


def test_without_gpu_the_panel_plans_for_a_chosen_card(qtbot, plan_fn) -> None:
    panel = VramPanel(plan_fn, None, None, 64 * GIB)
    qtbot.addWidget(panel)
    panel.show()
    assert "No NVIDIA GPU found" in panel.gpu_label.text()
    card = panel.findChild(QComboBox, "cardChoice")
    assert card is panel.card_combo and card.isVisible() and card.accessibleName()
    assert [card.itemData(i) for i in range(card.count())] == list(CARD_CHOICES_GIB) == [8, 12, 16, 24]
    assert card.currentData() == DEFAULT_CARD_GIB == 16
    assert panel.card_bytes() == 16 * GIB
    assert panel.slider.maximum() * STEP_MIB * MIB == 16 * GIB
    assert "Plan for a 16 GB card" in panel.plan_for_label.text() and panel.plan_for_label.isVisible()
    assert panel.summary.headline.startswith("Plan for a 16 GB card: fits")

    with qtbot.waitSignal(panel.cardChanged, timeout=1000) as blocker:
        card.setCurrentIndex(card.findData(24))
    assert blocker.args == [24 * GIB] and panel.card_bytes() == 24 * GIB
    assert panel.slider.maximum() * STEP_MIB * MIB == 24 * GIB
    assert panel.vram_budget_bytes() == 24 * GIB - STEP_MIB * MIB  # a new card: the whole card less one step
    assert "Plan for a 24 GB card" in panel.plan_for_label.text() and "24 GB card" in panel.max_label.text()
    card.setCurrentIndex(card.findData(8))
    assert panel.slider.maximum() * STEP_MIB * MIB == 8 * GIB
    assert "Plan for an 8 GB card" in panel.plan_for_label.text()

    panel.set_vram_budget_bytes(20 * GIB)  # a saved budget above the card picks the smallest card that holds it
    assert panel.card_bytes() == 24 * GIB and panel.vram_budget_bytes() == 20 * GIB
    panel.set_card_bytes(12 * GIB)
    assert card.currentData() == 12 and panel.vram_budget_bytes() <= 12 * GIB


def test_without_gpu_no_speed_is_shown(qtbot, plan_fn) -> None:
    panel = VramPanel(plan_fn, None, None, 64 * GIB)
    qtbot.addWidget(panel)
    panel.show()
    for budget in (6 * GIB, 12 * GIB):
        panel.set_vram_budget_bytes(budget)
        assert panel.plan.predicted_tok_s  # the planner has a roofline figure; the panel does not show it
        texts = [label.text() for label in panel.findChildren(QLabel)]
        assert not [t for t in texts if "tok/s" in t], texts
        assert not panel.breakdown.speed_label.isVisible()
    assert panel.summary.speed_line == ""


def test_without_gpu_apply_saves_and_says_the_model_runs_from_ram(qtbot, plan_fn) -> None:
    panel = VramPanel(plan_fn, None, None, 64 * GIB)
    qtbot.addWidget(panel)
    panel.set_in_use(None, "cpu")
    assert "RAM" in panel.in_use_label.text()
    panel.set_vram_budget_bytes(12 * GIB)
    assert panel.apply_button.isEnabled() and "GPU" in panel.apply_button.text()
    with qtbot.waitSignal(panel.applyRequested, timeout=1000) as blocker:
        panel.apply_button.click()
    assert blocker.args == [12 * GIB, DEFAULT_CTX_TOKENS]  # the app saves the choice
    status = panel.status_label.text()
    assert status == "No GPU here: the model runs from system RAM; this budget is saved for a GPU."
    assert not panel.apply_button.isEnabled()  # already saved
    texts = [label.text() for label in panel.findChildren(QLabel)]
    assert not [t for t in texts if "runs under this plan" in t], texts
    panel.set_vram_budget_bytes(10 * GIB)
    assert panel.apply_button.isEnabled() and "saved for a GPU" not in panel.status_label.text()
    assert "system RAM" in panel.status_label.text()


def test_object_and_accessible_names(qtbot) -> None:
    gpu = VramPanel(fake_plan, CARD, "RTX", None)
    qtbot.addWidget(gpu)
    assert gpu.findChild(QSlider, "vramSlider") is gpu.slider
    assert gpu.card_combo.isHidden()  # a GPU was found: its card is the card
    assert gpu.card_bytes() == CARD
    gpu.set_card_bytes(8 * GIB)
    assert gpu.card_bytes() == CARD
    for widget in (gpu.slider, gpu.ctx_combo, gpu.card_combo, gpu.apply_button, gpu.in_use_label, gpu.status_label):
        assert widget.accessibleName(), widget
    assert isinstance(gpu.apply_button, QPushButton) and gpu.apply_button.text() == "Apply and reload"


def test_planner_failure_is_shown_not_raised(qtbot) -> None:
    calls = []

    def broken(vram: int, ctx: int):
        calls.append(vram)
        if len(calls) > 1:
            raise ValueError("manifest has no expert layers")
        return fake_plan(vram, ctx)

    panel = VramPanel(broken, CARD, "RTX", None)
    qtbot.addWidget(panel)
    assert "no expert layers" in panel.breakdown.reason_label.text()
    assert not panel.apply_button.isEnabled()


def test_set_planner_switches_model(qtbot, plan_fn) -> None:
    panel = VramPanel(plan_fn, CARD, "RTX", 64 * GIB)
    qtbot.addWidget(panel)
    panel.set_vram_budget_bytes(10 * GIB)
    panel.set_in_use(panel.plan_for(10 * GIB, 8192).to_dict(), "cuda")
    assert panel.applied == (10 * GIB, 8192)
    with qtbot.waitSignal(panel.planChanged, timeout=1000) as blocker:
        panel.set_planner(fake_plan)  # another model: its own minimum, the budget kept
    assert blocker.args[0].min_vram_bytes == fake_plan(CARD, DEFAULT_CTX_TOKENS).min_vram_bytes
    assert panel.vram_budget_bytes() == 10 * GIB and panel.applied is None  # the plan in use was the old model's
    assert "nothing yet" in panel.in_use_label.text()
    assert panel.slider.minimum() * STEP_MIB * MIB >= fake_plan(CARD, DEFAULT_CTX_TOKENS).min_vram_bytes


def test_summary_words() -> None:
    s = summarize(fake_plan(8 * GIB, 8192), 8 * GIB, 32 * GIB)
    assert s.fits and s.headline.startswith("Fits")
    assert "of 40 layers' experts on GPU" in s.layers_line
    assert s.ram_line.endswith("of 32.0 GiB")
    assert layer_count([1, 2, 3]) == 3 and layer_count(7) == 7
    assert s.speed_line.startswith("≈ ") and s.speed_line.endswith(" tok/s AR (estimate)")
    planned = summarize(fake_plan(8 * GIB, 8192), 8 * GIB, None, plan_card_bytes=8 * GIB)
    assert planned.headline.startswith("Plan for an 8 GB card: fits") and planned.speed_line == ""


def test_context_choices_stop_at_the_models_limit(qtbot) -> None:
    asked: list[int] = []

    def plan(vram_budget_bytes: int, ctx_tokens: int):  # noqa: ANN202
        asked.append(ctx_tokens)
        return planner.make_plan(planner.manifest_for_shape("clover-35b-a3b"), vram_budget_bytes, ctx_tokens, 64 * GIB)

    panel = VramPanel(plan, CARD, "NVIDIA GeForce RTX 4080", 64 * GIB, ctx_tokens=65_536, ctx_limit=20_000)
    qtbot.addWidget(panel)
    items = lambda: [(panel.ctx_combo.itemText(i), panel.ctx_combo.itemData(i))  # noqa: E731
                     for i in range(panel.ctx_combo.count())]
    assert items() == [("4K tokens", 4096), ("8K tokens", 8192), ("16K tokens", 16_384)]
    assert panel.ctx_tokens() == 16_384 and set(asked) == {16_384}
    panel.set_context_limit(3000)  # shorter than every choice: exactly the limit
    assert items() == [("3,000 tokens", 3000)] and panel.ctx_tokens() == 3000
    panel.set_context_limit(None, want=65_536)  # no limit known: all of them, the one wanted
    assert [n for _, n in items()] == [4096, 8192, 16_384, 32_768, 65_536, 131_072] and panel.ctx_tokens() == 65_536
    panel.set_context_limit(None, want=10_000)  # not offered: the default
    assert panel.ctx_tokens() == DEFAULT_CTX_TOKENS
