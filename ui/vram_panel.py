"""The VRAM budget panel: a slider from the smallest budget that works up to the card's memory, and what the
planner makes of each budget (a stacked bar of where the bytes go, how many layers' experts stay on the GPU, RAM
needed, predicted speed, or a clear "won't fit" with the planner's reason).

Planning is pure arithmetic (``engine.planner``, stdlib only), so it runs in the GUI process on every slider move.
"Apply" asks the engine to reload under the new budget through :attr:`VramPanel.applyRequested`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from PySide6.QtCore import QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QFont, QPainter, QPaintEvent, QPen
from PySide6.QtWidgets import (
    QComboBox,
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSizePolicy,
    QSlider,
    QVBoxLayout,
    QWidget,
)

from ui.theme import COLORS, color

log = logging.getLogger(__name__)

GIB = 1024**3
MIB = 1024**2
STEP_MIB = 128  # slider resolution
NO_GPU_CARD_BYTES = 24 * GIB  # the slider's top when no GPU is found
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


class PlanLike(Protocol):
    """The fields of ``engine.planner.Plan`` the panel reads."""

    resident_expert_layers: Any  # a count, or the layer indices
    streamed_expert_layers: Any
    slot_pool_experts: int
    vram_bytes: int
    vram_breakdown: dict[str, int]
    ram_bytes: int
    fits: bool
    reason: str
    min_vram_bytes: int
    predicted_tok_s: dict[str, float]


PlanFunction = Callable[[int, int], PlanLike]  # (vram_bytes, ctx_tokens) -> plan


def layer_count(value: Any) -> int:
    """The planner may give a count or a sequence of layer indices."""
    if isinstance(value, int):
        return value
    if isinstance(value, Sequence) or hasattr(value, "__len__"):
        return len(value)
    return int(value or 0)


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class PlanSummary:
    """The words and numbers the panel shows for one plan (plain data, tested without widgets)."""

    fits: bool
    headline: str
    layers_line: str
    ram_line: str
    speed_line: str
    reason: str
    segments: tuple[tuple[str, str, str, int], ...]  # (key, label, colour name, bytes)


def summarize(plan: PlanLike, budget_bytes: int, ram_total_bytes: int | None) -> PlanSummary:
    resident = layer_count(plan.resident_expert_layers)
    streamed = layer_count(plan.streamed_expert_layers)
    total = resident + streamed
    breakdown = dict(plan.vram_breakdown or {})
    segments = tuple((k, label, col, int(breakdown.get(k, 0))) for k, label, col in SEGMENTS)
    used = sum(s[3] for s in segments)
    if plan.fits:
        headline = f"Fits: {gib(used)} of {gib(budget_bytes)}"
    else:
        headline = "Won't fit"
    if streamed:
        layers = f"{resident} of {total} layers' experts on GPU, {streamed} streamed from RAM"
        if plan.slot_pool_experts:
            layers += f" ({plan.slot_pool_experts} expert slots)"
    else:
        layers = f"All {total} layers' experts on GPU"
    ram = f"RAM needed: {gib(plan.ram_bytes)}"
    if ram_total_bytes:
        ram += f" of {gib(ram_total_bytes)}"
    speeds = plan.predicted_tok_s or {}
    parts = []
    if "diffusion" in speeds:
        parts.append(f"~{speeds['diffusion']:.0f} tok/s diffusion")
    if "ar" in speeds:
        parts.append(f"~{speeds['ar']:.0f} tok/s AR")
    speed = "Predicted: " + ", ".join(parts) if parts else "Predicted speed: unknown"
    reason = plan.reason or ("" if plan.fits else "the planner found no placement for this budget")
    return PlanSummary(bool(plan.fits), headline, layers, ram, speed, reason, segments)


class BudgetBar(QWidget):
    """Stacked bar: one segment per kind of bytes, drawn against the card's memory with a budget marker."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.segments: tuple[tuple[str, str, str, int], ...] = ()
        self.budget_bytes = 0
        self.card_bytes = 16 * GIB
        self.fits = True
        self.setMinimumHeight(46)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def sizeHint(self) -> QSize:
        return QSize(360, 46)

    def set_plan(self, summary: PlanSummary, budget_bytes: int, card_bytes: int) -> None:
        self.segments, self.budget_bytes, self.card_bytes, self.fits = summary.segments, budget_bytes, card_bytes, summary.fits
        self.update()

    def paintEvent(self, event: QPaintEvent) -> None:  # noqa: N802
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        bar = QRectF(0.5, 6.5, self.width() - 1.0, 22.0)
        scale_bytes = max(self.card_bytes, self.budget_bytes, sum(s[3] for s in self.segments), 1)
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
        bx0 = bar.x() + bar.width() * self.budget_bytes / scale_bytes
        if used_x > bx0 + 1:
            over = QColor(COLORS["danger"])
            over.setAlpha(110)
            p.setBrush(over)
            p.setPen(Qt.PenStyle.NoPen)
            p.drawRect(QRectF(bx0, bar.y(), used_x - bx0, bar.height()))
        # budget marker
        bx = bar.x() + bar.width() * self.budget_bytes / scale_bytes
        p.setPen(QPen(color("text") if self.fits else color("danger"), 2))
        p.drawLine(int(bx), int(bar.y() - 5), int(bx), int(bar.bottom() + 5))
        small = QFont(self.font())
        small.setPointSizeF(8.0)
        p.setFont(small)
        p.setPen(color("muted"))
        p.drawText(QRectF(0, bar.bottom() + 4, 120, 14), Qt.AlignmentFlag.AlignLeft, "0")
        p.drawText(
            QRectF(self.width() - 160, bar.bottom() + 4, 160, 14), Qt.AlignmentFlag.AlignRight, f"card {gib(self.card_bytes)}"
        )
        p.end()


