"""The Clover Desk window: conversations on the left, the chat in the middle, live panels on the right.

The window talks to the engine only through an ``EngineClient`` (a worker process behind Qt signals) and to the
disk only through a ``ChatStore``; both are passed in (see ``clover_desk.app``). Every engine event lands in
:meth:`MainWindow.on_engine_event`, which updates plain state (:class:`~ui.chat_view.StreamingReply`,
:class:`~ui.denoise_view.DenoiseModel`) and asks throttled views to repaint: the GUI thread only paints.

A reply is saved as it streams: each committed block appends its text to the store in one transaction
(``append_streaming``), so a crash of the engine or of the app loses at most the block in flight.

A save that fails (a full disk, a read-only folder: ``StorageError``) is shown in the info banner and never loses
what the user typed: the composer is cleared only once a send is saved. A per-block save that fails mid-answer
stops the generation (cancel sent, back to idle) and keeps the answer on screen, marked as not saved.

When the user opens the preview of the answer being streamed, the preview follows it: every answer delta hands the
page so far to the preview (whose own throttle coalesces the reloads) and the end of the answer flushes the last
one. Opening another message's preview shows that page and stops following.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol, cast

from PySide6.QtCore import QSize, Qt, QTimer, Signal
from PySide6.QtGui import QCloseEvent, QKeyEvent, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QFrame,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QMenu,
    QMessageBox,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QSplitter,
    QStackedWidget,
    QStatusBar,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from clover_desk.storage import StorageError
from engine.events import (
    BlockCommitted,
    BlockStep,
    EngineError,
    Finished,
    GenerationParams,
    LoadProgress,
    PromptInfo,
    TextDelta,
)
from ui.chat_view import ChatView, HtmlExtractor, MessageData, PreviewRequest, StreamingReply, preview_document_id
from ui.denoise_view import DenoiseView
from ui.throttle import Throttle

log = logging.getLogger(__name__)

GIB = 1024**3


# --------------------------------------------------------------------------------------------- plain logic


@dataclass(frozen=True)
class GenerationSettings:
    """What the settings drawer edits; stored per conversation (``Conversation.settings``)."""

    mode: str = "diffusion"  # "diffusion" | "ar"
    temperature: float = 0.0
    block_size: int = 32
    threshold: float = 0.9
    max_new_tokens: int = 1024
    enable_thinking: bool = True
    expand_thinking: bool = False  # display only: show the thinking section open by default

    def to_params(self, enable_thinking: bool | None = None) -> GenerationParams:
        return GenerationParams(
            mode=self.mode,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            do_sample=self.temperature > 0,
            block_size=self.block_size if self.mode == "diffusion" else None,
            threshold=self.threshold if self.mode == "diffusion" else None,
            enable_thinking=self.enable_thinking if enable_thinking is None else enable_thinking,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> GenerationSettings:
        defaults = cls()
        known = {k: v for k, v in (data or {}).items() if k in asdict(defaults)}
        try:
            return replace(defaults, **known)
        except TypeError:
            log.warning("ignoring malformed conversation settings %r", data)
            return defaults


def finished_stats(event: Finished, mode: str) -> dict[str, Any]:
    """The per-message statistics kept with an answer (shown under it, exported with it)."""
    stats: dict[str, Any] = {
        "mode": mode,
        "tokens": event.tokens,
        "passes": event.passes,
        "tokens_per_pass": round(event.tokens_per_pass, 3),
        "tokens_per_s": round(event.tokens_per_s, 3),
        "time_to_first_token_s": event.time_to_first_token_s,
        "prompt_tokens": event.prompt_tokens,
        "prefill_s": round(event.prefill_s, 4),
        "decode_s": round(event.decode_s, 4),
        "stop_reason": event.stop_reason,
    }
    rate = expert_hit_rate(event.accounting)
    if rate is not None:
        stats["expert_hit_rate"] = rate
    return stats


def expert_hit_rate(accounting: dict[str, Any] | None) -> float | None:
    """Expert slot-pool hit rate from ``Finished.accounting`` (engine.offload: ``hit_rate``, ``slot_hits`` /
    ``slot_misses``), or None when nothing was streamed."""
    if not accounting:
        return None
    hits = accounting.get("slot_hits", accounting.get("hits"))
    misses = accounting.get("slot_misses", accounting.get("misses"))
    if isinstance(hits, (int, float)) and isinstance(misses, (int, float)) and hits + misses == 0:
        return None  # nothing was looked up in the slot pool (every expert resident): no rate to show
    for key in ("hit_rate", "expert_hit_rate", "cache_hit_rate"):
        if isinstance(accounting.get(key), (int, float)):
            return float(accounting[key])
    if isinstance(hits, (int, float)) and isinstance(misses, (int, float)) and hits + misses > 0:
        return float(hits) / float(hits + misses)
    return None


def title_from_text(text: str, max_chars: int = 48) -> str:
    """A chat title from the first message: its first non-empty line, cut at a word boundary."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if len(line) <= max_chars:
        return line or "New chat"
    cut = line[:max_chars].rsplit(" ", 1)[0] or line[:max_chars]
    return cut.rstrip(" ,.;:") + "…"


