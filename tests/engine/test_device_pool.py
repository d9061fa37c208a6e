"""Device slot tables (``engine.placement.device_pool``): the host pool's decisions made on the device, AR steps through them
with the tokens of the host pool and no host read, one traced graph, the ownership hand-overs, the refusals, and the
Triton copy kernel under the interpreter."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from clover_desk.engine.decode.loop_parts import loop_hooks
from clover_desk.engine.decode.settings import DecodeSettings
from clover_desk.engine.errors import PlanError
from clover_desk.engine.kernels import step_graphs, triton_moe
from clover_desk.engine.model.clover import CloverModel
from clover_desk.engine.model.config import parse_config
from clover_desk.engine.placement import offload_runtime, placer, slot_pool
from clover_desk.engine.placement.device_pool import DeviceSlotTables
from clover_desk.engine.placement.expert_store import HostExpertStore
from clover_desk.engine.placement.placer import SimplePlan, apply_plan
from clover_desk.engine.placement.slot_pool import SlotPool
from clover_desk.engine.weights.checkpoint import random_state_dict
from clover_desk.engine.weights.quant import make_policy, quantize_model_
from clover_desk.engine.weights.tiny import config_dict_for, tiny_text_config
from tests.helpers_model import one_thread
from tests.offload_model import EXPERTS, LAYERS, SPECIAL, TOPK, assert_one_graph, quantized_model, tokens
from tests.triton_child import run_interpreted

pytestmark = pytest.mark.usefixtures("cpu_kernels_off")


_single_thread = pytest.fixture(autouse=True, scope="module")(one_thread)  # tiny matmuls: one thread is fastest


@pytest.fixture(scope="module")
def qmodel() -> CloverModel:
    return quantized_model()


def placed(qmodel: CloverModel, streamed: tuple[int, ...], slots: int, **kwargs: object) -> CloverModel:
    model = copy.deepcopy(qmodel)
    resident = tuple(i for i in range(LAYERS) if i not in streamed)
    apply_plan(model, SimplePlan(resident, streamed, slots), "cpu", **kwargs)
    return model


# --- the tables against the host pool, decision for decision ---


class _Layout:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def _pool(slots: int, row_bytes: int) -> SlotPool:
    return SlotPool(slots, _Layout(row_bytes), torch.device("cpu"), slot_pool.DeviceLedger(torch.device("cpu")))


@pytest.mark.parametrize("slots", [8, 11, 20, 64])
def test_device_tables_make_the_host_pools_decisions(slots: int) -> None:
    """Random AR steps over 3 streamed layers (E=16, k=4, each layer prefetching the next one's guess), once
    through the host pool and once through the device tables, handed over both ways between phases: the same slot
    for every expert at every step, every row in its slot, and at the end the same LRU order, prefetch marks and
    counters (evictions, prefetch hits and waste, bytes)."""
    rng = random.Random(slots)
    layers, e, k, r = (1, 2, 3), EXPERTS, TOPK, 40
    stores = {i: HostExpertStore(i, torch.randint(0, 256, (e, r), dtype=torch.uint8), False) for i in layers}
    ref, dev = _pool(slots, r), _pool(slots, r)
    tables = DeviceSlotTables(dev, layers, {i: s.rows for i, s in stores.items()}, e, k)

    def host_step(pool: SlotPool, layer: int, experts: list[int], guess: list[int] | None) -> dict[int, int]:
        got = pool.acquire(layer, sorted(experts), stores[layer], in_block=False)
        if guess is not None:
            pool.prefetch(layer + 1, sorted(guess), stores[layer + 1])
        pool.release(layer, sorted(experts))
        return got

    fetches_at_first = 0
    for phase in range(6):
        on_device = phase % 2 == 1
        if on_device:
            tables.push()
        for _ in range(30):
            for layer in layers:
                experts = rng.sample(range(e), k)
                guess = rng.sample(range(e), k) if layer != layers[-1] else None
                want = host_step(ref, layer, experts, guess)
                if on_device:
                    slots_of = tables.fetch(layer, torch.tensor(experts))
                    if guess is not None:
                        tables.prefetch(layer + 1, torch.tensor(guess))
                    got = dict(zip(sorted(experts), slots_of.tolist()))
                    fetches_at_first += layer == layers[0]
                else:
                    got = host_step(dev, layer, experts, guess)
                assert got == want, (phase, layer)
        if on_device:
            assert tables.check() == []
            tables.pull()
        assert dev.slot_of == ref.slot_of and list(dev.lru) == list(ref.lru) and dev.free == ref.free
        assert dev.prefetched_unused == ref.prefetched_unused and dev.key_of == ref.key_of
    for key, s in dev.slot_of.items():
        assert torch.equal(dev.buf[s], stores[key[0]].rows[key[1]]), key
    for name in ("slot_hits", "slot_misses", "evictions", "prefetched", "prefetch_hits", "prefetch_wasted",
                 "h2d_bytes"):
        assert getattr(dev.stats, name) == getattr(ref.stats, name), name
    assert ref.stats.prefetch_hits > 0
    if slots < len(layers) * e:  # a pool that cannot hold every expert evicts, prefetched ones too
        assert ref.stats.evictions > 0 and ref.stats.prefetch_wasted > 0
    assert dev.stats.passes == fetches_at_first == 90  # (the host pool leaves passes to the runtime)


@pytest.mark.parametrize("slots", [16, 19, 30, 64])
def test_device_block_passes_make_the_host_pools_decisions(slots: int) -> None:
    """Random diffusion blocks (1-5 passes, each streamed layer touching 1-16 of its 16 experts, the next layer's
    guess prefetched on a block's first pass only) between random AR steps, through the host pool and through the
    device tables, handed over both ways, sometimes in the middle of a block: the same slot for every expert at
    every fetch, and at each hand-over the same slots, LRU order, pins, prefetch marks and counters (block-pin
    evictions too) and the same distinct experts per block."""
    rng = random.Random(slots)
    layers, e, k, r = (1, 2, 3), EXPERTS, TOPK, 24
    stores = {i: HostExpertStore(i, torch.randint(0, 256, (e, r), dtype=torch.uint8), False) for i in layers}
    ref, dev = _pool(slots, r), _pool(slots, r)
    tables = DeviceSlotTables(dev, layers, {i: s.rows for i, s in stores.items()}, e, k)
    ref_seen: dict[int, set[int]] = {}
    dev_seen: dict[int, set[int]] = {}  # the host-side share of the device run's open block (pull / push)
    ref_distinct: list[int] = []

    def mask(experts: list[int]) -> torch.Tensor:
        m = torch.zeros(e, dtype=torch.bool)
        m[experts] = True
        return m

    def host_pass(pool: SlotPool, layer: int, experts: list[int], guess: list[int] | None,
                  in_block: bool) -> dict[int, int]:
        got = pool.acquire(layer, experts, stores[layer], in_block=in_block)
        if guess is not None:
            pool.prefetch(layer + 1, guess, stores[layer + 1])
        pool.release(layer, experts)
        return got

    on_device, fetches = False, 0
    for block in range(60):
        n_passes = rng.randint(1, 5)
        for p in range(n_passes + rng.randint(0, 3)):
            ar = p >= n_passes  # AR steps after the block
            if ar and p == n_passes:  # the block closes
                ref.end_block()
                for i in layers:
                    ref_distinct.append(len(ref_seen.get(i, ())))
                ref_seen = {}
                if on_device:
                    tables.end_block(count=True)
                else:
                    dev.end_block()
                    for i in layers:  # the runtime's count of a block closed on the host
                        tables.distinct[layers.index(i)] += len(dev_seen.get(i, ()))
                    tables.blocks_closed += 1
                dev_seen = {}
            if rng.random() < 0.15:  # hand over (in a block too)
                if on_device:
                    for i, got in tables.pull().items():
                        dev_seen.setdefault(i, set()).update(got)
                    assert dev.slot_of == ref.slot_of and list(dev.lru) == list(ref.lru) and dev.free == ref.free
                    assert dev.prefetched_unused == ref.prefetched_unused and dev.block_pins == ref.block_pins
                else:
                    tables.push(dev_seen)
                    dev_seen = {}
                on_device = not on_device
            for layer in layers:
                experts = sorted(rng.sample(range(e), k if ar else rng.randint(1, e)))
                guess = None
                if layer != layers[-1] and (ar or p == 0):
                    guess = sorted(rng.sample(range(e), k if ar else rng.randint(1, e)))
                want = host_pass(ref, layer, experts, guess, in_block=not ar)
                if not ar:
                    ref_seen.setdefault(layer, set()).update(experts)
                if on_device:
                    if ar:
                        got_slots = tables.fetch(layer, torch.tensor(experts))
                        if guess is not None:
                            tables.prefetch(layer + 1, torch.tensor(guess))
                    else:
                        tables.set_gate(p == 0)
                        tables.fetch_set(layer, mask(experts))
                        if layer != layers[-1]:  # offered every pass; the gate lets the first one through
                            tables.prefetch_set(layer + 1, mask(guess if guess is not None else experts))
                        got_slots = tables.row_index(layer)[experts]
                    got = dict(zip(experts, got_slots.tolist()))
                    fetches += layer == layers[0]
                else:
                    got = host_pass(dev, layer, experts, guess, in_block=not ar)
                    if not ar:
                        dev_seen.setdefault(layer, set()).update(experts)
                assert got == want, (block, p, layer)
        if on_device:
            assert tables.check() == []
    if on_device:
        tables.pull()
    assert tables.pinned.any().item() is False or ref.block_pins  # (a block may still be open)
    for key, s in dev.slot_of.items():
        assert torch.equal(dev.buf[s], stores[key[0]].rows[key[1]]), key
    for name in ("slot_hits", "slot_misses", "evictions", "block_pin_evictions", "prefetched", "prefetch_hits",
                 "prefetch_wasted", "h2d_bytes"):
        assert getattr(dev.stats, name) == getattr(ref.stats, name), name
    assert dev.stats.distinct_device_total == sum(ref_distinct)
    assert dev.stats.distinct_device_count == len(ref_distinct)
    assert ref.stats.prefetch_hits > 0 and ref.stats.prefetched > 0
    if slots < 2 * e:  # a pool that cannot hold two layers' sets evicts pins
        assert ref.stats.block_pin_evictions > 0
    assert fetches > 0


def test_a_block_fetch_traces_as_one_graph_with_the_eager_decisions() -> None:
    """The compiler's proof that a block pass's bookkeeping reads nothing on the host: a streamed layer's block
    fetch and the next layer's gated prefetch compile with fullgraph=True (the traced copy writes fixed shapes),
    and make the eager tables' decisions and copies, pass for pass."""
    layers, e, k, r = (1, 2), EXPERTS, TOPK, 8
    rows = {i: torch.randint(0, 256, (e, r), dtype=torch.uint8) for i in layers}
    eager = DeviceSlotTables(_pool(20, r), layers, rows, e, k)
    traced = DeviceSlotTables(_pool(20, r), layers, rows, e, k)

    def fetch(tables: DeviceSlotTables, present: torch.Tensor, guess: torch.Tensor) -> torch.Tensor:
        tables.fetch_set(1, present)
        tables.prefetch_set(2, guess)
        tables.fetch_set(2, guess ^ present)
        return tables.row_index(2) + 0

    rng = torch.Generator().manual_seed(0)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(fetch, backend="eager", fullgraph=True)
        for tables in (eager, traced):
            tables.push()
        for step in range(12):
            present, guess = torch.rand(2, e, generator=rng) < 0.5
            for tables in (eager, traced):
                tables.set_gate(step % 3 == 0)
            assert torch.equal(fetch(eager, present, guess), compiled(traced, present, guess)), step
            if step % 4 == 3:
                for tables in (eager, traced):
                    tables.end_block(count=True)
        for name in ("slot_of", "key_of", "stamp", "fresh", "pinned", "seen", "counts", "distinct"):
            assert torch.equal(getattr(eager, name), getattr(traced, name)), name
        assert torch.equal(eager.pool.buf, traced.pool.buf) and traced.check() == []
        assert int(traced.counts[0]) > 0 and int(traced.counts[2]) > 0  # hits, prefetched
    finally:
        torch._dynamo.reset()


def test_a_broken_victim_choice_is_caught() -> None:
    """The comparison above is not vacuous: newest-first victims make other decisions."""
    layers, e, k, r = (1, 2), EXPERTS, TOPK, 8
    stores = {i: HostExpertStore(i, torch.randint(0, 256, (e, r), dtype=torch.uint8), False) for i in layers}
    ref, dev = _pool(8, r), _pool(8, r)
    tables = DeviceSlotTables(dev, layers, {i: s.rows for i, s in stores.items()}, e, k)
    tables.push()
    real_topk = torch.topk
    rng = random.Random(0)
    differs = False
    try:
        torch.topk = lambda t, n, largest=True: real_topk(torch.where(t == tables.stamp.max(), t, -t), n,
                                                           largest=largest)
        for _ in range(20):
            experts = rng.sample(range(e), k)
            want = ref.acquire(1, sorted(experts), stores[1], in_block=False)
            ref.release(1, sorted(experts))
            got = dict(zip(sorted(experts), tables.fetch(1, torch.tensor(experts)).tolist()))
            differs |= got != want
    finally:
        torch.topk = real_topk
    assert differs


def test_refusals_and_what_excludes_what(qmodel: CloverModel) -> None:
    pool = _pool(7, 8)
    assert "at least 8" in str(DeviceSlotTables.refusal(pool, 4, torch.device("cpu")))
    assert DeviceSlotTables.refusal(_pool(8, 8), 4, torch.device("cpu")) is None
    assert DeviceSlotTables.refusal(None, 4, torch.device("cpu")) == "no layer is streamed"
    assert "meta" in str(DeviceSlotTables.refusal(_pool(8, 8), 4, torch.device("meta")))
    with pytest.raises(ValueError, match="top_k"):
        DeviceSlotTables(_pool(8, 8), (0,), {0: torch.zeros(16, 8, dtype=torch.uint8)}, 16, 0)
    with pytest.raises(PlanError, match="placed model"):
        placer.set_device_pool(copy.deepcopy(qmodel), True)
    with pytest.raises(PlanError, match="exclude each other"):
        placed(qmodel, (1, 3), EXPERTS, zero_copy=True, device_pool=True)
    model = placed(qmodel, (1, 3), EXPERTS, zero_copy=True)
    with pytest.raises(PlanError, match="exclude each other"):
        placer.set_device_pool(model, True)
    model = placed(qmodel, (1, 3), EXPERTS, device_pool=True)
    with pytest.raises(PlanError, match="exclude each other"):
        placer.set_zero_copy(model, True)
    # the settings' expert fetch (engine.settings.GpuPaths.expert_fetch) asks on CUDA only
    rt = offload_runtime.runtime_of(placed(qmodel, (1, 3), EXPERTS, expert_fetch="device_tables"))
    assert rt is not None and rt.tables is None


def test_a_pool_too_small_is_refused_and_keeps_fetching_on_the_host(qmodel: CloverModel) -> None:
    text = tiny_text_config(vocab_size=128, layers=2, hidden=64, experts=8, experts_per_tok=6)
    cfg = parse_config(config_dict_for("clover_moe", text, SPECIAL))
    model = CloverModel(cfg, dtype=torch.float32, device="cpu")
    model.load_state_dict(random_state_dict(cfg, seed=3), strict=True)
    quantize_model_(model, make_policy())
    rt = apply_plan(model, SimplePlan((0,), (1,), 8), "cpu", device_pool=True)
    assert rt.tables is None and "at least 12" in rt.device_pool_refused
    assert offload_runtime.accounting(model)["device_pool"] is False
    cache = model.new_cache(16)
    model(torch.arange(5, 9), 0, cache)
    model(torch.tensor([3]), 4, cache)
    assert offload_runtime.accounting(model)["host_reads"] == 2  # the prompt and the step both fetched on the host


# --- AR steps of a model ---


@pytest.mark.parametrize("streamed,slots", [((1, 3), EXPERTS), ((0, 1, 2, 3), EXPERTS), ((0, 1, 2, 3), EXPERTS + 3),
                                            ((0, 1, 2, 3), 4 * EXPERTS)])
def test_device_tables_never_change_the_tokens(qmodel: CloverModel, streamed: tuple[int, ...], slots: int) -> None:
    """AR, then diffusion, then AR again on one model (the tables handed to the device after each prompt and back
    for the next prompt): the tokens of the all-resident model, and the same counters as the host pool's, blocks
    and their pins included: every AR step's and block pass's look-ups and copies are counted."""
    ar, diffusion = tokens(qmodel, "ar", 12), tokens(qmodel, "diffusion", 32)
    model = placed(qmodel, streamed, slots, device_pool=True)
    host = placed(qmodel, streamed, slots)
    rt = offload_runtime.runtime_of(model)
    assert rt is not None and rt.tables is not None
    for mode, want in (("ar", ar), ("diffusion", diffusion), ("ar", ar)):
        assert tokens(model, mode, len(want)) == want, mode
        assert tokens(host, mode, len(want)) == want, mode
        assert rt.tables.check() == []
    got, ref = offload_runtime.accounting(model), offload_runtime.accounting(host)
    assert got["device_pool"] and not ref["device_pool"]
    for key in ("slot_hits", "slot_misses", "evictions", "block_pin_evictions", "prefetched", "prefetch_hits",
                "prefetch_wasted", "h2d_bytes", "passes", "blocks", "passes_per_block",
                "distinct_experts_per_layer_block"):
        assert got[key] == ref[key], key
    # the two AR prompts only (diffusion's 8-token prompt is its first block's tail: no causal prompt forward)
    assert got["host_reads"] == 2 * len(streamed) < ref["host_reads"]


def test_device_ar_steps_read_nothing_on_the_host(qmodel: CloverModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """No host read in an AR step through the device tables (counted at ``Tensor.cpu``, ``tolist`` and ``item``);
    its look-ups are counted on the device and show in the accounting. The prompt's forward fetched on the host
    first; turned off, the tables come back and a step fetches on the host again."""
    model = placed(qmodel, (1, 2, 3), 2 * EXPERTS, device_pool=True, prefetch=True)
    cache = model.new_cache(32)
    model(torch.arange(5, 12), 0, cache)
    prompt = offload_runtime.accounting(model)
    assert prompt["host_reads"] == 3
    reads: list[str] = []
    for name in ("cpu", "tolist", "item"):
        plain = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda t, *a, _p=plain, _n=name, **kw: (reads.append(_n), _p(t, *a, **kw))[1])
    for pos in range(7, 10):
        model(torch.tensor([pos]), pos, cache)
    assert reads == []
    monkeypatch.undo()
    after = offload_runtime.accounting(model)
    assert after["host_reads"] == prompt["host_reads"]
    looked = lambda a: a["slot_hits"] + a["slot_misses"]  # noqa: E731
    assert looked(after) - looked(prompt) == 3 * 3 * TOPK  # 3 steps x 3 streamed layers x top-4
    assert after["prefetched"] > prompt["prefetched"] and after["passes"] == prompt["passes"] + 3
    assert placer.set_device_pool(model, False) == ""
    rt = offload_runtime.runtime_of(model)
    assert rt is not None and rt.tables is None and not offload_runtime.accounting(model)["device_pool"]
    model(torch.tensor([10]), 10, cache)
    assert offload_runtime.accounting(model)["host_reads"] == prompt["host_reads"] + 3


def test_a_blocks_passes_run_on_the_device_tables_with_its_pins(qmodel: CloverModel,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A diffusion block's passes (a one-token forward inside the block too) fetch through the device tables, which
    keep the block's pins: from the first pass to the block's end the streamed layers read nothing on the host
    beyond what the all-resident model reads (the CPU's routed compute over 128 pairs sizes its groups on the host;
    the fused kernel does not), where the host pool reads once per streamed layer and pass. The pins are released
    at end_block, and the next prompt takes the tables back to the host with none."""

    def block_reads(model: CloverModel) -> list[str]:
        cache = model.new_cache(64)
        model(torch.arange(5, 37), 0, cache, block_size=32, prefill=True)
        reads: list[str] = []
        with monkeypatch.context() as m:
            for name in ("cpu", "tolist", "item"):
                plain = getattr(torch.Tensor, name)
                m.setattr(torch.Tensor, name,
                          lambda t, *a, _p=plain, _n=name, **kw: (reads.append(_n), _p(t, *a, **kw))[1])
            offload_runtime.begin_block(model)
            model(torch.arange(40, 72), 32, cache, block_size=32, write_cache=False)
            model(torch.tensor([3]), 32, cache, block_size=32, write_cache=False)
            model(torch.arange(40, 72), 32, cache, block_size=32, write_cache=False)
            rt = offload_runtime.runtime_of(model)
            if rt is not None and rt.tables is not None:
                assert rt.block_passes == 3 and not rt.tables._gate_on  # (prefetch on the block's first pass only)
                assert int(rt.tables.pinned.sum()) > 0
            offload_runtime.end_block(model)
        return reads

    resident = placed(qmodel, (), EXPERTS)
    host = placed(qmodel, (1, 3), EXPERTS + 4)
    model = placed(qmodel, (1, 3), EXPERTS + 4, device_pool=True)
    rt = offload_runtime.runtime_of(model)
    assert rt is not None and rt.tables is not None and rt.pool is not None
    want = block_reads(resident)
    assert len(block_reads(host)) > len(want)  # its fetches' reads (and their lists)
    assert offload_runtime.accounting(host)["host_reads"] == 2 + 3 * 2  # the prompt's, and one per streamed layer and pass
    assert block_reads(model) == want
    assert rt.tables.on_device and not rt.tables.pinned.any() and rt.tables.check() == []
    acc = offload_runtime.accounting(model)
    assert acc["host_reads"] == 2 and acc["blocks"] == 1 and acc["passes_per_block"] == 3.0  # (the prompt's)
    assert 0 < acc["distinct_experts_per_layer_block"] <= EXPERTS
    assert acc["distinct_experts_per_layer_block"] == offload_runtime.accounting(host)["distinct_experts_per_layer_block"]
    model(torch.arange(5, 12), 0, model.new_cache(32))  # a prompt: the tables come back, with no pin
    assert not rt.tables.on_device and not rt.pool.block_pins


@pytest.mark.parametrize("device_pool", [True, False])
def test_a_forward_that_raised_leaves_no_expert_marked_in_use(qmodel: CloverModel, device_pool: bool) -> None:
    """A host-pool forward that raises after its fetch left its experts marked in use, so that no later forward
    could evict them (here the next prompt's layer found the 16-slot pool too small). Every forward now starts by
    releasing them; the prompt and an AR step through the device tables then run."""
    model = placed(qmodel, (1, 3), EXPERTS, device_pool=device_pool)
    rt = offload_runtime.runtime_of(model)
    assert rt is not None and rt.pool is not None
    cache = model.new_cache(32)
    bank = model.layers[3].mlp.experts
    real = bank.compute

    def fails(*args: object) -> None:
        raise RuntimeError("out of memory (simulated)")

    bank.compute = fails  # the streamed layer 3 raises after its experts were fetched
    with pytest.raises(RuntimeError, match="simulated"):
        model(torch.arange(5, 12), 0, cache)
    bank.compute = real
    assert rt.pool.in_use
    cache = model.new_cache(32)
    model(torch.arange(5, 12), 0, cache)  # through the host pool: its fetches find every slot free to evict
    model(torch.tensor([7]), 7, cache)
    assert not rt.pool.in_use
    if device_pool:
        assert rt.tables is not None and rt.tables.on_device and rt.tables.check() == []


def test_an_abandoned_block_is_closed_by_the_next_causal_forward(qmodel: CloverModel) -> None:
    """A diffusion block whose generator was dropped (or whose pass raised) never reached end_block: its pins
    would stay, and every later AR step would count as inside the block (pinning all it touches, never on the
    device tables). The next causal forward closes it."""
    model = placed(qmodel, (1, 3), EXPERTS, device_pool=True)
    rt = offload_runtime.runtime_of(model)
    assert rt is not None and rt.pool is not None and rt.tables is not None
    cache = model.new_cache(64)
    model(torch.arange(5, 37), 0, cache, block_size=32, prefill=True)
    offload_runtime.begin_block(model)
    model(torch.arange(40, 72), 32, cache, block_size=32, write_cache=False)
    assert rt.in_block and rt.tables.pinned.any()  # ... and the generator is dropped here
    cache = model.new_cache(32)
    model(torch.arange(5, 12), 0, cache)
    assert not rt.in_block and not rt.pool.block_pins and not rt.tables.pinned.any()
    model(torch.tensor([7]), 7, cache)
    assert rt.tables.on_device and rt.tables.check() == []


class _Stream:
    """Stands in for a CUDA stream on the CPU: records the waits the device tables issue."""

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: "_Stream") -> None:
        self.log.append((self.name, other.name))


def test_the_prefetch_stream_is_forked_and_joined_once_per_streamed_layer(
    qmodel: CloverModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA-only branch (the prefetch on a side stream), run on the CPU with stand-in streams: in every AR step
    each prefetch forks the side stream from the step's (side waits main) and the next streamed layer's fetch joins
    it (main waits side) before reading the tables, exactly once; the first fetch of a step waits for nothing (a
    recorded graph may not wait on a stream it never forked); the side stream reads the guess from the tables' own
    buffer. Same tokens."""
    import contextlib

    want = tokens(qmodel, "ar", 8)
    model = placed(qmodel, (0, 1, 3), EXPERTS, device_pool=True)
    rt = offload_runtime.runtime_of(model)
    assert rt is not None and rt.tables is not None
    log: list[tuple[str, str]] = []
    main, side = _Stream("main", log), _Stream("side", log)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    rt.tables.side = side  # type: ignore[assignment]
    guesses: list[torch.Tensor] = []
    real = rt.tables._prefetch
    monkeypatch.setattr(rt.tables, "_prefetch", lambda layer, idx: (guesses.append(idx), real(layer, idx))[1])
    assert tokens(model, "ar", 8) == want
    steps = 7  # 8 tokens: the prompt's forward and 7 steps
    assert log == [("side", "main"), ("main", "side")] * 2 * steps  # layers 0 -> 1 and 1 -> 3 prefetch
    assert all(g is rt.tables._guess for g in guesses) and len(guesses) == 2 * steps
    assert not rt.tables._forked and rt.tables.check() == []


def test_an_ar_step_through_device_tables_traces_as_one_graph(qmodel: CloverModel) -> None:
    """The compiler's proof that the step reads nothing on the host: one graph, no break, and the step graphs'
    cuts leave an AR step whole while a block pass is still cut at its streamed layers."""
    model = placed(qmodel, (1, 3), EXPERTS, device_pool=True)
    cache = model.new_cache(32)
    model(torch.arange(5, 12), 0, cache)
    assert step_graphs.cuts(model, 1) == {} and step_graphs.streamed_layers(model, TOPK) == []
    assert step_graphs.streamed_layers(model, 32 * TOPK) == [1, 3]  # a block pass still fetches on the host
    assert step_graphs.cuts(model, 32) == dict.fromkeys(range(LAYERS), "bank")  # (on the CPU every bank sizes
    # its groups on the host over 128 pairs)

    def step(tok: torch.Tensor) -> torch.Tensor:
        return model(tok, 7, cache, block_size=None, write_cache=False)

    tok = torch.tensor([9])
    step(tok)  # the tables go to the device here (CloverModel.forward), outside any trace
    try:
        assert_one_graph(step, tok)
        rt = offload_runtime.runtime_of(model)
        assert rt is not None and rt.tables is not None and rt.tables.check() == []
    finally:
        torch._dynamo.reset()


def run_traced(gm: torch.fx.GraphModule, example_inputs: object) -> object:
    """A dynamo backend that runs the traced graph as is (no inductor: the tests check tracing, not codegen)."""
    return gm.forward


def test_compile_layers_runs_device_table_steps_as_one_graph(qmodel: CloverModel) -> None:
    """compile_layers gives a model with device tables the whole-step graph (a fetching one gets none), and its
    tokens, prompt by prompt: each prompt takes the tables back to the host and the steps hand them over again."""
    from clover_desk.engine.kernels.fastpath import compile_layers

    want = tokens(qmodel, "ar", 12)
    model = placed(qmodel, (0, 2), EXPERTS, device_pool=True)
    torch._dynamo.reset()
    try:
        compile_layers(model, backend=run_traced)
        assert model.step_graph is not None
        assert tokens(model, "ar", 12) == want
        assert tokens(model, "ar", 12) == want
        rt = offload_runtime.runtime_of(model)
        assert rt is not None and rt.tables is not None and rt.tables.check() == []
    finally:
        torch._dynamo.reset()


@pytest.mark.heavy  # ~55 s of inductor compiles: make test-heavy (the AR-step graph test stays in make test)
def test_compiled_layers_run_block_passes_through_device_tables(qmodel: CloverModel) -> None:
    """A diffusion run through the compiled layers with a streamed layer on the device tables (the first pass of a
    block prefetches, the later ones not: two variants of the layer, no host read in either): the uncompiled
    tokens, the block's pins released, no host read from the first block on."""
    from clover_desk.engine.kernels.fastpath import compile_layers

    want = tokens(qmodel, "diffusion", 32)
    model = placed(qmodel, (2, 3), EXPERTS, device_pool=True)
    torch._dynamo.reset()
    try:
        compile_layers(model, backend=run_traced)
        assert tokens(model, "diffusion", 32) == want
        rt = offload_runtime.runtime_of(model)
        assert rt is not None and rt.tables is not None
        assert rt.tables.on_device and rt.tables.check() == [] and not rt.tables.pinned.any()
        acc = offload_runtime.accounting(model)
        assert acc["blocks"] >= 1 and acc["host_reads"] == 0 and acc["slot_misses"] > 0
    finally:
        torch._dynamo.reset()


def test_step_graph_pieces_run_device_table_steps_whole() -> None:
    """Through engine.kernels.step_graphs' pieces (as on a GPU, not recorded): an AR step is one piece, with the tokens."""
    from clover_desk.engine.decode.generate import generate_ar
    from tests.engine.test_step_graphs import PROMPT as SG_PROMPT
    from tests.engine.test_step_graphs import _quantized, _settings, _tokens

    model = _quantized((1, 2))
    want = _tokens(model, 40)
    assert placer.set_device_pool(model, True) == ""
    runner = step_graphs.StepGraphs(model, record=False)
    assert runner.pieces == step_graphs.pieces_of(4, {})
    model.step_graph = runner
    try:
        *_, done = generate_ar(model, SG_PROMPT, _settings(model.config, 40))
        assert list(done.token_ids) == want
    finally:
        model.step_graph = None
    assert runner.replays == 39 and runner.failed is None


def test_a_block_pass_through_device_tables_is_one_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.kernels.step_graphs' cuts for a block pass, where the routed compute reads nothing (the fused MoE kernel on a
    GPU, stood in for here): the host pool's pass leaves the graphs at each streamed layer's fetch, the device
    tables' pass is one piece, however the cuts are asked for (outside a block too). Diffusion through that one
    piece (run eagerly) decodes the host pool's tokens; after the prompt no forward fetches on the host."""
    from clover_desk.engine.decode.generate import generate_diffusion
    from tests.engine.test_step_graphs import PROMPT as SG_PROMPT
    from tests.engine.test_step_graphs import _quantized

    def _diffusion(model: CloverModel, n: int) -> tuple[list[int], int]:  # (as the engine runs it: with the hooks)
        s = DecodeSettings(mode="diffusion", max_new_tokens=n, block_size=model.config.block_size, threshold=0.9,
                           mask_token_id=256, eos_token_ids=(), max_positions=model.config.max_position_embeddings)
        *_, done = generate_diffusion(model, SG_PROMPT, s, hooks=loop_hooks(model))
        return list(done.token_ids), done.passes

    host, model = _quantized((1, 2)), _quantized((1, 2))
    assert placer.set_device_pool(model, True) == ""
    b = model.config.block_size
    with monkeypatch.context() as m:
        for mod in ("clover_desk.engine.weights.quant", "clover_desk.engine.placement.streamed_bank"):
            m.setattr(f"{mod}.rows_sync_free", lambda pairs, device, layout: True)
        assert step_graphs.cuts(host, b) == {1: "fetch", 2: "fetch"}
        assert step_graphs.cuts(model, b) == {}
        assert step_graphs.cuts(model, 1) == {}
    want, passes = _diffusion(host, 20)
    runner = step_graphs.StepGraphs(model, record=False, cut={})
    model.pass_graph = runner
    try:
        got, got_passes = _diffusion(model, 20)
    finally:
        model.pass_graph = None
    assert got == want and got_passes == passes and runner.pass_replays == passes
    acc, ref = offload_runtime.accounting(model), offload_runtime.accounting(host)
    assert acc["host_reads"] == 2 and acc["blocks"] == ref["blocks"] > 1  # the prompt's prefill (one per layer)
    for key in ("slot_hits", "slot_misses", "evictions", "prefetched", "h2d_bytes", "passes"):
        assert acc[key] == ref[key], key


# --- the copy kernel ---


CHILD = r'''
import torch
from clover_desk.engine.kernels.triton_copy import copy_rows

torch.manual_seed(0)
for r in (40, 4099 * 4, 37):  # 4-byte words (one full and a partial chunk), bytes
    src = torch.randint(0, 256, (16, r), dtype=torch.uint8)
    dst = torch.randint(0, 256, (9, r), dtype=torch.uint8)
    want = dst.clone()
    src_rows, dst_rows = torch.tensor([3, 15, 0, 7]), torch.tensor([8, 0, 4, 2])
    need = torch.tensor([True, False, True, True])
    for s, d, n in zip(src_rows.tolist(), dst_rows.tolist(), need.tolist()):
        if n:
            want[d] = src[s]
    copy_rows(src, dst, src_rows, dst_rows, need)
    assert torch.equal(dst, want), r
print("ok")
'''


def test_the_copy_kernel_copies_only_the_missing_rows() -> None:
    pytest.importorskip("triton")
    run_interpreted(CHILD)


# What both placing children start from: random expert rows of three layers and a pair of slot tables (tensor ops,
# kernel) over two fresh pools of the same size.
PLACE_SETUP = r'''
import random
import torch
from clover_desk.engine.placement.device_pool import DeviceSlotTables
from clover_desk.engine.placement.slot_pool import DeviceLedger, SlotPool

class Layout:
    nbytes = 40

E, K, LAYERS = 16, 4, (1, 2, 3)
rows = {i: torch.randint(0, 256, (E, 40), dtype=torch.uint8) for i in LAYERS}

def table_pair(slots):
    pools = [SlotPool(slots, Layout(), torch.device("cpu"), DeviceLedger(torch.device("cpu"))) for _ in range(2)]
    return (DeviceSlotTables(p, LAYERS, rows, E, K) for p in pools)
'''

PLACE_CHILD = PLACE_SETUP + r'''
for slots in (8, 11, 37):
    ops, kernel = table_pair(slots)
    kernel.use_kernel = True
    ops.push()
    kernel.push()
    rng = random.Random(slots)
    for step in range(40):
        for layer in LAYERS:
            experts = torch.tensor(rng.sample(range(E), K))
            assert all(torch.equal(a, b) for a, b in zip(ops._place(layer - 1, experts, True),
                                                         kernel._place(layer - 1, experts, True))), (slots, step)
            if layer != LAYERS[-1]:
                guess = torch.tensor(rng.sample(range(E), K))
                assert all(torch.equal(a, b) for a, b in zip(ops._place(layer, guess, False),
                                                             kernel._place(layer, guess, False))), (slots, step)
            for name in ("slot_of", "key_of", "stamp", "fresh", "tick", "counts"):
                assert torch.equal(getattr(ops, name), getattr(kernel, name)), (slots, step, name)
    assert int(ops.counts[5]) > 0 and int(ops.counts[3]) > 0  # evictions, prefetch hits: the cases were met
print("ok")
'''


def test_the_place_kernel_makes_the_tensor_ops_decisions() -> None:
    """The one-program placing (engine.kernels.triton_copy.place) against DeviceSlotTables' tensor ops, run by Triton's
    interpreter over random fetches and prefetches at three pool sizes: the same experts, slots and misses, and
    the same tables and counters after every call."""
    pytest.importorskip("triton")
    run_interpreted(PLACE_CHILD)


PLACE_SET_CHILD = PLACE_SETUP + r'''
TABLES = ("slot_of", "key_of", "stamp", "fresh", "pinned", "seen", "tick", "counts", "distinct")
for slots in (16, 21, 64):
    ops, kernel = table_pair(slots)
    kernel.use_kernel = kernel.set_kernel = True
    ops.push()
    kernel.push()
    rng = random.Random(slots)
    for step in range(16):
        first = step % 4 == 0
        for t in (ops, kernel):
            t.set_gate(first)
        for layer in LAYERS:
            if rng.random() < 0.3:  # an AR step's fetch between blocks (the k-entry kernel)
                experts = torch.tensor(rng.sample(range(E), K))
                for t in (ops, kernel):
                    t.fetch(layer, experts)
                continue
            present = torch.rand(E) < rng.random()
            a, b = ops._place_set(layer - 1, present, True), kernel._place_set(layer - 1, present, True)
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (slots, step, a, b)
            if layer != LAYERS[-1]:
                guess = torch.rand(E) < rng.random()
                a = ops._place_set(layer, guess & ops.gate, False)
                b = kernel._place_set(layer, guess, False)
                assert all(torch.equal(x, y) for x, y in zip(a, b)), (slots, step, a, b)
            for name in TABLES:
                assert torch.equal(getattr(ops, name), getattr(kernel, name)), (slots, step, name)
        if step % 4 == 3:
            for t in (ops, kernel):
                t.end_block(count=True)
    c = ops.counts.tolist()
    assert c[3] > 0 and c[2] > 0, c  # prefetch hits, prefetched: the cases were met
    if slots < 3 * E:  # (64 slots hold every expert of the three layers)
        assert c[5] > 0, c  # evictions
    if slots < 2 * E:
        assert c[7] > 0, c  # block-pin evictions
print("ok")
'''


def test_the_set_place_kernel_makes_the_tensor_ops_decisions() -> None:
    '''The block pass's one-program placing (engine.kernels.triton_copy.place_set: one sort of the packed slots) against
    DeviceSlotTables' tensor ops under Triton's interpreter, over random block fetches of any size, gated
    prefetches, AR fetches between them and block ends, at three pool sizes: the same slots and copies, and the
    same tables and counters after every call.'''
    pytest.importorskip("triton")
    run_interpreted(PLACE_SET_CHILD)


MODEL_CHILD = r'''
import copy
import torch
from clover_desk.engine.placement import offload_runtime, placer
from clover_desk.engine.weights.checkpoint import random_state_dict
from clover_desk.engine.model.config import parse_config
from clover_desk.engine.decode.generate import generate_ar
from clover_desk.engine.decode.generate import generate_diffusion
from clover_desk.engine.decode.loop_parts import loop_hooks
from clover_desk.engine.decode.settings import DecodeSettings
from clover_desk.engine.model.clover import CloverModel
from clover_desk.engine.weights.quant import make_policy, quantize_model_
from clover_desk.engine.weights.tiny import config_dict_for, tiny_text_config

text = tiny_text_config(vocab_size=128, layers=4, hidden=64, experts=16, experts_per_tok=4)
special = {"<|endoftext|>": 1, "<|im_end|>": 2, "<|mask|>": 3, "</think>": 4}
cfg = parse_config(config_dict_for("clover_moe", text, special))
base = CloverModel(cfg, dtype=torch.float32, device="cpu")
base.load_state_dict(random_state_dict(cfg, seed=7), strict=True)
quantize_model_(base, make_policy())
settings = DecodeSettings(mode="ar", max_new_tokens=10, mask_token_id=3, eos_token_ids=(), max_positions=256)
prompt = [5, 17, 33, 9, 60, 61, 2, 40]
want = list(generate_ar(base, prompt, settings))[-1].token_ids
model = copy.deepcopy(base)
rt = placer.apply_plan(model, placer.SimplePlan((0,), (1, 2, 3), 16), "cpu", device_pool=True)
rt.tables.use_kernel = rt.tables.set_kernel = True  # the three kernels, interpreted, in every AR step and pass
got = list(generate_ar(model, prompt, settings))[-1].token_ids
assert got == want, (got, want)
assert rt.tables.check() == []
misses, prefetched = int(rt.tables.counts[1]), int(rt.tables.counts[2])  # the AR steps' own (device counters)
assert misses > 0 and prefetched > 0, (misses, prefetched)
diffusion = DecodeSettings(mode="diffusion", max_new_tokens=24, mask_token_id=3, eos_token_ids=(), block_size=32,
                           threshold=0.08, max_positions=256)
want = list(generate_diffusion(base, prompt, diffusion))[-1].token_ids
got = list(generate_diffusion(model, prompt, diffusion, hooks=loop_hooks(model)))[-1].token_ids
assert got == want, (got, want)
assert rt.tables.on_device and rt.tables.check() == [] and not rt.tables.pinned.any()
acc = offload_runtime.accounting(model)
assert acc["blocks"] == 1 and acc["passes_per_block"] > 1 and acc["slot_misses"] > misses, acc
print("ok")
'''


def test_ar_steps_and_block_passes_through_the_kernels_decode_the_same_tokens() -> None:
    """A model whose streamed layers fetch through the three kernels (interpreted): AR steps, then a diffusion
    block, with the all-resident model's tokens."""
    pytest.importorskip("triton")
    run_interpreted(MODEL_CHILD)


# --- on a GPU ---


@pytest.mark.gpu
def test_device_table_steps_are_one_cuda_graph_without_a_sync() -> None:
    """On a GPU: the AR step with device tables is one recorded CUDA graph (the prefetch forked to its stream and
    joined inside it), with the tokens of the host pool's uncaptured steps, and no sync."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("bitsandbytes")
    from tests.engine.test_step_graphs import _quantized, _replays_decode, _steps_never_sync, _tokens

    want = _tokens(_quantized((1, 3), "cuda", pool_layers=1, device_pool=False), 300)
    graphed = _quantized((1, 3), "cuda", pool_layers=1, device_pool=True)
    rt = offload_runtime.runtime_of(graphed)
    assert rt is not None and rt.tables is not None, rt.device_pool_refused if rt else None
    runner = step_graphs.StepGraphs(graphed)
    assert runner.pieces == step_graphs.pieces_of(4, {})
    _replays_decode(graphed, runner, want, recorded=2)
    assert rt.tables.check() == []
    _steps_never_sync(graphed)


@pytest.mark.gpu
def test_device_table_block_passes_are_one_cuda_graph_without_a_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU with the fused MoE kernel: a diffusion block's pass through the device tables is one recorded CUDA
    graph (no piece cut at the streamed layers), replayed without a sync, with the logits of the host pool's
    uncaptured pass; the block's pins are released at its end."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton")
    from tests.engine.test_step_graphs import PROMPT as SG_PROMPT
    from tests.engine.test_step_graphs import tiny_config, tiny_model

    monkeypatch.setattr(triton_moe, "_enabled", True)
    gpu = torch.device("cuda")

    def first_pass(device_pool: bool) -> tuple[CloverModel, object, torch.Tensor, torch.Tensor]:
        model = tiny_model(tiny_config(moe_block_coreset_enabled=True), seed=5, dtype=torch.bfloat16)
        quantize_model_(model, make_policy())
        apply_plan(model, SimplePlan((0, 2), (1, 3), 2 * model.config.num_experts), "cuda", device_pool=device_pool)
        b = model.config.block_size
        cache = model.new_cache(64)
        model(torch.tensor(SG_PROMPT[:b], device=gpu), 0, cache, block_size=b, write_cache=True)
        offload_runtime.begin_block(model)
        block = torch.tensor((SG_PROMPT * 2)[b : 2 * b], device=gpu)
        return model, cache, block, model(block, b, cache, block_size=b, write_cache=False)

    *_, want = first_pass(False)
    model, cache, block, _ = first_pass(True)
    rt = offload_runtime.runtime_of(model)
    assert rt is not None and rt.tables is not None and rt.tables.on_device, rt.device_pool_refused if rt else None
    b = model.config.block_size
    runner = step_graphs.StepGraphs(model)
    assert runner.pieces_for(b) == step_graphs.pieces_of(4, {})
    model.pass_graph = runner
    model(block, b, cache, block_size=b, write_cache=False)  # records
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = model(block, b, cache, block_size=b, write_cache=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert runner.failed is None and runner.recorded == 1 and runner.pass_replays == 2
    assert (got - want).abs().max() < 2e-2 * want.abs().max()
    offload_runtime.end_block(model)
    assert not rt.tables.pinned.any() and rt.tables.check() == []
