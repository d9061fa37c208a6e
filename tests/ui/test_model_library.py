"""The models page as a library (issue 10): each model's format and size on disk, the current one marked, Delete
(with its quantized cache, after a confirmation naming what goes and how much), Show in folder, and the device and
precision of the next load, through the real app (CloverDeskApp) with the scripted engine client."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fakes_ui import FakeEngineClient
from fixtures_tiny import copy_model, tiny_clover_dir  # noqa: F401 (session fixture)
from hostile_gguf import huge_array, huge_tensor, nested_arrays
from PySide6.QtCore import QObject, QUrl, Slot
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import QAbstractButton

from clover_desk.engine.placement.hardware import Hardware
from clover_desk.engine.weights.formats import checkpoint_files, read_safetensors_header
from clover_desk.qt_compat import guard_pyside_bool_refcounts
from clover_desk.ui.model_library import (
    CACHE_DIRNAME,
    ModelLibrary,
    external_cache_dir,
    library_paths,
    scan_entry,
    size_text,
)

guard_pyside_bool_refcounts()


@pytest.fixture
def models(tmp_path, tiny_clover_dir, monkeypatch):  # noqa: ANN001, ANN201, F811
    """A models folder with two tiny models; the second has a quantized cache beside it and one in the user's
    cache folder (as for a read-only model folder)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    folder = tmp_path / "home" / "models"
    first = copy_model(tiny_clover_dir, folder / "tiny-a")
    second = copy_model(tiny_clover_dir, folder / "tiny-b")
    inside = second / CACHE_DIRNAME / "0123abcd"
    inside.mkdir(parents=True)
    (inside / "weights.safetensors").write_bytes(b"\0" * 300_000)
    (inside / "manifest.json").write_text("{}")
    outside = external_cache_dir(second) / "4567ef01"
    outside.mkdir(parents=True)
    (outside / "weights.safetensors").write_bytes(b"\0" * 200_000)
    return folder, first, second


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_facts_of_a_model_folder(models) -> None:  # noqa: ANN001
    _folder, first, second = models
    files, _ = checkpoint_files(first)
    dtypes = {e.dtype for f in files for e in read_safetensors_header(f)[0].values()}
    a = scan_entry(first)
    assert a.usable and a.format.startswith("safetensors · ") and set(a.format.split(" · ")[1].split(" + ")) <= dtypes
    assert a.weights_bytes == folder_bytes(first) and a.cache_bytes == 0
    assert a.removes == ((str(first), folder_bytes(first)),)
    b = scan_entry(second)
    cache_inside = folder_bytes(second / CACHE_DIRNAME)
    outside = external_cache_dir(second)
    assert b.cache_bytes == cache_inside + folder_bytes(outside) == 300_000 + 2 + 200_000
    assert b.weights_bytes == folder_bytes(second) - cache_inside
    assert b.removes == ((str(second), folder_bytes(second)), (str(outside), folder_bytes(outside)))
    assert b.total_bytes == folder_bytes(second) + folder_bytes(outside)
    gone = scan_entry(second.parent / "nope")
    assert not gone.usable and "missing" in gone.format and gone.removes == ()


def test_the_cache_outside_a_read_only_model_is_where_the_engine_puts_it(models, monkeypatch) -> None:  # noqa: ANN001
    from clover_desk.engine.weights import quant_cache_files

    _folder, first, _second = models
    monkeypatch.setattr(quant_cache_files, "_writable", lambda _path: False)
    assert quant_cache_files.cache_dir_for(first).parent == external_cache_dir(first)
    assert quant_cache_files.CACHE_DIRNAME == CACHE_DIRNAME


def test_a_gguf_file_says_its_type(tmp_path) -> None:  # noqa: ANN001
    import gguf

    path = tmp_path / "models" / "clover-Q4_K_M.gguf"
    path.parent.mkdir()
    writer = gguf.GGUFWriter(str(path), "clover_moe")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    entry = scan_entry(path)
    assert entry.format == "GGUF · Q4_K_M" and entry.removes == ((str(path), path.stat().st_size),)
    assert library_paths(tmp_path / "models", []) == [str(path)]


