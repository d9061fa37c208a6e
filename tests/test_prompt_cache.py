"""The prompt cache (engine.generate.PromptCache): a request that starts with the tokens the last one's prefill read
(a chat's next turn re-sends the whole chat) starts from that state instead of reading them again, with the same
tokens out as an engine that reads everything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.events import Finished, GenerationParams, PromptInfo
from fixtures_tiny import tiny_clover_dir  # noqa: F401 (session fixture)


@pytest.fixture(scope="module")
def engines(tiny_clover_dir: Path) -> tuple[Any, Any]:  # noqa: F811
    """(an engine with its prompt cache, one without)."""
    from engine.api import Engine

    plain = Engine.load(tiny_clover_dir)
    plain.prompt_cache = None
    return Engine.load(tiny_clover_dir), plain


def _run(engine: Any, ids: list[int], mode: str, max_new: int = 12, block: int = 8) -> tuple[tuple[int, ...], int]:
    params = GenerationParams(mode=mode, max_new_tokens=max_new, do_sample=False, block_size=block)
    events = list(engine.generate(prompt_ids=ids, params=params))
    info = next(e for e in events if isinstance(e, PromptInfo))
    done = events[-1]
    assert isinstance(done, Finished)
    return done.token_ids, info.cached_tokens


# what a 75- and a 114-token prompt keep: up to the last whole GDN chunk before the end / its whole blocks of 8
@pytest.mark.parametrize(("mode", "kept", "kept_next"), [("ar", 64, 96), ("diffusion", 72, 112)])
def test_a_request_that_starts_like_the_last_one_reads_only_the_rest(engines: tuple[Any, Any], mode: str,
                                                                     kept: int, kept_next: int) -> None:
    cached_engine, plain = engines
    first = list(range(40, 115))  # 75 tokens
    assert _run(cached_engine, first, mode)[0] == _run(plain, first, mode)[0]
    second = first[:74] + list(range(300, 340))  # the same start, then more: a longer cache, the kept part copied
    tokens, cached = _run(cached_engine, second, mode)
    assert cached == kept and tokens == _run(plain, second, mode)[0]
    third = second + [7, 8, 9]  # the next turn again, and the kept cache is big enough this time
    tokens, cached = _run(cached_engine, third, mode, max_new=4)
    assert cached == kept_next and tokens == _run(plain, third, mode, max_new=4)[0]
    fourth = second[:kept_next - 1] + [5]  # shorter than what is kept: one snapshot, the last prompt's
    tokens, cached = _run(cached_engine, fourth, mode, max_new=4)
    assert cached == 0 and tokens == _run(plain, fourth, mode, max_new=4)[0]


def test_a_different_start_or_mode_reads_everything(engines: tuple[Any, Any]) -> None:
    cached_engine, plain = engines
    first = list(range(40, 115))
    _run(cached_engine, first, "diffusion")
    other = [39, *first[1:]]  # differs in the first token
    tokens, cached = _run(cached_engine, other, "diffusion")
    assert cached == 0 and tokens == _run(plain, other, "diffusion")[0]
    tokens, cached = _run(cached_engine, other, "ar")  # kept by a block-mode prefill: not an AR one's
    assert cached == 0 and tokens == _run(plain, other, "ar")[0]
    _run(cached_engine, other, "diffusion")
    tokens, cached = _run(cached_engine, other, "diffusion", block=4)  # other blocks: another attention pattern
    assert cached == 0 and tokens == _run(plain, other, "diffusion", block=4)[0]
    assert _run(cached_engine, other, "diffusion", block=4)[1] == 72  # and now that one is kept


def test_a_chats_next_turn_starts_from_the_last_turns_prompt(engines: tuple[Any, Any]) -> None:
    """The next turn renders the first answer where the first turn had its generation prompt: what the cache kept
    stops before that (whole blocks), so it is all the next turn's."""
    cached_engine, plain = engines
    question = {"role": "user", "content": "Tell me about block diffusion and why it can be faster than writing "
                                           "one token at a time, in a few sentences please."}
    params = GenerationParams(max_new_tokens=8, do_sample=False, block_size=8)
    first = list(cached_engine.generate(messages=[question], params=params))
    answer = first[-1].text or "ok"
    turn = [question, {"role": "assistant", "content": answer}, {"role": "user", "content": "And the cost?"}]
    second = list(cached_engine.generate(messages=turn, params=params))
    info = next(e for e in second if isinstance(e, PromptInfo))
    assert info.cached_tokens > 0 and info.cached_tokens % 8 == 0
    assert second[-1].token_ids == list(plain.generate(messages=turn, params=params))[-1].token_ids


def test_a_long_prompt_after_a_cached_start_reports_only_what_it_reads(tiny_clover_dir: Path) -> None:  # noqa: F811
    """The prefill's progress counts the tokens left to read; the point kept for the next turn is one more forward
    boundary, not one more progress event."""
    from engine.api import Engine
    from engine.events import PrefillProgress

    engine = Engine.load(tiny_clover_dir)
    engine.model.max_pass_tokens = 64
    first = list(range(40, 240))  # 200 tokens: segments of 64 in AR (causal) mode
    events = list(engine.generate(prompt_ids=first, params=GenerationParams(mode="ar", max_new_tokens=2)))
    assert [e.done for e in events if isinstance(e, PrefillProgress)] == [0, 64, 128, 192, 200]
    assert engine.prompt_cache.ids == tuple(first[:192])  # kept at the last whole GDN chunk before the end
    second = first + list(range(300, 420))
    events = list(engine.generate(prompt_ids=second, params=GenerationParams(mode="ar", max_new_tokens=2)))
    info = next(e for e in events if isinstance(e, PromptInfo))
    assert info.cached_tokens == 192
    assert [(e.done, e.total) for e in events if isinstance(e, PrefillProgress)] == [
        (0, 128), (64, 128), (128, 128)]  # 320 - 192 left
