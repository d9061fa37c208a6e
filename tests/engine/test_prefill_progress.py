"""A long prompt's prefill reports progress and can be cancelled between its segments (engine.decode.loop_parts.prefill),
on a tiny real Clover checkpoint: the segments are the model's own (``segment_tokens``), the cache they write is the
one a single forward writes, and a cancel set during the prefill ends the request before any denoising pass."""

from __future__ import annotations

import threading

import pytest
import torch
from fixtures_tiny import one_torch_thread, tiny_clover_dir  # noqa: F401 (fixtures)

from clover_desk.engine.api import Engine
from clover_desk.engine.decode.events import (
    BlockStep,
    Finished,
    GenerationParams,
    PrefillProgress,
    PromptInfo,
    TextDelta,
    from_dict,
    to_dict,
)
from clover_desk.engine.decode.loop_parts import prefill

SEGMENT = 64  # max_pass_tokens for these tests: a few hundred prompt tokens make several segments
LONG = "The quick brown fox jumps over the lazy dog. " * 40


@pytest.fixture(scope="module")
def clover(tiny_clover_dir, one_torch_thread):  # noqa: F811
    engine = Engine.load(tiny_clover_dir)
    engine.model.max_pass_tokens = SEGMENT
    engine.prompt_cache = None  # every request reads its whole prompt here (a repeated one would start later)
    return engine


def run(engine: Engine, prompt: str, cancel_after: int | None = None, **params) -> list[object]:  # noqa: ANN003
    """The events of one request; with ``cancel_after`` the flag is set once that many tokens were prefilled."""
    cancel = threading.Event()
    events: list[object] = []
    for event in engine.generate(prompt=prompt, params=GenerationParams(max_new_tokens=8, **params), cancel=cancel):
        events.append(event)
        if cancel_after is not None and isinstance(event, PrefillProgress) and event.done >= cancel_after:
            cancel.set()
    return events


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_a_long_prompt_reports_each_segment_then_decodes(clover: Engine, mode: str) -> None:
    events = run(clover, LONG, mode=mode, block_size=8 if mode == "diffusion" else None)
    info = events[0]
    assert isinstance(info, PromptInfo)
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    prefilled = info.first_block * info.block_size if mode == "diffusion" else info.prompt_tokens
    assert prefilled > 4 * SEGMENT
    # one before the first segment, one after each; all before the first pass of the answer
    assert [p.done for p in progress] == [0, *range(SEGMENT, prefilled, SEGMENT), prefilled]
    assert {p.total for p in progress} == {prefilled}
    last_progress = max(i for i, e in enumerate(events) if isinstance(e, PrefillProgress))
    first_decode = min(i for i, e in enumerate(events) if isinstance(e, (BlockStep, TextDelta, Finished)))
    assert last_progress < first_decode
    assert isinstance(events[-1], Finished) and events[-1].stop_reason != "cancelled"


def test_a_short_prompt_is_one_pass_without_progress_events(clover: Engine) -> None:
    events = run(clover, "hi")
    assert not any(isinstance(e, PrefillProgress) for e in events)
    assert isinstance(events[-1], Finished)


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_stop_during_the_prefill_ends_the_request_before_decoding(clover: Engine, mode: str) -> None:
    events = run(clover, LONG, cancel_after=2 * SEGMENT, mode=mode, block_size=8 if mode == "diffusion" else None)
    progress = [e.done for e in events if isinstance(e, PrefillProgress)]
    assert progress == [0, SEGMENT, 2 * SEGMENT]  # the flag was honoured before the next segment
    assert not any(isinstance(e, (BlockStep, TextDelta)) for e in events)
    done = events[-1]
    assert isinstance(done, Finished) and done.stop_reason == "cancelled" and done.tokens == 0 and done.passes == 0


def test_segments_write_the_cache_the_models_own_split_writes(clover: Engine) -> None:
    model = clover.model
    ids = torch.tensor(clover.tokenizer.encode(LONG)[: 5 * SEGMENT], dtype=torch.long)  # [T]
    whole_cache = model.new_cache(ids.numel())
    whole = model.forward(ids, 0, whole_cache, block_size=8, write_cache=True, last_only=True, prefill=True)
    steps = prefill(model, ids, model.new_cache(ids.numel()), 8, None, prefill=True)
    seen = []
    try:
        while True:
            seen.append(next(steps).done)
    except StopIteration as stop:
        segmented = stop.value
    assert seen == [0, *range(SEGMENT, 5 * SEGMENT + 1, SEGMENT)]
    assert torch.equal(segmented, whole)


def test_the_event_travels_as_json() -> None:
    record = to_dict(PrefillProgress(done=3072, total=12288))
    assert record == {"event": "prefill", "done": 3072, "total": 12288}
    assert from_dict(record) == PrefillProgress(3072, 12288)