class VramPanel(QWidget):
    """Budget slider + context selector + plan display + Apply."""

    applyRequested = Signal(object, int)  # (budget bytes, context tokens): reload the model under this plan
    planChanged = Signal(object)  # the plan now displayed (engine.planner.Plan), after each slider / context move

    def __init__(
        self,
        planner: PlanFunction,
        card_bytes: int | None,
        gpu_name: str | None = None,
        ram_total_bytes: int | None = None,
        ctx_tokens: int = 8192,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setObjectName("vramPanel")
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground, True)
        self._planner = planner
        self.card_bytes = card_bytes or NO_GPU_CARD_BYTES
        self.has_gpu = card_bytes is not None
        self.gpu_name = gpu_name
        self.ram_total_bytes = ram_total_bytes
        self.plan: PlanLike | None = None
        self.summary: PlanSummary | None = None
        self.applied: tuple[int, int] | None = None  # (budget, ctx) the engine runs under

        self.title = QLabel("VRAM budget")
        self.title.setObjectName("convTitle")
        self.gpu_label = QLabel(self._gpu_text())
        self.gpu_label.setObjectName("muted")
        self.budget_label = QLabel()
        self.budget_label.setObjectName("bigFigure")
        self.state_label = QLabel()
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setObjectName("budgetSlider")
        self.slider.setSingleStep(1)
        self.slider.setPageStep(8)
        self.min_label = QLabel()
        self.min_label.setObjectName("faint")
        self.max_label = QLabel()
        self.max_label.setObjectName("faint")
        self.ctx_combo = QComboBox()
        for n in CONTEXT_CHOICES:
            self.ctx_combo.addItem(f"{n // 1024}K tokens", n)
        index = self.ctx_combo.findData(ctx_tokens)
        self.ctx_combo.setCurrentIndex(index if index >= 0 else 1)
        self.bar = BudgetBar()
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
            self._legend_values[key] = value
            self.legend.addWidget(swatch, row, 0)
            self.legend.addWidget(name, row, 1)
            self.legend.addWidget(value, row, 2)
        self.layers_label = QLabel()
        self.layers_label.setWordWrap(True)
        self.ram_label = QLabel()
        self.speed_label = QLabel()
        self.reason_label = QLabel()
        self.reason_label.setWordWrap(True)
        self.reason_label.setObjectName("dangerText")
        self.apply_button = QPushButton("Apply and reload")
        self.apply_button.setObjectName("primary")
        self.apply_button.setToolTip("Reload the model under this budget (the app keeps running)")
        self.applied_label = QLabel()
        self.applied_label.setObjectName("muted")
        self.applied_label.setWordWrap(True)

        self._build_layout()
        self._init_range()
        self._connect_signals()
        self.on_budget_changed(self.slider.value())

    # ----------------------------------------------------------------- layout
    def _build_layout(self) -> None:
        root = QVBoxLayout(self)
        root.setContentsMargins(16, 14, 16, 14)
        root.setSpacing(10)
        root.addWidget(self.title)
        root.addWidget(self.gpu_label)
        top = QHBoxLayout()
        top.addWidget(self.budget_label)
        top.addStretch(1)
        top.addWidget(self.state_label)
        root.addLayout(top)
        root.addWidget(self.slider)
        ends = QHBoxLayout()
        ends.addWidget(self.min_label)
        ends.addStretch(1)
        ends.addWidget(self.max_label)
        root.addLayout(ends)
        root.addWidget(self.bar)
        card = QFrame()
        card.setObjectName("loadBanner")
        card_layout = QVBoxLayout(card)
        card_layout.setContentsMargins(12, 10, 12, 10)
        card_layout.addLayout(self.legend)
        root.addWidget(card)
        root.addWidget(self.layers_label)
        root.addWidget(self.ram_label)
        root.addWidget(self.speed_label)
        root.addWidget(self.reason_label)
        ctx_row = QHBoxLayout()
        ctx_label = QLabel("Context length")
        ctx_row.addWidget(ctx_label)
        ctx_row.addStretch(1)
        ctx_row.addWidget(self.ctx_combo)
        root.addLayout(ctx_row)
        root.addStretch(1)
        root.addWidget(self.applied_label)
        root.addWidget(self.apply_button)

    def _init_range(self, keep_value: bool = False) -> None:
        """Slider range: from the smallest budget that fits this model at the chosen context up to the card."""
        top = self.card_bytes
        try:
            floor = int(self._planner(top, self.ctx_tokens()).min_vram_bytes or 0)
        except Exception:  # noqa: BLE001 - a planner bug must not take the window down; logged, then a safe floor
            log.exception("planner failed while computing the minimum budget")
            floor = 0
        floor = max(0, min(floor, top))
        lo = -(-floor // (STEP_MIB * MIB))  # round up to a slider step
        hi = top // (STEP_MIB * MIB)
        value = self.slider.value()
        self.slider.setRange(lo, max(lo, hi))
        if keep_value:
            self.slider.setValue(max(lo, min(value, hi)))  # a larger context may raise the floor past the value
        else:
            self.slider.setValue(max(lo, hi - 1))  # default: the whole card less one step
        self.min_label.setText(f"min {gib(lo * STEP_MIB * MIB)}")
        self.max_label.setText(("card " if self.has_gpu else "no GPU found: up to ") + gib(hi * STEP_MIB * MIB))

    def _connect_signals(self) -> None:
        self.slider.valueChanged.connect(self.on_budget_changed)
        self.ctx_combo.currentIndexChanged.connect(self.on_context_changed)
        self.apply_button.clicked.connect(self.on_apply_clicked)

    def _gpu_text(self) -> str:
        if self.gpu_name:
            return f"{self.gpu_name} · {gib(self.card_bytes)}"
        return "No NVIDIA GPU found · planning for a 24 GiB card"

    # ----------------------------------------------------------------- API
    def budget_bytes(self) -> int:
        return self.slider.value() * STEP_MIB * MIB

    def ctx_tokens(self) -> int:
        return int(self.ctx_combo.currentData() or 8192)

    def set_budget_bytes(self, n: int) -> None:
        self.slider.setValue(round(n / (STEP_MIB * MIB)))

    def set_planner(self, planner: PlanFunction) -> None:
        """Plan for another model (a new folder was chosen): new minimum, same budget where it still fits."""
        budget = self.budget_bytes()
        self._planner = planner
        self.applied = None
        self.slider.blockSignals(True)
        self._init_range()
        self.slider.setValue(max(self.slider.minimum(), min(self.slider.maximum(), round(budget / (STEP_MIB * MIB)))))
        self.slider.blockSignals(False)
        self.replan()

    def set_applied(self, budget_bytes: int, ctx_tokens: int) -> None:
        """The engine now runs under this budget (called after a reload succeeded)."""
        self.applied = (budget_bytes, ctx_tokens)
        self._update_apply_state()

    # ----------------------------------------------------------------- slots
    def on_budget_changed(self, _value: int) -> None:
        self.replan()

    def on_context_changed(self, _index: int) -> None:
        self.slider.blockSignals(True)
        self._init_range(keep_value=True)  # the KV cache and workspace grow with the context: new minimum
        self.slider.blockSignals(False)
        self.replan()

    def on_apply_clicked(self) -> None:
        if self.plan is None or not self.plan.fits:
            return
        self.applyRequested.emit(self.budget_bytes(), self.ctx_tokens())

    def replan(self) -> None:
        budget = self.budget_bytes()
        try:
            plan = self._planner(budget, self.ctx_tokens())
        except Exception as exc:  # noqa: BLE001 - shown as a "won't fit" with the planner's message
            log.warning("planner failed for %d bytes: %s", budget, exc)
            self.plan = None
            self.summary = None
            self.state_label.setText("Won't fit")
            self.state_label.setObjectName("dangerText")
            self.reason_label.setText(str(exc))
            self.reason_label.show()
            self.apply_button.setEnabled(False)
            return
        self.plan = plan
        self.summary = summarize(plan, budget, self.ram_total_bytes)
        s = self.summary
        self.budget_label.setText(gib(budget))
        self.state_label.setText("● Fits" if s.fits else "● Won't fit")
        self.state_label.setObjectName("okText" if s.fits else "dangerText")
        self.state_label.style().unpolish(self.state_label)
        self.state_label.style().polish(self.state_label)
        self.bar.set_plan(s, budget, self.card_bytes)
        for key, _label, _col, n in s.segments:
            self._legend_values[key].setText(gib(n))
        self.layers_label.setText(s.layers_line)
        self.ram_label.setText(s.ram_line)
        self.speed_label.setText(s.speed_line)
        self.reason_label.setText(s.reason if not s.fits else "")
        self.reason_label.setVisible(not s.fits)
        for label in (self.layers_label, self.ram_label, self.speed_label):
            label.setEnabled(s.fits)  # greyed: these figures describe a plan that cannot run
        self._update_apply_state()
        self.planChanged.emit(plan)

    def _update_apply_state(self) -> None:
        fits = self.plan is not None and self.plan.fits
        current = (self.budget_bytes(), self.ctx_tokens())
        self.apply_button.setEnabled(fits and current != self.applied)
        if self.applied is None:
            self.applied_label.setText("Not applied yet: the engine loads with its default plan.")
        elif current == self.applied:
            self.applied_label.setText(f"The engine runs under this plan ({gib(self.applied[0])}, {self.applied[1] // 1024}K context).")
        else:
            self.applied_label.setText(
                f"Engine runs under {gib(self.applied[0])}, {self.applied[1] // 1024}K context. Apply to reload."
            )


def planner_from_engine(manifest: Any, ram_bytes: int | None) -> PlanFunction:
    """A :data:`PlanFunction` over ``engine.planner.make_plan`` for one model manifest."""
    from engine import planner  # stdlib-only module; imported here so the panel can be tested with a fake

    def plan(vram_bytes: int, ctx_tokens: int) -> PlanLike:
        return planner.make_plan(manifest, vram_bytes, ctx_tokens, ram_bytes)

    return plan
