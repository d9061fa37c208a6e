"""``clover-desk bench speed --count``: what one AR step and one denoising pass dispatch (torch ops, host reads,
bytes written), per layer kind, and the planned workspace against the measured scratch."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable
from typing import Any

from clover_desk.bench.random_model import (
    MIB,
    _build_random_model,
    _check_stream,
    _config,
    _device_dtype,
    _dispatch_as_on_a_gpu,
    _place,
)


def run_count(args: argparse.Namespace) -> int:
    """``--count``: ops, host reads and bytes written of one AR step and one denoising pass, per layer kind, and
    scaled to the shape's full depth (the layers of a kind dispatch the same ops whatever their depth)."""
    import torch

    device, dtype = _device_dtype(args)
    _, config = _config(args.shape, "clover_moe", args.layers)
    _, full = _config(args.shape, "clover_moe")
    _check_stream(args, config)
    t0 = time.perf_counter()
    model = _build_random_model(config, dtype, device, args.seed, args.quant)
    print(f"bench speed --count: shape {args.shape}, {config.num_hidden_layers} of {full.num_hidden_layers} layers "
          f"built, quant {args.quant}, device {device}{' (dispatched as on a GPU)' if device == 'cpu' else ''}, "
          f"{str(dtype).replace('torch.', '')} ({time.perf_counter() - t0:.1f} s to build)")
    if args.vram_budget_bytes is not None or args.stream is not None:
        _place(model, config, args, device)
    B = config.block_size
    prompt = torch.randint(16, config.vocab_size, (4 * B,), generator=torch.Generator().manual_seed(args.seed))
    with torch.inference_mode(), (_dispatch_as_on_a_gpu() if device == "cpu" else contextlib.nullcontext()):
        cache = model.new_cache(3 * B)
        ids = prompt.to(device)
        model.forward(ids[: 2 * B], 0, cache, block_size=B, write_cache=True, last_only=True, prefill=True)
        block = torch.full((B,), config.mask_token_id, dtype=torch.long, device=device)
        step = ids[2 * B - 1 : 2 * B]

        def prompt_forward() -> None:
            fresh = model.new_cache(4 * B)
            model.forward(ids, 0, fresh, block_size=B, write_cache=True, last_only=True, prefill=True)

        # A prefill segment as long as the plan allows, at the end of the default context: the most scratch a
        # prefill forward takes (the cache past the prompt holds zeros: the shapes, not the values, set the bytes)
        ctx, parts, details = _planned_workspace(model, B)
        seg = details["prefill_chunk_tokens"]
        long_cache = model.new_cache(ctx)
        seg_ids = torch.randint(16, config.vocab_size, (seg,), generator=torch.Generator().manual_seed(args.seed))

        def segment_forward() -> None:
            long_cache.length = ctx - seg
            model.forward(seg_ids.to(device), ctx - seg, long_cache, block_size=B, write_cache=True, last_only=True,
                          prefill=True)

        pass_name = f"denoising pass ({B} slots)"
        seg_name = f"prefill segment ({seg} tokens after {ctx - seg:,} in the cache, block mode)"
        forwards = {
            "AR step (1 token)": lambda: model.forward(step, 2 * B, cache, block_size=None, write_cache=False),
            pass_name: lambda: model.forward(block, 2 * B, cache, block_size=B, write_cache=False),
            f"prompt forward ({4 * B} tokens, block mode)": prompt_forward,
            seg_name: segment_forward,
        }
        scratch = {}
        for name, fn in forwards.items():
            fn()  # first use: lazy initialisation is not a per-forward cost
            c = _forward_ops(fn, model.layers)
            scratch[name] = c["scratch"]
            print(f"{name}: {c['ops']} ops, {c['reads']} host reads, {c['written'] / 1e6:.1f} MB written")
            top = ", ".join(f"{what} {n / MIB:.1f}" for n, what in c["scratch_top"][:3])
            print(f"    scratch: {c['scratch'] / MIB:.1f} MiB at once (largest then, MiB: {top})")
            total_ops, total_bytes, total_reads = c["outside_ops"], c["outside_written"], c["outside_reads"]
            for kind in dict.fromkeys(config.layer_types):
                idx = [i for i, t in enumerate(config.layer_types) if t == kind]
                ops = sum(c["layer_ops"][i] for i in idx) / len(idx)
                wrote = sum(c["layer_written"][i] for i in idx) / len(idx)
                reads = sum(c["layer_reads"][i] for i in idx) / len(idx)
                n_full = sum(t == kind for t in full.layer_types)
                total_ops += ops * n_full
                total_bytes += wrote * n_full
                total_reads += reads * n_full
                print(f"    per {kind} layer (mean of {len(idx)}): {ops:7.0f} ops, {wrote / 1e6:9.2f} MB written, "
                      f"{reads:.0f} host reads")
            print(f"    outside the layers (embedding, final norm, LM head): {c['outside_ops']} ops, "
                  f"{c['outside_written'] / 1e6:.2f} MB written")
            print(f"    at the full {full.num_hidden_layers} layers: ~{total_ops:.0f} ops, ~{total_bytes / 1e6:.1f} MB "
                  f"written, ~{total_reads:.0f} host reads")
        _print_workspace(scratch[pass_name], scratch[seg_name], ctx, parts, details)
        _count_graph_cuts(model, config, full, cache, step, block, args.quant == "card")
        _count_device_tables(model, config)
    return 0