def test_a_hostile_gguf_in_the_models_folder_is_listed_as_damaged_without_stalling_the_scan(qtbot,  # noqa: ANN001
                                                                                             tmp_path) -> None:
    """Through the real widget and its scan thread: each hostile header (which GGUFReader loops on forever or
    recurses through) is a row saying what is wrong, that cannot be loaded and can be deleted."""
    folder = tmp_path / "models"
    folder.mkdir()
    bad = [huge_array(folder / "a-huge-array.gguf"), nested_arrays(folder / "b-nested.gguf"),
           huge_tensor(folder / "c-huge-tensor.gguf")]
    library = ModelLibrary(folder)
    qtbot.addWidget(library)
    with qtbot.waitSignal(library.scanned, timeout=10_000):
        library.refresh()
    assert [row.entry.path for row in library.rows] == [str(p) for p in bad]
    for row, says in zip(library.rows, ("elements of 'tokenizer.ggml.token_type'", "nests arrays", "too many")):
        assert row.entry.format.startswith("GGUF, damaged: truncated or damaged GGUF file") and says in row.entry.format
        assert says in row.facts_label.text()
        assert not row.load_button.isEnabled() and row.delete_button.isEnabled()


def test_sizes_read_in_gigabytes() -> None:
    assert size_text(12_345_000_000) == "12.3 GB" and size_text(340_000_000) == "340 MB" and size_text(2_000) == "2 kB"


# ---- through the app ---------------------------------------------------------------------------------------------


