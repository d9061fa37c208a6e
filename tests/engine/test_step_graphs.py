"""The AR step and the block passes as one call: ``CloverModel.static_step`` / ``static_pass`` (position as a
tensor, keys read to a fixed bucket, the form a CUDA graph records) equal the ordinary passes and trace as one
graph with no break; passes are cut around the experts that read the host; ``compile_layers`` routes AR steps
through one whole-step graph on the CPU (same tokens as eager) and AR steps and block passes through CUDA graphs on
a GPU (``gpu``-marked: replays counted, tokens equal, no sync under ``set_sync_debug_mode("error")``)."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch

from clover_desk.engine.decode.generate import generate_ar, generate_diffusion
from clover_desk.engine.decode.settings import DecodeSettings
from clover_desk.engine.kernels import step_graphs, triton_moe
from clover_desk.engine.kernels.fastpath import compile_layers
from tests.helpers_model import CountingBackend, tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("cpu_kernels_off")

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


def _static_block(model: Any, ids: torch.Tensor, pos: int, cache: Any, kv_len: int, write: bool) -> torch.Tensor:
    """A block pass the way a recorded one runs: the static pass and every layer, then the head."""
    b = model.config.block_size
    p = model.static_pass(torch.tensor([pos]), cache, kv_len, b, b, write)
    out = model.head(model.static_layers(model.embed(ids), p, cache, 0, len(model.layers)))
    if write:
        cache.length = pos + b
    return out


@pytest.mark.parametrize("coreset", [False, True])
def test_static_block_passes_equal_the_ordinary_ones(coreset: bool) -> None:
    """A denoising pass (the cache left bit for bit as it was, its free slots used as scratch) and a commit pass
    (the cache written as the ordinary pass writes it), with the keys read to a bucket past the block."""
    model = tiny_model(tiny_config(moe_block_coreset_enabled=coreset), seed=5)
    b = model.config.block_size
    ids = torch.tensor((PROMPT * 2)[: 2 * b])
    ref = model.new_cache(64)
    model(ids[:b], 0, ref, block_size=b, write_cache=True)
    mine = ref.clone()
    mine.key[1][:, b:].normal_()  # the free slots hold something else: a pass must put it back
    before = mine.clone()
    block = ids[b:]
    want = model(block, b, ref, block_size=b, write_cache=False)  # [B, V]
    got = _static_block(model, block, b, mine, 32, write=False)
    assert got.shape == want.shape and (got - want).abs().max() < 1e-5
    assert all(torch.equal(x, y) for x, y in zip(mine.tensors(), before.tensors()))
    want = model(block, b, ref, block_size=b, write_cache=True, last_only=True)  # [1, V]
    got = _static_block(model, block, b, mine, 32, write=True)[-1:]
    assert (got - want).abs().max() < 1e-5 and mine.length == ref.length == 2 * b
    for name in ("key", "value", "conv", "state"):
        for x, y in zip(getattr(ref, name), getattr(mine, name)):
            if x is not None:  # K/V: the committed slots (past them, the scratch each way used)
                x, y = (x[:, : 2 * b], y[:, : 2 * b]) if name in ("key", "value") else (x, y)
                assert (x - y).abs().max() < 1e-5, name


def test_the_static_block_pass_traces_as_one_graph() -> None:
    """No host read in a whole block: traced (the dense bank then gathers one expert per pair), one graph."""
    model = tiny_model(tiny_config(moe_block_coreset_enabled=True), seed=5)
    b = model.config.block_size
    cache = model.new_cache(64)
    model(torch.tensor(PROMPT[:b]), 0, cache, block_size=b, write_cache=True)
    h = model.embed(torch.tensor(PROMPT[:b]))

    def denoise(h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        p = model.static_pass(pos, cache, 32, b, b, False)
        return model.head(model.static_layers(h, p, cache, 0, len(model.layers)))

    torch._dynamo.reset()
    explained = torch._dynamo.explain(denoise)(h, torch.tensor([b]))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [str(r.reason)[:200] for r in explained.break_reasons]
    torch._dynamo.reset()


def _diffusion(model: Any, n: int) -> tuple[list[int], int]:
    """(tokens, forward passes) of a diffusion run."""
    s = DecodeSettings(mode="diffusion", max_new_tokens=n, block_size=model.config.block_size, threshold=0.9,
                       mask_token_id=256, eos_token_ids=(), max_positions=model.config.max_position_embeddings,
                       shift_logits=model.config.shift_logits)
    *_, done = generate_diffusion(model, PROMPT, s)
    return list(done.token_ids), done.passes


@pytest.mark.parametrize("streamed, cut", [
    ((), None), ((1,), None), ((0, 3), None), ((), {}), ((2,), {0: "bank", 2: "bank"}), ((1, 2), {1: "fetch", 2: "fetch"}),
])
def test_block_passes_run_in_pieces_through_static_buffers_decode_the_same_tokens(
    streamed: tuple[int, ...], cut: dict[int, str] | None
) -> None:
    """Diffusion through the pieces (run eagerly, ``record=False``): the tokens of ordinary passes, every
    denoising and commit pass served by the pieces, with the cut the banks ask for (None: on the CPU every
    quantized bank reads the host over a block) or a given one: whole layers in the block pieces, or streamed layers
    whose fetch runs eagerly and whose compute reads the slot table inside a piece (the cut the fused kernel
    gets on a GPU)."""
    model = _quantized(streamed)
    model.config = model.config.with_overrides(moe_block_coreset_enabled=True)
    for layer in model.layers:
        layer.mlp.config = model.config
    want, passes = _diffusion(model, 20)
    runner = step_graphs.StepGraphs(model, record=False, cut=cut)
    expected = {i: "bank" for i in range(4)} if cut is None else cut
    assert {s[1]: s[0] for kind, stages in runner.pieces_for(8) if kind == "eager" for s in stages} == expected
    model.pass_graph = runner
    try:
        got, got_passes = _diffusion(model, 20)
    finally:
        model.pass_graph = None
    assert got == want and got_passes == passes
    assert runner.pass_replays == passes and runner.failed is None  # (the prompt's prefill is not a decode pass)
    if streamed:  # every fetched expert went back to the pool once its compute was issued
        from clover_desk.engine.placement import offload_runtime

        rt = offload_runtime.runtime_of(model)
        assert rt is not None and rt.pool is not None and not rt.pool.in_use
    if cut == {0: "bank", 2: "bank"}:  # what bench speed --compile prints of it
        from clover_desk.bench.timing import _step_graph_line

        model.step_graph = runner
        assert _step_graph_line(model).startswith(
            "CUDA graphs (engine.kernels.step_graphs): an AR step is 3 graph(s) around 0 streamed fetch(es) and 2 eager expert "
            f"bank(s), a 8-slot pass the same; 0 recorded, 0 AR steps and {passes} block passes")


def test_a_pass_is_cut_around_what_reads_the_host() -> None:
    g, e = "graph", "eager"
    L, F, B, A, H, X, C = (
        lambda i, part=part: (part, i) for part in ("layer", "front", "bank", "back", "head", "fetch", "compute")
    )
    assert step_graphs.pieces_of(4, {}) == [(g, (L(0), L(1), L(2), L(3), H(4)))]
    assert step_graphs.pieces_of(4, {1: "bank"}) == [(g, (L(0), F(1))), (e, (B(1),)), (g, (A(1), L(2), L(3), H(4)))]
    assert step_graphs.pieces_of(2, {0: "bank", 1: "bank"}) == [  # the mixers, routers and shared experts stay in graphs
        (g, (F(0),)), (e, (B(0),)), (g, (A(0), F(1))), (e, (B(1),)), (g, (A(1), H(2)))
    ]
    assert step_graphs.pieces_of(3, {1: "fetch"}) == [  # a streamed bank: only its fetch is eager
        (g, (L(0), F(1))), (e, (X(1),)), (g, (C(1), A(1), L(2), H(3)))
    ]
    with pytest.raises(ValueError, match="allowed 'bank', 'fetch'"):
        step_graphs.pieces_of(2, {0: "stream"})


def test_the_banks_that_read_the_host_are_cut_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense experts: an AR step's 4 pairs gather one expert each (no read); a block's 32 pairs are grouped on the
    host on the CPU. Streamed banks fetch on the host at any size. A quantized NF4 bank is sync-free over a block
    only with the fused kernel on a GPU."""
    from clover_desk.engine.weights.quant import QuantExpertBank

    dense = tiny_model(tiny_config(), seed=5)
    assert step_graphs.cuts(dense, 1) == {}
    assert step_graphs.cuts(dense, 8) == dict.fromkeys(range(4), "bank")
    placed = _quantized((1, 2))
    assert step_graphs.cuts(placed, 1) == {1: "fetch", 2: "fetch"}  # an AR step's 4 pairs: only the fetch is eager
    assert step_graphs.cuts(placed, 8) == dict.fromkeys(range(4), "bank")
    streamed = placed.layers[1].mlp.experts
    assert not streamed.compute_sync_free(32, torch.device("cuda"), torch.bfloat16)
    nf4 = placed.layers[0].mlp.experts
    assert isinstance(nf4, QuantExpertBank) and nf4.layout.fmt == "nf4"
    gpu = torch.device("cuda")
    monkeypatch.setattr(triton_moe, "_enabled", False)
    assert not nf4.sync_free(256, gpu, torch.bfloat16)
    monkeypatch.setattr(triton_moe, "_enabled", True)  # GpuPaths.fused_moe (engine.kernels.switches.use)
    assert nf4.sync_free(256, gpu, torch.bfloat16)  # (the kernels' own tests: tests/engine/test_triton_moe.py)
    assert streamed.compute_sync_free(256, gpu, torch.bfloat16)
    assert not nf4.sync_free(256, torch.device("cpu"), torch.float32) and nf4.sync_free(8, gpu, torch.bfloat16)