class SystemMonitor:
    """RAM (psutil) and VRAM (NVML, when present) in use. Cheap enough for a 2 s timer on the GUI thread."""

    def __init__(self) -> None:
        self._nvml_handle: Any = None
        self._nvml_tried = False

    def _nvml(self) -> Any:
        if not self._nvml_tried:
            self._nvml_tried = True
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml_handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            except Exception as exc:  # noqa: BLE001 - no driver / no GPU / no pynvml: VRAM is simply not shown
                log.debug("NVML unavailable: %s", exc)
                self._nvml_handle = None
        return self._nvml_handle

    def sample(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {"ram_used": None, "ram_total": None, "vram_used": None, "vram_total": None}
        try:
            import psutil

            vm = psutil.virtual_memory()
            out["ram_used"], out["ram_total"] = int(vm.total - vm.available), int(vm.total)
        except (ImportError, OSError) as exc:
            log.debug("psutil unavailable: %s", exc)
        handle = self._nvml()
        if handle is not None:
            try:
                import pynvml

                info = pynvml.nvmlDeviceGetMemoryInfo(handle)
                out["vram_used"], out["vram_total"] = int(info.used), int(info.total)
            except Exception as exc:  # noqa: BLE001 - a transient NVML error only hides the figure
                log.debug("NVML memory query failed: %s", exc)
        return out


class HtmlPreview(Protocol):
    """What the window needs from the preview tab (``ui.preview.PreviewPane``)."""

    def set_html(self, text: str, document_id: str | None = None) -> None: ...  # throttled
    def flush(self) -> None: ...  # show the latest text now


class Recorder(Protocol):
    """Saves one streaming answer from its events (``clover_desk.storage.StreamRecorder``)."""

    def on_event(self, event: object) -> bool: ...


RecorderFactory = Callable[[Any, int], Recorder]  # (store, assistant message id) -> recorder


# --------------------------------------------------------------------------------------------- small widgets


class PromptEdit(QPlainTextEdit):
    """The message box: Enter sends, Shift+Enter adds a line, Esc stops (or cancels an edit)."""

    submitted = Signal()  # Enter pressed: send the text
    escapePressed = Signal()  # Esc pressed: stop the generation / leave edit mode

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
            else:
                self.submitted.emit()
            return
        if event.key() == Qt.Key.Key_Escape:
            self.escapePressed.emit()
            return
        super().keyPressEvent(event)


class Composer(QFrame):
    """Input box with the per-message Think toggle and the Send / Stop button."""

    sendRequested = Signal(str)  # text to send (already stripped, never empty)
    stopRequested = Signal()  # stop the running generation
    editCancelled = Signal()  # the user left edit mode without sending

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("composer")
        self.generating = False
        self.editing: MessageData | None = None
        self.input = PromptEdit()
        self.input.setObjectName("composerInput")
        self.input.setPlaceholderText("Message Clover…  (Enter to send, Shift+Enter for a new line)")
        self.input.setFixedHeight(72)
        self.edit_note = QLabel()
        self.edit_note.setObjectName("warnText")
        self.edit_note.setVisible(False)
        self.think_button = QPushButton("Think")
        self.think_button.setObjectName("chip")
        self.think_button.setCheckable(True)
        self.think_button.setChecked(True)
        self.think_button.setToolTip("Let the model think before answering (this message)")
        self.mode_label = QLabel()
        self.mode_label.setObjectName("faint")
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("sendButton")
        self.send_button.setCursor(Qt.CursorShape.PointingHandCursor)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 8)
        layout.setSpacing(4)
        layout.addWidget(self.edit_note)
        layout.addWidget(self.input)
        row = QHBoxLayout()
        row.addWidget(self.think_button)
        row.addWidget(self.mode_label)
        row.addStretch(1)
        row.addWidget(self.send_button)
        layout.addLayout(row)
        self._connect_signals()

    def _connect_signals(self) -> None:
        self.input.submitted.connect(self.on_submit)
        self.input.escapePressed.connect(self.on_escape)
        self.send_button.clicked.connect(self.on_send_clicked)

    def set_generating(self, on: bool) -> None:
        self.generating = on
        self.send_button.setText("Stop" if on else "Send")
        self.send_button.setObjectName("stopButton" if on else "sendButton")
        self.send_button.style().unpolish(self.send_button)
        self.send_button.style().polish(self.send_button)

    def begin_edit(self, data: MessageData) -> None:
        self.editing = data
        self.input.setPlainText(data.content)
        self.edit_note.setText("Editing a message: Enter resends it (later messages are replaced), Esc cancels")
        self.edit_note.setVisible(True)
        self.input.setFocus()

    def end_edit(self) -> None:
        self.editing = None
        self.edit_note.setVisible(False)

    def on_send_clicked(self) -> None:
        if self.generating:
            self.stopRequested.emit()
        else:
            self.on_submit()

    def on_submit(self) -> None:
        if self.generating:
            return
        text = self.input.toPlainText().strip()
        if not text:
            return
        self.sendRequested.emit(text)  # the window clears the box once the message is saved (kept if not)

    def on_escape(self) -> None:
        if self.generating:
            self.stopRequested.emit()
        elif self.editing is not None:
            self.end_edit()
            self.input.clear()
            self.editCancelled.emit()


