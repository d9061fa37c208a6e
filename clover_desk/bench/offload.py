"""``clover-desk bench offload``: host-to-device expert bytes per committed token under a VRAM plan.

Default: the 35B-A3B shapes (``engine.placement.planner.manifest_for_shape``) planned for a 16 GB card. A synthetic routing
trace (Zipf-like expert popularity per layer, a per-block topic, per-position noise that persists across the
denoising passes of a block) is calibrated so one 32-position pass touches ~70 of 256 experts per layer (the
measured LLaDA2.0-mini figure) and is run through the real slot pool / LRU / block-pin code of
``engine.placement.slot_pool``, with rows of a few bytes standing in for the 1.77 MB experts (bytes are counted at full size).

Modes: ``--tiny`` runs a tiny random model end to end on the CPU (real quantized weights, real streaming, real
generation loop); ``--gpu`` runs the prepared device check (full-size INT4 experts in pinned memory, 16 GiB cap,
H2D GB/s, AR tok/s and diffusion passes/s of the expert path, a block's coreset load time); without CUDA it says so
and exits 2. Only figures are printed; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clover_desk.cli import flags
from clover_desk.engine.defaults import DEFAULT_CTX_TOKENS
from clover_desk.engine.placement.hardware import DEFAULT_HARDWARE

log = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shape", default="clover-35b-a3b", help="model shape for the planner (default clover-35b-a3b)"
    )
    parser.add_argument("--vram-gb", dest="vram_budget_bytes", type=flags.vram_budget, default=16 * flags.GIB_BYTES, help="VRAM budget in GiB (default 16)")
    parser.add_argument("--ctx", type=flags.TOKENS, default=DEFAULT_CTX_TOKENS, help=f"context tokens the plan reserves (default {DEFAULT_CTX_TOKENS})")
    parser.add_argument("--tokens-per-pass", type=flags.number(0.0, 32.0, lo_open=True), default=3.0, help="committed tokens per denoising pass (TPF)")
    parser.add_argument(
        "--target-distinct", type=flags.number(8.0, 160.0), default=70.0,
        help="distinct experts per 32-slot pass to calibrate to (8 to 160: uniform routing touches ~163 of 256)"
    )
    parser.add_argument(
        "--block-reuse",
        type=flags.number(1.0, 32.0),
        default=1.3,
        help="block working set / per-pass distinct experts to calibrate to (planner's assumption 1.3)",
    )
    parser.add_argument("--blocks", type=flags.integer(1, 1_000), default=8, help="diffusion blocks to simulate (after one warm-up block)")
    parser.add_argument("--seed", type=flags.SEED, default=0)
    parser.add_argument("--tiny", action="store_true", help="end to end on a tiny random model on the CPU")
    parser.add_argument("--gpu", action="store_true", help="the device check (needs CUDA)")
    parser.add_argument("--gpu-mem-gb", type=flags.GIB, default=16.0, help="--gpu: cap the process at this much GPU memory")


def run(args: argparse.Namespace) -> int:
    if args.gpu:
        return run_gpu_check(args)
    if args.tiny:
        return run_tiny(args)
    return run_simulation(args)


# ---------------------------------------------------------------------------------------------------------------
# Routing trace
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class TraceModel:
    """Router logits = layer popularity (Zipf-like, exponent ``alpha``) + block topic + position noise.

    Noise persists across the passes of a block (correlation ``rho``: the temporal consistency TEAM reports)."""

    experts: int = 256
    top_k: int = 8
    alpha: float = 1.0
    topic_std: float = 1.0
    noise_std: float = 1.0
    rho: float = 0.9


class RoutingTrace:
    def __init__(self, model: TraceModel, layers: int, seed: int) -> None:
        import torch

        self.m = model
        self.layers = layers
        self.gen = torch.Generator().manual_seed(seed)
        ranks = torch.stack([torch.randperm(model.experts, generator=self.gen) for _ in range(layers)])  # [L, E]
        self.popularity = -model.alpha * torch.log1p(ranks.float())  # [L, E] Zipf-like logits

    def block(self, positions: int, passes: int) -> Any:
        """Router logits [passes, L, positions, E] for one block."""
        import torch

        m = self.m
        topic = torch.randn(self.layers, 1, m.experts, generator=self.gen) * m.topic_std  # [L, 1, E]
        noise = torch.randn(self.layers, positions, m.experts, generator=self.gen)  # [L, T, E]
        out = []
        for _ in range(passes):
            out.append(self.popularity[:, None, :] + topic + m.noise_std * noise)
            fresh = torch.randn(self.layers, positions, m.experts, generator=self.gen)
            noise = m.rho * noise + math.sqrt(1 - m.rho**2) * fresh
        return torch.stack(out)  # [P, L, T, E]

    def route(self, logits: Any, coreset: bool, block_size: int, top_p: float = 0.9) -> list[list[int]]:
        """Distinct experts per layer for one pass: logits [L, T, E] -> [[expert ids] per layer]."""
        import torch

        from clover_desk.engine.model.moe import block_coreset_topk

        out = []
        for layer_logits in logits:
            if coreset:
                probs = torch.softmax(layer_logits, dim=-1)
                _, idx = block_coreset_topk(probs, block_size, self.m.top_k, top_p)
            else:
                idx = layer_logits.topk(self.m.top_k, dim=-1).indices
            out.append(torch.unique(idx).tolist())
        return out


def mean_distinct_per_pass(model: TraceModel, positions: int = 32, samples: int = 6, seed: int = 1) -> float:
    tr = RoutingTrace(model, 4, seed)
    counts = []
    for _ in range(samples):
        logits = tr.block(positions, 1)[0]
        counts += [len(x) for x in tr.route(logits, False, positions)]
    return sum(counts) / len(counts)


def block_reuse_factor(model: TraceModel, passes: int, samples: int = 3, seed: int = 2) -> float:
    """Distinct experts of a block's layer over all its passes / distinct per pass."""
    tr = RoutingTrace(model, 4, seed)
    ratios = []
    for _ in range(samples):
        logits = tr.block(32, passes)
        per_pass = [tr.route(logits[p], False, 32) for p in range(passes)]
        for layer in range(4):
            union = set().union(*(set(r[layer]) for r in per_pass))
            ratios.append(len(union) / (sum(len(r[layer]) for r in per_pass) / passes))
    return sum(ratios) / len(ratios)


