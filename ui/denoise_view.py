"""Live view of block diffusion: the current 32-slot block, pass by pass, with a replay slider.

Events update a plain :class:`DenoiseModel` (cheap: append a tuple); a :class:`~ui.throttle.Throttle` repaints
the one custom-painted :class:`DenoiseCanvas` at most ~30 times a second, so a flood of ``BlockStep`` events never
slows the engine or the GUI thread. The model keeps every step of the last ``history_blocks`` blocks, which the
replay slider walks through. Each new answer starts live again (the slider only replays the answer it was moved
in); the Live button (``liveToggle``) is checked whenever the view follows the newest pass.

In autoregressive mode there are no blocks to denoise: the view says so and shows the token stream instead (the
latest pieces, one per model step, the newest highlighted) with the token count and tok/s.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from PySide6.QtCore import QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QFont, QFontMetricsF, QPainter, QPaintEvent, QPen
from PySide6.QtWidgets import QHBoxLayout, QLabel, QSizePolicy, QSlider, QVBoxLayout, QWidget

from clover_desk.engine.decode.events import BlockCommitted, BlockStep, Finished, PromptInfo, TextDelta
from clover_desk.ui.theme import color, confidence_color, mono_font, set_style_class
from clover_desk.ui.throttle import Throttle
from clover_desk.ui.widgets import accessible, push_button

AR_PIECES_KEPT = 400  # autoregressive mode: the latest text pieces shown in the token stream

# --------------------------------------------------------------------------------------------- model (no Qt)


def _count(n: int, noun: str) -> str:
    """"1 block", "2 blocks"."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


@dataclass
class BlockRecord:
    """Every denoising pass of one block, in order, plus what the block finally committed."""

    block_index: int
    steps: list[BlockStep] = field(default_factory=list)
    committed_tokens: int | None = None  # set by BlockCommitted
    passes: int | None = None


class DenoiseModel:
    """What the view shows, kept as plain data: recent blocks with their steps, and running speed figures."""

    def __init__(self, history_blocks: int = 64, clock=time.monotonic) -> None:
        self.history_blocks = history_blocks
        self._clock = clock
        self.blocks: deque[BlockRecord] = deque(maxlen=history_blocks)
        self.block_size = 32
        self.total_steps = 0  # steps received this generation (including those that left the history)
        self.tokens_committed = 0
        self.blocks_committed = 0
        self.passes_committed = 0
        self.started_at: float | None = None  # first step of this generation
        self.finished: Finished | None = None
        self.mode = "diffusion"  # "diffusion" | "ar" (one token per step: no blocks, a token stream instead)
        self.pieces: deque[tuple[str, str]] = deque(maxlen=AR_PIECES_KEPT)  # AR: (text, channel), newest last
        self.pieces_seen = 0  # AR: text pieces received (about one per token)
        self.version = 0  # bumped on every change; the view repaints only when it moved

    # -- events
    def reset(self, mode: str | None = None) -> None:
        self.blocks.clear()
        self.total_steps = self.tokens_committed = self.blocks_committed = self.passes_committed = 0
        self.started_at = None
        self.finished = None
        self.pieces.clear()
        self.pieces_seen = 0
        if mode is not None:
            self.mode = mode
        self.version += 1

    def on_prompt(self, info: PromptInfo) -> None:
        self.reset("ar" if info.block_size <= 1 else "diffusion")  # the AR loop announces blocks of one token
        self.block_size = max(1, info.block_size) if self.mode == "diffusion" else self.block_size

    def on_delta(self, delta: TextDelta) -> None:
        """Autoregressive mode: the token stream (in diffusion mode text arrives per block and is not shown here)."""
        if self.mode != "ar" or not delta.text:
            return
        if self.started_at is None:
            self.started_at = self._clock()
        self.pieces.append((delta.text, delta.channel))
        self.pieces_seen += 1
        self.version += 1

    def on_step(self, step: BlockStep) -> None:
        if self.started_at is None:
            self.started_at = self._clock()
        if not self.blocks or self.blocks[-1].block_index != step.block_index:
            self.blocks.append(BlockRecord(step.block_index))
        self.blocks[-1].steps.append(step)
        self.block_size = len(step.tokens) or self.block_size
        self.total_steps += 1
        self.version += 1

    def on_committed(self, event: BlockCommitted) -> None:
        for record in reversed(self.blocks):
            if record.block_index == event.block_index:
                record.committed_tokens = len(event.token_ids)
                record.passes = event.passes
                break
        self.tokens_committed += len(event.token_ids)
        self.blocks_committed += 1
        self.passes_committed += event.passes
        self.version += 1

    def on_finished(self, event: Finished) -> None:
        self.finished = event
        self.version += 1

    # -- queries
    def step_count(self) -> int:
        """Steps held in the history (the replay slider's range)."""
        return sum(len(b.steps) for b in self.blocks)

    def step_at(self, index: int) -> tuple[BlockRecord, int] | None:
        """The block and pass index of history step ``index`` (0 = oldest kept)."""
        for record in self.blocks:
            if index < len(record.steps):
                return record, index
            index -= len(record.steps)
        return None

    def latest(self) -> tuple[BlockRecord, int] | None:
        if not self.blocks or not self.blocks[-1].steps:
            return None
        return self.blocks[-1], len(self.blocks[-1].steps) - 1

    def tokens(self) -> int:
        """Tokens generated so far (AR: the pieces received, until Finished gives the exact count)."""
        if self.finished is not None:
            return self.finished.tokens
        return self.pieces_seen if self.mode == "ar" else self.tokens_committed

    def tokens_per_s(self) -> float:
        if self.finished is not None and self.finished.tokens_per_s:
            return self.finished.tokens_per_s
        done = self.tokens()
        if self.started_at is None or not done:
            return 0.0
        elapsed = self._clock() - self.started_at
        return done / elapsed if elapsed > 0 else 0.0

    def tokens_per_pass(self) -> float:
        if self.finished is not None and self.finished.tokens_per_pass:
            return self.finished.tokens_per_pass
        return self.tokens_committed / self.passes_committed if self.passes_committed else 0.0


