"""Composition root: builds the engine client, the chat store and the window, and wires them together.

Nothing else in the application constructs these objects; tests build the same graph with a temporary
``CLOVER_DESK_HOME`` (or pass their own client / store). The rules the wiring implements:

* the engine worker starts with the app; once it is ready the configured model is loaded (again after a restart);
* picking a model in the model manager loads it and remembers it (``settings.json`` in the app-data folder);
* "Apply" in the VRAM panel reloads the model under the new budget, without restarting the app;
* a new chat starts from the model folder's own generation settings (``config.json`` / ``generation_config.json``,
  read here without torch; the engine's ``loaded`` answer carries the same);
* the window's size, splitters, theme and export folder live in ``window.ini`` in the app-data folder;
* on quit the worker is shut down and the store closed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QSettings
from PySide6.QtWidgets import QApplication, QWidget

from clover_desk import paths
from clover_desk.downloads import GGUF_REPO_ID, OFFICIAL_GGUF, ModelDownloader, RunFit, run_fit
from clover_desk.engine.decode.events import LoadProgress
from clover_desk.engine.defaults import DEFAULT_CTX_TOKENS
from clover_desk.engine.errors import CloverError
from clover_desk.engine.files import atomic_write_text
from clover_desk.engine.model.config import load_config, load_generation_defaults
from clover_desk.engine.placement import planner
from clover_desk.engine.placement.hardware import DEFAULT_HARDWARE, MemoryMonitor, probe_hardware
from clover_desk.engine.settings import EXCLUSIVE, OPT_IN, GpuPaths, SettingsError, opt_in_env
from clover_desk.engine.weights.formats import FORMAT_OF_TORCH_NAME
from clover_desk.engine.weights.gguf.file import open_gguf
from clover_desk.storage.recorder import StreamRecorder
from clover_desk.storage.store import ChatStore
from clover_desk.ui.html_extract import extract_html
from clover_desk.ui.main_window import MainWindow
from clover_desk.ui.model_library import ModelLibrary
from clover_desk.ui.model_manager import ModelManagerPanel
from clover_desk.ui.model_paths import MODELS_DIR_NAME, RECENT_FILE_NAME
from clover_desk.ui.preview import PreviewPane
from clover_desk.ui.vram_panel import VramPanel
from clover_desk.ui.widgets import PreviewOff
from clover_desk.worker.client import EngineClient
from clover_desk.worker.remote import RemoteBackend
from clover_desk.worker.token_counter import TokenCounter

log = logging.getLogger(__name__)

GIB = 1024**3
SETTINGS_NAME = paths.SETTINGS_NAME
WINDOW_SETTINGS_NAME = "window.ini"  # QSettings (INI): window geometry, splitter, theme, last export folder


@dataclass
class AppSettings:
    """What the app remembers between runs (the chats themselves live in the ChatStore)."""

    model_dir: str | None = None
    device: str | None = None  # None: "cuda" when a GPU is found, else "cpu"
    dtype: str | None = None  # None: bfloat16 on cuda, float32 on cpu
    vram_budget_bytes: int | None = None  # the VRAM panel's applied budget (None: load without a plan)
    ctx_tokens: int = DEFAULT_CTX_TOKENS
    # a model folder on the CPU loads through its quantized cache (4-bit experts, 8-bit dense layers; built beside it
    # on first use, Engine.load's precision "nf4"); False: the weights as stored, in dtype. A GPU load under a plan
    # is always quantized, and a .gguf file is read as its own blocks
    quantized: bool = True
    compile_layers: bool = False  # compile the decoder layers at load (engine.kernels.fastpath; a warm-up while loading)
    # the experimental GPU paths chosen on the models page (engine.settings.OPT_IN switch names); None: never chosen,
    # the worker runs those of the settings the app started with (CloverDeskApp's gpu_paths: CLOVER_DESK_FUSED_MOE=1 ...)
    gpu_paths: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> AppSettings:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable settings %s: %s", path, exc)
            return cls()
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        settings = cls(**known)
        if settings.gpu_paths is not None:  # a hand-edited file: drop what the engine would refuse, and say so

            try:
                opt_in_env(settings.gpu_paths)
            except (TypeError, ValueError) as exc:
                log.warning("ignoring gpu_paths in %s: %s", path, exc)
                settings.gpu_paths = None
        return settings

    def save(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(asdict(self), indent=2))


def _probe() -> Any:
    """The machine's GPU / RAM (``engine.placement.hardware.probe_hardware``; NVML and psutil, no torch)."""

    try:
        return probe_hardware()
    except Exception as exc:  # noqa: BLE001 - a broken driver must not stop the app; plan for the default card
        log.warning("hardware probe failed: %s", exc)
        return DEFAULT_HARDWARE


