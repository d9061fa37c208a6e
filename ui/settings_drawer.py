"""The settings drawer: system prompt and generation settings of the chat on show (saved with it), the default
system prompt of new chats and named presets (saved with the app's settings: ``ui.chat_presets``).

The numeric ranges are the engine's (``engine.decode.limits.GENERATION_LIMITS``: what the worker accepts); a
setting that has no meaning in the chosen mode, or without sampling, is disabled and says why."""

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
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from clover_desk.engine.decode.limits import GENERATION_LIMITS, INT32_MAX, Limit
from clover_desk.ui.chat_presets import ChatPresets
from clover_desk.ui.drawer_presets import DrawerPresets
from clover_desk.ui.generation import MAX_TOKENS_LIMIT, GenerationSettings
from clover_desk.ui.theme import set_style_class
from clover_desk.ui.widgets import accessible, named

BLOCK_SIZES = (8, 16, 32, 64)
MAX_CONTEXT = 16_777_216  # config.json's largest max_position_embeddings (engine.model.config)
SAMPLING_ONLY = "Only when sampling (temperature above 0): at 0 every step takes the likeliest token."
MODE_NOTES = {
    "diffusion": (
        "<b>In block diffusion</b> every pass proposes a token for each masked slot: temperature, top-p and top-k "
        "shape each slot's proposal, and the penalties are applied to each slot's proposal too (presence: the "
        "answer so far; repetition: prompt and answer). Then the slots above the threshold commit."
    ),
    "ar": (
        "<b>Autoregressive</b> writes one token per step: temperature, top-p, top-k and the penalties shape each "
        "next token. Block size and threshold belong to block diffusion and are off."
    ),
    "spec": (
        "<b>Self-speculative</b>: block diffusion drafts a block, one causal pass checks it, and the tokens are exactly "
        "autoregressive greedy's. Greedy only: temperature, top-p, top-k and seed are off; the penalties apply as in "
        "autoregressive; block size and threshold shape the drafts."
    ),
}


