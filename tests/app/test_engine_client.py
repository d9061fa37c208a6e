"""EngineClient with qtbot: a real worker process, the real engine on a tiny checkpoint, crashes and restarts.

Failure paths the real engine cannot produce on demand (OOM, a slow load) use tests/fake_engine.py through the
worker's explicit ``--engine-factory`` flag.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtCore import QElapsedTimer, QTimer

from clover_desk.engine.decode.events import (
    BlockCommitted,
    BlockStep,
    EngineError,
    Finished,
    GenerationParams,
    LoadProgress,
    PromptInfo,
    TextDelta,
)
from clover_desk.worker.client import EngineClient

ROOT = Path(__file__).resolve().parents[2]
FAKE = ["--engine-factory", "tests.fake_engine:make"]
LOAD_MS = 60_000  # generous: the CI box may be shared by several test runs
GEN_MS = 90_000
USER = [{"role": "user", "content": "Tell me a long story about a dragon."}]
# Sampling with a fixed seed keeps a random tiny model from stopping at EOS after a block or two.
LONG = GenerationParams(max_new_tokens=512, block_size=4, do_sample=True, temperature=1.0, seed=1)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from clover_desk.engine.weights.tiny import make_tiny  # torch: test process only, never the GUI client under test

    return make_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def client(qapp: Any) -> EngineClient:
    """One client for the real-engine tests (torch imports and model loads are what costs time here); each test
    brings it to the state it needs with _ready_with_model()."""
    c = EngineClient(worker_args=["--log-level", "DEBUG"])
    yield c
    c.shutdown(wait_ms=10_000)  # the blocking form the app uses on quit
    assert c.pid is None or c.state == "stopping"


@pytest.fixture
def fake_client(qtbot: Any) -> EngineClient:
    c = EngineClient(worker_args=FAKE)
    yield c
    _stop(qtbot, c)


def _stop(qtbot: Any, c: EngineClient) -> None:
    if c.state != "stopped":
        with qtbot.waitSignal(c.stopped, timeout=15_000):
            c.shutdown()


def _start(qtbot: Any, c: EngineClient) -> None:
    with qtbot.waitSignal(c.ready, timeout=LOAD_MS):
        c.start()
    assert c.state == "idle" and c.pid is not None


def _load(qtbot: Any, c: EngineClient, model_dir: str | Path) -> dict[str, Any]:
    with qtbot.waitSignal(c.loaded, timeout=LOAD_MS) as blocker:
        c.load(model_dir)
    return blocker.args[0]


def _ready_with_model(qtbot: Any, c: EngineClient, model_dir: Path) -> None:
    if c.state == "stopped":
        _start(qtbot, c)
    if c.model_info is None or c.model_info["model_dir"] != str(model_dir):
        _load(qtbot, c, model_dir)
    assert c.state == "idle"


def _is_end(request_id: str) -> Any:
    return lambda rid, ev: rid == request_id and isinstance(ev, (Finished, EngineError))


class Recorder:
    """Collects (request_id, event) pairs from EngineClient.event."""

    def __init__(self, c: EngineClient) -> None:
        self.items: list[tuple[str, Any]] = []
        c.event.connect(lambda rid, ev: self.items.append((rid, ev)))

    def of(self, request_id: str, kind: type | None = None) -> list[Any]:
        return [ev for rid, ev in self.items if rid == request_id and (kind is None or isinstance(ev, kind))]


# --------------------------------------------------------------------------- the real engine


def test_load_generate_with_the_real_engine_gui_stays_responsive(qtbot: Any, client: EngineClient, tiny_model: Path) -> None:
    states: list[str] = []
    client.stateChanged.connect(states.append)
    progress: list[LoadProgress] = []
    client.loadProgress.connect(progress.append)
    assert client.state == "stopped"
    with qtbot.waitSignal(client.loaded, timeout=LOAD_MS) as loaded:
        client.start()
        client.load(tiny_model)  # queued until the worker is ready
    client.stateChanged.disconnect(states.append)
    client.loadProgress.disconnect(progress.append)
    info = loaded.args[0]
    assert info["config"]["model_type"] == "clover_moe" and info["model_dir"] == str(tiny_model)
    assert progress and all(isinstance(p, LoadProgress) for p in progress) and progress[-1].stage == "done"
    assert states == ["starting", "loading", "idle"]
    assert client.model_info == info

    # A timer on the GUI thread keeps ticking while the worker generates: nothing blocks the event loop.
    ticks: list[int] = []
    clock = QElapsedTimer()
    clock.start()
    timer = QTimer()
    timer.setInterval(20)
    timer.timeout.connect(lambda: ticks.append(clock.elapsed()))
    timer.start()
    rec = Recorder(client)
    params = GenerationParams(max_new_tokens=12, block_size=4, do_sample=True, temperature=1.0, seed=1)
    request_id = client.generate(USER, params)
    assert client.state == "generating" and client.current_request == request_id
    with qtbot.waitSignal(client.event, timeout=GEN_MS, check_params_cb=_is_end(request_id)):
        pass
    timer.stop()

    events = rec.of(request_id)
    assert isinstance(events[0], PromptInfo) and isinstance(events[-1], Finished), events[-1]
    assert rec.of(request_id, BlockStep) and rec.of(request_id, BlockCommitted)
    deltas = rec.of(request_id, TextDelta)
    final = events[-1]
    assert "".join(d.text for d in deltas if d.channel == "answer") == final.text
    assert "".join(d.text for d in deltas if d.channel == "thinking") == final.thinking
    assert client.state == "idle" and client.current_request is None
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert len(ticks) >= 3 and max(gaps) < 1500, f"GUI thread stalled: longest gap {max(gaps)} ms"


def _generating(qtbot: Any, client: EngineClient, tiny_model: Path) -> tuple[Recorder, str]:
    """A long answer under way (its first denoising pass seen), recorded: (the recorder, the request id)."""
    _ready_with_model(qtbot, client, tiny_model)
    rec = Recorder(client)
    request_id = client.generate(USER, LONG)
    with qtbot.waitSignal(
        client.event, timeout=GEN_MS, check_params_cb=lambda rid, ev: rid == request_id and isinstance(ev, BlockStep)
    ):
        pass
    return rec, request_id


def test_cancel_stops_within_one_pass(qtbot: Any, client: EngineClient, tiny_model: Path) -> None:
    rec, request_id = _generating(qtbot, client, tiny_model)
    client.cancel(request_id)
    sent_at = len(rec.items)
    with qtbot.waitSignal(client.event, timeout=GEN_MS, check_params_cb=_is_end(request_id)):
        pass
    final = rec.of(request_id)[-1]
    assert isinstance(final, Finished) and final.stop_reason == "cancelled"
    after = [ev for rid, ev in rec.items[sent_at:] if isinstance(ev, BlockStep)]
    assert len(after) <= 1  # at most the pass that was running when the flag was set
    assert final.tokens < 512
    # The worker is free again: a second request runs to its end.
    second = client.generate(USER, GenerationParams(max_new_tokens=4, block_size=4))
    with qtbot.waitSignal(client.event, timeout=GEN_MS, check_params_cb=_is_end(second)):
        pass
    assert isinstance(rec.of(second)[-1], Finished)


def test_plan_answers_only_the_latest_request(qtbot: Any, client: EngineClient, tiny_model: Path) -> None:
    _ready_with_model(qtbot, client, tiny_model)
    plans: list[dict[str, Any]] = []
    client.planReady.connect(plans.append)
    client.request_plan(tiny_model, vram_budget_bytes=1 << 20, ram_gb=8, ctx=1024)  # superseded before it is answered
    with qtbot.waitSignal(client.planReady, timeout=LOAD_MS) as blocker:
        client.request_plan(tiny_model, vram_budget_bytes=2 << 30, ram_gb=8, ctx=1024)
    plan = blocker.args[0]
    assert plan["fits"] is True and plan["ctx_tokens"] == 1024
    errors: list[tuple[str, str]] = []
    client.errorMessage.connect(lambda k, m: errors.append((k, m)))
    with qtbot.waitSignal(client.errorMessage, timeout=LOAD_MS):
        client.request_plan(tiny_model.parent / "missing", vram_budget_bytes=2 << 30, ram_gb=8)
    assert len(plans) == 1 and errors and errors[0][0] != "PlanOK"


def test_load_error_from_the_real_engine_keeps_the_worker(
    qtbot: Any, client: EngineClient, tiny_model: Path, tmp_path: Path
) -> None:
    _ready_with_model(qtbot, client, tiny_model)
    shown: list[tuple[str, str]] = []
    client.errorMessage.connect(lambda k, m: shown.append((k, m)))
    with qtbot.waitSignal(client.loadFailed, timeout=LOAD_MS) as failed:
        client.load(tmp_path / "no-such-model")
    kind, message = failed.args
    assert kind == "ConfigError" and "no-such-model" in message
    assert shown == [(kind, message)] and client.state == "idle"
    # The same worker still serves: a real load works after the failed one.
    _load(qtbot, client, tiny_model)


def test_kill_9_mid_generation_emits_crashed_and_restart_works(qtbot: Any, client: EngineClient, tiny_model: Path) -> None:
    rec, request_id = _generating(qtbot, client, tiny_model)
    assert client.pid is not None
    with qtbot.waitSignal(client.crashed, timeout=15_000) as crashed:
        os.kill(client.pid, signal.SIGKILL)
    reason = crashed.args[0]
    assert "SIGKILL" in reason and "Last log lines" in reason
    final = rec.of(request_id)[-1]
    assert isinstance(final, EngineError) and final.kind == "WorkerCrashed"
    assert client.state == "stopped" and client.model_info is None

    with qtbot.waitSignal(client.ready, timeout=LOAD_MS):
        client.restart()
    _load(qtbot, client, tiny_model)
    again = client.generate(USER, GenerationParams(max_new_tokens=4, block_size=4))
    with qtbot.waitSignal(client.event, timeout=GEN_MS, check_params_cb=_is_end(again)):
        pass
    assert isinstance(rec.of(again)[-1], Finished)


# --------------------------------------------------------------------------- scripted failures (fake engine)


def test_out_of_memory_is_reported_as_a_crash_with_its_reason(qtbot: Any, fake_client: EngineClient) -> None:
    c = fake_client
    _start(qtbot, c)
    _load(qtbot, c, "/models/fake")
    rec = Recorder(c)
    with qtbot.waitSignal(c.crashed, timeout=GEN_MS) as crashed:
        request_id = c.generate([{"role": "user", "content": "oom"}])
    assert "exited with code 3" in crashed.args[0] and "OutOfMemory: CUDA out of memory" in crashed.args[0]
    final = rec.of(request_id)[-1]
    assert isinstance(final, EngineError) and final.kind == "OutOfMemory"
    assert len(rec.of(request_id, EngineError)) == 1  # one end per request, not one per channel
    with qtbot.waitSignal(c.ready, timeout=LOAD_MS):
        c.restart()
    _load(qtbot, c, "/models/fake")
    ok = c.generate([{"role": "user", "content": "hi"}])
    with qtbot.waitSignal(c.event, timeout=GEN_MS, check_params_cb=_is_end(ok)):
        pass
    assert isinstance(rec.of(ok)[-1], Finished)


def test_out_of_memory_while_loading_fails_the_load_and_crashes(qtbot: Any, fake_client: EngineClient) -> None:
    _start(qtbot, fake_client)
    failed: list[tuple[str, str]] = []
    fake_client.loadFailed.connect(lambda k, m: failed.append((k, m)))
    with qtbot.waitSignal(fake_client.crashed, timeout=LOAD_MS):
        fake_client.load("/models/oom")
    assert [k for k, _ in failed] == ["OutOfMemory"] and "out of memory" in failed[0][1]
    assert fake_client.state == "stopped"


def test_refusals_are_answered_as_events(qtbot: Any, fake_client: EngineClient) -> None:
    c = fake_client
    rec = Recorder(c)
    stopped_id = c.generate([{"role": "user", "content": "hi"}])  # not started
    with qtbot.waitSignal(c.event, timeout=5000, check_params_cb=_is_end(stopped_id)):
        pass
    assert rec.of(stopped_id)[-1].kind == "WorkerStopped"
    _start(qtbot, c)
    not_loaded = c.generate([{"role": "user", "content": "hi"}])
    with qtbot.waitSignal(c.event, timeout=5000, check_params_cb=_is_end(not_loaded)):
        pass
    assert rec.of(not_loaded)[-1].kind == "NotLoaded"

    _load(qtbot, c, "/models/fake")
    endless = c.generate([{"role": "user", "content": "endless"}])
    busy = c.generate([{"role": "user", "content": "hi"}])
    with qtbot.waitSignal(c.event, timeout=5000, check_params_cb=_is_end(busy)):
        pass
    assert rec.of(busy)[-1].kind == "Busy" and c.current_request == endless
    with qtbot.waitSignal(c.event, timeout=GEN_MS, check_params_cb=_is_end(endless)):
        c.cancel()  # no id: the current request
    assert rec.of(endless)[-1].stop_reason == "cancelled"

    bug = c.generate([{"role": "user", "content": "bug"}])
    with qtbot.waitSignal(c.event, timeout=GEN_MS, check_params_cb=_is_end(bug)):
        pass
    assert rec.of(bug)[-1].kind == "ValueError" and c.state == "idle"


def test_cancel_load_then_shutdown(qtbot: Any, fake_client: EngineClient) -> None:
    c = fake_client
    _start(qtbot, c)
    with qtbot.waitSignal(c.loadProgress, timeout=LOAD_MS):
        c.load("/models/slow")
    assert c.state == "loading"
    with qtbot.waitSignal(c.loadFailed, timeout=LOAD_MS) as failed:
        c.cancel_load()
    assert failed.args[0] == "CancelledError" and c.state == "idle"
    with qtbot.waitSignal(c.stopped, timeout=15_000):
        c.shutdown()
    assert c.state == "stopped" and c.pid is None
    rec = Recorder(c)
    after = c.generate([{"role": "user", "content": "hi"}])
    with qtbot.waitSignal(c.event, timeout=5000, check_params_cb=_is_end(after)):
        pass
    assert rec.of(after)[-1].kind == "WorkerStopped"


def test_compile_travels_with_the_load_to_the_engine(qtbot: Any, fake_client: EngineClient) -> None:
    c = fake_client
    _start(qtbot, c)
    assert _load(qtbot, c, "/models/fake")["compiled"] is False  # not asked: the engine factory is not told
    with qtbot.waitSignal(c.loaded, timeout=LOAD_MS) as blocker:
        c.load("/models/fake", compile=True)
    assert blocker.args[0]["compiled"] is True  # the engine's answer (the fake engine compiles what it is asked)


def test_a_worker_that_cannot_start_is_reported(qtbot: Any) -> None:
    c = EngineClient(python=str(Path("/nonexistent/python3")))
    with qtbot.waitSignal(c.crashed, timeout=15_000) as crashed:
        c.start()
    assert "could not start" in crashed.args[0] and c.state == "stopped"


def test_the_gui_side_never_imports_torch() -> None:
    code = (
        "import json, sys\n"
        "import clover_desk.worker.client, clover_desk.storage.store, clover_desk.storage.recorder, clover_desk.paths\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "PySide6.QtCore" in loaded
    assert not any(m == "torch" or m.startswith("torch.") for m in loaded)


def test_a_second_load_while_loading_is_refused_without_ending_the_first(qtbot: Any, fake_client: EngineClient) -> None:
    c = fake_client
    _start(qtbot, c)
    with qtbot.waitSignal(c.loadProgress, timeout=LOAD_MS):
        c.load("/models/slow")
    failed: list[tuple[str, str]] = []
    c.loadFailed.connect(lambda k, m: failed.append((k, m)))
    with qtbot.waitSignal(c.loadFailed, timeout=5000):
        c.load("/models/fake")
    assert failed[0][0] == "Busy" and c.state == "loading"
    with qtbot.waitSignal(c.crashed, timeout=15_000):
        os.kill(c.pid, signal.SIGKILL)
    # The first load is still the one the crash ends.
    assert [k for k, _ in failed] == ["Busy", "WorkerCrashed"]


def test_shutdown_mid_generation_ends_the_request_exactly_once(qtbot: Any, fake_client: EngineClient) -> None:
    c = fake_client
    _start(qtbot, c)
    _load(qtbot, c, "/models/fake")
    rec = Recorder(c)
    request_id = c.generate([{"role": "user", "content": "endless"}])
    with qtbot.waitSignal(c.event, timeout=GEN_MS, check_params_cb=lambda rid, ev: isinstance(ev, BlockStep)):
        pass
    with qtbot.waitSignal(c.stopped, timeout=15_000):
        c.shutdown()  # the worker still answers "finished (cancelled)" on its way out: dropped
    ends = [ev for ev in rec.of(request_id) if isinstance(ev, (Finished, EngineError))]
    assert len(ends) == 1 and isinstance(ends[0], EngineError) and ends[0].kind == "WorkerStopped"


def test_gpu_paths_reach_the_worker_from_its_next_start(
    qtbot: Any, fake_client: EngineClient, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The window's choice of experimental GPU paths is the worker's environment: every switch 1 or 0 (so the
    app's own environment cannot add one), read when the worker starts; the worker says which it runs with."""
    from clover_desk.engine.settings import opt_in_env

    c = fake_client
    monkeypatch.setenv("CLOVER_DESK_FLA_GDN", "1")  # set where the app was started: the choice overrides it
    assert c.set_env(opt_in_env(["CLOVER_DESK_FUSED_MOE"])) is False  # no worker yet: nothing to restart
    _start(qtbot, c)
    assert _load(qtbot, c, "/models/fake")["gpu_paths"] == ["CLOVER_DESK_FUSED_MOE"]
    assert c.set_env(opt_in_env(["CLOVER_DESK_DEVICE_POOL", "CLOVER_DESK_FUSED_MOE"])) is True  # must restart
    assert _load(qtbot, c, "/models/fake")["gpu_paths"] == ["CLOVER_DESK_FUSED_MOE"]  # the running one's
    with qtbot.waitSignal(c.ready, timeout=LOAD_MS):
        c.restart()
    assert _load(qtbot, c, "/models/fake")["gpu_paths"] == ["CLOVER_DESK_FUSED_MOE", "CLOVER_DESK_DEVICE_POOL"]
    assert c.set_env(opt_in_env(["CLOVER_DESK_FUSED_MOE", "CLOVER_DESK_DEVICE_POOL"])) is False  # the same again
    with pytest.raises(ValueError, match="CLOVER_DESK_ZERO_COPY and CLOVER_DESK_DEVICE_POOL exclude each other"):
        opt_in_env(["CLOVER_DESK_ZERO_COPY", "CLOVER_DESK_DEVICE_POOL"])
    with pytest.raises(ValueError, match="unknown GPU path 'CLOVER_DESK_TURBO'"):
        opt_in_env(["CLOVER_DESK_TURBO"])