class SettingsDrawer(QFrame):
    """System prompt and sampling settings for the current conversation."""

    changed = Signal()  # any setting changed (read them back with settings() / system_prompt())
    closeRequested = Signal()  # the drawer's Done button

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("settingsDrawer")
        title = QLabel("Chat settings")
        title.setObjectName("convTitle")
        self.done_button = QPushButton("Done")
        self.done_button.setObjectName("ghost")
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setPlaceholderText("You are a helpful assistant…")
        self.system_prompt.setFixedHeight(110)
        self.mode = QComboBox()
        self.mode.addItem("Block diffusion", "diffusion")
        self.mode.addItem("Autoregressive", "ar")
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0.0, 2.0)
        self.temperature.setSingleStep(0.05)
        self.temperature.setToolTip("0 = greedy (deterministic)")
        self.block_size = QComboBox()
        for n in (8, 16, 32, 64):
            self.block_size.addItem(str(n), n)
        self.threshold = QDoubleSpinBox()
        self.threshold.setRange(0.0, 1.0)
        self.threshold.setSingleStep(0.05)
        self.threshold.setToolTip("Commit every slot whose confidence is at least this (at least one per pass)")
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(16, 32768)
        self.max_tokens.setSingleStep(128)
        self.thinking = QCheckBox("Think before answering")
        self.expand_thinking = QCheckBox("Show thinking expanded")
        self.expand_thinking.setToolTip("Open the thinking section of answers by default (it can always be toggled)")
        form = QFormLayout()
        form.setLabelAlignment(Qt.AlignmentFlag.AlignLeft)
        form.setVerticalSpacing(10)
        form.addRow("Mode", self.mode)
        form.addRow("Temperature", self.temperature)
        form.addRow("Block size", self.block_size)
        form.addRow("Threshold", self.threshold)
        form.addRow("Max tokens", self.max_tokens)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 16, 16, 16)
        layout.setSpacing(10)
        top = QHBoxLayout()
        top.addWidget(title)
        top.addStretch(1)
        top.addWidget(self.done_button)
        layout.addLayout(top)
        scope = QLabel("Saved with this chat. Think can also be switched per message next to the input box.")
        scope.setObjectName("muted")
        scope.setWordWrap(True)
        layout.addWidget(scope)
        prompt_label = QLabel("SYSTEM PROMPT")
        prompt_label.setObjectName("sectionTitle")
        layout.addWidget(prompt_label)
        layout.addWidget(self.system_prompt)
        sampling = QLabel("GENERATION")
        sampling.setObjectName("sectionTitle")
        layout.addWidget(sampling)
        layout.addLayout(form)
        layout.addWidget(self.thinking)
        layout.addWidget(self.expand_thinking)
        hints = QLabel(
            "<b>Block diffusion</b> fills a block of masked slots per step; <b>threshold</b>: every slot at least "
            "this confident is committed in a pass (at least one), so lower is faster and riskier. "
            "<b>Block size</b> is the number of slots per block. <b>Temperature</b> 0 is greedy. "
            "<b>Autoregressive</b> writes one token per step."
        )
        hints.setObjectName("muted")
        hints.setWordWrap(True)
        layout.addWidget(hints)
        layout.addStretch(1)
        self.set_settings(GenerationSettings(), "")
        self._connect_signals()

    def _connect_signals(self) -> None:
        for sig in (
            self.mode.currentIndexChanged,
            self.block_size.currentIndexChanged,
            self.temperature.valueChanged,
            self.threshold.valueChanged,
            self.max_tokens.valueChanged,
            self.thinking.toggled,
            self.expand_thinking.toggled,
            self.system_prompt.textChanged,
        ):
            sig.connect(self.on_any_changed)
        self.done_button.clicked.connect(self.closeRequested)

    def set_settings(self, s: GenerationSettings, system_prompt: str) -> None:
        widgets = (self.mode, self.block_size, self.temperature, self.threshold, self.max_tokens, self.thinking,
                   self.expand_thinking, self.system_prompt)
        for w in widgets:
            w.blockSignals(True)
        self.mode.setCurrentIndex(max(0, self.mode.findData(s.mode)))
        self.block_size.setCurrentIndex(max(0, self.block_size.findData(s.block_size)))
        self.temperature.setValue(s.temperature)
        self.threshold.setValue(s.threshold)
        self.max_tokens.setValue(s.max_new_tokens)
        self.thinking.setChecked(s.enable_thinking)
        self.expand_thinking.setChecked(s.expand_thinking)
        self.system_prompt.setPlainText(system_prompt)
        for w in widgets:
            w.blockSignals(False)
        self._update_enabled()

    def settings(self) -> GenerationSettings:
        return GenerationSettings(
            mode=str(self.mode.currentData()),
            temperature=float(self.temperature.value()),
            block_size=int(self.block_size.currentData()),
            threshold=float(self.threshold.value()),
            max_new_tokens=int(self.max_tokens.value()),
            enable_thinking=self.thinking.isChecked(),
            expand_thinking=self.expand_thinking.isChecked(),
        )

    def system_prompt_text(self) -> str:
        return self.system_prompt.toPlainText().strip()

    def _update_enabled(self) -> None:
        diffusion = self.mode.currentData() == "diffusion"
        self.block_size.setEnabled(diffusion)
        self.threshold.setEnabled(diffusion)

    def on_any_changed(self, *_args: object) -> None:
        self._update_enabled()
        self.changed.emit()


class ConversationSidebar(QFrame):
    """New chat, search, and the list of conversations (rename in place, delete and export from the menu)."""

    newRequested = Signal()  # start a new conversation
    selected = Signal(int)  # conversation id chosen
    renameRequested = Signal(int, str)  # (conversation id, new title)
    deleteRequested = Signal(int)  # conversation id to delete (after confirmation)
    exportRequested = Signal(int, str)  # (conversation id, "markdown" | "json")
    searchChanged = Signal(str)  # the search text
    modelsRequested = Signal()  # open the model manager page

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("sidebar")
        self.setFixedWidth(260)
        title = QLabel("☘ Clover Desk")
        title.setObjectName("appTitle")
        self.new_button = QPushButton("+  New chat")
        self.new_button.setObjectName("newChat")
        self.new_button.setToolTip("New chat (Ctrl+N)")
        self.search = QLineEdit()
        self.search.setObjectName("search")
        self.search.setPlaceholderText("Search chats")
        self.search.setClearButtonEnabled(True)
        self.list = QListWidget()
        self.list.setObjectName("conversationList")
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.setEditTriggers(QListWidget.EditTrigger.EditKeyPressed)
        self.list.setWordWrap(True)
        # titles wrap inside the sidebar's width; never a horizontal scroll bar under the list
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setResizeMode(QListWidget.ResizeMode.Adjust)
        self.models_button = QPushButton("Models")
        self.models_button.setObjectName("ghost")
        self.models_button.setToolTip("Download, choose and quantize models")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 14, 12, 10)
        layout.setSpacing(10)
        layout.addWidget(title)
        layout.addWidget(self.new_button)
        layout.addWidget(self.search)
        recent = QLabel("CHATS")
        recent.setObjectName("sectionTitle")
        layout.addWidget(recent)
        layout.addWidget(self.list, 1)
        layout.addWidget(self.models_button, 0, Qt.AlignmentFlag.AlignLeft)
        self._filling = False
        self._connect_signals()

    def _connect_signals(self) -> None:
        self.new_button.clicked.connect(self.newRequested)
        self.models_button.clicked.connect(self.modelsRequested)
        self.search.textChanged.connect(self.searchChanged)
        self.list.currentItemChanged.connect(self.on_current_changed)
        self.list.itemChanged.connect(self.on_item_changed)
        self.list.customContextMenuRequested.connect(self.on_context_menu)

    def set_items(self, items: list[tuple[int, str, str]], current: int | None) -> None:
        """``items``: (conversation id, title, snippet or "")."""
        self._filling = True
        self.list.clear()
        for cid, title, snippet in items:
            item = QListWidgetItem(title)
            item.setData(Qt.ItemDataRole.UserRole, cid)
            item.setToolTip(snippet or title)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
            self.list.addItem(item)
            if cid == current:
                self.list.setCurrentItem(item)
        self._filling = False

    def current_id(self) -> int | None:
        item = self.list.currentItem()
        return None if item is None else int(item.data(Qt.ItemDataRole.UserRole))

    def item_for(self, cid: int) -> QListWidgetItem | None:
        for i in range(self.list.count()):
            if self.list.item(i).data(Qt.ItemDataRole.UserRole) == cid:
                return self.list.item(i)
        return None

    def start_rename(self, cid: int) -> None:
        item = self.item_for(cid)
        if item is not None:
            self.list.editItem(item)

    def on_current_changed(self, current: QListWidgetItem | None, _previous: QListWidgetItem | None) -> None:
        if current is not None and not self._filling:
            self.selected.emit(int(current.data(Qt.ItemDataRole.UserRole)))

    def on_item_changed(self, item: QListWidgetItem) -> None:
        if not self._filling and item.text().strip():
            self.renameRequested.emit(int(item.data(Qt.ItemDataRole.UserRole)), item.text().strip())

    def on_context_menu(self, pos: Any) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        cid = int(item.data(Qt.ItemDataRole.UserRole))
        menu = QMenu(self)
        rename = menu.addAction("Rename")
        export_md = menu.addAction("Export as Markdown…")
        export_json = menu.addAction("Export as JSON…")
        menu.addSeparator()
        delete = menu.addAction("Delete")
        chosen = menu.exec(self.list.viewport().mapToGlobal(pos))
        if chosen is rename:
            self.list.editItem(item)
        elif chosen is export_md:
            self.exportRequested.emit(cid, "markdown")
        elif chosen is export_json:
            self.exportRequested.emit(cid, "json")
        elif chosen is delete:
            self.deleteRequested.emit(cid)