def _count_device_tables(model: Any, config: Any) -> None:
    """With device slot tables (``--device-pool``): the ops one streamed layer adds to an AR step for its fetch
    (look-up, victims, table writes, the copy) and for the next streamed layer's prefetch (its router, top-k, the
    same placing), all recorded in the step's graph (the planner's ``Roofline.device_table_kernels`` counts the
    CUDA path's two programs)."""
    import torch

    from clover_desk.engine.placement import offload_runtime

    rt = offload_runtime.runtime_of(model)
    if rt is None or rt.tables is None:
        return
    tables, k = rt.tables, config.num_experts_per_tok
    layer = rt.streamed_layers[0]
    bank = model.layers[layer].mlp.experts
    rt.before_pass(1)
    x = torch.randn(1, config.hidden_size, dtype=model.dtype, device=model.device)
    idx = torch.randperm(config.num_experts, device=model.device)[:k].view(1, k)
    programs = 2 if tables.use_kernel else 0  # Triton launches: not torch ops, not seen by the count
    fetch = _forward_ops(lambda: tables.fetch(layer, idx))
    how = "its two Triton programs (placing, copy) + " if programs else "tensor ops (the CPU's path; on CUDA two Triton programs) "
    line = f"device slot tables, per streamed layer of an AR step: fetch {how}{fetch['ops']} ops"
    total = fetch["ops"] + programs
    reads = fetch["reads"]
    if bank.next_router is not None and bank.next_layer is not None:
        guess = _forward_ops(lambda: tables.prefetch(bank.next_layer, bank.next_router(x).topk(k, dim=-1).indices))
        line += f"; the next layer's prefetch (router, top-k, placing, copy; a side stream on CUDA) {guess['ops']} ops"
        total += guess["ops"] + programs
        reads += guess["reads"]
    print(f"{line}: {total} launches, {reads} host reads, recorded in the step's one graph")
    # a diffusion block's pass: the layer's whole set (a 32-slot pass routes to up to E experts), its pins
    from clover_desk.engine.model.experts import present

    B = config.block_size
    block_idx = torch.randint(0, config.num_experts, (B, k), device=model.device)
    rt.begin_block()
    rt.before_pass(B, B)
    fetch = _forward_ops(lambda: tables.fetch_set(layer, present(block_idx, config.num_experts)))
    line = (f"device slot tables, per streamed layer of a block pass: fetch {how}{fetch['ops']} ops (its presence mask "
            "included)")
    total, reads = fetch["ops"] + programs, fetch["reads"]
    if bank.next_router is not None and bank.next_layer is not None:
        xb = torch.randn(B, config.hidden_size, dtype=model.dtype, device=model.device)
        guess = _forward_ops(lambda: tables.prefetch_set(
            bank.next_layer, present(bank.next_router(xb).topk(k, dim=-1).indices, config.num_experts)))
        line += f"; the next layer's prefetch (a block's first pass; gated on the device) {guess['ops']} ops"
        total += guess["ops"] + programs
        reads += guess["reads"]
    rt.end_block()
    print(f"{line}: {total} launches, {reads} host reads, recorded in the pass's graph")


