"""The worker process protocol, through a real subprocess and real pipes.

Failure paths use the scripted engine in tests/fake_engine.py (selected by the explicit ``--engine-factory`` flag);
the happy path also runs the real engine on a tiny checkpoint (see test_engine_client.py for the Qt side).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from worker_proc import FAKE, WorkerProc

from clover_desk.engine.decode.events import from_dict
from clover_desk.worker.reports import FATAL_EXIT_CODE, classify_fatal


@pytest.fixture
def fake_worker() -> WorkerProc:
    w = WorkerProc(*FAKE)
    w.expect_event("ready")
    yield w
    w.close()


def test_protocol_errors_keep_the_worker_alive(fake_worker: WorkerProc) -> None:
    w = fake_worker
    w.send(cmd="generate", id="r0", messages=[{"role": "user", "content": "hi"}])
    assert w.expect_event("error", id="r0")["kind"] == "NotLoaded"
    w.send(cmd="dance")
    assert w.expect_event("error")["kind"] == "ProtocolError"
    assert w.proc.stdin is not None
    w.proc.stdin.write(b"{not json\n\n")
    w.proc.stdin.flush()
    bad = w.expect_event("error")
    assert bad["kind"] == "ProtocolError" and bad["fatal"] is False
    w.send(cmd="load")
    assert w.expect_event("error", op="load")["kind"] == "ProtocolError"
    w.send(cmd="shutdown")
    w.expect_event("bye")
    assert w.proc.wait(10) == 0


def test_load_generate_and_back_to_back_requests(fake_worker: WorkerProc) -> None:
    w = fake_worker
    w.send(cmd="load", model_dir="/models/fake", device="cpu", dtype="float32")
    loaded = w.expect_event("loaded")
    progress = [r for r in w.seen if r["event"] == "load_progress"]
    assert progress and progress[-1]["stage"] == "done"
    assert loaded["config"]["model_type"] == "fake" and loaded["model_dir"] == "/models/fake"

    w.send(cmd="generate", id="a", messages=[{"role": "user", "content": "hi"}], params={"max_new_tokens": 8})
    finished = w.expect_event("finished", id="a")
    mine = [r for r in w.seen if r.get("id") == "a"]
    kinds = [r["event"] for r in mine]
    assert kinds[0] == "prompt" and kinds[-1] == "finished"
    assert kinds.count("block_step") == 8 and kinds.count("block_committed") == 2 and kinds.count("delta") == 2
    assert finished["text"] == "b0 b1 "
    assert all(from_dict(r) is not None for r in mine)  # every record decodes as an engine event
    # The next request may go out the moment "finished" is read: never "Busy".
    w.send(cmd="generate", id="b", messages=[{"role": "user", "content": "again"}])
    w.expect(lambda r: r.get("id") == "b" and r["event"] in ("finished", "error"))
    assert w.seen[-1]["event"] == "finished"
    w.send(cmd="generate", id="c", messages=[{"role": "user", "content": "x"}], params={"no_such_param": 1})
    assert w.expect_event("error", id="c")["kind"] == "ProtocolError"


def test_cancel_takes_effect_within_one_pass(fake_worker: WorkerProc) -> None:
    w = fake_worker
    w.load()
    w.send(cmd="generate", id="e", messages=[{"role": "user", "content": "endless"}])
    for _ in range(6):
        w.expect_event("block_step", id="e")
    w.send(cmd="generate", id="f", messages=[{"role": "user", "content": "hi"}])
    assert w.expect_event("error", id="f")["kind"] == "Busy"
    w.send(cmd="cancel", id="other")  # a stale id is ignored
    w.send(cmd="cancel", id="e")
    marker = len(w.seen)
    finished = w.expect_event("finished", id="e")
    assert finished["stop_reason"] == "cancelled"
    late_steps = [r for r in w.seen[marker:] if r["event"] == "block_step"]
    # Passes already queued when the cancel was sent, plus at most the one in flight: bounded, not "the rest".
    assert len(late_steps) <= 8


def test_cancel_load_then_load_again(fake_worker: WorkerProc) -> None:
    w = fake_worker
    w.send(cmd="load", model_dir="/models/slow")
    w.expect_event("load_progress")
    w.send(cmd="load", model_dir="/models/fake")
    assert w.expect_event("error", op="load")["kind"] == "Busy"
    w.send(cmd="cancel_load")
    err = w.expect_event("error", op="load", kind="CancelledError")
    assert err["fatal"] is False
    w.send(cmd="load", model_dir="/models/fake")
    assert w.expect_event("loaded")["model_dir"] == "/models/fake"


def test_clover_errors_and_bugs_are_reported_and_survived(fake_worker: WorkerProc) -> None:
    w = fake_worker
    w.send(cmd="load", model_dir="/models/fail")
    err = w.expect_event("error", op="load")
    assert err["kind"] == "CheckpointError" and "lm_head.weight" in err["message"] and not err["fatal"]
    w.load()
    w.send(cmd="generate", id="p", messages=[{"role": "user", "content": "prompt-error"}])
    assert w.expect_event("error", id="p")["kind"] == "PromptError"
    w.send(cmd="generate", id="q", messages=[{"role": "user", "content": "bug"}])
    bug = w.expect_event("error", id="q")
    assert bug["kind"] == "ValueError" and bug["fatal"] is False
    w.send(cmd="generate", id="r", messages=[{"role": "user", "content": "fine"}])
    assert w.expect_event("finished", id="r")["stop_reason"] == "max_new_tokens"


def test_out_of_memory_while_generating_is_fatal(fake_worker: WorkerProc) -> None:
    w = fake_worker
    w.load()
    w.send(cmd="generate", id="o", messages=[{"role": "user", "content": "oom"}])
    err = w.expect_event("error", id="o")
    assert err["kind"] == "OutOfMemory" and err["fatal"] is True and "out of memory" in err["message"]
    assert w.proc.wait(10) == FATAL_EXIT_CODE


def test_out_of_memory_while_loading_is_fatal(fake_worker: WorkerProc) -> None:
    w = fake_worker
    w.send(cmd="load", model_dir="/models/oom")
    err = w.expect_event("error", op="load")
    assert (err["kind"], err["fatal"]) == ("OutOfMemory", True)
    assert w.proc.wait(10) == FATAL_EXIT_CODE


def test_stdin_closed_mid_generation_ends_the_worker(fake_worker: WorkerProc) -> None:
    """The GUI died: the worker must not linger as an orphan holding the GPU."""
    w = fake_worker
    w.load()
    w.send(cmd="generate", id="e", messages=[{"role": "user", "content": "endless"}])
    w.expect_event("block_step", id="e")
    assert w.proc.stdin is not None
    w.proc.stdin.close()
    assert w.proc.wait(15) == 0


def test_bad_engine_factory_fails_at_startup() -> None:
    w = WorkerProc("--engine-factory", "tests.no_such_module:make")
    try:
        err = w.expect_event("error")
        assert (err["kind"], err["fatal"]) == ("StartupError", True)
        assert w.proc.wait(10) == FATAL_EXIT_CODE
    finally:
        w.close()


class OutOfMemoryError(RuntimeError):
    pass


class AcceleratorError(RuntimeError):
    pass


def test_classify_fatal() -> None:
    assert classify_fatal(OutOfMemoryError("CUDA out of memory")) == "OutOfMemory"
    assert classify_fatal(MemoryError()) == "OutOfMemory"
    assert classify_fatal(AcceleratorError("device-side assert triggered")) == "CudaError"
    assert classify_fatal(RuntimeError("CUDA error: an illegal memory access was encountered")) == "CudaError"
    assert classify_fatal(RuntimeError("shape mismatch")) is None
    assert classify_fatal(ValueError("CUDA error")) is None


def test_real_engine_under_a_budget_plans_for_the_requested_context(tmp_path: Path) -> None:
    """The worker hands the load's context to the real engine: the plan it reports is sized for it."""
    from clover_desk.engine.weights.tiny import make_tiny

    folder = make_tiny(tmp_path / "m", model_type="clover_moe", seed=3)
    w = WorkerProc()
    try:
        w.expect_event("ready")
        w.send(cmd="load", model_dir=str(folder), device="cpu", dtype="float32", precision="nf4", vram_budget_bytes=2 << 30,
               ctx_tokens=4096)
        announced = w.expect_event("plan")  # made here with the one planning function, before the weights
        loaded = w.expect_event("loaded")
        assert loaded["plan"]["ctx_tokens"] == 4096 and loaded["plan"]["fits"] is True
        assert announced["op"] == "load" and announced["plan"] == loaded["plan"]
        # the plan the window saw travels with the load and is placed as is (here one that streams every layer)
        from clover_desk.engine.placement.planner import plan_model

        floor = plan_model(folder, 0, 512).min_vram_bytes
        shown = plan_model(folder, floor, 512).to_dict()
        assert shown["fits"] and len(shown["streamed_expert_layers"]) == 4
        w.send(cmd="load", model_dir=str(folder), device="cpu", dtype="bfloat16", precision="nf4", plan=shown)
        assert w.expect_event("plan")["plan"] == shown
        assert w.expect_event("loaded")["plan"] == shown
        w.send(cmd="generate", id="g", messages=[{"role": "user", "content": "hi"}], params={"max_new_tokens": 4})
        done = w.expect(lambda r: r.get("id") == "g" and r["event"] in ("finished", "error"))
        assert done["event"] == "finished" and "h2d_bytes" in done["accounting"]
        # a plan without a precision is refused in one line: it never switches the load to the quantized cache
        w.send(cmd="load", model_dir=str(folder), device="cpu", dtype="bfloat16", plan=shown)
        refused = w.expect(lambda r: r.get("event") == "error" and r.get("op") == "load")
        assert refused["kind"] == "PlanError" and "precision 'nf4'" in refused["message"], refused
    finally:
        w.close()


