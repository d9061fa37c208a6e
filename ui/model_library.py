"""The models page as a library: every model this app knows (the recent ones and what sits in the models folder),
the current one marked, each with its format and size on disk, and Load, Show in folder and Delete; above them,
the device, precision and compilation the next load uses.

What a model is made of is read without loading it (:func:`scan_entry`, stdlib + the engine's torch-free readers):
the safetensors headers' dtypes, a GGUF file's type, the quantized cache the engine keeps beside the weights
(``<model>/.clover-cache/``, or under the user's cache folder when the model's folder is read-only: the rule of
``engine.weights.quant_cache.cache_dir_for``). Scans and deletions run on a thread, which hands its result to the GUI thread
through a :class:`~ui.thread_bridge.ThreadBridge` (it never touches a Qt object); the GUI thread only paints.

Delete asks first, naming every folder or file it will remove and how much space that frees; the model loaded now
cannot be deleted (choose another one first).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import Qt, QUrl, Signal
from PySide6.QtGui import QAction, QDesktopServices
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFrame,
    QHBoxLayout,
    QLabel,
    QMenu,
    QMessageBox,
    QPushButton,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from clover_desk.engine.errors import CloverError
from clover_desk.engine.weights.formats import checkpoint_files, read_safetensors_header
from clover_desk.engine.weights.gguf.file import split_parts
from clover_desk.engine.weights.gguf.header import read_header
from clover_desk.ui.model_paths import library_paths
from clover_desk.ui.theme import set_style_class
from clover_desk.ui.thread_bridge import ThreadBridge
from clover_desk.ui.widgets import ElidedLabel, accessible, connect_each, named, push_button, spread_row, vbox

log = logging.getLogger(__name__)

CACHE_DIRNAME = ".clover-cache"  # = engine.weights.quant_cache.CACHE_DIRNAME (tests check they agree)
DEVICES = (("cpu", "CPU"), ("cuda", "GPU (CUDA)"))
PRECISIONS = (("float32", "float32"), ("bfloat16", "bfloat16"))
PRECISION_TOOLTIP = (
    "The precision the model computes in, and holds what is not 4-bit in: float32 is exact on any CPU; bfloat16 "
    "halves the memory of the unquantized weights"
)
QUANTIZED_TOOLTIP = (
    "Load a model folder through its quantized cache: experts in 4 bits (NF4), the other layers in 8 bits, about a "
    "quarter of the memory of bfloat16, and the CPU's fast kernels. The cache is built beside the model the first "
    "time (minutes for a large model) and reused after. Off: the weights as stored, in the chosen precision. A "
    "GGUF file is always read as its own quantized blocks."
)
QUANTIZED_GPU_TOOLTIP = "On the GPU the weights are always 4-bit: the VRAM plan places the quantized cache"
COMPILE_TOOLTIP = (
    "Compile the model's layers for faster decoding once it has loaded (AR decoding ran 3-5x faster on a CPU, "
    "measured on small models). The price is a warm-up while the model loads: two to three minutes on a CPU the "
    "first time, under a minute on later runs (the compiled code is kept on disk). Needs a C++ compiler for "
    "the CPU, or Triton for a GPU; without one the model loads uncompiled and the window says why."
)

GPU_PATHS_TOOLTIP = (
    "Faster code paths for an NVIDIA GPU that are not yet measured on one, so they are off unless chosen here. "
    "They change how the engine computes, not the model: each is tested against the standard path (within float "
    "rounding, the same greedy tokens on the test models). They do nothing on a CPU. Used from the next load: the "
    "engine restarts for them."
)

# ---------------------------------------------------------------------------------------------------------------
# What a model is made of (no Qt)
# ---------------------------------------------------------------------------------------------------------------


# the models-folder scan reads at most this much of a GGUF header, in at most this long (a real 150k-token vocabulary
# is a few MB, read in well under a second)
SCAN_HEADER_BYTES = 64 << 20
SCAN_SECONDS = 5.0

@dataclass(frozen=True)
class LibraryEntry:
    """One model as the library shows it."""

    path: str  # the model folder, or a GGUF file (the first part of a split set)
    name: str
    format: str  # "safetensors · BF16", "GGUF · Q4_K_M", or why it cannot be read
    weights_bytes: int
    cache_bytes: int  # its quantized caches
    removes: tuple[tuple[str, int], ...]  # (path, bytes) that Delete removes
    usable: bool = True

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.removes)


def size_text(nbytes: int) -> str:
    """"12.3 GB" (decimal, as disks are sold and the download page counts), "340 MB" below a gigabyte."""
    if nbytes >= 1e9:
        return f"{nbytes / 1e9:.1f} GB"
    if nbytes >= 1e6:
        return f"{nbytes / 1e6:.0f} MB"
    return f"{max(nbytes, 0) / 1e3:.0f} kB"


def tree_bytes(path: Path) -> int:
    """Bytes on disk under ``path`` (a file or a folder; links are not followed)."""
    try:
        if path.is_symlink() or path.is_file():
            return path.lstat().st_size
    except OSError:
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def external_cache_dir(model_dir: Path) -> Path:
    """Where the engine keeps a read-only model folder's quantized caches (one per policy hash below it): the rule of
    ``engine.weights.quant_cache.cache_dir_for`` without its torch import."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clover-desk" / "quant"
    return base / hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:16]


