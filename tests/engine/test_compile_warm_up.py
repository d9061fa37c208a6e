"""A compiled load warms its layers up before it returns (``Engine.load(compile=True)`` / ``Engine.warm_up``): one
short generation per decoding mode, each announced as a load-progress stage, a cancel between them ending the load
as cancelled, a GGUF file compiled too, and a machine without a C++ compiler said to load uncompiled. Then the same through the worker's ``load`` (its progress
records shown by the window's load banner) and ``clover-desk serve --compile``.

The real engine on the tiny checkpoint; the layers go through a counting backend that runs the traced graphs (no
inductor: the inductor figures are ``clover-desk bench speed --compile``'s). The tests share that one backend and
leave dynamo's cache in place between them, so the graphs traced by the first load serve the later ones (a model
of the same shape passes the same guards); the module resets dynamo when it ends.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_tiny import tiny_clover_dir  # noqa: F401 (session fixture)
from helpers_model import CountingBackend

from clover_desk.engine.api import Engine
from clover_desk.engine.decode.events import COMPILE_STAGES, Finished, GenerationParams, LoadProgress

BACKEND = CountingBackend()


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


def _stages(events: list[LoadProgress]) -> list[str]:
    """The stages in the order they began (a stage's repeats folded)."""
    out: list[str] = []
    for e in events:
        if not out or out[-1] != e.stage:
            out.append(e.stage)
    return out


def _generate(engine: Engine, ids: list[int], mode: str, n: int) -> Finished:
    *_, done = engine.generate(prompt_ids=ids, params=GenerationParams(mode=mode, max_new_tokens=n, do_sample=False))
    assert isinstance(done, Finished)
    return done


@pytest.mark.heavy  # ~90 s of inductor compiles on 2 cores: make test-heavy (the GGUF warm-up below stays in make test)
def test_a_compiled_load_warms_up_ar_then_diffusion_and_the_first_requests_compile_nothing(
    tiny_clover_dir: Path,  # noqa: F811
) -> None:
    events: list[LoadProgress] = []
    engine = Engine.load(tiny_clover_dir, compile=True, compile_backend=BACKEND, progress=events.append)
    assert engine.compiled and engine.compile_skipped is None
    assert _stages(events)[-3:] == ["done", "compiling-ar", "compiling-diffusion"]
    warm = [e for e in events if e.stage in COMPILE_STAGES]
    assert [e.current for e in warm] == ["one-time warm-up 1 of 2: 4 tokens of AR decoding",
                                         "one-time warm-up 2 of 2: 2 blocks of block diffusion"]
    assert all(e.total_bytes == 0 for e in warm)  # a busy indicator: the warm-up's length is not known
    graphs = BACKEND.graphs
    assert graphs > 0  # the warm-up ran the compiled layers
    # requests shaped like the warm-up's (a prompt one block and a few tokens long) find every graph compiled: in
    # AR the prefill, the first steps and the steady steps; in diffusion the prefill, denoising and commit passes
    ids = engine._warm_up_prompt()  # noqa: SLF001
    assert _generate(engine, ids, "ar", 8).tokens == 8
    assert _generate(engine, ids[::-1], "diffusion", 2 * engine.config.block_size).passes >= 3
    assert BACKEND.graphs == graphs
    # Prompts of other lengths (shorter than a chunk or a block, several chunks, several whole blocks) find their
    # graphs too: the warm-up's order and lengths leave no variant for the first request to compile (a short
    # prompt's prefill used to compile the one-chunk GDN graph, ~1 s; a diffusion prompt shorter than a block its
    # first pass at position 0), and the count is not one graph per prompt length (the chunk scan runs eagerly)
    block = engine.config.block_size

    def other_lengths(short: int, blocks: int) -> None:
        assert _generate(engine, ids[:short], "ar", 3).tokens == 3
        assert _generate(engine, ids[:short], "diffusion", 2 * block).passes >= 2
        long = (ids * 8)[: blocks * block + short]
        assert _generate(engine, long, "ar", 3).tokens == 3
        assert _generate(engine, long, "diffusion", block).passes >= 2

    other_lengths(5, 3)
    other_lengths(7, 4)
    other_lengths(11, 5)
    assert BACKEND.graphs == graphs


def test_cancel_during_the_warm_up_keeps_the_model_uncompiled(tiny_clover_dir: Path) -> None:  # noqa: F811
    """(Issue 32: it ended the load as cancelled, leaving no model.) The weights are in place by then: Cancel stops
    the compile, and the model is kept, running eagerly."""
    cancel = threading.Event()
    events: list[LoadProgress] = []

    def progress(p: LoadProgress) -> None:
        events.append(p)
        if p.stage == "compiling-ar":
            cancel.set()  # the user presses Cancel as the warm-up starts

    engine = Engine.load(tiny_clover_dir, compile=True, compile_backend=BACKEND, progress=progress, cancel=cancel)
    assert engine.compile_cancelled and not engine.compiled
    assert _stages(events)[-2:] == ["done", "compiling-ar"]  # the diffusion stage never began


def test_a_gguf_file_compiles_and_warms_up_in_its_modes(tiny_clover_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """GGUF modules (blocks dequantized in the forward) compile like the others; measured on a small Q4_0 model,
    compiled AR decoding ran ~2.8x faster than eager on 2 CPU cores."""
    from clover_desk.engine.weights.gguf.writer import write_gguf

    gguf = write_gguf(tiny_clover_dir, tmp_path / "tiny-Q8_0.gguf", "Q8_0", layout="upstream")[0]
    events: list[LoadProgress] = []
    engine = Engine.load(gguf, compile=True, compile_backend=BACKEND, progress=events.append)
    assert engine.compiled and engine.compile_skipped is None
    assert _stages([e for e in events if e.stage in COMPILE_STAGES]) == ["compiling-ar"]  # upstream layout: AR only


def test_without_a_cpp_compiler_the_model_loads_uncompiled_and_says_why(
    tiny_clover_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no g++, c++, clang++ or cl to be found
    monkeypatch.delenv("CXX", raising=False)
    events: list[LoadProgress] = []
    with caplog.at_level("WARNING", logger="clover_desk.engine.api"):
        engine = Engine.load(tiny_clover_dir, compile=True, progress=events.append)  # the real inductor backend
    assert not engine.compiled and "needs a C++ compiler" in (engine.compile_skipped or "")
    assert [e.current for e in events if e.stage in COMPILE_STAGES] == [engine.compile_skipped]
    assert f"not compiling {tiny_clover_dir.name}: torch.compile on the CPU needs a C++ compiler" in caplog.text


def test_the_worker_loads_compiled_and_the_window_shows_the_warm_up(
    qapp: Any, tiny_clover_dir: Path,  # noqa: F811
) -> None:
    from clover_desk.engine.decode.events import from_dict
    from clover_desk.ui.banners import LoadBanner
    from clover_desk.worker.process import Worker

    records: list[dict[str, Any]] = []
    worker = Worker(records.append, functools.partial(Engine.load, compile_backend=BACKEND))
    try:
        worker.handle({"cmd": "load", "model_dir": str(tiny_clover_dir), "compile": True})
        deadline = time.monotonic() + 180  # run alone, this test traces the graphs itself
        while not any(r["event"] in ("loaded", "error") for r in records) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        worker.stop()
    assert records[-1]["event"] == "loaded", records[-1]
    assert records[-1]["compiled"] is True and records[-1]["compile_skipped"] is None
    assert records[-1]["cpu_kernels_missing"] is None  # float weights (the window says when kernels are missing)
    progress = [from_dict(r) for r in records if r["event"] == "load_progress"]
    assert _stages(progress)[-2:] == ["compiling-ar", "compiling-diffusion"]
    banner = LoadBanner()
    banner.set_progress(progress[-1])
    assert banner.label.text() == "Compiling the layers…"
    assert banner.detail.text().endswith(" s · one-time warm-up 2 of 2: 2 blocks of block diffusion")  # elapsed first


def test_serve_compile_loads_the_model_compiled(tiny_clover_dir: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from clover_desk.cli import serve as cmd_serve
    from clover_desk.cli.main import parse_args

    asked: list[dict[str, Any]] = []
    load = Engine.load

    def load_with_test_backend(*args: Any, **kwargs: Any) -> Engine:  # the real load, its kwargs seen
        asked.append(kwargs)
        return load(*args, compile_backend=BACKEND, **kwargs)

    monkeypatch.setattr(Engine, "load", load_with_test_backend)
    args = parse_args(["serve", "--model", str(tiny_clover_dir), "--port", "0", "--compile"])
    assert args.compile is True and parse_args(["serve", "--model", "m"]).compile is False
    engine = cmd_serve._load(args)  # noqa: SLF001
    assert asked[-1]["compile"] is True and engine.compiled
    err = capsys.readouterr().err
    assert "clover-desk serve: compiling-ar: one-time warm-up 1 of 2" in err
    assert "clover-desk serve: compiling-diffusion: one-time warm-up 2 of 2" in err
