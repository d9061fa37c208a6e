"""Render the README screenshots from the real widgets, headless: ``.venv/bin/python scripts/screenshots.py``.

The window is the application's own (built by ``clover_desk.app.CloverDeskApp``) over a temporary app-data folder;
only the engine is replaced by a replay of prepared events (a tiny random checkpoint writes noise, which makes a
poor picture). Writes ``docs/screenshots/*.png``: the detailed set at ``--size`` in the dark theme, and the whole
window at 1,024 x 640 and 1,920 x 1,080 in the light and the dark theme (``window-<theme>-<W>x<H>.png``).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("QTWEBENGINE_DISABLE_SANDBOX", "1")
os.environ.setdefault("QTWEBENGINE_CHROMIUM_FLAGS", "--disable-gpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clover_desk.qt_compat import guard_pyside_bool_refcounts  # noqa: E402
from clover_desk.ui.preview_sandbox import register_schemes  # noqa: E402

guard_pyside_bool_refcounts()
register_schemes()

from PySide6.QtCore import QEventLoop, QObject, QTimer, Signal  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from clover_desk.engine.decode.events import (  # noqa: E402
    BlockCommitted,
    BlockStep,
    Finished,
    GenerationParams,
    LoadProgress,
    PromptInfo,
    TextDelta,
)
from clover_desk.engine.placement.hardware import Hardware  # noqa: E402

log = logging.getLogger("screenshots")
GIB = 1024**3

THINKING = (
    "The user wants a small pomodoro timer as a single HTML file. Keep it self-contained: inline CSS and JS, "
    "no CDN. A big countdown, start/pause/reset, and a progress ring drawn with SVG."
)
ANSWER = """Here is a self-contained **Pomodoro timer** — one file, no network:

```html
<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>Pomodoro</title>
<style>
 body{margin:0;height:100vh;display:grid;place-items:center;background:#0f1720;color:#e8f0ea;font-family:sans-serif}
 .card{text-align:center} .t{font-size:72px;font-weight:700;letter-spacing:2px;margin:18px 0}
 button{background:#46c98b;border:0;border-radius:10px;padding:10px 22px;margin:0 6px;font-size:16px;color:#0b1410}
 button.alt{background:#26313d;color:#e8f0ea} circle{transition:stroke-dashoffset .5s linear}
</style></head><body><div class="card">
 <svg width="220" height="220"><circle cx="110" cy="110" r="96" stroke="#26313d" stroke-width="12" fill="none"/>
 <circle id="ring" cx="110" cy="110" r="96" stroke="#46c98b" stroke-width="12" fill="none"
  stroke-dasharray="603" stroke-dashoffset="150" transform="rotate(-90 110 110)"/></svg>
 <div class="t" id="t">18:45</div>
 <button>Start</button><button class="alt">Reset</button>
</div></body></html>
```

- **Start / Pause** toggles the countdown; **Reset** goes back to 25:00.
- The ring is an SVG circle whose `stroke-dashoffset` follows the time left.

Open it with the **Preview** button to try it in the sandbox."""

QUESTION = "Write a pomodoro timer as a single HTML file, no external libraries."
SECOND_Q = "How does block diffusion decide how many tokens to commit in one pass?"
SECOND_A = """Each pass predicts **all 32 masked slots** of the current block at once. Then:

1. Every slot whose confidence is at least the *threshold* (0.9 here) is committed.
2. If none clears it, the single most confident slot is committed, so a pass always makes progress.
3. Committed slots are never re-masked; the next pass sees them as context.

