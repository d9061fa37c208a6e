"""Expert streaming (engine/placement/: expert_store, slot_pool, streamed_bank, offload_runtime, placer) on a tiny quantized Clover model, with the CPU as the device."""

from __future__ import annotations

import copy

import pytest
import torch

from clover_desk.engine.decode.events import Finished
from clover_desk.engine.decode.generate import generate
from clover_desk.engine.errors import OutOfMemory, PlanError
from clover_desk.engine.model.clover import CloverModel
from clover_desk.engine.placement import expert_store, offload_runtime, placer, streamed_bank
from clover_desk.engine.placement.placer import SimplePlan, apply_plan
from clover_desk.engine.weights.checkpoint import random_state_dict
from clover_desk.engine.weights.quant import QuantExpertBank
from tests.helpers_model import one_thread
from tests.offload_model import (
    EXPERTS,
    LAYERS,
    MASK,
    ar_steps_counting_host_reads,
    assert_fetched_nothing,
    assert_one_graph,
    quantized_model,
    settings,
    tiny_config,
    tokens,
)

_single_thread = pytest.fixture(autouse=True, scope="module")(one_thread)  # tiny matmuls: one thread is fastest


@pytest.fixture(scope="module")
def qmodel() -> CloverModel:
    return quantized_model()


def fresh(model: CloverModel) -> CloverModel:
    return copy.deepcopy(model)


PLANS = {
    "none-streamed": ((), 0),
    "some-streamed": ((1, 3), EXPERTS),
    "all-min-pool": ((0, 1, 2, 3), EXPERTS),
    "all-mid-pool": ((0, 1, 2, 3), EXPERTS + 9),
    "all-big-pool": ((0, 1, 2, 3), 4 * EXPERTS),
}


@pytest.mark.parametrize("mode,n", [("ar", 12), ("diffusion", 32)])
def test_streaming_never_changes_the_tokens(qmodel: CloverModel, mode: str, n: int) -> None:
    reference = tokens(qmodel, mode, n)
    assert len(reference) == n
    for name, (streamed, slots) in PLANS.items():
        model = fresh(qmodel)
        resident = tuple(i for i in range(LAYERS) if i not in streamed)
        rt = apply_plan(model, SimplePlan(resident, streamed, slots), "cpu")
        got = tokens(model, mode, n)
        assert got == reference, f"plan {name} changed the output"
        acc = offload_runtime.accounting(model)
        if streamed:
            assert acc["h2d_bytes"] > 0 and acc["slot_misses"] > 0, name
            # blocks come from the loop's hooks only: diffusion blocks span several passes; AR steps open none
            if mode == "diffusion":
                assert acc["blocks"] >= 1 and acc["passes_per_block"] > 1, name
            else:
                assert acc["blocks"] == 0 and acc["passes"] >= n, name
            assert acc["h2d_bytes"] == (acc["slot_misses"] + acc["prefetched"]) * rt.pool.layout.nbytes
            assert isinstance(model.layers[streamed[0]].mlp.experts, streamed_bank.StreamedExpertBank)
        else:
            assert acc["h2d_bytes"] == 0
        for i in resident:
            assert isinstance(model.layers[i].mlp.experts, QuantExpertBank)


def test_loop_hooks_give_the_same_tokens_and_fill_finished_accounting(qmodel: CloverModel) -> None:
    from clover_desk.engine.decode.loop_parts import LoopHooks

    reference = tokens(qmodel, "diffusion", 32)
    model = fresh(qmodel)
    apply_plan(model, SimplePlan((0,), (1, 2, 3), EXPERTS), "cpu")
    hooks = LoopHooks(
        begin_block=lambda: offload_runtime.begin_block(model),
        end_block=lambda: offload_runtime.end_block(model),
        accounting=lambda: offload_runtime.accounting(model),
    )
    events = list(generate(model, [5, 17, 33, 9, 60, 61, 2, 40], settings("diffusion", 32), hooks=hooks))
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.token_ids == reference
    acc = fin.accounting
    assert acc["h2d_bytes"] > 0 and acc["blocks"] >= 1 and acc["passes_per_block"] > 1
    assert acc["streamed_layers"] == [1, 2, 3] and acc["slot_pool_experts"] == EXPERTS


