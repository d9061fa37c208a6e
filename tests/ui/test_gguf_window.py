"""GGUF files in the window: opened from the model manager, loaded by the real worker, and the official files offered
for download (one file each, from the Hub stand-in). The files are written by engine.weights.gguf.writer from a tiny random
model: the fork layout (diffusion tensors kept) and upstream llama.cpp's (autoregressive only)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import pytest
from fixtures_tiny import tiny_clover_dir  # noqa: F401 (session fixture)
from gui_desk import running_desk
from PySide6.QtCore import Qt
from worker_proc import WorkerProc

from clover_desk.downloads import GGUF_REPO_ID, GgufChoice, ModelDownloader
from clover_desk.engine.decode.events import Finished
from clover_desk.qt_compat import guard_pyside_bool_refcounts
from clover_desk.ui.contracts import EngineState
from clover_desk.ui.model_manager import ModelManagerPanel, check_gguf_file, check_model_path
from tests.hf_test_server import FakeHub

guard_pyside_bool_refcounts()

LOAD_MS = 90_000
GEN_MS = 90_000


@pytest.fixture(scope="module")
def ggufs(tiny_clover_dir, tmp_path_factory) -> dict[str, Any]:  # noqa: F811
    from clover_desk.engine.weights.gguf.writer import write_gguf

    out = tmp_path_factory.mktemp("ggufs")
    return {
        "upstream": write_gguf(tiny_clover_dir, out / "tiny-upstream-Q8_0.gguf", "Q8_0", layout="upstream")[0],
        "fork": write_gguf(tiny_clover_dir, out / "tiny-fork-Q8_0.gguf", "Q8_0", layout="fork")[0],
        "stripped": write_gguf(tiny_clover_dir, out / "stripped.gguf", "F32", layout="fork",
                               diffusion_tensors=False)[0],
        "split": write_gguf(tiny_clover_dir, out / "split.gguf", "Q8_0", split_max_tensors=25),
    }


# ---- the worker --------------------------------------------------------------------------------------------------


def test_the_worker_loads_a_gguf_file_says_why_diffusion_is_refused_and_takes_a_layout(ggufs) -> None:
    w = WorkerProc()
    try:
        w.expect_event("ready")
        w.send(cmd="load", model_dir=str(ggufs["upstream"]))
        loaded = w.expect_event("loaded")
        assert "upstream llama.cpp's layout" in loaded["ar_only"] and loaded["config"]["is_diffusion"] is False
        w.send(cmd="generate", id="d", prompt_ids=[5, 17, 300], raw=True, params={"mode": "diffusion"})
        assert "diffusion mode is not available" in w.expect_event("error", id="d")["message"]
        w.send(cmd="generate", id="a", prompt_ids=[5, 17, 300], raw=True, params={"mode": "ar", "max_new_tokens": 3})
        assert w.expect(lambda r: r.get("id") == "a" and r["event"] in ("finished", "error"))["event"] == "finished"

        w.send(cmd="load", model_dir=str(ggufs["fork"]))
        assert w.expect_event("loaded")["ar_only"] is None
        # a fork file without its diffusion tensors is refused as detected, and loads with the layout named
        w.send(cmd="load", model_dir=str(ggufs["stripped"]))
        refused = w.expect_event("error", op="load")
        assert "layout 'fork'" in refused["message"]
        w.send(cmd="load", model_dir=str(ggufs["stripped"]), gguf_layout="fork")
        assert w.expect_event("loaded")["model_dir"] == str(ggufs["stripped"])
    finally:
        w.close()


# ---- the window --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def desk(qapp, tmp_path_factory):
    from clover_desk.app import AppSettings

    def prepare(app: Any) -> None:
        app.events = []
        app.client.event.connect(lambda rid, ev: app.events.append((rid, ev)))

    with running_desk(tmp_path_factory.mktemp("gguf_home"), AppSettings(), until="ready", load_ms=LOAD_MS,
                      size=(1200, 800), prepare=prepare) as app:
        yield app


def _open(qtbot, desk, path: Path, monkeypatch) -> dict[str, Any]:
    """Model ▸ Models… ▸ Open GGUF file… (the file dialog answers ``path``), until the worker has loaded it."""
    from PySide6.QtWidgets import QFileDialog

    window = desk.window
    window.show_models_page()
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a, **k: (str(path), "GGUF model (*.gguf)"))
    with qtbot.waitSignal(desk.client.loaded, timeout=LOAD_MS) as blocker:
        qtbot.mouseClick(window.model_manager.open_gguf_button, Qt.MouseButton.LeftButton)
    return blocker.args[0]


def test_an_upstream_gguf_runs_in_ar_and_the_window_says_why(qtbot, desk, ggufs, monkeypatch) -> None:
    window = desk.window
    info = _open(qtbot, desk, ggufs["upstream"], monkeypatch)
    assert info["model_dir"] == str(ggufs["upstream"]) and window.engine_status.state is EngineState.READY
    assert desk.settings.model_dir == str(ggufs["upstream"])  # remembered like a folder
    banner = window.info_banner.label.text()
    assert window.info_banner.isVisible() and "Block diffusion is unavailable for this file" in banner
    assert "upstream llama.cpp's layout" in banner
    mode = window.drawer.mode
    assert mode.currentData() == "ar"
    diffusion = mode.model().item(mode.findData("diffusion"))
    assert not diffusion.isEnabled() and "upstream llama.cpp's layout" in diffusion.toolTip()
    assert window.composer.mode_label.text() == "autoregressive"

    window.composer.input.setPlainText("Hello")
    with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS) as finished:
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    rid, reason = finished.args
    assert reason in ("eos", "max_new_tokens")
    assert [ev for r, ev in desk.events if r == rid and isinstance(ev, Finished)]
    assert desk.store.messages(window.conversation_id)[-1].status == "complete"

    # a fork-layout file runs block diffusion: the choice comes back
    _open(qtbot, desk, ggufs["fork"], monkeypatch)
    assert mode.model().item(mode.findData("diffusion")).isEnabled() and window.drawer.diffusion_unavailable == ""


def test_any_part_of_a_split_set_opens_the_set(qtbot, desk, ggufs, monkeypatch) -> None:
    first, second = ggufs["split"][:2]
    assert len(ggufs["split"]) > 2 and second.name.endswith(f"-00002-of-{len(ggufs['split']):05d}.gguf")
    info = _open(qtbot, desk, second, monkeypatch)
    assert info["model_dir"] == str(first)
    assert desk.window.model_manager.recent_models()[0] == str(first)


def test_gguf_checks_say_what_is_wrong(tmp_path, ggufs) -> None:
    assert check_model_path(ggufs["fork"]).ok and "GGUF file" in check_gguf_file(ggufs["fork"]).message
    assert f"{len(ggufs['split'])} parts" in check_gguf_file(ggufs["split"][0]).message
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"NOPE" * 10)
    assert "not a GGUF file" in check_model_path(fake).message
    lonely = tmp_path / "set-00001-of-00003.gguf"
    lonely.write_bytes(b"GGUF")
    message = check_model_path(lonely).message
    assert "missing" in message and "set-00002-of-00003.gguf" in message
    assert "not a file" in check_model_path(tmp_path / "absent.gguf").message


# ---- downloads ---------------------------------------------------------------------------------------------------


def test_the_manager_downloads_only_the_chosen_gguf_file(qtbot, tmp_path, ggufs, monkeypatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    data = ggufs["fork"].read_bytes()
    other = ggufs["upstream"].read_bytes()
    with FakeHub() as hub:
        hub.add_repo(GGUF_REPO_ID, {"Clover-Q4_0.gguf": data, "Clover-Q8_0.gguf": other, "README.md": b"hi"},
                     lfs={"Clover-Q4_0.gguf", "Clover-Q8_0.gguf"})
        choices = [GgufChoice("Q4_0", len(data), hashlib.sha256(data).hexdigest()), GgufChoice("Q8_0")]
        factory = functools.partial(ModelDownloader, endpoint=hub.endpoint, token=False, reserve_bytes=0)
        panel = ModelManagerPanel(downloader_factory=factory, models_dir=tmp_path / "models",
                                  recent_file=tmp_path / "recent.json", gguf_choices=choices)
        qtbot.addWidget(panel)
        labels = [panel.download_choice.itemText(i) for i in range(panel.download_choice.count())]
        assert labels[1:] == [f"GGUF Q4_0 ({len(data) / 1e9:.1f} GB): that file only", "GGUF Q8_0: that file only"]
        panel.download_choice.setCurrentIndex(1)
        assert panel.repo_edit.text() == GGUF_REPO_ID
        assert panel.target_edit.text() == str(tmp_path / "models" / "Clover-35B-A3B-Preview-GGUF")
        with qtbot.waitSignal(panel.modelChosen, timeout=60_000) as chosen:
            qtbot.mouseClick(panel.download_button, Qt.MouseButton.LeftButton)
        path = Path(chosen.args[0])
        assert path == tmp_path / "models" / "Clover-35B-A3B-Preview-GGUF" / "Clover-Q4_0.gguf"
        assert path.read_bytes() == data
        fetched = {p.rsplit("/", 1)[-1] for _, m, p, _ in hub.state.requests if "/cdn/" in p and m == "GET"}
        assert fetched == {hashlib.sha256(data).hexdigest()}  # the other file was never transferred
        assert "GGUF file" in panel.download_status.text()
        panel.shutdown()
