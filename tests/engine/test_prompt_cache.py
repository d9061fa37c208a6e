"""The prompt cache (engine.decode.prompt_cache.PromptCache): a request that starts with the tokens the last one's prefill read
(a chat's next turn re-sends the whole chat) starts from that state instead of reading them again, with the same
tokens out as an engine that reads everything."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from fixtures_tiny import tiny_clover_dir  # noqa: F401 (session fixture)

from clover_desk.engine.decode.events import Finished, GenerationParams, PromptInfo


@pytest.fixture(scope="module")
def engines(tiny_clover_dir: Path) -> tuple[Any, Any]:  # noqa: F811
    """(an engine with its prompt cache, one without)."""
    from clover_desk.engine.api import Engine

    plain = Engine.load(tiny_clover_dir)
    plain.prompt_cache = None
    return Engine.load(tiny_clover_dir), plain


def _run(engine: Any, ids: list[int], mode: str, max_new: int = 12, block: int = 8,
         **kwargs: Any) -> tuple[tuple[int, ...], int]:
    params = GenerationParams(mode=mode, max_new_tokens=max_new, do_sample=False, block_size=block)
    events = list(engine.generate(prompt_ids=ids, params=params, **kwargs))
    info = next(e for e in events if isinstance(e, PromptInfo))
    done = events[-1]
    assert isinstance(done, Finished) and done.cached_tokens == info.cached_tokens
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
    fourth = second[:kept_next - 1] + [5]  # shorter than what is kept: back to the point kept before it
    tokens, cached = _run(cached_engine, fourth, mode, max_new=4)
    assert cached == kept and tokens == _run(plain, fourth, mode, max_new=4)[0]
    fifth = second[:kept - 1] + [5]  # shorter than that too: no point below it was kept (the first read had none)
    tokens, cached = _run(cached_engine, fifth, mode, max_new=4)
    assert cached == 0 and tokens == _run(plain, fifth, mode, max_new=4)[0]


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
    from clover_desk.engine.api import Engine
    from clover_desk.engine.decode.events import PrefillProgress

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
    from clover_desk.engine.decode.generate import generate
    from clover_desk.engine.decode.prompt_cache import PromptCache
    from clover_desk.engine.decode.settings import DecodeSettings
    from clover_desk.engine.kernels import step_graphs
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
    cached = {"ar": (0, 64, 96, 96, 256), "diffusion": (0, 72, 112, 112, 264)}[mode]
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
        # the next turn: the entry left in the replaced cache goes to host memory and comes back into the new one
        assert run(fifth, kept) == (want[len(fifth)], cached[4])
        assert runner._cache_ref() is model._kept_cache and not kept.saved
        # back to a checkpoint (an older message edited): in place, in the graphs' cache
        shared = model._kept_cache
        point = max(n for n in kept.checkpoint_lengths if n < len(first))
        back = first[:point] + list(range(200, 230))
        assert run(back, kept) == (run(back, None)[0], point) and point > 0
        assert model._kept_cache is shared and runner._cache_ref() is shared
    finally:
        model.step_graph = model.pass_graph = None
        model._kept_cache = None


@pytest.mark.parametrize(("mode", "kept_a", "kept_b"), [("ar", 64, 64), ("diffusion", 72, 80)])
def test_a_chat_switched_back_to_goes_on_from_its_entry_in_host_memory(engines: tuple[Any, Any], mode: str,
                                                                        kept_a: int, kept_b: int) -> None:
    """Two chats taking turns: each request that starts otherwise moves the last prompt's entry to host memory,
    and a chat's next turn finds its own there (the longest entry it starts with)."""
    from clover_desk.engine.decode.prompt_cache import PromptCache

    cached_engine, plain = engines
    cached_engine.prompt_cache = store = PromptCache()
    a, b = list(range(500, 575)), list(range(600, 680))  # 75 and 80 tokens
    assert _run(cached_engine, a, mode)[1] == 0
    assert _run(cached_engine, b, mode)[1] == 0
    assert [len(e.ids) for e in store.saved] == [kept_a] and all(e.kv[0][1].device.type == "cpu" for e in store.saved)
    a2, b2 = a + list(range(700, 730)), b + list(range(730, 760))
    assert _run(cached_engine, a2, mode) == (_run(plain, a2, mode)[0], kept_a)
    assert _run(cached_engine, b2, mode) == (_run(plain, b2, mode)[0], kept_b)
    assert len(store.saved) == 1 and store.saved[0].ids[:kept_a] == tuple(a2[:kept_a])  # a2's, b2's is live
    assert 0 < store.saved_bytes == store.saved[0].nbytes
    # a's first turn again (shorter than a2's entry), then b: a's entries of two lengths are saved (and b2's); a's
    # third turn goes on from the longer one
    longer = 96 if mode == "ar" else 104  # a2 and b2 are 110 tokens
    _run(cached_engine, a, mode)
    _run(cached_engine, b, mode)
    assert [(e.ids[0], len(e.ids)) for e in store.saved] == [(500, longer), (600, longer), (500, kept_a)]
    a3 = a2 + [1, 2, 3]
    assert _run(cached_engine, a3, mode) == (_run(plain, a3, mode)[0], longer)


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_scopes_never_share_entries(engines: tuple[Any, Any], mode: str) -> None:
    """Issue 31: a request of another scope (another HTTP client) reads a prompt whole even when the same tokens are
    cached, live or saved in host memory, and each scope still finds its own entries afterwards."""
    from clover_desk.engine.decode.prompt_cache import PromptCache

    cached_engine, plain = engines
    cached_engine.prompt_cache = store = PromptCache()
    a = list(range(500, 575))
    longer = a + list(range(700, 730))
    assert _run(cached_engine, a, mode, cache_scope="alice")[1] == 0
    kept = _run(cached_engine, longer, mode, cache_scope="alice")[1]
    assert kept > 0  # her own next turn
    tokens, cached = _run(cached_engine, longer, mode, cache_scope="bob")  # her entry is live: not his
    assert cached == 0 and tokens == _run(plain, longer, mode)[0]
    assert [e.scope for e in store.saved] == ["alice"]  # hers moved to host memory, as another chat's
    assert _run(cached_engine, longer, mode, cache_scope="carol")[1] == 0  # saved, live: neither is hers
    assert _run(cached_engine, longer, mode, cache_scope="alice")[1] > 0  # alice's own, back from host memory
    assert _run(cached_engine, longer, mode, cache_scope="bob")[1] > 0  # bob's own, saved meanwhile
    assert _run(cached_engine, longer, mode)[1] == 0  # the engine's own chats (LOCAL_SCOPE) are apart too