class _Opened(QObject):
    """Receives what QDesktopServices.openUrl would hand the file manager."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[QUrl] = []

    @Slot(QUrl)
    def open(self, url: QUrl) -> None:  # noqa: A003
        self.urls.append(url)


@pytest.fixture
def desk(qapp, qtbot, models):  # noqa: ANN001, ANN201
    from clover_desk.app import AppSettings, CloverDeskApp

    folder, first, _second = models
    home = folder.parent
    (home / "recent_models.json").write_text(json.dumps([str(first)]))
    app = CloverDeskApp(home, client=FakeEngineClient(loaded=False), settings=AppSettings(model_dir=str(first)),
                        hardware=Hardware(gpu_name=None, ram_total_bytes=32 * 1024**3), with_preview=False,
                        start_engine=False, style=False)
    qtbot.addWidget(app.window)
    app.window.show()
    app.window.show_models_page()
    library = app.model_library
    qtbot.waitUntil(lambda: len(library.rows) == 2, timeout=10_000)
    yield app
    app.shutdown(wait_ms=0)


def test_the_models_page_lists_each_model_with_the_current_one_marked(qtbot, desk, models) -> None:  # noqa: ANN001
    _folder, first, second = models
    library = desk.model_library
    assert desk.window.pages.currentWidget().widget().findChild(type(library), "modelLibrary") is library
    current, other = library.row_for(str(first)), library.row_for(str(second))
    assert current.badge.isVisible() and current.badge.text() == "current" and "currentModel" in current.property("class")
    assert current.delete_button.isHidden() and current.load_button.isHidden()  # in use: never deleted
    assert not other.badge.isVisible() and other.delete_button.isEnabled() and other.load_button.isEnabled()
    assert "quantized cache 500 kB" in other.facts_label.text() and "safetensors · " in other.facts_label.text()
    assert [b.accessibleName() for b in other.findChildren(QAbstractButton)] == [
        "Load tiny-b", "Show tiny-b in its folder", "Delete tiny-b"]


def test_show_in_folder_opens_the_models_folder(qtbot, desk, models) -> None:  # noqa: ANN001
    _folder, _first, second = models
    opened = _Opened()
    QDesktopServices.setUrlHandler("file", opened, "open")
    try:
        desk.model_library.row_for(str(second)).reveal_button.click()
    finally:
        QDesktopServices.unsetUrlHandler("file")
    assert [u.toLocalFile() for u in opened.urls] == [str(second)]


def test_delete_asks_naming_what_goes_then_removes_the_model_and_its_caches(qtbot, desk, models) -> None:  # noqa: ANN001
    _folder, _first, second = models
    library = desk.model_library
    outside = external_cache_dir(second)
    entry = scan_entry(second)
    library.row_for(str(second)).delete_button.click()
    box = library.confirm_box
    assert box is not None and box.isVisible()
    text = box.text()
    assert "Delete tiny-b?" in text and str(second) in text and str(outside) in text
    assert f"{size_text(entry.total_bytes)}</b> freed" in text and "quantized cache" in text
    assert second.is_dir() and outside.is_dir()  # nothing goes before the answer
    confirm = box.findChild(QAbstractButton, "confirmDelete")
    assert confirm.text() == f"Delete {size_text(entry.total_bytes)}"
    with qtbot.waitSignal(library.deleted, timeout=10_000) as deleted:
        confirm.click()
    assert deleted.args == [str(second)]
    assert not second.exists() and not outside.exists()
    qtbot.waitUntil(lambda: len(library.rows) == 1, timeout=10_000)
    assert "freed" in library.status.text()


def test_cancel_deletes_nothing(qtbot, desk, models) -> None:  # noqa: ANN001
    _folder, _first, second = models
    library = desk.model_library
    library.row_for(str(second)).delete_button.click()
    with qtbot.assertNotEmitted(library.deleted, wait=300):
        library.confirm_box.reject()
    assert second.is_dir() and external_cache_dir(second).is_dir()


def test_device_and_precision_apply_to_the_next_load(qtbot, desk, models) -> None:  # noqa: ANN001
    _folder, _first, second = models
    library, client = desk.model_library, desk.client
    devices = library.device_choice
    assert devices.currentData() == "cpu" and not devices.model().item(1).isEnabled()  # no GPU here
    assert library.dtype_choice.currentData() == "float32"
    library.dtype_choice.setCurrentIndex(library.dtype_choice.findData("bfloat16"))
    assert desk.settings.dtype == "bfloat16" and json.loads(desk.settings_path.read_text())["dtype"] == "bfloat16"
    assert client.loads == []  # applied on the next load, not now
    assert library.reload_button.isVisible()
    with qtbot.waitSignal(client.loaded, timeout=5000):
        library.row_for(str(second)).load_button.click()
    assert client.loads[-1][:3] == (str(second), "cpu", "bfloat16")
    assert desk.window.pages.currentIndex() == 0  # Load went back to the chat, where the model loads
    qtbot.waitUntil(lambda: library.row_for(str(second)) is not None
                    and library.row_for(str(second)).badge.isVisibleTo(library), timeout=10_000)
    library.dtype_choice.setCurrentIndex(library.dtype_choice.findData("float32"))
    with qtbot.waitSignal(client.loaded, timeout=5000):
        library.reload_button.click()
    assert client.loads[-1][:3] == (str(second), "cpu", "float32")


def test_a_folder_on_the_cpu_loads_through_its_4_bit_cache_unless_unticked(qtbot, desk, models, tmp_path) -> None:  # noqa: ANN001
    """Without a GPU a model folder loads through its quantized cache by default (the 35B folder would need 69 GB of
    RAM in bfloat16); unticking "4-bit weights" loads the weights as stored, and the choice is remembered. A .gguf
    file is read as its own blocks either way; on the GPU the box shows the plan's 4 bits, fixed."""
    from clover_desk.app import AppSettings, CloverDeskApp
    from clover_desk.storage.store import ChatStore

    folder, _first, second = models
    library, client = desk.model_library, desk.client
    box = library.quantized_choice
    assert box.isChecked() and box.isEnabled() and "quantized cache" in box.toolTip()
    with qtbot.waitSignal(client.loaded, timeout=5000):
        library.row_for(str(second)).load_button.click()
    assert client.loads[-1][:2] == (str(second), "cpu") and client.precisions[-1] == "nf4"
    fit = desk.download_fit(None)  # the folder counted as the cache it loads through: it fits the 32 GiB of RAM
    assert fit.place == "ram" and "quantized cache" in fit.text
    desk.window.show_models_page()
    box.click()
    assert desk.settings.quantized is False and json.loads(desk.settings_path.read_text())["quantized"] is False
    assert library.reload_button.isVisible()
    unquantized = desk.download_fit(None)
    assert unquantized.place == "too_large" and "138.7 GB for the 35B weights unquantized in fp32" in unquantized.text
    with qtbot.waitSignal(client.loaded, timeout=5000):
        library.reload_button.click()
    assert client.loads[-1][:3] == (str(second), "cpu", "float32") and client.precisions[-1] is None
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    box.click()  # ticked again: still no precision for a .gguf file (its own blocks)
    desk.settings.model_dir = str(gguf)
    desk.load_model()
    assert client.loads[-1][0] == str(gguf) and client.precisions[-1] is None
    # the GPU always loads 4-bit under its plan: the box says so and cannot be unticked; the CPU's choice stays
    box.click()
    assert desk.settings.quantized is False
    library.device_choice.model().item(1).setEnabled(True)
    library.device_choice.setCurrentIndex(library.device_choice.findData("cuda"))
    assert box.isChecked() and not box.isEnabled() and "VRAM plan" in box.toolTip()
    assert desk.settings.device == "cuda" and desk.settings.quantized is False
    library.device_choice.setCurrentIndex(library.device_choice.findData("cpu"))
    assert not box.isChecked() and box.isEnabled()
    # the next start of the app shows the saved choice
    assert AppSettings.load(desk.settings_path).quantized is False
    again = CloverDeskApp(folder.parent, client=FakeEngineClient(loaded=False), store=ChatStore(tmp_path / "chats.db"),
                          settings=AppSettings(model_dir=str(second), quantized=False),
                          hardware=Hardware(gpu_name=None, ram_total_bytes=32 * 1024**3), with_preview=False,
                          start_engine=False, style=False)
    try:
        assert not again.model_library.quantized_choice.isChecked()
        again.load_model()
        assert again.client.precisions == [None]
    finally:
        again.shutdown(wait_ms=0)
        again.window.close()


