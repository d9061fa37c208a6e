"""The model manager panel: folder checks, a real download from the loopback Hub, the demo model via make-tiny."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "0"

from clover_desk.downloads import ModelDownloader  # noqa: E402
from clover_desk.qt_compat import guard_pyside_bool_refcounts  # noqa: E402
from clover_desk.ui.model_manager import ModelManagerPanel, check_model_dir, progress_text  # noqa: E402
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
