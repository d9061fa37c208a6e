"""``clover-desk bench speed --moe-only``: one MoE layer's routed experts at the Clover-35B-A3B expert shape, dense,
NF4 and GGUF banks, with the GPU candidates (fused Triton, INT8 LM head, GDN kernels, zero-copy, device tables)."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

from clover_desk.bench.random_model import _best, _config, _device_dtype, _sync
from clover_desk.engine.placement.manifest import SHAPES as MODEL_SHAPES

_35B = MODEL_SHAPES["clover-35b-a3b"]
# --moe-only times one layer of the 35B shape's routed experts
MOE_SHAPE = dict(experts=_35B.num_experts, top_k=_35B.num_experts_per_tok, hidden=_35B.hidden_size,
                 intermediate=_35B.moe_intermediate_size)

# Letters: T tokens, K top-k, E experts, D hidden size, I expert intermediate size, U distinct experts used.



def _moe_routing(t: int, k: int, e: int, distinct: int, gen: Any) -> tuple[Any, Any]:
    """Routing of T tokens that touches at most ``distinct`` experts: each token picks k distinct experts from one
    random pool (a trained router concentrates a block on a few dozen experts; uniform routing would touch ~160 of
    256 for T=32). Returns (topk_idx [T, K] long, topk_w [T, K] fp32 summing to 1 per token)."""
    import torch

    pool = torch.randperm(e, generator=gen)[: max(distinct, k)]  # [U]
    picks = torch.stack([torch.randperm(pool.numel(), generator=gen)[:k] for _ in range(t)])  # [T, K]
    idx = pool[picks]  # [T, K]
    w = torch.rand(t, k, generator=gen) + 0.1
    return idx, w / w.sum(-1, keepdim=True)


def _random_nf4_bank(e: int, d: int, i: int, gen: Any) -> Any:
    """A resident NF4 bank with random codes and realistic block absmax (quantizing 805 M random weights through
    bitsandbytes would take minutes on 2 cores; speed does not depend on the values)."""
    import torch

    from clover_desk.engine.weights.quant import ExpertLayout, QuantExpertBank

    layout = ExpertLayout.build(e, d, i, "nf4", 64)
    packed = torch.randint(0, 256, (e, layout.nbytes), dtype=torch.uint8, generator=gen)  # [E, R]
    for off, n in (layout.gate_up_scales, layout.down_scales):
        scales = torch.empty(e, n // 4).uniform_(0.02, 0.06, generator=gen)  # [E, blocks] fp32 absmax
        packed[:, off : off + n] = scales.view(torch.uint8)
    return QuantExpertBank(layout, packed=packed)


def _random_gguf_q4_0_bank(e: int, d: int, i: int, gen: Any) -> Any:
    """A resident GGUF Q4_0 bank (the official Q4_0 file's expert format: 18-byte blocks of 32 values) with random
    nibbles and an fp16 scale in a realistic range in every block."""
    import torch

    from clover_desk.engine.weights.gguf import quants as gq
    from clover_desk.engine.weights.gguf.model import GGUFExpertBank, GGUFExpertLayout

    layout = GGUFExpertLayout(e, d, i, (gq.Q4_0, gq.Q4_0, gq.Q4_0))
    packed = torch.randint(0, 256, (e, layout.nbytes), dtype=torch.uint8, generator=gen)  # [E, R]
    blocks = packed.view(e, -1, gq.BLOCK[gq.Q4_0][1])  # [E, blocks, 18]
    scales = torch.empty(blocks.shape[:2]).uniform_(0.002, 0.006, generator=gen).to(torch.float16)  # [E, blocks]
    blocks[:, :, :2] = scales.view(torch.uint8).view(e, -1, 2)
    return GGUFExpertBank(layout, packed)


def run_moe_only(args: argparse.Namespace) -> int:
    import torch

    from clover_desk.engine.model.experts import DenseExpertBank

    device, dtype = _device_dtype(args)
    e, k, d, i = MOE_SHAPE["experts"], MOE_SHAPE["top_k"], MOE_SHAPE["hidden"], MOE_SHAPE["intermediate"]
    gen = torch.Generator().manual_seed(args.seed)
    print(f"bench speed --moe-only: one MoE layer's routed experts, E={e} top-{k}, D={d}, I={i}, device {device}, "
          f"{str(dtype).replace('torch.', '')}, torch threads {torch.get_num_threads()}")
    t0 = time.perf_counter()
    dense = DenseExpertBank(e, d, i, dtype=dtype, device=device)
    with torch.no_grad():
        dense.gate_up_proj.normal_(0.0, d**-0.5)
        dense.down_proj.normal_(0.0, i**-0.5)
    banks = {"dense": dense, "nf4": _random_nf4_bank(e, d, i, gen).to(device),
             "q4_0": _random_gguf_q4_0_bank(e, d, i, gen).to(device)}
    _sync(device)
    print(f"banks built in {time.perf_counter() - t0:.1f} s")
    try:
        from clover_desk.engine.model.experts import routed_reference as dense_reference
        from clover_desk.engine.weights.quant import routed_reference as quant_reference
    except ImportError:  # before the grouped compute existed: the bank itself is the loop
        dense_reference = quant_reference = None
    for t in (1, 32):
        idx, w = _moe_routing(t, k, e, args.moe_distinct, gen)
        idx, w = idx.to(device), w.to(device)
        x = torch.randn(t, d, generator=gen).to(device=device, dtype=dtype)  # [T, D]
        distinct = int(torch.unique(idx).numel())
        for name, bank in banks.items():
            def step(bank: Any = bank) -> Any:
                bank.prepare_for(x, idx)  # the one host read SparseMoe does before a streamed bank's call
                return bank(x, idx, w)

            with torch.inference_mode():
                ms = _best(step, args.repeats, device) * 1e3
                line = f"T={t:<3d} {name:<6s} distinct experts {distinct:3d}: {ms:9.2f} ms/layer"
                # (the per-expert loop reads NF4 / INT8 rows; a GGUF bank has no such reference)
                ref = {"dense": dense_reference, "nf4": quant_reference}.get(name)
                if ref is not None:
                    ms_ref = _best(lambda: ref(bank, x, idx, w), args.repeats, device) * 1e3
                    diff = (step().float() - ref(bank, x, idx, w).float()).abs().max().item()
                    line += f" | per-expert loop {ms_ref:9.2f} ms/layer ({ms_ref / ms:4.1f}x), max |diff| {diff:.2e}"
                print(line)
            if dense_reference is not None and name != "q4_0":
                print(f"        {'':<6s} non-view torch ops per layer (~ GPU kernel launches): "
                      + _op_counts(bank, name, x, idx, w, dense_reference if name == "dense" else quant_reference))
        for name in ("nf4", "q4_0"):
            _fused_line(name, banks[name], x, idx, w, args.repeats, device, t, distinct)
        if t > 1:
            print(_group_sweep_line(banks["nf4"], x, idx, w, args.repeats, device, dtype, d, i))
        else:
            print(_bnb_gemv_line(banks["nf4"], x, idx, w, args.repeats, device))
            print(_zero_copy_line(banks["nf4"], x, k, args.repeats, device, gen))
    _int8_head_lines(args, device, dtype, gen)
    gdn_lines(device, dtype, args.repeats)
    return 0


HEAD_SHAPE = (_35B.vocab_size, _35B.hidden_size)  # the 35B shape's LM head, int8 on the card


def _int8_head_lines(args: argparse.Namespace, device: str, dtype: Any, gen: Any) -> None:
    """The LM head as an int8 QuantLinear: the chunked dequantize-then-matmul path against the fused Triton kernel
    (engine.kernels.triton_linear), 1 and 32 rows; CUDA only (the CPU has its own int8 GEMV)."""
    import torch

    from clover_desk.engine.kernels import triton_linear
    from clover_desk.engine.weights.quant import QuantLinear

    if device != "cuda" or not triton_linear.available():
        print(f"LM head int8 fused (Triton): not run ({'no Triton' if device == 'cuda' else 'CUDA only'})")
        return
    o, n = HEAD_SHAPE
    head = QuantLinear(n, o, "int8", device=device)
    head.codes = torch.randint(-127, 128, (o, n), dtype=torch.int8, generator=gen).to(device)
    head.scales = (torch.rand(o, generator=gen) * 1e-3).to(device)
    with torch.inference_mode():
        for t in (1, 32):
            x = torch.randn(t, n, generator=gen).to(device=device, dtype=dtype)
            chunked = _best(lambda: head(x), args.repeats, device) * 1e3
            fused = _best(lambda: triton_linear.int8_linear(x, head.codes, head.scales), args.repeats, device) * 1e3
            diff = (triton_linear.int8_linear(x, head.codes, head.scales).float() - head(x).float()).abs().max().item()
            print(f"T={t:<3d} LM head {o}x{n} int8: chunked dequantize-then-matmul {chunked:8.2f} ms, fused (Triton) "
                  f"{fused:8.2f} ms ({chunked / fused:4.1f}x; codes {o * n / fused / 1e6:6.1f} GB/s), max |diff| "
                  f"{diff:.2e}")
            print(f"      {_torch_int8pack_line(head, x, args.repeats, device)}")


def _torch_int8pack_line(head: Any, x: Any, repeats: int, device: str) -> str:
    """torch's own weight-only int8 matmul (``torch._weight_int8pack_mm``, the CPU path's GEMV) on this device, a
    third candidate for the LM head beside the chunked and the Triton paths: its time, or why it did not run (a
    private op; CUDA builds may lack it, or take only some dtypes)."""
    import torch

    def run() -> Any:
        return torch._weight_int8pack_mm(x, head.codes, head.scales.to(x.dtype))

    if not hasattr(torch, "_weight_int8pack_mm"):
        return "torch._weight_int8pack_mm: not in this torch"
    try:
        ms = _best(run, repeats, device) * 1e3
        diff = (run().float() - head(x).float()).abs().max().item()
    except (RuntimeError, NotImplementedError) as exc:
        return f"torch._weight_int8pack_mm: not run here ({str(exc).splitlines()[0][:120]})"
    o, n = head.codes.shape
    return f"torch._weight_int8pack_mm {ms:8.2f} ms (codes {o * n / ms / 1e6:6.1f} GB/s), max |diff| {diff:.2e}"


def gdn_lines(device: str, dtype: Any, repeats: int, shape: str = "clover-35b-a3b", prompt: int = 1024) -> None:
    """One Gated DeltaNet layer of ``shape`` (no Clover extras: the causal forwards), an AR step through the cache
    and a ``prompt``-token prefill, with the PyTorch rule and, on CUDA with fla-core installed, with
    flash-linear-attention's kernels (engine.kernels.gdn_kernels), with the larger difference between their outputs."""
    import torch

    from clover_desk.engine.kernels import gdn_kernels
    from clover_desk.engine.model.cache import PassContext
    from clover_desk.engine.model.gdn import GatedDeltaNet

    _, config = _config(shape, "qwen3_5_moe", layers=1)
    layer = GatedDeltaNet(config, 0, clover_extras=False).to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            fill = torch.randn(param.shape, generator=gen) * (param.shape[-1] ** -0.5 if param.dim() > 1 else 0.5)
            param.copy_(fill.abs() + 1.0 if name.startswith("norm") else fill)
    d, hv, dk, dv = config.hidden_size, layer.num_v_heads, layer.dk, layer.dv
    empty = torch.empty(0, device=device)

    def run(x: Any, start: int, state: Any) -> Any:
        conv = torch.zeros(layer.kernel - 1, layer.conv_dim, device=device, dtype=dtype)
        p = PassContext(start_pos=start, length=x.shape[0], block_size=None, cache=None, write_cache=False, cos=empty,
                  sin=empty, attn_mask=None, attn_causal=True, coreset=False)
        return layer(x, p, (conv, state.clone()))

    x_prompt = torch.randn(prompt, d, generator=gen).to(device=device, dtype=dtype)
    x_step = torch.randn(1, d, generator=gen).to(device=device, dtype=dtype)
    state = (torch.randn(hv, dk, dv, generator=gen) * 0.1).to(device)
    fla = gdn_kernels.AVAILABLE and (device == "cuda" or gdn_kernels.INTERPRETED)  # interpreted: the tests
    with torch.inference_mode():
        figures, outs = {}, {}
        for kernels in (False, True) if fla else (False,):
            gdn_kernels.OPTED_IN, opted = kernels, gdn_kernels.OPTED_IN
            try:
                figures[kernels] = (_best(lambda: run(x_step, prompt, state), repeats, device) * 1e3,
                                    _best(lambda: run(x_prompt, 0, state), repeats, device) * 1e3)
                outs[kernels] = (run(x_step, prompt, state).float(), run(x_prompt, 0, state).float())
            finally:
                gdn_kernels.OPTED_IN = opted
    line = (f"GDN layer ({shape}: {hv} value heads, dk {dk}, dv {dv}): PyTorch rule AR step {figures[False][0]:7.3f} ms, "
            f"prefill {prompt} tokens {figures[False][1]:8.2f} ms")
    if fla:
        diff = max((a - b).abs().max().item() for a, b in zip(outs[True], outs[False]))
        line += (f" | fla kernels AR step {figures[True][0]:7.3f} ms ({figures[False][0] / figures[True][0]:4.1f}x), "
                 f"prefill {figures[True][1]:8.2f} ms ({figures[False][1] / figures[True][1]:4.1f}x), max |diff| "
                 f"{diff:.2e}")
    else:
        line += f" | fla kernels: not run ({'CUDA only' if device != 'cuda' else 'fla-core not installed'})"
    print(line)