def scan_entry(path: str | Path) -> LibraryEntry:
    """The facts of one model (never raises: a model that cannot be read says why in ``format``)."""
    p = Path(path)
    name = p.name
    if p.suffix.lower() == ".gguf":
        return _gguf_entry(p)
    if not p.is_dir():
        return LibraryEntry(str(p), name, "missing: the folder is gone", 0, 0, (), usable=False)
    inside = p / CACHE_DIRNAME
    outside = external_cache_dir(p)
    cache_inside = tree_bytes(inside) if inside.is_dir() else 0
    cache_outside = tree_bytes(outside) if outside.is_dir() else 0
    folder = tree_bytes(p)
    removes = [(str(p), folder)] + ([(str(outside), cache_outside)] if cache_outside else [])
    return LibraryEntry(str(p), name, _safetensors_format(p), folder - cache_inside, cache_inside + cache_outside,
                        tuple(removes), usable=(p / "config.json").is_file())


def _safetensors_format(folder: Path) -> str:

    try:
        files, _ = checkpoint_files(folder)
        by_dtype: dict[str, int] = {}
        for file in files:
            entries, _raw = read_safetensors_header(file)
            for entry in entries.values():
                by_dtype[entry.dtype] = by_dtype.get(entry.dtype, 0) + entry.nbytes
    except (CloverError, OSError) as exc:
        return f"unreadable weights ({exc})" if (folder / "config.json").is_file() else "no model here"
    if not by_dtype:
        return "safetensors (empty)"
    total = sum(by_dtype.values())
    main = [d for d, n in sorted(by_dtype.items(), key=lambda kv: -kv[1]) if n >= 0.05 * total]
    return "safetensors · " + " + ".join(main)


def _gguf_entry(path: Path) -> LibraryEntry:

    try:
        parts = split_parts(path)
    except CloverError as exc:
        return LibraryEntry(str(path), path.name, f"GGUF, incomplete ({exc})", 0, 0, (), usable=False)
    removes = tuple((str(part), tree_bytes(part)) for part in parts)
    size = sum(n for _, n in removes)
    try:
        kind = gguf_type(path)
    except CloverError as exc:  # listed, as damaged (it can still be deleted), never loaded
        why = str(exc).removeprefix(f"{path}: ")
        return LibraryEntry(str(path), path.name, f"GGUF, damaged: {why}", size, 0, removes, usable=False)
    except OSError as exc:
        return LibraryEntry(str(path), path.name, f"GGUF, unreadable ({exc.strerror})", size, 0, removes,
                            usable=False)
    return LibraryEntry(str(path), path.name, f"GGUF · {kind}", size, 0, removes)


def gguf_type(path: Path) -> str:
    """The file's quantization as llama.cpp names it ("Q4_K_M"), from ``general.file_type``; else the type most of
    its bytes are stored in. The header is read with the bounded reader, at most :data:`SCAN_HEADER_BYTES` of it
    within :data:`SCAN_SECONDS`: a damaged or hostile file is a CloverError (the scan lists it as damaged), never a
    stall."""
    import gguf  # the names of llama.cpp's types (numpy comes with it: imported when a GGUF file is listed)

    header = read_header(path, keep_arrays=False, max_header_bytes=SCAN_HEADER_BYTES, deadline_s=SCAN_SECONDS)
    file_type = header.metadata.get("general.file_type")
    if isinstance(file_type, int) and not isinstance(file_type, bool):
        try:
            return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
        except ValueError:
            log.info("%s: general.file_type %d is not a llama.cpp file type", path, file_type)
    by_type: dict[str, int] = {}
    for tensor in header.tensors:
        kind = gguf.GGMLQuantizationType(tensor.qtype).name
        by_type[kind] = by_type.get(kind, 0) + tensor.nbytes
    return max(by_type, key=by_type.__getitem__) if by_type else "unknown type"