def _planned_workspace(model: Any, block: int) -> tuple[int, dict[str, int], dict[str, Any]]:
    """(context, workspace parts, details) the planner counts for ``model`` at the default context."""
    from clover_desk.engine.defaults import DEFAULT_CTX_TOKENS
    from clover_desk.engine.placement import planner
    from clover_desk.engine.placement.placer import manifest_from_model
    from clover_desk.engine.weights.formats import format_of_torch_dtype

    ctx = min(DEFAULT_CTX_TOKENS, model.config.max_position_embeddings or DEFAULT_CTX_TOKENS) // block * block
    # in the dtype the forwards it is compared with ran in
    facts = planner.model_facts(planner.manifest_from_dict(manifest_from_model(model)), format_of_torch_dtype(model.dtype))
    parts, details = planner.workspace(facts, ctx, block)
    return ctx, parts, details


def _print_workspace(
    pass_scratch: int, segment_scratch: int, ctx: int, parts: dict[str, int], details: dict[str, Any]
) -> None:
    """The measured scratch of a denoising pass and a prefill segment next to the planner's workspace for them."""
    dequant = parts["dequant_dense"] + parts["dequant_experts"] + parts["gather_experts"]  # both kinds use them
    prefill, decode = sum(details["prefill"].values()) + dequant, sum(details["decode"].values()) + dequant
    # what SDPA's memory-efficient kernel makes of a causal pass's mask on a GPU (its bias and aligned copy): not a
    # torch op output here, so not in the measured scratch
    kernel = details["prefill"].get("attn_bias", 0)
    print(f"workspace at a {ctx:,}-token context, measured scratch vs the planner (engine.placement.planner.workspace):")
    print(f"    denoising pass: {pass_scratch / MIB:.1f} MiB measured, {decode / MIB:.1f} MiB planned")
    print(f"    prefill segment ({details['prefill_chunk_tokens']} tokens): {segment_scratch / MIB:.1f} MiB measured, "
          f"{prefill / MIB:.1f} MiB planned, of which ~{kernel / MIB:.1f} MiB is the attention kernel's own mask "
          f"copies on a GPU (not seen here)")