def bnb_gemv_moe(bank: Any, x: Any, idx: Any, w: Any, gemv: Any = None) -> Any:
    """One token's routed experts through bitsandbytes' 4-bit GEMV (``torch.ops.bitsandbytes.gemv_4bit``), straight
    from an NF4 bank's rows: per expert, gate_up [2I, D] and down [D, I] each one GEMV on its codes and absmax in
    the row, SwiGLU between, the k outputs weighted and summed in fp32. x [1, D], idx / w [1, K] -> [1, D] in x's
    dtype. The expert ids are read back to the host (a sync) to address their rows. The issue's candidate for an
    AR step's experts; ``bench speed --moe-only`` times it against the grouped and fused paths on CUDA (on the CPU
    bitsandbytes' GEMV reads a layout of its own, repacked at load). ``gemv``: another op with the same arguments
    (the tests' reference)."""
    import torch
    import torch.nn.functional as F

    from clover_desk.engine.weights.bnb import bnb_functional

    lay = bank.layout
    inter, hidden = lay.intermediate_size, lay.hidden_size
    code = bnb_functional().get_4bit_type("nf4", device=x.device)  # [16] fp32, bitsandbytes' NF4 table
    gemv = gemv or torch.ops.bitsandbytes.gemv_4bit

    def seg(row: Any, part: tuple[int, int], dtype: Any = torch.uint8) -> Any:
        return row[part[0] : part[0] + part[1]].view(dtype)

    out = torch.zeros(1, hidden, dtype=torch.float32, device=x.device)
    for j, e in enumerate(idx[0].tolist()):
        row = bank.packed[e]
        gu = gemv(x, seg(row, lay.gate_up_codes), [2 * inter, hidden], seg(row, lay.gate_up_scales, torch.float32),
                  code, lay.blocksize)  # [1, 2I]
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        y = gemv(h, seg(row, lay.down_codes), [hidden, inter], seg(row, lay.down_scales, torch.float32), code,
                 lay.blocksize)  # [1, D]
        out += y.float() * w[0, j].float()
    return out.to(x.dtype)