def test_the_status_bar_names_the_weights_the_loaded_engine_holds(qtbot, desk) -> None:  # noqa: ANN001
    """The engine's answer says how it holds its weights; the status bar says it beside the device, for every
    precision the engine has (an answer without one, from an older engine, adds nothing)."""
    from clover_desk.engine.defaults import PRECISIONS

    status = desk.window.engine_status
    names = set()
    for precision in PRECISIONS:
        status.on_engine_loaded({"model_dir": "/models/tiny", "precision": precision})
        status.refresh()
        text = status.gpu_label.text()
        assert text.startswith("No GPU (CPU) · ") and text.count("·") == 1, text
        names.add(text)
    assert len(names) == len(PRECISIONS)
    assert "No GPU (CPU) · 4-bit weights" in names and "No GPU (CPU) · GGUF blocks" in names
    status.on_engine_loaded({"model_dir": "/models/tiny"})
    status.refresh()
    assert status.gpu_label.text() == "No GPU (CPU)"


def test_the_next_plan_counts_in_the_chosen_precision(qtbot, desk) -> None:  # noqa: ANN001
    desk.on_load_options_changed("cuda", "float32")
    assert desk._plan(16 * 1024**3, 4096).compute_dtype == "fp32"  # noqa: SLF001
    desk.on_load_options_changed("cuda", "bfloat16")
    assert desk._plan(16 * 1024**3, 4096).compute_dtype == "bf16"  # noqa: SLF001


def test_compile_the_layers_is_remembered_and_sent_with_the_next_load(
    qtbot, desk, models, tmp_path,  # noqa: ANN001
) -> None:
    from clover_desk.app import AppSettings, CloverDeskApp
    from clover_desk.storage.store import ChatStore

    folder, _first, second = models
    library, client = desk.model_library, desk.client
    box = library.compile_choice
    assert not box.isChecked() and box.isVisibleTo(library)  # off unless chosen
    tip = box.toolTip()
    assert all(words in tip for words in ("faster decoding", "warm-up while the model loads",
                                          "two to three minutes on a CPU", "under a minute on later runs",
                                          "Needs a C++ compiler"))
    box.click()
    assert desk.settings.compile_layers is True and json.loads(desk.settings_path.read_text())["compile_layers"]
    assert client.loads == [] and library.reload_button.isVisible()  # applied on the next load, not now
    with qtbot.waitSignal(client.loaded, timeout=5000):
        library.row_for(str(second)).load_button.click()
    assert client.loads[-1][0] == str(second) and client.compiles[-1] is True
    # the next start of the app shows it ticked and loads compiled
    assert AppSettings.load(desk.settings_path).compile_layers is True
    again = CloverDeskApp(folder.parent, client=FakeEngineClient(loaded=False), store=ChatStore(tmp_path / "chats.db"),
                          hardware=Hardware(gpu_name=None, ram_total_bytes=32 * 1024**3), with_preview=False,
                          start_engine=False, style=False)
    try:
        assert again.model_library.compile_choice.isChecked()
        again.load_model()
        assert again.client.compiles == [True]
        again.model_library.compile_choice.click()
        again.load_model()
        assert again.client.compiles == [True, False] and again.settings.compile_layers is False
    finally:
        again.shutdown(wait_ms=0)
        again.window.close()