def double_spin(limit: Limit, decimals: int, step: float, name: str, tip: str) -> QDoubleSpinBox:
    """A spin box over ``limit``'s range (an open lower end starts one step above it)."""
    box = QDoubleSpinBox()
    box.setObjectName(name)
    box.setDecimals(decimals)
    box.setRange(limit.lo + (10 ** -decimals if limit.lo_open else 0.0), limit.hi)
    box.setSingleStep(step)
    box.setToolTip(f"{tip} Allowed: {limit.allowed}.")
    return box


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
        self.system_prompt = named(QPlainTextEdit(), "systemPrompt", "System prompt")
        self.system_prompt.setPlaceholderText("You are a helpful assistant…")
        self.system_prompt.setFixedHeight(96)
        self.system_prompt.setTabChangesFocus(True)
        self.mode = named(QComboBox(), "modeChoice", "Decoding mode")
        self.mode.addItem("Block diffusion", "diffusion")
        self.mode.addItem("Autoregressive", "ar")
        self.mode.addItem("Self-speculative (AR's tokens, diffusion drafts)", "spec")
        self.diffusion_unavailable = ""  # why the loaded model cannot decode by block diffusion ("" when it can)
        self.temperature = named(QDoubleSpinBox(), "temperature", "Temperature", tip="0 = greedy (deterministic)")
        self.temperature.setRange(0.0, 2.0)
        self.temperature.setSingleStep(0.05)
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
        self.max_tokens = named(QSpinBox(), "maxTokens", "Maximum new tokens")
        self.max_tokens.setRange(16, MAX_TOKENS_LIMIT)
        self.max_tokens.setSingleStep(128)
        self.thinking = named(QCheckBox("Think before answering"), "thinkSetting", "Think before answering")
        self.expand_thinking = named(
            QCheckBox("Show thinking expanded"), "expandThinking", "Show thinking expanded", tip="Open the thinking section of answers by default (it can always be toggled)",
        )
        self.defaults_label = QLabel()
        set_style_class(self.defaults_label, "faint")
        self.defaults_label.setWordWrap(True)
        self._build_sampling()
        self.preset_box = DrawerPresets(self)  # presets and the new chats' system prompt
        form = QFormLayout()
        form.setLabelAlignment(Qt.AlignmentFlag.AlignLeft)
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        form.setVerticalSpacing(10)
        form.addRow("&Mode", self.mode)
        form.addRow("&Temperature", self.temperature)
        form.addRow("&Block size", self.block_size)
        form.addRow("T&hreshold", self.threshold)
        form.addRow("Max to&kens", self.max_tokens)
        form.addRow("Top-&p", self.top_p)
        form.addRow("Top-k", self.top_k)
        form.addRow("Presence penalty", self.presence_penalty)
        form.addRow("Repetition penalty", self.repetition_penalty)
        form.addRow("&Seed", self.seed)
        form.addRow("&Context length", self.context_length)
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
        layout.addWidget(self.mode_note)
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
        self.preset_box.add_to(layout)
        layout.addStretch(1)
        self.model_context = 0  # the loaded model's context (0: unknown)
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
            self.top_p.valueChanged,
            self.top_k.valueChanged,
            self.presence_penalty.valueChanged,
            self.repetition_penalty.valueChanged,
            self.context_length.valueChanged,
        ):
            sig.connect(self.on_any_changed)
        self.seed.textChanged.connect(self.on_seed_edited)
        self.done_button.clicked.connect(self.closeRequested)

    def _widgets(self) -> tuple[QWidget, ...]:
        return (self.mode, self.block_size, self.temperature, self.threshold, self.max_tokens, self.thinking,
                self.expand_thinking, self.system_prompt, self.top_p, self.top_k, self.presence_penalty,
                self.repetition_penalty, self.seed, self.context_length)

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
        self.top_p.setValue(s.top_p)
        self.top_k.setValue(min(s.top_k, self.top_k.maximum()))
        self.presence_penalty.setValue(s.presence_penalty)
        self.repetition_penalty.setValue(s.repetition_penalty)
        self.seed.setText("" if s.seed is None else str(s.seed))
        self._seed_value = s.seed
        self.context_length.setValue(s.context_length)
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
            top_p=float(self.top_p.value()),
            top_k=int(self.top_k.value()),
            presence_penalty=float(self.presence_penalty.value()),
            repetition_penalty=float(self.repetition_penalty.value()),
            seed=self._seed_value,
            context_length=int(self.context_length.value()),
        )

    def system_prompt_text(self) -> str:
        return self.system_prompt.toPlainText().strip()

    def _update_enabled(self) -> None:
        mode = str(self.mode.currentData())
        blocks = mode in ("diffusion", "spec")
        self.block_size.setEnabled(blocks)
        self.threshold.setEnabled(blocks)
        self.temperature.setEnabled(mode != "spec")  # spec mode is greedy: its tokens are AR greedy's
        sampling = mode != "spec" and self.temperature.value() > 0
        for box in (self.top_p, self.top_k, self.seed):
            box.setEnabled(sampling)
        self.mode_note.setText(MODE_NOTES.get(mode, ""))

    def on_any_changed(self, *_args: object) -> None:
        self._update_enabled()
        self.changed.emit()

    # -- the sampling settings
    def _build_sampling(self) -> None:
        limits = GENERATION_LIMITS
        self.top_p = double_spin(limits["top_p"], 2, 0.05, "topP",
                                 f"Sample only from the likeliest tokens whose probabilities add up to this (1: all). "
                                 f"{SAMPLING_ONLY}")
        accessible(self.top_p, "Top-p")
        self.top_k = QSpinBox()
        self.top_k.setObjectName("topK")
        self.top_k.setRange(int(limits["top_k"].lo), int(min(limits["top_k"].hi, INT32_MAX)))
        self.top_k.setSpecialValueText("off")
        self.top_k.setToolTip(f"Sample only from the k likeliest tokens (0: off). {SAMPLING_ONLY} "
                              f"Allowed: {limits['top_k'].allowed}.")
        accessible(self.top_k, "Top-k")
        self.presence_penalty = double_spin(limits["presence_penalty"], 2, 0.1, "presencePenalty",
                                            "Subtracted from the score of every token the answer already holds: "
                                            "higher repeats less (0: off).")
        accessible(self.presence_penalty, "Presence penalty")
        self.repetition_penalty = double_spin(limits["repetition_penalty"], 2, 0.01, "repetitionPenalty",
                                              "Divides the score of every token seen in the prompt or the answer: "
                                              "above 1 repeats less (1: off).")
        accessible(self.repetition_penalty, "Repetition penalty")
        self.seed = QLineEdit()
        self.seed.setObjectName("seed")
        self.seed.setPlaceholderText("random")
        self.seed.setToolTip(f"The same seed gives the same sampled answer; empty: a new one each time. "
                             f"{SAMPLING_ONLY} Allowed: {limits['seed'].allowed}.")
        accessible(self.seed, "Seed")
        self._seed_value: int | None = None
        self.context_length = QSpinBox()
        self.context_length.setObjectName("contextLength")
        self.context_length.setRange(0, MAX_CONTEXT)
        self.context_length.setSingleStep(1024)
        self.context_length.setGroupSeparatorShown(True)
        self.context_length.setSpecialValueText("the model's")
        self.context_length.setToolTip(
            "The most tokens of this chat (prompt and answer) Clover reads; a longer chat leaves its oldest turns "
            "out or is summarized, as at the model's own limit (0: the loaded model's context). The model's "
            "context itself is set in the VRAM panel (it reloads the model).")
        accessible(self.context_length, "Context length")
        self.mode_note = QLabel()
        self.mode_note.setObjectName("modeNote")
        set_style_class(self.mode_note, "muted")
        self.mode_note.setWordWrap(True)

    def set_model_context(self, tokens: int | None) -> None:
        """The loaded model's context: the most a chat may ask for, and what 0 stands for."""
        self.model_context = int(tokens or 0)
        top = self.model_context or MAX_CONTEXT
        self.context_length.blockSignals(True)
        self.context_length.setMaximum(top)
        self.context_length.blockSignals(False)
        self.context_length.setSpecialValueText(f"the model's ({self.model_context:,})" if self.model_context
                                                else "the model's")

    def on_seed_edited(self, text: str) -> None:
        """A whole number in the engine's range, or empty (random); anything else is named and not used."""
        text = text.strip()
        try:
            self._seed_value = int(GENERATION_LIMITS["seed"].parse(text)) if text else None
            self.seed.setProperty("invalid", False)
            self.seed.setToolTip(self.seed.toolTip().split(" Not used: ")[0])
        except ValueError as exc:
            self._seed_value = None
            self.seed.setProperty("invalid", True)
            self.seed.setToolTip(self.seed.toolTip().split(" Not used: ")[0] + f" Not used: seed {exc}.")
        self.seed.style().unpolish(self.seed)  # the style sheet's [invalid="true"] border follows the property
        self.seed.style().polish(self.seed)
        self.on_any_changed()

    # -- presets and the default system prompt
    def set_preset_store(self, presets: ChatPresets) -> None:
        """Where presets and the default system prompt are kept (the app's settings: ``ui.drawer_presets``)."""
        self.preset_box.set_store(presets)

    def new_chat_system_prompt(self) -> str:
        return self.preset_box.new_chat_system_prompt()
