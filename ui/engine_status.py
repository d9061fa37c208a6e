"""The engine's life as the window shows it: loading, loaded, failed, crashed, restarted, and the status bar.

:class:`EngineStatus` keeps the engine's :class:`~ui.contracts.EngineState` for :class:`ui.main_window.MainWindow`
(which wires the engine client's ``loadProgress``, ``loaded``, ``ready``, ``errorMessage`` and ``crashed`` here, and
the banners' buttons), shows it in the load, crash and notice banners, and owns the status bar's labels: the engine's
state (or what the answer in flight is doing), the GPU and the experimental paths the engine runs with, VRAM and RAM
in use (the memory monitor's sample, every 2 s), the speed and the expert cache's hit rate of the last answer. With a
remote backend (Model ▸ Backend…) the figures a remote server does not report say so.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QStatusBar, QWidget

from clover_desk.engine.decode.events import LoadProgress
from clover_desk.engine.defaults import DTYPE_OF_PRECISION
from clover_desk.ui.contracts import EngineState, MemoryMonitor
from clover_desk.ui.throttle import Throttle
from clover_desk.ui.widgets import ElidedLabel, accessible

log = logging.getLogger(__name__)

GIB = 1024**3
LOAD_CANCELLED = "Loading cancelled."
MONITOR_MS = 2000  # how often the status bar samples VRAM and RAM in use


# how the status bar names the loaded engine's weights (engine.defaults.PRECISIONS, the worker's "loaded" answer)
WEIGHTS_HELD = {"nf4": "4-bit weights", "gguf": "GGUF blocks",
                **{precision: f"{dtype} weights" for precision, dtype in DTYPE_OF_PRECISION.items()}}


class EngineWindowLike(Protocol):
    """What :class:`EngineStatus` uses of its window (``ui.main_window.MainWindow``)."""

    client: Any  # ui.contracts.EngineClientLike
    model_dir: str | None
    monitor: MemoryMonitor | None
    gpu_name: str | None
    vram_panel: QWidget | None
    remote: Any  # ui.remote_chat.RemoteBackendControl | None
    session: Any  # ui.chat_session.ChatSession
    long_chats: Any  # ui.long_chats.LongChats
    drawer: Any  # ui.settings_drawer.SettingsDrawer
    chat_settings: Any  # ui.chat_settings.ChatSettings: .set_model_info(), .sync()
    denoise: Any  # ui.denoise_view.DenoiseView
    prompt_progress: Any  # ui.prompt_progress.PromptProgress
    model_label: Any
    crash_banner: Any  # ui.banners.Banner
    info_banner: Any  # ui.banners.Banner
    load_banner: Any  # ui.banners.LoadBanner
    chat_actions: Any  # ui.chat_actions.ChatActions: .uses_remote(), .update_send_state(), .read_ahead_timer

    def is_generating(self) -> bool: ...

    def show_panel(self, widget: QWidget | None) -> None: ...

    def statusBar(self) -> QStatusBar: ...  # noqa: N802 - Qt's name


class EngineStatus:
    """The engine's state, its banners and the status bar of one window."""

    def __init__(self, window: EngineWindowLike, parent: QWidget) -> None:
        self.window = window
        if window.model_dir is None:
            self.state = EngineState.NO_MODEL
        elif getattr(window.client, "model_info", None):  # handed a client whose model is already loaded
            self.state = EngineState.READY
        else:
            self.state = EngineState.STARTING
        self.gpu_paths_in_use: list[str] = []  # the experimental GPU paths the loaded engine runs with (its answer)
        self.precision_in_use = ""  # how the loaded engine holds its weights (its answer's "precision"; "" unknown)
        self.throttle = Throttle(self.refresh, 250, parent)
        self.monitor_timer = QTimer(parent)
        self.monitor_timer.setInterval(MONITOR_MS)
        self.monitor_timer.timeout.connect(self.refresh)
        self._build_status_bar(window.statusBar())

    def _build_status_bar(self, bar: QStatusBar) -> None:
        bar.setSizeGripEnabled(False)
        self.engine_label = ElidedLabel()
        self.engine_label.setObjectName("engineStatus")
        self.gpu_label = ElidedLabel()
        self.gpu_label.setObjectName("gpuStatus")
        self.gpu_label.setMaximumWidth(260)
        self.vram_label = ElidedLabel()
        self.ram_label = ElidedLabel()
        self.speed_label = ElidedLabel()
        self.speed_label.setObjectName("speedStatus")
        self.hit_label = ElidedLabel()
        for label, name in ((self.engine_label, "Engine"), (self.gpu_label, "GPU"), (self.vram_label, "VRAM in use"),
                            (self.ram_label, "RAM in use"), (self.speed_label, "Speed"),
                            (self.hit_label, "Expert cache")):
            accessible(label, name)
        bar.addWidget(self.engine_label, 1)
        for w in (self.gpu_label, self.vram_label, self.ram_label, self.speed_label, self.hit_label):
            bar.addPermanentWidget(w)

    def start(self) -> None:
        """Sample the memory in use every 2 s (with a monitor)."""
        if self.window.monitor is not None:
            self.monitor_timer.start()

    # ----------------------------------------------------------------- the engine's life
    def set_state(self, state: EngineState) -> None:
        self.state = state
        self.refresh()

    def on_load_progress(self, event: LoadProgress) -> None:
        self.clear_load_notice()
        self.state = EngineState.LOADING
        self.window.load_banner.set_progress(event)
        self.throttle.request()
        self.window.chat_actions.update_send_state()

    def on_engine_loaded(self, info: object = None) -> None:
        w = self.window
        w.load_banner.hide()
        w.crash_banner.hide()
        if isinstance(info, Mapping):
            w.chat_settings.set_model_info(info)
            self.gpu_paths_in_use = [str(p) for p in info.get("gpu_paths") or ()]
            self.precision_in_use = str(info.get("precision") or "")
            self.set_diffusion_unavailable(str(info.get("ar_only") or ""))
            if info.get("compile_cancelled"):
                w.info_banner.action.setVisible(False)
                w.info_banner.show_message("Compiling was cancelled: the model is loaded and runs uncompiled; "
                                           "“Compile the layers” is now off.")
            else:
                self.say_compile_skipped(str(info.get("compile_skipped") or ""),
                                         after_notice=bool(info.get("ar_only")))
            self.say_cpu_kernels_missing(str(info.get("cpu_kernels_missing") or ""))
        self.set_state(EngineState.READY)
        w.chat_actions.read_ahead_timer.start()

    def say_compile_skipped(self, reason: str, after_notice: bool = False) -> None:
        """"Compile the layers" was on but the engine could not compile this model (``Engine.compile_skipped``: no
        C++ compiler for the CPU, no Triton for CUDA): say so in the notice banner (after the notice already there when ``after_notice``)."""
        if not reason:
            return
        banner = self.window.info_banner
        before = banner.label.text() + " " if after_notice else ""
        banner.action.setVisible(False)
        banner.show_message(f"{before}“Compile the layers” is on, but {reason}.")

    def say_cpu_kernels_missing(self, reason: str) -> None:
        """The quantized weights run on the CPU without the engine's CPU kernels (``Engine.cpu_kernels_missing``: no
        C compiler, no prebuilt library for this CPU): ~30x slower, and gcc fixes it. Added after any notice shown."""
        if not reason:
            return
        banner = self.window.info_banner
        before = banner.label.text() + " " if not banner.isHidden() and banner.label.text() else ""
        banner.action.setVisible(False)
        banner.show_message(f"{before}This model runs about 30x slower than it could: the engine's CPU kernels are "
                            f"unavailable here: {reason}. Install gcc, then load the model again.")

    def set_diffusion_unavailable(self, reason: str) -> None:
        """The loaded model decodes autoregressively only (``Engine.ar_only``: a GGUF file without the diffusion
        tensors): say so plainly, and answer in AR mode with the diffusion choice disabled (its tooltip says why)."""
        w = self.window
        w.drawer.set_diffusion_available(reason)
        w.chat_settings.sync()
        if reason:
            w.info_banner.action.setVisible(False)
            w.info_banner.show_message(f"Block diffusion is unavailable for this file, so answers use "
                                       f"autoregressive mode: {reason}.")

    def on_engine_ready(self, *_info: object) -> None:
        if self.state in (EngineState.STARTING, EngineState.CRASHED, EngineState.READY):
            self.state = EngineState.STARTING if self.window.model_dir else EngineState.NO_MODEL
        self.window.crash_banner.hide()
        self.refresh()

    def on_engine_restarting(self) -> None:
        """The app restarts the worker (another model, another VRAM plan): no Send until it has loaded again."""
        self.set_state(EngineState.STARTING)

    def clear_load_notice(self) -> None:
        """The "Loading cancelled." notice is about that load: another chat, backend or load takes it away."""
        if self.window.info_banner.label.text() == LOAD_CANCELLED:
            self.window.info_banner.hide()

    def on_engine_error_message(self, kind: str, message: str) -> None:
        w = self.window
        w.load_banner.hide()
        if w.session.local_request():
            w.session.fail(f"{kind}: {message}", "error")
        if kind in ("CancelledError",):
            w.info_banner.action.setVisible(False)
            w.info_banner.show_message(LOAD_CANCELLED)
            if self.state is EngineState.LOADING:
                self.state = EngineState.NO_MODEL
        else:
            text = f"{kind}: {message}"
            oom = "OutOfMemory" in kind or "out of memory" in message.lower()
            if oom:
                text += "  Try a smaller VRAM budget or a shorter context in the VRAM tab."
            w.info_banner.set_action("Open VRAM tab")
            w.info_banner.action.setVisible(oom and w.vram_panel is not None)
            w.info_banner.show_message(text)
            if self.state in (EngineState.LOADING, EngineState.STARTING):
                self.state = EngineState.ERROR
        self.refresh()

    def on_engine_crashed(self, reason: str) -> None:
        w = self.window
        self.state = EngineState.CRASHED
        w.load_banner.hide()
        if w.session.local_request():
            w.session.fail(f"the engine stopped: {reason}", "crashed")
        w.crash_banner.show_message(f"The engine stopped: {reason}. Your chats are saved.")
        self.refresh()

    def on_restart_clicked(self) -> None:
        self.window.crash_banner.hide()
        self.state = EngineState.STARTING
        self.window.client.restart()
        self.refresh()

    def on_cancel_load(self) -> None:
        self.window.client.cancel_load()
        self.window.load_banner.label.setText("Cancelling…")

    def on_open_vram_tab(self) -> None:
        if self.window.vram_panel is not None:
            self.window.show_panel(self.window.vram_panel)
        self.window.info_banner.hide()

    # ----------------------------------------------------------------- the status bar
    def refresh(self) -> None:
        w = self.window
        generating = w.is_generating()
        state_text = self.state.status_text
        if generating:
            state_text = "● Reading your message…" if w.prompt_progress.active else "● Generating…"
            if w.long_chats.summary is not None:
                state_text = "● Summarizing the chat…"
        self.engine_label.setText(state_text)
        if w.chat_actions.uses_remote() and w.remote is not None:  # the header names what answers
            w.model_label.setText(w.remote.model_name() or f"remote: {w.remote.host() or 'no URL set'}")
        else:
            w.model_label.setText(Path(w.model_dir).name if w.model_dir else "no model")
        paths, held = self.gpu_paths_in_use, WEIGHTS_HELD.get(self.precision_in_use)
        self.gpu_label.setText((w.gpu_name or "No GPU (CPU)") + (f" · {held}" if held else "")
                               + (f" · {len(paths)} experimental path{'s' if len(paths) > 1 else ''}" if paths else ""))
        self._show_memory(w.monitor.sample() if w.monitor is not None else {})
        live = w.denoise.model.tokens_per_s() if generating else None
        tok_s = live or (w.session.last_tok_s if not w.session.last_tok_s_remote else None)
        self.speed_label.setText(f"{tok_s:.1f} tok/s" if tok_s else "– tok/s")
        rate = w.session.last_hit_rate
        self.hit_label.setText(f"Expert cache {rate * 100:.0f}% hits" if rate is not None else "Expert cache –")
        if w.chat_actions.uses_remote() and w.remote is not None:  # figures a remote does not report: said so, not guessed
            if not generating:
                self.engine_label.setText(f"● Remote: {w.remote.host() or 'no URL set'}")
            # the server's figure, once it reported one (not the local engine's last)
            rate_s = None if generating or not w.session.last_tok_s_remote else w.session.last_tok_s
            self.speed_label.setText(f"{rate_s:.1f} tok/s (remote)" if rate_s else "tok/s unavailable (remote)")
            self.hit_label.setText("Expert cache unavailable (remote)")
        w.chat_actions.update_send_state()

    def _show_memory(self, sample: Mapping[str, Any]) -> None:
        vram_used, vram_total = sample.get("vram_used"), sample.get("vram_total")
        if vram_used is not None and vram_total:
            self.vram_label.setText(f"VRAM {vram_used / GIB:.1f}/{vram_total / GIB:.0f} GiB")
        else:
            self.vram_label.setText("VRAM –")
        ram_used, ram_total = sample.get("ram_used"), sample.get("ram_total")
        if ram_used is not None and ram_total:
            self.ram_label.setText(f"RAM {ram_used / GIB:.1f}/{ram_total / GIB:.0f} GiB")
        else:
            self.ram_label.setText("RAM –")
