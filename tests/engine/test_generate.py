"""The AR and block-diffusion loops, first on a scripted fake model (exact protocol checks), then end to end on
tiny real checkpoints through :class:`engine.api.Engine`."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence

import pytest
import torch
from letter_model import (
    END_THINK,
    EOS,
    MASK,
    THINK,
    FakeCache,
    LetterTokenizer,
    ScriptedModel,
    V,
    letters,
    settings,
)

from clover_desk.engine.decode import decoding
from clover_desk.engine.decode.events import BlockCommitted, BlockStep, Finished, PromptInfo, TextDelta
from clover_desk.engine.decode.generate import generate, generate_ar, generate_diffusion
from clover_desk.engine.decode.settings import DecodeSettings
from clover_desk.engine.errors import PromptError


def run(model: ScriptedModel, prompt: Sequence[int], s: DecodeSettings, **kw: object) -> list[object]:
    return list(generate(model, prompt, s, **kw))  # type: ignore[arg-type]


def finished(events: list[object]) -> Finished:
    assert isinstance(events[-1], Finished)
    return events[-1]


# ---- block protocol ----------------------------------------------------------------------------------------------


def test_blocks_align_to_position_zero_with_the_prompt_tail_in_the_first_block() -> None:
    model = ScriptedModel(letters)
    prompt = [letters(p) for p in range(19)]  # 2 whole blocks of 8 + a tail of 3
    events = run(model, prompt, settings(max_new_tokens=13))
    info = events[0]
    assert info == PromptInfo(prompt_tokens=19, block_size=8, first_block=2, tail=3)
    prefill = model.calls[0]
    assert (prefill.start_pos, len(prefill.ids), prefill.block_size, prefill.write_cache) == (0, 16, 8, True)
    first = model.calls[1]
    assert first.start_pos == 16 and first.ids[:3] == prompt[16:] and first.ids[3:] == [MASK] * 5
    assert not first.write_cache
    steps = [e for e in events if isinstance(e, BlockStep)]
    assert steps[0].prompt_slots == 3 and steps[0].masked[:3] == (False, False, False)
    assert steps[0].confidence[:3] == (1.0, 1.0, 1.0)
    done = finished(events)
    assert done.token_ids == tuple(letters(p) for p in range(19, 32))  # 5 in the tail block + 8 in the next
    assert done.stop_reason == "max_new_tokens" and done.tokens == 13


def test_commit_pass_writes_each_block_into_the_cache_exactly_once() -> None:
    model = ScriptedModel(letters)
    prompt = [letters(p) for p in range(5)]
    events = run(model, prompt, settings(max_new_tokens=30))  # blocks 0..4; 3 + 8 + 8 + 8 + 3 slots
    writes = [c for c in model.calls if c.write_cache]
    assert [c.start_pos for c in writes] == [0, 8, 16, 24]  # no prefill (no whole prompt block); last block skipped
    assert all(c.block_size == 8 and len(c.ids) == 8 and MASK not in c.ids for c in writes)
    cache = model.caches[0]
    assert cache.tokens == [letters(p) for p in range(32)]  # prompt + committed blocks, each once, in order
    committed = [e for e in events if isinstance(e, BlockCommitted)]
    assert [c.block_index for c in committed] == [0, 1, 2, 3, 4]
    assert sum(len(c.token_ids) for c in committed) == 30


def test_confident_slots_commit_together_and_the_rest_one_per_pass() -> None:
    # even positions are confident (p ~ 0.997), odd ones are not (p ~ 0.24): pass 1 commits the 4 even slots
    # of a block of 8, then the fallback commits one odd slot per pass (left-most on ties): 1 + 4 passes.
    model = ScriptedModel(letters, margin=lambda p: 12.0 if p % 2 == 0 else 3.0)
    events = run(model, [letters(p) for p in range(8)], settings(max_new_tokens=16))
    steps = [e for e in events if isinstance(e, BlockStep) and e.block_index == 1]
    assert len(steps) == 5
    assert steps[0].committed_now == (True, False) * 4
    assert [s.committed_now.index(True) for s in steps[1:]] == [1, 3, 5, 7]
    assert all(sum(s.committed_now) == 1 for s in steps[1:])
    # still-masked slots report this pass's confidence; committed ones the confidence they were committed with
    assert steps[0].confidence[1] < 0.5 and steps[0].confidence[0] > 0.95
    committed = [e for e in events if isinstance(e, BlockCommitted)]
    assert committed[0].passes == 6  # 5 denoise + the commit pass
    done = finished(events)
    assert done.passes == 5 + 1 + 5  # block 2 is the last one: its commit pass is skipped
    assert done.tokens_per_pass == pytest.approx(16 / 11)


def test_eos_truncates_the_block_and_stops() -> None:
    model = ScriptedModel(lambda p: EOS if p == 13 else letters(p))
    events = run(model, [letters(p) for p in range(4)], settings(max_new_tokens=100))
    done = finished(events)
    assert done.stop_reason == "eos"
    assert done.token_ids == tuple(letters(p) for p in range(4, 13)) + (EOS,)
    assert [c.start_pos for c in model.calls if c.write_cache] == [0]  # block 0 committed; block 1 ended by EOS


def test_a_resolved_eos_ends_the_block_without_filling_the_slots_after_it() -> None:
    # position 9 is EOS and confident; positions after it are never confident. The block ends as soon as every
    # slot before the EOS is committed, without spending passes on the slots after it.
    model = ScriptedModel(lambda p: EOS if p == 9 else letters(p), margin=lambda p: 12.0 if p <= 9 else 1.0)
    events = run(model, [letters(p) for p in range(8)], settings())
    steps = [e for e in events if isinstance(e, BlockStep)]
    assert len(steps) == 1 and steps[0].masked[2:] == (True,) * 6
    assert finished(events).token_ids == (letters(8), EOS)


def test_max_new_tokens_ends_inside_a_block() -> None:
    model = ScriptedModel(letters, margin=lambda p: 12.0 if p < 11 else 1.0)
    events = run(model, [letters(p) for p in range(8)], settings(max_new_tokens=3))
    done = finished(events)
    assert done.token_ids == (letters(8), letters(9), letters(10)) and done.stop_reason == "max_new_tokens"
    assert len([e for e in events if isinstance(e, BlockStep)]) == 1  # slots past the budget are not waited for


def test_slots_past_the_budget_compete_so_a_shorter_budget_only_cuts() -> None:
    # slots past the budget are the most confident: they commit first, as they do with a longer budget, and the
    # shorter run stops as soon as its own slots are committed (the same passes, cut)
    model = ScriptedModel(letters, margin=lambda p: 0.5 if p < 11 else 4.0)
    events = run(model, [letters(p) for p in range(8)], settings(max_new_tokens=3))
    steps = [e for e in events if isinstance(e, BlockStep)]
    assert len(steps) == 8 and sorted(s.committed_now.index(True) for s in steps[:5]) == [3, 4, 5, 6, 7]
    longer = run(ScriptedModel(letters, margin=lambda p: 0.5 if p < 11 else 4.0), [letters(p) for p in range(8)],
                 settings(max_new_tokens=20))
    assert [e for e in longer if isinstance(e, BlockStep)][:8] == steps
    assert finished(longer).token_ids[:3] == finished(events).token_ids
    # after a committed EOS, the slots behind it do not compete
    eos_model = ScriptedModel(lambda p: EOS if p == 10 else letters(p), margin=lambda p: {10: 12.0}.get(p, 0.5 if p < 10 else 4.0))
    steps = [e for e in run(eos_model, [letters(p) for p in range(8)], settings()) if isinstance(e, BlockStep)]
    assert len(steps) == 3  # EOS at slot 2, then slots 0 and 1


def test_diffusion_respects_shifted_logits() -> None:
    model = ScriptedModel(letters, shift=True)
    events = run(model, [letters(p) for p in range(8)], settings(max_new_tokens=16, shift_logits=True))
    assert finished(events).token_ids == tuple(letters(p) for p in range(8, 24))
    # without the shift flag the same model's rows are read one slot off
    wrong = run(ScriptedModel(letters, shift=True), [letters(p) for p in range(8)], settings(max_new_tokens=16))
    assert finished(wrong).token_ids != tuple(letters(p) for p in range(8, 24))


def test_the_mask_token_is_never_proposed() -> None:
    model = ScriptedModel(lambda p: MASK)  # a model that always predicts the mask
    done = finished(run(model, [letters(0)], settings(max_new_tokens=7)))
    assert MASK not in done.token_ids and done.tokens == 7


def test_presence_penalty_changes_a_repeated_choice() -> None:
    # every slot slightly prefers token 20 over 21; with a strong presence penalty, once 20 is out 21 wins
    class TwoChoice(ScriptedModel):
        def forward(self, ids, start_pos, cache, block_size=None, write_cache=True, last_only=False):  # type: ignore[no-untyped-def]
            out = super().forward(ids, start_pos, cache, block_size, write_cache, last_only)
            out[:, 20], out[:, 21] = 5.0, 4.5
            return out

    plain = finished(run(TwoChoice(lambda p: 0, margin=lambda p: 0.0), [10], settings(mode="ar", max_new_tokens=3)))
    assert plain.token_ids == (20, 20, 20)
    penal = run(TwoChoice(lambda p: 0, margin=lambda p: 0.0), [10], settings(mode="ar", max_new_tokens=3,
                                                                          presence_penalty=1.0))
    assert finished(penal).token_ids == (20, 21, 20)  # once both are out, both carry the same penalty


# ---- context limit -----------------------------------------------------------------------------------------------


def test_prompt_that_cannot_fit_its_last_block_is_refused() -> None:
    model = ScriptedModel(letters)
    with pytest.raises(PromptError, match="needs 72 positions, but the context holds 64"):
        generate_diffusion(model, [letters(p) for p in range(64)], settings(max_positions=64))
    with pytest.raises(PromptError, match="needs 64 positions, but the context holds 60"):
        generate_diffusion(model, [letters(p) for p in range(56)], settings(max_positions=60))
    assert model.calls == []  # refused before any forward
    # 60 tokens fit: the tail block [56, 64) ends exactly at the limit
    done = finished(run(model, [letters(p) for p in range(60)], settings(max_positions=64)))
    assert done.tokens == 4 and done.stop_reason == "context"


def test_max_new_tokens_is_clamped_to_the_context() -> None:
    model = ScriptedModel(letters)
    done = finished(run(model, [letters(p) for p in range(50)], settings(max_positions=64, max_new_tokens=500)))
    assert done.stop_reason == "context" and done.tokens == 14
    ar = finished(run(ScriptedModel(letters), [letters(p) for p in range(50)],
                      settings(mode="ar", max_positions=64, max_new_tokens=500)))
    assert ar.stop_reason == "context" and ar.tokens == 14
    with pytest.raises(PromptError, match="no room"):
        generate_ar(ScriptedModel(letters), [letters(p) for p in range(64)], settings(mode="ar", max_positions=64))


def test_each_mode_entry_decodes_in_its_mode_whatever_the_settings_say() -> None:
    """generate_ar and generate_diffusion are generate in their mode: the settings' own mode does not pick the loop."""
    prompt = [letters(p) for p in range(10)]
    ar_info = next(iter(generate_ar(ScriptedModel(letters), prompt, settings(mode="diffusion"))))
    block_info = next(iter(generate_diffusion(ScriptedModel(letters), prompt, settings(mode="ar"))))
    assert isinstance(ar_info, PromptInfo) and ar_info.block_size == 1
    assert isinstance(block_info, PromptInfo) and block_info.block_size == 8


