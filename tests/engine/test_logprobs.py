"""Log probabilities from the engine (``Engine.generate(logprobs=N)``, :class:`engine.decode.events.TokenLogprobs`).

Each value is checked against an independent recomputation: AR and spec against one plain causal forward of the
tiny model over prompt + answer (the row before each token), diffusion against the recorded logits of the pass that
committed the token. The tiny model's defaults have penalties, so the distribution reported (the model's own, raw
logits) differs from the penalized one the token was picked from: the checks tell them apart.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fixtures_tiny import one_torch_thread, tiny_clover_dir  # noqa: F401
from test_spec import OracleDrafter

from clover_desk.engine.api import MAX_TOP_LOGPROBS, Engine
from clover_desk.engine.decode import decoding
from clover_desk.engine.decode.events import (
    BlockStep,
    Finished,
    GenerationParams,
    TextDelta,
    TokenLogprobs,
    from_dict,
    to_dict,
)
from clover_desk.engine.decode.generate import generate, generate_spec
from clover_desk.engine.decode.settings import DecodeSettings, resolve_settings
from clover_desk.engine.errors import PromptError

PROMPT = "Write a haiku about the sea."
TOL = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_clover_dir, one_torch_thread) -> Engine:  # noqa: ANN001, F811
    return Engine.load(tiny_clover_dir)


def _settings(engine: Engine, mode: str, n: int, top: int | None, **kw: Any) -> DecodeSettings:
    params = GenerationParams(mode=mode, max_new_tokens=n, **kw)
    s = resolve_settings(params, engine.generation_defaults, engine.config, engine.tokenizer)
    return DecodeSettings(**{**s.__dict__, "logprobs": top})


def _split(events: list[Any]) -> tuple[list[TokenLogprobs], Finished]:
    assert isinstance(events[-1], Finished)
    return [e for e in events if isinstance(e, TokenLogprobs)], events[-1]


def _flat(lps: list[TokenLogprobs]) -> tuple[list[int], list[float], list[list[tuple[int, float]]], list[str]]:
    ids, values, tops, channels = [], [], [], []
    for e in lps:
        assert len(e.token_ids) == len(e.logprobs) == len(e.channels)
        assert len(e.top_ids) == len(e.top_logprobs) == e.top * len(e.token_ids)
        ids += e.token_ids
        values += e.logprobs
        tops += [e.alternatives(i) for i in range(len(e.token_ids))]
        channels += e.channels
    return ids, values, tops, channels


def _causal_rows(engine: Engine, ids: list[int]) -> torch.Tensor:
    """log_softmax of one plain causal forward over ``ids`` (no prompt cache, no decoding loop): [len(ids), V]."""
    model = engine.model
    with torch.no_grad():
        logits = model.forward(torch.tensor(ids), 0, model.new_cache(len(ids)), block_size=None, write_cache=True)
    return torch.log_softmax(logits.float(), dim=-1)


def _check_against_rows(rows: torch.Tensor, prompt_len: int, ids: list[int], values: list[float],
                        tops: list[list[tuple[int, float]]], top: int) -> None:
    for i, (tok, value, alternatives) in enumerate(zip(ids, values, tops)):
        row = rows[prompt_len - 1 + i]  # the row before token i chose it
        assert value == pytest.approx(float(row[tok]), abs=TOL), i
        assert len(alternatives) == top
        best = torch.topk(row, top)
        assert [v for _, v in alternatives] == pytest.approx(best.values.tolist(), abs=TOL)
        assert [v for _, v in alternatives] == sorted((v for _, v in alternatives), reverse=True)
        for alt_id, alt_value in alternatives:
            assert alt_value == pytest.approx(float(row[alt_id]), abs=TOL)
        if top and value > alternatives[-1][1] + TOL:  # the chosen token is among the best: it is listed
            assert tok in [a for a, _ in alternatives], i


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_ar_logprobs_are_the_model_s_own_distribution(engine: Engine, sample: bool) -> None:
    """AR: each token's value is log_softmax of the raw causal row before it (not the penalized, not the
    temperature-scaled one); the answer's summed log probability is the plain forward's."""
    prompt = engine.prompt_ids(prompt=PROMPT)
    kw = {"temperature": 0.7, "seed": 3} if sample else {"temperature": 0.0}
    s = _settings(engine, "ar", 24, 5, **kw)
    lps, done = _split(list(generate(engine.model, prompt, s, engine.tokenizer)))
    ids, values, tops, channels = _flat(lps)
    assert tuple(ids) == done.token_ids and len(lps) == done.tokens  # one event per token, every token
    rows = _causal_rows(engine, prompt + ids)
    _check_against_rows(rows, len(prompt), ids, values, tops, 5)
    total = sum(float(rows[len(prompt) - 1 + i, t]) for i, t in enumerate(ids))
    assert sum(values) == pytest.approx(total, abs=1e-3)
    assert all(c in ("thinking", "answer", "marker", "eos") for c in channels)
    # the penalties changed what was picked somewhere: the raw distribution is not the one sampled from
    penalized = [i for i, (t, alts) in enumerate(zip(ids, tops)) if alts[0][0] != t]
    assert penalized or sample


def test_spec_logprobs_equal_ar_s(engine: Engine) -> None:
    """Spec mode reports the verify pass's causal rows: the same values as AR greedy and the plain forward, over
    accepted drafts, the verifier's own tokens, rollbacks and catch-ups."""
    prompt = engine.prompt_ids(prompt=PROMPT)
    mask, vocab = engine.tokenizer.mask_token_id, engine.config.vocab_size
    for block, wrong in ((8, 0.0), (8, 0.3), (5, 0.2)):
        s = _settings(engine, "spec", 30, 3, temperature=0.0, block_size=block)
        ar_lps, ar_done = _split(list(generate(engine.model, prompt, DecodeSettings(**{**s.__dict__, "mode": "ar"}))))
        drafter = OracleDrafter(ar_done.token_ids, len(prompt), wrong, block, vocab, mask)
        lps, done = _split(list(generate_spec(engine.model, prompt, s, engine.tokenizer, drafter=drafter)))
        assert done.token_ids == ar_done.token_ids
        ids, values, tops, _ = _flat(lps)
        _, ar_values, ar_tops, _ = _flat(ar_lps)
        assert tuple(ids) == done.token_ids
        assert values == pytest.approx(ar_values, abs=TOL)
        assert [[a for a, _ in t] for t in tops] == [[a for a, _ in t] for t in ar_tops]
        _check_against_rows(_causal_rows(engine, prompt + ids), len(prompt), ids, values, tops, 3)
    # the denoising drafter too (no injected drafts)
    s = _settings(engine, "spec", 20, 0, temperature=0.0, block_size=8)
    lps, done = _split(list(generate_spec(engine.model, prompt, s, engine.tokenizer)))
    ids, values, tops, _ = _flat(lps)
    assert tuple(ids) == done.token_ids and tops == [[]] * len(ids)
    _check_against_rows(_causal_rows(engine, prompt + ids), len(prompt), ids, values, tops, 0)