def _count_graph_cuts(model: Any, config: Any, full: Any, cache: Any, step: Any, block: Any, quant: bool) -> None:
    """What a GPU's CUDA graphs leave to the host (``engine.kernels.step_graphs``): the pieces of an AR step and of a
    denoising pass as a GPU cuts them, each piece counted on its own: the ops recorded (replayed as one launch per
    graph) and the ops and host reads of the eager pieces, per streamed layer's fetch and per eager bank."""
    from clover_desk.engine.kernels.step_graphs import StepGraphs, streamed_layers

    n, n_full, B = config.num_hidden_layers, full.num_hidden_layers, config.block_size
    streamed = streamed_layers(model)
    s_full = round(len(streamed) * n_full / n)
    fetch = dict.fromkeys(streamed, "fetch")
    # 8 pairs gather one expert each: only the streamed fetches read (none with device slot tables, --device-pool)
    cases = [("AR step", step, None, dict.fromkeys(streamed_layers(model, config.num_experts_per_tok), "fetch"))]
    # a block's 256 pairs: the dequantizing compute sizes its groups on the host in every layer (dense weights too,
    # off Hopper); the fused kernel (quantized, opt-in) sorts them on the device, leaving only the fetches
    cases.append((f"{B}-slot pass, dequantizing experts", block, B, dict.fromkeys(range(n), "bank")))
    if quant:  # (with device slot tables a block pass fetches on the device: no fetch left eager)
        block_fetch = {i: c for i, c in fetch.items()
                       if model.layers[i].mlp.experts.fetches(B * config.num_experts_per_tok, in_block=True)}
        cases.append((f"{B}-slot pass, fused MoE kernel", block, B, block_fetch))
    print(f"under CUDA graphs (engine.kernels.step_graphs, cut as on a GPU; {len(streamed)} of {n} layers streamed, "
          f"~{s_full} of {n_full} at full depth):")
    placement = getattr(model, "_offload_runtime", None)
    for name, ids, block_size, cut in cases:
        if placement is not None:  # what CloverModel.forward does before a pass (device slot tables change hands)
            if block_size is not None:
                placement.begin_block()  # (a block's pass, as the loop runs it)
            placement.before_pass(ids.shape[0], block_size)
        runner = StepGraphs(model, record=False, cut=cut)
        pieces = runner.pieces_of_pass(ids, cache.length, cache.clone(), block_size, block_size is None, False)
        kinds = [stages[0][0] if kind == "eager" else "graph" for kind, stages in runner.pieces_for(ids.shape[0])]
        got: dict[str, list[int]] = {"graph": [0, 0], "fetch": [0, 0], "bank": [0, 0]}
        for kind, piece in zip(kinds, pieces.pieces):
            c = _forward_ops(piece.fn)
            got[kind][0] += c["ops"]
            got[kind][1] += c["reads"]
        pieces.finish()
        if placement is not None and block_size is not None:
            placement.end_block()
        per = {k: (got[k][0] / max(kinds.count(k), 1), got[k][1] / max(kinds.count(k), 1)) for k in ("fetch", "bank")}
        cut_full = round(len(cut) * n_full / n)
        kind_full = "bank" if "bank" in cut.values() else "fetch"
        if not cut:  # one graph: nothing eager
            per[kind_full] = (0.0, 0.0)
        eager_full = cut_full * per[kind_full][0]
        stand_in = " (the CPU's dequantizing compute standing in for the kernel)" if "fused" in name else ""
        eager = "; ".join(f"{kinds.count(k)} {k}{'es' if k == 'fetch' else 's'} x {per[k][0]:.0f} ops, "
                          f"{per[k][1]:.1f} host reads" for k in ("fetch", "bank") if kinds.count(k))
        print(f"    {name}: {kinds.count('graph')} graphs ({got['graph'][0]} ops recorded, {got['graph'][1]} host reads "
              f"in them{stand_in if got['graph'][1] else ''}); eager: {eager or 'nothing'}; at full depth "
              f"~{cut_full + 1} graph launches + ~{eager_full:.0f} eager ops, ~{cut_full * per[kind_full][1]:.0f} "
              f"host reads")



