"""Device slot tables (``engine.device_pool``): the host pool's decisions made on the device, AR steps through them
with the tokens of the host pool and no host read, one traced graph, the ownership hand-overs, the refusals, and the
Triton copy kernel under the interpreter."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator

import pytest
import torch

from engine import offload, step_graphs
from engine.checkpoint import random_state_dict
from engine.config import parse_config
from engine.device_pool import DeviceSlotTables
from engine.errors import PlanError
from engine.events import Finished
from engine.generate import DecodeSettings, LoopHooks, generate
from engine.model import CloverModel
from engine.offload import HostExpertStore, SimplePlan, SlotPool, apply_plan
from engine.quant import make_policy, quantize_model_
from engine.tiny import config_dict_for, tiny_text_config
from tests.triton_child import run_interpreted

MASK = 3
SPECIAL = {"<|endoftext|>": 1, "<|im_end|>": 2, "<|mask|>": MASK, "</think>": 4}
LAYERS, EXPERTS, TOPK = 4, 16, 4
PROMPT = [5, 17, 33, 9, 60, 61, 2, 40]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def qmodel() -> CloverModel:
    text = tiny_text_config(vocab_size=128, layers=LAYERS, hidden=64, experts=EXPERTS, experts_per_tok=TOPK)
    cfg = parse_config(config_dict_for("clover_moe", text, SPECIAL))
    model = CloverModel(cfg, dtype=torch.float32, device="cpu")
    model.load_state_dict(random_state_dict(cfg, seed=7), strict=True)
    quantize_model_(model, make_policy())
    model.eval()
    return model


def placed(qmodel: CloverModel, streamed: tuple[int, ...], slots: int, **kwargs: object) -> CloverModel:
    model = copy.deepcopy(qmodel)
    resident = tuple(i for i in range(LAYERS) if i not in streamed)
    apply_plan(model, SimplePlan(resident, streamed, slots), "cpu", **kwargs)
    return model


def tokens(model: CloverModel, mode: str, n: int) -> tuple[int, ...]:
    settings = DecodeSettings(mode=mode, max_new_tokens=n, mask_token_id=MASK, eos_token_ids=(), block_size=32,
                              threshold=0.08, max_positions=256)
    hooks = LoopHooks(begin_block=lambda: offload.begin_block(model), end_block=lambda: offload.end_block(model))
    fin = list(generate(model, PROMPT, settings, hooks=hooks))[-1]
    assert isinstance(fin, Finished)
    return fin.token_ids


# --- the tables against the host pool, decision for decision ---


class _Layout:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def _pool(slots: int, row_bytes: int) -> SlotPool:
    return SlotPool(slots, _Layout(row_bytes), torch.device("cpu"), offload.DeviceLedger(torch.device("cpu")))


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


def test_refusals_and_what_excludes_what(qmodel: CloverModel, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = _pool(7, 8)
    assert "at least 8" in str(DeviceSlotTables.refusal(pool, 4, torch.device("cpu")))
    assert DeviceSlotTables.refusal(_pool(8, 8), 4, torch.device("cpu")) is None
    assert DeviceSlotTables.refusal(None, 4, torch.device("cpu")) == "no layer is streamed"
    assert "meta" in str(DeviceSlotTables.refusal(_pool(8, 8), 4, torch.device("meta")))
    with pytest.raises(ValueError, match="top_k"):
        DeviceSlotTables(_pool(8, 8), (0,), {0: torch.zeros(16, 8, dtype=torch.uint8)}, 16, 0)
    with pytest.raises(PlanError, match="placed model"):
        offload.set_device_pool(copy.deepcopy(qmodel), True)
    with pytest.raises(PlanError, match="exclude each other"):
        placed(qmodel, (1, 3), EXPERTS, zero_copy=True, device_pool=True)
    model = placed(qmodel, (1, 3), EXPERTS, zero_copy=True)
    with pytest.raises(PlanError, match="exclude each other"):
        offload.set_device_pool(model, True)
    model = placed(qmodel, (1, 3), EXPERTS, device_pool=True)
    with pytest.raises(PlanError, match="exclude each other"):
        offload.set_zero_copy(model, True)
    monkeypatch.setenv(offload.DEVICE_POOL_ENV, "1")  # the environment asks on CUDA only
    rt = offload.runtime_of(placed(qmodel, (1, 3), EXPERTS))
    assert rt is not None and rt.tables is None


def test_a_pool_too_small_is_refused_and_keeps_fetching_on_the_host(qmodel: CloverModel) -> None:
    text = tiny_text_config(vocab_size=128, layers=2, hidden=64, experts=8, experts_per_tok=6)
    cfg = parse_config(config_dict_for("clover_moe", text, SPECIAL))
    model = CloverModel(cfg, dtype=torch.float32, device="cpu")
    model.load_state_dict(random_state_dict(cfg, seed=3), strict=True)
    quantize_model_(model, make_policy())
    rt = apply_plan(model, SimplePlan((0,), (1,), 8), "cpu", device_pool=True)
    assert rt.tables is None and "at least 12" in rt.device_pool_refused
    assert offload.accounting(model)["device_pool"] is False
    cache = model.new_cache(16)
    model(torch.arange(5, 9), 0, cache)
    model(torch.tensor([3]), 4, cache)
    assert offload.accounting(model)["host_reads"] == 2  # the prompt and the step both fetched on the host


# --- AR steps of a model ---


@pytest.mark.parametrize("streamed,slots", [((1, 3), EXPERTS), ((0, 1, 2, 3), EXPERTS), ((0, 1, 2, 3), EXPERTS + 3),
                                            ((0, 1, 2, 3), 4 * EXPERTS)])
def test_device_tables_never_change_the_tokens(qmodel: CloverModel, streamed: tuple[int, ...], slots: int) -> None:
    """AR, then diffusion, then AR again on one model (the tables handed to the device for each run of steps and
    back for each prompt and block pass): the tokens of the all-resident model, and the same counters as the host
    pool's: every AR step's looks-ups and copies are counted."""
    ar, diffusion = tokens(qmodel, "ar", 12), tokens(qmodel, "diffusion", 32)
    model = placed(qmodel, streamed, slots, device_pool=True)
    host = placed(qmodel, streamed, slots)
    rt = offload.runtime_of(model)
    assert rt is not None and rt.tables is not None
    for mode, want in (("ar", ar), ("diffusion", diffusion), ("ar", ar)):
        assert tokens(model, mode, len(want)) == want, mode
        assert tokens(host, mode, len(want)) == want, mode
        assert rt.tables.check() == []
    got, ref = offload.accounting(model), offload.accounting(host)
    assert got["device_pool"] and not ref["device_pool"]
    for key in ("slot_hits", "slot_misses", "evictions", "prefetched", "prefetch_hits", "prefetch_wasted",
                "h2d_bytes", "passes", "blocks"):
        assert got[key] == ref[key], key
    assert got["host_reads"] < ref["host_reads"]


def test_device_ar_steps_read_nothing_on_the_host(qmodel: CloverModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """No host read in an AR step through the device tables (counted at ``Tensor.cpu``, ``tolist`` and ``item``);
    its look-ups are counted on the device and show in the accounting. The prompt's forward fetched on the host
    first; turned off, the tables come back and a step fetches on the host again."""
    model = placed(qmodel, (1, 2, 3), 2 * EXPERTS, device_pool=True, prefetch=True)
    cache = model.new_cache(32)
    model(torch.arange(5, 12), 0, cache)
    prompt = offload.accounting(model)
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
    after = offload.accounting(model)
    assert after["host_reads"] == prompt["host_reads"]
    looked = lambda a: a["slot_hits"] + a["slot_misses"]  # noqa: E731
    assert looked(after) - looked(prompt) == 3 * 3 * TOPK  # 3 steps x 3 streamed layers x top-4
    assert after["prefetched"] > prompt["prefetched"] and after["passes"] == prompt["passes"] + 3
    assert offload.set_device_pool(model, False) == ""
    rt = offload.runtime_of(model)
    assert rt is not None and rt.tables is None and not offload.accounting(model)["device_pool"]
    model(torch.tensor([10]), 10, cache)
    assert offload.accounting(model)["host_reads"] == prompt["host_reads"] + 3


def test_a_one_token_pass_inside_a_block_stays_with_the_host_pool(qmodel: CloverModel) -> None:
    """A diffusion block's pins live in the host pool: a one-token forward inside a block fetches there (the tables
    stay with the host, the pins are kept); after the block an AR step takes the tables to the device."""
    model = placed(qmodel, (1, 3), EXPERTS, device_pool=True)
    rt = offload.runtime_of(model)
    assert rt is not None and rt.tables is not None and rt.pool is not None
    cache = model.new_cache(64)
    model(torch.arange(5, 37), 0, cache, block_size=32, prefill=True)
    offload.begin_block(model)
    model(torch.arange(40, 72), 32, cache, block_size=32, write_cache=False)
    reads = offload.accounting(model)["host_reads"]
    model(torch.tensor([3]), 32, cache, block_size=32, write_cache=False)
    assert not rt.tables.on_device and rt.pool.block_pins
    assert offload.accounting(model)["host_reads"] == reads + 2  # both streamed layers fetched on the host
    offload.end_block(model)
    model(torch.tensor([3]), 32, cache)
    assert rt.tables.on_device and rt.tables.check() == []


@pytest.mark.parametrize("device_pool", [True, False])
def test_a_forward_that_raised_leaves_no_expert_marked_in_use(qmodel: CloverModel, device_pool: bool) -> None:
    """A host-pool forward that raises after its fetch left its experts marked in use, so that no later forward
    could evict them (here the next prompt's layer found the 16-slot pool too small). Every forward now starts by
    releasing them; the prompt and an AR step through the device tables then run."""
    model = placed(qmodel, (1, 3), EXPERTS, device_pool=device_pool)
    rt = offload.runtime_of(model)
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
    rt = offload.runtime_of(model)
    assert rt is not None and rt.pool is not None and rt.tables is not None
    cache = model.new_cache(64)
    model(torch.arange(5, 37), 0, cache, block_size=32, prefill=True)
    offload.begin_block(model)
    model(torch.arange(40, 72), 32, cache, block_size=32, write_cache=False)
    assert rt.in_block and rt.pool.block_pins  # ... and the generator is dropped here
    cache = model.new_cache(32)
    model(torch.arange(5, 12), 0, cache)
    assert not rt.in_block and not rt.pool.block_pins
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
    rt = offload.runtime_of(model)
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
        torch._dynamo.reset()
        explained = torch._dynamo.explain(step)(tok)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), [
            str(b.reason)[:200] for b in explained.break_reasons
        ]
        torch._dynamo.reset()
        compiled = torch.compile(step, backend="eager", fullgraph=True)
        assert (compiled(tok) - step(tok)).abs().max() < 1e-5
        rt = offload.runtime_of(model)
        assert rt is not None and rt.tables is not None and rt.tables.check() == []
    finally:
        torch._dynamo.reset()


def test_compile_layers_runs_device_table_steps_as_one_graph(qmodel: CloverModel) -> None:
    """compile_layers gives a model with device tables the whole-step graph (a fetching one gets none), and its
    tokens, prompt by prompt: each prompt takes the tables back to the host and the steps hand them over again."""
    from engine.fastpath import compile_layers

    def run_traced(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        return gm.forward

    want = tokens(qmodel, "ar", 12)
    model = placed(qmodel, (0, 2), EXPERTS, device_pool=True)
    torch._dynamo.reset()
    try:
        compile_layers(model, backend=run_traced)
        assert model.step_graph is not None
        assert tokens(model, "ar", 12) == want
        assert tokens(model, "ar", 12) == want
        rt = offload.runtime_of(model)
        assert rt is not None and rt.tables is not None and rt.tables.check() == []
    finally:
        torch._dynamo.reset()


def test_step_graph_pieces_run_device_table_steps_whole() -> None:
    """Through engine.step_graphs' pieces (as on a GPU, not recorded): an AR step is one piece, with the tokens."""
    from tests.test_step_graphs import PROMPT as SG_PROMPT, _quantized, _settings, _tokens
    from engine.generate import generate_ar

    model = _quantized((1, 2))
    want = _tokens(model, 40)
    assert offload.set_device_pool(model, True) == ""
    runner = step_graphs.StepGraphs(model, record=False)
    assert runner.pieces == step_graphs.pieces_of(4, {})
    model.step_graph = runner
    try:
        *_, done = generate_ar(model, SG_PROMPT, _settings(model.config, 40))
        assert list(done.token_ids) == want
    finally:
        model.step_graph = None
    assert runner.replays == 39 and runner.failed is None


# --- the copy kernel ---


CHILD = r'''
import torch
from engine.triton_copy import copy_rows

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


PLACE_CHILD = r'''
import random
import torch
from engine.device_pool import DeviceSlotTables
from engine.offload import DeviceLedger, SlotPool

class Layout:
    nbytes = 40

E, K, LAYERS = 16, 4, (1, 2, 3)
rows = {i: torch.randint(0, 256, (E, 40), dtype=torch.uint8) for i in LAYERS}
for slots in (8, 11, 37):
    pools = [SlotPool(slots, Layout(), torch.device("cpu"), DeviceLedger(torch.device("cpu"))) for _ in range(2)]
    ops, kernel = (DeviceSlotTables(p, LAYERS, rows, E, K) for p in pools)
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
    """The one-program placing (engine.triton_copy.place) against DeviceSlotTables' tensor ops, run by Triton's
    interpreter over random fetches and prefetches at three pool sizes: the same experts, slots and misses, and
    the same tables and counters after every call."""
    pytest.importorskip("triton")
    run_interpreted(PLACE_CHILD)


MODEL_CHILD = r'''
import copy
import torch
from engine import offload
from engine.checkpoint import random_state_dict
from engine.config import parse_config
from engine.generate import DecodeSettings, generate_ar
from engine.model import CloverModel
from engine.quant import make_policy, quantize_model_
from engine.tiny import config_dict_for, tiny_text_config

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
rt = offload.apply_plan(model, offload.SimplePlan((0,), (1, 2, 3), 16), "cpu", device_pool=True)
rt.tables.use_kernel = True  # both kernels, interpreted, in every AR step
got = list(generate_ar(model, prompt, settings))[-1].token_ids
assert got == want, (got, want)
assert rt.tables.check() == []
misses, prefetched = int(rt.tables.counts[1]), int(rt.tables.counts[2])  # the AR steps' own (device counters)
assert misses > 0 and prefetched > 0, (misses, prefetched)
print("ok")
'''


def test_ar_steps_through_both_kernels_decode_the_same_tokens() -> None:
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
    from tests.test_step_graphs import _steps_never_sync, _tokens, tiny_config, tiny_model

    def on_gpu(device_pool: bool) -> CloverModel:
        model = tiny_model(tiny_config(), seed=5)
        quantize_model_(model, make_policy())
        apply_plan(model, SimplePlan((0, 2), (1, 3), model.config.num_experts), "cuda", device_pool=device_pool)
        return model

    want = _tokens(on_gpu(False), 300)
    graphed = on_gpu(True)
    rt = offload.runtime_of(graphed)
    assert rt is not None and rt.tables is not None, rt.device_pool_refused if rt else None
    runner = step_graphs.StepGraphs(graphed)
    assert runner.pieces == step_graphs.pieces_of(4, {})
    graphed.step_graph = runner
    assert _tokens(graphed, 300) == want
    assert runner.failed is None and runner.recorded == 2 and runner.replays == 299
    assert rt.tables.check() == []
    _steps_never_sync(graphed)