def test_a_model_left_uncompiled_is_said_so(qtbot, desk) -> None:  # noqa: ANN001
    reason = "torch.compile on the CPU needs a C++ compiler (g++, clang++ or MSVC's cl), and none was found"
    desk.window.engine_status.on_engine_loaded({"model_dir": "/models/tiny", "compile_skipped": reason})
    banner = desk.window.info_banner
    assert not banner.isHidden() and banner.label.text() == f"“Compile the layers” is on, but {reason}."


def test_a_model_without_the_cpu_kernels_is_said_to_run_slowly(qtbot, desk) -> None:  # noqa: ANN001
    missing = "no C compiler found (set CC or install gcc)"
    desk.window.engine_status.on_engine_loaded({"model_dir": "/models/tiny", "cpu_kernels_missing": missing})
    banner = desk.window.info_banner
    text = banner.label.text()
    assert not banner.isHidden() and "30x slower" in text and f"unavailable here: {missing}." in text
    # after another notice of the same load: both are kept
    reason = "torch.compile on the CPU needs a C++ compiler (g++, clang++ or MSVC's cl), and none was found"
    desk.window.engine_status.on_engine_loaded({"model_dir": "/models/tiny", "compile_skipped": reason,
                                                "cpu_kernels_missing": missing})
    text = banner.label.text()
    assert text.startswith(f"“Compile the layers” is on, but {reason}. This model runs about 30x slower")
    assert text.endswith("Install gcc, then load the model again.")
    banner.hide()
    desk.window.engine_status.on_engine_loaded({"model_dir": "/models/tiny", "cpu_kernels_missing": None})
    assert banner.isHidden()


def test_experimental_gpu_paths_are_chosen_here_and_restart_the_engine_at_the_next_load(
    qtbot, models, tmp_path, monkeypatch,  # noqa: ANN001
) -> None:
    from clover_desk.app import AppSettings, CloverDeskApp
    from clover_desk.engine.settings import OPT_IN, GpuPaths
    from clover_desk.storage.store import ChatStore

    folder, first, second = models
    # what `clover-desk gui` read where the app started (CLOVER_DESK_FUSED_INT8=1): shown until a choice is made
    started = GpuPaths(fused_int8=True)
    gpu = Hardware(gpu_name="NVIDIA GeForce RTX 4080", vram_total_bytes=16 * 1024**3, ram_total_bytes=64 * 1024**3)
    app = CloverDeskApp(folder.parent, client=FakeEngineClient(loaded=False), store=ChatStore(tmp_path / "c.db"),
                        settings=AppSettings(model_dir=str(first), device="cpu"), hardware=gpu, with_preview=False,
                        style=False, gpu_paths=started)
    try:
        library, client, window = app.model_library, app.client, app.window
        window.show()
        qtbot.waitUntil(lambda: len(client.loads) == 1, timeout=5000)  # the first load, with the inherited switch
        qtbot.waitUntil(lambda: window.engine_status.state.name == "READY", timeout=5000)
        assert client.started_env["CLOVER_DESK_FUSED_INT8"] == "1" and client.started_env["CLOVER_DESK_FUSED_MOE"] == "0"
        assert window.engine_status.gpu_label.text() == "NVIDIA GeForce RTX 4080 · 1 experimental path"
        window.show_models_page()
        button, actions = library.gpu_paths_button, library.gpu_paths_actions
        assert button.isEnabled() and button.text() == "GPU paths: 1 on" and list(actions) == list(OPT_IN)
        assert actions["CLOVER_DESK_FUSED_MOE"].text() == "Routed experts through the fused Triton MoE kernels " \
                                                          "(NF4 rows, GGUF blocks)"
        actions["CLOVER_DESK_FUSED_INT8"].trigger()  # off
        actions["CLOVER_DESK_FUSED_MOE"].trigger()
        actions["CLOVER_DESK_ZERO_COPY"].trigger()
        actions["CLOVER_DESK_DEVICE_POOL"].trigger()  # excludes zero-copy: that one goes off
        chosen = ["CLOVER_DESK_FUSED_MOE", "CLOVER_DESK_DEVICE_POOL"]
        assert library.gpu_paths() == chosen and button.text() == "GPU paths: 2 on"
        assert json.loads(app.settings_path.read_text())["gpu_paths"] == chosen
        assert client.restarts == 0 and len(client.loads) == 1 and library.reload_button.isVisible()  # not yet
        with qtbot.waitSignal(client.loaded, timeout=5000):
            library.row_for(str(second)).load_button.click()
        assert client.restarts == 1  # the worker reads the switches when it starts
        assert GpuPaths.from_env(client.started_env).opt_in() == chosen
        qtbot.waitUntil(lambda: window.engine_status.gpu_label.text() == "NVIDIA GeForce RTX 4080 · 2 experimental paths",
                        timeout=5000)
        with qtbot.waitSignal(client.loaded, timeout=5000):
            library.reload_button.click()  # nothing changed since: loaded again without a restart
        assert client.restarts == 1
    finally:
        app.shutdown(wait_ms=0)
        app.window.close()
    # the next start of the app: the choice, not the environment
    again = CloverDeskApp(folder.parent, client=FakeEngineClient(loaded=False), store=ChatStore(tmp_path / "d.db"),
                          hardware=gpu, with_preview=False, start_engine=False, style=False)
    try:
        assert again.model_library.gpu_paths() == chosen and again.client.env["CLOVER_DESK_FUSED_INT8"] == "0"
    finally:
        again.shutdown(wait_ms=0)
        again.window.close()