def _bnb_gemv_line(bank: Any, x: Any, idx: Any, w: Any, repeats: int, device: str) -> str:
    """:func:`bnb_gemv_moe` timed on the AR step's routing, with its largest difference from the engine's path."""
    import torch

    k = idx.shape[1]
    head = f"T=1   nf4 bitsandbytes gemv_4bit, one per expert matrix ({2 * k} GEMVs, ids read back):"
    if device != "cuda":
        return f"{head} not run (CUDA only: on the CPU bitsandbytes' GEMV reads a layout of its own)"
    with torch.inference_mode():
        ms = _best(lambda: bnb_gemv_moe(bank, x, idx, w), repeats, device) * 1e3
        diff = (bnb_gemv_moe(bank, x, idx, w).float() - bank(x, idx, w).float()).abs().max().item()
    return f"{head} {ms:9.2f} ms/layer, max |diff| vs grouped {diff:.2e}"


ZERO_COPY_STEPS = 16  # AR steps per timed run of _zero_copy_line, each with its own routing


def _zero_copy_line(bank: Any, x: Any, k: int, repeats: int, device: str, gen: Any) -> str:
    """One streamed layer's AR step three ways, each step with fresh routing (k experts drawn at random): through
    the slot pool when its experts miss (a pool of k slots: the step reads back which experts, copies their rows,
    then computes: a miss's whole cost), in place (zero-copy: the compute gathers its k rows from the page-locked
    host rows mapped into the device, engine.placement.expert_store.in_place_view), and resident (the rows already in device
    memory: the floor). The rows' bytes over the time give each path's effective rate; on a GPU this decides
    whether AR steps read streamed experts in place (CLOVER_DESK_ZERO_COPY). On the CPU host and device memory are
    one: the three differ by the copies only."""

    import torch

    from clover_desk.engine.kernels import triton_moe
    from clover_desk.engine.placement import expert_store

    dev = torch.device(device)
    layout = bank.layout
    rows, pinned = expert_store.alloc_host_rows(tuple(bank.packed.shape), dev.type == "cuda", expert_store.PinBudget(None), 0)
    rows.copy_(bank.packed.cpu())
    store = expert_store.HostExpertStore(0, rows, pinned)
    runtime, streamed = _one_streamed_layer(store, layout, k, dev)
    view, why = expert_store.in_place_view(rows, dev)
    e = bank.num_experts
    routings = []
    for _ in range(ZERO_COPY_STEPS):
        w = torch.rand(1, k, generator=gen) + 0.1
        routings.append((torch.randperm(e, generator=gen)[:k].view(1, k).to(dev), (w / w.sum()).to(dev)))

    def steps(fn: Callable[[Any, Any], Any]) -> float:
        """ms per step, best of ``repeats`` runs of every routing."""
        return _best(lambda: [fn(idx, w) for idx, w in routings], repeats, device) * 1e3 / len(routings)

    def through_pool(idx: Any, w: Any) -> Any:
        streamed.prepare_for(x, idx)
        return streamed(x, idx, w)

    with torch.inference_mode():
        runtime.reset_stats()
        pool_ms = steps(through_pool)
        st = runtime.stats
        misses = st.slot_misses / max(st.slot_hits + st.slot_misses, 1) * k  # of the k experts, per step
        resident_ms = steps(lambda idx, w: bank(x, idx, w))
        row_mb = layout.nbytes / 1e6
        line = (f"T=1   nf4 streamed layer, AR step: through the pool {pool_ms:7.3f} ms ({misses:.1f} of {k} experts "
                f"missing: {misses * row_mb / pool_ms:6.2f} GB/s of rows)")
        line += " | " + _device_tables_part(bank, store, view, why, x, routings, dev, steps)
        if view is None:
            line += f" | in place (zero-copy): not run ({why})"
        else:
            streamed.in_place, runtime.zero_copy = view, True
            in_place_ms = steps(lambda idx, w: streamed(x, idx, w))
            diff = max((streamed(x, idx, w).float() - bank(x, idx, w).float()).abs().max().item()
                       for idx, w in routings[:2])
            line += (f" | in place (zero-copy) {in_place_ms:7.3f} ms ({k * row_mb / in_place_ms:6.2f} GB/s of rows, "
                     f"{pool_ms / in_place_ms:4.2f}x the pool's speed), max |diff| {diff:.1e}")
        line += f" | resident {resident_ms:7.3f} ms"
        if view is not None and dev.type == "cuda" and triton_moe.available() and triton_moe.supports(layout):
            fused_in_place = steps(lambda idx, w: triton_moe.fused_moe(x, view, layout, idx, w))
            fused_resident = steps(lambda idx, w: triton_moe.fused_moe(x, bank.packed, layout, idx, w))
            line += (f" | fused (Triton) in place {fused_in_place:7.3f} ms ({k * row_mb / fused_in_place:6.2f} GB/s), "
                     f"resident {fused_resident:7.3f} ms")
    return line