def calibrate(target: float, base: TraceModel, reuse: float, passes: int) -> TraceModel:
    """Bisect the popularity exponent so a 32-position pass touches ``target`` distinct experts on average, then
    the pass-to-pass noise correlation so a block's working set is ``reuse`` x a pass's."""
    lo, hi = 0.0, 4.0
    for _ in range(12):
        mid = (lo + hi) / 2
        d = mean_distinct_per_pass(TraceModel(**{**base.__dict__, "alpha": mid}), samples=4)
        if d > target:
            lo = mid  # too spread: more skew
        else:
            hi = mid
    tm = TraceModel(**{**base.__dict__, "alpha": (lo + hi) / 2})
    lo, hi = 0.0, 1.0
    for _ in range(8):
        mid = (lo + hi) / 2
        if block_reuse_factor(TraceModel(**{**tm.__dict__, "rho": mid}), passes) > reuse:
            lo = mid  # the block drifts too much: more consistency
        else:
            hi = mid
    return TraceModel(**{**tm.__dict__, "rho": (lo + hi) / 2})


# ---------------------------------------------------------------------------------------------------------------
# Simulation through the real slot pool
# ---------------------------------------------------------------------------------------------------------------


def _sim_pool(slots: int, experts: int, layers: list[int]) -> tuple[Any, dict[int, Any]]:
    import torch

    from clover_desk.engine.placement.expert_store import HostExpertStore
    from clover_desk.engine.placement.slot_pool import DeviceLedger, SlotPool
    from clover_desk.engine.weights.quant import ExpertLayout

    layout = ExpertLayout.build(experts, 16, 8, "nf4", 64)  # a stand-in row of a few hundred bytes
    pool = SlotPool(slots, layout, torch.device("cpu"), DeviceLedger(torch.device("cpu")))
    stores = {
        i: HostExpertStore(i, torch.zeros(experts, layout.nbytes, dtype=torch.uint8), False) for i in layers
    }
    return pool, stores


