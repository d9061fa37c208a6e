"""The VRAM panel hands the plan it shows to the load (issue 29, item 3): the window plans once between the slider
and the load, and says the precision that plan places ("nf4": never implied by the plan)."""

from __future__ import annotations

from typing import Any

import pytest
from fakes_ui import FakeEngineClient

from clover_desk.app import AppSettings, CloverDeskApp
from clover_desk.engine.defaults import GIB
from clover_desk.engine.placement import planner
from clover_desk.engine.placement.hardware import Hardware

GPU = Hardware(gpu_name="NVIDIA GeForce RTX 4070 Ti SUPER", vram_total_bytes=16 * GIB, ram_total_bytes=64 * GIB,
               ram_available_bytes=48 * GIB)


def test_apply_loads_the_plan_the_panel_shows_without_planning_again(
    qtbot: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[planner.Plan] = []
    plan_model = planner.plan_model

    def counted(*args: Any, **kwargs: Any) -> planner.Plan:
        made.append(plan_model(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(planner, "plan_model", counted)
    client = FakeEngineClient()
    with qtbot.waitSignal(client.loaded, timeout=2000):
        desk = CloverDeskApp(tmp_path, client=client, settings=AppSettings(model_dir="/models/first"),
                             hardware=GPU, with_preview=False, with_model_manager=False)
    qtbot.addWidget(desk.window)
    panel = desk.vram_panel
    assert client.plans[0] == panel.plan.to_dict() and client.precisions == ["nf4"]  # the first load: its proposal
    panel.set_vram_budget_bytes(12 * GIB)  # the slider moves: the panel plans and shows that plan
    shown, planned = panel.plan, len(made)
    assert shown is made[-1] and shown.vram_budget_bytes == 12 * GIB
    with qtbot.waitSignal(client.loaded, timeout=2000):
        panel.apply_button.click()
    assert len(made) == planned  # no second planning between the slider and the load
    assert client.plans[-1] == shown.to_dict() and client.precisions[-1] == "nf4"


def test_a_budget_the_panel_does_not_show_is_shown_then_loaded(
    qtbot: Any, tmp_path: Any
) -> None:
    client = FakeEngineClient()
    settings = AppSettings(model_dir="/models/first", vram_budget_bytes=10 * GIB)
    with qtbot.waitSignal(client.loaded, timeout=2000):
        desk = CloverDeskApp(tmp_path, client=client, settings=settings, hardware=GPU, with_preview=False,
                             with_model_manager=False)
    qtbot.addWidget(desk.window)
    panel = desk.vram_panel
    assert panel.plan is not None and panel.plan.vram_budget_bytes == 10 * GIB  # what was loaded is on show
    assert client.plans == [panel.plan.to_dict()]


def test_the_budget_setting_kept_its_name_so_todays_settings_file_reads_back(tmp_path: Any) -> None:
    """The budget was already ``vram_budget_bytes`` (bytes) in settings.json: nothing to migrate. A file as the
    version before issue 29's item 3 wrote it keeps its budget and context."""
    path = tmp_path / "settings.json"
    path.write_text(
        '{\n  "model_dir": "/models/clover",\n  "device": "cuda",\n  "dtype": null,\n'
        '  "vram_budget_bytes": 13958643712,\n  "ctx_tokens": 8192,\n  "compile_layers": false,\n'
        '  "gpu_paths": null,\n  "extra": {}\n}', encoding="utf-8")
    settings = AppSettings.load(path)
    assert settings.vram_budget_bytes == 13 * GIB and settings.ctx_tokens == 8192
    settings.save(path)
    assert AppSettings.load(path) == settings
