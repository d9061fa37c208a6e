"""A denoising pass computes the LM head only for the rows that still propose a masked slot (``head_rows``): the
rows it computes equal the full pass's, and the decoded tokens, logprobs and sampled choices are those of a loop
that computes every row."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures_tiny import one_torch_thread, tiny_clover_dir  # noqa: F401

from clover_desk.engine.api import Engine
from clover_desk.engine.decode.diffusion import head_rows
from clover_desk.engine.decode.events import BlockStep, Finished, GenerationParams, TokenLogprobs
from clover_desk.engine.weights.gguf.writer import write_gguf


@pytest.fixture(scope="module")
def clover(tiny_clover_dir, one_torch_thread):  # type: ignore[no-untyped-def]
    return Engine.load(tiny_clover_dir)


@pytest.fixture(scope="module")
def q8(tiny_clover_dir: Path, tmp_path_factory: pytest.TempPathFactory, one_torch_thread):  # type: ignore[no-untyped-def]
    """The tiny model as a Q8_0 GGUF: its head runs in the CPU kernels, which round and sum each row alone."""
    path = write_gguf(tiny_clover_dir, tmp_path_factory.mktemp("q8") / "tiny-Q8_0.gguf", "Q8_0", layout="fork")[0]
    return Engine.load(path)


class _Rows:
    """Counts the rows the LM head multiplies per call (a forward hook on it)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.rows: list[int] = []
        self._hook = model.lm_head.register_forward_hook(lambda _m, args, _out: self.rows.append(args[0].shape[0]))

    def close(self) -> None:
        self._hook.remove()


def _every_and_fewer(engine: Engine, params: GenerationParams,
                     logprobs: int | None) -> tuple[list[object], list[int], list[object], list[int]]:
    """(events, head rows per call) with every head row, then with fewer; after a warm-up run, so the prompt cache
    holds the prompt for both."""
    _events(engine, params, logprobs, rows_on=False)
    counter = _Rows(engine.model)
    try:
        every = _events(engine, params, logprobs, rows_on=False)
        rows_every = list(counter.rows)
        counter.rows.clear()
        fewer = _events(engine, params, logprobs, rows_on=True)
        return every, rows_every, fewer, list(counter.rows)
    finally:
        counter.close()


def _events(engine: Engine, params: GenerationParams, logprobs: int | None, rows_on: bool) -> list[object]:
    model = engine.model
    model.computes_head_rows = rows_on  # the instance's answer hides the class's
    try:
        return list(engine.generate(prompt="Write a haiku about the sea.", params=params, logprobs=logprobs))
    finally:
        del model.computes_head_rows


def test_the_rows_are_those_of_masked_slots_shifted_where_the_model_predicts_the_next_token() -> None:
    class Model:
        computes_head_rows = True

    still = [False, True, False, True, True]
    assert head_rows(Model(), still, shift=False) == [1, 3, 4]
    assert head_rows(Model(), still, shift=True) == [0, 2, 3]  # slot j from row j - 1
    assert head_rows(Model(), [True, False, True], shift=True) == [1]  # slot 0 takes the row before the block
    assert head_rows(Model(), [True, True, True], shift=False) is None  # every row: one full pass
    assert head_rows(object(), still, shift=False) is None  # a model that does not say it takes them


@pytest.mark.parametrize("which", ["plain", "q8"])
def test_head_rows_equal_the_full_pass_rows(clover: Engine, q8: Engine, which: str) -> None:
    model = (clover if which == "plain" else q8).model
    cfg = model.config
    B = 8
    cache = model.new_cache(2 * B)
    ids = torch.arange(20, 20 + B)
    with torch.no_grad():
        model.forward(ids, 0, cache, block_size=B)  # one committed block
        block = torch.tensor([30, 31, cfg.mask_token_id, 33, cfg.mask_token_id, cfg.mask_token_id, 36, 37])
        full = model.forward(block, B, cache, block_size=B, write_cache=False)  # [B, V]
        rows = torch.tensor([1, 4, 5])
        part = model.forward(block, B, cache, block_size=B, write_cache=False, head_rows=rows)  # [3, V]
    assert part.shape == (3, cfg.vocab_size)
    if which == "q8":  # the C kernel rounds and sums each activation row alone: the same bits
        assert torch.equal(part, full[rows])
    else:  # a BLAS product of fewer rows may sum in another order
        torch.testing.assert_close(part, full[rows], rtol=1e-5, atol=1e-5)