def test_saved_entries_stay_within_their_budget_least_recently_used_first(engines: tuple[Any, Any]) -> None:
    from clover_desk.engine.decode.prompt_cache import PromptCache

    cached_engine, plain = engines
    chats = {name: list(range(base, base + 75)) for name, base in zip("abcd", (300, 400, 500, 600))}
    cached_engine.prompt_cache = store = PromptCache()
    for name in "ab":
        _run(cached_engine, chats[name], "diffusion")
    one = store.saved[0].nbytes  # every chat's entry is as big: 72 tokens
    cached_engine.prompt_cache = store = PromptCache(host_bytes=2 * one)
    for name in "abc":
        _run(cached_engine, chats[name], "diffusion")
    assert [e.ids[0] for e in store.saved] == [300, 400]
    assert _run(cached_engine, chats["a"], "diffusion")[1] == 72  # a comes back; c goes out
    _run(cached_engine, chats["d"], "diffusion")  # a goes out, b (used longest ago) makes room
    assert [e.ids[0] for e in store.saved] == [500, 300] and store.saved_bytes <= 2 * one
    tokens, cached = _run(cached_engine, chats["b"], "diffusion")
    assert cached == 0 and tokens == _run(plain, chats["b"], "diffusion")[0]
    cached_engine.prompt_cache = store = PromptCache(host_bytes=0)  # only the last prompt's
    for name in "aba":
        assert _run(cached_engine, chats[name], "diffusion")[1] == 0
    assert not store.saved


