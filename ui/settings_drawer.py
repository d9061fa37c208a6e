"""The settings drawer: system prompt and generation settings of the chat on show (saved with it)."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from ui.generation import MAX_TOKENS_LIMIT, GenerationSettings
from ui.theme import set_style_class
from ui.widgets import accessible

BLOCK_SIZES = (8, 16, 32, 64)


class SettingsDrawer(QFrame):
    """System prompt and sampling settings for the current conversation."""

    changed = Signal()  # any setting changed by the user (read them back with settings() / system_prompt_text())
    closeRequested = Signal()  # the drawer's Done button

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("settingsDrawer")
        title = QLabel("Chat settings")
        set_style_class(title, "title")
        self.done_button = QPushButton("Done")
        self.done_button.setObjectName("settingsDone")
        set_style_class(self.done_button, "ghost")
        accessible(self.done_button, "Close chat settings")
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setObjectName("systemPrompt")
        self.system_prompt.setPlaceholderText("You are a helpful assistant…")
        self.system_prompt.setFixedHeight(96)
        self.system_prompt.setTabChangesFocus(True)
        accessible(self.system_prompt, "System prompt")
        self.mode = QComboBox()
        self.mode.setObjectName("modeChoice")
        self.mode.addItem("Block diffusion", "diffusion")
        self.mode.addItem("Autoregressive", "ar")
        self.mode.addItem("Self-speculative (AR's tokens, diffusion drafts)", "spec")
        accessible(self.mode, "Decoding mode")
        self.diffusion_unavailable = ""  # why the loaded model cannot decode by block diffusion ("" when it can)
        self.temperature = QDoubleSpinBox()
        self.temperature.setObjectName("temperature")
        self.temperature.setRange(0.0, 2.0)
        self.temperature.setSingleStep(0.05)
        self.temperature.setToolTip("0 = greedy (deterministic)")
        accessible(self.temperature, "Temperature")
        self.block_size = QComboBox()
        self.block_size.setObjectName("blockSize")
        for n in BLOCK_SIZES:
            self.block_size.addItem(str(n), n)
        accessible(self.block_size, "Block size")
        self.threshold = QDoubleSpinBox()
        self.threshold.setObjectName("threshold")
        self.threshold.setRange(0.0, 1.0)
        self.threshold.setDecimals(2)
        self.threshold.setSingleStep(0.05)
        self.threshold.setToolTip(
            "A pass commits every masked slot whose confidence is above this value (strictly greater), and at "
            "least one slot"
        )
        accessible(self.threshold, "Commit threshold")
        self.max_tokens = QSpinBox()
        self.max_tokens.setObjectName("maxTokens")
        self.max_tokens.setRange(16, MAX_TOKENS_LIMIT)
        self.max_tokens.setSingleStep(128)
        accessible(self.max_tokens, "Maximum new tokens")
        self.thinking = QCheckBox("Think before answering")
        self.thinking.setObjectName("thinkSetting")
        accessible(self.thinking, "Think before answering")
        self.expand_thinking = QCheckBox("Show thinking expanded")
        self.expand_thinking.setObjectName("expandThinking")
        self.expand_thinking.setToolTip("Open the thinking section of answers by default (it can always be toggled)")
        accessible(self.expand_thinking, "Show thinking expanded")
        self.defaults_label = QLabel()
        set_style_class(self.defaults_label, "faint")
        self.defaults_label.setWordWrap(True)
        form = QFormLayout()
        form.setLabelAlignment(Qt.AlignmentFlag.AlignLeft)
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        form.setVerticalSpacing(10)
        form.addRow("&Mode", self.mode)
        form.addRow("&Temperature", self.temperature)
        form.addRow("&Block size", self.block_size)
        form.addRow("T&hreshold", self.threshold)
        form.addRow("Max to&kens", self.max_tokens)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 16, 16, 16)
        layout.setSpacing(10)
        top = QHBoxLayout()
        top.addWidget(title)
        top.addStretch(1)
        top.addWidget(self.done_button)
        layout.addLayout(top)
        scope = QLabel("Saved with this chat. Think is the same switch as the one next to the message box.")
        set_style_class(scope, "muted")
        scope.setWordWrap(True)
        layout.addWidget(scope)
        prompt_label = QLabel("SYSTEM &PROMPT")
        prompt_label.setBuddy(self.system_prompt)
        set_style_class(prompt_label, "sectionTitle")
        layout.addWidget(prompt_label)
        layout.addWidget(self.system_prompt)
        sampling = QLabel("GENERATION")
        set_style_class(sampling, "sectionTitle")
        layout.addWidget(sampling)
        layout.addLayout(form)
        layout.addWidget(self.thinking)
        layout.addWidget(self.expand_thinking)
        hints = QLabel(
            "<b>Block diffusion</b> fills a block of masked slots per pass; a pass commits every slot whose "
            "confidence is above the <b>threshold</b> (at least one), so lower is faster and riskier. "
            "<b>Block size</b> is the number of slots per block. <b>Temperature</b> 0 is greedy. "
            "<b>Autoregressive</b> writes one token per step."
        )
        set_style_class(hints, "muted")
        hints.setWordWrap(True)
        layout.addWidget(hints)
        layout.addWidget(self.defaults_label)
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

    def _widgets(self) -> tuple[QWidget, ...]:
        return (self.mode, self.block_size, self.temperature, self.threshold, self.max_tokens, self.thinking,
                self.expand_thinking, self.system_prompt)

    def set_settings(self, s: GenerationSettings, system_prompt: str) -> None:
        """Show ``s`` without emitting :attr:`changed` (it is not a user edit). Block diffusion shows as
        autoregressive while the model cannot decode by diffusion (:meth:`set_diffusion_available`)."""
        for w in self._widgets():
            w.blockSignals(True)
        mode = "ar" if self.diffusion_unavailable else s.mode
        self.mode.setCurrentIndex(max(0, self.mode.findData(mode)))
        if self.block_size.findData(s.block_size) < 0:  # a model with another native block size
            self.block_size.addItem(str(s.block_size), s.block_size)
        self.block_size.setCurrentIndex(self.block_size.findData(s.block_size))
        self.temperature.setValue(s.temperature)
        self.threshold.setValue(s.threshold)
        self.max_tokens.setValue(s.max_new_tokens)
        self.thinking.setChecked(s.enable_thinking)
        self.expand_thinking.setChecked(s.expand_thinking)
        self.system_prompt.setPlainText(system_prompt)
        for w in self._widgets():
            w.blockSignals(False)
        self._update_enabled()

    def set_diffusion_available(self, reason: str) -> None:
        """``reason`` (non-empty): the loaded model decodes autoregressively only (a GGUF file without the diffusion
        tensors): the diffusion choice is disabled with the reason as its tooltip and the mode shows AR, without
        changing what the chat saved. "": diffusion is offered again."""
        self.diffusion_unavailable = reason
        text = f"Block diffusion is unavailable for this model: {reason}" if reason else ""
        for data in ("diffusion", "spec"):  # spec mode drafts by diffusion
            index = self.mode.findData(data)
            item = self.mode.model().item(index) if hasattr(self.mode.model(), "item") else None
            if item is not None:
                item.setEnabled(not reason)
            self.mode.setItemData(index, text or None, Qt.ItemDataRole.ToolTipRole)
        self.mode.setToolTip(text)
        if reason and self.mode.currentData() in ("diffusion", "spec"):
            self.mode.blockSignals(True)
            self.mode.setCurrentIndex(self.mode.findData("ar"))
            self.mode.blockSignals(False)
        self._update_enabled()

    def set_model_defaults_text(self, model_name: str, defaults: GenerationSettings) -> None:
        """Say where a new chat's values come from."""
        if not model_name:
            self.defaults_label.setText("")
            return
        mode = "block diffusion" if defaults.mode == "diffusion" else "autoregressive"
        temp = "greedy" if defaults.temperature == 0 else f"temperature {defaults.temperature:g}"
        self.defaults_label.setText(
            f"New chats start from {model_name}'s own settings: {mode}, block {defaults.block_size}, threshold "
            f"{defaults.threshold:g}, {temp}, up to {defaults.max_new_tokens:,} tokens."
        )

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
        mode = self.mode.currentData()
        self.block_size.setEnabled(mode in ("diffusion", "spec"))
        self.threshold.setEnabled(mode in ("diffusion", "spec"))
        self.temperature.setEnabled(mode != "spec")  # spec mode is greedy: its tokens are AR greedy's

    def on_any_changed(self, *_args: object) -> None:
        self._update_enabled()
        self.changed.emit()
