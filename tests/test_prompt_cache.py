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


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_passes_replayed_from_cuda_graphs_go_on_from_the_cache_the_model_keeps(mode: str) -> None:
    """A model whose AR steps and block passes replay CUDA graphs hands every request the same cache (the graphs
    belong to it): the prompt cache keeps that one, so a chat's next turn both skips what it read and replays the
    graphs recorded for it. The pieces run eagerly here (``record=False``, the CPU) through the buffers a recording
    reads; the tokens are those of a model without graphs or prompt cache."""
    from engine import step_graphs
    from engine.generate import DecodeSettings, PromptCache, generate
    from tests.helpers_model import tiny_config, tiny_model

    model = tiny_model(tiny_config(), seed=5)
    cfg = model.config

    def run(prompt: list[int], kept: PromptCache | None, n: int = 12) -> tuple[tuple[int, ...], int]:
        s = DecodeSettings(mode=mode, max_new_tokens=n, block_size=cfg.block_size, threshold=0.9, mask_token_id=256,
                           eos_token_ids=(), max_positions=cfg.max_position_embeddings, shift_logits=cfg.shift_logits)
        events = list(generate(model, prompt, s, prompt_cache=kept))
        info = next(e for e in events if isinstance(e, PromptInfo))
        return tuple(events[-1].token_ids), info.cached_tokens

    first = list(range(3, 78))  # 75 tokens
    second = first[:74] + list(range(100, 140))  # the next turn: 114 tokens
    third = second + [7, 8, 9]
    fourth = third + list(range(20, 170))  # 267 tokens: past the 256 positions the kept cache was sized to
    fifth = fourth + [1]
    want = {len(p): run(p, None)[0] for p in (first, second, third, fourth, fifth)}
    # what each keeps: up to the last whole GDN chunk (32) before the end / the prompt's whole blocks of 8
    cached = {"ar": (0, 64, 96, 96), "diffusion": (0, 72, 112, 112)}[mode]
    runner = step_graphs.StepGraphs(model, record=False)
    model.step_graph = model.pass_graph = runner
    kept = PromptCache()
    try:
        for prompt, expected in zip((first, second, third), cached):
            assert run(prompt, kept) == (want[len(prompt)], expected)
            if prompt is first:
                shared = model._kept_cache
            assert model._kept_cache is shared and runner._cache_ref() is shared  # the graphs' cache, never another
        assert run(fourth, kept) == (want[len(fourth)], cached[3])  # a longer one: the kept rows move into it
        assert model._kept_cache is not shared and model._kept_cache.max_len == 512
        served = runner.replays if mode == "ar" else runner.pass_replays
        assert served >= 4 * 12 - 4  # the decoding passes went through the pieces
        # a longer request without the prompt cache replaces the model's cache: the next turn reads everything
        run(first, None, n=600)
        assert model._kept_cache.max_len == 768
        assert run(fifth, kept) == (want[len(fifth)], 0)
        assert runner._cache_ref() is model._kept_cache
    finally:
        model.step_graph = model.pass_graph = None
        model._kept_cache = None