def committed_per_pass(record: BlockRecord) -> list[int]:
    """Slots committed by each pass of a block (the bar chart)."""
    return [sum(1 for i, c in enumerate(s.committed_now) if c and i >= s.prompt_slots) for s in record.steps]


def display_text(piece: str) -> str:
    """A token piece made visible in a cell: spaces as ·, newlines as ⏎, tabs as →."""
    if piece == "":
        return "∅"
    return piece.replace("\n", "⏎").replace("\t", "→").replace(" ", "·")


# --------------------------------------------------------------------------------------------- painting


class DenoiseCanvas(QWidget):
    """The one custom-painted widget: header figures, 32 cells, the per-pass bar chart and a legend."""

    COLUMNS = 8

    def __init__(self, model: DenoiseModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._model = model
        self.shown: tuple[BlockRecord, int] | None = None  # which (block, pass) is drawn; None = waiting
        self.paint_count = 0
        self.painted = ""  # what the last paint drew: "blocks" or "token stream" (tests, diagnostics)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.setMinimumSize(300, 320)
        self._cell_font = mono_font(9.0)
        self._small = QFont(self.font())
        self._small.setPointSizeF(8.5)
        self._big = QFont(self.font())
        self._big.setPointSizeF(15.0)
        self._big.setWeight(QFont.Weight.DemiBold)

    def sizeHint(self) -> QSize:
        return QSize(420, 460)

    def show_step(self, shown: tuple[BlockRecord, int] | None) -> None:
        self.shown = shown
        self.update()

    def paintEvent(self, event: QPaintEvent) -> None:  # noqa: N802 (Qt name)
        self.paint_count += 1
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        p.fillRect(self.rect(), color("surface"))
        margin = 14.0
        width = self.width() - 2 * margin
        y = margin
        if self._model.mode == "ar":
            self._paint_autoregressive(p, margin, y, width)
            p.end()
            self.painted = "token stream"
            return
        self.painted = "blocks"
        y = self._paint_header(p, margin, y, width)
        cols = self.COLUMNS
        rows = max(1, -(-self._model.block_size // cols))
        gap = 5.0
        cell_w = (width - gap * (cols - 1)) / cols
        cell_h = max(34.0, min(58.0, cell_w * 0.8))
        grid_h = rows * cell_h + (rows - 1) * gap
        self._paint_cells(p, margin, y, cell_w, cell_h, gap, cols)
        y += grid_h + 16
        room = self.height() - y - 56  # what the two charts share above the legend
        chart_h = max(60.0, min(180.0, room * 0.55))
        self._paint_chart(p, QRectF(margin, y, width, chart_h))
        y += chart_h + 14
        history_h = max(50.0, min(150.0, room - chart_h - 14))
        self._paint_history(p, QRectF(margin, y, width, history_h))
        y += history_h + 12
        self._paint_legend(p, margin, y)
        p.end()

    def _paint_header(self, p: QPainter, x: float, y: float, width: float) -> float:
        m = self._model
        shown = self.shown
        figures = [
            ("block", f"{shown[0].block_index}" if shown else "–"),
            ("pass", f"{shown[1] + 1}" + (f"/{shown[0].passes}" if shown and shown[0].passes else "") if shown else "–"),
            ("tok/pass", f"{m.tokens_per_pass():.1f}" if m.passes_committed else "–"),
            ("tok/s", f"{m.tokens_per_s():.1f}" if m.tokens_committed else "–"),
        ]
        return self._paint_figures(p, x, y, width, figures)

    def _paint_cells(self, p: QPainter, x0: float, y0: float, cw: float, ch: float, gap: float, cols: int) -> None:
        n = self._model.block_size
        step = self.shown[0].steps[self.shown[1]] if self.shown else None
        p.setFont(self._cell_font)
        fm = QFontMetricsF(self._cell_font)
        for i in range(n):
            r, c = divmod(i, cols)
            rect = QRectF(x0 + c * (cw + gap), y0 + r * (ch + gap), cw, ch)
            if step is None or i >= len(step.tokens):
                p.setPen(Qt.PenStyle.NoPen)
                p.setBrush(color("mask"))
                p.drawRoundedRect(rect, 5, 5)
                continue
            conf = step.confidence[i] if i < len(step.confidence) else 0.0
            text = ""
            verdict = step.verdict[i] if i < len(step.verdict) else ""
            if verdict:  # spec mode's verify pass: accepted drafts, the verifier's own token, rejected drafts
                self._paint_verdict(p, rect, verdict, step.texts[i] if i < len(step.texts) else "", fm)
                continue
            if i < step.prompt_slots:  # prompt tail: context, not generated
                fill, fg, pen = color("surface2"), color("faint"), QPen(color("border"), 1)
                text = step.texts[i] if i < len(step.texts) else ""
            elif step.masked[i]:
                fill, fg, pen = color("mask"), color("faint"), QPen(Qt.PenStyle.NoPen)
            elif step.committed_now[i]:
                fill = confidence_color(conf)
                fg = QColor("#0d1014")  # dark text on the bright confidence colours, in both themes
                pen = QPen(color("text"), 2)
                text = step.texts[i] if i < len(step.texts) else ""
            else:
                base = confidence_color(conf)
                fill = QColor(base)
                fill.setAlpha(70)
                fg, pen = color("text"), QPen(base.darker(115), 1)
                text = step.texts[i] if i < len(step.texts) else ""
            p.setPen(pen)
            p.setBrush(fill)
            p.drawRoundedRect(rect.adjusted(1, 1, -1, -1), 5, 5)
            p.setPen(fg)
            if step.masked[i] and i >= step.prompt_slots:
                p.drawText(rect, Qt.AlignmentFlag.AlignCenter, "▒")
                continue
            label = fm.elidedText(display_text(text), Qt.TextElideMode.ElideRight, rect.width() - 6)
            p.drawText(rect.adjusted(3, 2, -3, -10), Qt.AlignmentFlag.AlignCenter, label)
            p.setFont(self._small)
            p.setPen(fg if step.committed_now[i] else color("muted"))
            p.drawText(rect.adjusted(3, 0, -4, -2), Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignBottom, f"{conf:.2f}")
            p.setFont(self._cell_font)

    def _paint_verdict(self, p: QPainter, rect: QRectF, verdict: str, text: str, fm: QFontMetricsF) -> None:
        """One slot of a verify pass (spec mode): "accepted" green, "verifier" the accent outlined, "rejected" red
        and struck through (it is drafted again)."""
        base = color("danger" if verdict == "rejected" else "accent")
        fill = QColor(base)
        fill.setAlpha(200 if verdict == "accepted" else 90)
        p.setPen(QPen(color("text"), 2) if verdict == "verifier" else QPen(base.darker(115), 1))
        p.setBrush(fill)
        p.drawRoundedRect(rect.adjusted(1, 1, -1, -1), 5, 5)
        p.setPen(color("text"))
        label = fm.elidedText(display_text(text), Qt.TextElideMode.ElideRight, rect.width() - 6)
        p.drawText(rect.adjusted(3, 2, -3, -10), Qt.AlignmentFlag.AlignCenter, label)
        p.setFont(self._small)
        p.setPen(color("muted"))
        p.drawText(rect.adjusted(3, 0, -4, -2), Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignBottom,
                   {"accepted": "ok", "verifier": "AR", "rejected": "x"}[verdict])
        if verdict == "rejected":
            p.setPen(QPen(base, 1.5))
            p.drawLine(rect.left() + 4, rect.center().y(), rect.right() - 4, rect.center().y())
        p.setFont(self._cell_font)

    def _paint_chart(self, p: QPainter, area: QRectF) -> None:
        p.setFont(self._small)
        p.setPen(color("muted"))
        p.drawText(QRectF(area.x(), area.y(), area.width(), 16), Qt.AlignmentFlag.AlignLeft, "TOKENS COMMITTED PER PASS")
        plot = QRectF(area.x(), area.y() + 20, area.width(), area.height() - 20)
        p.setPen(QPen(color("border"), 1))
        p.drawLine(plot.bottomLeft(), plot.bottomRight())
        if not self.shown:
            return
        record, current = self.shown
        counts = committed_per_pass(record)
        top = max(max(counts, default=1), 4)
        slots = max(len(counts), 8)
        bar_w = min(28.0, plot.width() / slots)
        for i, k in enumerate(counts):
            h = (plot.height() - 14) * k / top
            bar = QRectF(plot.x() + i * bar_w + 2, plot.bottom() - h, bar_w - 4, h)
            p.setPen(Qt.PenStyle.NoPen)
            p.setBrush(color("accent") if i == current else color("accent_dim") if i < current else color("surface3"))
            p.drawRoundedRect(bar, 2, 2)
            if bar_w >= 14:
                p.setPen(color("text") if i == current else color("muted"))
                p.drawText(QRectF(bar.x() - 4, bar.y() - 14, bar.width() + 8, 13), Qt.AlignmentFlag.AlignCenter, str(k))

    def _paint_history(self, p: QPainter, area: QRectF) -> None:
        """Passes per block over the kept history; the block on show is outlined."""
        p.setFont(self._small)
        p.setPen(color("muted"))
        p.drawText(QRectF(area.x(), area.y(), area.width(), 16), Qt.AlignmentFlag.AlignLeft,
                   "PASSES PER BLOCK (RECENT)")
        plot = QRectF(area.x(), area.y() + 20, area.width(), area.height() - 20)
        p.setPen(QPen(color("border"), 1))
        p.drawLine(plot.bottomLeft(), plot.bottomRight())
        blocks = list(self._model.blocks)
        if not blocks:
            return
        bar_w = min(14.0, plot.width() / max(len(blocks), 24))
        blocks = blocks[-int(plot.width() // bar_w):]
        top = max(max(len(b.steps) for b in blocks), 8)
        shown = self.shown[0] if self.shown else None
        for i, record in enumerate(blocks):
            n = len(record.steps)
            h = (plot.height() - 4) * n / top
            bar = QRectF(plot.x() + i * bar_w + 1, plot.bottom() - h, bar_w - 2, h)
            fill = color("accent2") if record.committed_tokens is not None else color("surface3")
            fill.setAlpha(230 if record is shown else 140)
            p.setPen(QPen(color("text"), 1.5) if record is shown else Qt.PenStyle.NoPen)
            p.setBrush(fill)
            p.drawRect(bar)

    def _paint_figures(self, p: QPainter, x: float, y: float, width: float, figures: list[tuple[str, str]]) -> float:
        box_w = width / len(figures)
        for i, (label, value) in enumerate(figures):
            bx = x + i * box_w
            p.setFont(self._big)
            p.setPen(color("text"))
            p.drawText(QRectF(bx, y, box_w, 26), Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, value)
            p.setFont(self._small)
            p.setPen(color("muted"))
            p.drawText(QRectF(bx, y + 26, box_w, 16), Qt.AlignmentFlag.AlignLeft, label.upper())
        return y + 54

    def _paint_autoregressive(self, p: QPainter, x: float, y: float, width: float) -> None:
        """AR mode: no blocks. The figures, one sentence saying why, and the token stream (newest highlighted)."""
        m = self._model
        tokens = m.tokens()
        y = self._paint_figures(p, x, y, width, [
            ("mode", "AR"),
            ("tokens", f"{tokens:,}" if tokens else "–"),
            ("tok/step", "1.0"),
            ("tok/s", f"{m.tokens_per_s():.1f}" if tokens else "–"),
        ])
        p.setFont(self._small)
        p.setPen(color("muted"))
        note = QRectF(x, y, width, 34)
        p.drawText(note, Qt.AlignmentFlag.AlignLeft | Qt.TextFlag.TextWordWrap,
                   "Autoregressive: one token per model step, nothing to denoise. The latest tokens:")
        y += 40
        p.drawText(QRectF(x, y, width, 16), Qt.AlignmentFlag.AlignLeft, "TOKEN STREAM")
        y += 20
        area = QRectF(x, y, width, max(40.0, self.height() - y - 40))
        p.setPen(QPen(color("border"), 1))
        p.setBrush(color("surface2"))
        p.drawRoundedRect(area, 6, 6)
        self._paint_stream(p, area.adjusted(8, 8, -8, -8))
        legend_y = area.bottom() + 10
        lx = x
        for swatch, label in ((color("accent"), "newest token"), (color("surface3"), "answer"),
                              (color("mask"), "thinking")):
            p.setPen(Qt.PenStyle.NoPen)
            p.setBrush(swatch)
            p.drawRoundedRect(QRectF(lx, legend_y + 3, 10, 10), 2, 2)
            p.setPen(color("muted"))
            p.setFont(self._small)
            w = QFontMetricsF(self._small).horizontalAdvance(label)
            p.drawText(QRectF(lx + 14, legend_y, w + 4, 16), Qt.AlignmentFlag.AlignLeft, label)
            lx += w + 30

    def _paint_stream(self, p: QPainter, area: QRectF) -> None:
        """The newest pieces as chips, filled line by line from the bottom up (the newest bottom right)."""
        pieces = list(self._model.pieces)
        if not pieces:
            p.setFont(self._small)
            p.setPen(color("faint"))
            p.drawText(area, Qt.AlignmentFlag.AlignCenter, "waiting for the first token")
            return
        fm = QFontMetricsF(self._cell_font)
        line_h, gap = fm.height() + 8, 4.0
        max_lines = max(1, int((area.height() + gap) // (line_h + gap)))
        lines: list[list[tuple[str, str, float]]] = [[]]
        used = 0.0
        for text, channel in reversed(pieces):  # newest first: fill the bottom line, then the ones above
            label = fm.elidedText(display_text(text), Qt.TextElideMode.ElideRight, area.width() - 8)
            w = fm.horizontalAdvance(label) + 10
            if lines[-1] and used + w > area.width():
                if len(lines) == max_lines:
                    break
                lines.append([])
                used = 0.0
            lines[-1].append((label, channel, w))
            used += w + gap
        p.setFont(self._cell_font)
        newest = True
        for row, line in enumerate(lines):
            top = area.bottom() - (row + 1) * line_h - row * gap
            right = area.right()
            for label, channel, w in line:  # newest first, right to left
                rect = QRectF(right - w, top, w, line_h)
                fill = color("accent") if newest else color("mask") if channel == "thinking" else color("surface3")
                p.setPen(Qt.PenStyle.NoPen)
                p.setBrush(fill)
                p.drawRoundedRect(rect, 4, 4)
                p.setPen(color("on_accent") if newest else color("muted") if channel == "thinking" else color("text"))
                p.drawText(rect, Qt.AlignmentFlag.AlignCenter, label)
                right -= w + gap
                newest = False

    def _paint_legend(self, p: QPainter, x: float, y: float) -> None:
        p.setFont(self._small)
        items = [
            (color("mask"), "masked"),
            (confidence_color(0.95), "committed this pass"),
            (QColor(70, 201, 139, 70), "committed earlier"),
        ]
        if any(r.steps and any(st.verdict for st in r.steps) for r in self._model.blocks):  # spec mode's verify
            items += [(color("accent"), "draft accepted"), (color("danger"), "draft rejected")]
        left, right = x, self.width() - 14.0
        for swatch, label in items:  # an item that does not fit goes to the next line (narrow panels)
            w = QFontMetricsF(self._small).horizontalAdvance(label)
            if x > left and x + 14 + w > right:
                x, y = left, y + 20
            p.setPen(Qt.PenStyle.NoPen)
            p.setBrush(swatch)
            p.drawRoundedRect(QRectF(x, y + 3, 10, 10), 2, 2)
            p.setPen(color("muted"))
            p.drawText(QRectF(x + 14, y, w + 4, 16), Qt.AlignmentFlag.AlignLeft, label)
            x += w + 30
        # confidence scale, on the next line when the panel is narrow
        if x + 150 > right:
            x, y = left, y + 20
        for k in range(20):
            p.setPen(Qt.PenStyle.NoPen)
            p.setBrush(confidence_color(k / 19))
            p.drawRect(QRectF(x + k * 3, y + 4, 3, 8))
        p.setPen(color("muted"))
        p.drawText(QRectF(x + 64, y, 80, 16), Qt.AlignmentFlag.AlignLeft, "confidence")


class DenoiseView(QWidget):
    """The denoising tab: canvas + replay controls. Feed it engine events with :meth:`add_event`; call
    :meth:`start` when an answer begins (it clears the view and follows the live pass again)."""

    replayChanged = Signal(int, int)  # (block_index, pass_index) now drawn, when the user scrubs

    def __init__(self, history_blocks: int = 64, fps: int = 30, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("denoiseView")
        self.model = DenoiseModel(history_blocks)
        self.canvas = DenoiseCanvas(self.model)
        self.canvas.setObjectName("denoiseCanvas")
        accessible(self.canvas, "Denoising of the current block")
        self.following = True  # live: show the newest step; False: the slider picks
        self.unavailable = ""  # why there are no passes to show (a remote answer), "" when there can be
        self._shown_version = -1
        self.throttle = Throttle(self.refresh, max(1, 1000 // fps), self)

        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setObjectName("replaySlider")
        self.slider.setRange(0, 0)
        self.slider.setEnabled(False)
        self.slider.setToolTip("Replay the recorded passes of the last blocks (the end follows the live pass)")
        accessible(self.slider, "Replay position")
        self.live_button = push_button("Live", "liveToggle", style="chip", checked=True, name="Follow the live pass",
                                       tip="Follow the newest pass (each new answer starts live)")
        self.position_label = QLabel("waiting for a generation")
        self.position_label.setObjectName("denoisePosition")
        self.position_label.setWordWrap(True)  # never cut at the panel's edge
        set_style_class(self.position_label, "muted")
        self.replay_label = QLabel("&Replay")
        self.replay_label.setBuddy(self.slider)

        controls = QHBoxLayout()
        controls.setContentsMargins(14, 4, 14, 12)
        controls.addWidget(self.replay_label)
        controls.addWidget(self.slider, 1)
        controls.addWidget(self.live_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        layout.addWidget(self.canvas, 1)
        info = QHBoxLayout()
        info.setContentsMargins(14, 0, 14, 0)
        info.addWidget(self.position_label)
        layout.addLayout(info)
        layout.addLayout(controls)
        self._connect_signals()

    def _connect_signals(self) -> None:
        self.slider.valueChanged.connect(self.on_slider_moved)
        self.live_button.toggled.connect(self.on_live_toggled)

    # -- events in (cheap: no painting here)
    def add_event(self, event: object) -> None:
        if isinstance(event, BlockStep):
            self.model.on_step(event)
        elif isinstance(event, BlockCommitted):
            self.model.on_committed(event)
        elif isinstance(event, TextDelta):
            if self.model.mode != "ar":
                return
            self.model.on_delta(event)
        elif isinstance(event, PromptInfo):
            self.model.on_prompt(event)
            self._set_following(True)
        elif isinstance(event, Finished):
            self.model.on_finished(event)
            self.throttle.request()
            self.throttle.flush()
            return
        else:
            return
        self.throttle.request()

    def start(self, mode: str = "diffusion") -> None:
        """A new answer begins (``mode`` "diffusion" | "ar" | "spec", whose drafting and verify passes show as
        blocks): clear the view and follow its live pass."""
        self.model.reset("ar" if mode == "ar" else "diffusion")
        self._set_following(True)
        self.throttle.request()

    def clear(self) -> None:
        self.start(self.model.mode)

    def set_unavailable(self, reason: str) -> None:
        """Say why nothing can be shown (a remote server's passes never cross its API) instead of waiting for
        passes; "" shows them again."""
        self.unavailable = reason
        self._shown_version = -1
        self.refresh()

    def _set_following(self, on: bool) -> None:
        self.following = on
        self._shown_version = -1
        if self.live_button.isChecked() != on:
            self.live_button.blockSignals(True)
            self.live_button.setChecked(on)
            self.live_button.blockSignals(False)

    # -- throttled refresh
    def refresh(self) -> None:
        if self.model.version == self._shown_version:
            return
        self._shown_version = self.model.version
        if self.unavailable:
            self.canvas.show_step(None)
            self.slider.setEnabled(False)
            self.live_button.setEnabled(False)
            self.position_label.setText(self.unavailable)
            return
        ar = self.model.mode == "ar"
        count = 0 if ar else self.model.step_count()
        self.slider.blockSignals(True)
        self.slider.setRange(0, max(0, count - 1))
        self.slider.setEnabled(count > 0)
        if self.following:
            self.slider.setValue(max(0, count - 1))
        self.slider.blockSignals(False)
        self.live_button.setEnabled(not ar)
        if ar:
            self._show_autoregressive()
            return
        self._show(self.model.latest() if self.following else self.model.step_at(self.slider.value()))

    def _show_autoregressive(self) -> None:
        self.canvas.show_step(None)
        m = self.model
        tokens = m.tokens()
        if not tokens:
            self.position_label.setText("autoregressive · one token per step, no blocks to denoise")
            return
        state = "finished" if m.finished is not None else "live"
        self.position_label.setText(f"autoregressive · {state} · {tokens:,} tokens · {m.tokens_per_s():.1f} tok/s")

    def _show(self, shown: tuple[BlockRecord, int] | None) -> None:
        self.canvas.show_step(shown)
        if shown is None:
            self.position_label.setText("waiting for a generation")
            return
        record, pass_index = shown
        state = "live" if self.following else "replay"
        total = f" of {record.passes}" if record.passes else ""
        self.position_label.setText(
            f"{state} · block {record.block_index}, pass {pass_index + 1}{total} · "
            f"{_count(self.model.blocks_committed, 'block')}, {_count(self.model.tokens_committed, 'token')}"
        )

    # -- slots
    def on_slider_moved(self, value: int) -> None:
        # dragged back: replay (the view stays there while new passes arrive); dragged to the end: live again
        self._set_following(value >= self.slider.maximum())
        shown = self.model.step_at(value)
        self._show(shown)
        if shown:
            self.replayChanged.emit(shown[0].block_index, shown[1])

    def on_live_toggled(self, live: bool) -> None:
        self.following = live
        self._shown_version = -1
        self.refresh()