def test_empty_prompt_and_out_of_vocab_ids_are_refused() -> None:
    with pytest.raises(PromptError, match="empty"):
        generate(ScriptedModel(letters), [], settings())
    with pytest.raises(PromptError, match="outside the vocabulary"):
        generate(ScriptedModel(letters), [1, 999], settings(), vocab_size=V)


def test_diffusion_without_a_mask_id_is_a_clear_error() -> None:
    with pytest.raises(PromptError, match="mask"):
        generate_diffusion(ScriptedModel(letters), [10, 11], settings(mask_token_id=None))


# ---- cancel ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_cancel_takes_effect_within_one_pass(mode: str) -> None:
    model = ScriptedModel(letters, margin=lambda p: 1.0)  # one slot per pass: many passes per block
    cancel = threading.Event()
    events = []
    calls_at_cancel = -1
    prompt = [letters(p) for p in range(8)]
    for event in generate(model, prompt, settings(mode=mode, max_new_tokens=64), LetterTokenizer(), cancel):
        events.append(event)
        if isinstance(event, (BlockStep, TextDelta)) and not cancel.is_set() and len(events) > 3:
            cancel.set()
            calls_at_cancel = len(model.calls)
    done = finished(events)
    assert done.stop_reason == "cancelled"
    assert len(model.calls) == calls_at_cancel  # not a single forward after the flag was seen
    assert done.tokens < 64