def _quantized(streamed: tuple[int, ...], device: str = "cpu", pool_layers: int = 2, **apply: Any) -> Any:
    """The tiny model (seed 5) with NF4 experts, ``streamed`` layers' experts streamed through a pool of
    ``pool_layers`` layers' worth of slots, placed on ``device`` (``apply``: placer.apply_plan's switches)."""
    from clover_desk.engine.placement import placer
    from clover_desk.engine.weights.quant import make_policy, quantize_model_

    model = tiny_model(tiny_config(), seed=5)
    quantize_model_(model, make_policy())
    resident = tuple(i for i in range(len(model.layers)) if i not in streamed)
    placer.apply_plan(model, placer.SimplePlan(resident, streamed, pool_layers * model.config.num_experts), device,
                      **apply)
    return model


def _replays_decode(graphed: Any, runner: step_graphs.StepGraphs, want: list[int], recorded: int) -> None:
    """``graphed``, stepping through ``runner``'s CUDA graphs, decodes ``want`` (300 tokens): ``recorded`` graphs
    recorded, every later step replayed, none failed."""
    graphed.step_graph = runner
    assert _tokens(graphed, 300) == want
    assert runner.failed is None and runner.recorded == recorded and runner.replays == 299


@pytest.mark.parametrize("streamed", [(), (1,), (0, 3)])
def test_steps_run_in_pieces_through_static_buffers_decode_the_same_tokens(streamed: tuple[int, ...]) -> None:
    """The pieces run eagerly (``record=False``, the CPU) through the buffers a recording reads: the tokens of
    ordinary steps, across two key buckets (the 256-key graph and the cache's), with streamed layers fetching as
    they do in an ordinary step."""
    from clover_desk.engine.placement import offload_runtime

    model = _quantized(streamed)
    want = _tokens(model, 260)  # positions 11..270: buckets 256 and the cache's 271
    runner = step_graphs.StepGraphs(model, record=False)
    assert [kind for kind, _ in runner.pieces].count("eager") == len(streamed)
    model.step_graph = runner
    looked = lambda: sum(offload_runtime.accounting(model).get(k, 0) for k in ("slot_hits", "slot_misses"))  # noqa: E731
    before = looked()
    try:
        assert _tokens(model, 260) == want
    finally:
        model.step_graph = None
    assert runner.replays == 259 and runner.failed is None and runner.recorded == 0
    if streamed:
        assert looked() >= before + 259 * len(streamed)  # each streamed layer looked its experts up in each step
        rt = offload_runtime.runtime_of(model)
        assert rt is not None and rt.pool is not None and not rt.pool.in_use  # and gave them back