def test_forward_logits_are_bit_identical_under_streaming(qmodel: CloverModel) -> None:
    ids = torch.tensor([5, 17, 33, 9, 60, 61, 2, 40] * 5)  # 40 tokens: a full block and a partial one
    ref = qmodel(ids, 0, None, block_size=32)
    model = fresh(qmodel)
    apply_plan(model, SimplePlan((0, 2), (1, 3), EXPERTS), "cpu", staging=True, pin_budget_bytes=0)
    out = model(ids, 0, None, block_size=32)
    assert torch.equal(out, ref)
    acc = offload_runtime.accounting(model)
    assert acc["staged_copies"] > 0  # pageable rows went through the staging ring


def test_block_working_set_is_loaded_once_and_reused_across_passes(qmodel: CloverModel) -> None:
    model = fresh(qmodel)
    apply_plan(model, SimplePlan((), (0, 1, 2, 3), 4 * EXPERTS), "cpu", prefetch=False)
    rt = offload_runtime.runtime_of(model)
    assert rt is not None
    prompt = torch.tensor([5, 17, 33, 9] * 8)  # one committed block of 32
    cache = model.new_cache(64)
    model(prompt, 0, cache, block_size=32)
    rt.reset_stats()
    block = torch.full((32,), MASK)
    offload_runtime.begin_block(model)
    model(block, 32, cache, block_size=32, write_cache=False)
    after_first = offload_runtime.accounting(model)["h2d_bytes"]
    for _ in range(3):
        model(block, 32, cache, block_size=32, write_cache=False)
    acc = offload_runtime.accounting(model)
    assert acc["h2d_bytes"] == after_first  # passes 2..4 hit the block's pinned slots: no new copies
    assert acc["slot_hits"] >= 3 * acc["slot_misses"]
    offload_runtime.end_block(model)
    acc = offload_runtime.accounting(model)
    assert acc["blocks"] == 1 and acc["passes_per_block"] == 4.0
    assert 0 < acc["distinct_experts_per_layer_block"] <= EXPERTS


def test_minimum_pool_evicts_other_layers_block_pins_without_changing_numbers(qmodel: CloverModel) -> None:
    ids = torch.tensor(list(range(5, 37)))
    ref = qmodel(ids, 0, None, block_size=32)
    model = fresh(qmodel)
    apply_plan(model, SimplePlan((), (0, 1, 2, 3), EXPERTS), "cpu")
    offload_runtime.begin_block(model)
    for _ in range(2):
        assert torch.equal(model(ids, 0, None, block_size=32), ref)
    offload_runtime.end_block(model)
    acc = offload_runtime.accounting(model)
    assert acc["block_pin_evictions"] > 0
    assert acc["slot_misses"] > placer.min_slot_pool(model)


def test_prefetch_guesses_the_next_layer(qmodel: CloverModel) -> None:
    model = fresh(qmodel)
    apply_plan(model, SimplePlan((), (0, 1, 2, 3), 4 * EXPERTS), "cpu", prefetch=True)
    tokens(model, "ar", 6)
    acc = offload_runtime.accounting(model)
    assert acc["prefetched"] > 0
    assert acc["prefetch_hits"] > 0