def test_cancel_before_start_runs_no_forward() -> None:
    cancel = threading.Event()
    cancel.set()
    model = ScriptedModel(letters)
    done = finished(run(model, [letters(p) for p in range(20)], settings(), cancel=cancel))
    assert done.stop_reason == "cancelled" and model.calls == []


# ---- AR ----------------------------------------------------------------------------------------------------------


def test_ar_prefills_once_then_one_cached_token_per_forward() -> None:
    model = ScriptedModel(letters, shift=True)  # causal: row i predicts position i + 1
    prompt = [letters(p) for p in range(5)]
    events = run(model, prompt, settings(mode="ar", max_new_tokens=6))
    done = finished(events)
    assert done.token_ids == tuple(letters(p) for p in range(5, 11))
    assert model.calls[0].ids == prompt and model.calls[0].block_size is None
    assert [(c.start_pos, len(c.ids)) for c in model.calls[1:]] == [(5, 1), (6, 1), (7, 1), (8, 1), (9, 1)]
    assert all(c.write_cache and c.last_only for c in model.calls)
    assert done.passes == 6 and done.tokens_per_pass == 1.0
    assert not any(isinstance(e, BlockStep) for e in events)


def test_ar_stops_at_eos() -> None:
    model = ScriptedModel(lambda p: EOS if p == 7 else letters(p), shift=True)
    done = finished(run(model, [letters(0)] * 4, settings(mode="ar")))
    assert done.stop_reason == "eos" and done.token_ids == (letters(4), letters(5), letters(6), EOS)