def test_zero_copy_ar_steps_are_one_piece_and_decode_the_same_tokens() -> None:
    """With zero-copy reads an AR step has nothing to cut (its streamed layers read their experts in place), so it
    is one graph; a block pass is still cut at every bank. Run through the pieces: the tokens of ordinary steps,
    and no streamed layer looks its experts up in the pool."""
    from clover_desk.engine.placement import offload_runtime, placer

    model = _quantized((1, 2))
    want = _tokens(model, 40)
    runner = step_graphs.StepGraphs(model, record=False)
    assert [kind for kind, _ in runner.pieces].count("eager") == 2
    model.step_graph = runner
    placer.set_zero_copy(model, True)  # drops how the passes were cut
    assert step_graphs.cuts(model, 1) == {} and runner.pieces == step_graphs.pieces_of(4, {})
    assert step_graphs.cuts(model, 8) == dict.fromkeys(range(4), "bank")
    assert step_graphs.streamed_layers(model) == [1, 2] and step_graphs.streamed_layers(model, pairs=4) == []
    looked = lambda: sum(offload_runtime.accounting(model)[k] for k in ("slot_hits", "slot_misses"))  # noqa: E731
    offload_runtime.runtime_of(model).reset_stats()
    try:
        *_, done = generate_ar(model, PROMPT, _settings(model.config, 40))
        prompt_only = looked()
        assert list(done.token_ids) == want
        assert _tokens(model, 40) == want
    finally:
        model.step_graph = None
    assert runner.replays == 2 * 39 and runner.failed is None
    assert 0 < looked() == 2 * prompt_only  # only the two prompts' forwards went through the pool


