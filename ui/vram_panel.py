"""The VRAM budget panel: a slider from the smallest budget that works up to the card's memory, and what the
planner makes of each budget (a stacked bar of where the bytes go, how many layers' experts stay on the GPU, RAM
needed, an estimated speed, or a clear "won't fit" with the planner's reason), next to the plan the engine really
placed (:meth:`VramPanel.set_in_use`).

Planning is pure arithmetic (``engine.placement.planner``, stdlib only), so it runs in the GUI process on every slider move.
"Apply" asks the engine to reload under the new budget through :attr:`VramPanel.applyRequested`.

Without an NVIDIA GPU the panel only plans: the user picks the card to plan for (:data:`CARD_CHOICES_GIB`), every
figure is labelled as a plan for that card, no speed is shown (there is nothing to measure it on) and Apply only
saves the budget for a GPU; the model runs from system RAM on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QFont, QPainter, QPaintEvent, QPen
from PySide6.QtWidgets import (
    QComboBox,
    QFrame,
    QGridLayout,
    QLabel,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QSlider,
    QVBoxLayout,
    QWidget,
)

from clover_desk.engine.defaults import CARD_CHOICES_GIB, DEFAULT_CARD_BYTES, DEFAULT_CARD_GIB, DEFAULT_CTX_TOKENS
from clover_desk.engine.placement import planner
from clover_desk.ui.theme import COLORS, color, set_style_class
from clover_desk.ui.widgets import spread_row, vbox

log = logging.getLogger(__name__)

GIB = 1024**3
MIB = 1024**2
STEP_MIB = 128  # slider resolution
STEP_BYTES = STEP_MIB * MIB
CONTEXT_CHOICES = (4096, 8192, 16384, 32768, 65536, 131072)

# (breakdown key, legend label, palette colour); the bar draws them in this order.
SEGMENTS: tuple[tuple[str, str, str], ...] = (
    ("non_expert", "Non-expert weights", "seg_non_expert"),
    ("resident_experts", "Resident experts", "seg_resident"),
    ("expert_slots", "Expert slots (streamed)", "seg_slots"),
    ("kv_cache", "KV cache", "seg_kv"),
    ("gdn_state", "DeltaNet state", "seg_state"),
    ("workspace", "Workspace", "seg_workspace"),
    ("reserve", "Reserve", "seg_reserve"),
)

NO_GPU_UNSAVED_TEXT = "No GPU here: the model runs from system RAM. Apply saves this budget for a GPU."
NO_GPU_SAVED_TEXT = "No GPU here: the model runs from system RAM; this budget is saved for a GPU."


PlanFunction = Callable[[int, int], planner.Plan]  # (vram_budget_bytes, ctx_tokens) -> plan (stdlib-only module: no torch)


def layer_count(value: Any) -> int:
    """The planner may give a count or a sequence of layer indices."""
    if isinstance(value, int):
        return value
    if isinstance(value, Sequence) or hasattr(value, "__len__"):
        return len(value)
    return int(value or 0)


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def card_words(card_bytes: int) -> str:
    """How a card is sold: "16 GB" (cards are sized in binary gigabytes and sold as GB)."""
    n = card_bytes / GIB
    return f"{n:.0f} GB" if abs(n - round(n)) < 1e-9 else f"{n:.1f} GB"


def a_card(card_bytes: int) -> str:
    """ "a 16 GB card", "an 8 GB card". """
    words = card_words(card_bytes)
    return f"{'an' if words.startswith(('8', '11', '18')) else 'a'} {words} card"


def ctx_words(ctx_tokens: int) -> str:
    return f"{ctx_tokens // 1024}K" if ctx_tokens and ctx_tokens % 1024 == 0 else f"{ctx_tokens:,} tokens"


def plan_as_dict(plan: planner.Plan | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A plan as the flat dict ``engine.placement.planner.Plan.to_dict()`` gives, from a ``Plan`` or that dict (the
    worker's ``plan`` and ``loaded`` records carry it)."""
    if plan is None:
        return None
    if isinstance(plan, planner.Plan):
        return plan.to_dict()
    return dict(plan)