def test_gpu_paths_cannot_be_chosen_without_a_gpu_and_a_bad_choice_on_disk_is_dropped(
    qtbot, desk, tmp_path, caplog,  # noqa: ANN001
) -> None:
    from clover_desk.app import AppSettings

    button = desk.model_library.gpu_paths_button
    assert button.isVisibleTo(desk.model_library) and not button.isEnabled()
    assert button.toolTip() == "No CUDA GPU was found on this computer"
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"gpu_paths": ["CLOVER_DESK_ZERO_COPY", "CLOVER_DESK_DEVICE_POOL"]}))
    assert AppSettings.load(path).gpu_paths is None
    assert "exclude each other" in caplog.text
    path.write_text(json.dumps({"gpu_paths": ["CLOVER_DESK_FUSED_MOE"]}))
    assert AppSettings.load(path).gpu_paths == ["CLOVER_DESK_FUSED_MOE"]


def test_the_app_reads_no_switch_itself_it_is_handed_the_settings(qtbot, models, tmp_path, monkeypatch) -> None:  # noqa: ANN001, E501
    """The app never reads the GPU switches from its environment (`clover-desk gui` read them once and refuses both
    exclusive ones, tests/engine/test_settings.py): without the object it gives its worker the defaults, every switch
    written, so the environment it inherited cannot add a path either."""
    from clover_desk.app import AppSettings, CloverDeskApp
    from clover_desk.engine.settings import SWITCHES, GpuPaths
    from clover_desk.storage.store import ChatStore

    folder, first, _second = models
    monkeypatch.setenv("CLOVER_DESK_ZERO_COPY", "1")
    monkeypatch.setenv("CLOVER_DESK_DEVICE_POOL", "1")
    gpu = Hardware(gpu_name="NVIDIA GeForce RTX 4080", vram_total_bytes=16 * 1024**3, ram_total_bytes=64 * 1024**3)
    app = CloverDeskApp(folder.parent, client=FakeEngineClient(loaded=False), store=ChatStore(tmp_path / "c.db"),
                        settings=AppSettings(model_dir=str(first)), hardware=gpu, with_preview=False,
                        start_engine=False, style=False)
    try:
        library = app.model_library
        assert app.client.env == GpuPaths().to_env() and set(app.client.env) == set(SWITCHES)
        assert library.gpu_paths() == []
        library.gpu_paths_actions["CLOVER_DESK_ZERO_COPY"].trigger()
        assert GpuPaths.from_env(app.client.env) == GpuPaths(expert_fetch="zero_copy")
    finally:
        app.shutdown(wait_ms=0)
        app.window.close()