def test_compiled_layers_run_in_the_pieces_as_on_a_gpu() -> None:
    """What compile_layers sets up on a GPU, short of recording: compiled layers inside the pieces of AR steps and
    block passes (the static passes traced: positions, masks, scratch K/V put back), with a streamed layer cut at
    its fetch in AR steps and at its bank in block passes; the eager tokens of both modes."""
    model = _quantized((2,))
    model.config = model.config.with_overrides(moe_block_coreset_enabled=True)
    for layer in model.layers:
        layer.mlp.config = model.config
    want_ar, want_dd = _tokens(model, 6), _diffusion(model, 12)
    torch._dynamo.reset()
    backend = CountingBackend()
    compile_layers(model, backend=backend, whole_step=False)
    runner = step_graphs.StepGraphs(model, record=False)
    model.step_graph = model.pass_graph = runner
    try:
        assert (_tokens(model, 6), _diffusion(model, 12)) == (want_ar, want_dd)
    finally:
        model.step_graph = model.pass_graph = None
        torch._dynamo.reset()
    assert backend.graphs > 0 and runner.replays == 5 and runner.pass_replays == want_dd[1]
    assert [kind for kind, _ in runner.pieces_for(1)].count("eager") == 1


def test_requests_reuse_the_cache_and_the_passes_recorded_for_it(model: Any) -> None:
    """Replaying graphs, the model hands each request the one cache it keeps, emptied (so the graphs recorded for
    it serve the next request too); a longer request gets a longer cache. Tokens as with fresh caches."""
    want_ar, want_dd = _tokens(model, 6), _diffusion(model, 12)
    assert model.new_cache(40) is not model.new_cache(40)  # (not replaying: a fresh cache per request)
    runner = step_graphs.StepGraphs(model, record=False)
    model.step_graph = model.pass_graph = runner
    built: list[Any] = []
    make = runner._make
    runner._make = lambda cache, key: built.append(key) or make(cache, key)  # type: ignore[method-assign]
    try:
        first = model.new_cache(40)
        assert first.max_len == 256
        for _ in range(2):
            assert (_tokens(model, 6), _diffusion(model, 12)) == (want_ar, want_dd)
        assert len(built) == 3  # the AR step, the denoising and the commit pass: recorded once for both requests
        assert model.new_cache(200) is first and first.length == 0
        assert all(not t.any() for t in first.tensors())  # emptied
        longer = model.new_cache(300)
        assert longer is not first and longer.max_len == 512  # a multiple of 256: never far past what was asked
        assert not runner._steps  # the shorter cache's graphs went with it
    finally:
        model.step_graph = model.pass_graph = None
        model._kept_cache = None