def test_ar_sampling_is_seeded() -> None:
    outs = []
    for _ in range(2):
        model = ScriptedModel(letters, margin=lambda p: 0.5, shift=True)
        outs.append(finished(run(model, [10], settings(mode="ar", do_sample=True, temperature=1.0, seed=7,
                                                       max_new_tokens=12))).token_ids)
    assert outs[0] == outs[1] and outs[0] != tuple(letters(p) for p in range(1, 13))


def test_ar_greedy_never_outputs_the_mask_and_takes_the_runner_up() -> None:
    # the mask wins outright where the next position is even (9 against the letter's 5) and ties it elsewhere
    class MaskFirst(ScriptedModel):
        def forward(self, ids, start_pos, cache, block_size=None, write_cache=True, last_only=False):  # type: ignore[no-untyped-def]
            out = super().forward(ids, start_pos, cache, block_size, write_cache, last_only)
            p = start_pos + ids.shape[0]  # the position the last row predicts
            out[:, MASK] = 9.0 if p % 2 == 0 else 5.0
            return out

    done = finished(run(MaskFirst(letters, margin=lambda p: 5.0, shift=True), [letters(0)] * 3,
                        settings(mode="ar", max_new_tokens=6)))
    assert MASK not in done.token_ids
    assert done.token_ids == tuple(letters(p) for p in range(3, 9))


def test_ar_greedy_equals_the_full_policy_on_random_logits() -> None:
    # random rows, the mask often on top, penalties on: the fast greedy path picks what penalties, the forbidden
    # mask and the softmax's argmax (decoding.propose) pick
    table = torch.randn(64, V, generator=torch.Generator().manual_seed(5)) * 3
    table[::3, MASK] = 50.0

    class Random(ScriptedModel):
        def forward(self, ids, start_pos, cache, block_size=None, write_cache=True, last_only=False):  # type: ignore[no-untyped-def]
            super().forward(ids, start_pos, cache, block_size, write_cache, last_only)
            rows = table[start_pos : start_pos + ids.shape[0]].clone()
            return rows[-1:] if last_only else rows

    prompt = [11, 12, 13]
    for kw in ({}, {"repetition_penalty": 1.3, "presence_penalty": 0.7}):
        s = settings(mode="ar", max_new_tokens=20, eos_token_ids=(), **kw)
        got = finished(run(Random(letters), prompt, s)).token_ids
        seq, want = list(prompt), []
        for _ in range(20):
            row = table[len(seq) - 1 : len(seq)].clone()
            seen = torch.zeros(V, dtype=torch.bool)
            seen[seq] = True
            out_seen = torch.zeros(V, dtype=torch.bool)
            out_seen[want] = True
            row = decoding.apply_repetition_penalty(row, seen, s.repetition_penalty)
            row = decoding.apply_presence_penalty(row, out_seen, s.presence_penalty)
            row = decoding.forbid_tokens(row, [MASK])
            tok = int(decoding.propose(row)[0][0])
            seq.append(tok)
            want.append(tok)
        assert got == tuple(want)
        assert MASK not in got


# ---- text channels -----------------------------------------------------------------------------------------------


def test_thinking_text_goes_to_its_own_channel_and_the_answer_follows() -> None:
    # prompt ends with <think>: generated text is thinking until </think>, then answer, then EOS
    script = {8: 10, 9: 11, 10: 12, 11: END_THINK, 12: 13, 13: 14, 14: EOS}
    model = ScriptedModel(lambda p: script.get(p, 15))
    events = run(model, [20, 21, 22, 23, 24, 25, 26, THINK], settings(block_size=4),
                 tokenizer=LetterTokenizer())
    deltas = [e for e in events if isinstance(e, TextDelta)]
    assert "".join(d.text for d in deltas if d.channel == "thinking") == "abc"
    assert "".join(d.text for d in deltas if d.channel == "answer") == "de"
    done = finished(events)
    assert done.thinking == "abc" and done.text == "de" and done.stop_reason == "eos"
    steps = [e for e in events if isinstance(e, BlockStep)]
    assert "</think>" in steps[-1].texts or any("</think>" in s.texts for s in steps)  # pieces name special tokens


def test_deltas_are_only_emitted_for_committed_blocks() -> None:
    model = ScriptedModel(letters)
    seen_before_commit = []
    committed = 0
    for e in generate(model, [letters(p) for p in range(8)], settings(max_new_tokens=16), tokenizer=LetterTokenizer()):
        if isinstance(e, BlockCommitted):
            committed += 1
        if isinstance(e, TextDelta):
            seen_before_commit.append(committed)
    # each block's text arrives once, right before its BlockCommitted
    assert seen_before_commit == [0, 1]


# ---- end to end on tiny real checkpoints ---------------------------------------------------------------------------

from fixtures_tiny import one_torch_thread, tiny_clover_dir, tiny_qwen_dir  # noqa: E402,F401