class Banner(QFrame):
    """A one-line notice across the chat with an optional action button and a close button."""

    actionClicked = Signal()  # the banner's action (e.g. "Restart engine")

    def __init__(self, object_name: str, action_text: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName(object_name)
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.action = QPushButton(action_text)
        self.action.setObjectName("primary")
        self.action.setVisible(bool(action_text))
        self.close_button = QPushButton("✕")
        self.close_button.setObjectName("ghost")
        self.close_button.setFixedWidth(30)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(14, 8, 8, 8)
        layout.addWidget(self.label, 1)
        layout.addWidget(self.action)
        layout.addWidget(self.close_button)
        self.action.clicked.connect(self.actionClicked)
        self.close_button.clicked.connect(self.hide)
        self.hide()

    def show_message(self, text: str) -> None:
        self.label.setText(text)
        self.show()


class LoadBanner(QFrame):
    """Model loading progress with a Cancel button."""

    cancelRequested = Signal()  # stop loading the model

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("loadBanner")
        self.label = QLabel("Loading model…")
        self.detail = QLabel()
        self.detail.setObjectName("muted")
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.bar.setFixedHeight(8)
        self.cancel = QPushButton("Cancel")
        top = QHBoxLayout()
        top.addWidget(self.label)
        top.addStretch(1)
        top.addWidget(self.detail)
        top.addWidget(self.cancel)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(14, 8, 10, 10)
        layout.addLayout(top)
        layout.addWidget(self.bar)
        self.cancel.clicked.connect(self.cancelRequested)
        self.hide()

    def set_progress(self, event: LoadProgress) -> None:
        stage = {"reading": "Reading weights", "quantizing": "Quantizing", "writing-cache": "Writing cache",
                 "placing": "Placing on the GPU", "done": "Loaded"}.get(event.stage, event.stage)
        self.label.setText(f"{stage}…" if event.stage != "done" else stage)
        if event.total_bytes > 0:
            self.bar.setRange(0, 1000)
            self.bar.setValue(int(1000 * event.done_bytes / event.total_bytes))
            detail = f"{event.done_bytes / GIB:.1f} / {event.total_bytes / GIB:.1f} GiB"
            if event.eta_s:
                detail += f" · {int(event.eta_s)} s left"
            self.detail.setText(detail)
        else:
            self.bar.setRange(0, 0)  # busy indicator
            self.detail.setText(event.current)
        self.show()


# --------------------------------------------------------------------------------------------- the window


class MainWindow(QMainWindow):
    """Composition of the views above around one EngineClient and one ChatStore."""

    conversationChanged = Signal(int)  # the conversation shown (id)
    generationStarted = Signal(str)  # request id
    generationFinished = Signal(str, str)  # (request id, stop reason | "error" | "crashed")
    modelChosen = Signal(str)  # a model folder was picked in the model manager (the app loads it)
    applyPlanRequested = Signal(object, int)  # (vram bytes as int, ctx tokens) from the VRAM panel

    def __init__(
        self,
        client: Any,  # clover_desk.engine_client.EngineClient (signals: ready, loadProgress, loaded, event, ...)
        store: Any,  # clover_desk.storage.ChatStore
        recorder_factory: RecorderFactory,
        *,
        model_dir: str | None = None,
        vram_panel: QWidget | None = None,
        preview: QWidget | None = None,  # a QWidget that is also an HtmlPreview
        model_manager: QWidget | None = None,
        html_extractor: HtmlExtractor | None = None,
        monitor: SystemMonitor | None = None,
        gpu_name: str | None = None,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Clover Desk")
        self.resize(1480, 900)
        self.client = client
        self.store = store
        self._new_recorder = recorder_factory
        self.recorder: Any = None  # saves the streaming answer (clover_desk.storage.StreamRecorder)
        self.model_dir = model_dir
        self.monitor = monitor
        self.gpu_name = gpu_name
        self.conversation_id: int | None = None
        self.request_id: str | None = None
        self.reply: StreamingReply | None = None
        self.reply_data: MessageData | None = None
        self.reply_mode = "diffusion"
        self.preview_follows: MessageData | None = None  # the streaming answer the preview shows as it grows
        self.engine_state = "starting"  # starting | loading | ready | crashed | no-model
        self.last_tok_s: float | None = None
        self.last_hit_rate: float | None = None

        # -- views
        self.sidebar = ConversationSidebar()
        self.chat = ChatView(html_extractor)
        self.composer = Composer()
        self.drawer = SettingsDrawer()
        self.crash_banner = Banner("crashBanner", "Restart engine")
        self.info_banner = Banner("infoBanner")
        self.load_banner = LoadBanner()
        self.denoise = DenoiseView()
        self.denoise.setObjectName("denoiseView")
        self.vram_panel = vram_panel
        self.preview = preview
        self.model_manager = model_manager
        self.title_label = QLabel("New chat")
        self.title_label.setObjectName("convTitle")
        self.model_label = QLabel()
        self.model_label.setObjectName("muted")
        self.settings_button = QPushButton("Settings")
        self.settings_button.setObjectName("ghost")
        self.settings_button.setCheckable(True)
        self.settings_button.setToolTip("System prompt, temperature, block size, threshold… (Ctrl+,)")
        self.panel_button = QPushButton("Panels")
        self.panel_button.setObjectName("ghost")
        self.panel_button.setCheckable(True)
        self.panel_button.setChecked(True)
        self.panel_button.setToolTip("Show or hide the denoising / VRAM / preview panels")
        self.tabs = QTabWidget()
        self.tabs.setObjectName("sideTabs")
        self.tabs.setDocumentMode(True)
        self.tabs.addTab(self.denoise, "Denoising")
        if vram_panel is not None:
            self.tabs.addTab(vram_panel, "VRAM")
        if preview is not None:
            self.tabs.addTab(preview, "Preview")
        self.pages = QStackedWidget()
        self.chat_page = self._build_chat_page()
        self.pages.addWidget(self.chat_page)
        if model_manager is not None:
            self.pages.addWidget(self._build_models_page(model_manager))
        self._build_status_bar()
        self._build_layout()
        self._build_shortcuts()
        self.status_throttle = Throttle(self.refresh_status, 250, self)
        self.monitor_timer = QTimer(self)
        self.monitor_timer.setInterval(2000)
        self._connect_signals()
        if self.monitor is not None:
            self.monitor_timer.start()
        self.reload_conversations()
        conversations = self.store.list_conversations(limit=1)
        if conversations:
            self.open_conversation(conversations[0].id)
        if model_dir is None and model_manager is not None:
            self.engine_state = "no-model"
            self.show_models_page()
        self.refresh_status()

    # ----------------------------------------------------------------- construction
    def _build_chat_page(self) -> QWidget:
        page = QWidget()
        page.setObjectName("chatPage")
        header = QFrame()
        header.setObjectName("chatHeader")
        h = QHBoxLayout(header)
        h.setContentsMargins(20, 10, 12, 10)
        h.addWidget(self.title_label)
        h.addSpacing(10)
        h.addWidget(self.model_label)
        h.addStretch(1)
        h.addWidget(self.settings_button)
        h.addWidget(self.panel_button)
        center = QWidget()
        c = QVBoxLayout(center)
        c.setContentsMargins(0, 0, 0, 0)
        c.setSpacing(0)
        banners = QVBoxLayout()
        banners.setContentsMargins(20, 8, 20, 0)
        banners.setSpacing(6)
        banners.addWidget(self.crash_banner)
        banners.addWidget(self.info_banner)
        banners.addWidget(self.load_banner)
        c.addLayout(banners)
        c.addWidget(self.chat, 1)
        composer_row = QHBoxLayout()
        composer_row.setContentsMargins(20, 6, 20, 14)
        composer_row.addWidget(self.composer)
        c.addLayout(composer_row)
        body = QHBoxLayout()
        body.setContentsMargins(0, 0, 0, 0)
        body.setSpacing(0)
        body.addWidget(center, 1)
        layout = QVBoxLayout(page)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        layout.addWidget(header)
        layout.addLayout(body, 1)
        return page

    def _build_models_page(self, manager: QWidget) -> QWidget:
        page = QWidget()
        page.setObjectName("chatPage")
        layout = QVBoxLayout(page)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(manager)
        return page

    def _build_layout(self) -> None:
        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.setChildrenCollapsible(False)
        self.splitter.setHandleWidth(1)
        # the right side: the panels, or the settings drawer slid over them (the chat keeps its width)
        self.side = QStackedWidget()
        self.side.setObjectName("sidePanel")
        self.side.addWidget(self.tabs)
        self.side.addWidget(self.drawer)
        self.splitter.addWidget(self.pages)
        self.splitter.addWidget(self.side)
        self.splitter.setStretchFactor(0, 3)
        self.splitter.setStretchFactor(1, 0)
        self.splitter.setSizes([880, 520])
        self.side.setMinimumWidth(400)
        central = QWidget()
        central.setObjectName("centralArea")
        layout = QHBoxLayout(central)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        layout.addWidget(self.sidebar)
        layout.addWidget(self.splitter, 1)
        self.setCentralWidget(central)

    def _build_status_bar(self) -> None:
        bar = QStatusBar()
        bar.setSizeGripEnabled(False)
        self.setStatusBar(bar)
        self.engine_label = QLabel()
        self.gpu_label = QLabel()
        self.vram_label = QLabel()
        self.ram_label = QLabel()
        self.speed_label = QLabel()
        self.hit_label = QLabel()
        bar.addWidget(self.engine_label)
        for w in (self.gpu_label, self.vram_label, self.ram_label, self.speed_label, self.hit_label):
            bar.addPermanentWidget(w)

    def _build_shortcuts(self) -> None:
        QShortcut(QKeySequence.StandardKey.New, self, activated=self.on_new_conversation)
        QShortcut(QKeySequence("Ctrl+,"), self, activated=self.settings_button.toggle)
        QShortcut(QKeySequence("Ctrl+Shift+R"), self, activated=self.on_regenerate_last)
        QShortcut(QKeySequence("Ctrl+K"), self, activated=self.sidebar.search.setFocus)

    def _connect_signals(self) -> None:
        # engine
        self.client.event.connect(self.on_engine_event)
        self.client.loadProgress.connect(self.on_load_progress)
        self.client.loaded.connect(self.on_engine_loaded)
        self.client.ready.connect(self.on_engine_ready)
        self.client.errorMessage.connect(self.on_engine_error_message)
        self.client.crashed.connect(self.on_engine_crashed)
        # sidebar
        self.sidebar.newRequested.connect(self.on_new_conversation)
        self.sidebar.selected.connect(self.on_conversation_selected)
        self.sidebar.renameRequested.connect(self.on_rename_requested)
        self.sidebar.deleteRequested.connect(self.on_delete_requested)
        self.sidebar.exportRequested.connect(self.on_export_requested)
        self.sidebar.searchChanged.connect(self.on_search_changed)
        self.sidebar.modelsRequested.connect(self.show_models_page)
        # chat
        self.composer.sendRequested.connect(self.on_send_requested)
        self.composer.stopRequested.connect(self.on_stop_requested)
        self.chat.editRequested.connect(self.on_edit_requested)
        self.chat.regenerateRequested.connect(self.on_regenerate_requested)
        self.chat.previewRequested.connect(self.on_preview_requested)
        self.chat.copied.connect(self.on_copied)
        self.drawer.changed.connect(self.on_settings_changed)
        self.drawer.closeRequested.connect(lambda: self.settings_button.setChecked(False))
        self.settings_button.toggled.connect(self.on_settings_toggled)
        self.panel_button.toggled.connect(self.on_panels_toggled)
        # banners
        self.crash_banner.actionClicked.connect(self.on_restart_clicked)
        self.load_banner.cancelRequested.connect(self.on_cancel_load)
        self.info_banner.actionClicked.connect(self.on_open_vram_tab)
        # panels
        if self.vram_panel is not None and hasattr(self.vram_panel, "applyRequested"):
            self.vram_panel.applyRequested.connect(self.on_apply_plan)
        if self.model_manager is not None and hasattr(self.model_manager, "modelChosen"):
            self.model_manager.modelChosen.connect(self.on_model_chosen)
        self.monitor_timer.timeout.connect(self.refresh_status)

    # ----------------------------------------------------------------- conversations
    def reload_conversations(self, query: str = "") -> None:
        if query.strip():
            items = [(h.conversation.id, h.conversation.title, h.snippet) for h in self.store.search(query)]
        else:
            items = [(c.id, c.title, "") for c in self.store.list_conversations()]
        self.sidebar.set_items(items, self.conversation_id)

    def open_conversation(self, conversation_id: int | None) -> None:
        if self.is_generating():
            self.on_stop_requested()
        self.conversation_id = conversation_id
        self.composer.end_edit()
        if conversation_id is None:
            self.chat.clear()
            self.title_label.setText("New chat")
            self.drawer.set_settings(self.drawer.settings(), "")
            return
        conv = self.store.get_conversation(conversation_id)
        self.title_label.setText(conv.title)
        self.drawer.set_settings(GenerationSettings.from_dict(conv.settings), conv.system_prompt)
        self.composer.think_button.setChecked(self.drawer.settings().enable_thinking)
        self.chat.expand_thinking = self.drawer.settings().expand_thinking
        self.chat.set_messages(
            [
                MessageData(m.role, m.content, m.thinking, m.thinking_seconds, m.status, dict(m.stats), m.id)
                for m in self.store.messages(conversation_id)
                if m.role in ("user", "assistant")
            ]
        )
        self.show_chat_page()
        self.conversationChanged.emit(conversation_id)

    def _ensure_conversation(self, first_text: str) -> int:
        if self.conversation_id is None:
            conv = self.store.create_conversation(
                title=title_from_text(first_text),
                system_prompt=self.drawer.system_prompt_text(),
                settings=asdict(self.drawer.settings()),
            )
            self.conversation_id = conv.id
            self.title_label.setText(conv.title)
            self.reload_conversations(self.sidebar.search.text())
            self.conversationChanged.emit(conv.id)
        return self.conversation_id

    def on_new_conversation(self) -> None:
        self.open_conversation(None)
        self.sidebar.list.clearSelection()
        self.sidebar.list.setCurrentItem(None)
        self.show_chat_page()
        self.composer.input.setFocus()

    def on_conversation_selected(self, conversation_id: int) -> None:
        if conversation_id != self.conversation_id:
            self.open_conversation(conversation_id)

    def on_rename_requested(self, conversation_id: int, title: str) -> None:
        try:
            self.store.rename_conversation(conversation_id, title)
        except StorageError as exc:
            self.show_save_error(exc, "The chat was not renamed")
            QTimer.singleShot(0, lambda: self.reload_conversations(self.sidebar.search.text()))
            return
        if conversation_id == self.conversation_id:
            self.title_label.setText(title)
        QTimer.singleShot(0, lambda: self.reload_conversations(self.sidebar.search.text()))

    def on_delete_requested(self, conversation_id: int) -> None:
        answer = QMessageBox.question(self, "Delete chat", "Delete this chat and all its messages?")
        if answer == QMessageBox.StandardButton.Yes:
            self.delete_conversation(conversation_id)

    def delete_conversation(self, conversation_id: int) -> None:
        if conversation_id == self.conversation_id and self.is_generating():
            self.recorder = None  # its message is about to go: nothing more to save
        if conversation_id == self.conversation_id:
            self.open_conversation(None)
        try:
            self.store.delete_conversation(conversation_id)
        except StorageError as exc:
            self.show_save_error(exc, "The chat was not deleted")
        self.reload_conversations(self.sidebar.search.text())

    def on_export_requested(self, conversation_id: int, fmt: str) -> None:
        suffix = ".md" if fmt == "markdown" else ".json"
        title = self.store.get_conversation(conversation_id).title
        safe = "".join(ch if ch.isalnum() or ch in " -_" else "_" for ch in title).strip() or "chat"
        path, _ = QFileDialog.getSaveFileName(self, "Export chat", str(Path.home() / f"{safe}{suffix}"))
        if path:
            self.export_conversation(conversation_id, fmt, path)

    def export_conversation(self, conversation_id: int, fmt: str, path: str) -> Path | None:
        try:
            out = (self.store.export_markdown if fmt == "markdown" else self.store.export_json)(conversation_id, path)
        except (OSError, StorageError) as exc:
            self.show_save_error(exc, f"The chat was not exported to {path}")
            return None
        self.statusBar().showMessage(f"Exported to {out}", 5000)
        return out

    def on_search_changed(self, text: str) -> None:
        self.reload_conversations(text)

    def on_settings_changed(self) -> None:
        settings = self.drawer.settings()
        self.composer.think_button.setChecked(settings.enable_thinking)
        self.chat.set_expand_thinking(settings.expand_thinking)
        self.composer.mode_label.setText("" if settings.mode == "diffusion" else "autoregressive")
        if self.conversation_id is not None:
            try:
                self.store.update_conversation(
                    self.conversation_id, system_prompt=self.drawer.system_prompt_text(), settings=asdict(settings)
                )
            except StorageError as exc:
                self.show_save_error(exc, "The chat settings were not saved")

    # ----------------------------------------------------------------- sending
    def is_generating(self) -> bool:
        return self.request_id is not None

    def on_send_requested(self, text: str) -> None:
        """Save the message (or the edit) and start the answer; the composer is cleared only when both were saved.
        A failed save leaves the typed text (and edit mode) in the composer and says why in the banner."""
        if self.is_generating():
            return
        editing = self.composer.editing
        sent: MessageData | None = None
        try:
            if editing is not None and editing.message_id is not None and editing in self.chat.messages():
                self.store.edit_message(editing.message_id, text)  # repeatable: a retry after a failure re-edits
                index = self.chat.index_of(editing)
                self.chat.remove_from(index + 1)
                editing.content = text
                self.chat.widgets[index].refresh()
            else:
                if editing is not None:
                    self.composer.end_edit()
                cid = self._ensure_conversation(text)
                saved = self.store.add_message(cid, "user", text)
                sent = MessageData("user", text, message_id=saved.id)
                self.chat.add_message(sent)
            self._start_generation()
        except StorageError as exc:
            if sent is not None:  # saved, but no answer could be started: take it back so a retry sends it once
                self._take_back(sent)
            self.show_save_error(exc, "Your message was not sent (it is still in the box)")
            return
        self.composer.end_edit()
        self.composer.input.clear()

    def _take_back(self, sent: MessageData) -> None:
        assert sent.message_id is not None
        try:
            self.store.truncate_after(sent.message_id, include=True)
        except StorageError as exc:
            log.warning("cannot take back message %s after a failed send: %s", sent.message_id, exc)
            return
        if sent in self.chat.messages():
            self.chat.remove_from(self.chat.index_of(sent))

    def _start_generation(self) -> None:
        cid = self.conversation_id
        assert cid is not None
        settings = self.drawer.settings()
        params = settings.to_params(enable_thinking=self.composer.think_button.isChecked())
        messages = self.store.chat_messages(cid)
        saved = self.store.add_message(cid, "assistant", "", status="streaming", stats={"mode": settings.mode})
        self.reply = StreamingReply()
        self.reply_mode = settings.mode
        self.reply_data = MessageData("assistant", status="streaming", stats={"mode": settings.mode},
                                      message_id=saved.id)
        self.chat.add_message(self.reply_data)
        self.recorder = self._new_recorder(self.store, saved.id)
        self.denoise.clear()
        if settings.mode == "ar":
            self.denoise.position_label.setText("autoregressive mode: one token per step, no blocks to denoise")
        self.request_id = str(self.client.generate(messages, params, None))
        self.composer.set_generating(True)
        if settings.mode == "diffusion" and self.side.currentWidget() is self.tabs:
            self.tabs.setCurrentWidget(self.denoise)
        self.generationStarted.emit(self.request_id)
        self.refresh_status()

    def on_stop_requested(self) -> None:
        if self.request_id is not None:
            self.client.cancel(self.request_id)
            self.engine_label.setText("● Stopping…")

    def on_regenerate_last(self) -> None:
        last = self.chat.last_assistant()
        if last is not None:
            self.on_regenerate_requested(last.data)

    def on_regenerate_requested(self, data: MessageData) -> None:
        if self.is_generating() or data.message_id is None:
            return
        try:
            self.store.truncate_after(data.message_id, include=True)
            self.chat.remove_from(self.chat.index_of(data))
            self._start_generation()
        except StorageError as exc:
            self.show_save_error(exc, "The answer was not regenerated")

    def on_edit_requested(self, data: MessageData) -> None:
        if self.is_generating():
            return
        self.composer.begin_edit(data)

    def _html_preview(self) -> HtmlPreview | None:
        return cast("HtmlPreview | None", self.preview)

    def on_preview_requested(self, request: PreviewRequest) -> None:
        preview = self._html_preview()
        if preview is None:
            return
        streaming = self.reply_data is not None and request.message is self.reply_data
        self.preview_follows = request.message if streaming and request.block is None else None
        preview.set_html(request.html, request.document_id)
        preview.flush()
        self.settings_button.setChecked(False)
        self.panel_button.setChecked(True)
        self.tabs.setCurrentWidget(self.preview)

    def on_settings_toggled(self, shown: bool) -> None:
        self.side.setCurrentWidget(self.drawer if shown else self.tabs)
        if shown:
            self.panel_button.setChecked(True)

    def on_panels_toggled(self, shown: bool) -> None:
        self.side.setVisible(shown)
        if not shown:
            self.settings_button.setChecked(False)

    def on_copied(self, what: str) -> None:
        self.statusBar().showMessage("Code copied" if what == "code" else "Message copied", 2000)

    # ----------------------------------------------------------------- engine events
    def on_engine_event(self, request_id: str, event: object) -> None:
        if request_id != self.request_id or self.reply is None or self.reply_data is None:
            return
        save_error: StorageError | None = None
        if self.recorder is not None:
            try:
                self.recorder.on_event(event)  # the store first: what is saved never lags what is shown
            except StorageError as exc:
                save_error = exc
        if save_error is not None:
            self._stop_unsaved(event, save_error)
            return
        if isinstance(event, TextDelta):
            self.reply.add(event.text, event.channel)
            self._sync_reply()
            if event.channel != "thinking" and self.preview_follows is self.reply_data:
                self._feed_preview()
        elif isinstance(event, BlockStep):
            self.denoise.add_event(event)
        elif isinstance(event, BlockCommitted):
            self.denoise.add_event(event)
            self.status_throttle.request()
        elif isinstance(event, PromptInfo):
            self.denoise.add_event(event)
        elif isinstance(event, Finished):
            self.denoise.add_event(event)
            self._finish(event)
        elif isinstance(event, EngineError):
            self._fail(f"{event.kind}: {event.message}", "error")

    def _sync_reply(self) -> None:
        assert self.reply is not None and self.reply_data is not None
        self.reply_data.content = self.reply.answer
        self.reply_data.thinking = self.reply.thinking
        self.reply_data.thinking_seconds = self.reply.thinking_seconds()
        self.chat.stream_changed()

    def _feed_preview(self) -> None:
        """Hand the followed answer's page so far to the preview (throttled there)."""
        data, preview = self.preview_follows, self._html_preview()
        if data is None or preview is None:
            return
        html = self.chat.extract_html(data.content)
        if html is not None:
            preview.set_html(html, preview_document_id(data))

    def _finish(self, event: Finished) -> None:
        assert self.reply is not None and self.reply_data is not None
        self.reply.finish()
        stats = finished_stats(event, self.reply_mode)
        status = "stopped" if event.stop_reason == "cancelled" else "complete"
        data = self.reply_data
        # The deltas are authoritative for what was shown; Finished carries the same text (used if they differ).
        data.content = event.text or self.reply.answer
        data.thinking = event.thinking or self.reply.thinking
        data.thinking_seconds = self.reply.thinking_seconds()
        data.status = status
        data.stats = stats
        self.last_tok_s = event.tokens_per_s
        self.last_hit_rate = stats.get("expert_hit_rate", self.last_hit_rate)
        self._end_generation(event.stop_reason)

    def _fail(self, message: str, reason: str) -> None:
        if self.reply is None or self.reply_data is None:
            return
        if self.recorder is not None and not self.recorder.done:  # e.g. a crash reported before its EngineError
            self.recorder.on_event(EngineError("WorkerCrashed" if reason == "crashed" else "Error", message))
        data = self.reply_data
        data.status = "error"
        data.stats = {**data.stats, "error": message, "stop_reason": reason}
        self._end_generation(reason)

    def _stop_unsaved(self, event: object, error: StorageError) -> None:
        """A save failed mid-answer: stop the generation (cancel sent unless this event ended it), back to idle,
        and keep the answer on screen (this event's text included) marked as not saved."""
        assert self.reply is not None and self.reply_data is not None
        ended = isinstance(event, (Finished, EngineError))
        if not ended and self.request_id is not None:
            self.client.cancel(self.request_id)  # its remaining events are ignored: the request ends here
        if isinstance(event, TextDelta):
            self.reply.add(event.text, event.channel)
        self.reply.finish()
        data = self.reply_data
        data.content = event.text if isinstance(event, Finished) and event.text else self.reply.answer
        data.thinking = event.thinking if isinstance(event, Finished) and event.thinking else self.reply.thinking
        data.thinking_seconds = self.reply.thinking_seconds()
        data.status = "error"
        data.stats = {**data.stats, "stop_reason": "not-saved", "error": f"not saved: {error}"}
        self.recorder = None
        self.show_save_error(error, "The answer is shown but was not saved; generation stopped")
        self._end_generation("not-saved")

    def show_save_error(self, error: BaseException, what: str) -> None:
        """One clear message in the info banner for a failed save."""
        log.warning("%s: %s", what, error)
        self.info_banner.action.setVisible(False)
        self.info_banner.show_message(f"{what}: {error}")

    def _end_generation(self, reason: str) -> None:
        request_id = self.request_id or ""
        preview = self._html_preview()
        if preview is not None and self.preview_follows is not None and self.preview_follows is self.reply_data:
            self._feed_preview()  # the final text (Finished's, when it differs from the deltas)
            preview.flush()
        self.preview_follows = None
        self.request_id = None
        self.reply = None
        self.reply_data = None
        self.recorder = None
        self.chat.end_stream()
        self.composer.set_generating(False)
        self.reload_conversations(self.sidebar.search.text())
        self.refresh_status()
        self.generationFinished.emit(request_id, reason)

    def on_load_progress(self, event: LoadProgress) -> None:
        self.engine_state = "loading"
        self.load_banner.set_progress(event)
        self.status_throttle.request()

    def on_engine_loaded(self, *_info: object) -> None:
        self.engine_state = "ready"
        self.load_banner.hide()
        self.crash_banner.hide()
        self.refresh_status()

    def on_engine_ready(self, *_info: object) -> None:
        if self.engine_state in ("starting", "crashed"):
            self.engine_state = "starting" if self.model_dir else "no-model"
        self.crash_banner.hide()
        self.refresh_status()

    def on_engine_error_message(self, kind: str, message: str) -> None:
        self.load_banner.hide()
        if self.is_generating():
            self._fail(f"{kind}: {message}", "error")
        if kind in ("CancelledError",):
            self.info_banner.action.setVisible(False)
            self.info_banner.show_message("Loading cancelled.")
            self.engine_state = "no-model" if self.engine_state == "loading" else self.engine_state
        else:
            text = f"{kind}: {message}"
            oom = "OutOfMemory" in kind or "out of memory" in message.lower()
            if oom:
                text += "  Try a smaller VRAM budget or a shorter context in the VRAM tab."
            self.info_banner.action.setText("Open VRAM tab")
            self.info_banner.action.setVisible(oom and self.vram_panel is not None)
            self.info_banner.show_message(text)
            if self.engine_state == "loading":
                self.engine_state = "error"
        self.refresh_status()

    def on_engine_crashed(self, reason: str) -> None:
        self.engine_state = "crashed"
        self.load_banner.hide()
        if self.is_generating():
            self._fail(f"the engine stopped: {reason}", "crashed")
        self.crash_banner.show_message(f"The engine stopped: {reason}. Your chats are saved.")
        self.refresh_status()

    def on_restart_clicked(self) -> None:
        self.crash_banner.hide()
        self.engine_state = "starting"
        self.client.restart()
        self.refresh_status()

    def on_cancel_load(self) -> None:
        self.client.cancel_load()
        self.load_banner.label.setText("Cancelling…")

    def on_open_vram_tab(self) -> None:
        if self.vram_panel is not None:
            self.settings_button.setChecked(False)
            self.panel_button.setChecked(True)
            self.tabs.setCurrentWidget(self.vram_panel)
        self.info_banner.hide()

    def on_apply_plan(self, vram_bytes: int, ctx_tokens: int) -> None:
        self.applyPlanRequested.emit(vram_bytes, ctx_tokens)

    def on_model_chosen(self, path: str) -> None:
        self.model_dir = path
        self.show_chat_page()
        self.modelChosen.emit(path)
        self.refresh_status()

    # ----------------------------------------------------------------- pages and status
    def show_models_page(self) -> None:
        if self.model_manager is not None:
            self.pages.setCurrentIndex(1)
            self.title_label.setText("Models")

    def show_chat_page(self) -> None:
        self.pages.setCurrentIndex(0)

    def refresh_status(self) -> None:
        state_text = {
            "starting": "● Starting engine…",
            "loading": "● Loading model…",
            "ready": "● Ready",
            "crashed": "● Engine stopped",
            "no-model": "● No model: choose one in Models",
            "error": "● Model failed to load",
        }.get(self.engine_state, self.engine_state)
        if self.is_generating():
            state_text = "● Generating…"
        self.engine_label.setText(state_text)
        self.model_label.setText(Path(self.model_dir).name if self.model_dir else "no model")
        self.gpu_label.setText(self.gpu_name or "No GPU (CPU)")
        sample = self.monitor.sample() if self.monitor is not None else {}
        if sample.get("vram_used") is not None and sample.get("vram_total"):
            self.vram_label.setText(f"VRAM {sample['vram_used'] / GIB:.1f}/{sample['vram_total'] / GIB:.0f} GiB")
        else:
            self.vram_label.setText("VRAM –")
        if sample.get("ram_used") is not None and sample.get("ram_total"):
            self.ram_label.setText(f"RAM {sample['ram_used'] / GIB:.1f}/{sample['ram_total'] / GIB:.0f} GiB")
        else:
            self.ram_label.setText("RAM –")
        live = self.denoise.model.tokens_per_s() if self.is_generating() else None
        tok_s = live or self.last_tok_s
        self.speed_label.setText(f"{tok_s:.1f} tok/s" if tok_s else "– tok/s")
        rate = self.last_hit_rate
        self.hit_label.setText(f"Expert cache {rate * 100:.0f}% hits" if rate is not None else "Expert cache –")

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802
        if self.is_generating() and self.recorder is not None:
            try:
                self.recorder.flush()  # keep what streamed so far; the store marks it interrupted on next open
            except StorageError as exc:
                log.warning("the answer being generated was not saved at close: %s", exc)
        self.monitor_timer.stop()
        super().closeEvent(event)

    def sizeHint(self) -> QSize:
        return QSize(1480, 900)