def test_bad_head_rows_are_refused(clover: Engine) -> None:
    model = clover.model
    ids = torch.arange(20, 28)
    with pytest.raises(ValueError, match="lie in 0..7"):
        model.forward(ids, 0, None, block_size=8, head_rows=torch.tensor([8]))
    with pytest.raises(ValueError, match="exclude each other"):
        model.forward(ids, 0, None, block_size=8, head_rows=torch.tensor([1]), last_only=True)
    with pytest.raises(ValueError, match="1-D long"):
        model.forward(ids, 0, None, block_size=8, head_rows=torch.tensor([1.0]))


@pytest.mark.parametrize("which", ["plain", "q8"])
@pytest.mark.parametrize(("params", "logprobs"), [
    (GenerationParams(max_new_tokens=24, block_size=8, threshold=0.5), 2),
    (GenerationParams(max_new_tokens=24, block_size=8, threshold=0.3, do_sample=True, temperature=0.9, seed=7), None),
], ids=["greedy-logprobs", "sampled"])
def test_diffusion_decodes_the_same_with_fewer_head_rows(clover: Engine, q8: Engine, which: str,
                                                         params: GenerationParams, logprobs: int | None) -> None:
    engine = clover if which == "plain" else q8
    every, rows_every, fewer, rows_fewer = _every_and_fewer(engine, params, logprobs)
    done_fewer, done_every = fewer[-1], every[-1]
    assert isinstance(done_fewer, Finished) and isinstance(done_every, Finished)
    assert done_fewer.token_ids == done_every.token_ids and done_fewer.passes == done_every.passes
    steps = [(e.tokens, e.masked, e.committed_now) for e in fewer if isinstance(e, BlockStep)]
    assert steps == [(e.tokens, e.masked, e.committed_now) for e in every if isinstance(e, BlockStep)]
    if logprobs:
        lp = [e for e in fewer if isinstance(e, TokenLogprobs)]
        lp_every = [e for e in every if isinstance(e, TokenLogprobs)]
        assert lp and [(e.token_ids, e.top_ids) for e in lp] == [(e.token_ids, e.top_ids) for e in lp_every]
        if which == "q8":  # the same bits
            assert lp == lp_every
        else:  # the same up to the BLAS product's summation order over fewer rows
            got = torch.tensor([v for e in lp for v in (*e.logprobs, *e.top_logprobs)])
            want = torch.tensor([v for e in lp_every for v in (*e.logprobs, *e.top_logprobs)])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the saving is real: the same head calls (commit passes, one row each, included), a block's later denoising
    # passes with fewer rows
    assert len(rows_fewer) == len(rows_every) and sum(rows_fewer) < sum(rows_every)
    assert all(f <= e for f, e in zip(rows_fewer, rows_every))


def test_spec_drafts_the_same_with_fewer_head_rows(clover: Engine) -> None:
    """Self-speculative decoding drafts by denoising passes too: the same tokens and passes, fewer head rows."""
    params = GenerationParams(mode="spec", max_new_tokens=16, block_size=8, threshold=0.5)
    every, rows_every, fewer, rows_fewer = _every_and_fewer(clover, params, None)
    assert isinstance(every[-1], Finished) and isinstance(fewer[-1], Finished)
    assert fewer[-1].token_ids == every[-1].token_ids and fewer[-1].passes == every[-1].passes
    steps = [(e.tokens, e.masked) for e in fewer if isinstance(e, BlockStep)]
    assert steps and steps == [(e.tokens, e.masked) for e in every if isinstance(e, BlockStep)]
    assert len(rows_fewer) == len(rows_every) and sum(rows_fewer) < sum(rows_every)