def _one_streamed_layer(store: Any, layout: Any, slots: int, dev: Any) -> tuple[Any, Any]:
    """(runtime, bank): one streamed layer (layer 0, rows in ``store``) over a pool of ``slots``, no prefetch,
    wired by hand: engine.placement.placer.place_model places whole models."""
    from clover_desk.engine.placement import offload_runtime, slot_pool, streamed_bank

    ledger = slot_pool.DeviceLedger(dev)
    runtime = offload_runtime.OffloadRuntime(dev, slot_pool.SlotPool(slots, layout, dev, ledger), ledger, prefetch=False)
    runtime.stores, runtime.streamed_layers = {0: store}, (0,)
    return runtime, streamed_bank.StreamedExpertBank(0, layout, store, runtime)


def _device_tables_part(resident: Any, store: Any, view: Any, why: str, x: Any, routings: list[Any], dev: Any,
                        steps: Callable[[Callable[[Any, Any], Any]], float]) -> str:
    """The same AR steps through device slot tables (engine.placement.device_pool) in a pool of 2k slots: the placing and the
    copy of the missing rows on the device (two Triton programs on CUDA), no host read, then the compute; its output
    against the resident bank's."""
    from clover_desk.engine.placement.device_pool import DeviceSlotTables

    layout, e, k = resident.layout, resident.num_experts, routings[0][0].shape[-1]
    runtime, bank = _one_streamed_layer(store, layout, 2 * k, dev)
    refused = why if view is None else DeviceSlotTables.refusal(runtime.pool, k, dev)
    if refused:
        return f"device tables: not run ({refused})"
    runtime.tables = DeviceSlotTables(runtime.pool, (0,), {0: view}, e, k)
    ms = steps(lambda idx, w: bank(x, idx, w))
    runtime.tables.merge_counts()
    st = runtime.stats
    missing = st.slot_misses / max(st.slot_hits + st.slot_misses, 1) * k
    diff = max((bank(x, idx, w).float() - resident(x, idx, w).float()).abs().max().item() for idx, w in routings[:2])
    return (f"device tables {ms:7.3f} ms ({missing:.1f} of {k} missing: "
            f"{missing * layout.nbytes / 1e6 / ms:6.2f} GB/s of rows, no host read), max |diff| {diff:.1e}")