def test_a_chat_read_right_after_a_generation_waits_for_it_to_let_go(fake_worker: WorkerProc) -> None:
    """The window reads a chat ahead as soon as a generation's finished record arrives; the generate thread may hold
    the engine a moment longer. The read waits for it and reads; it is not answered "busy"."""
    w = fake_worker
    w.load()
    w.send(cmd="generate", id="g", messages=[{"role": "user", "content": "linger"}])
    assert w.expect_event("finished", id="g")["stop_reason"] == "max_new_tokens"
    w.send(cmd="read_chat", id="r", messages=[{"role": "user", "content": "hi"}])
    assert w.expect_event("chat_read", id="r")["stop_reason"] == "prefilled"


def test_reading_a_chat_ahead_yields_to_whatever_needs_the_engine(fake_worker: WorkerProc) -> None:
    """read_chat (the window reading a chat while the engine is idle) holds the engine, but a generate, a load or
    another read_chat stops it within a segment; it is answered by one chat_read record, never an error."""
    w = fake_worker
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    w.send(cmd="read_chat", id="w0", messages=chat)
    assert w.expect_event("chat_read", id="w0")["stop_reason"] == "busy"  # no model yet
    w.load()
    w.send(cmd="read_chat", id="w1", messages=chat)
    assert w.expect_event("chat_read", id="w1")["stop_reason"] == "prefilled"
    endless = [*chat, {"role": "user", "content": "endless"}]
    w.send(cmd="read_chat", id="w2", messages=endless)
    w.send(cmd="generate", id="g", messages=[{"role": "user", "content": "hi"}])  # preempts w2
    assert w.expect_event("chat_read", id="w2")["stop_reason"] == "cancelled"
    assert w.expect_event("finished", id="g")["stop_reason"] == "max_new_tokens"
    w.send(cmd="read_chat", id="w3", messages=endless)
    w.send(cmd="read_chat", id="w4", messages=chat)  # another chat: w3 stops, w4 reads
    assert w.expect_event("chat_read", id="w3")["stop_reason"] == "cancelled"
    assert w.expect_event("chat_read", id="w4")["stop_reason"] == "prefilled"
    w.send(cmd="read_chat", id="w5", messages=[{"role": "user", "content": "prompt-error"}])
    refused = w.expect_event("chat_read", id="w5")
    assert refused["stop_reason"] == "refused" and "context holds" in refused["message"]
    w.send(cmd="read_chat", id="w6", messages=[{"role": "user", "content": "bug"}])
    assert w.expect_event("chat_read", id="w6")["message"] == "internal error: scripted bug"
    w.send(cmd="read_chat", id="w7", messages=[], extra=1)
    assert 'unknown field "extra"' in w.expect_event("chat_read", id="w7")["message"]
    w.send(cmd="read_chat", id="w8", messages=endless)
    w.send(cmd="load", model_dir="/models/fake")  # a load drops the model: the read ends first
    assert w.expect_event("chat_read", id="w8")["stop_reason"] == "cancelled"
    w.expect(lambda r: r["event"] == "loaded" and len([x for x in w.seen if x["event"] == "loaded"]) == 2)
    assert not [r for r in w.seen if r["event"] == "error"]