Easy stretches (boilerplate, closing tags) commit 8–12 tokens in one pass, hard ones 1–2 — which is why
the *tok/pass* figure in the Denoising tab moves with the content."""

WORDS = ("Each pass predicts all masked slots of the current block at once and commits every slot whose confidence "
         "clears the threshold , so easy stretches finish in a few passes while hard ones take longer").split()


class ReplayClient(QObject):
    """Replays prepared events with the EngineClient signal contract (no worker process)."""

    ready = Signal()
    stateChanged = Signal(str)
    loadProgress = Signal(object)
    loaded = Signal(dict)
    loadFailed = Signal(str, str)
    event = Signal(str, object)
    errorMessage = Signal(str, str)
    crashed = Signal(str)
    planReady = Signal(dict)
    stopped = Signal()

    def __init__(self, pass_ms: int = 100) -> None:
        super().__init__()
        self.state = "idle"
        self.pid = None
        self.model_info: dict | None = None
        self.script: list[object] = []
        self.n = 0
        self.pass_ms = pass_ms  # one denoising pass of the 35B model on the target card, roughly
        self._queue: list[object] = []
        self._rid = ""
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self._next)

    def start(self) -> None:
        self.ready.emit()

    def load(self, *args: object, **kwargs: object) -> None:
        self.model_info = {"model_dir": str(args[0]) if args else ""}
        self.loaded.emit(self.model_info)

    def cancel_load(self) -> None: ...
    def cancel(self, request_id: str) -> None: ...
    def restart(self) -> None: ...
    def shutdown(self, wait_ms: int = 0) -> None: ...

    def generate(self, messages: list, params: GenerationParams, tools: object = None) -> str:
        self.n += 1
        self._rid = f"r{self.n}"
        self._queue = list(self.script)
        self._timer.start(0)  # asynchronous, like the real client
        return self._rid

    def _next(self) -> None:
        while self._queue:
            ev = self._queue.pop(0)
            self.event.emit(self._rid, ev)
            if isinstance(ev, BlockStep):
                self._timer.start(self.pass_ms)
                return


def diffusion_script(answer: str, thinking: str, blocks: int, seed: int = 3) -> list:
    """Plausible per-pass events: confidences high for easy slots, passes committing several slots each."""
    rng = random.Random(seed)
    out: list[object] = [PromptInfo(prompt_tokens=58, block_size=32, first_block=1, tail=26)]
    answer_blocks = max(1, blocks - 1)
    chunk = -(-len(answer) // answer_blocks)
    passes_total = 0
    for b in range(blocks):
        prompt_slots = 26 if b == 0 else 0
        masked = [i >= prompt_slots for i in range(32)]
        conf = [1.0 if i < prompt_slots else 0.0 for i in range(32)]
        texts = ["⟨prompt⟩" if i < prompt_slots else "" for i in range(32)]
        p = 0
        while any(masked):
            todo = [i for i in range(32) if masked[i]]
            k = min(len(todo), rng.choice((2, 3, 4, 5, 6, 8, 9)))
            now = [False] * 32
            for i in sorted(todo, key=lambda _: rng.random())[:k]:
                masked[i], now[i] = False, True
                conf[i] = min(0.999, max(0.42, rng.gauss(0.86, 0.12)))
                texts[i] = " " + WORDS[(i + 5 * b) % len(WORDS)]
            out.append(BlockStep(b, p, tuple(range(32)), tuple(texts), tuple(masked), tuple(conf), tuple(now),
                                 prompt_slots))
            p += 1
        passes_total += p
        if b == 0 and thinking:
            out.append(TextDelta(thinking, "thinking"))
        elif b > 0 or not thinking:
            k = b - 1 if thinking else b
            if answer[k * chunk : (k + 1) * chunk]:
                out.append(TextDelta(answer[k * chunk : (k + 1) * chunk], "answer"))
        out.append(BlockCommitted(b, p, tuple(range(32 - prompt_slots))))
    tokens = 32 * blocks - 26
    out.append(Finished(tuple(range(tokens)), answer, thinking, "eos", tokens, passes_total, tokens / passes_total,
                        38.4, 0.41, 58, 0.12, tokens / 38.4, {"hits": 8712, "misses": 1288}))
    return out


def settle(ms: int = 300) -> None:
    loop = QEventLoop()
    QTimer.singleShot(ms, loop.quit)
    loop.exec()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "docs" / "screenshots"))
    parser.add_argument("--size", default="1480x900")
    parser.add_argument("--matrix-only", action="store_true", help="only the window-<theme>-<size>.png set")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    width, height = (int(v) for v in args.size.split("x"))

    app = QApplication.instance() or QApplication(sys.argv[:1])
    from clover_desk.app import AppSettings, CloverDeskApp
    from clover_desk.ui.theme import apply_theme

    apply_theme(app, "dark")
    home = Path(tempfile.mkdtemp(prefix="clover-shots-"))
    hardware = Hardware(gpu_name="NVIDIA GeForce RTX 4070 Ti SUPER", vram_total_bytes=16 * GIB,
                        vram_free_bytes=15 * GIB, ram_total_bytes=64 * GIB, ram_available_bytes=52 * GIB)
    client = ReplayClient()
    desk = CloverDeskApp(home, client=client, settings=AppSettings(model_dir="/models/Clover-35B-A3B-Preview"),
                         hardware=hardware, with_model_manager=False)
    window = desk.window
    window.state.set_theme_preference("dark")
    window.resize(width, height)
    window.show()

    # 1. a chat with an HTML app, its preview open
    if args.matrix_only:
        client.pass_ms = 5
    older = desk.store.create_conversation(title="Block diffusion, explained")
    desk.store.add_message(older.id, "user", SECOND_Q)
    desk.store.add_message(older.id, "assistant", SECOND_A, stats={"tokens": 96, "tokens_per_s": 41.2})
    for title in ("Refactor the SQLite schema", "Trip plan: Lisbon in 3 days", "Regex for ISO dates"):
        desk.store.create_conversation(title=title)
    window.conversations.reload()
    window.conversations.on_new()
    client.script = diffusion_script(ANSWER, THINKING, blocks=9)
    window.composer.input.setPlainText(QUESTION)
    finished = QEventLoop()
    window.generationFinished.connect(finished.quit)
    window.composer.on_submit()
    answer = window.chat.widgets[-1]
    # The Preview button shows up while the page streams; opened then, the preview follows the answer.
    while window.is_generating() and not answer.preview_button.isVisible():
        settle(10)
    answer.preview_button.click()
    while window.is_generating() and "rotate(-90" not in desk.preview.html():  # the ring is drawn
        settle(10)
    while window.is_generating() and desk.preview.shown_html() != desk.preview.html():  # the throttled reload
        settle(10)
    settle(250)
    if not window.is_generating():
        log.warning("the answer finished before the mid-stream picture")
    shot(window, out / "preview-while-streaming.png")
    if window.is_generating():
        finished.exec()
    answer.thinking_toggle.setChecked(True)
    answer.preview_button.click()
    settle(2500)  # let QtWebEngine render
    window.chat.scroll.verticalScrollBar().setValue(0)
    settle(200)
    shot(window, out / "chat-with-preview.png")
    matrix(window, out)
    if args.matrix_only:
        window.close()
        desk.store.close()
        return 0
    window.state.set_theme_preference("dark")
    window.resize(width, height)
    settle(300)

    # 2. the denoising view mid-block
    window.conversations.on_selected(older.id)
    client.script = diffusion_script(SECOND_A, "", blocks=6, seed=11)
    window.composer.input.setPlainText("And what does the threshold slider change?")
    window.composer.on_submit()
    window.tabs.setCurrentWidget(window.denoise)
    model = window.denoise.model
    while not (model.blocks_committed == 3 and model.blocks[-1].block_index == 3 and len(model.blocks[-1].steps) >= 3):
        settle(10)
    window.denoise.throttle.flush()
    window.denoise.refresh()
    shot(window, out / "denoising-mid-block.png")
    shot(window.tabs, out / "denoising-panel.png")
    finished.exec()  # let it finish for the next pictures

    # 3. the VRAM panel
    window.tabs.setCurrentWidget(desk.vram_panel)
    desk.vram_panel.set_vram_budget_bytes(int(13.5 * GIB))
    # the engine runs under a 12 GiB / 8K plan; the slider proposes another one ("Apply to reload under this plan")
    desk.vram_panel.set_in_use(desk.vram_panel.plan_for(int(12 * GIB), 8192).to_dict(), "cuda")
    settle(200)
    shot(window, out / "vram-panel.png")
    shot(window.tabs, out / "vram-panel-detail.png")

    # 4. the settings drawer
    window.settings_button.setChecked(True)
    window.drawer.system_prompt.setPlainText("You are a concise assistant. Inline all CSS and JS in HTML answers.")
    window.sidebar.search.setText("diffusion")
    window.tabs.setCurrentWidget(window.denoise)
    settle(200)
    shot(window, out / "settings-and-search.png")
    window.settings_button.setChecked(False)
    window.sidebar.search.clear()

    # 5. an engine crash: the banner, the chat intact; and model loading with Cancel
    client.crashed.emit("worker killed by SIGKILL (out of host memory?)")
    client.loadProgress.emit(LoadProgress("quantizing", int(9.3 * GIB), int(18.6 * GIB), "layers.21.mlp.experts", 41.0))
    settle(200)
    shot(window, out / "engine-crash-and-load.png")
    # a 6 GiB card asked for a 128K context: the slider's floor is above the card, so the plan cannot fit
    from clover_desk.ui.vram_panel import VramPanel

    small = VramPanel(desk._plan_function(), 6 * GIB, "NVIDIA GeForce RTX 2060", hardware.ram_total_bytes)
    small.resize(desk.vram_panel.size())
    small.ctx_combo.setCurrentIndex(small.ctx_combo.findData(131072))
    small.show()
    settle(100)
    shot(small, out / "vram-wont-fit.png")
    small.close()

    window.close()
    desk.store.close()
    download_fits(home / "models-page", hardware, out / "download-fits.png")
    log.info("wrote %s", ", ".join(sorted(p.name for p in out.glob("*.png"))))
    return 0


def download_fits(home: Path, hardware: Hardware, path: Path) -> None:
    """The models page on the 16 GB card, its download choices each marked with how it fits the card and the disk,
    with the list of choices opened under it (a popup is a window of its own, so it is grabbed on its own)."""
    from PySide6.QtGui import QColor, QPainter, QPixmap

    from clover_desk.app import AppSettings, CloverDeskApp

    desk = CloverDeskApp(home, client=ReplayClient(), settings=AppSettings(), hardware=hardware, with_preview=False,
                         start_engine=False)
    page = desk.model_manager
    page.resize(900, 780)
    page.show()
    settle(200)
    picture = page.grab()
    page.download_choice.showPopup()
    settle(100)
    popup = page.download_choice.view().window().grab()
    page.download_choice.hidePopup()
    out = QPixmap(picture.width(), picture.height() + popup.height() + 40)
    out.fill(QColor("#15161a"))
    painter = QPainter(out)
    painter.drawPixmap(0, 0, picture)
    painter.setPen(QColor("#dddddd"))
    painter.drawText(12, picture.height() + 24, "The list of choices, opened (each item's tooltip has the figures "
                                                "shown under the list for the chosen one):")
    painter.drawPixmap(12, picture.height() + 34, popup)
    painter.end()
    if not out.save(str(path)):
        raise SystemExit(f"could not write {path}")
    log.info("%s", path)
    desk.shutdown()


MATRIX_SIZES = ((1024, 640), (1920, 1080))


def matrix(window, out: Path) -> None:
    """The whole window at the two sizes that must work, in both themes: the chat with its page in the preview,
    and the denoising panel over the same chat (``window-<theme>-<W>x<H>.png``, ``...-denoising.png``)."""
    for theme in ("light", "dark"):
        window.state.set_theme_preference(theme)
        for w, h in MATRIX_SIZES:
            window.resize(w, h)
            window.show_panel(window.preview)
            settle(1500)  # relayout, and QtWebEngine repaints at the new size
            window.chat.scroll.verticalScrollBar().setValue(0)
            settle(200)
            shot(window, out / f"window-{theme}-{w}x{h}.png")
            window.show_panel(window.denoise)
            window.denoise.slider.setValue(window.denoise.slider.maximum() // 2)  # a block mid-way, replayed
            settle(300)
            shot(window, out / f"window-{theme}-{w}x{h}-denoising.png")


def shot(widget, path: Path) -> None:
    if not widget.grab().save(str(path)):
        raise SystemExit(f"could not write {path}")
    log.info("%s", path)


if __name__ == "__main__":
    sys.exit(main())
