"""The model manager: the first page when no model is configured. Open a folder, download Clover, or make a demo.

Three ways to a model, each ending in :attr:`ModelManagerPanel.modelChosen` with a folder or a GGUF file that passed
:func:`check_model_path` (a folder: config.json readable, ``model_type`` supported, safetensors weights present; a
GGUF file: the GGUF magic, every part of a split set present):

* **Open folder…** / **Open GGUF file…**: a local folder in the Hugging Face layout, or a ``.gguf`` file (any part
  of a split set opens the set at its first part);
* **Download**: a Hub repository (default ``Diffuspace/Clover-35B-A3B-Preview``) into a folder, or one of the
  official GGUF files (only that file), on a worker thread, with bytes, speed and time left, Cancel, and Resume
  (the partial bytes are kept across restarts);
* **Create demo model**: runs ``clover-desk make-tiny DIR`` in a child process (QProcess: the UI never imports
  torch). The demo model has random weights: it runs the whole pipeline, and what it writes is noise.

Dependencies are passed in by the composition root (ui never imports clover_desk): ``downloader_factory`` (the
service that downloads: ``clover_desk.downloads.ModelDownloader``; without one, Download says it is unavailable),
``models_dir`` (where downloads and the demo go by default), ``recent_file`` (a JSON list of recent models; in memory
only when None), and ``gguf_choices`` / ``gguf_repo_id`` (the GGUF files offered for download:
``clover_desk.downloads.OFFICIAL_GGUF``, each with ``quant``, ``size`` and ``label``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from PySide6.QtCore import QProcess, QStandardPaths, Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from clover_desk.engine.errors import CancelledError, CloverError
from clover_desk.engine.model.config import SUPPORTED_MODEL_TYPES, load_config
from clover_desk.engine.weights.gguf.file import split_parts  # file names only (no numpy, no gguf package)
from clover_desk.ui.download_fit import ChoiceFit, RunFitLike, best_choice, choice_fits, existing_parent, free_bytes
from clover_desk.ui.thread_bridge import ThreadBridge
from clover_desk.ui.widgets import WrapLabel, push_button

log = logging.getLogger(__name__)

DEFAULT_REPO_ID = "Diffuspace/Clover-35B-A3B-Preview"
DEFAULT_GGUF_REPO_ID = "Diffuspace/Clover-35B-A3B-Preview-GGUF"
GGUF_MAGIC = b"GGUF"
DEMO_FOLDER_NAME = "clover-tiny-demo"
PARTIAL_STATE_DIR = ".clover-download"  # = clover_desk.downloads.STATE_DIR: partial bytes live there
MAX_RECENT = 10


def free_folder(parent: Path, name: str) -> Path:
    """``parent / name``, or with the first free ``-2``, ``-3``… suffix when that exists: a second demo model is a
    new folder, never written over the first (which may be loaded, or chatted with)."""
    candidate, n = parent / name, 1
    while candidate.exists():
        n += 1
        candidate = parent / f"{name}-{n}"
    return candidate


# ---------------------------------------------------------------------------------------------------------------
# Checking a folder (no Qt)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelCheck:
    ok: bool
    message: str  # what is wrong, or a one-line description of the model
    model_type: str | None = None


def check_model_dir(path: str | Path) -> ModelCheck:
    """Can the engine load this folder? Reads config.json only (stdlib): never loads weights."""
    folder = Path(path)
    if not folder.is_dir():
        return ModelCheck(False, f"{folder} is not a folder")
    if not (folder / "config.json").is_file():
        gguf = sorted(p.name for p in folder.glob("*.gguf"))
        if gguf:
            return ModelCheck(False, f"{folder.name} holds GGUF files ({gguf[0]}…): open the .gguf file itself "
                                     "(Open GGUF file…)")
        return ModelCheck(False, f"{folder} has no config.json: choose the folder that holds the model's "
                                 "config.json and *.safetensors files")
    try:
        config = load_config(folder)
    except CloverError as exc:
        return ModelCheck(False, str(exc))
    has_weights = (folder / "model.safetensors.index.json").is_file() or any(folder.glob("*.safetensors"))
    if not has_weights:
        return ModelCheck(False, f"{folder} has a config.json but no *.safetensors weights", config.model_type)
    kind = "block diffusion" if config.is_diffusion else "autoregressive"
    return ModelCheck(True, f"{config.model_type} ({kind}), {config.num_hidden_layers} layers, "
                            f"{config.num_experts} experts", config.model_type)


def check_gguf_file(path: str | Path) -> ModelCheck:
    """Can the engine open this GGUF file? Its magic and its split set's parts (stdlib: the tensors are read at load,
    where the layout decides whether block diffusion is available)."""
    file = Path(path)
    if not file.is_file():
        return ModelCheck(False, f"{file} is not a file")
    try:
        parts = split_parts(file)
        for part in parts:
            with part.open("rb") as f:
                if f.read(4) != GGUF_MAGIC:
                    return ModelCheck(False, f"{part.name} is not a GGUF file (it does not start with the GGUF magic)")
    except CloverError as exc:  # a part of the split set is missing
        return ModelCheck(False, str(exc))
    except OSError as exc:
        return ModelCheck(False, f"cannot read {file}: {exc.strerror or exc}")
    size = sum(p.stat().st_size for p in parts)
    split = f", {len(parts)} parts" if len(parts) > 1 else ""
    return ModelCheck(True, f"GGUF file, {size / 1e9:.1f} GB{split}", "gguf")


def check_model_path(path: str | Path) -> ModelCheck:
    """A model folder (:func:`check_model_dir`) or a ``.gguf`` file (:func:`check_gguf_file`)."""
    target = Path(path)
    if target.suffix.lower() == ".gguf" and not target.is_dir():
        return check_gguf_file(target)
    return check_model_dir(target)


def model_path(path: str | Path) -> Path:
    """The path a model is remembered and loaded by: absolute; a split GGUF set by its first part."""
    target = Path(path).absolute()
    if target.suffix.lower() == ".gguf":
        try:
            return split_parts(target)[0]
        except CloverError:
            return target
    return target


def free_space_text(folder: str | Path) -> str:
    target = existing_parent(folder)
    try:
        free = shutil.disk_usage(target).free
    except OSError as exc:
        return f"free space unknown ({exc.strerror or exc})"
    return f"{free / 1e9:.1f} GB free on {target}"


def progress_text(done: int, total: int, speed_bps: float, eta_s: float | None) -> str:
    parts = [f"{done / 1e9:.2f} of {total / 1e9:.2f} GB"]
    if speed_bps > 0:
        parts.append(f"{speed_bps / 1e6:.1f} MB/s")
    if eta_s is not None:
        minutes, seconds = divmod(int(eta_s + 0.5), 60)
        hours, minutes = divmod(minutes, 60)
        parts.append(f"{hours} h {minutes:02d} min left" if hours else f"{minutes} min {seconds:02d} s left")
    return " · ".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# The download worker
# ---------------------------------------------------------------------------------------------------------------


class Downloader(Protocol):
    """What the panel needs of ``clover_desk.downloads.ModelDownloader``."""

    def run(self) -> Path: ...


DownloaderFactory = Callable[..., Downloader]  # (target_dir, repo_id, *, progress, cancel) -> Downloader
FitEstimator = Callable[[Any], RunFitLike]  # a choice (None: the safetensors folder) -> how it would run here


class GgufChoiceLike(Protocol):
    """One GGUF file offered for download (``clover_desk.downloads.GgufChoice``)."""

    quant: str
    size: int | None

    @property
    def label(self) -> str: ...


class _DownloadJob:
    """Runs one download on a Python thread; its end (``finished(folder)`` or ``failed(message, cancelled)``) is
    called on the GUI thread through the panel's bridge, after the progress the download reported before it (that
    goes through the same bridge, see ``ModelManagerPanel.start_download``). Plain Python: no thread touches a Qt
    object, so a panel deleted mid-download cannot crash the app."""

    def __init__(self, downloader: Downloader, cancel: threading.Event, bridge: ThreadBridge,
                 finished: Callable[[str], None], failed: Callable[[str, bool], None]) -> None:
        self._downloader = downloader
        self.cancel = cancel
        self._bridge = bridge
        self._finished = functools.partial(bridge.post, finished)
        self._failed = functools.partial(bridge.post, failed)
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = self._bridge.spawn(self._run, name="model-download")

    def _run(self) -> None:
        try:
            folder = self._downloader.run()
        except CancelledError as exc:
            self._failed(str(exc), True)
        except CloverError as exc:
            self._failed(str(exc), False)
        except Exception as exc:  # noqa: BLE001 - a worker must report, never die silently
            log.exception("download failed")
            self._failed(f"download failed: {exc}", False)
        else:
            self._finished(str(folder))


# ---------------------------------------------------------------------------------------------------------------
# The panel
# ---------------------------------------------------------------------------------------------------------------


class DemoPanelLike(Protocol):
    """What :class:`DemoModelMaker` uses of its panel (:class:`ModelManagerPanel`)."""

    models_dir: Path
    demoEnded: Any  # noqa: N815 - a Qt signal: (ok, message or the folder)

    def choose(self, folder: str) -> None: ...


class DemoModelMaker:
    """The "Demo model" box of :class:`ModelManagerPanel`: ``clover-desk make-tiny`` in a child process, into a free
    folder of the models folder; a model that passes its check is chosen."""

    def __init__(self, panel: DemoPanelLike, python: str) -> None:
        self.panel = panel
        self.python = python
        self.process: QProcess | None = None
        self.folder: Path | None = None
        self.output: list[str] = []
        self.button = QPushButton("Create demo model")
        self.button.setAccessibleName("Create a demo model")
        self.status = WrapLabel("A tiny model with random weights (a few MB, made on this computer in seconds). It "
                                "exercises the whole app, but its output is random noise, not language.")
        self.box = QGroupBox("Demo model")
        layout = QVBoxLayout(self.box)
        layout.addWidget(self.button, 0, Qt.AlignmentFlag.AlignLeft)
        layout.addWidget(self.status)
        self.button.clicked.connect(self.on_clicked)

    def on_clicked(self) -> None:
        self.create()

    def create(self, folder: str | Path | None = None) -> None:
        if self.process is not None:
            return
        self.folder = Path(folder) if folder else free_folder(self.panel.models_dir, DEMO_FOLDER_NAME)
        self.output = []
        process = QProcess(self.box)
        process.setProgram(self.python)
        process.setArguments(["-m", "clover_desk.cli.main", "make-tiny", str(self.folder)])
        process.setProcessChannelMode(QProcess.ProcessChannelMode.MergedChannels)
        process.readyReadStandardOutput.connect(self.on_output)
        process.finished.connect(self.on_finished)
        process.errorOccurred.connect(self.on_error)
        self.process = process
        self.button.setEnabled(False)
        self.status.setText(f"Creating a demo model in {_escape(str(self.folder))}…")
        process.start()

    def shutdown(self, timeout_s: float) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.waitForFinished(int(timeout_s * 1000))

    def on_output(self) -> None:
        if self.process is not None:
            self.output.append(bytes(self.process.readAllStandardOutput().data()).decode(errors="replace"))

    def _ended(self, ok: bool, message: str) -> None:
        self.status.setText(_escape(message))
        self.panel.demoEnded.emit(ok, message)

    def on_finished(self, exit_code: int, exit_status: QProcess.ExitStatus) -> None:
        self.on_output()
        self.process = None
        self.button.setEnabled(True)
        output = "".join(self.output).strip()
        folder = self.folder
        if exit_status != QProcess.ExitStatus.NormalExit or exit_code != 0 or folder is None:
            last = output.splitlines()[-1] if output else f"exit code {exit_code}"
            self._ended(False, f"Could not create the demo model: {last}")
            return
        check = check_model_dir(folder)
        if not check.ok:
            self._ended(False, f"The demo model is not usable: {check.message}")
            return
        self.status.setText(_escape(f"Demo model ready in {folder}. Remember: its weights are random, so its output "
                                    "is random noise; it shows how the app works, not what Clover can do."))
        self.panel.demoEnded.emit(True, str(folder))
        self.panel.choose(str(folder))

    def on_error(self, error: QProcess.ProcessError) -> None:
        if error == QProcess.ProcessError.FailedToStart and self.process is not None:
            self.process = None
            self.button.setEnabled(True)
            self._ended(False, f"Could not start {self.python}: {error.name}")


class ModelManagerPanel(QWidget):
    """Choose, download or create the model. Emits :attr:`modelChosen` with a folder that passed the check."""

    # A model folder or GGUF file the user chose (opened, downloaded, created, or picked from the recent list); it
    # passed check_model_path.
    modelChosen = Signal(str)
    # Download progress snapshot (clover_desk.downloads.DownloadProgress), on the GUI thread.
    downloadProgress = Signal(object)
    # The download ended: (ok, message). ok False covers errors and cancel.
    downloadEnded = Signal(bool, str)
    # The demo model process ended: (ok, message).
    demoEnded = Signal(bool, str)
    # The recent list changed (most recent first).
    recentModelsChanged = Signal(list)

    def __init__(
        self,
        parent: QWidget | None = None,
        *,
        downloader_factory: DownloaderFactory | None = None,
        models_dir: str | Path | None = None,
        recent_file: str | Path | None = None,
        python: str = sys.executable,
        default_repo_id: str = DEFAULT_REPO_ID,
        gguf_choices: Sequence[GgufChoiceLike] = (),
        gguf_repo_id: str = DEFAULT_GGUF_REPO_ID,
        fit_estimator: FitEstimator | None = None,
    ) -> None:
        super().__init__(parent)
        self._factory = downloader_factory
        self._fit_estimator = fit_estimator
        self._default_repo_id = default_repo_id
        self._gguf_repo_id = gguf_repo_id
        if models_dir is None:
            base = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.AppLocalDataLocation)
            models_dir = Path(base or Path.home() / ".clover-desk") / "models"
        self.models_dir = Path(models_dir)
        self._recent_file = Path(recent_file) if recent_file else None
        self._job: _DownloadJob | None = None
        # Progress snapshots come from the downloader's threads (huggingface_hub's workers among them, which can
        # still report after the job ended), the job's end from its thread: they only ever post to this bridge,
        # drained on the GUI thread in order, so no thread can reach a Qt object that was already deleted.
        self.bridge = ThreadBridge(self)
        self._recent: list[str] = []

        title = WrapLabel("<h2>Choose a model</h2>Clover Desk needs a model folder (Hugging Face layout: config.json "
                          "and *.safetensors) or a GGUF file. Open one you have, download Clover, or make a demo model "
                          "to try the app.")

        # --- open ---
        self.open_button = push_button("Open folder…", clicked=self.on_open_clicked)
        self.open_gguf_button = push_button("Open GGUF file…", "openGgufButton", clicked=self.on_open_gguf_clicked,
                                            tip="A .gguf file (for a split set, any of its parts)")
        self.open_status = WrapLabel()
        self.open_status.setObjectName("openStatus")
        open_box = QGroupBox("A model on this computer")
        open_layout = QVBoxLayout(open_box)
        open_row = QHBoxLayout()
        open_row.addWidget(self.open_button)
        open_row.addWidget(self.open_gguf_button)
        open_row.addStretch(1)
        open_layout.addLayout(open_row)
        open_layout.addWidget(self.open_status)

        # --- download ---
        self.download_choice = QComboBox()
        self.download_choice.setObjectName("downloadChoice")
        self.download_choice.addItem("Safetensors model folder (BF16, about 69 GB)", None)
        for choice in gguf_choices:
            self.download_choice.addItem(f"{choice.label}: that file only", choice)
        self.repo_edit = QLineEdit(default_repo_id)
        self.repo_edit.setPlaceholderText("owner/name")
        self.target_edit = QLineEdit(str(self.models_dir / default_repo_id.split("/")[-1]))
        self.browse_button = push_button("Browse…", clicked=self.on_browse_clicked)
        self.free_label = QLabel()
        self.fit_label = WrapLabel()  # the chosen item's fit: the card (or RAM) and the disk, with the figures
        self.fit_label.setObjectName("downloadFit")
        self._choice_names = [self.download_choice.itemText(i) for i in range(self.download_choice.count())]
        self.download_button = push_button("Download", clicked=self.on_download_clicked)
        self.cancel_button = push_button("Cancel", clicked=self.on_cancel_clicked)
        self.resume_button = push_button("Resume", clicked=self.on_download_clicked)
        self.progress_bar = QProgressBar()
        self.progress_bar.setRange(0, 1000)
        self.progress_bar.setValue(0)
        self.progress_label = WrapLabel()
        self.download_status = WrapLabel("A safetensors folder skips the repository's GGUF files; a GGUF choice "
                                         "fetches that one file. The download continues where it stopped if interrupted.")
        target_row = QHBoxLayout()
        target_row.addWidget(self.target_edit, 1)
        target_row.addWidget(self.browse_button)
        buttons = QHBoxLayout()
        for button in (self.download_button, self.cancel_button, self.resume_button):
            buttons.addWidget(button)
        buttons.addStretch(1)
        download_box = QGroupBox("Download from the Hugging Face Hub")
        form = QFormLayout(download_box)
        form.addRow("What", self.download_choice)
        form.addRow("", self.fit_label)
        form.addRow("Repository", self.repo_edit)
        form.addRow("Into folder", target_row)
        form.addRow("", self.free_label)
        form.addRow(buttons)
        form.addRow(self.progress_bar)
        form.addRow(self.progress_label)
        form.addRow(self.download_status)

        # --- demo ---
        self.demo = DemoModelMaker(self, python)  # its box, and make-tiny in a child process

        # --- recent ---
        self.recent_list = QListWidget()
        self.recent_list.setObjectName("modelList")
        recent_box = QGroupBox("Recent models (double-click to open)")
        recent_layout = QVBoxLayout(recent_box)
        recent_layout.addWidget(self.recent_list)

        for widget, name in (
            (self.open_button, "Open a model folder"), (self.open_gguf_button, "Open a GGUF model file"),
            (self.download_choice, "What to download"), (self.repo_edit, "Hub repository to download"),
            (self.target_edit, "Download into folder"), (self.browse_button, "Choose the download folder"),
            (self.download_button, "Download"), (self.cancel_button, "Cancel the download"),
            (self.resume_button, "Resume the download"),
            (self.recent_list, "Recent models"), (self.progress_bar, "Download progress"),
        ):
            widget.setAccessibleName(name)
        layout = QVBoxLayout(self)
        layout.addWidget(title)
        layout.addWidget(open_box)
        layout.addWidget(download_box)
        layout.addWidget(self.demo.box)
        layout.addWidget(recent_box, 1)

        self._load_recent()
        self._update_free_space()
        self._set_downloading(False)
        self._update_resume()
        self._connect_signals()
        if fit_estimator is not None:  # offered first: the best that fits (set once, before the user chooses)
            self.download_choice.setCurrentIndex(best_choice(self.refresh_fits()))

    def _connect_signals(self) -> None:
        self.download_choice.currentIndexChanged.connect(self.on_download_choice_changed)
        self.target_edit.editingFinished.connect(self.on_target_edited)
        self.repo_edit.textEdited.connect(self.on_repo_edited)
        self.recent_list.itemActivated.connect(self.on_recent_activated)

    # ---- public API ----------------------------------------------------------------------------------------

    def open_model(self, path: str | Path) -> bool:
        """Check ``path`` (a model folder or a ``.gguf`` file) and, if the engine can load it, emit modelChosen
        (a split GGUF set by its first part). Returns whether it was accepted."""
        check = check_model_path(path)
        if not check.ok:
            what = "file" if Path(path).suffix.lower() == ".gguf" else "folder"
            self.open_status.setText(f"<b>Cannot use this {what}:</b> {_escape(check.message)}")
            return False
        self.open_status.setText(f"Opened {_escape(str(path))}: {_escape(check.message)}")
        self.choose(str(model_path(path)))
        return True

    def open_folder(self, path: str | Path) -> bool:
        """:meth:`open_model` (a folder, or a GGUF file)."""
        return self.open_model(path)

    def start_download(self, repo_id: str | None = None, target_dir: str | Path | None = None) -> None:
        if self._job is not None:
            return
        repo_id = (repo_id or self.repo_edit.text()).strip()
        target = Path(target_dir or self.target_edit.text()).expanduser()
        self.repo_edit.setText(repo_id)
        self.target_edit.setText(str(target))
        cancel = threading.Event()
        if self._factory is None:
            self._on_download_failed("downloading is not available here (no downloader was given to the window)", False)
            return
        choice = self.download_choice.currentData()
        extra = {"gguf": choice} if choice is not None else {}  # one GGUF file instead of the model folder
        # called on the downloader's threads: it only posts (the job's cancel event tells its reports apart)
        progress = functools.partial(self.bridge.post, self._on_job_progress, cancel)
        try:
            downloader = self._factory(target, repo_id, progress=progress, cancel=cancel, **extra)
        except CloverError as exc:
            self._on_download_failed(str(exc), False)
            return
        self._job = _DownloadJob(downloader, cancel, self.bridge, self.on_download_finished, self.on_download_failed)
        self.download_status.setText(f"Downloading {_escape(repo_id)}…")
        self.progress_label.setText("asking the Hub for the file list…")
        self._set_downloading(True)
        self._job.start()

    def cancel_download(self) -> None:
        if self._job is not None:
            self._job.cancel.set()
            self.download_status.setText("Cancelling… (the bytes downloaded so far are kept)")
            self.cancel_button.setEnabled(False)

    def recent_models(self) -> list[str]:
        """The recent models still on disk (one deleted, or on a drive gone, is not offered)."""
        return [p for p in self._recent if Path(p).exists()]

    def set_recent_models(self, paths: Sequence[str]) -> None:
        self._recent = list(dict.fromkeys(str(p) for p in paths))[:MAX_RECENT]
        self._refresh_recent()

    def is_busy(self) -> bool:
        return self._job is not None or self.demo.process is not None

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop a running download or demo creation (call when the app quits)."""
        if self._job is not None:
            self._job.cancel.set()
            if self._job.thread is not None:
                self._job.thread.join(timeout_s)
        self.demo.shutdown(timeout_s)

    # ---- slots ---------------------------------------------------------------------------------------------

    def on_open_clicked(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Open a model folder", str(self.models_dir))
        if path:
            self.open_folder(path)

    def on_open_gguf_clicked(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a GGUF model file", str(self.models_dir),
                                              "GGUF model (*.gguf);;All files (*)")
        if path:
            self.open_model(path)

    def on_download_choice_changed(self, _index: int) -> None:
        """A GGUF file comes from the GGUF repository into its own folder; the model folder from the other."""
        choice = self.download_choice.currentData()
        repo_id = self._gguf_repo_id if choice is not None else self._default_repo_id
        self.repo_edit.setText(repo_id)
        self.target_edit.setText(str(self.models_dir / repo_id.split("/")[-1]))
        self._update_free_space()
        self._update_resume()

    def on_browse_clicked(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Download into", str(self.models_dir))
        if path:
            self.target_edit.setText(path)
            self._update_free_space()
            self._update_resume()

    def on_target_edited(self) -> None:
        self._update_free_space()
        self._update_resume()

    def on_repo_edited(self, text: str) -> None:
        # Follow the repository name in the default target, unless the user chose another folder.
        current = Path(self.target_edit.text())
        if current.parent == self.models_dir and "/" in text:
            self.target_edit.setText(str(self.models_dir / text.split("/")[-1]))

    def on_download_clicked(self) -> None:
        self.start_download()

    def on_cancel_clicked(self) -> None:
        self.cancel_download()

    def on_download_progress(self, p: Any) -> None:
        self.progress_bar.setValue(int(1000 * p.done_bytes / p.total_bytes) if p.total_bytes else 0)
        what = {"planning": "planning", "checking": "checking", "downloading": "downloading",
                "verifying": "verifying checksum of", "done": "done"}.get(p.state, p.state)
        name = f" {p.file}" if p.file else ""
        counter = f" ({p.file_index + 1}/{p.file_count})" if p.file_count and p.state != "done" else ""
        self.progress_label.setText(f"{what}{name}{counter} — "
                                    f"{progress_text(p.done_bytes, p.total_bytes, p.speed_bps, p.eta_s)}")
        self.downloadProgress.emit(p)

    def on_download_finished(self, folder: str) -> None:
        self._release_job()
        self._set_downloading(False)
        self.progress_bar.setValue(1000)
        check = check_model_path(folder)
        if not check.ok:
            message = f"Downloaded, but the engine cannot use it: {check.message}"
            self.download_status.setText(_escape(message))
            self.downloadEnded.emit(False, message)
            return
        self.download_status.setText(f"Downloaded into {_escape(folder)}: {_escape(check.message)}")
        self.downloadEnded.emit(True, folder)
        self.choose(folder)

    def on_download_failed(self, message: str, cancelled: bool) -> None:
        self._on_download_failed(message, cancelled)

    def on_recent_activated(self, item: QListWidgetItem) -> None:
        self.open_folder(item.data(Qt.ItemDataRole.UserRole))

    # ---- internals -----------------------------------------------------------------------------------------

    def _on_job_progress(self, cancel: threading.Event, progress: Any) -> None:
        if self._job is not None and self._job.cancel is cancel:  # late reports of an ended job are dropped
            self.on_download_progress(progress)

    def _release_job(self) -> None:
        self._job = None  # (what the job reported before its end was delivered before it: one ordered bridge)

    def _on_download_failed(self, message: str, cancelled: bool) -> None:
        self._release_job()
        self._set_downloading(False)
        if cancelled:
            text = "Cancelled. The bytes downloaded so far are kept: press Resume to continue."
        else:
            said = message.strip()
            text = f"<b>Download stopped:</b> {_escape(said)}"
            if said and said[-1] not in ".!?":
                text += "."  # (the next sentence started right after the error's last word)
            if "resume" not in message.lower() and "again" not in message.lower():
                text += " Press Resume to try again; finished files are not fetched twice."
        self.download_status.setText(text)
        self.resume_button.setEnabled(True)
        self.downloadEnded.emit(False, message)

    def _set_downloading(self, on: bool) -> None:
        self.download_button.setEnabled(not on)
        self.cancel_button.setEnabled(on)
        if on:
            self.resume_button.setEnabled(False)
        self.repo_edit.setEnabled(not on)
        self.download_choice.setEnabled(not on)
        self.target_edit.setEnabled(not on)
        self.browse_button.setEnabled(not on)

    def _update_resume(self) -> None:
        """Resume is offered when the target folder holds a partial download (also after a restart)."""
        state = Path(self.target_edit.text()).expanduser() / PARTIAL_STATE_DIR
        partial = state.is_dir() and any(state.rglob("*.part"))
        self.resume_button.setEnabled(self._job is None and partial)
        if partial and self._job is None:
            self.resume_button.setToolTip("A partial download is in this folder: continue it")

    def _update_free_space(self) -> None:
        self.free_label.setText(free_space_text(self.target_edit.text() or self.models_dir))
        self.refresh_fits()

    def refresh_fits(self) -> list[ChoiceFit]:
        """Each choice's fit on this machine in its item (name, badge, figures as tooltip) and, for the chosen one,
        under the list. Never changes the choice. (Without a fit estimator: nothing to show.)"""
        if self._fit_estimator is None:
            return []
        choices = [self.download_choice.itemData(i) for i in range(self.download_choice.count())]
        fits = choice_fits(self._fit_estimator, choices, free_bytes(self.target_edit.text() or self.models_dir))
        for i, fit in enumerate(fits):
            badge = fit.badge()
            self.download_choice.setItemText(i, f"{self._choice_names[i]} — {badge}" if badge else self._choice_names[i])
            self.download_choice.setItemData(i, fit.details(), Qt.ItemDataRole.ToolTipRole)
        current = fits[self.download_choice.currentIndex()] if fits else None
        self.fit_label.setText(_escape(current.details()).replace("\n", "<br>") if current is not None else "")
        return fits

    def choose(self, folder: str) -> None:
        """A model that passed its check: first in the recent list, and chosen (:attr:`modelChosen`)."""
        self._recent = [folder, *[p for p in self._recent if p != folder]][:MAX_RECENT]
        self._refresh_recent()
        self._save_recent()
        self.recentModelsChanged.emit(list(self._recent))
        self.modelChosen.emit(folder)

    def _refresh_recent(self) -> None:
        self.recent_list.clear()
        for path in self.recent_models():  # a deleted model is not listed (it stays remembered, should it return)
            item = QListWidgetItem(f"{Path(path).name} — {path}")
            item.setData(Qt.ItemDataRole.UserRole, path)
            self.recent_list.addItem(item)

    def _load_recent(self) -> None:
        if self._recent_file is None:
            return
        try:
            data = json.loads(self._recent_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable recent-models file %s: %s", self._recent_file, exc)
            return
        if isinstance(data, list):
            self.set_recent_models([str(p) for p in data if isinstance(p, str)])

    def _save_recent(self) -> None:
        if self._recent_file is None:
            return
        try:
            self._recent_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._recent_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._recent, indent=1), encoding="utf-8")
            os.replace(tmp, self._recent_file)
        except OSError as exc:
            log.warning("cannot save recent models to %s: %s", self._recent_file, exc)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


__all__ = [
    "DEFAULT_REPO_ID",
    "ModelCheck",
    "ModelManagerPanel",
    "SUPPORTED_MODEL_TYPES",
    "check_gguf_file",
    "check_model_dir",
    "check_model_path",
    "free_space_text",
    "progress_text",
]
