"""Small in-test fakes for the GUI tests (no mocks): a planner with Clover-35B-like numbers."""

from __future__ import annotations

from clover_desk.engine.placement.planner import Plan

GIB = 1024**3


def fake_plan(vram_budget_bytes: int, ctx_tokens: int, layers: int = 40) -> Plan:
    """A real ``Plan`` with made-up numbers (the budget and context left unset, as a hand-made plan has them)."""
    non_expert = int(2.6 * GIB)
    per_layer = int(0.42 * GIB)
    slots = int(0.9 * GIB)
    kv = ctx_tokens * 20 * 1024
    state = int(0.05 * GIB)
    workspace = int(0.3 * GIB)
    reserve = int(0.6 * GIB)
    fixed = non_expert + kv + state + workspace + reserve
    minimum = fixed + slots
    room = vram_budget_bytes - fixed
    resident = max(0, min(layers, room // per_layer))
    streamed = layers - resident
    use_slots = slots if streamed else 0
    if streamed and resident * per_layer + use_slots > room:
        resident = max(0, (room - use_slots) // per_layer)
        streamed = layers - resident
    fits = vram_budget_bytes >= minimum
    breakdown = {
        "non_expert": non_expert,
        "resident_experts": resident * per_layer,
        "expert_slots": use_slots,
        "kv_cache": kv,
        "gdn_state": state,
        "workspace": workspace,
        "reserve": reserve,
    }
    return Plan(
        resident_expert_layers=list(range(resident)),
        streamed_expert_layers=list(range(resident, layers)),
        slot_pool_experts=64 if streamed else 0,
        vram_used_bytes=sum(breakdown.values()),
        vram_breakdown=breakdown,
        ram_bytes=streamed * per_layer + int(1.5 * GIB),
        fits=fits,
        reason="" if fits else f"needs at least {minimum / GIB:.1f} GiB: non-expert weights, KV cache at {ctx_tokens} tokens and the expert slot pool",
        min_vram_bytes=minimum,
        predicted_tok_s={"diffusion": 12 + 1.6 * resident, "ar": 6 + 0.5 * resident},
        assumptions={},
    )


# ---------------------------------------------------------------------------------------------- engine client

from PySide6.QtCore import QObject, QTimer, Signal  # noqa: E402

from clover_desk.engine.decode.events import (  # noqa: E402
    BlockCommitted,
    BlockStep,
    Finished,
    GenerationParams,
    LoadProgress,
    PromptInfo,
    TextDelta,
)
from clover_desk.engine.settings import GpuPaths  # noqa: E402

WORDS = (
    "Block diffusion fills thirty-two masked slots at once and commits every slot the model is sure of "
    "in each pass so a block usually needs far fewer passes than tokens"
).split()


class FakeEngineClient(QObject):
    """Speaks the EngineClient signal contract with scripted block-diffusion events, one pass per timer tick.

    With ``paused`` set, nothing is emitted by itself: the test hands out events with :meth:`emit_until` (in the
    order of the script, synchronously) and lets the rest run on the timer with :meth:`resume`.
    """

    ready = Signal()
    loadProgress = Signal(object)
    loaded = Signal(object)
    event = Signal(str, object)
    errorMessage = Signal(str, str)
    crashed = Signal(str)
    planReady = Signal(dict)

    def __init__(self, blocks: int = 3, pass_ms: int = 5, answer: str | None = None, thinking: str = "",
                 loaded: bool = True) -> None:
        """``loaded``: the client already has a model (as a real client after its ``loaded`` answer), so a window
        built on it accepts messages at once; False: it starts with none (the window waits for ``loaded``)."""
        super().__init__()
        self.model_info: dict | None = {"model_dir": "/models/tiny", "device": "cpu"} if loaded else None
        self.blocks = blocks
        self.pass_ms = pass_ms
        self.answer = answer
        self.thinking = thinking
        self.paused = False  # generate() waits for emit_until() / resume()
        self.requests: list[tuple[list[dict[str, str]], GenerationParams]] = []
        self.reads: list[tuple[list[dict[str, str]], GenerationParams]] = []  # read_chat calls
        self.cancelled: list[str] = []
        self.restarts = 0
        self.load_cancelled = 0
        self.state = "stopped"
        self.loads: list[tuple[str, str, str, float | None]] = []
        self.ctx_loads: list[int | None] = []  # the planned context sent with each load
        self.plans: list[dict | None] = []  # the plan sent with each load (None: no plan)
        self.precisions: list[str | None] = []  # the precision sent with each load (None: the dtype's)
        self.compiles: list[bool] = []  # whether each load asked for compiled layers
        self.env: dict[str, str] = {}  # set_env: the next worker's extra environment
        self.started_env: dict[str, str] = {}  # the running worker's (set at start / restart, as the real client)
        self.pid = None
        self._timer = QTimer(self)
        self._timer.timeout.connect(self._tick)
        self._script: list[object] = []
        self._rid = ""
        self._n = 0

    def generate(self, messages, params, tools=None) -> str:  # noqa: ANN001
        self._n += 1
        self._rid = f"r{self._n}"
        self.requests.append((list(messages), params))
        self._script = self._make_script(params)
        if not self.paused:
            self._timer.start(self.pass_ms)
        return self._rid

    def read_chat(self, messages, params) -> str:  # noqa: ANN001
        """Recorded only (the real client has the idle engine read the chat into its prompt cache)."""
        self.reads.append((list(messages), params))
        return f"read-{len(self.reads)}"

    def emit_until(self, kind: type, count: int = 1) -> list[object]:
        """Emit the scripted events now, up to and including the ``count``-th next one of type ``kind``."""
        emitted: list[object] = []
        while self._script and count > 0:
            event = self._script.pop(0)
            emitted.append(event)
            self.event.emit(self._rid, event)
            if isinstance(event, kind):
                count -= 1
        return emitted

    def resume(self) -> None:
        """Let the rest of the script run on the timer."""
        self.paused = False
        if self._script:
            self._timer.start(self.pass_ms)

    def cancel(self, request_id: str | None = None) -> None:
        self.cancelled.append(request_id or self._rid)
        self._script = [e for e in self._script if isinstance(e, Finished)]
        if self._script:
            f = self._script[-1]
            self._script = [Finished(**{**f.__dict__, "stop_reason": "cancelled"})]

    def set_env(self, env: dict[str, str]) -> bool:
        self.env.update(env)
        return self.state != "stopped" and self.env != self.started_env

    def start(self) -> None:
        self.state = "idle"
        self.started_env = dict(self.env)
        QTimer.singleShot(1, self.ready.emit)

    def shutdown(self, wait_ms: int = 0) -> None:
        self.state = "stopped"

    def load(self, model_dir, device: str = "cpu", dtype: str = "float32", vram_budget_bytes: int | None = None,  # noqa: ANN001
             ctx_tokens: int | None = None, plan: dict | None = None, compile: bool = False,
             precision: str | None = None) -> None:
        self.loads.append((str(model_dir), device, dtype, vram_budget_bytes))
        self.precisions.append(precision)
        self.compiles.append(compile)
        self.ctx_loads.append(ctx_tokens if plan is None else plan.get("ctx_tokens"))
        self.plans.append(plan)
        info = {"model_dir": str(model_dir), "device": device, "plan": plan,
                "ctx_tokens": (plan or {}).get("ctx_tokens") or ctx_tokens,  # as the worker reports it
                "gpu_paths": GpuPaths.from_env(self.started_env).opt_in()}  # as the worker reports its own
        self.model_info = None

        def done() -> None:
            self.model_info = info
            self.loaded.emit(info)

        QTimer.singleShot(1, done)

    def cancel_load(self) -> None:
        self.load_cancelled += 1

    def restart(self) -> None:
        self.restarts += 1
        self.started_env = dict(self.env)
        self.model_info = None
        QTimer.singleShot(1, self.ready.emit)

    def _tick(self) -> None:
        if not self._script:
            self._timer.stop()
            return
        self.event.emit(self._rid, self._script.pop(0))
        if not self._script:
            self._timer.stop()

    def _make_script(self, params: GenerationParams) -> list[object]:
        import random

        rng = random.Random(len(self.requests))
        answer_words = (self.answer or " ".join(WORDS)).split(" ")
        if params.mode == "ar":  # as engine.decode.generate's AR loop: blocks of one token, a delta per token
            ar: list[object] = [PromptInfo(prompt_tokens=12, block_size=1, first_block=12, tail=0)]
            if self.thinking and params.enable_thinking:
                ar.append(TextDelta(self.thinking, "thinking"))
            ar += [TextDelta((" " if i else "") + w, "answer") for i, w in enumerate(answer_words)]
            n = len(answer_words) + (1 if self.thinking and params.enable_thinking else 0)
            ar.append(Finished(tuple(range(n)), " ".join(answer_words), self.thinking, "eos", n, n, 1.0, 23.5, 0.1,
                               12, 0.05, n / 23.5))
            return ar
        out: list[object] = [PromptInfo(prompt_tokens=12, block_size=32, first_block=0, tail=0)]
        passes_total = 0
        if self.thinking and params.enable_thinking:
            out.append(TextDelta(self.thinking, "thinking"))
        per_block = max(1, -(-len(answer_words) // self.blocks))
        for b in range(self.blocks):
            chunk = answer_words[b * per_block : (b + 1) * per_block]
            masked = [True] * 32
            conf = [0.0] * 32
            texts = [""] * 32
            p = 0
            while any(masked):
                now = [False] * 32
                todo = [i for i in range(32) if masked[i]]
                for i in rng.sample(todo, min(len(todo), rng.randint(3, 9))):
                    masked[i], now[i], conf[i] = False, True, rng.uniform(0.55, 1.0)
                    texts[i] = " " + WORDS[i % len(WORDS)]
                out.append(BlockStep(b, p, tuple(range(32)), tuple(texts), tuple(masked), tuple(conf), tuple(now)))
                p += 1
            passes_total += p
            text = (" " if b else "") + " ".join(chunk)
            out.append(TextDelta(text, "answer"))
            out.append(BlockCommitted(b, p, tuple(range(32))))
        full = " ".join(answer_words)
        out.append(
            Finished(
                token_ids=tuple(range(32 * self.blocks)), text=full, thinking=self.thinking, stop_reason="eos",
                tokens=32 * self.blocks, passes=passes_total, tokens_per_pass=32 * self.blocks / passes_total,
                tokens_per_s=41.5, time_to_first_token_s=0.12, prompt_tokens=12, prefill_s=0.05, decode_s=1.2,
                accounting={"hits": 930, "misses": 70},
            )
        )
        return out

    def emit_load(self, done: int, total: int) -> None:
        self.loadProgress.emit(LoadProgress("reading", done, total, "model-00001.safetensors", 12.0))