def test_a_streamed_layer_reads_the_host_once_per_forward(qmodel: CloverModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its experts and its guess of the next streamed layer's come back in one copy (a GPU sync each), with no
    ``torch.unique`` (whose output size is a sync of its own on a GPU); the prefetch still happens."""
    model = fresh(qmodel)
    apply_plan(model, SimplePlan((0,), (1, 2, 3), 4 * EXPERTS), "cpu", prefetch=True)
    cache = model.new_cache(32)
    model(torch.arange(5, 12), 0, cache)
    reads: list[tuple[int, ...]] = []
    plain = torch.Tensor.cpu

    def counted(t: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        reads.append(tuple(t.shape))
        return plain(t, *args, **kwargs)

    def no_unique(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.unique in a streamed forward")

    monkeypatch.setattr(torch.Tensor, "cpu", counted)
    monkeypatch.setattr(torch, "unique", no_unique)
    before = offload_runtime.accounting(model)
    model(torch.tensor([3]), cache.length, cache)
    e = model.config.num_experts
    assert reads == [(2, e), (2, e), (1, e)]  # layers 1 and 2 guess the next streamed layer's experts, 3 has none
    after = offload_runtime.accounting(model)
    assert after["prefetched"] > before["prefetched"]
    assert after["host_reads"] - before["host_reads"] == 3  # what the accounting reports: one per streamed layer


def test_plan_from_the_planner_allocates_what_it_says(qmodel: CloverModel) -> None:
    from clover_desk.engine.placement.planner import ModelGeometry, make_plan, manifest_from_dict

    model = fresh(qmodel)
    geo = ModelGeometry.from_config(model.config)
    manifest = manifest_from_dict(placer.manifest_from_model(model), geometry=geo)
    probe = make_plan(manifest, 0, 256, compute_dtype="fp32")  # this model computes in fp32
    assert not probe.fits and probe.min_vram_bytes
    budget = probe.min_vram_bytes + 2 * (manifest.expert_layer_bytes()[0] // EXPERTS)
    plan = make_plan(manifest, budget, 256, compute_dtype="fp32")
    assert plan.fits and plan.streamed_expert_layers, plan.reason
    rt = apply_plan(model, plan, "cpu", host_embedding=True)
    placed = rt.ledger.by_kind
    br = plan.vram_breakdown
    for kind in ("non_expert", "resident_experts", "expert_slots"):
        assert placed.get(kind, 0) == br[kind], f"{kind}: placed {placed.get(kind, 0)} B, plan says {br[kind]} B"
    assert rt.pool is not None and rt.pool.num_slots == plan.slot_pool_experts
    assert list(rt.streamed_layers) == list(plan.streamed_expert_layers)


def test_placement_never_plans(qmodel: CloverModel) -> None:
    with pytest.raises(PlanError, match="places a plan"):
        apply_plan(fresh(qmodel), 16.0, "cpu")


def test_slot_pool_below_minimum_is_refused(qmodel: CloverModel) -> None:
    with pytest.raises(PlanError, match=f"below the minimum {EXPERTS}"):
        apply_plan(fresh(qmodel), SimplePlan((0,), (1, 2, 3), EXPERTS - 1), "cpu")


def test_out_of_memory_during_placement_leaves_the_model_unchanged(qmodel: CloverModel) -> None:
    model = fresh(qmodel)
    before = {n: p for n, p in model.named_parameters()}
    banks_before = {i: type(model.layers[i].mlp.experts) for i in range(LAYERS)}
    with pytest.raises(OutOfMemory, match="out of device memory placing .*cap"):
        apply_plan(model, SimplePlan((0,), (1, 2, 3), 2 * EXPERTS), "cpu", device_cap_bytes=50_000)
    assert offload_runtime.runtime_of(model) is None
    assert {i: type(model.layers[i].mlp.experts) for i in range(LAYERS)} == banks_before
    assert all(p is before[n] for n, p in model.named_parameters())
    ids = torch.tensor([1, 2, 3, 4])
    assert torch.equal(model(ids, 0, None), qmodel(ids, 0, None))
    # the same plan with room enough works: the cap, not the plan, was the problem
    apply_plan(model, SimplePlan((0,), (1, 2, 3), 2 * EXPERTS), "cpu", device_cap_bytes=10**9)


def test_only_quantized_banks_stream() -> None:
    cfg = tiny_config()
    model = CloverModel(cfg, dtype=torch.float32, device="cpu")
    model.load_state_dict(random_state_dict(cfg, seed=1), strict=True)
    with pytest.raises(PlanError, match="only quantized expert banks"):
        apply_plan(model, SimplePlan((), (0, 1, 2, 3), EXPERTS), "cpu")


def test_plan_naming_a_missing_layer_is_refused(qmodel: CloverModel) -> None:
    with pytest.raises(PlanError, match="streams layers \\[9\\]"):
        apply_plan(fresh(qmodel), SimplePlan((), (9,), EXPERTS), "cpu")


def test_pinning_falls_back_to_pageable_rows_when_refused_or_over_budget() -> None:
    budget = expert_store.PinBudget(64)
    rows, pinned = expert_store.alloc_host_rows((4, 32), True, budget, 0)  # 128 B > 64 B budget: not pinned
    assert not pinned and budget.left == 64 and tuple(rows.shape) == (4, 32) and not rows.is_pinned()
    rows, pinned = expert_store.alloc_host_rows((2, 32), True, budget, 1)  # within budget
    assert budget.left == 0
    if not torch.cuda.is_available():  # pinning is refused without a CUDA driver: pageable fallback
        assert not pinned
    assert pinned == rows.is_pinned()
    rows, pinned = expert_store.alloc_host_rows((2, 32), False, expert_store.PinBudget(None), 2)
    assert not pinned


# the diffusion case compiles block passes too (~60 s on 2 cores): make test-heavy; the AR case stays in make test
@pytest.mark.parametrize("mode,n", [("ar", 12), pytest.param("diffusion", 32, marks=pytest.mark.heavy)])
def test_compiled_layers_stream_the_same_tokens(qmodel: CloverModel, mode: str, n: int) -> None:
    """Compiled decoder layers (engine.kernels.fastpath) over streamed banks: the bank's host-side bookkeeping (which
    expert sits in which slot, changing every step) must never be traced into a graph, where it would be baked in
    as constants and, in the AR loop's steady steps (guards skipped), reused for the wrong experts."""
    import torch._dynamo

    from clover_desk.engine.kernels.fastpath import compile_layers

    def run_traced(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        return gm.forward

    reference = tokens(qmodel, mode, n)
    model = fresh(qmodel)
    apply_plan(model, SimplePlan((0, 2), (1, 3), EXPERTS + 2), "cpu")
    torch._dynamo.reset()
    try:
        compile_layers(model, backend=run_traced)
        assert tokens(model, mode, n) == reference
        assert tokens(model, mode, n) == reference  # a second request: every variant already compiled
        assert offload_runtime.accounting(model)["slot_misses"] > 0
    finally:
        torch._dynamo.reset()


# --- zero-copy: AR steps read streamed experts where they lie (engine.placement.expert_store.in_place_view) ---


@pytest.mark.parametrize("mode,n", [("ar", 12), ("diffusion", 32)])
def test_zero_copy_never_changes_the_tokens(qmodel: CloverModel, mode: str, n: int) -> None:
    reference = tokens(qmodel, mode, n)
    for name in ("some-streamed", "all-min-pool"):
        streamed, slots = PLANS[name]
        model = fresh(qmodel)
        rt = apply_plan(model, SimplePlan(tuple(i for i in range(LAYERS) if i not in streamed), streamed, slots),
                        "cpu", zero_copy=True)
        assert rt.zero_copy and all(model.layers[i].mlp.experts.in_place is not None for i in streamed)
        assert tokens(model, mode, n) == reference, name
        acc = offload_runtime.accounting(model)
        assert acc["zero_copy"] and acc["zero_copy_layers"] == list(streamed)
        if mode == "diffusion":  # block passes go through the pool as before
            assert acc["slot_misses"] > 0 and acc["blocks"] >= 1


def test_zero_copy_ar_steps_neither_fetch_nor_read_the_host(qmodel: CloverModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """An AR step's few pairs gather their rows from the host store itself: no host read, no copy, no pool slot;
    a prompt's forward (more pairs) still fetches through the pool. Turned off, the step fetches again."""
    model = fresh(qmodel)
    apply_plan(model, SimplePlan((0,), (1, 2, 3), 4 * EXPERTS), "cpu", zero_copy=True, prefetch=True)
    rt = offload_runtime.runtime_of(model)
    assert rt is not None
    cache = model.new_cache(32)
    model(torch.arange(5, 12), 0, cache)  # 7 tokens x top-4: through the pool
    prompt = offload_runtime.accounting(model)
    assert prompt["host_reads"] == 3 and prompt["slot_misses"] > 0
    reads = ar_steps_counting_host_reads(model, cache, range(7, 10), monkeypatch)
    after = offload_runtime.accounting(model)
    assert reads == []
    assert_fetched_nothing(prompt, after)
    assert not rt.pool.in_use
    assert placer.set_zero_copy(model, False) == {}
    model(torch.tensor([10]), 10, cache)
    assert reads and offload_runtime.accounting(model)["host_reads"] == prompt["host_reads"] + 3


def test_zero_copy_follows_the_expert_fetch_on_cuda_only(qmodel: CloverModel) -> None:
    model = fresh(qmodel)
    rt = apply_plan(model, SimplePlan((0,), (1, 2, 3), EXPERTS), "cpu", expert_fetch="zero_copy")
    assert not rt.zero_copy  # the CPU tests emulate a GPU's copies unless asked
    assert all(model.layers[i].mlp.experts.in_place is None for i in (1, 2, 3))
    rows = torch.zeros(4, 8, dtype=torch.uint8)
    assert expert_store.in_place_view(rows, torch.device("cpu"))[0] is rows
    view, why = expert_store.in_place_view(rows, torch.device("meta"))
    assert view is None and "meta" in why
    if not torch.cuda.is_available():  # pageable rows have no device address
        view, why = expert_store.in_place_view(rows, torch.device("cuda"))
        assert view is None and "pageable" in why
    with pytest.raises(PlanError, match="placed model"):
        placer.set_zero_copy(fresh(qmodel), True)


def test_a_zero_copy_ar_step_traces_as_one_graph(qmodel: CloverModel) -> None:
    """No host sync in an AR step over streamed layers, proven by the compiler: with zero-copy the whole step is one
    graph; through the pool each streamed layer's fetch breaks it."""
    model = fresh(qmodel)
    apply_plan(model, SimplePlan((0, 2), (1, 3), EXPERTS), "cpu")
    cache = model.new_cache(32)
    model(torch.arange(5, 12), 0, cache)

    def step(tok: torch.Tensor) -> torch.Tensor:
        return model(tok, 7, cache, block_size=None, write_cache=False)

    tok = torch.tensor([9])
    try:
        torch._dynamo.reset()
        through_pool = torch._dynamo.explain(step)(tok)
        assert through_pool.graph_break_count > 0
        placer.set_zero_copy(model, True)
        assert_one_graph(step, tok)
    finally:
        torch._dynamo.reset()


def test_compile_layers_runs_zero_copy_ar_steps_as_one_graph(qmodel: CloverModel) -> None:
    """On the CPU a model whose streamed layers fetch gets no whole-step graph (its pieces' guards would change
    every step); with zero-copy nothing in an AR step fetches, so it gets one, with the eager tokens."""
    import torch._dynamo

    from clover_desk.engine.kernels.fastpath import compile_layers

    def run_traced(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        return gm.forward

    reference = tokens(qmodel, "ar", 12)
    fetching = fresh(qmodel)
    apply_plan(fetching, SimplePlan((0, 2), (1, 3), EXPERTS), "cpu")
    model = fresh(qmodel)
    apply_plan(model, SimplePlan((0, 2), (1, 3), EXPERTS), "cpu", zero_copy=True)
    torch._dynamo.reset()
    try:
        compile_layers(fetching, backend=run_traced)
        assert fetching.step_graph is None
        compile_layers(model, backend=run_traced)
        assert model.step_graph is not None
        assert tokens(model, "ar", 12) == reference
        assert tokens(model, "ar", 12) == reference
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
def test_page_locked_rows_are_read_in_place_by_the_gpu() -> None:
    """The mapping zero-copy rests on: a CUDA tensor whose bytes are the page-locked host rows (no copy: a write on
    the host is what the GPU reads next), gathered by a device-side index; pageable rows are refused with why."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gpu = torch.device("cuda")
    rows = torch.randint(0, 256, (16, 4096), dtype=torch.uint8).pin_memory()
    view, why = expert_store.in_place_view(rows, gpu)
    assert view is not None, why
    assert view.device.type == "cuda" and view.data_ptr() == rows.data_ptr()
    picked = torch.tensor([3, 15, 0], device=gpu)
    assert torch.equal(view[picked].cpu(), rows[[3, 15, 0]])
    rows[15, :8] = 7  # the host writes; the GPU reads the new bytes, no copy in between
    torch.cuda.synchronize()
    assert torch.equal(view[picked].cpu()[1, :8], torch.full((8,), 7, dtype=torch.uint8))
    assert expert_store.in_place_view(torch.zeros(2, 8, dtype=torch.uint8), gpu)[1].startswith("the rows are pageable")
