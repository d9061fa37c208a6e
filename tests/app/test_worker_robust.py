"""The worker answers every line, however malformed, and stays usable: through the real worker process and pipes.

Each malformed line must get exactly one ``ProtocolError`` record whose message names the offending field (or says
what is wrong with the line), and then a real generate request on the same process must still run to its end.
The engine behind the worker is the scripted one of tests/fake_engine.py (vocabulary of 16 ids), selected with the
explicit ``--engine-factory`` flag; the checks under test run before any engine code.
"""

from __future__ import annotations

import dataclasses
import io
import json
import queue
from collections.abc import Iterator
from typing import Any

import pytest
from worker_proc import FAKE, TIMEOUT, WorkerProc

from clover_desk.engine.decode.events import GenerationParams
from clover_desk.worker.protocol import MAX_LINE_BYTES, MAX_NESTING, PARAM_FIELDS, read_lines

USER = [{"role": "user", "content": "hi"}]


def _line(command: dict[str, Any]) -> bytes:
    return json.dumps(command).encode()


def _gen(**fields: Any) -> bytes:
    return _line({"cmd": "generate", "id": "bad", "messages": USER, **fields})


def _params(**params: Any) -> bytes:
    return _gen(params=params)


def _load(**fields: Any) -> bytes:
    return _line({"cmd": "load", "model_dir": "/models/fake", **fields})


def _serve(**fields: Any) -> bytes:
    return _line({"cmd": "serve", "host": "127.0.0.1", "port": 0, **fields})


def _nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