def _pass(pool: Any, stores: dict[int, Any], routed: list[list[int]], streamed: list[int], in_block: bool) -> None:
    for layer in streamed:
        experts = routed[layer]
        pool.acquire(layer, experts, stores[layer], in_block=in_block)
        pool.release(layer, experts)


def simulate_ar(plan: Any, tm: TraceModel, n_layers: int, tokens: int, seed: int) -> dict[str, float]:
    streamed = list(plan.streamed_expert_layers)
    pool, stores = _sim_pool(plan.slot_pool_experts, tm.experts, streamed)
    tr = RoutingTrace(tm, n_layers, seed)
    done = 0
    warm = 64
    while done < tokens + warm:
        window = tr.block(32, 1)[0]  # a 32-token topic window, one position per AR step
        for t in range(32):
            routed = tr.route(window[:, t : t + 1], False, 1)
            _pass(pool, stores, routed, streamed, in_block=False)
            pool.end_block()
            done += 1
            if done == warm:
                pool.stats.__init__()
    st = pool.stats
    return {
        "misses_per_token": st.slot_misses / tokens,
        "hit_rate": st.slot_hits / max(1, st.slot_hits + st.slot_misses),
    }


def simulate_diffusion(
    plan: Any,
    tm: TraceModel,
    n_layers: int,
    blocks: int,
    passes: int,
    coreset: bool,
    seed: int,
    pin_blocks: bool = True,
) -> dict[str, float]:
    streamed = list(plan.streamed_expert_layers)
    pool, stores = _sim_pool(plan.slot_pool_experts, tm.experts, streamed)
    tr = RoutingTrace(tm, n_layers, seed)
    distinct_pass, distinct_block = [], []
    for b in range(blocks + 1):
        if b == 1:
            pool.stats.__init__()
            distinct_pass, distinct_block = [], []
        logits = tr.block(32, passes)
        union: dict[int, set[int]] = {}
        for p in range(passes):
            routed = tr.route(logits[p], coreset, 32)
            for layer in range(n_layers):
                union.setdefault(layer, set()).update(routed[layer])
                distinct_pass.append(len(routed[layer]))
            _pass(pool, stores, routed, streamed, in_block=pin_blocks)
            if not pin_blocks:
                pool.end_block()
        distinct_block += [len(u) for u in union.values()]
        pool.end_block()
    st = pool.stats
    return {
        "misses_per_block": st.slot_misses / blocks,
        "hit_rate": st.slot_hits / max(1, st.slot_hits + st.slot_misses),
        "distinct_per_pass": sum(distinct_pass) / len(distinct_pass),
        "distinct_per_block": sum(distinct_block) / len(distinct_block),
        "block_pin_evictions": st.block_pin_evictions / blocks,
    }