def in_use_line(plan: Mapping[str, Any] | None, device: str) -> str:
    """The one line that says what the engine placed: layer counts, slots, VRAM of budget, context."""
    if plan is None:
        if device == "cpu":
            return "In use: no plan, the model runs from system RAM on the CPU"
        return f"In use: no plan, the model was loaded on {device or 'the device'} without a VRAM budget"
    resident = layer_count(plan.get("resident_expert_layers", 0))
    streamed = layer_count(plan.get("streamed_expert_layers", 0))
    if streamed:
        slots = int(plan.get("slot_pool_experts") or 0)
        parts = [f"{resident} resident / {streamed} streamed layers", f"{slots:,} slots"]
    else:
        parts = [f"all {resident} layers resident"]
    used = int(plan.get("vram_used_bytes") or 0)
    budget = int(plan.get("vram_budget_bytes") or 0)
    parts.append(f"{used / GIB:.2f} GiB of {budget / GIB:.2f} GiB" if budget else f"{used / GIB:.2f} GiB")
    ctx = int(plan.get("ctx_tokens") or 0)
    if ctx:
        parts.append(f"{ctx_words(ctx)} context")
    return "In use: " + ", ".join(parts)


@dataclass(frozen=True)
class PlanSummary:
    """The words and numbers the panel shows for one plan (plain data, tested without widgets)."""

    fits: bool
    headline: str
    layers_line: str
    ram_line: str
    speed_line: str  # "" when there is no GPU to estimate a speed for
    reason: str
    segments: tuple[tuple[str, str, str, int], ...]  # (key, label, colour name, bytes)


def summarize(
    plan: planner.Plan, vram_budget_bytes: int, ram_total_bytes: int | None, *, plan_card_bytes: int | None = None
) -> PlanSummary:
    """``plan_card_bytes``: no GPU was found and this is a plan for a card of that size. The headline says so and
    there is no speed line (the planner's roofline figure would read as a measurement of a card that is not here).
    """
    resident = layer_count(plan.resident_expert_layers)
    streamed = layer_count(plan.streamed_expert_layers)
    total = resident + streamed
    breakdown = dict(plan.vram_breakdown or {})
    segments = tuple((k, label, col, int(breakdown.get(k, 0))) for k, label, col in SEGMENTS)
    used = sum(s[3] for s in segments)
    headline = f"Fits: {gib(used)} of {gib(vram_budget_bytes)}" if plan.fits else "Won't fit"
    if plan_card_bytes is not None:
        headline = f"Plan for {a_card(plan_card_bytes)}: " + headline[0].lower() + headline[1:]
    if streamed:
        layers = f"{resident} of {total} layers' experts on GPU, {streamed} streamed from RAM"
        if plan.slot_pool_experts:
            layers += f" ({plan.slot_pool_experts:,} expert slots)"
    else:
        layers = f"All {total} layers' experts on GPU"
    ram = f"RAM needed: {gib(plan.ram_bytes)}"
    if ram_total_bytes:
        ram += f" of {gib(ram_total_bytes)}"
    speed = ""
    if plan_card_bytes is None:
        speeds = plan.predicted_tok_s or {}
        parts = []
        if "diffusion" in speeds:
            parts.append(f"≈ {speeds['diffusion']:.0f} tok/s diffusion")
        if "ar" in speeds:
            parts.append(f"≈ {speeds['ar']:.0f} tok/s AR")
        speed = ", ".join(parts) + " (estimate)" if parts else "Speed estimate: unknown"
    reason = plan.reason or ("" if plan.fits else "the planner found no placement for this budget")
    return PlanSummary(bool(plan.fits), headline, layers, ram, speed, reason, segments)