def delete_entry(entry: LibraryEntry) -> None:
    """Remove what ``entry.removes`` names (folders whole, files one by one)."""
    for path, _size in entry.removes:
        p = Path(path)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


# ---------------------------------------------------------------------------------------------------------------
# The widget
# ---------------------------------------------------------------------------------------------------------------


class _Job:
    """Runs one function on a Python thread; ``done(result, exception or None)`` is called on the GUI thread through
    the bridge (never once the bridge's owner is gone). Plain Python: the thread touches no Qt object."""

    def __init__(self, bridge: ThreadBridge, fn: Callable[[], object], done: Callable[[object, object], None]) -> None:
        self._fn = fn
        self._post = functools.partial(bridge.post, done)
        self.thread = bridge.spawn(self._run, name="model-library")

    def _run(self) -> None:
        try:
            result = self._fn()
        except OSError as exc:
            self._post(None, exc)
            return
        self._post(result, None)


class ModelRow(QFrame):
    """One model: name (and "current"), format and sizes, path, and its actions."""

    def __init__(self, entry: LibraryEntry, current: bool, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.entry = entry
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground, True)
        set_style_class(self, "card", "currentModel" if current else "")
        self.name_label = QLabel(entry.name)
        set_style_class(self.name_label, "convTitle")
        self.badge = QLabel("current" if current else "")
        set_style_class(self.badge, "okText")
        self.badge.setVisible(current)
        facts = entry.format
        if entry.weights_bytes:
            facts += f" · {size_text(entry.weights_bytes)}"
        if entry.cache_bytes:
            facts += f" · quantized cache {size_text(entry.cache_bytes)}"
        self.facts_label = QLabel(facts)
        set_style_class(self.facts_label, "muted")
        self.facts_label.setWordWrap(True)
        self.path_label = ElidedLabel(entry.path, "faint")
        self.load_button = QPushButton("Load")
        self.reveal_button = QPushButton("Show in folder")
        self.delete_button = QPushButton("Delete…")
        for button, tip, name in (
            (self.load_button, "Load this model", f"Load {entry.name}"),
            (self.reveal_button, "Open its folder in the file manager", f"Show {entry.name} in its folder"),
            (self.delete_button, "Remove it from the disk (asks first)", f"Delete {entry.name}"),
        ):
            set_style_class(button, "ghost")
            button.setToolTip(tip)
            accessible(button, name)
        self.load_button.setEnabled(entry.usable)
        self.delete_button.setEnabled(bool(entry.removes))
        self.load_button.setVisible(not current)  # in use: nothing to load, and never deleted from under the engine
        self.delete_button.setVisible(not current)
        top = QHBoxLayout()
        top.addWidget(self.name_label)
        top.addSpacing(8)
        top.addWidget(self.badge)
        top.addStretch(1)
        for button in (self.load_button, self.reveal_button, self.delete_button):
            top.addWidget(button)
        vbox(top, self.facts_label, self.path_label, margins=(12, 8, 8, 8), spacing=2, parent=self)
        accessible(self, f"Model {entry.name}" + (" (current)" if current else ""))