def run_simulation(args: argparse.Namespace) -> int:
    import torch

    from clover_desk.engine.errors import CloverError

    torch.set_num_threads(1)  # tiny [32, 256] ops: threads only add contention
    from clover_desk.engine.placement.planner import manifest_for_shape, plan_model

    try:
        manifest = manifest_for_shape(args.shape)
        plan = plan_model(manifest, args.vram_budget_bytes, args.ctx, DEFAULT_HARDWARE)
    except CloverError as exc:
        print(f"error: {exc}")
        return 2
    if not plan.fits:
        print(f"plan does not fit {args.vram_budget_bytes / GiB:g} GiB: {plan.reason}")
        return 2
    geo = manifest.geometry
    row = max(-(-b // geo.num_experts) for b in manifest.expert_layer_bytes().values())
    n_layers = geo.num_hidden_layers
    passes = int(round(32 / args.tokens_per_pass)) + 1  # denoising passes + the commit pass
    print(
        f"plan: {args.shape} at {args.vram_budget_bytes / GiB:g} GiB, ctx {args.ctx}: {len(plan.resident_expert_layers)} resident, "
        f"{len(plan.streamed_expert_layers)} streamed expert layers, slot pool {plan.slot_pool_experts} experts "
        f"({plan.slot_pool_experts * row / GiB:.2f} GiB), expert row {row:,} B"
    )
    t0 = time.perf_counter()
    base = TraceModel(experts=geo.num_experts, top_k=geo.num_experts_per_tok)
    tm = calibrate(args.target_distinct, base, args.block_reuse, passes)
    achieved = mean_distinct_per_pass(tm, samples=8, seed=args.seed + 11)
    reuse = block_reuse_factor(tm, passes, seed=args.seed + 12)
    print(
        f"routing trace: Zipf exponent {tm.alpha:.3f}, topic std {tm.topic_std}, pass-to-pass noise correlation "
        f"{tm.rho:.3f}; calibrated distinct experts per 32-slot pass: {achieved:.1f} of {geo.num_experts} "
        f"(target {args.target_distinct:g}), block working set {reuse:.2f}x a pass (target {args.block_reuse:g})"
    )

    ar = simulate_ar(plan, tm, n_layers, tokens=32 * args.blocks, seed=args.seed)
    ar_bytes = ar["misses_per_token"] * row
    print(
        f"AR: {ar['misses_per_token']:.1f} expert loads/token (slot hit rate {ar['hit_rate']:.1%}) = "
        f"{ar_bytes / MiB:.1f} MiB host->device per token"
    )
    rows = [
        ("diffusion, block working set pinned", False, True),
        ("diffusion, pinned + coreset top-p 0.9", True, True),
        ("diffusion, no block pins (plain LRU)", False, False),
    ]
    for label, coreset, pins in rows:
        d = simulate_diffusion(plan, tm, n_layers, args.blocks, passes, coreset, args.seed, pin_blocks=pins)
        per_token = d["misses_per_block"] * row / 32
        ratio = ar_bytes / per_token if per_token else float("inf")
        print(
            f"{label}: {passes} passes/block, distinct/pass {d['distinct_per_pass']:.1f}, per block-layer "
            f"{d['distinct_per_block']:.1f}, hit rate {d['hit_rate']:.1%}, "
            f"pin evictions/block {d['block_pin_evictions']:.0f}: "
            f"{per_token / MiB:.1f} MiB/token; AR/diffusion bytes ratio {ratio:.2f}x"
        )
    print(f"(simulated {args.blocks} blocks after a warm-up block in {time.perf_counter() - t0:.1f} s)")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# --tiny: end to end on a tiny random model
# ---------------------------------------------------------------------------------------------------------------


def run_tiny(args: argparse.Namespace) -> int:
    import torch

    from clover_desk.engine.decode.generate import generate
    from clover_desk.engine.decode.settings import DecodeSettings
    from clover_desk.engine.model.config import parse_config
    from clover_desk.engine.placement import offload_runtime, placer
    from clover_desk.engine.weights.checkpoint import random_state_dict, write_checkpoint
    from clover_desk.engine.weights.quant import make_policy
    from clover_desk.engine.weights.quant_cache import load_quantized
    from clover_desk.engine.weights.tiny import config_dict_for, tiny_text_config

    torch.set_num_threads(1)
    special = {"<|endoftext|>": 1, "<|im_end|>": 2, "<|mask|>": 3, "</think>": 4}
    text = tiny_text_config(vocab_size=256, layers=4, hidden=64, experts=32, experts_per_tok=4)
    cd = config_dict_for("clover_moe", text, special)
    cfg = parse_config(cd)
    prompt = [5, 17, 33, 9, 60, 61, 2, 40]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        write_checkpoint(
            model_dir, random_state_dict(cfg, seed=args.seed, dtype=torch.bfloat16), cd, max_shard_bytes=1 << 20
        )
        t0 = time.perf_counter()
        base, report = load_quantized(model_dir, make_policy(), cache_root=Path(tmp) / "cache")
        print(
            f"tiny model: 4 layers, 32 experts top-4; quantized cache built in {time.perf_counter() - t0:.2f} s "
            f"({(report.path / 'weights.safetensors').stat().st_size / 1024:.0f} KiB)"
        )
        import copy

        for mode, n, thr in (("ar", 32, 0.95), ("diffusion", 64, 0.08)):
            s = DecodeSettings(
                mode=mode, max_new_tokens=n, mask_token_id=3, eos_token_ids=(), threshold=thr, max_positions=512
            )
            ref = list(generate(base, prompt, s))[-1]
            model = copy.deepcopy(base)
            plan = placer.SimplePlan((0, 2), (1, 3), cfg.num_experts)
            placer.apply_plan(model, plan, "cpu")
            t0 = time.perf_counter()
            fin = list(generate(model, prompt, s))[-1]
            dt = time.perf_counter() - t0
            acc = offload_runtime.accounting(model)
            same = "identical" if fin.token_ids == ref.token_ids else "DIFFERENT"
            print(
                f"{mode}: {fin.tokens} tokens in {fin.passes} passes ({dt:.2f} s), tokens {same} to all-resident; "
                f"host->device {acc['h2d_bytes'] / max(fin.tokens, 1) / 1024:.1f} KiB/token, slot hit rate "
                f"{acc['hit_rate']:.1%}, passes/block {acc['passes_per_block']:.1f}, distinct experts per "
                f"layer-block {acc['distinct_experts_per_layer_block']:.1f}, prefetched {acc['prefetched']} "
                f"(hits {acc['prefetch_hits']})"
            )
    return 0


# ---------------------------------------------------------------------------------------------------------------
# --gpu: the prepared device check
# ---------------------------------------------------------------------------------------------------------------


def run_gpu_check(args: argparse.Namespace) -> int:
    """Full-size INT4 experts in pinned host memory, slot pool on a GPU capped at ``--gpu-mem-gb``.

    Prints achieved H2D GB/s (one row per copy, the streaming path), AR decode tok/s and diffusion passes/s of the
    expert path (router -> experts for every MoE layer; attention/GDN excluded), and one block's coreset load time.
    """
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu check: CUDA is not available on this machine (torch built for "
            f"{'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU only'}); nothing measured"
        )
        return 2
    from clover_desk.engine.placement import expert_store, slot_pool
    from clover_desk.engine.placement.planner import SHAPE_PREFIX, manifest_for_shape, plan_model, probe_hardware
    from clover_desk.engine.weights.quant import ExpertLayout, QuantExpertBank, routed_forward

    dev = torch.device("cuda")
    total = torch.cuda.get_device_properties(dev).total_memory
    cap = min(1.0, args.gpu_mem_gb * GiB / total)
    torch.cuda.set_per_process_memory_fraction(cap, dev)
    print(f"gpu: {torch.cuda.get_device_name(dev)}, capped at {cap * total / GiB:.1f} of {total / GiB:.1f} GiB")
    manifest = manifest_for_shape(args.shape)
    geo = manifest.geometry
    plan = plan_model(SHAPE_PREFIX + args.shape, args.vram_budget_bytes, args.ctx, probe_hardware())
    e, d, i, k = geo.num_experts, geo.hidden_size, geo.moe_intermediate_size, geo.num_experts_per_tok
    lay = ExpertLayout.build(e, d, i, "nf4", 64)
    streamed = list(plan.streamed_expert_layers)
    resident = list(plan.resident_expert_layers)
    print(
        f"plan: {len(resident)} resident / {len(streamed)} streamed layers, {plan.slot_pool_experts} slots, "
        f"row {lay.nbytes:,} B"
    )

    # a few real NF4 experts (quantized on the GPU), tiled over every row: valid data, quick to build
    t0 = time.perf_counter()
    seed_rows = torch.empty(16, lay.nbytes, dtype=torch.uint8)
    for j in range(16):
        gu = torch.randn(2 * i, d, device=dev, dtype=torch.bfloat16) * d**-0.5
        dn = torch.randn(d, i, device=dev, dtype=torch.bfloat16) * i**-0.5
        seed_rows[j] = lay.pack(gu, dn, out=torch.zeros(lay.nbytes, dtype=torch.uint8, device=dev)).cpu()
    ledger = slot_pool.DeviceLedger(dev)
    pool = slot_pool.SlotPool(plan.slot_pool_experts, lay, dev, ledger)
    budget = expert_store.PinBudget(None)
    stores = {}
    for layer in streamed:
        rows, pinned = expert_store.alloc_host_rows((e, lay.nbytes), True, budget, layer)
        rows.copy_(seed_rows.repeat((e + 15) // 16, 1)[:e])
        stores[layer] = expert_store.HostExpertStore(layer, rows, pinned)
    if any(not s.pinned for s in stores.values()):
        pool.staging = expert_store.StagingRing(lay.nbytes, 4, dev)
    banks = {
        layer: QuantExpertBank(lay, device=dev, packed=seed_rows.repeat((e + 15) // 16, 1)[:e].to(dev))
        for layer in resident
    }
    routers = torch.randn(geo.num_hidden_layers, e, d, device=dev, dtype=torch.bfloat16) * d**-0.5
    pinned = sum(s.nbytes for s in stores.values() if s.pinned)
    print(
        f"built in {time.perf_counter() - t0:.1f} s: pinned host experts {pinned / GiB:.2f} GiB, "
        f"device {torch.cuda.memory_allocated(dev) / GiB:.2f} GiB"
    )

    # H2D: copy N rows through the pool's copy path
    layer0 = streamed[0] if streamed else None
    if layer0 is not None:
        n = min(plan.slot_pool_experts, e)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pool.acquire(layer0, list(range(n)), stores[layer0], in_block=False)
        pool.release(layer0, list(range(n)))
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(
            f"H2D: {n} experts ({n * lay.nbytes / GiB:.2f} GiB) in {dt * 1e3:.1f} ms = "
            f"{n * lay.nbytes / dt / 1e9:.1f} GB/s"
        )
        pool.end_block()

    def moe_pass(x: torch.Tensor, in_block: bool, coreset: bool = False) -> None:
        t = x.shape[0]
        for layer in range(geo.num_hidden_layers):
            logits = x @ routers[layer].T  # [T, E]
            if coreset:
                from clover_desk.engine.model.moe import block_coreset_topk

                w, idx = block_coreset_topk(torch.softmax(logits.float(), -1), t, k, 0.9)
            else:
                w, idx = torch.softmax(logits.float(), -1).topk(k, dim=-1)
            if layer in stores:
                used = torch.unique(idx).tolist()
                slots = pool.acquire(layer, used, stores[layer], in_block=in_block)
                pool.wait_ready(list(slots.values()))
                x = routed_forward(x, idx, w, e, lay, lambda j: pool.buf[slots[j]])
                pool.release(layer, used)
            else:
                x = banks[layer](x, idx, w)

    def rand_x(t: int) -> torch.Tensor:
        return torch.randn(t, d, device=dev, dtype=torch.bfloat16)

    moe_pass(rand_x(1), False)  # warm-up
    torch.cuda.synchronize()
    steps = 32
    t0 = time.perf_counter()
    for _ in range(steps):
        moe_pass(rand_x(1), False)
        pool.end_block()
    torch.cuda.synchronize()
    print(
        f"AR decode (expert path): {steps / (time.perf_counter() - t0):.1f} tok/s, slot hit rate "
        f"{pool.stats.slot_hits / max(1, pool.stats.slot_hits + pool.stats.slot_misses):.1%}"
    )
    for coreset in (False, True):
        pool.end_block()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        xb = rand_x(32)  # the same block input every pass: routing is consistent across a block's passes
        moe_pass(xb, True, coreset)  # first pass of a block: loads the block's experts
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        passes = 11
        t0 = time.perf_counter()
        for _ in range(passes):
            moe_pass(xb, True, coreset)
        torch.cuda.synchronize()
        rate = passes / (time.perf_counter() - t0)
        label = "with coreset" if coreset else "no coreset"
        print(
            f"diffusion ({label}): first pass of a block (its expert load) {first * 1e3:.1f} ms, "
            f"later passes {rate:.1f} passes/s"
        )
    return 0