class BudgetBar(QWidget):
    """Stacked bar: one segment per kind of bytes, drawn against the card's memory with a budget marker."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.segments: tuple[tuple[str, str, str, int], ...] = ()
        self.vram_budget_bytes = 0
        self.card_bytes = 16 * GIB
        self.card_caption = ""  # the right-hand caption under the bar; "" draws "card <size>"
        self.fits = True
        self.setMinimumHeight(46)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def sizeHint(self) -> QSize:
        return QSize(360, 46)

    def set_plan(self, summary: PlanSummary, vram_budget_bytes: int, card_bytes: int) -> None:
        self.segments, self.vram_budget_bytes, self.card_bytes, self.fits = summary.segments, vram_budget_bytes, card_bytes, summary.fits
        self.update()

    def paintEvent(self, event: QPaintEvent) -> None:  # noqa: N802
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        bar = QRectF(0.5, 6.5, self.width() - 1.0, 22.0)
        scale_bytes = max(self.card_bytes, self.vram_budget_bytes, sum(s[3] for s in self.segments), 1)
        p.setPen(Qt.PenStyle.NoPen)
        p.setBrush(color("surface2"))
        p.drawRoundedRect(bar, 5, 5)
        p.save()
        p.setClipRect(bar)
        x = bar.x()
        for _key, _label, col, n in self.segments:
            w = bar.width() * n / scale_bytes
            if w <= 0:
                continue
            p.setBrush(color(col))
            p.drawRect(QRectF(x, bar.y(), w, bar.height()))
            x += w
        used_x = x
        p.restore()
        # what does not fit: the part of the bar past the budget, tinted red
        bx0 = bar.x() + bar.width() * self.vram_budget_bytes / scale_bytes
        if used_x > bx0 + 1:
            over = QColor(COLORS["danger"])
            over.setAlpha(110)
            p.setBrush(over)
            p.setPen(Qt.PenStyle.NoPen)
            p.drawRect(QRectF(bx0, bar.y(), used_x - bx0, bar.height()))
        # budget marker
        bx = bar.x() + bar.width() * self.vram_budget_bytes / scale_bytes
        p.setPen(QPen(color("text") if self.fits else color("danger"), 2))
        p.drawLine(int(bx), int(bar.y() - 5), int(bx), int(bar.bottom() + 5))
        small = QFont(self.font())
        small.setPointSizeF(8.0)
        p.setFont(small)
        p.setPen(color("muted"))
        p.drawText(QRectF(0, bar.bottom() + 4, 120, 14), Qt.AlignmentFlag.AlignLeft, "0")
        p.drawText(
            QRectF(self.width() - 160, bar.bottom() + 4, 160, 14), Qt.AlignmentFlag.AlignRight,
            self.card_caption or f"card {gib(self.card_bytes)}",
        )
        p.end()


class PlanBreakdown:
    """Where one plan's bytes go (the bar and its legend), how many layers' experts stay on the GPU, RAM needed, the
    speed estimate, or why the plan does not fit: the part of :class:`VramPanel` that shows one plan."""

    def __init__(self) -> None:
        self.bar = BudgetBar()
        self.bar.setAccessibleName("Where the VRAM goes")
        self.legend = QGridLayout()
        self.legend.setHorizontalSpacing(10)
        self.legend.setVerticalSpacing(4)
        self._legend_values: dict[str, QLabel] = {}
        for row, (key, label, col) in enumerate(SEGMENTS):
            swatch = QLabel()
            swatch.setFixedSize(12, 12)
            swatch.setStyleSheet(f"background: {COLORS[col]}; border-radius: 3px;")
            name = QLabel(label)
            value = QLabel("–")
            value.setAlignment(Qt.AlignmentFlag.AlignRight)
            value.setAccessibleName(label)
            self._legend_values[key] = value
            self.legend.addWidget(swatch, row, 0)
            self.legend.addWidget(name, row, 1)
            self.legend.addWidget(value, row, 2)
        self.layers_label = QLabel()
        self.layers_label.setWordWrap(True)
        self.layers_label.setAccessibleName("Expert layers")
        self.ram_label = QLabel()
        self.ram_label.setAccessibleName("RAM needed")
        self.speed_label = QLabel()
        self.speed_label.setAccessibleName("Speed estimate")
        self.speed_label.setToolTip("The planner's roofline estimate for this card, not a measurement")
        self.reason_label = QLabel()
        self.reason_label.setWordWrap(True)
        set_style_class(self.reason_label, "dangerText")
        self.reason_label.setAccessibleName("Why it won't fit")

    def add_to(self, col: QVBoxLayout, has_gpu: bool) -> None:
        """The bar, the legend in a card, the figures and the reason, down the panel's column (no speed without a
        GPU: there is nothing to estimate it for)."""
        col.addWidget(self.bar)
        card = QFrame()
        set_style_class(card, "card")
        card_layout = QVBoxLayout(card)
        card_layout.setContentsMargins(12, 10, 12, 10)
        card_layout.addLayout(self.legend)
        col.addWidget(card)
        col.addWidget(self.layers_label)
        col.addWidget(self.ram_label)
        col.addWidget(self.speed_label)
        self.speed_label.setVisible(has_gpu)
        col.addWidget(self.reason_label)

    def show(self, s: PlanSummary, vram_budget_bytes: int, card_bytes: int, caption: str) -> None:
        self.bar.card_caption = caption
        self.bar.set_plan(s, vram_budget_bytes, card_bytes)
        for key, _label, _col, n in s.segments:
            self._legend_values[key].setText(gib(n))
        self.layers_label.setText(s.layers_line)
        self.ram_label.setText(s.ram_line)
        self.speed_label.setText(s.speed_line)
        self.reason_label.setText(s.reason if not s.fits else "")
        self.reason_label.setVisible(not s.fits)
        for label in (self.layers_label, self.ram_label, self.speed_label):
            label.setEnabled(s.fits)  # greyed: these figures describe a plan that cannot run

    def show_failure(self, message: str) -> None:
        """The planner failed: its message, as a "won't fit"."""
        self.reason_label.setText(message)
        self.reason_label.show()


class VramPanel(QWidget):
    """Budget slider + context selector + plan display + the plan in use + Apply.

    ``card_bytes`` is the GPU's memory, or None when no NVIDIA GPU was found: the panel then plans for a card the
    user picks (:data:`CARD_CHOICES_GIB`, default :data:`DEFAULT_CARD_GIB`) and Apply only saves the budget.
    """

    applyRequested = Signal(object, int)  # (budget bytes, context tokens): reload (or, without a GPU, save) this plan
    planChanged = Signal(object)  # the plan now displayed (engine.placement.planner.Plan), after a slider / context / card move
    cardChanged = Signal(object)  # no GPU: the card size (bytes) the user now plans for

    def __init__(
        self,
        planner: PlanFunction,
        card_bytes: int | None,
        gpu_name: str | None = None,
        ram_total_bytes: int | None = None,
        ctx_tokens: int = DEFAULT_CTX_TOKENS,
        parent: QWidget | None = None,
        ctx_limit: int | None = None,
    ) -> None:
        super().__init__(parent)
        self.setObjectName("vramPanel")
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground, True)
        self._planner = planner
        self.has_gpu = bool(card_bytes)
        self._card_bytes = int(card_bytes) if card_bytes else DEFAULT_CARD_BYTES
        self.gpu_name = gpu_name
        self.ram_total_bytes = ram_total_bytes
        self.plan: planner.Plan | None = None
        self.summary: PlanSummary | None = None
        self._in_use_known = False  # set_in_use was called since the last model switch
        self._in_use: dict[str, Any] | None = None  # the plan the engine placed (None: it runs without one)
        self._in_use_device = ""
        self._saved: tuple[int, int] | None = None  # no GPU: the (budget, ctx) Apply saved last

        self.title = QLabel("VRAM budget")
        set_style_class(self.title, "title")
        self.gpu_label = QLabel(self._gpu_text())
        set_style_class(self.gpu_label, "muted" if self.has_gpu else "warnText")
        self.gpu_label.setWordWrap(True)
        self.gpu_label.setAccessibleName("GPU")
        self.card_label = QLabel("Card to plan for")
        self.card_combo = QComboBox()
        self.card_combo.setObjectName("cardChoice")
        self.card_combo.setAccessibleName("Card size to plan for")
        self.card_combo.setToolTip("No NVIDIA GPU was found: choose the card size the plan is made for")
        for n in CARD_CHOICES_GIB:
            self.card_combo.addItem(f"{n} GB", n)
        self.card_combo.setCurrentIndex(max(0, self.card_combo.findData(DEFAULT_CARD_GIB)))
        self.card_label.setBuddy(self.card_combo)
        self.plan_for_label = QLabel()
        set_style_class(self.plan_for_label, "muted")
        self.plan_for_label.setAccessibleName("Plan for")
        self.budget_label = QLabel()
        set_style_class(self.budget_label, "bigFigure")
        self.budget_label.setAccessibleName("VRAM budget")
        self.state_label = QLabel()
        self.state_label.setAccessibleName("Plan state")
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setObjectName("vramSlider")
        self.slider.setAccessibleName("VRAM budget")
        self.slider.setSingleStep(1)
        self.slider.setPageStep(8)
        self.min_label = QLabel()
        set_style_class(self.min_label, "faint")
        self.max_label = QLabel()
        set_style_class(self.max_label, "faint")
        self.ctx_combo = QComboBox()
        self.ctx_combo.setObjectName("contextChoice")
        self.ctx_combo.setAccessibleName("Context length")
        self._fill_contexts(ctx_limit, ctx_tokens)
        self.breakdown = PlanBreakdown()  # where the plan's bytes go, layers, RAM, speed, why it won't fit
        self.apply_button = QPushButton()
        self.apply_button.setObjectName("applyButton")
        set_style_class(self.apply_button, "primary")  # the theme's primary-button look (assets/style.qss)
        self.apply_button.setAccessibleName("Apply")
        self.in_use_label = QLabel()
        set_style_class(self.in_use_label, "muted")
        self.in_use_label.setWordWrap(True)
        self.in_use_label.setAccessibleName("Plan in use")
        self.status_label = QLabel()
        self.status_label.setWordWrap(True)
        self.status_label.setAccessibleName("Plan status")

        self._build_layout()
        self._init_range()
        self._connect_signals()
        self.on_budget_changed(self.slider.value())

    # ----------------------------------------------------------------- layout
    def _build_layout(self) -> None:
        """The inputs and the plan scroll when the panel is short; the plan in use and Apply stay pinned below."""
        body = QWidget()
        body.setObjectName("vramPanelBody")
        col = QVBoxLayout(body)
        col.setContentsMargins(16, 14, 16, 6)
        col.setSpacing(10)
        col.addWidget(self.title)
        col.addWidget(self.gpu_label)
        col.addLayout(spread_row(self.card_label, self.card_combo))
        self.card_label.setVisible(not self.has_gpu)
        self.card_combo.setVisible(not self.has_gpu)
        ctx_label = QLabel("Context length")
        ctx_label.setBuddy(self.ctx_combo)
        col.addLayout(spread_row(ctx_label, self.ctx_combo))
        col.addWidget(self.plan_for_label)
        self.plan_for_label.setVisible(not self.has_gpu)
        col.addLayout(spread_row(self.budget_label, self.state_label))
        col.addWidget(self.slider)
        col.addLayout(spread_row(self.min_label, self.max_label))
        self.breakdown.add_to(col, self.has_gpu)
        col.addStretch(1)

        self.scroll = QScrollArea()
        self.scroll.setObjectName("vramPanelScroll")
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.scroll.setStyleSheet("QScrollArea#vramPanelScroll, QWidget#vramPanelBody { background: transparent; }")
        self.scroll.viewport().setAutoFillBackground(False)
        self.scroll.setWidget(body)

        footer = vbox(self.in_use_label, self.status_label, self.apply_button, margins=(16, 6, 16, 14), spacing=8)

        self._footer = footer
        root = QVBoxLayout(self)
        root.setContentsMargins(0, 0, 0, 0)
        root.setSpacing(0)
        root.addWidget(self.scroll, 1)
        root.addLayout(footer)
        for combo in (self.card_combo, self.ctx_combo):
            combo.setMinimumWidth(130)

    def sizeHint(self) -> QSize:  # noqa: N802 - the whole plan without scrolling (a scroll area alone hints small)
        body = self.scroll.widget().sizeHint()
        foot = self._footer.sizeHint()
        return QSize(max(body.width(), foot.width()), body.height() + foot.height())

    def _init_range(self, keep_value: bool = False) -> None:
        """Slider range: from the smallest budget that fits this model at the chosen context up to the card."""
        top = self._card_bytes
        try:
            floor = int(self._planner(top, self.ctx_tokens()).min_vram_bytes or 0)
        except Exception:  # noqa: BLE001 - a planner bug must not take the window down; logged, then a safe floor
            log.exception("planner failed while computing the minimum budget")
            floor = 0
        floor = max(0, min(floor, top))
        lo = -(-floor // STEP_BYTES)  # round up to a slider step
        hi = top // STEP_BYTES
        value = self.slider.value()
        self.slider.setRange(lo, max(lo, hi))
        if keep_value:
            self.slider.setValue(max(lo, min(value, hi)))  # a larger context may raise the floor past the value
        else:
            self.slider.setValue(max(lo, hi - 1))  # default: the whole card less one step
        self.min_label.setText(f"min {gib(lo * STEP_BYTES)}")
        self.max_label.setText(f"card {gib(hi * STEP_BYTES)}" if self.has_gpu else f"{card_words(top)} card")

    def _connect_signals(self) -> None:
        self.slider.valueChanged.connect(self.on_budget_changed)
        self.ctx_combo.currentIndexChanged.connect(self.on_context_changed)
        self.card_combo.currentIndexChanged.connect(self.on_card_changed)
        self.apply_button.clicked.connect(self.on_apply_clicked)

    def _gpu_text(self) -> str:
        if self.has_gpu:
            return f"{self.gpu_name or 'NVIDIA GPU'} · {gib(self._card_bytes)}"
        return "No NVIDIA GPU found. Pick a card size to see how the model would be placed on it."

    # ----------------------------------------------------------------- API
    def vram_budget_bytes(self) -> int:
        return self.slider.value() * STEP_BYTES

    def ctx_tokens(self) -> int:
        return int(self.ctx_combo.currentData() or DEFAULT_CTX_TOKENS)

    def card_bytes(self) -> int:
        """The card the slider's top stands for: the GPU's memory, or (no GPU) the card size chosen to plan for."""
        return self._card_bytes

    def set_card_bytes(self, n: int) -> None:
        """No GPU: plan for the smallest offered card holding ``n`` bytes (the largest if none does). With a GPU
        the card is the GPU's and this does nothing."""
        if self.has_gpu:
            log.warning("set_card_bytes ignored: the panel plans for the %s GPU found", gib(self._card_bytes))
            return
        fits = [g for g in CARD_CHOICES_GIB if g * GIB >= n]
        self.card_combo.setCurrentIndex(self.card_combo.findData(min(fits) if fits else max(CARD_CHOICES_GIB)))

    def set_vram_budget_bytes(self, n: int) -> None:
        """Move the slider to ``n`` (a step of 128 MiB); without a GPU a budget above the card picks a larger card."""
        if not self.has_gpu and n > self._card_bytes:
            self.set_card_bytes(n)
        self.slider.setValue(round(n / STEP_BYTES))

    def plan_for(self, vram_budget_bytes: int, ctx_tokens: int) -> planner.Plan:
        """What the panel's planner makes of this budget and context (``engine.placement.planner.Plan`` in the app)."""
        return self._planner(vram_budget_bytes, ctx_tokens)

    def plan_to_load(self, vram_budget_bytes: int, ctx_tokens: int) -> planner.Plan | None:
        """The plan to load for this budget and context: the one the panel shows, handed to the load as is (the
        window plans once between the slider and the load). When the panel shows another budget or context it is
        moved there first, so what is loaded is what it shows; a budget or context it cannot show (off the slider's
        steps, a context it does not offer) is planned once here. None: the planner failed (the panel says why)."""
        if not self._shows(vram_budget_bytes, ctx_tokens):
            index = self.ctx_combo.findData(ctx_tokens)
            if index >= 0:
                self.ctx_combo.setCurrentIndex(index)  # replans for the new context
            self.set_vram_budget_bytes(vram_budget_bytes)  # replans when the slider moves
        if self._shows(vram_budget_bytes, ctx_tokens):
            return self.plan
        try:
            return self._planner(vram_budget_bytes, ctx_tokens)
        except Exception as exc:  # noqa: BLE001 - reported to the caller as no plan, logged
            log.warning("planner failed for %d bytes, %d tokens: %s", vram_budget_bytes, ctx_tokens, exc)
            return None

    def _shows(self, vram_budget_bytes: int, ctx_tokens: int) -> bool:
        plan = self.plan
        return plan is not None and plan.vram_budget_bytes == vram_budget_bytes and plan.ctx_tokens == ctx_tokens

    def set_planner(self, planner: PlanFunction) -> None:
        """Plan for another model (a new folder was chosen): new minimum, same budget where it still fits."""
        budget = self.vram_budget_bytes()
        self._planner = planner
        self._in_use_known, self._in_use, self._in_use_device, self._saved = False, None, "", None
        self.slider.blockSignals(True)
        self._init_range()
        self.slider.setValue(max(self.slider.minimum(), min(self.slider.maximum(), round(budget / STEP_BYTES))))
        self.slider.blockSignals(False)
        self.replan()

    def set_context_limit(self, limit: int | None, want: int | None = None) -> None:
        """The model's longest context (its config.json ``max_position_embeddings``; None: none known): the
        context choices past it go (one of exactly that length comes in when none is short enough), and the
        context chosen is ``want`` (the one chosen now when None), or the longest left when that is past it. No
        replan here: :meth:`set_planner` (a new model) replans."""
        self.ctx_combo.blockSignals(True)
        self._fill_contexts(limit, self.ctx_tokens() if want is None else int(want))
        self.ctx_combo.blockSignals(False)

    def _fill_contexts(self, limit: int | None, want: int) -> None:
        choices = [n for n in CONTEXT_CHOICES if not limit or n <= limit] or [int(limit or DEFAULT_CTX_TOKENS)]
        self.ctx_combo.clear()
        for n in choices:
            self.ctx_combo.addItem(f"{n // 1024}K tokens" if n % 1024 == 0 else f"{n:,} tokens", n)
        if want not in choices:  # past the limit: the longest left; otherwise the default (or the shortest)
            want = choices[-1] if want > choices[-1] else DEFAULT_CTX_TOKENS if DEFAULT_CTX_TOKENS in choices \
                else choices[0]
        self.ctx_combo.setCurrentIndex(choices.index(want))

    def set_in_use(self, plan: planner.Plan | Mapping[str, Any] | None, device: str) -> None:
        """The plan the engine placed after a load (``Plan.to_dict()`` or a ``Plan``), on ``device``
        ("cuda" / "cpu"); None: it runs without a plan (on the CPU everything is in RAM)."""
        self._in_use_known = True
        self._in_use = plan_as_dict(plan)
        self._in_use_device = device
        self._update_apply_state()

    def in_use(self) -> dict[str, Any] | None:
        """The plan the engine placed, as a flat dict (None: no plan, or no load reported yet)."""
        return dict(self._in_use) if self._in_use is not None else None

    @property
    def applied(self) -> tuple[int, int] | None:
        """``(budget bytes, context tokens)`` of the plan in use, or None (read-only; see :meth:`set_in_use`)."""
        if self._in_use is None:
            return None
        return int(self._in_use.get("vram_budget_bytes") or 0), int(self._in_use.get("ctx_tokens") or 0)

    def is_dirty(self) -> bool:
        """True when the slider's plan is not the one in use (compared by budget, to a slider step, and context)."""
        if self._in_use is None:
            return True
        budget, ctx = self.applied or (0, 0)
        return not (budget and round(budget / STEP_BYTES) == self.slider.value() and ctx == self.ctx_tokens())

    def runs_on_cpu(self) -> bool:
        """No GPU found, or the engine was loaded on the CPU: a budget changes nothing until there is a GPU."""
        return not self.has_gpu or self._in_use_device == "cpu"

    # ----------------------------------------------------------------- slots
    def on_budget_changed(self, _value: int) -> None:
        self.replan()

    def on_context_changed(self, _index: int) -> None:
        self.slider.blockSignals(True)
        self._init_range(keep_value=True)  # the KV cache and workspace grow with the context: new minimum
        self.slider.blockSignals(False)
        self.replan()

    def on_card_changed(self, _index: int) -> None:
        if self.has_gpu:
            return
        self._card_bytes = int(self.card_combo.currentData() or DEFAULT_CARD_GIB) * GIB
        self.slider.blockSignals(True)
        self._init_range()  # another card: its top, the whole card less one step
        self.slider.blockSignals(False)
        self.replan()
        self.cardChanged.emit(self._card_bytes)

    def on_apply_clicked(self) -> None:
        if self.plan is None or not self.plan.fits:
            return
        if self.runs_on_cpu():
            self._saved = (self.vram_budget_bytes(), self.ctx_tokens())
            self._update_apply_state()
        self.applyRequested.emit(self.vram_budget_bytes(), self.ctx_tokens())

    def replan(self) -> None:
        budget = self.vram_budget_bytes()
        self.plan_for_label.setText(f"Plan for {a_card(self._card_bytes)} (no GPU here to measure on)")
        try:
            plan = self._planner(budget, self.ctx_tokens())
        except Exception as exc:  # noqa: BLE001 - shown as a "won't fit" with the planner's message
            log.warning("planner failed for %d bytes: %s", budget, exc)
            self.plan = None
            self.summary = None
            self.budget_label.setText(gib(budget))
            self._set_state(False)
            self.breakdown.show_failure(str(exc))
            self._update_apply_state()
            return
        self.plan = plan
        card = None if self.has_gpu else self._card_bytes
        self.summary = summarize(plan, budget, self.ram_total_bytes, plan_card_bytes=card)
        s = self.summary
        self.budget_label.setText(gib(budget))
        self._set_state(s.fits)
        caption = "" if self.has_gpu else f"planned {card_words(self._card_bytes)} card"
        self.breakdown.show(s, budget, self._card_bytes, caption)
        self._update_apply_state()
        self.planChanged.emit(plan)

    def _set_state(self, fits: bool) -> None:
        self.state_label.setText("● Fits" if fits else "● Won't fit")
        self._restyle(self.state_label, "okText" if fits else "dangerText")

    @staticmethod
    def _restyle(label: QLabel, name: str) -> None:
        set_style_class(label, name)

    def _update_apply_state(self) -> None:
        fits = self.plan is not None and bool(self.plan.fits)
        current = (self.vram_budget_bytes(), self.ctx_tokens())
        if not self._in_use_known:
            self.in_use_label.setText("In use: nothing yet (no model loaded)")
        else:
            self.in_use_label.setText(in_use_line(self._in_use, self._in_use_device))
        if self.runs_on_cpu():
            self.apply_button.setText("Save for a GPU")
            self.apply_button.setToolTip("Keep this budget and context for when the model runs on a GPU")
            self.apply_button.setEnabled(fits and current != self._saved)
            if current == self._saved:
                self.status_label.setText(NO_GPU_SAVED_TEXT)
            else:
                self.status_label.setText(NO_GPU_UNSAVED_TEXT)
            self._restyle(self.status_label, "muted")
            return
        self.apply_button.setText("Apply and reload")
        self.apply_button.setToolTip("Reload the model under this budget (the app keeps running)")
        dirty = self.is_dirty()
        self.apply_button.setEnabled(fits and dirty)
        if not dirty:
            self.status_label.setText("The slider shows the plan in use.")
            self._restyle(self.status_label, "muted")
        elif not self._in_use_known:
            self.status_label.setText("Apply to load the model under this plan.")
            self._restyle(self.status_label, "muted")
        else:
            self.status_label.setText("This is not the plan in use. Apply to reload under this plan.")
            self._restyle(self.status_label, "warnText")


def planner_from_engine(manifest: Any, ram_bytes: int | None) -> PlanFunction:
    """A :data:`PlanFunction` over ``engine.placement.planner.make_plan`` for one model manifest."""

    def plan(vram_budget_bytes: int, ctx_tokens: int) -> planner.Plan:
        return planner.make_plan(manifest, vram_budget_bytes, ctx_tokens, ram_bytes)

    return plan