# (line, text the error message must contain). Types of every field, ranges, nesting, encodings.
MALFORMED: list[tuple[str, bytes, str]] = [
    # not JSON / not an object
    ("not-json", b"{not json", "not JSON"),
    ("unterminated-string", b'{"cmd": "load', "not JSON"),
    ("invalid-utf8", b'{"cmd": "\xff\xfe"}', "not JSON"),
    ("huge-integer", b'{"cmd": "load", "model_dir": "/m", "ctx_tokens": ' + b"9" * 5000 + b"}", "not JSON"),
    *((name, line, "JSON object") for name, line in (
        ("array", b"[]"), ("string", b'"load"'), ("number", b"42"), ("null", b"null"), ("nan-literal", b"NaN"))),
    # cmd
    *((f"cmd-{name}", line, "'cmd'") for name, line in (
        ("missing", b"{}"), ("list", b'{"cmd": []}'), ("object", b'{"cmd": {"a": 1}}'), ("number", b'{"cmd": 1}'),
        ("null", b'{"cmd": null}'), ("unknown", b'{"cmd": "dance"}'), ("wrong-case", b'{"cmd": "LOAD"}'))),
    # nesting
    ("200k-open-brackets", b"[" * 200_000, "nested"),
    ("200k-open-objects", b'{"a":' * 200_000, "nested"),
    ("nested-past-limit", _gen(tools=[{"t": _nested(MAX_NESTING)}]), "nested more than"),
    # load
    ("load-no-model_dir", _line({"cmd": "load"}), "'model_dir'"),
    ("load-model_dir-number", _line({"cmd": "load", "model_dir": 5}), "'model_dir'"),
    ("load-model_dir-empty", _line({"cmd": "load", "model_dir": ""}), "'model_dir'"),
    ("load-model_dir-list", _line({"cmd": "load", "model_dir": ["/m"]}), "'model_dir'"),
    ("load-model_dir-null", _line({"cmd": "load", "model_dir": None}), "'model_dir'"),
    ("load-model_dir-nul", _line({"cmd": "load", "model_dir": "/m\x00x"}), "'model_dir'"),
    ("load-device-gpu", _load(device="gpu"), "'device'"),
    ("load-device-number", _load(device=1), "'device'"),
    ("load-device-list", _load(device=["cpu"]), "'device'"),
    ("load-dtype-int8", _load(dtype="int8"), "'dtype'"),
    ("load-dtype-alias", _load(dtype="fp16"), "'dtype'"),
    ("load-dtype-number", _load(dtype=32), "'dtype'"),
    ("load-precision-unknown", _load(precision="int4"), "'precision'"),
    ("load-precision-dtype", _load(precision="bfloat16"), "'precision'"),
    ("load-vram-string", _load(vram_budget_bytes="x"), "'vram_budget_bytes'"),
    ("load-vram-negative", _load(vram_budget_bytes=-1), "'vram_budget_bytes'"),
    ("load-vram-zero", _load(vram_budget_bytes=0), "'vram_budget_bytes'"),
    ("load-vram-bool", _load(vram_budget_bytes=True), "'vram_budget_bytes'"),
    ("load-vram-gib", _load(vram_budget_bytes=2.5), "'vram_budget_bytes'"),  # bytes are whole: not GiB
    ("load-vram-huge", _load(vram_budget_bytes=2**70), "'vram_budget_bytes'"),
    ("load-vram-nan", b'{"cmd": "load", "model_dir": "/m", "vram_budget_bytes": NaN}', "'vram_budget_bytes'"),
    ("load-vram-inf", b'{"cmd": "load", "model_dir": "/m", "vram_budget_bytes": 1e999}', "'vram_budget_bytes'"),
    ("load-vram-old-gib-key", _load(vram_gb=2.0), '"vram_gb"'),  # the GiB field before issue 29: named, refused
    ("load-ctx-string", _load(ctx_tokens="x"), "'ctx_tokens'"),
    ("load-ctx-zero", _load(ctx_tokens=0), "'ctx_tokens'"),
    ("load-ctx-negative", _load(ctx_tokens=-5), "'ctx_tokens'"),
    ("load-ctx-float", _load(ctx_tokens=1.5), "'ctx_tokens'"),
    ("load-ctx-bool", _load(ctx_tokens=True), "'ctx_tokens'"),
    ("load-ctx-huge", _load(ctx_tokens=2**40), "'ctx_tokens'"),
    ("load-ctx-alias-string", _load(ctx="x"), "'ctx'"),
    ("load-plan-string", _load(plan="p"), "'plan'"),
    ("load-plan-list", _load(plan=[]), "'plan'"),
    ("load-unknown-field", _load(vram=2), "unknown field \"vram\""),
    ("load-gguf_layout-unknown", _load(gguf_layout="llama"), "'gguf_layout'"),
    ("load-gguf_layout-number", _load(gguf_layout=1), "'gguf_layout'"),
    ("load-gguf_layout-wrong-case", _load(gguf_layout="Fork"), "'gguf_layout'"),
    ("load-compile-string", _load(compile="yes"), "'compile'"),
    ("load-compile-number", _load(compile=1), "'compile'"),
    # generate: the request
    ("gen-no-id", _line({"cmd": "generate", "messages": USER}), "'id'"),
    ("gen-id-number", _line({"cmd": "generate", "id": 5, "messages": USER}), "'id'"),
    ("gen-id-empty", _line({"cmd": "generate", "id": "", "messages": USER}), "'id'"),
    ("gen-messages-string", _gen(messages="hi"), "'messages'"),
    ("gen-messages-object", _gen(messages={"role": "user"}), "'messages'"),
    ("gen-message-number", _gen(messages=[1]), "messages[0]"),
    ("gen-message-no-role", _gen(messages=[{"content": "x"}]), "messages[0].role"),
    ("gen-message-role-number", _gen(messages=[{"role": 5, "content": "x"}]), "messages[0].role"),
    ("gen-message-content-number", _gen(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    ("gen-prompt-number", _line({"cmd": "generate", "id": "bad", "prompt": 5}), "'prompt'"),
    ("gen-prompt_ids-string", _line({"cmd": "generate", "id": "bad", "prompt_ids": "1 2"}), "'prompt_ids'"),
    ("gen-prompt_ids-float", _line({"cmd": "generate", "id": "bad", "prompt_ids": [1.5]}), "prompt_ids[0]"),
    ("gen-prompt_ids-negative", _line({"cmd": "generate", "id": "bad", "prompt_ids": [3, -1]}), "prompt_ids[1]"),
    ("gen-prompt_ids-bool", _line({"cmd": "generate", "id": "bad", "prompt_ids": [True]}), "prompt_ids[0]"),
    ("gen-prompt_ids-past-vocab", _line({"cmd": "generate", "id": "bad", "prompt_ids": [15, 16]}), "prompt_ids[1]"),
    ("gen-raw-string", _gen(raw="yes"), "'raw'"),
    ("gen-tools-object", _gen(tools={"name": "t"}), "'tools'"),
    ("gen-tools-numbers", _gen(tools=[1]), "'tools'"),
    ("gen-unknown-field", _gen(temperature=0.5), "unknown field \"temperature\""),
    # generate: params (every GenerationParams field, wrong type and out of range)
    ("params-string", _gen(params="fast"), "'params'"),
    ("params-list", _gen(params=[]), "'params'"),
    ("params-unknown", _params(no_such_param=1), "unknown field \"no_such_param\""),
    ("mode-unknown", _params(mode="fast"), "'mode'"),
    ("mode-number", _params(mode=1), "'mode'"),
    ("mode-null", _params(mode=None), "'mode'"),
    ("max_new_tokens-zero", _params(max_new_tokens=0), "'max_new_tokens'"),
    ("max_new_tokens-string", _params(max_new_tokens="8"), "'max_new_tokens'"),
    ("max_new_tokens-float", _params(max_new_tokens=1.5), "'max_new_tokens'"),
    ("max_new_tokens-bool", _params(max_new_tokens=True), "'max_new_tokens'"),
    ("max_new_tokens-huge", _params(max_new_tokens=2**40), "'max_new_tokens'"),
    ("temperature-negative", _params(temperature=-0.1), "'temperature'"),
    ("temperature-string", _params(temperature="hot"), "'temperature'"),
    ("temperature-nan", _gen()[:-1] + b', "params": {"temperature": NaN}}', "'temperature'"),
    ("temperature-inf", _gen()[:-1] + b', "params": {"temperature": 1e999}}', "'temperature'"),
    ("temperature-huge-int", _params(temperature=10**400), "'temperature'"),
    ("temperature-tiny", _params(temperature=1e-300), "'temperature'"),  # logits / 1e-300 overflow to inf
    ("temperature-above-100", _params(temperature=1e6), "'temperature'"),
    ("top_p-zero", _params(top_p=0), "'top_p'"),
    ("top_p-above-one", _params(top_p=1.5), "'top_p'"),
    ("top_p-string", _params(top_p="x"), "'top_p'"),
    ("top_k-negative", _params(top_k=-1), "'top_k'"),
    ("top_k-float", _params(top_k=1.5), "'top_k'"),
    ("top_k-string", _params(top_k="k"), "'top_k'"),
    ("do_sample-string", _params(do_sample="yes"), "'do_sample'"),
    ("do_sample-number", _params(do_sample=1), "'do_sample'"),
    ("presence_penalty-string", _params(presence_penalty="x"), "'presence_penalty'"),
    ("presence_penalty-inf", _gen()[:-1] + b', "params": {"presence_penalty": -1e999}}', "'presence_penalty'"),
    ("repetition_penalty-zero", _params(repetition_penalty=0), "'repetition_penalty'"),
    ("repetition_penalty-negative", _params(repetition_penalty=-1), "'repetition_penalty'"),
    ("repetition_penalty-list", _params(repetition_penalty=[1]), "'repetition_penalty'"),
    ("repetition_penalty-tiny", _params(repetition_penalty=1e-9), "'repetition_penalty'"),
    ("presence_penalty-huge", _params(presence_penalty=1e300), "'presence_penalty'"),
    ("block_size-zero", _params(block_size=0), "'block_size'"),
    ("block_size-float", _params(block_size=2.5), "'block_size'"),
    ("block_size-string", _params(block_size="32"), "'block_size'"),
    ("block_size-past-4096", _params(block_size=4097), "'block_size'"),
    ("threshold-negative", _params(threshold=-0.1), "'threshold'"),
    ("threshold-above-one", _params(threshold=1.1), "'threshold'"),
    ("threshold-string", _params(threshold="x"), "'threshold'"),
    ("enable_thinking-string", _params(enable_thinking="no"), "'enable_thinking'"),
    ("enable_thinking-null", _params(enable_thinking=None), "'enable_thinking'"),
    ("seed-negative", _params(seed=-1), "'seed'"),
    ("seed-too-big", _params(seed=2**63), "'seed'"),
    ("seed-float", _params(seed=1.5), "'seed'"),
    ("seed-string", _params(seed="s"), "'seed'"),
    # cancel / plan
    ("cancel-id-number", _line({"cmd": "cancel", "id": 5}), "'id'"),
    ("cancel-no-id", _line({"cmd": "cancel"}), "'id'"),
    ("plan-no-model_dir", _line({"cmd": "plan", "id": "p"}), "'model_dir'"),
    ("plan-model_dir-number", _line({"cmd": "plan", "id": "p", "model_dir": 5}), "'model_dir'"),
    ("plan-vram-string", _line({"cmd": "plan", "id": "p", "model_dir": "/m", "vram_budget_bytes": "x"}),
     "'vram_budget_bytes'"),
    ("plan-vram-negative", _line({"cmd": "plan", "id": "p", "model_dir": "/m", "vram_budget_bytes": -1}),
     "'vram_budget_bytes'"),
    ("plan-vram-gib", _line({"cmd": "plan", "id": "p", "model_dir": "/m", "vram_budget_bytes": 12.5}),
     "'vram_budget_bytes'"),
    ("plan-ram-zero", _line({"cmd": "plan", "id": "p", "model_dir": "/m", "ram_gb": 0}), "'ram_gb'"),
    ("plan-ctx-string", _line({"cmd": "plan", "id": "p", "model_dir": "/m", "ctx": "x"}), "'ctx'"),
    ("plan-id-list", _line({"cmd": "plan", "id": [], "model_dir": "/m"}), "'id'"),
    ("plan-unknown-option", _line({"cmd": "plan", "id": "p", "model_dir": "/m", "vram": 2}), "unknown field \"vram\""),
    # serve (nothing is bound: every one is refused before the server is made)
    ("serve-no-host", _line({"cmd": "serve", "port": 0}), "'host'"),
    ("serve-no-port", _line({"cmd": "serve", "host": "127.0.0.1"}), "'port'"),
    ("serve-host-number", _serve(host=127), "'host'"),
    ("serve-host-empty", _serve(host=""), "'host'"),
    ("serve-host-space", _serve(host="127.0.0.1 "), "'host'"),
    ("serve-host-nul", _serve(host="a\x00b"), "'host'"),
    ("serve-host-null", _serve(host=None), "'host'"),
    ("serve-port-string", _serve(port="8000"), "'port'"),
    ("serve-port-negative", _serve(port=-1), "'port'"),
    ("serve-port-too-big", _serve(port=65536), "'port'"),
    ("serve-port-float", _serve(port=8000.5), "'port'"),
    ("serve-port-bool", _serve(port=True), "'port'"),
    ("serve-api_key-number", _serve(api_key=5), "'api_key'"),
    ("serve-api_key-empty", _serve(api_key=""), "'api_key'"),
    ("serve-api_key-space", _serve(api_key="my key"), "'api_key'"),
    ("serve-api_key-newline", _serve(api_key="k\nX-Injected: 1"), "'api_key'"),
    ("serve-api_key-non-ascii", _serve(api_key="clé"), "'api_key'"),
    ("serve-unknown-field", _serve(ctx=5), "unknown field \"ctx\""),
]


@pytest.fixture(scope="module")
def loaded_worker() -> Iterator[WorkerProc]:
    """One worker process for the whole table, with the scripted model loaded (vocabulary: 16 ids)."""
    w = WorkerProc(*FAKE)
    try:
        w.expect_event("ready")
        w.send(cmd="load", model_dir="/models/fake")
        w.expect_event("loaded")
        yield w
    finally:
        w.close()


def _send_raw(w: WorkerProc, data: bytes) -> None:
    assert w.proc.stdin is not None
    w.proc.stdin.write(data + b"\n")
    w.proc.stdin.flush()


def _next_record(w: WorkerProc) -> dict[str, Any]:
    try:
        record = w.records.get(timeout=TIMEOUT)
    except queue.Empty:
        raise AssertionError("the worker did not answer the line") from None
    if record is None:
        raise AssertionError(f"the worker died; stderr:\n{w.stderr.decode()[-3000:]}")
    w.seen.append(record)
    return record


def _still_serves(w: WorkerProc, request_id: str) -> None:
    """A valid request on the same process runs to its end (not Busy, not stuck)."""
    w.send(cmd="generate", id=request_id, messages=USER, params={"max_new_tokens": 8})
    end = w.expect(lambda r: r.get("id") == request_id and r["event"] in ("finished", "error"))
    assert end["event"] == "finished", end


@pytest.mark.parametrize(("line", "names"), [(line, names) for _, line, names in MALFORMED],
                         ids=[case_id for case_id, _, _ in MALFORMED])
def test_malformed_line_gets_one_protocol_error_naming_the_field(
    loaded_worker: WorkerProc, line: bytes, names: str, request: pytest.FixtureRequest
) -> None:
    w = loaded_worker
    start = len(w.seen)
    _send_raw(w, line)
    answer = _next_record(w)
    assert answer["event"] == "error" and answer["kind"] == "ProtocolError", answer
    assert answer["fatal"] is False
    assert names in answer["message"], answer["message"]
    assert "\n" not in answer["message"] and len(answer["message"]) < 400  # one clear line
    if answer.get("id") is not None:
        assert isinstance(answer["id"], str)
    _still_serves(w, f"probe-{request.node.callspec.id}")
    # exactly one answer: nothing else came between the error and the probe's records
    assert [r for r in w.seen[start + 1:] if r["event"] == "error"] == []


def test_a_line_over_the_limit_is_refused_then_the_next_one_served(loaded_worker: WorkerProc) -> None:
    w = loaded_worker
    over = _gen(prompt=None, messages=[{"role": "user", "content": "a" * (MAX_LINE_BYTES + 1024)}])
    assert len(over) > MAX_LINE_BYTES
    _send_raw(w, over)
    answer = _next_record(w)
    assert (answer["event"], answer["kind"]) == ("error", "ProtocolError")
    assert "longer than" in answer["message"] and str(MAX_LINE_BYTES) in answer["message"]
    _still_serves(w, "after-long-line")
    # a long line under the limit is an ordinary command
    w.send(cmd="generate", id="long-ok", messages=[{"role": "user", "content": "b" * (2 << 20)}])
    assert w.expect(lambda r: r.get("id") == "long-ok" and r["event"] in ("finished", "error"))["event"] == "finished"


def test_every_valid_boundary_value_is_accepted(loaded_worker: WorkerProc) -> None:
    """The checks refuse only what is out of range: the edges themselves, and the client's full params, pass."""
    w = loaded_worker
    edges = [
        {"temperature": 0, "top_p": 1, "top_k": 0, "threshold": 0, "seed": 0, "block_size": 1, "max_new_tokens": 1},
        # the top edges of engine.decode.limits.GENERATION_LIMITS (the CLI's flags accept the same)
        {"temperature": 100, "top_p": 1e-9, "threshold": 1, "seed": 2**63 - 1, "repetition_penalty": 100,
         "presence_penalty": -100, "do_sample": True, "mode": "ar", "enable_thinking": False, "block_size": 4096},
        {"temperature": 1e-3, "repetition_penalty": 0.01, "presence_penalty": 100, "max_new_tokens": 2**31 - 1},
        dataclasses.asdict(GenerationParams()),  # what EngineClient sends: every field, None for the defaults
        dataclasses.asdict(GenerationParams(mode="ar", max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=20,
                                            do_sample=True, presence_penalty=0.5, repetition_penalty=1.1,
                                            block_size=32, threshold=0.9, enable_thinking=False, seed=7)),
        None,
    ]
    for i, params in enumerate(edges):
        w.send(cmd="generate", id=f"edge-{i}", messages=USER, params=params)
        end = w.expect(lambda r, i=i: r.get("id") == f"edge-{i}" and r["event"] in ("finished", "error"))
        assert end["event"] == "finished", (params, end)
    w.send(cmd="generate", id="ids", prompt_ids=[0, 15], raw=True, tools=None)
    assert w.expect(lambda r: r.get("id") == "ids" and r["event"] in ("finished", "error"))["event"] == "finished"


def test_refused_load_never_leaves_the_worker_loading() -> None:
    """The hostile review's case: a load with ctx_tokens "x" used to leave every later command "Busy"."""
    w = WorkerProc(*FAKE)
    try:
        w.expect_event("ready")
        for bad in ({"ctx_tokens": "x"}, {"ctx_tokens": "x", "vram_budget_bytes": 2 << 30}, {"vram_budget_bytes": "x"}, {"device": []}):
            w.send(cmd="load", model_dir="/models/fake", **bad)
            refused = w.expect_event("error", op="load")
            assert refused["kind"] == "ProtocolError", refused
            w.send(cmd="load", model_dir="/models/fake")  # at once: never "Busy: a model is loading"
            loaded = w.expect(lambda r: r["event"] in ("loaded", "error"))
            assert loaded["event"] == "loaded", loaded
        assert not [r for r in w.seen if r.get("kind") == "Busy"]
        w.send(cmd="shutdown")
        w.expect_event("bye")
        assert w.proc.wait(10) == 0
    finally:
        w.close()


def test_param_checks_cover_every_generation_param() -> None:
    """The worker's table of checks and engine.decode.events.GenerationParams name the same fields."""
    assert set(PARAM_FIELDS) == {f.name for f in dataclasses.fields(GenerationParams)}


def test_read_lines_bounds_each_line() -> None:
    stream = io.BufferedReader(io.BytesIO(b"0123456789\n" + b"x" * 25 + b"\n\nshort\r\nlast"), buffer_size=8)
    assert list(read_lines(stream, limit=10)) == [b"0123456789", None, b"", b"short", b"last"]
    stream = io.BufferedReader(io.BytesIO(b"y" * 11))
    assert list(read_lines(stream, limit=10)) == [None]


def test_a_valid_plan_with_make_plan_options_is_answered(loaded_worker: WorkerProc) -> None:
    """The plan checks refuse only what is wrong: budgets, context and make_plan's own options pass."""
    w = loaded_worker
    w.send(cmd="plan", id="ok", model_dir="shape:clover-35b-a3b", vram_budget_bytes=12 << 30, ram_gb=64, ctx=4096, block_size=32,
           optimize_for="diffusion")
    answer = w.expect(lambda r: r.get("id") == "ok")
    assert answer["event"] == "plan", answer
    assert answer["plan"]["ctx_tokens"] == 4096
