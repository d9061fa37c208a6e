"""The AR step as one call: ``CloverModel.static_step`` (position as a tensor, keys read to a fixed bucket, the
form a CUDA graph records) equals the ordinary step; it traces as one graph with no break; ``compile_layers``
routes AR steps through one whole-step graph on the CPU (same tokens as eager) and through CUDA graphs on a GPU
(``gpu``-marked: replays counted, tokens equal, no sync under ``set_sync_debug_mode("error")``)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from engine import step_graphs
from engine.fastpath import compile_layers
from engine.generate import DecodeSettings, generate_ar
from tests.helpers_model import CountingBackend, tiny_config, tiny_model

PROMPT = [5, 9, 17, 33, 65, 129, 7, 11, 13, 19, 23]


def _settings(cfg: Any, n: int) -> DecodeSettings:
    return DecodeSettings(mode="ar", max_new_tokens=n, block_size=cfg.block_size, threshold=cfg.threshold,
                          mask_token_id=256, eos_token_ids=(), max_positions=cfg.max_position_embeddings,
                          shift_logits=cfg.shift_logits)


def _tokens(model: Any, n: int) -> list[int]:
    *_, done = generate_ar(model, PROMPT, _settings(model.config, n))
    return list(done.token_ids)


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model(tiny_config(), seed=5)


def test_bucket_is_the_next_power_of_two_within_the_cache() -> None:
    assert [step_graphs.bucket(n, 4096) for n in (1, 256, 257, 700, 1024, 1025)] == [256, 256, 512, 1024, 1024, 2048]
    assert step_graphs.bucket(300, 320) == 320  # never past the cache
    for bad in (0, 321):
        with pytest.raises(ValueError, match="1..320"):
            step_graphs.bucket(bad, 320)


def test_static_steps_equal_the_ordinary_steps_and_write_the_same_cache(model: Any) -> None:
    ids = torch.tensor(PROMPT)
    ref = model.new_cache(64)
    model(ids, 0, ref, write_cache=True)
    mine = ref.clone()
    tok = torch.tensor([3])
    for pos in range(len(PROMPT), len(PROMPT) + 6):
        want = model(tok, pos, ref, write_cache=True, last_only=True)  # [1, V]
        kv_len = 32 if pos < 16 else 64  # a bucket past the position: the extra keys are masked
        got = model.static_step(model.embed(tok), torch.tensor([pos]), mine, kv_len)
        mine.length = pos + 1
        assert got.shape == want.shape
        assert (got - want).abs().max() < 1e-5, pos
        tok = want.argmax(-1)
        assert torch.equal(got.argmax(-1), tok)
    for a, b in zip(ref.tensors(), mine.tensors()):
        assert (a - b).abs().max() < 1e-6


def test_the_static_step_traces_as_one_graph(model: Any) -> None:
    cache = model.new_cache(64)
    model(torch.tensor(PROMPT), 0, cache, write_cache=True)
    h, pos = model.embed(torch.tensor([3])), torch.tensor([len(PROMPT)])
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model.static_step)(h, pos, cache.clone(), 32)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [str(b.reason)[:200] for b in explained.break_reasons]
    torch._dynamo.reset()
    # traced on the CPU, the one-query attention is written out with the mask (not SDPA's): the same logits
    compiled = torch.compile(model.static_step, backend="eager", fullgraph=True)
    want = model.static_step(h, pos, cache.clone(), 32)
    assert (compiled(h, pos, cache.clone(), 32) - want).abs().max() < 1e-5
    torch._dynamo.reset()


def test_compile_layers_runs_the_ar_step_as_one_graph_with_the_eager_tokens() -> None:
    model = tiny_model(tiny_config(), seed=7)
    eager = _tokens(model, 6)
    torch._dynamo.reset()
    backend = CountingBackend()
    compile_layers(model, backend=backend)
    assert step_graphs.capturable(model) is not None  # a CPU model: no CUDA graph, a compiled whole step
    steps: list[int] = []
    whole = model.step_graph
    assert whole is not None

    def counted(ids: torch.Tensor, *args: Any) -> torch.Tensor:
        steps.append(int(ids.shape[0]))
        return whole(ids, *args)

    model.step_graph = counted
    assert _tokens(model, 6) == eager
    assert steps == [1] * 5  # every AR step after the prefill went through the whole-step graph, nothing else did
    model.step_graph = whole
    torch._dynamo.reset()


def test_a_step_is_cut_around_its_streamed_layers() -> None:
    g, e = "graph", "eager"
    assert step_graphs.pieces_of(4, set()) == [(g, 0, 4)]
    assert step_graphs.pieces_of(4, {1}) == [(g, 0, 1), (e, 1, 2), (g, 2, 4)]
    assert step_graphs.pieces_of(4, {0, 3}) == [(e, 0, 1), (g, 1, 3), (e, 3, 4), (g, 4, 4)]  # the head on its own
    assert step_graphs.pieces_of(3, {0, 1, 2}) == [(e, 0, 1), (e, 1, 2), (e, 2, 3), (g, 3, 3)]


def _quantized(streamed: tuple[int, ...]) -> Any:
    from engine import offload
    from engine.quant import make_policy, quantize_model_

    model = tiny_model(tiny_config(), seed=5)
    quantize_model_(model, make_policy())
    resident = tuple(i for i in range(len(model.layers)) if i not in streamed)
    offload.apply_plan(model, offload.SimplePlan(resident, streamed, 2 * model.config.num_experts), "cpu")
    return model


@pytest.mark.parametrize("streamed", [(), (1,), (0, 3)])
def test_steps_run_in_pieces_through_static_buffers_decode_the_same_tokens(streamed: tuple[int, ...]) -> None:
    """The pieces run eagerly (``record=False``, the CPU) through the buffers a recording reads: the tokens of
    ordinary steps, across two key buckets (the 256-key graph and the cache's), with streamed layers fetching as
    they do in an ordinary step."""
    from engine import offload

    model = _quantized(streamed)
    want = _tokens(model, 260)  # positions 11..270: buckets 256 and the cache's 271
    runner = step_graphs.StepGraphs(model, record=False)
    assert [kind for kind, _, _ in runner.pieces].count("eager") == len(streamed)
    model.step_graph = runner
    looked = lambda: sum(offload.accounting(model).get(k, 0) for k in ("slot_hits", "slot_misses"))  # noqa: E731
    before = looked()
    try:
        assert _tokens(model, 260) == want
    finally:
        model.step_graph = None
    assert runner.replays == 259 and runner.failed is None and runner.recorded == 0
    if streamed:
        assert looked() >= before + 259 * len(streamed)  # each streamed layer looked its experts up in each step


def test_step_graphs_refuse_what_they_cannot_capture(model: Any) -> None:
    assert "CUDA device" in str(step_graphs.capturable(model))
    with pytest.raises(ValueError, match="CUDA device"):
        step_graphs.StepGraphs(model)


@pytest.mark.gpu
def test_cuda_graph_steps_decode_the_uncaptured_tokens_without_a_sync() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gpu = torch.device("cuda")
    cpu_model = tiny_model(tiny_config(), seed=9)
    ref = copy.deepcopy(cpu_model).to(gpu, torch.bfloat16)
    ref.dtype = torch.bfloat16
    want = _tokens(ref, 300)  # crosses the 256-key bucket: two graphs
    graphed = copy.deepcopy(ref)
    runner = step_graphs.StepGraphs(graphed)
    graphed.step_graph = runner
    assert _tokens(graphed, 300) == want
    assert runner.failed is None and runner.recorded == 2 and runner.replays == 299
    cache = graphed.new_cache(512)
    graphed(torch.tensor(PROMPT, device=gpu), 0, cache, write_cache=True)
    tok = torch.tensor([3], device=gpu)
    graphed(tok, len(PROMPT), cache, write_cache=True, last_only=True)  # records this cache's graph
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for pos in range(len(PROMPT) + 1, len(PROMPT) + 4):
            graphed(tok, pos, cache, write_cache=True, last_only=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_cuda_graph_pieces_around_streamed_layers_decode_the_uncaptured_tokens() -> None:
    """A model with streamed layers on a GPU: one graph per run of resident layers, the streamed layers eager
    between replays; the tokens of uncaptured steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("bitsandbytes")
    from engine import offload
    from engine.quant import make_policy, quantize_model_

    def placed() -> Any:
        model = tiny_model(tiny_config(), seed=5)
        quantize_model_(model, make_policy())
        offload.apply_plan(model, offload.SimplePlan((0, 2), (1, 3), model.config.num_experts), "cuda")
        return model

    want = _tokens(placed(), 300)
    graphed = placed()
    runner = step_graphs.StepGraphs(graphed)
    assert runner.pieces == [("graph", 0, 1), ("eager", 1, 2), ("graph", 2, 3), ("eager", 3, 4), ("graph", 4, 4)]
    graphed.step_graph = runner
    assert _tokens(graphed, 300) == want
    assert runner.failed is None and runner.recorded == 3 * 2 and runner.replays == 299  # 3 graphs, 2 buckets