class ModelLibrary(QFrame):
    """The models this app knows, with Load / Show in folder / Delete, and the device, precision, compilation and
    experimental GPU paths of the next load."""

    loadRequested = Signal(str)  # load this model (a folder or a GGUF file)
    deleted = Signal(str)  # this model was removed from the disk
    loadOptionsChanged = Signal(str, str, bool, bool)  # (device, dtype, compile the layers, 4-bit weights on the CPU)
    gpuPathsChanged = Signal(list)  # the experimental GPU paths (switch names) chosen for the next load
    reloadRequested = Signal()  # load the current model again now (with the new options)
    scanned = Signal()  # the list was refreshed

    def __init__(
        self,
        models_dir: Path,
        recent: Callable[[], Sequence[str]] = list,
        *,
        gpu_name: str | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        compile_layers: bool = False,
        quantized: bool = True,
        gpu_paths: Mapping[str, str] | None = None,
        exclusive: Sequence[str] = (),
        gpu_paths_on: Sequence[str] = (),
        parent: QWidget | None = None,
    ) -> None:
        """``quantized``: a model folder on the CPU loads through its quantized cache (a GPU load always does, under
        the VRAM plan). ``gpu_paths``: the experimental GPU paths offered (switch name -> what it turns on), ``exclusive`` the
        ones of which at most one may be on, ``gpu_paths_on`` those on now."""
        super().__init__(parent)
        self.setObjectName("modelLibrary")
        self.models_dir = Path(models_dir)
        self._recent = recent
        self.current: str | None = None
        self.entries: list[LibraryEntry] = []
        self.rows: list[ModelRow] = []
        self.confirm_box: QMessageBox | None = None
        self._job: _Job | None = None
        self._again = False
        self.bridge = ThreadBridge(self)
        title = QLabel("Your models")
        set_style_class(title, "title")
        self.refresh_button = push_button("Refresh", style="ghost", name="Refresh the list of models",
                                          clicked=self.refresh)
        self.device_choice = QComboBox()
        self.device_choice.setObjectName("deviceChoice")
        for value, label in DEVICES:
            self.device_choice.addItem(label if value == "cpu" or not gpu_name else f"{label}: {gpu_name}", value)
        if not gpu_name:  # no GPU found: CUDA cannot be chosen
            self.device_choice.model().item(1).setEnabled(False)  # type: ignore[attr-defined]
            self.device_choice.setItemData(1, "No CUDA GPU was found on this computer", Qt.ItemDataRole.ToolTipRole)
        accessible(self.device_choice, "Device the model runs on")
        self.dtype_choice = QComboBox()
        self.dtype_choice.setObjectName("precisionChoice")
        for value, label in PRECISIONS:
            self.dtype_choice.addItem(label, value)
        self.dtype_choice.setToolTip(PRECISION_TOOLTIP)
        accessible(self.dtype_choice, "Precision of the weights")
        self.quantized_choice = named(QCheckBox("4-bit weights"), "quantizedChoice",
                                      "Load a model folder through its 4-bit quantized cache")
        self._quantized_on_cpu = bool(quantized)  # the CPU's choice (a GPU load is always quantized)
        self.compile_choice = named(
            QCheckBox("Compile the layers"), "compileChoice", "Compile the model's layers when it loads",
        )
        self.compile_choice.setToolTip(COMPILE_TOOLTIP)
        self.gpu_paths_button = QToolButton()
        self.gpu_paths_button.setObjectName("gpuPathsChoice")
        self.gpu_paths_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        self.gpu_paths_menu = QMenu(self.gpu_paths_button)
        self.gpu_paths_actions: dict[str, QAction] = {}
        self._exclusive = tuple(exclusive)
        for name, what in (gpu_paths or {}).items():
            action = self.gpu_paths_menu.addAction(what[:1].upper() + what[1:])
            action.setCheckable(True)
            action.setToolTip(f"{name}=1 (not yet measured on a GPU)")
            action.setData(name)
            action.toggled.connect(functools.partial(self.on_gpu_path_toggled, name))
            self.gpu_paths_actions[name] = action
        self.gpu_paths_menu.setToolTipsVisible(True)
        self.gpu_paths_button.setMenu(self.gpu_paths_menu)
        self.gpu_paths_button.setVisible(bool(self.gpu_paths_actions))
        self.gpu_paths_button.setEnabled(bool(gpu_name))
        self.gpu_paths_button.setToolTip(GPU_PATHS_TOOLTIP if gpu_name else "No CUDA GPU was found on this computer")
        accessible(self.gpu_paths_button, "Experimental GPU paths")
        self.set_gpu_paths(gpu_paths_on)
        self.options_note = QLabel("Used the next time a model loads.")
        set_style_class(self.options_note, "muted")
        self.reload_button = push_button("Reload now", "reloadWithOptions", style="ghost",
                                         name="Reload the current model with these settings",
                                         clicked=self.on_reload_clicked)
        self.reload_button.setVisible(False)
        self.status = QLabel()
        self.status.setObjectName("libraryStatus")
        set_style_class(self.status, "muted")
        self.status.setWordWrap(True)
        self.empty = QLabel("No models yet: open, download or create one below.")
        set_style_class(self.empty, "muted")
        options = QHBoxLayout()
        options.addWidget(QLabel("Device"))
        options.addWidget(self.device_choice)
        options.addSpacing(12)
        options.addWidget(QLabel("Precision"))
        options.addWidget(self.dtype_choice)
        options.addSpacing(12)
        options.addWidget(self.quantized_choice)
        options.addSpacing(12)
        options.addWidget(self.compile_choice)
        options.addSpacing(12)
        options.addWidget(self.gpu_paths_button)
        options.addStretch(1)
        note = QHBoxLayout()  # a line of its own: the options row stays narrow enough for a 1280-pixel window
        note.addWidget(self.options_note, 1)
        note.addWidget(self.reload_button)
        self.rows_layout = QVBoxLayout()
        self.rows_layout.setSpacing(6)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(10, 10, 10, 4)
        layout.addLayout(spread_row(title, self.refresh_button))
        layout.addLayout(options)
        layout.addLayout(note)
        layout.addWidget(self.status)
        layout.addWidget(self.empty)
        layout.addLayout(self.rows_layout)
        self.set_load_options(device, dtype, compile_layers, quantized)
        self._connect_signals()

    def _connect_signals(self) -> None:
        connect_each(self.on_options_changed, self.device_choice.currentIndexChanged,
                     self.dtype_choice.currentIndexChanged, self.compile_choice.toggled, self.quantized_choice.toggled)

    # ---- public API ----------------------------------------------------------------------------------------

    def set_load_options(self, device: str, dtype: str, compile_layers: bool = False, quantized: bool = True) -> None:
        """Show the options the next load uses (no ``loadOptionsChanged``: not a user edit)."""
        for combo, value in ((self.device_choice, device), (self.dtype_choice, dtype)):
            combo.blockSignals(True)
            combo.setCurrentIndex(max(0, combo.findData(value)))
            combo.blockSignals(False)
        self.compile_choice.blockSignals(True)
        self.compile_choice.setChecked(bool(compile_layers))
        self.compile_choice.blockSignals(False)
        self._quantized_on_cpu = bool(quantized)
        self._show_quantized()

    def _show_quantized(self) -> None:
        """The 4-bit box says what the chosen device loads: the CPU's choice, or ticked and fixed on the GPU (whose
        VRAM plan always places the quantized cache)."""
        box, gpu = self.quantized_choice, self.device_choice.currentData() == "cuda"
        box.blockSignals(True)
        box.setChecked(True if gpu else self._quantized_on_cpu)
        box.blockSignals(False)
        box.setEnabled(not gpu)
        box.setToolTip(QUANTIZED_GPU_TOOLTIP if gpu else QUANTIZED_TOOLTIP)

    def set_gpu_paths(self, on: Sequence[str]) -> None:
        """Show these experimental GPU paths as chosen (no ``gpuPathsChanged``: not a user edit)."""
        for name, action in self.gpu_paths_actions.items():
            action.blockSignals(True)
            action.setChecked(name in on)
            action.blockSignals(False)
        self._label_gpu_paths()

    def gpu_paths(self) -> list[str]:
        """The experimental GPU paths chosen for the next load (switch names, in the offered order)."""
        return [name for name, action in self.gpu_paths_actions.items() if action.isChecked()]

    def on_gpu_path_toggled(self, name: str, checked: bool) -> None:
        if checked and name in self._exclusive:  # at most one of them: choosing one clears the others
            for other in self._exclusive:
                if other != name and other in self.gpu_paths_actions:
                    self.gpu_paths_actions[other].blockSignals(True)
                    self.gpu_paths_actions[other].setChecked(False)
                    self.gpu_paths_actions[other].blockSignals(False)
        self._label_gpu_paths()
        self.reload_button.setVisible(self.current is not None)
        self.gpuPathsChanged.emit(self.gpu_paths())

    def _label_gpu_paths(self) -> None:
        n = len(self.gpu_paths())
        self.gpu_paths_button.setText(f"GPU paths: {n} on" if n else "GPU paths: standard")

    def load_options(self) -> tuple[str, str, bool, bool]:
        """(device, dtype, compile the layers, a model folder on the CPU through its quantized cache) of the next
        load."""
        return (str(self.device_choice.currentData()), str(self.dtype_choice.currentData()),
                self.compile_choice.isChecked(), self._quantized_on_cpu)

    def set_current(self, path: str | None) -> None:
        """The model in use (marked; it cannot be deleted)."""
        self.current = path
        self.refresh()

    def refresh(self) -> None:
        """Scan the models again (on a thread; ``scanned`` follows)."""
        if self._job is not None:
            self._again = True
            return
        models_dir, recent = self.models_dir, list(self._recent())
        self._job = _Job(self.bridge, lambda: [scan_entry(p) for p in library_paths(models_dir, recent)],
                         self.on_scanned)

    def row_for(self, path: str) -> ModelRow | None:
        return next((r for r in self.rows if _same(r.entry.path, path)), None)

    def ask_delete(self, entry: LibraryEntry) -> QMessageBox:
        """Open the confirmation (window-modal); Delete removes the files once it is accepted."""
        lines = "".join(f"<li>{_escape(path)} ({size_text(size)})</li>" for path, size in entry.removes)
        weights = f"its weights ({_escape(entry.format)}, {size_text(entry.weights_bytes)})"
        cache = f" and its quantized cache ({size_text(entry.cache_bytes)})" if entry.cache_bytes else ""
        box = QMessageBox(QMessageBox.Icon.Warning, "Delete model",
                          f"<p><b>Delete {_escape(entry.name)}?</b></p>"
                          f"<p>This removes {weights}{cache} from the disk:</p><ul>{lines}</ul>"
                          f"<p><b>{size_text(entry.total_bytes)}</b> freed. This cannot be undone.</p>",
                          QMessageBox.StandardButton.Cancel, self)
        box.setObjectName("deleteModelBox")
        delete = box.addButton(f"Delete {size_text(entry.total_bytes)}", QMessageBox.ButtonRole.DestructiveRole)
        delete.setObjectName("confirmDelete")
        accessible(delete, f"Delete {entry.name}")
        box.setDefaultButton(QMessageBox.StandardButton.Cancel)
        box.buttonClicked.connect(lambda button: self._delete_now(entry) if button is delete else None)
        self.confirm_box = box
        box.open()
        return box

    # ---- slots ---------------------------------------------------------------------------------------------

    def on_scanned(self, entries: object, error: object) -> None:
        self._release_job()
        if error is not None:
            self.status.setText(f"Could not read the models folder: {_escape(str(error))}")
        self._show(list(entries) if isinstance(entries, list) else [])
        self.scanned.emit()
        if self._again:
            self._again = False
            self.refresh()

    def on_reload_clicked(self) -> None:
        """The options are being applied: nothing is left to reload (the button showed after the reload)."""
        self.reload_button.setVisible(False)
        self.reloadRequested.emit()

    def on_options_changed(self, *_args: object) -> None:
        if self.quantized_choice.isEnabled():  # (on the GPU the box shows the plan's 4 bits, not the CPU's choice)
            self._quantized_on_cpu = self.quantized_choice.isChecked()
        self._show_quantized()
        device, dtype, compile_layers, quantized = self.load_options()
        self.reload_button.setVisible(self.current is not None)
        self.loadOptionsChanged.emit(device, dtype, compile_layers, quantized)

    def on_reveal(self, entry: LibraryEntry) -> None:
        target = Path(entry.path)
        folder = target.parent if target.suffix.lower() == ".gguf" else target
        if not QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder))):
            self.status.setText(f"Could not open {_escape(str(folder))} in the file manager.")

    def on_deleted(self, entry: LibraryEntry, error: object) -> None:
        self._release_job()
        if error is not None:
            self.status.setText(f"<b>Not deleted:</b> {_escape(str(error))}")
        else:
            self.status.setText(f"Deleted {_escape(entry.name)}: {size_text(entry.total_bytes)} freed.")
            self.deleted.emit(entry.path)
        self.refresh()

    # ---- internals -----------------------------------------------------------------------------------------

    def _release_job(self) -> None:
        self._job = None

    def _delete_now(self, entry: LibraryEntry) -> None:
        self.confirm_box = None
        if self.current is not None and _same(entry.path, self.current):
            return  # (its button is disabled; a model in use is never deleted)
        self.status.setText(f"Deleting {_escape(entry.name)}…")
        self._job = _Job(self.bridge, lambda: delete_entry(entry),
                         lambda _result, error: self.on_deleted(entry, error))

    def _show(self, entries: list[LibraryEntry]) -> None:
        for row in self.rows:
            row.setParent(None)
            row.deleteLater()
        self.rows = []
        self.entries = entries
        for entry in entries:
            row = ModelRow(entry, self.current is not None and _same(entry.path, self.current))
            row.load_button.clicked.connect(lambda _=False, p=entry.path: self.loadRequested.emit(p))
            row.reveal_button.clicked.connect(lambda _=False, e=entry: self.on_reveal(e))
            row.delete_button.clicked.connect(lambda _=False, e=entry: self.ask_delete(e))
            self.rows_layout.addWidget(row)
            self.rows.append(row)
        self.empty.setVisible(not entries)


def _same(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
