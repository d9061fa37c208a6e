"""The model manager panel: folder checks, a real download from the loopback Hub, the demo model via make-tiny."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

os.environ["HF_HUB_OFFLINE"] = "0"

from clover_desk.app import AppSettings, CloverDeskApp  # noqa: E402
from clover_desk.downloads import GGUF_REPO_ID, OFFICIAL_GGUF, ModelDownloader, run_fit  # noqa: E402
from clover_desk.engine.placement.hardware import Hardware  # noqa: E402
from clover_desk.qt_compat import guard_pyside_bool_refcounts  # noqa: E402
from clover_desk.ui.model_manager import ModelManagerPanel, check_model_dir, progress_text  # noqa: E402
from tests.fakes_ui import FakeEngineClient  # noqa: E402
from tests.hf_test_server import FakeHub  # noqa: E402

guard_pyside_bool_refcounts()  # PySide6 6.12 on CPython 3.11: see the guard's docstring

REPO = "Diffuspace/Clover-Panel-Test"
CONFIG = {
    "model_type": "clover_moe", "vocab_size": 1024, "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
}
WEIGHTS = os.urandom(2_000_000)
TIMEOUT_MS = 60_000


def write_model(folder: Path, config: dict | None = None, weights: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or CONFIG))
    if weights:
        (folder / "model.safetensors").write_bytes(b"\0" * 16)
    return folder


@pytest.fixture
def hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setattr("huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE", 128 * 1024)
    with FakeHub() as server:
        server.add_repo(REPO, {"config.json": json.dumps(CONFIG).encode(), "model.safetensors": WEIGHTS},
                        lfs={"model.safetensors"})
        yield server


@pytest.fixture
def panel(qtbot, tmp_path, hub):
    factory = functools.partial(ModelDownloader, endpoint=hub.endpoint, token=False, reserve_bytes=0)
    widget = ModelManagerPanel(downloader_factory=factory, models_dir=tmp_path / "models",
                               recent_file=tmp_path / "recent.json", default_repo_id=REPO)
    qtbot.addWidget(widget)
    yield widget
    widget.shutdown()


# ---- folder checks -----------------------------------------------------------------------------------------------


def test_check_model_dir_explains_what_is_wrong(tmp_path: Path) -> None:
    assert "not a folder" in check_model_dir(tmp_path / "absent").message
    assert "no config.json" in check_model_dir(tmp_path).message
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "clover-Q4_K_M.gguf").write_bytes(b"GGUF")
    assert "open the .gguf file itself" in check_model_dir(tmp_path / "gguf").message
    bad = write_model(tmp_path / "llama", {"model_type": "llama"})
    assert "'llama' is not supported" in check_model_dir(bad).message
    partial = write_model(tmp_path / "partial", {"model_type": "clover_moe", "vocab_size": 10})
    assert "missing required field" in check_model_dir(partial).message
    no_weights = write_model(tmp_path / "noweights", weights=False)
    assert "no *.safetensors" in check_model_dir(no_weights).message
    good = check_model_dir(write_model(tmp_path / "good"))
    assert good.ok and good.model_type == "clover_moe" and "block diffusion" in good.message


def test_progress_text() -> None:
    assert progress_text(1_500_000_000, 70_000_000_000, 52_000_000, 3725) == \
        "1.50 of 70.00 GB · 52.0 MB/s · 1 h 02 min left"
    assert progress_text(0, 10, 0.0, None) == "0.00 of 0.00 GB"


def test_open_folder_errors_are_shown_and_good_folder_is_chosen(qtbot, panel, tmp_path: Path) -> None:
    with qtbot.assertNotEmitted(panel.modelChosen):
        assert panel.open_folder(tmp_path / "nowhere") is False
    assert "Cannot use this folder" in panel.open_status.text()
    assert "not a folder" in panel.open_status.text()
    write_model(tmp_path / "weird", {"model_type": "bert"})
    assert panel.open_folder(tmp_path / "weird") is False
    assert "not supported" in panel.open_status.text()

    good = write_model(tmp_path / "good")
    with qtbot.waitSignal(panel.modelChosen) as blocker:
        assert panel.open_folder(good) is True
    assert blocker.args == [str(good)]
    assert panel.recent_models() == [str(good)]
    assert json.loads((tmp_path / "recent.json").read_text()) == [str(good)]


def test_recent_list_survives_a_restart_and_opens_on_activation(qtbot, panel, tmp_path: Path, hub) -> None:
    good = write_model(tmp_path / "good")
    panel.open_folder(good)
    again = ModelManagerPanel(downloader_factory=None, models_dir=tmp_path / "models",
                              recent_file=tmp_path / "recent.json")
    qtbot.addWidget(again)
    assert again.recent_list.count() == 1
    with qtbot.waitSignal(again.modelChosen) as blocker:
        again.recent_list.itemActivated.emit(again.recent_list.item(0))
    assert blocker.args == [str(good)]


def test_free_space_is_shown_and_nothing_to_resume(panel) -> None:
    assert " GB free on " in panel.free_label.text()
    assert panel.download_button.isEnabled()
    assert not panel.resume_button.isEnabled() and not panel.cancel_button.isEnabled()


# ---- download ----------------------------------------------------------------------------------------------------


def test_download_reports_progress_and_chooses_the_model(qtbot, panel, tmp_path: Path, hub) -> None:
    seen = []
    panel.downloadProgress.connect(seen.append)
    target = tmp_path / "models" / "dl"
    panel.target_edit.setText(str(target))
    with qtbot.waitSignal(panel.modelChosen, timeout=TIMEOUT_MS) as chosen:
        panel.download_button.click()
    assert chosen.args == [str(target)]
    assert (target / "model.safetensors").read_bytes() == WEIGHTS
    assert panel.progress_bar.value() == 1000
    assert seen and seen[-1].state == "done" and seen[-1].done_bytes == seen[-1].total_bytes
    assert any(p.state == "downloading" for p in seen)
    assert "Downloaded into" in panel.download_status.text()
    assert panel.download_button.isEnabled() and not panel.cancel_button.isEnabled()


def test_download_cancel_then_resume(qtbot, panel, tmp_path: Path, hub) -> None:
    hub.state.chunk_delay_s = 0.02
    target = tmp_path / "models" / "slow"
    panel.target_edit.setText(str(target))
    with qtbot.waitSignal(panel.downloadProgress, timeout=TIMEOUT_MS,
                          check_params_cb=lambda p: p.state == "downloading" and p.done_bytes > 300_000):
        panel.download_button.click()
    assert panel.cancel_button.isEnabled() and not panel.download_button.isEnabled()
    with qtbot.waitSignal(panel.downloadEnded, timeout=TIMEOUT_MS) as ended:
        panel.cancel_button.click()
    assert ended.args[0] is False
    assert "Cancelled" in panel.download_status.text()
    assert panel.resume_button.isEnabled()
    # After a restart of the app, the partial download is found and Resume is offered.
    fresh = ModelManagerPanel(models_dir=tmp_path / "models")
    qtbot.addWidget(fresh)
    assert not fresh.resume_button.isEnabled()
    fresh.target_edit.setText(str(target))
    fresh.target_edit.editingFinished.emit()
    assert fresh.resume_button.isEnabled()

    hub.state.chunk_delay_s = 0.0
    with qtbot.waitSignal(panel.modelChosen, timeout=TIMEOUT_MS):
        panel.resume_button.click()
    assert (target / "model.safetensors").read_bytes() == WEIGHTS
    assert any((h.get("range") or "").startswith("bytes=") for h in hub.requests_for("/cdn/"))


def test_download_error_is_shown(qtbot, panel, tmp_path: Path) -> None:
    panel.repo_edit.setText("nobody/nothing")
    with qtbot.waitSignal(panel.downloadEnded, timeout=TIMEOUT_MS) as ended:
        panel.download_button.click()
    assert ended.args[0] is False
    assert "not found" in panel.download_status.text()
    assert panel.resume_button.isEnabled()


# ---- demo model --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_model_is_created_with_make_tiny_and_chosen(qtbot, panel, tmp_path: Path) -> None:
    repo_root = Path(__file__).resolve().parents[2]
    if not (repo_root / "clover_desk" / "cli" / "make_tiny.py").exists():
        pytest.skip("clover-desk make-tiny is not there yet")
    assert "random noise" in panel.demo.status.text()
    with qtbot.waitSignal(panel.modelChosen, timeout=180_000) as chosen:
        panel.demo.button.click()
    folder = Path(chosen.args[0])
    assert folder == tmp_path / "models" / "clover-tiny-demo"
    assert check_model_dir(folder).ok
    assert "random noise" in panel.demo.status.text() and "ready" in panel.demo.status.text()
    assert panel.demo.button.isEnabled()


def test_demo_failure_is_reported(qtbot, panel, tmp_path: Path) -> None:
    blocker_file = tmp_path / "not-a-folder"
    blocker_file.write_text("x")
    with qtbot.waitSignal(panel.demoEnded, timeout=180_000) as ended:
        panel.demo.create(blocker_file / "demo")  # a folder inside a file: make-tiny must fail
    assert ended.args[0] is False
    assert "Could not create the demo model" in panel.demo.status.text()


# ---- downloads that fit ----------------------------------------------------------------------------------------

GIB = 1024**3
CARD_16 = Hardware(gpu_name="NVIDIA GeForce RTX 4080", vram_total_bytes=16 * GIB, ram_total_bytes=64 * GIB,
                   ram_available_bytes=48 * GIB)


def fits_panel(qtbot, tmp_path: Path, budget: int | None, hardware: Hardware = CARD_16,  # noqa: ANN001
               quantized: bool = True) -> ModelManagerPanel:
    """The panel as the app builds it: the official choices, each judged by run_fit at ``budget`` (None: no GPU;
    ``quantized``: the folder through its quantized cache)."""
    def estimate(choice):  # noqa: ANN001, ANN202
        return run_fit(choice, budget, 16384, hardware, "bf16" if budget else "fp32", quantized=quantized)

    widget = ModelManagerPanel(models_dir=tmp_path / "models", gguf_choices=OFFICIAL_GGUF, gguf_repo_id=GGUF_REPO_ID,
                               fit_estimator=estimate)
    qtbot.addWidget(widget)
    return widget


def items(panel: ModelManagerPanel) -> list[str]:
    return [panel.download_choice.itemText(i) for i in range(panel.download_choice.count())]


def test_a_16_gb_card_is_offered_a_gguf_file_first_not_the_69_gb_folder(qtbot, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("clover_desk.ui.model_manager.free_bytes", lambda _folder: 2000 * 10**9)
    panel = fits_panel(qtbot, tmp_path, 15 * GIB)
    assert panel.download_choice.currentData() is OFFICIAL_GGUF[0]  # Q4_0: partial offload, the smallest download
    assert panel.repo_edit.text() == GGUF_REPO_ID  # the repository and folder follow the default
    assert panel.target_edit.text().endswith("Clover-35B-A3B-Preview-GGUF")
    folder, q4_0, q4_k_m, q8_0 = items(panel)
    assert folder == "Safetensors model folder (BF16, about 69 GB) — partial offload · fits the disk"
    assert q4_0 == "GGUF Q4_0 (19.6 GB): that file only — partial offload · fits the disk"
    assert "partial offload at best (by size)" in q8_0 and "partial offload at best (by size)" in q4_k_m
    tip = panel.download_choice.itemData(0, Qt.ItemDataRole.ToolTipRole)
    assert "expert layers on the card" in tip and "Disk: needs 90.4 GB" in tip
    assert "(the planner, the 35B shape at Q4_0's 4.5 bits a weight)" in panel.fit_label.text()
    panel.download_choice.setCurrentIndex(3)  # the line under the list follows the choice
    assert "the planner counts it once the file is on disk" in panel.fit_label.text()


def test_a_small_disk_marks_the_big_choices_as_not_fitting(qtbot, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("clover_desk.ui.model_manager.free_bytes", lambda _folder: 30 * 10**9)
    panel = fits_panel(qtbot, tmp_path, 24 * GIB)  # a 24 GB card: the folder would run whole on it
    folder, q4_0, q4_k_m, q8_0 = items(panel)
    assert folder.endswith("full GPU offload · too big for the disk") and q8_0.endswith("too big for the disk")
    assert q4_0.endswith("full GPU offload · fits the disk") and q4_k_m.endswith("fits the disk")
    assert panel.download_choice.currentData() is OFFICIAL_GGUF[0]
    assert "30.0 GB free there: fits" in panel.fit_label.text()


def test_without_a_gpu_the_folder_is_too_large_and_a_file_that_fits_the_ram_is_offered(qtbot, tmp_path) -> None:
    panel = fits_panel(qtbot, tmp_path, None, Hardware(gpu_name=None, ram_total_bytes=32 * GIB), quantized=False)
    folder, q4_0, _, q8_0 = items(panel)
    assert "likely too large" in folder and "likely too large" in q8_0 and "runs from RAM" in q4_0
    assert panel.download_choice.currentData() is OFFICIAL_GGUF[0]
    assert "No NVIDIA GPU: runs from RAM" in panel.fit_label.text()


def test_without_a_gpu_the_folder_fits_the_ram_through_its_quantized_cache(qtbot, tmp_path) -> None:
    panel = fits_panel(qtbot, tmp_path, None, Hardware(gpu_name=None, ram_total_bytes=32 * GIB))
    folder, q4_0, _, q8_0 = items(panel)
    assert "runs from RAM" in folder and "runs from RAM" in q4_0 and "likely too large" in q8_0
    assert panel.download_choice.currentData() is OFFICIAL_GGUF[0]  # the smaller download of the two that fit
    panel.download_choice.setCurrentIndex(0)
    assert "quantized cache" in panel.fit_label.text()


def test_the_fits_follow_the_budget_but_never_change_the_users_choice(qtbot, tmp_path) -> None:
    """The app refreshes the fits when the VRAM budget is applied; the choice the user made stays."""
    desk = CloverDeskApp(tmp_path, client=FakeEngineClient(), settings=AppSettings(), hardware=CARD_16, with_preview=False,
                         start_engine=False, style=False)
    qtbot.addWidget(desk.window)
    combo = desk.model_manager.download_choice
    assert combo.currentData() is OFFICIAL_GGUF[0]  # a 16 GB card: not the folder
    assert "partial offload" in combo.itemText(1)
    combo.setCurrentIndex(0)  # the user wants the folder
    desk.on_apply_plan(40 * GIB, 16384)  # (no GPU reload here: a fake client) the budget the window now uses
    assert combo.currentIndex() == 0
    assert "full GPU offload" in combo.itemText(1)
    assert desk.model_manager.repo_edit.text() == "Diffuspace/Clover-35B-A3B-Preview"
    desk.shutdown()