def _forward_ops(fn: Callable[[], Any], layers: Any = ()) -> dict[str, Any]:
    """What one forward dispatches, counted at torch's dispatcher: ``ops`` (non-view torch ops: they stand in for
    kernel launches, what a GPU pays per launch and CPU timings cannot show), ``reads`` (host reads: scalar reads,
    ``.item()`` / ``int(tensor)`` / ``bool(tensor)``, device-to-host copies, and on the CPU every ``.cpu()`` call,
    which never reaches the dispatcher there but is where the code reads back on a GPU; a ``.tolist()`` of a CPU
    tensor stays invisible) and ``written`` (bytes the ops write: every output tensor, and for an in-place op the part
    it writes: the source rows of an ``index_copy_`` / ``index_put_``, the whole tensor otherwise). Allocations
    (``empty`` and kin) are neither ops nor writes. With ``layers`` (the decoder layers), each is also split per layer
    (``layer_ops``, ``layer_written``, ``layer_reads``: lists in layer order); the rest (embedding, final norm, LM
    head, the loop's own ops) is ``outside_ops`` / ``outside_written`` / ``outside_reads``.

    ``scratch``: the most bytes that tensors made during the forward held at one time (the device memory a forward
    needs beyond the weights and the cache it was given: the planner's workspace), with ``scratch_top``, the largest
    of them then (bytes, "op shape dtype"). Counted from the storages the ops return that their inputs do not own,
    freed when the last tensor on them goes; a kernel's own internal buffers are not seen."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    # int(t), float(t), t.item() arrive as aten.item under a dispatch mode, bool(t) as is_nonzero (a .tolist() of a
    # CPU tensor reads memory without dispatching: invisible here; of a GPU tensor it is a _to_copy)
    aten = torch.ops.aten
    scalar_reads = {aten.item, aten._local_scalar_dense, aten.is_nonzero}
    allocations = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided}
    partial = {aten.index_copy_, aten.index_put_, aten.index_copy, aten.index_put, aten._index_put_impl_}

    def nbytes(x: Any) -> int:
        return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = self.reads = self.written = 0
            self.where = -1  # the decoder layer running, -1 outside the layers
            self.layer_ops = [0] * len(layers)
            self.layer_written = [0] * len(layers)
            self.layer_reads = [0] * len(layers)
            self.live: dict[int, tuple[Any, int, str]] = {}  # storage -> (weak ref, bytes, what made it)
            self.scratch = 0
            self.scratch_top: list[tuple[int, str]] = []

        def track(self, func: Any, args: Any, kw: Any, out: Any) -> None:
            """New storages among ``out`` join the live set; the ones no tensor holds any more leave it."""
            if not (func.is_view or func._schema.is_mutable):  # views and in-place / out= ops allocate nothing
                owned = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kw)) if isinstance(t, torch.Tensor)}
                for t in tree_leaves(out):
                    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                        continue
                    storage = t.untyped_storage()
                    if storage.data_ptr() in owned or storage.nbytes() == 0:
                        continue
                    ref = StorageWeakRef(storage)
                    if ref.cdata not in self.live:
                        what = f"{func.overloadpacket.__name__} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
                        self.live[ref.cdata] = (ref, storage.nbytes(), what)
            for key in [key for key, (ref, _, _) in self.live.items() if ref.expired()]:
                del self.live[key]
            now = sum(n for _, n, _ in self.live.values())
            if now > self.scratch:
                self.scratch = now
                self.scratch_top = sorted(((n, what) for _, n, what in self.live.values()), reverse=True)[:4]

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kw = kwargs or {}
            out = func(*args, **kw)
            self.track(func, args, kw, out)
            if func.is_view or func.overloadpacket in allocations:  # metadata or memory only: no kernel, no write
                return out
            to_host = (
                func.overloadpacket is aten._to_copy
                and str(kw.get("device", "")) == "cpu"
                and args[0].device.type != "cpu"
            )
            read = func.overloadpacket in scalar_reads or to_host
            self.reads += read
            if func.overloadpacket in partial:  # the rows written: the source / values argument
                src = args[3] if func.overloadpacket in (aten.index_copy_, aten.index_copy) else args[2]
                wrote = nbytes(src)
            else:
                wrote = sum(nbytes(t) for t in tree_leaves(out))
            self.ops += 1
            self.written += wrote
            if self.where >= 0:
                self.layer_ops[self.where] += 1
                self.layer_written[self.where] += wrote
                self.layer_reads[self.where] += read
            return out

    mode = Count()

    def counted_cpu(t: Any, *args: Any, **kwargs: Any) -> Any:
        # .cpu() of a CPU tensor never reaches the dispatcher; the code calls it where, on a GPU, it reads back
        if t.device.type == "cpu":
            mode.reads += 1
            if mode.where >= 0:
                mode.layer_reads[mode.where] += 1
        return plain_cpu(t, *args, **kwargs)

    plain_cpu = torch.Tensor.cpu
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda *_, i=i: setattr(mode, "where", i)))
        hooks.append(layer.register_forward_hook(lambda *_: setattr(mode, "where", -1)))
    torch.Tensor.cpu = counted_cpu  # type: ignore[method-assign]
    try:
        with torch.inference_mode(), mode:
            fn()
    finally:
        torch.Tensor.cpu = plain_cpu  # type: ignore[method-assign]
        for h in hooks:
            h.remove()
    return {"ops": mode.ops, "reads": mode.reads, "written": mode.written, "layer_ops": mode.layer_ops,
            "layer_written": mode.layer_written, "layer_reads": mode.layer_reads,
            "outside_ops": mode.ops - sum(mode.layer_ops), "outside_written": mode.written - sum(mode.layer_written),
            "outside_reads": mode.reads - sum(mode.layer_reads), "scratch": mode.scratch,
            "scratch_top": mode.scratch_top}