GROUP_SWEEP = (4, 8, 16)  # experts per dequantize group timed by --moe-only


def _group_sweep_line(bank: Any, x: Any, idx: Any, w: Any, repeats: int, device: str, dtype: Any, d: int,
                      i: int) -> str:
    """The dequantize-then-matmul path of a pass at several group sizes (engine.model.experts.GROUP_BYTES, set for the
    sweep only): bigger groups launch fewer kernels, smaller ones keep their dequantized weights in L2 (16 experts
    of the 35B shape are 96 MiB of bf16, 4 are 24 MiB); the measurement picks GROUP_BYTES for the device."""
    import torch

    from clover_desk.engine.model import experts

    kind = torch.device(device).type
    expert_bytes = 3 * d * i * torch.tensor([], dtype=dtype).element_size()
    saved = experts.GROUP_BYTES[kind]
    times = []
    try:
        with torch.inference_mode():
            for g in GROUP_SWEEP:
                experts.GROUP_BYTES[kind] = g * expert_bytes
                times.append(_best(lambda: bank(x, idx, w), repeats, device) * 1e3)
    finally:
        experts.GROUP_BYTES[kind] = saved
    now = max(1, saved // expert_bytes)
    cells = " / ".join(f"{ms:.2f}" for ms in times)
    sizes = " / ".join(str(g) for g in GROUP_SWEEP)
    best = GROUP_SWEEP[min(range(len(times)), key=times.__getitem__)]
    return (f"T={x.shape[0]:<3d} nf4 dequantized in groups of {sizes} experts: {cells} ms/layer (fastest: {best}; "
            f"GROUP_BYTES[{kind!r}] holds {now} now)")


FUSED_WARPS = (4, 8)  # warps per program timed by --moe-only's fused lines (engine.kernels.triton_moe.NUM_WARPS)


def _fused_line(
    name: str, bank: Any, x: Any, idx: Any, w: Any, repeats: int, device: str, t: int, distinct: int
) -> None:
    """The fused Triton kernel (engine.kernels.triton_moe: NF4 or GGUF rows) on the same bank and routing, next to the
    grouped dequantize-then-matmul path."""
    import torch

    from clover_desk.engine.kernels import triton_moe

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # (the tests run it on the CPU through the interpreter)
    if (device != "cuda" and not interpreted) or not triton_moe.available():
        print(f"T={t:<3d} {name} fused (Triton): not run ({'no Triton' if device == 'cuda' else 'CUDA only'})")
        return
    kind = "grouped" if idx.numel() >= triton_moe.GROUPED_MIN_PAIRS else "pair"
    saved = triton_moe.NUM_WARPS[kind]
    counts = sorted({*FUSED_WARPS, saved})
    times = {}
    try:
        with torch.inference_mode():
            for warps in counts:  # (each count compiles its own kernels on first use)
                triton_moe.NUM_WARPS[kind] = warps
                times[warps] = _best(lambda: triton_moe.fused_moe(x, bank.packed, bank.layout, idx, w), repeats,
                                     device) * 1e3
            triton_moe.NUM_WARPS[kind] = saved
            grouped = bank(x, idx, w).float()
            diff = (triton_moe.fused_moe(x, bank.packed, bank.layout, idx, w).float() - grouped).abs().max().item()
    finally:
        triton_moe.NUM_WARPS[kind] = saved
    cells = ", ".join(f"{times[n]:.2f} at {n} warps" for n in counts)
    print(f"T={t:<3d} {name} fused (Triton, {'grouped tl.dot' if kind == 'grouped' else 'per pair'}) distinct experts "
          f"{distinct:3d}: {times[saved]:9.2f} ms/layer ({cells}; NUM_WARPS[{kind!r}] is {saved}), max |diff| vs "
          f"grouped {diff:.2e}")


def _op_counts(bank: Any, name: str, x: Any, idx: Any, w: Any, reference: Callable[..., Any]) -> str:
    """Non-view torch ops dispatched by the per-expert loop and by the grouped compute with the grouping a CUDA
    device gets (GROUP_BYTES["cuda"], bf16 weights): a device-independent stand-in for GPU launch overhead, which
    CPU timings cannot show. A few of the grouped path's ops build index tensors on the host (no kernel on a GPU);
    the grouped mm fast path (sm90/sm100) is not modelled here."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from clover_desk.engine.model.experts import GROUP_BYTES, moe_grouped
    from clover_desk.engine.weights.quant import unpack_rows

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.ops += not func.is_view  # views, slices, detach: metadata only, no kernel
            return func(*args, **(kwargs or {}))

    def counted(fn: Callable[[], Any]) -> int:
        with torch.inference_mode(), Count() as mode:
            fn()
        return mode.ops

    inter3 = 3 * bank.intermediate_size
    group = max(1, GROUP_BYTES["cuda"] // (inter3 * bank.hidden_size * 2))  # experts per group in bf16 on CUDA
    if name == "dense":
        weights = bank.gather
    else:
        def weights(ids: Any) -> Any:
            return unpack_rows(bank.layout, bank.packed, ids, x.dtype)

    loop = counted(lambda: reference(bank, x, idx, w))
    grouped = counted(lambda: moe_grouped(x, idx, w, bank.num_experts, weights, inter3, group_experts=group))
    return f"per-expert loop {loop}, grouped ({group} experts per group) {grouped}"