def model_info_from_folder(model_dir: str | None) -> dict[str, Any] | None:
    """``config`` and ``generation_defaults`` of a model folder as the engine's ``loaded`` answer carries them, read
    without torch (``engine.model.config``); None when there is no folder or it cannot be read."""
    if not model_dir:
        return None

    try:
        if is_gguf(model_dir):  # the config is in the file's metadata (numpy + the gguf package, no torch)
            return {"model_dir": str(model_dir), "config": asdict(open_gguf(model_dir).config)}
        config = load_config(model_dir)
        generation = load_generation_defaults(model_dir, config)
    except (CloverError, OSError) as exc:
        log.info("no generation defaults from %s: %s", model_dir, exc)
        return None
    return {"model_dir": str(model_dir), "config": asdict(config), "generation_defaults": asdict(generation)}


def is_gguf(model: str | None) -> bool:
    """Whether the configured model is a GGUF file (its config is in the file's metadata)."""
    return bool(model) and str(model).lower().endswith(".gguf")


class CloverDeskApp(QObject):
    """The running application: owns the client, the store, the window and the remembered settings."""

    def __init__(
        self,
        home: Path | None = None,
        *,
        client: Any = None,
        store: ChatStore | None = None,
        settings: AppSettings | None = None,
        hardware: Any = None,
        with_preview: bool = True,
        preview_off: str | None = None,
        with_model_manager: bool = True,
        start_engine: bool = True,
        style: bool = True,
        gpu_paths: GpuPaths | None = None,
        parent: QObject | None = None,
    ) -> None:
        """``style``: apply the window's theme (light / dark / following the system) to the application.
        ``preview_off``: why the HTML preview cannot run here (as root without the sandbox): its tab says so and no
        web engine starts. ``gpu_paths``: the GPU paths and kernel switches the app was started with (what
        ``clover-desk gui`` read from its environment; default: the defaults), the engine process's unless the models
        page chose other opt-in paths."""
        super().__init__(parent)

        self.home = Path(home) if home is not None else paths.app_data_dir()
        self.home.mkdir(parents=True, exist_ok=True)
        self.settings_path = self.home / SETTINGS_NAME
        self.settings = settings or AppSettings.load(self.settings_path)
        self.hardware = hardware if hardware is not None else _probe()
        self.store = store or ChatStore(self.home / paths.CHATS_DB_NAME)
        self.client = client or EngineClient()
        self.started_gpu_paths = gpu_paths or GpuPaths()
        self._apply_gpu_paths()
        self.device = self.settings.device or ("cuda" if self.hardware.gpu_name else "cpu")
        self.dtype = self.settings.dtype or ("bfloat16" if self.device == "cuda" else "float32")
        self.vram_panel = self._build_vram_panel()
        self.preview = self._build_preview(preview_off) if with_preview else None
        self.model_manager = self._build_model_manager() if with_model_manager else None
        self.model_library = self._build_model_library() if self.model_manager is not None else None
        self.token_counter = TokenCounter(self)  # the context meter: the model folder's tokenizer, no worker needed
        self.token_counter.set_model(self.settings.model_dir)
        self.window = MainWindow(
            self.client,
            self.store,
            StreamRecorder,
            model_dir=self.settings.model_dir,
            vram_panel=self.vram_panel,
            preview=self.preview,
            model_manager=self.model_manager,
            model_library=self.model_library,
            html_extractor=self._html_extractor(),
            monitor=MemoryMonitor(),
            gpu_name=self.hardware.gpu_name,
            ui_settings=QSettings(str(self.home / WINDOW_SETTINGS_NAME), QSettings.Format.IniFormat),
            token_counter=self.token_counter,
        )
        if hasattr(self.client, "start_server"):  # the worker's HTTP server (Model ▸ Serve over HTTP…)
            self.window.set_server_control(self.client)
        self.window.set_remote_factory(RemoteBackend)  # Model ▸ Backend…: (url, api_key, model) -> RemoteBackend
        info = model_info_from_folder(self.settings.model_dir)
        if info is not None:
            self.window.chat_settings.set_model_info({**info, "ctx_tokens": self.settings.ctx_tokens})  # the context it will load with
        if style:
            self.window.state.apply_theme_preference()
        self._connect_signals()
        if start_engine:
            self.client.start()

    # ----------------------------------------------------------------- parts
    def _plan_function(self) -> Any:
        """``(vram_budget_bytes, ctx_tokens) -> Plan`` for the configured model on this machine: ``engine.placement.planner.
        plan_model``, the one planning function (the worker checks and places the plan it is sent)."""

        manifest = self._manifest(planner)
        self._ctx_limit = manifest.geometry.max_position_embeddings or None  # the panel offers no longer context
        hardware = self.hardware

        # the precision chosen for the next load on the GPU; without one the panel plans for a card the user picks,
        # which would run in bf16 (a CPU load places nothing by a plan)
        compute = FORMAT_OF_TORCH_NAME.get(self.dtype, "bf16") if self.device == "cuda" else "bf16"

        def plan(vram_budget_bytes: int, ctx_tokens: int) -> Any:
            return planner.plan_model(manifest, vram_budget_bytes, ctx_tokens, hardware, compute_dtype=compute)

        return plan

    def _build_vram_panel(self) -> QWidget:
        hardware = self.hardware
        self._plan = self._plan_function()
        panel = VramPanel(
            self._plan,
            hardware.vram_total_bytes,
            hardware.gpu_name,
            hardware.ram_total_bytes,
            ctx_tokens=self.settings.ctx_tokens,
            ctx_limit=self._ctx_limit,
        )
        if self.settings.vram_budget_bytes:
            panel.set_vram_budget_bytes(self.settings.vram_budget_bytes)
        return panel

    def _manifest(self, planner: Any) -> Any:
        """The configured model as the planner counts it (headers under the quantization policy), or the published
        model's shape when no model is chosen yet or its folder cannot be read."""
        if self.settings.model_dir:
            try:
                return planner.model_manifest(self.settings.model_dir)
            except Exception as exc:  # noqa: BLE001 - an unreadable folder: plan for the published model instead
                log.warning("cannot read %s for planning (%s); planning for clover-35b-a3b", self.settings.model_dir, exc)
        return planner.model_manifest(planner.SHAPE_PREFIX + "clover-35b-a3b")

    def _build_preview(self, off_reason: str | None = None) -> QWidget | None:
        return PreviewOff(off_reason) if off_reason else PreviewPane()

    def _build_model_manager(self) -> QWidget | None:
        return ModelManagerPanel(
            downloader_factory=ModelDownloader,
            models_dir=self.home / MODELS_DIR_NAME,
            recent_file=self.home / RECENT_FILE_NAME,
            gguf_choices=OFFICIAL_GGUF,
            gguf_repo_id=GGUF_REPO_ID,
            fit_estimator=self.download_fit,
        )

    def download_fit(self, choice: Any) -> RunFit:
        """How a download choice (None: the safetensors folder) would run here, by the planner: at the VRAM budget
        and context the window loads with (the applied ones, else the VRAM panel's), or from RAM without a GPU."""
        compute = FORMAT_OF_TORCH_NAME.get(self.dtype, "bf16")
        if self.device != "cuda":
            return run_fit(choice, None, self.settings.ctx_tokens, self.hardware, compute,
                           quantized=self.settings.quantized)
        budget, ctx = self.settings.vram_budget_bytes, self.settings.ctx_tokens
        if not budget:  # nothing applied yet: what load_model would plan for (the panel's proposal)
            budget, ctx = self.vram_panel.vram_budget_bytes(), self.vram_panel.ctx_tokens()
        return run_fit(choice, budget, ctx, self.hardware, compute)

    def _build_model_library(self) -> QWidget:
        """The models on disk (the recent ones and the models folder's), with the device and precision of the next
        load."""

        manager = self.model_manager
        library = ModelLibrary(self.home / MODELS_DIR_NAME, manager.recent_models if manager is not None else list,
                               gpu_name=self.hardware.gpu_name, device=self.device, dtype=self.dtype,
                               compile_layers=self.settings.compile_layers, quantized=self.settings.quantized,
                               gpu_paths=OPT_IN, exclusive=EXCLUSIVE,
                               gpu_paths_on=self.gpu_paths())
        library.set_current(self.settings.model_dir)
        return library

    def _html_extractor(self) -> Any:
        return extract_html

    def _connect_signals(self) -> None:
        self.client.ready.connect(self.on_engine_ready)
        self.client.loaded.connect(self.on_model_loaded)
        self.window.modelChosen.connect(self.on_model_chosen)
        self.window.applyPlanRequested.connect(self.on_apply_plan)
        if self.model_library is not None and self.model_manager is not None:
            self.model_library.loadRequested.connect(self.model_manager.open_model)  # checked, then remembered
            self.model_library.loadOptionsChanged.connect(self.on_load_options_changed)
            self.model_library.reloadRequested.connect(self.on_reload_requested)
            self.model_library.gpuPathsChanged.connect(self.on_gpu_paths_changed)
            self.model_manager.recentModelsChanged.connect(self.model_library.refresh)
        app = QApplication.instance()
        if app is not None:
            app.aboutToQuit.connect(self.on_about_to_quit)

    def gpu_paths(self) -> list[str]:
        """The experimental GPU paths the worker runs with: the models page's choice, or (never chosen) those of
        the settings the app started with."""
        return list(self.settings.gpu_paths) if self.settings.gpu_paths is not None else self.started_gpu_paths.opt_in()

    def _apply_gpu_paths(self) -> bool:
        """Give the worker exactly the chosen paths (every switch, 1 or 0, over the app's environment: the started
        settings with the models page's opt-in choice); returns whether a running worker has to restart for them."""
        if not hasattr(self.client, "set_env"):
            return False
        try:
            paths = GpuPaths.from_opt_in(self.gpu_paths(), base=self.started_gpu_paths)
        except SettingsError as exc:  # a hand-edited choice (AppSettings.load drops one that is refused)
            log.warning("GPU paths: %s", exc)
            return False
        return bool(self.client.set_env(paths.to_env()))

    # ----------------------------------------------------------------- slots
    def load_model(self) -> None:
        if not self.settings.model_dir:
            return
        budget, ctx = self.settings.vram_budget_bytes, self.settings.ctx_tokens
        if self.device == "cuda" and not budget:
            # nothing applied yet: plan for what the VRAM panel proposes (the card less one step) rather than
            # trying to put the whole BF16 model on the GPU
            budget, ctx = self.vram_panel.vram_budget_bytes(), self.vram_panel.ctx_tokens()
        if self._ctx_limit:  # a model with a shorter context than the one chosen runs at its whole context
            ctx = min(ctx, self._ctx_limit)
        # the plan the panel shows for this budget and context travels with the load and is placed as is; without
        # a GPU there is no plan: everything runs from system RAM (the budget is kept for later)
        # (the panel's own plan: the window plans once between the slider and the load)
        plan = None
        if budget and self.device == "cuda":
            shown = self.vram_panel.plan_to_load(budget, ctx)
            if shown is None:  # e.g. a context over the model's limit: say so, load nothing
                log.warning("cannot plan %s for %d bytes, %d tokens", self.settings.model_dir, budget, ctx)
                self.window.engine_status.on_engine_error_message(
                    "PlanError", f"no plan for a {budget / 2**30:.2f} GiB budget and {ctx:,} tokens of context")
                return
            plan = shown.to_dict()
        self.window.engine_status.on_load_progress(LoadProgress("reading", 0, 0, Path(self.settings.model_dir).name))
        # the engine says if it cannot compile; answers from a remote server need no compiled local model
        remote = self.window.remote is not None and self.window.remote.selected
        compile_layers = {"compile": True} if self.settings.compile_layers and not remote else {}
        # without a plan the context still travels: the engine holds requests to it and the composer's meter
        # counts against it (the VRAM panel's applied context, one context size everywhere)
        context = {"ctx_tokens": ctx} if plan is None and ctx else {}
        # a plan places the quantized cache, and without a GPU a folder loads through it unless "4-bit weights" is
        # off (a .gguf file: its own blocks): said, not implied (Engine.load)
        quantized = plan is not None or (self.device != "cuda" and self.settings.quantized)
        precision = {"precision": "nf4"} if quantized and Path(self.settings.model_dir).suffix != ".gguf" else {}
        self.client.load(self.settings.model_dir, device=self.device, dtype=self.dtype, plan=plan, **compile_layers,
                         **context, **precision)

    def on_engine_ready(self) -> None:
        self.load_model()

    def on_model_loaded(self, info: dict[str, Any]) -> None:
        """The panel shows the plan the engine placed (None: no plan, the model runs from system RAM). A compile the
        user cancelled unticks "Compile the layers" (saved): the next start does not compile again."""
        self.vram_panel.set_in_use(info.get("plan") or None, str(info.get("device") or self.device))
        if info.get("compile_cancelled") and self.settings.compile_layers:
            self.settings.compile_layers = False
            self.save_settings()
            if self.model_library is not None:
                self.model_library.compile_choice.blockSignals(True)  # (no "Reload now": this is the model's state)
                self.model_library.compile_choice.setChecked(False)
                self.model_library.compile_choice.blockSignals(False)

    def on_model_chosen(self, model_dir: str) -> None:
        self.settings.model_dir = model_dir
        self.save_settings()
        self.token_counter.set_model(model_dir)
        if self.model_library is not None:
            self.model_library.set_current(model_dir)
        self._plan = self._plan_function()
        self.vram_panel.set_context_limit(self._ctx_limit, self.settings.ctx_tokens)  # the one applied, if it fits
        self.vram_panel.set_planner(self._plan)
        info = model_info_from_folder(model_dir)
        if info is not None:
            self.window.chat_settings.set_model_info({**info, "ctx_tokens": self.settings.ctx_tokens})
        if self.client.state in ("idle",) and not self._apply_gpu_paths():  # (the worker has the chosen paths)
            self.load_model()
        else:
            self.window.engine_status.on_engine_restarting()
            self.client.restart()  # ready → load_model

    def on_load_options_changed(self, device: str, dtype: str, compile_layers: bool | None = None,
                                quantized: bool | None = None) -> None:
        """The models page's device, precision, compilation and 4-bit weights (None: unchanged): remembered, and
        used from the next load on (the VRAM panel plans in the new precision at once, the download choices say
        how they fit)."""
        self.settings.device, self.settings.dtype = device, dtype
        if compile_layers is not None:
            self.settings.compile_layers = bool(compile_layers)
        if quantized is not None:
            self.settings.quantized = bool(quantized)
        self.save_settings()
        self.device, self.dtype = device, dtype
        self._plan = self._plan_function()
        self.vram_panel.set_planner(self._plan)
        self._refresh_download_fits()

    def _refresh_download_fits(self) -> None:
        """The models page's download choices say how they fit the budget, context and precision now chosen."""
        if self.model_manager is not None:
            self.model_manager.refresh_fits()

    def on_gpu_paths_changed(self, on: list[str]) -> None:
        """The models page's experimental GPU paths: remembered, and in force from the next load (the worker reads
        the switches when it starts, so that load restarts it)."""
        self.settings.gpu_paths = list(on)
        self.save_settings()
        self._apply_gpu_paths()

    def on_reload_requested(self) -> None:
        """Load the current model again now (with the options just chosen)."""
        if self.settings.model_dir:
            self.window.on_model_chosen(self.settings.model_dir)

    def on_apply_plan(self, vram_budget_bytes: int, ctx_tokens: int) -> None:
        """Reload under the panel's plan. Without a GPU there is nothing to reload: the choice is saved for later
        (the panel says the model runs from system RAM)."""
        self.settings.vram_budget_bytes = vram_budget_bytes
        self.settings.ctx_tokens = ctx_tokens
        self.save_settings()
        self._refresh_download_fits()
        if self.device != "cuda":
            return
        if self.client.state == "idle" and not self._apply_gpu_paths():
            self.load_model()
        else:
            self.window.engine_status.on_engine_restarting()
            self.client.restart()

    def save_settings(self) -> None:
        try:
            self.settings.save(self.settings_path)
        except OSError as exc:
            log.warning("cannot save settings to %s: %s", self.settings_path, exc)

    def on_about_to_quit(self) -> None:
        self.shutdown()

    def shutdown(self, wait_ms: int = 3000) -> None:
        if self.model_manager is not None:
            self.model_manager.shutdown()  # stop a download thread / demo-model process cleanly
        if self.window.remote is not None:
            self.window.remote.shutdown()  # a remote answer in flight: its connection is closed
        self.client.shutdown(wait_ms=wait_ms)
        self.token_counter.shutdown()
        self.store.close()