from clover_desk.engine.api import Engine, plan_for  # noqa: E402
from clover_desk.engine.decode.events import GenerationParams  # noqa: E402
from clover_desk.engine.defaults import GIB  # noqa: E402

PLAIN = dict(presence_penalty=0.0, repetition_penalty=1.0)  # penalties off where a reference is recomputed by hand


@pytest.fixture(scope="module")
def clover(tiny_clover_dir, one_torch_thread):  # type: ignore[no-untyped-def]
    return Engine.load(tiny_clover_dir)


@pytest.fixture(scope="module")
def qwen(tiny_qwen_dir, one_torch_thread):  # type: ignore[no-untyped-def]
    return Engine.load(tiny_qwen_dir)


def test_engine_diffusion_end_to_end_on_tiny_clover(clover: Engine) -> None:
    params = GenerationParams(max_new_tokens=12, block_size=8)  # a tail block and at least one more
    events = list(clover.generate(prompt="Write a haiku about the sea.", params=params))
    info = events[0]
    assert isinstance(info, PromptInfo) and info.block_size == 8
    assert info.prompt_tokens == len(clover.tokenizer.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}]))
    done = finished(events)
    steps = [e for e in events if isinstance(e, BlockStep)]
    committed = [e for e in events if isinstance(e, BlockCommitted)]
    assert 1 <= done.tokens <= 12 and done.passes >= len(committed) >= 1
    assert sum(len(c.token_ids) for c in committed) == done.tokens
    assert done.passes == sum(c.passes for c in committed)
    assert all(len(s.tokens) == 8 for s in steps)
    assert steps[0].block_index == info.first_block and steps[0].prompt_slots == info.tail
    deltas = [e for e in events if isinstance(e, TextDelta)]
    assert "".join(d.text for d in deltas if d.channel == "answer") == done.text
    assert "".join(d.text for d in deltas if d.channel == "thinking") == done.thinking
    assert clover.tokenizer.mask_token_id not in done.token_ids
    assert done.tokens_per_pass == pytest.approx(done.tokens / done.passes)


def test_engine_ar_matches_an_uncached_greedy_reference(qwen: Engine) -> None:
    ids = qwen.prompt_ids(prompt="The harbour town", raw=True)
    done = finished(list(qwen.generate(prompt_ids=ids, params=GenerationParams(mode="ar", max_new_tokens=6, **PLAIN))))
    seq = list(ids)
    eos = set(qwen.generation_defaults.eos_token_ids)
    with torch.inference_mode():
        for _ in range(done.tokens):
            logits = qwen.model.forward(torch.tensor(seq), 0, None)  # [T, V], no cache at all
            logits[:, qwen.tokenizer.mask_token_id] = float("-inf")
            seq.append(int(logits[-1].argmax()))
            if seq[-1] in eos:
                break
    assert list(done.token_ids) == seq[len(ids):]


def test_engine_diffusion_matches_an_uncached_block_reference(qwen: Engine) -> None:
    # The cached loop (prefill, read-only denoise passes, commit passes) must decode exactly what re-running the
    # whole context in block mode without a cache decodes, pass by pass.
    B = 8
    ids = qwen.prompt_ids(prompt="Q: What is the capital of Australia?\nA:", raw=True)
    params = GenerationParams(max_new_tokens=20, block_size=B, **PLAIN)
    done = finished(list(qwen.generate(prompt_ids=ids, params=params)))
    mask = qwen.tokenizer.mask_token_id
    seq = list(ids)
    out: list[int] = []
    with torch.inference_mode():
        while len(out) < 20:
            pos0 = (len(seq) // B) * B
            block = seq[pos0:] + [mask] * (B - (len(seq) - pos0))
            start = len(seq) - pos0
            while mask in block[start:]:
                logits = qwen.model.forward(torch.tensor(seq[:pos0] + block), 0, None, block_size=B)[pos0:]  # [B, V]
                logits[:, mask] = float("-inf")
                probs = torch.softmax(logits, -1)
                conf, tok = probs.max(-1)
                masked = torch.tensor([t == mask for t in block])
                conf = torch.where(masked, conf, torch.tensor(-1.0))
                commit = conf > 0.95
                if not commit.any():
                    commit[int(conf.argmax())] = True
                block = [int(t) if c else b for b, t, c in zip(block, tok.tolist(), commit.tolist())]
            new = block[start:][: 20 - len(out)]
            out += new
            seq += new
    eos = set(qwen.generation_defaults.eos_token_ids)
    cut = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
    assert list(done.token_ids) == out[:cut]


def test_engine_refuses_bad_requests_before_any_event(clover: Engine) -> None:
    with pytest.raises(PromptError, match="empty"):
        clover.generate(prompt="   ")
    with pytest.raises(PromptError, match="empty"):
        clover.generate(prompt_ids=[])
    with pytest.raises(PromptError, match="exactly one"):
        clover.generate(prompt="a", prompt_ids=[1])
    with pytest.raises(PromptError, match="outside the vocabulary"):
        clover.generate(prompt_ids=[1, 10**6])


def test_engine_context_limit_refuses_and_clamps(clover: Engine) -> None:
    small = Engine(clover.model, clover.config.with_overrides(max_position_embeddings=64), clover.generation_defaults,
                   clover.tokenizer)
    with pytest.raises(PromptError, match="context holds 64"):
        small.generate(prompt_ids=list(range(10, 80)))
    done = finished(list(small.generate(prompt_ids=list(range(10, 66)), params=GenerationParams(max_new_tokens=100))))
    assert done.stop_reason in ("context", "eos") and done.tokens <= 8


def test_engine_diffusion_needs_a_mask_id(qwen: Engine) -> None:
    no_tokenizer = Engine(qwen.model, qwen.config, qwen.generation_defaults, None)
    assert qwen.config.mask_token_id is None
    with pytest.raises(PromptError, match="mask"):
        no_tokenizer.generate(prompt_ids=[10, 11, 12])
    done = finished(list(no_tokenizer.generate(prompt_ids=[10, 11, 12], params=GenerationParams(mode="ar", max_new_tokens=3))))
    assert done.tokens == 3


def test_engine_chat_with_tools_and_thinking_off(clover: Engine) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "Is it warmer in Lisbon or in Oslo?"}]
    ids = clover.prompt_ids(messages=msgs, tools=tools, enable_thinking=False)
    text = clover.tokenizer.decode(ids, skip_special_tokens=False)
    assert "get_weather" in text and text.endswith("<think>\n\n</think>\n\n")
    events = list(clover.generate(messages=msgs, tools=tools, params=GenerationParams(enable_thinking=False, max_new_tokens=4)))
    assert events[0].prompt_tokens == len(ids)  # type: ignore[union-attr]