def test_a_recording_that_fails_leaves_the_passes_uncaptured(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a recording raises (here: no CUDA streams on this machine, as a kernel library's own error would),
    the reason is kept, the cache is as it was, and every pass runs uncaptured with the ordinary tokens."""
    want_ar, want_dd = _tokens(model, 6), _diffusion(model, 12)
    runner = step_graphs.StepGraphs(model, record=False)
    runner.record = True  # records as on a GPU: it fails at the first side stream

    def no_stream(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("no CUDA stream here")

    monkeypatch.setattr(torch.cuda, "Stream", no_stream)
    model.step_graph = model.pass_graph = runner
    try:
        assert (_tokens(model, 6), _diffusion(model, 12)) == (want_ar, want_dd)
    finally:
        model.step_graph = model.pass_graph = None
        model._kept_cache = None
    assert runner.failed is not None and "no CUDA stream here" in runner.failed
    assert runner.replays == runner.pass_replays == runner.recorded == 0


def test_the_warm_up_before_a_recording_is_not_counted_as_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recording first runs the pass twice eagerly. Those runs are not the request's passes: the streaming
    accounting (passes, passes per block, and the block's pass number that decides prefetching) is that of an
    uncaptured run. Here on the CPU, CUDA's streams are stand-ins and the capture itself fails, after the warm-up."""
    from clover_desk.engine.placement import offload_runtime

    want_tokens, _ = _diffusion(_quantized((1,)), 20)
    model = _quantized((1,))
    plain = offload_runtime.accounting(model)
    _diffusion(model, 20)
    want = {k: v for k, v in offload_runtime.accounting(model).items() if k in ("passes", "passes_per_block")}
    assert plain["passes"] == 0 < want["passes"]

    class Stream:
        def wait_stream(self, other: Any) -> None:
            pass

    def no_capture(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no capture on the CPU")

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", no_capture)
    model = _quantized((1,))
    runner = step_graphs.StepGraphs(model, record=False)
    runner.record = True
    model.pass_graph = runner
    warm: list[int] = []
    run = step_graphs._Step.run
    monkeypatch.setattr(step_graphs._Step, "run", lambda self, eager=False: warm.append(eager) or run(self, eager))
    tokens, _ = _diffusion(model, 20)
    assert runner.failed is not None and "no capture on the CPU" in runner.failed and warm == [True, True]
    got = {k: v for k, v in offload_runtime.accounting(model).items() if k in ("passes", "passes_per_block")}
    assert tokens == want_tokens and got == want


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
    _replays_decode(graphed, step_graphs.StepGraphs(graphed), want, recorded=2)
    _steps_never_sync(graphed)


@pytest.mark.gpu
def test_cuda_graph_steps_go_on_from_the_prompt_cache_replaying_their_graphs() -> None:
    """A chat's next turn on a model whose steps replay CUDA graphs: it starts from what the last turn read (the
    model's one cache, engine.decode.prompt_cache.PromptCache) and replays the graphs recorded for it, recording none, and so
    does a turn that goes back to a checkpoint; the tokens and cached lengths of an uncaptured model with its own
    prompt cache (the same prefill splits)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from clover_desk.engine.decode.events import PromptInfo
    from clover_desk.engine.decode.prompt_cache import PromptCache

    gpu = torch.device("cuda")
    ref = tiny_model(tiny_config(), seed=9).to(gpu, torch.bfloat16)
    ref.dtype = torch.bfloat16
    graphed = copy.deepcopy(ref)
    runner = step_graphs.StepGraphs(graphed)
    graphed.step_graph = runner
    turns = [list(range(3, 78)), list(range(3, 77)) + list(range(100, 140)),  # 75 tokens, then 114 that start so,
             list(range(3, 67)) + list(range(200, 230))]  # then 94 that go back to the first's point (a checkpoint)

    def run(model: Any, kept: PromptCache) -> list[tuple[list[int], int]]:
        out = []
        for prompt in turns:
            events = list(generate_ar(model, prompt, _settings(model.config, 40), prompt_cache=kept))
            info = next(e for e in events if isinstance(e, PromptInfo))
            out.append((list(events[-1].token_ids), info.cached_tokens))
        return out

    want = run(ref, PromptCache())
    assert [cached for _, cached in want] == [0, 64, 64]
    assert run(graphed, PromptCache()) == want
    assert runner.failed is None and runner.recorded == 1  # one key bucket: later turns replayed the first's graph
    assert runner.replays == 3 * 39


def _steps_never_sync(graphed: Any) -> None:
    """AR steps of ``graphed`` (its step graphs on a CUDA device), after the one that records a new cache's graph,
    under ``set_sync_debug_mode("error")``: any sync raises."""
    gpu = torch.device("cuda")
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
    want = _tokens(_quantized((1, 3), "cuda", pool_layers=1), 300)
    graphed = _quantized((1, 3), "cuda", pool_layers=1)
    runner = step_graphs.StepGraphs(graphed)
    assert runner.pieces == step_graphs.pieces_of(4, {1: "fetch", 3: "fetch"})  # 3 graphs around 2 eager fetches
    _replays_decode(graphed, runner, want, recorded=3 * 2)  # 3 graphs, 2 buckets


@pytest.mark.gpu
def test_zero_copy_streamed_steps_are_one_cuda_graph_without_a_sync() -> None:
    """Streamed layers whose page-locked rows are mapped into the GPU's address space (engine.placement.streamed_bank zero-copy): an
    AR step is one recorded graph that reads those rows over PCIe, with the tokens of the uncaptured steps through
    the pool and no sync."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("bitsandbytes")
    from clover_desk.engine.placement import offload_runtime

    want = _tokens(_quantized((1, 3), "cuda", pool_layers=1, zero_copy=False), 300)
    graphed = _quantized((1, 3), "cuda", pool_layers=1, zero_copy=True)
    rt = offload_runtime.runtime_of(graphed)
    assert rt is not None and rt.zero_copy and rt.zero_copy_refused == {}
    view = graphed.layers[1].mlp.experts.in_place
    assert view.device.type == "cuda" and torch.equal(view.cpu(), rt.stores[1].rows)  # the host bytes, mapped
    runner = step_graphs.StepGraphs(graphed)
    assert runner.pieces == step_graphs.pieces_of(4, {})
    _replays_decode(graphed, runner, want, recorded=2)
    _steps_never_sync(graphed)


@pytest.mark.gpu
def test_cuda_graph_block_passes_decode_the_uncaptured_tokens() -> None:
    """Diffusion with the denoising and commit passes replayed from CUDA graphs (fp32: the same tokens as the
    uncaptured passes), the banks that read the host cut out where the GPU needs it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ref = tiny_model(tiny_config(moe_block_coreset_enabled=True), seed=9).to("cuda")
    want, passes = _diffusion(ref, 40)
    graphed = copy.deepcopy(ref)
    runner = step_graphs.StepGraphs(graphed)
    graphed.step_graph = graphed.pass_graph = runner
    got, got_passes = _diffusion(graphed, 40)
    assert (got, got_passes) == (want, passes)
    assert runner.failed is None and runner.pass_replays == passes and runner.recorded >= 2  # denoise + commit


@pytest.mark.gpu
@pytest.mark.parametrize("streamed", [(), (1, 3)])
def test_a_block_pass_with_fused_nf4_experts_is_recorded_around_its_fetches(
    streamed: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """NF4 experts through the fused kernel (it sorts the pairs on the device): resident, nothing in a block pass
    reads the host, so the whole pass is one graph and runs without a sync; streamed, only each streamed layer's
    fetch is eager and its compute reads the slot table inside the graphs. The logits are the uncaptured pass's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton")
    from clover_desk.engine.placement import placer
    from clover_desk.engine.weights.quant import make_policy, quantize_model_

    monkeypatch.setattr(triton_moe, "_enabled", True)
    model = tiny_model(tiny_config(moe_block_coreset_enabled=True), seed=5, dtype=torch.bfloat16)
    quantize_model_(model, make_policy())
    resident = tuple(i for i in range(len(model.layers)) if i not in streamed)
    placer.apply_plan(model, placer.SimplePlan(resident, streamed, 2 * model.config.num_experts), "cuda")
    runner = step_graphs.StepGraphs(model)
    b = model.config.block_size
    assert runner.pieces_for(b) == step_graphs.pieces_of(len(model.layers), dict.fromkeys(streamed, "fetch"))
    gpu = torch.device("cuda")
    cache = model.new_cache(64)
    model(torch.tensor(PROMPT[:b], device=gpu), 0, cache, block_size=b, write_cache=True)
    block = torch.tensor((PROMPT * 2)[b : 2 * b], device=gpu)
    want = model(block, b, cache, block_size=b, write_cache=False)
    model.pass_graph = runner
    model(block, b, cache, block_size=b, write_cache=False)  # records
    torch.cuda.synchronize()
    if not streamed:
        torch.cuda.set_sync_debug_mode("error")
    try:
        got = model(block, b, cache, block_size=b, write_cache=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert runner.failed is None and runner.recorded == len(streamed) + 1 and runner.pass_replays == 2
    assert (got - want).abs().max() < 2e-2 * want.abs().max()


def test_passes_of_every_key_length_write_one_logits_buffer(model: Any) -> None:
    """The head piece's fp32 logits live in one buffer per pass shape, not one per key bucket: a 32-slot pass's is
    32 MB at Clover's vocabulary, and a 16K context has 7 buckets. Passes at different lengths read the keys to
    their own bucket but write the same buffer; the caller gets a copy."""
    runner = step_graphs.StepGraphs(model, record=False)
    cache = model.new_cache(1024)
    b = model.config.block_size
    block = torch.arange(b) + 3
    near = runner.pieces_of_pass(block, 0, cache, b, False, False)
    far = runner.pieces_of_pass(block, 640, cache, b, False, False)  # the 1024-key bucket, not 256
    commit = runner.pieces_of_pass(block, 640, cache, b, True, True)
    assert near.out.data_ptr() == far.out.data_ptr() and tuple(far.out.shape) == (b, model.config.vocab_size)
    assert commit.out.data_ptr() != far.out.data_ptr() and tuple(commit.out.shape) == (1, model.config.vocab_size)