def test_no_entry_is_saved_that_would_leave_the_machine_short_of_memory(engines: tuple[Any, Any],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    from clover_desk.engine.decode import prompt_cache

    cached_engine, _ = engines
    a, b, c = (list(range(base, base + 75)) for base in (300, 400, 500))
    cached_engine.prompt_cache = store = prompt_cache.PromptCache()
    _run(cached_engine, a, "diffusion")
    _run(cached_engine, b, "diffusion")  # a is saved
    store.host_bytes = store.saved_bytes  # room for one entry
    monkeypatch.setattr(prompt_cache, "SAVED_FREE_MARGIN", psutil.virtual_memory().total)
    _run(cached_engine, c, "diffusion")  # b would take a's place: b is not saved, and a is not dropped for it
    assert [e.ids[0] for e in store.saved] == [300]
    assert _run(cached_engine, a, "diffusion")[1] == 72  # a comes back
    for prompt in (b, c, b):
        assert _run(cached_engine, prompt, "diffusion")[1] == 0
    assert not store.saved


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
@pytest.mark.parametrize("thinking", [True, False])
def test_what_is_kept_stops_before_the_generation_prompt(engines: tuple[Any, Any], mode: str, thinking: bool) -> None:
    """The generation prompt ("<|im_start|>assistant\\n<think>\\n", more with thinking off) is where a chat's next
    turn writes the answer instead: a point kept past its start would never match again. A first turn whose whole
    blocks (GDN chunks in AR mode) reach into it: the next turn still goes on from the blocks before it."""
    from clover_desk.engine.decode.prompt_cache import PromptCache

    cached_engine, plain = engines
    tok = cached_engine.tokenizer
    unit = 8 if mode == "diffusion" else 32
    params = GenerationParams(mode=mode, max_new_tokens=6, do_sample=False, block_size=8, enable_thinking=thinking)
    for n in range(1, 80):  # a question whose whole blocks / chunks reach past where the next turn differs
        question = [{"role": "user", "content": "Explain " + "block diffusion " * n}]
        nxt = [*question, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "More?"}]
        ids = cached_engine.prompt_ids(messages=question, enable_thinking=thinking)
        later = cached_engine.prompt_ids(messages=nxt, enable_thinking=thinking)
        differ = next(i for i, (a, b) in enumerate(zip(ids, later)) if a != b)  # "<think>"
        turn = len(ids) - 1 - ids[::-1].index(tok.turn_start_id)
        if turn >= unit and (len(ids) if mode == "diffusion" else len(ids) - 1) // unit * unit > differ:
            break
    else:
        pytest.fail("no question length reaches into the generation prompt")
    cached_engine.prompt_cache = PromptCache()
    list(cached_engine.generate(messages=question, params=params))
    events = list(cached_engine.generate(messages=nxt, params=params))
    assert next(e for e in events if isinstance(e, PromptInfo)).cached_tokens == turn // unit * unit > 0
    assert events[-1].token_ids == list(plain.generate(messages=nxt, params=params))[-1].token_ids


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_reading_a_chat_ahead_leaves_only_the_new_message_to_read(engines: tuple[Any, Any], mode: str) -> None:
    """Engine.read_chat (what the window runs while the engine is idle): the chat so far, its last answer
    included, is read into the prompt cache and nothing is generated; the next turn then reads only its new message,
    with the tokens of an engine that reads everything."""
    from clover_desk.engine.decode.prompt_cache import PromptCache

    cached_engine, plain = engines
    cached_engine.prompt_cache = PromptCache()
    chat = [{"role": "user", "content": "Tell me about the lighthouse keepers and their islands, please. " * 3},
            {"role": "assistant", "content": "They kept the lamps lit through every storm of the northern winter. " * 3}]
    params = GenerationParams(mode=mode, max_new_tokens=6, do_sample=False, block_size=8)
    events = list(cached_engine.read_chat(chat, params))
    done = events[-1]
    assert isinstance(done, Finished) and done.stop_reason == "prefilled" and done.tokens == 0 and done.text == ""
    ids = cached_engine.prompt_ids(messages=chat)
    unit = 32 if mode == "ar" else 8
    turn = len(ids) - 1 - ids[::-1].index(cached_engine.tokenizer.turn_start_id)  # its generation prompt
    assert cached_engine.prompt_cache.ids == tuple(ids[: turn // unit * unit])
    nxt = [*chat, {"role": "user", "content": "And then?"}]
    second = list(cached_engine.generate(messages=nxt, params=params))
    assert second[-1].cached_tokens == turn // unit * unit
    assert second[-1].token_ids == list(plain.generate(messages=nxt, params=params))[-1].token_ids
    cancel = threading.Event()
    cancel.set()
    assert list(cached_engine.read_chat(nxt, params, cancel=cancel))[-1].stop_reason == "cancelled"


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_a_prefill_stopped_part_way_keeps_what_it_read(tiny_clover_dir: Path, mode: str) -> None:  # noqa: F811
    """A read-ahead stopped by a send (or an answer stopped while its prompt was read) keeps the whole segments
    it read: the request after it goes on from there, with the tokens of an engine that reads everything."""
    from clover_desk.engine.api import Engine
    from clover_desk.engine.decode.events import PrefillProgress

    engine, plain = Engine.load(tiny_clover_dir), Engine.load(tiny_clover_dir)
    plain.prompt_cache = None
    engine.model.max_pass_tokens = 64  # segments of 64 (whole blocks of 8, whole GDN chunks of 32)
    chat = [{"role": "user", "content": "Tell me about the lighthouse keepers and their islands, please. " * 8},
            {"role": "assistant", "content": "They kept the lamps lit through every storm of the winter. " * 8}]
    params = GenerationParams(mode=mode, max_new_tokens=6, do_sample=False, block_size=8)
    cancel = threading.Event()
    events = []
    for event in engine.read_chat(chat, params, cancel=cancel):
        events.append(event)
        if isinstance(event, PrefillProgress) and event.done == 128:
            cancel.set()  # a send comes: the read stops after the segment it is in
    assert events[-1].stop_reason == "cancelled" and [e.done for e in events if isinstance(e, PrefillProgress)] == [
        0, 64, 128]
    ids = engine.prompt_ids(messages=chat)
    assert engine.prompt_cache.ids == tuple(ids[:128])
    nxt = [*chat, {"role": "user", "content": "And then?"}]
    second = list(engine.generate(messages=nxt, params=params))
    assert second[-1].cached_tokens == 128
    assert second[-1].token_ids == list(plain.generate(messages=nxt, params=params))[-1].token_ids


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_regenerate_after_a_read_ahead_goes_back_to_the_point_before_the_answer(engines: tuple[Any, Any],
                                                                               mode: str) -> None:
    """The read-ahead extends the entry over the answer; Regenerate then sends the prompt that had it written,
    which stops before the answer: the entry goes back to the point kept before (its states were copied to host
    memory; the rows below it are the same), so Regenerate does not read the chat again."""
    from clover_desk.engine.decode.prompt_cache import PromptCache

    cached_engine, plain = engines
    cached_engine.prompt_cache = PromptCache()
    question = [{"role": "user", "content": "Tell me about the lighthouse keepers and their islands, please. " * 3}]
    params = GenerationParams(mode=mode, max_new_tokens=6, do_sample=False, block_size=8)
    first = list(cached_engine.generate(messages=question, params=params))[-1]
    before = cached_engine.prompt_cache.ids
    chat = [*question, {"role": "assistant", "content": "They kept the lamps lit through every storm. " * 3}]
    list(cached_engine.read_chat(chat, params))
    assert len(cached_engine.prompt_cache.ids) > len(before)  # extended over the answer
    again = list(cached_engine.generate(messages=question, params=params))[-1]  # Regenerate
    assert again.cached_tokens == len(before) > 0 and again.token_ids == first.token_ids
    assert again.token_ids == list(plain.generate(messages=question, params=params))[-1].token_ids


def _chat(turns: int) -> list[dict[str, str]]:
    """A chat of ``turns`` questions and answers, each some 20-30 tokens."""
    out = []
    for i in range(turns):
        out.append({"role": "user", "content": f"Question {i}: tell me about lighthouse keeper number {i}, please."})
        out.append({"role": "assistant", "content": f"Keeper {i} kept the lamp lit through storm {i} of the winter."})
    return out


def _turn_at(engine: Any, messages: list[dict[str, str]], index: int) -> int:
    """Where message ``index`` starts (its <|im_start|>) in the prompt of ``messages``."""
    ids = engine.prompt_ids(messages=messages)
    starts = [i for i, t in enumerate(ids) if t == engine.tokenizer.turn_start_id]
    return starts[index]


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_an_older_message_edited_goes_back_to_the_checkpoint_before_it(engines: tuple[Any, Any], mode: str) -> None:
    """A chat read in one prefill (opened from disk and read ahead) leaves checkpoints at its turn starts: an older
    message edited and sent again reads from the turn start before it, not the whole chat, with the tokens of an
    engine that reads everything; without checkpoints it reads everything."""
    from clover_desk.engine.decode.prompt_cache import PromptCache

    cached_engine, plain = engines
    unit = 32 if mode == "ar" else 8
    params = GenerationParams(mode=mode, max_new_tokens=6, do_sample=False, block_size=8)
    chat = _chat(4)
    edited = [*chat[:4], {"role": "user", "content": "Question 2, asked otherwise: what did the keepers eat?"}]
    at = _turn_at(cached_engine, chat, 4) // unit * unit  # the edited message's turn start, whole units
    for checkpoints, expect in ((8, at), (0, 0)):
        cached_engine.prompt_cache = store = PromptCache(checkpoints=checkpoints)
        list(cached_engine.read_chat(chat, params))
        assert (at in store.checkpoint_lengths) == (checkpoints > 0)
        done = list(cached_engine.generate(messages=edited, params=params))[-1]
        assert done.cached_tokens == expect
        assert done.token_ids == list(plain.generate(messages=edited, params=params))[-1].token_ids
    assert expect == 0 < at  # (the loop's last case: without checkpoints)


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_turn_by_turn_every_point_gone_on_from_stays_reachable_up_to_the_limit(engines: tuple[Any, Any],
                                                                             mode: str) -> None:
    """The window's rhythm: a send, then a read-ahead of the answer, turn after turn. Each point a later request
    went on from becomes a checkpoint, so Regenerate two turns back still reads only its last message; past
    ``checkpoints`` the oldest go."""
    from clover_desk.engine.decode.prompt_cache import PromptCache

    cached_engine, plain = engines
    unit = 32 if mode == "ar" else 8
    params = GenerationParams(mode=mode, max_new_tokens=6, do_sample=False, block_size=8)
    chat = _chat(4)
    cached_engine.prompt_cache = store = PromptCache(checkpoints=4)
    for turn in range(4):
        list(cached_engine.generate(messages=chat[: 2 * turn + 1], params=params))  # the send
        list(cached_engine.read_chat(chat[: 2 * turn + 2], params))  # the read-ahead after its answer
        assert len(store.checkpoint_lengths) == min(4, 2 * turn + 1)
    assert store.checkpoint_lengths == sorted(store.checkpoint_lengths)
    oldest = store.checkpoint_lengths[0]
    back = chat[:5]  # the third question, answered again (two turns back)
    expect = _turn_at(cached_engine, chat, 5) // unit * unit  # its generation prompt starts where answer 2 did
    assert expect in store.checkpoint_lengths
    done = list(cached_engine.generate(messages=back, params=params))[-1]
    assert done.cached_tokens == expect
    assert done.token_ids == list(plain.generate(messages=back, params=params))[-1].token_ids
    assert max(store.checkpoint_lengths) < expect <= len(store.ids)  # the later ones went with the rows over them
    first = chat[:1]  # the first question again: before the oldest checkpoint left
    assert _turn_at(cached_engine, chat, 1) // unit * unit < oldest
    done = list(cached_engine.generate(messages=first, params=params))[-1]
    assert done.cached_tokens == 0
    assert done.token_ids == list(plain.generate(messages=first, params=params))[-1].token_ids


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_a_saved_chat_branched_from_an_older_answer_starts_from_its_checkpoint(engines: tuple[Any, Any],
                                                                                mode: str) -> None:
    """A chat moved to host memory (another chat was opened) keeps its checkpoints: a branch from one of its
    older answers starts from the checkpoint there, and the chat's own entry stays saved for it."""
    from clover_desk.engine.decode.prompt_cache import PromptCache

    cached_engine, plain = engines
    unit = 32 if mode == "ar" else 8
    params = GenerationParams(mode=mode, max_new_tokens=6, do_sample=False, block_size=8)
    a = _chat(4)
    b = [{"role": "user", "content": "Something else entirely: how do tides work?"}]
    cached_engine.prompt_cache = store = PromptCache()
    list(cached_engine.read_chat(a, params))
    full = store.ids
    list(cached_engine.read_chat(b, params))  # a is saved, with its checkpoints
    assert [e.ids for e in store.saved] == [full] and store.saved[0].backs
    branch = [*a[:4], {"role": "user", "content": "Back to keeper 1: where was the lighthouse?"}]
    done = list(cached_engine.generate(messages=branch, params=params))[-1]
    assert done.cached_tokens == _turn_at(cached_engine, a, 4) // unit * unit > 0
    assert done.token_ids == list(plain.generate(messages=branch, params=params))[-1].token_ids
    saved_a = [e for e in store.saved if e.ids == full]  # a's entry stays saved (b's too, if it kept any)
    assert len(saved_a) == 1
    a_points = [len(p.ids) for p in saved_a[0].backs]
    assert store.checkpoint_lengths[:-1] == [n for n in a_points if n < done.cached_tokens]  # the branch has them too
    assert store.checkpoint_lengths[-1] == done.cached_tokens  # and the point it went on from
    # a's own next turn starts with the branch's entry too (up to "user" of the message that differs), but a's saved
    # entry is longer: it goes on from that
    nxt = [*a, {"role": "user", "content": "And keeper 4?"}]
    done = list(cached_engine.generate(messages=nxt, params=params))[-1]
    assert done.cached_tokens == len(full)
    assert done.token_ids == list(plain.generate(messages=nxt, params=params))[-1].token_ids


def test_checkpoints_stay_within_the_memory_limits(engines: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A saved entry whose checkpoints would pass ``host_bytes`` leaves out its oldest ones; no checkpoint is made
    that would leave the machine short of memory."""
    import psutil

    from clover_desk.engine.decode import prompt_cache

    cached_engine, _ = engines
    params = GenerationParams(mode="diffusion", max_new_tokens=6, do_sample=False, block_size=8)
    a, b = _chat(3), [{"role": "user", "content": "Something else entirely: how do tides work?"}]
    cached_engine.prompt_cache = store = prompt_cache.PromptCache()
    list(cached_engine.read_chat(a, params))
    points = store.checkpoint_lengths
    list(cached_engine.read_chat(b, params))
    entry = store.saved[0]
    assert [len(p.ids) for p in entry.backs] == points and len(points) >= 3
    one = entry.backs[0].nbytes  # every checkpoint is as big (the GDN states and a logit row)
    assert entry.nbytes > len(points) * one
    cached_engine.prompt_cache = store = prompt_cache.PromptCache(host_bytes=entry.nbytes - one)
    list(cached_engine.read_chat(a, params))
    list(cached_engine.read_chat(b, params))
    assert [len(p.ids) for p in store.saved[0].backs] == points[1:] and store.saved_bytes <= store.host_bytes
    monkeypatch.setattr(prompt_cache, "SAVED_FREE_MARGIN", psutil.virtual_memory().total)
    cached_engine.prompt_cache = store = prompt_cache.PromptCache()
    list(cached_engine.read_chat(a, params))
    assert store.checkpoint_lengths == [] and len(store.ids) == len(entry.ids)


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_a_request_waiting_for_its_answer_gets_checkpoints_only_where_its_forwards_end(tiny_clover_dir: Path,  # noqa: F811
                                                                                      mode: str) -> None:
    """A send's prefill makes no extra forward for checkpoints (with streamed experts each forward streams its
    layers' experts again): it keeps the points where its segments end anyway. A read-ahead, run while the engine
    is idle, also stops at the chat's turn starts."""
    from clover_desk.engine.api import Engine
    from clover_desk.engine.decode.prompt_cache import PromptCache

    engine = Engine.load(tiny_clover_dir)
    engine.model.max_pass_tokens = 64  # segments of 64
    calls: list[int] = []
    forward = engine.model.forward

    def counted(ids: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(ids.shape[-1])
        return forward(ids, *args, **kwargs)

    engine.model.forward = counted
    chat = _chat(4)
    params = GenerationParams(mode=mode, max_new_tokens=1, do_sample=False, block_size=8)
    runs = {}
    for checkpoints in (0, 8):
        engine.prompt_cache = PromptCache(checkpoints=checkpoints)
        calls.clear()
        list(engine.generate(messages=chat[:7], params=params))
        runs[checkpoints] = (list(calls), engine.prompt_cache.checkpoint_lengths, len(engine.prompt_cache.ids))
    assert runs[0][0] == runs[8][0]  # the same forwards
    kept = runs[8][2]
    assert runs[0][1] == [] and runs[8][1] == list(range(64, kept, 64)) and len(runs[8][1]) >= 3
    calls.clear()
    engine.prompt_cache = store = PromptCache()
    list(engine.read_chat(chat, params))
    unit = 32 if mode == "ar" else 8
    turns = {_turn_at(engine, chat, i) // unit * unit for i in range(1, 8)}
    assert store.checkpoint_lengths == sorted(p for p in turns | set(range(64, len(store.ids), 64))
                                              if 0 < p < len(store.ids))[-8:]
    assert len(calls) > -(-len(store.ids) // 64)  # the read ends forwards there too


def test_other_chats_checkpoints_make_room_before_whole_chats_do(engines: tuple[Any, Any]) -> None:
    """Saved entries within ``host_bytes``: a new one makes room by the checkpoints of the least recently used
    entries first, then by its own oldest, and only then by whole entries, so that going back to a chat (common)
    still finds it when editing an older message of it (rarer) would not."""
    from clover_desk.engine.decode.prompt_cache import PromptCache

    cached_engine, _ = engines
    params = GenerationParams(mode="diffusion", max_new_tokens=6, do_sample=False, block_size=8)
    chats = [[{"role": "user", "content": f"Chat {c}. " + m["content"]} if m["role"] == "user" else m
              for m in _chat(3)] for c in range(4)]
    cached_engine.prompt_cache = store = PromptCache()
    for chat in chats[:2]:
        list(cached_engine.read_chat(chat, params))
    whole = store.saved[0]  # every chat's entry is as big, and so is every checkpoint
    one, points = whole.backs[0].nbytes, len(whole.backs)
    own = whole.nbytes - points * one
    assert points >= 3
    cached_engine.prompt_cache = store = PromptCache(host_bytes=3 * own + (points + 1) * one)
    for chat in chats:  # a, b, c saved in turn (d is the last, live)
        list(cached_engine.read_chat(chat, params))
    assert len(store.saved) == 3 and store.saved_bytes <= store.host_bytes  # no chat went
    kept = [len(e.backs) for e in store.saved]
    assert kept == [0, 1, points] and store.saved[2].nbytes == whole.nbytes  # a's went, then b's oldest ones
    assert [len(p.ids) for p in store.saved[1].backs] == [len(p.ids) for p in whole.backs][-1:]
    done = list(cached_engine.generate(messages=[*chats[0], {"role": "user", "content": "And then?"}],
                                       params=params))[-1]
    assert done.cached_tokens == len(whole.ids)  # chat a comes back whole (only its checkpoints went)


def test_the_shared_start_of_two_prompts_is_found_exactly() -> None:
    import random

    from clover_desk.engine.decode.prompt_cache import _shared

    rng = random.Random(0)
    for _ in range(300):  # within the first window of 64 tokens and past several doubled ones
        size = rng.randrange(0, 60) if rng.random() < 0.5 else rng.randrange(0, 700)
        ids = tuple(rng.randrange(4) for _ in range(size))
        other = list(ids[: rng.randrange(0, len(ids) + 1)]) + [rng.randrange(4) for _ in range(rng.randrange(0, 9))]
        want = next((i for i, (a, b) in enumerate(zip(other, ids)) if a != b), min(len(other), len(ids)))
        assert _shared(tuple(other), ids) == want, (other, ids)