def test_engine_cancel_stops_generation(clover: Engine) -> None:
    cancel = threading.Event()
    events = []
    for e in clover.generate(prompt="hello", params=GenerationParams(max_new_tokens=200), cancel=cancel):
        events.append(e)
        if isinstance(e, BlockStep) and e.pass_index == 2:
            cancel.set()
    done = finished(events)
    assert done.stop_reason == "cancelled"
    assert sum(isinstance(e, BlockStep) for e in events) == 3  # the flag was honoured before the next pass


def test_engine_under_a_vram_budget_uses_the_offload_plan(tiny_clover_dir, tmp_path, one_torch_thread) -> None:  # type: ignore[no-untyped-def]
    from fixtures_tiny import copy_model

    folder = copy_model(tiny_clover_dir, tmp_path / "m")  # the quantized cache is written beside the model
    engine = Engine.load(folder, device="cpu", precision="nf4", placement=plan_for(folder, 2 * GIB, dtype="float32"))
    assert engine.plan is not None and engine.plan.fits
    done = finished(list(engine.generate(prompt="hi", params=GenerationParams(max_new_tokens=6, block_size=8))))
    assert done.tokens >= 1
    assert "resident_layers" in done.accounting and "h2d_bytes" in done.accounting


def test_a_cpu_load_without_the_cpu_kernels_says_it_runs_slowly(tiny_clover_dir, tmp_path, monkeypatch,  # type: ignore[no-untyped-def]
                                                                 one_torch_thread) -> None:
    """No C compiler and no prebuilt library: the quantized model still loads and answers (weights unpacked per
    forward), and the engine says why it is slow (the window shows it); with the kernels it says nothing."""
    from fixtures_tiny import copy_model

    from clover_desk.engine.kernels import cpu_quant

    folder = copy_model(tiny_clover_dir, tmp_path / "m")
    assert Engine.load(folder, device="cpu", precision="nf4").cpu_kernels_missing is None
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("CLOVER_DESK_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(cpu_quant, "PREBUILT_DIR", tmp_path / "no-prebuilt")
    cpu_quant._reset()
    try:
        engine = Engine.load(folder, device="cpu", precision="nf4")
        assert engine.cpu_kernels_missing and "no-such-cc" in engine.cpu_kernels_missing
        done = finished(list(engine.generate(prompt="hi", params=GenerationParams(max_new_tokens=4, block_size=8))))
        assert done.tokens >= 1
        assert Engine.load(folder, device="cpu").cpu_kernels_missing is None  # float weights: no kernels needed
    finally:
        monkeypatch.undo()
        cpu_quant._reset()


def test_the_consumer_never_runs_in_no_grad_or_inference_mode() -> None:
    # the loops are generators: a mode switched on around a yield would leak into the caller's code
    for _ in generate(ScriptedModel(letters), [letters(p) for p in range(9)], settings(max_new_tokens=10)):
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def test_think_end_bias_in_the_loop_closes_thinking_once() -> None:
    model = ScriptedModel(letters, margin=lambda p: 3.0)
    s = settings(max_new_tokens=16, think_end_bias=10.0, think_end_bias_start=0, think_end_bias_window=0)
    done = finished(run(model, [letters(p) for p in range(7)] + [THINK], s))
    assert done.token_ids[0] == END_THINK and done.token_ids.count(END_THINK) == 1
    # without an open <think> in the prompt the bias stays off
    plain = finished(run(ScriptedModel(letters, margin=lambda p: 3.0), [letters(p) for p in range(8)], s))
    assert END_THINK not in plain.token_ids


def test_length_penalty_in_the_loop_ends_the_answer() -> None:
    model = ScriptedModel(letters, margin=lambda p: 3.0)
    s = settings(max_new_tokens=40, length_penalty=10.0, length_penalty_start=8, length_penalty_window=0)
    done = finished(run(model, [letters(p) for p in range(8)], s))
    # block 1 is entered with 0 tokens generated (ramp 0), block 2 with 8 (ramp 1): EOS wins there
    assert done.stop_reason == "eos" and done.token_ids[:8] == tuple(letters(p) for p in range(8, 16))
    assert done.token_ids[8] == EOS and done.tokens == 9


def test_planned_engine_keeps_the_embedding_in_ram_and_holds_to_the_planned_context(  # type: ignore[no-untyped-def]
    tiny_clover_dir, tmp_path, one_torch_thread
) -> None:
    from fixtures_tiny import copy_model

    from clover_desk.engine.placement.offload_runtime import runtime_of

    folder = copy_model(tiny_clover_dir, tmp_path / "m")
    engine = Engine.load(folder, device="cpu", precision="nf4", placement=plan_for(folder, 2 * GIB, 96, "float32"))
    plan, model = engine.plan, engine.model
    assert plan.ctx_tokens == 96
    assert model.max_pass_tokens == plan.prefill_chunk_tokens > 0
    embed_bytes = model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    placed = runtime_of(model).ledger.by_kind["non_expert"]
    # the plan keeps the embedding table in system RAM; placement must agree with it (within 5%)
    print(f"non-expert placed {placed} B, planned {plan.vram_breakdown['non_expert']} B, embedding {embed_bytes} B")
    assert abs(placed - plan.vram_breakdown["non_expert"]) <= 0.05 * plan.vram_breakdown["non_expert"]
    # the KV cache was planned for 96 positions: a longer request stops at the context, it never outgrows the plan
    ids = engine.prompt_ids(prompt="hi")
    done = finished(list(engine.generate(prompt_ids=ids, params=GenerationParams(max_new_tokens=500))))
    assert done.stop_reason in ("context", "eos")
    assert len(ids) + done.tokens <= 96
    with pytest.raises(PromptError, match="96"):
        list(engine.generate(prompt_ids=list(range(1, 120)), params=GenerationParams(max_new_tokens=8)))


# ---- the loop's fidelity to the published sampler (LowConfidence, LLaDA2 generate) ----------------------------------
# Margins on a 64-token vocabulary: p(target) = e^m / (e^m + 63). m = 7.62 gives 0.970 (above the 0.95 threshold);
# a repetition penalty of 1.2 brings it to 6.35 (0.900), a presence penalty of 0.9 to 6.72 (0.929): both below.
ABOVE = 7.62
X, Y, Z = 20, 21, 22


class BlockAware(ScriptedModel):
    """ScriptedModel whose margins may depend on what the current block already holds (``ids``)."""

    def __init__(self, margins: Callable[[int, list[int]], tuple[int, float]]) -> None:
        super().__init__(lambda p: 0)
        self.margins = margins

    def forward(self, ids: torch.Tensor, start_pos: int, cache: FakeCache, **kw: object) -> torch.Tensor:  # type: ignore[override]
        out = super().forward(ids, start_pos, cache, **kw)  # type: ignore[arg-type]
        if kw.get("write_cache", True):
            return out
        logits = torch.zeros(ids.shape[0], V)
        for i in range(ids.shape[0]):
            tok, m = self.margins(start_pos + i, ids.tolist())
            logits[i, tok] = m
        return logits


def test_denoising_passes_run_in_block_mode_and_never_write_the_cache() -> None:
    model = ScriptedModel(letters, margin=lambda p: 3.0 if p % 3 else 12.0)  # several passes per block
    run(model, [letters(p) for p in range(11)], settings(max_new_tokens=20))
    denoise = [c for c in model.calls if not c.write_cache]
    assert len(denoise) > 3 and all(c.block_size == 8 for c in denoise)  # bidirectional inside the block
    commits = [c for c in model.calls[1:] if c.write_cache]
    assert commits and all(c.block_size == 8 for c in commits)


def test_confidence_is_taken_after_the_penalties() -> None:
    # first generated block = positions 8..15; slot 8 proposes X (in the prompt) at a raw 0.97, slot 9 Y at ~1.0
    def margins(p: int, ids: list[int]) -> tuple[int, float]:
        return {8: (X, ABOVE), 9: (Y, 12.0)}.get(p, (letters(p), 2.0))

    prompt = [X] + [letters(p) for p in range(1, 8)]
    events = run(BlockAware(margins), prompt, settings(max_new_tokens=8, repetition_penalty=1.2))
    first = next(e for e in events if isinstance(e, BlockStep))
    assert first.committed_now[:2] == (False, True)  # X's penalized confidence (0.90) is below the threshold
    assert 0.85 < first.confidence[0] < 0.95


def test_tokens_committed_in_this_block_count_for_the_presence_penalty() -> None:
    # pass 1 commits Y at slot 8; then slot 9 proposes Y again at a raw 0.97 and slot 10 Z at ~1.0
    def margins(p: int, ids: list[int]) -> tuple[int, float]:
        y_in = ids[0] == Y
        return {8: (Y, 12.0), 9: (Y, ABOVE if y_in else 1.0), 10: (Z, 12.0 if y_in else 1.0)}.get(p, (letters(p), 1.0))

    prompt = [letters(p) for p in range(8)]
    events = run(BlockAware(margins), prompt, settings(max_new_tokens=8, presence_penalty=0.9))
    steps = [e for e in events if isinstance(e, BlockStep)]
    assert steps[0].committed_now[:3] == (True, False, False)
    assert steps[1].committed_now[1:3] == (False, True)  # Y, already in the block, is penalized: 0.93 < 0.95
    assert 0.9 < steps[1].confidence[1] < 0.95


def test_stop_inside_the_first_block_keeps_its_committed_text() -> None:
    """Before: Esc a few passes into a diffusion answer's first block gave an empty answer ("stopped", no text, no
    Continue) while the denoising view showed the committed tokens. The tokens committed from the block's start on
    are the answer so far: streamed as text, in Finished, and in a BlockCommitted for the recorder."""
    model = ScriptedModel(letters, margin=lambda p: 1.0)  # one slot per pass: many passes per block
    cancel = threading.Event()
    events: list = []
    prompt = [letters(p) for p in range(8)]
    shown: tuple[int, ...] = ()
    for event in generate(model, prompt, settings(max_new_tokens=64), LetterTokenizer(), cancel):
        events.append(event)
        if isinstance(event, BlockStep) and event.pass_index == 2:
            cancel.set()
            shown = event.tokens[event.prompt_slots:]
    done = finished(events)
    committed = [t for t in shown if t != MASK]
    assert done.stop_reason == "cancelled" and len(committed) == 3
    lead = list(itertools.takewhile(lambda t: t != MASK, shown))
    assert lead and done.token_ids == tuple(lead) and done.tokens == len(lead)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == done.text != ""
    (block,) = [e for e in events if isinstance(e, BlockCommitted)]
    assert block.token_ids == tuple(lead)


def test_without_a_plan_the_engine_holds_requests_to_the_context_it_was_loaded_with(tiny_clover_dir,
                                                                                    one_torch_thread) -> None:
    """Before: a load without a plan (system RAM) took up to max_position_embeddings (131,072) while the window's VRAM
    panel and the load said 16K: two context sizes."""
    engine = Engine.load(tiny_clover_dir, ctx_tokens=48)
    assert engine.ctx_limit == 48
    done = [e for e in engine.generate(prompt="hello there", params=GenerationParams(mode="ar", max_new_tokens=200))
            if isinstance(e, Finished)][-1]
    assert done.stop_reason == "context" and done.prompt_tokens + done.tokens <= 48
    assert Engine.load(tiny_clover_dir).ctx_limit == 0  # nothing asked: the model's own context


def test_a_plan_for_the_cpu_counts_the_cpu_cache_s_q6_k_head(tmp_path, one_torch_thread) -> None:  # type: ignore[no-untyped-def]
    """Rows of whole 256-value blocks: on the CPU the cache holds the head in Q6_K blocks (formats.policy_for), so a
    plan made for a CPU load counts those bytes and the load accepts it; a plan made for a GPU load counts the INT8
    head and a CPU load refuses it in one line."""
    from clover_desk.engine.errors import PlanError
    from clover_desk.engine.weights.tiny import make_tiny

    folder = make_tiny(tmp_path / "m", hidden=256, layers=2, experts=4, experts_per_tok=2)
    engine = Engine.load(folder, device="cpu", precision="nf4",
                         placement=plan_for(folder, 2 * GIB, 64, "float32", device="cpu"))
    assert engine.plan is not None and engine.plan.fits
    assert finished(list(engine.generate(prompt="hi", params=GenerationParams(max_new_tokens=2, mode="ar")))).tokens
    with pytest.raises(PlanError, match="another model or quantization"):
        Engine.load(folder, device="cpu", precision="nf4", placement=plan_for(folder, 2 * GIB, 64, "float32",
                                                                              device="cuda"))