class _Recording:
    """The model, with every forward's arguments and output kept (the engine-level hook of the diffusion check)."""

    computes_head_rows = False  # every pass's every row recorded (test_head_rows: fewer rows give the same values)

    def __init__(self, model: Any) -> None:
        self._model = model
        self.calls: list[tuple[dict[str, Any], torch.Tensor]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def forward(self, ids: torch.Tensor, start_pos: int, cache: Any, block_size: int | None = None,
                write_cache: bool = True, last_only: bool = False, **kw: Any) -> torch.Tensor:
        out = self._model.forward(ids, start_pos, cache, block_size=block_size, write_cache=write_cache,
                                  last_only=last_only, **kw)
        self.calls.append(({"write_cache": write_cache}, out.detach().clone()))
        return out


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_diffusion_logprobs_are_the_committing_pass_s(engine: Engine, sample: bool) -> None:
    """Diffusion: each token's value is log_softmax of its slot's (shifted) raw logits at the pass that committed
    it, recomputed from the recorded forwards; it lies in [log(1/V), 0] when greedy."""
    prompt = engine.prompt_ids(prompt=PROMPT)
    kw = {"temperature": 0.9, "seed": 5} if sample else {"temperature": 0.0}
    s = _settings(engine, "diffusion", 40, 4, block_size=8, **kw)
    model = _Recording(engine.model)
    events = list(generate(model, prompt, s, engine.tokenizer))  # type: ignore[arg-type]
    lps, done = _split(events)
    ids, values, tops, _ = _flat(lps)
    assert tuple(ids) == done.token_ids
    steps = [e for e in events if isinstance(e, BlockStep)]
    denoise = [i for i, (kw_, _) in enumerate(model.calls) if not kw_["write_cache"]]
    assert len(denoise) == len(steps)
    committed: dict[int, tuple[float, list[float]]] = {}  # output position -> (value, top values) when committed
    for step, call in zip(steps, denoise):
        prev = next(out for kw_, out in reversed(model.calls[:call]) if kw_["write_cache"])[-1]
        logits = model.calls[call][1].float()
        if s.shift_logits:
            logits = decoding.shift_logits(logits, prev)
        lp = torch.log_softmax(logits, dim=-1)
        for slot in range(step.prompt_slots, len(step.tokens)):
            position = step.block_index * 8 + slot - len(prompt)
            if step.committed_now[slot] and position < len(ids):
                assert position not in committed  # a slot commits once
                committed[position] = (float(lp[slot, step.tokens[slot]]), torch.topk(lp[slot], 4).values.tolist())
    expected = [committed[i] for i in range(len(ids))]
    assert len(expected) == len(values)
    log_v = -torch.log(torch.tensor(float(engine.config.vocab_size))).item()
    for value, alternatives, (want_value, want_top) in zip(values, tops, expected):
        assert value == pytest.approx(want_value, abs=TOL)
        assert [v for _, v in alternatives] == pytest.approx(want_top, abs=TOL)
        assert value <= 0.0
        if not sample:
            assert value >= log_v - TOL  # greedy picks a token at least as likely as the flat distribution


def test_no_logprobs_unless_asked_and_the_event_round_trips(engine: Engine) -> None:
    prompt = engine.prompt_ids(prompt=PROMPT)
    for mode in ("ar", "diffusion", "spec"):
        events = list(generate(engine.model, prompt, _settings(engine, mode, 12, None, temperature=0.0),
                               engine.tokenizer))
        assert not any(isinstance(e, TokenLogprobs) for e in events), mode
        assert any(isinstance(e, TextDelta) for e in events) or events[-1].tokens
    events = list(engine.generate(prompt_ids=prompt, params=GenerationParams(mode="ar", max_new_tokens=3),
                                  logprobs=2))
    event = next(e for e in events if isinstance(e, TokenLogprobs))
    assert from_dict(to_dict(event)) == event
    for bad in (-1, MAX_TOP_LOGPROBS + 1, True, 1.5):
        with pytest.raises(PromptError, match="logprobs must be a whole number from 0 to 20"):
            engine.generate(prompt_ids=prompt, logprobs=bad)  # type: ignore[arg-type]
