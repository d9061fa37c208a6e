"""``clover-desk bench speed``: prefill / AR / diffusion speed of the engine on a random model built from a config.

Shapes:
* ``mid`` (default): hidden 512, 8 layers, 64 experts (top 8), vocab 4096 — a few seconds per figure on 2 cores.
* ``clover-35b-a3b``: the full Clover-35B-A3B shape (40 layers, 256 experts, vocab 248,320). Meant for
  ``--device cuda --dtype bfloat16``: all weights resident, random init directly on the GPU, no checkpoint.

Figures: prefill tokens/s (block mode, and causal), AR decode tokens/s (greedy through the cache), diffusion
passes/s for one 32-slot block (read-only denoising pass), and tokens per pass from a real diffusion run on the
random model (random weights are rarely confident, so expect about 1 token per pass: the figure is honest, not
representative of a trained model). ``--compare-transformers`` also runs the same checkpoint (written by
transformers' ``save_pretrained``) through transformers' own greedy ``generate`` and reports whether the tokens
match.

``--moe-only`` times one MoE layer's routed experts alone (``bank.prepare`` + ``bank(x, idx, w)``, what
``engine.model.clover.SparseMoe`` calls) at the Clover-35B-A3B expert shape (E=256, top-8, D=2048, I=512) for T=1 (an AR
step) and T=32 (one diffusion pass), dense and NF4 banks; float32 on CPU, bfloat16 on CUDA. It also times the slow
per-expert loop kept as the reference (``engine.model.experts.routed_reference``, ``engine.weights.quant.routed_reference``) and
prints the largest difference between the two.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from clover_desk.cli import flags
from engine.placement.manifest import SHAPES as MODEL_SHAPES
from engine.placement.manifest import shape_fields

_35B = MODEL_SHAPES["clover-35b-a3b"]
SHAPES: dict[str, dict[str, Any]] = {
    "mid": dict(
        vocab_size=4096, layers=8, hidden=512, experts=64, experts_per_tok=8, heads=8, kv_heads=2, head_dim=64,
        linear_key_heads=4, linear_value_heads=8, linear_head_dim=64, moe_intermediate=256, shared_intermediate=256,
    ),
    "deep-narrow": dict(  # the full depth and expert count at tiny widths: a token costs ~no arithmetic, so the
        # figures are the per-token framework overhead (the one-plan / fast-path issues' comparison shape)
        vocab_size=4096, layers=40, hidden=128, experts=256, experts_per_tok=8, heads=4, kv_heads=2, head_dim=32,
        linear_key_heads=2, linear_value_heads=4, linear_head_dim=32, moe_intermediate=64, shared_intermediate=64,
    ),
    "tiny": dict(  # for tests of this command
        vocab_size=512, layers=4, hidden=64, experts=8, experts_per_tok=2, heads=4, kv_heads=2, head_dim=16,
        linear_key_heads=2, linear_value_heads=4, linear_head_dim=16, moe_intermediate=32, shared_intermediate=32,
    ),
    "clover-35b-a3b": shape_fields("clover-35b-a3b"),  # the planner's shape (engine.placement.manifest.SHAPES)
}
# Special ids for the random vocabularies (any ids work for speed; these mirror the tiny tokenizer's order).
SPECIAL = {"<|endoftext|>": 0, "<|im_end|>": 2, "</think>": 4, "<|mask|>": 5}


# --moe-only times one layer of the 35B shape's routed experts
MOE_SHAPE = dict(experts=_35B.num_experts, top_k=_35B.num_experts_per_tok, hidden=_35B.hidden_size,
                 intermediate=_35B.moe_intermediate_size)
# Bounds of the sizing flags: a benchmark's runs fit in memory and end (a typo such as --decode-tokens 10000000 is
# refused in one line instead of running for days)
MAX_BENCH_PROMPT = 65_536
MAX_BENCH_TOKENS = 4_096
MAX_REPEATS = 1_000
MAX_LAYERS = 1_024  # engine.model.config's bound on num_hidden_layers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=tuple(SHAPES), default="mid", help="mid (default), deep-narrow, clover-35b-a3b, tiny")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="default: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--prompt-tokens", type=flags.integer(1, MAX_BENCH_PROMPT), default=None, help="prefill length (default 256 mid, 1024 full)")
    parser.add_argument("--decode-tokens", type=flags.integer(1, MAX_BENCH_TOKENS), default=32, help="AR tokens to time")
    parser.add_argument("--diffusion-tokens", type=flags.integer(1, MAX_BENCH_TOKENS), default=64, help="tokens of the real diffusion run")
    parser.add_argument("--mode", choices=("ar-diffusion", "spec"), default="ar-diffusion",
                        help="spec: also a self-speculative run beside AR and diffusion (its tokens checked against AR's)")
    parser.add_argument("--repeats", type=flags.integer(1, MAX_REPEATS), default=5, help="timed repeats of the prefill and block passes")
    parser.add_argument("--layers", type=flags.integer(1, MAX_LAYERS), default=None, help="override the shape's layer count (smoke runs)")
    parser.add_argument("--seed", type=flags.SEED, default=0)
    parser.add_argument("--moe-only", action="store_true",
                        help="time one MoE layer's routed experts (E=256, k=8, D=2048, I=512), T=1 and T=32")
    parser.add_argument("--moe-distinct", type=flags.integer(MOE_SHAPE["top_k"], MOE_SHAPE["experts"]), default=70,
                        help="--moe-only: distinct experts a 32-token pass routes to (default 70, a trained router)")
    parser.add_argument("--count", action="store_true",
                        help="only count what one AR step and one denoising pass dispatch: torch ops (~ GPU kernel "
                             "launches), host reads (syncs on a GPU) and bytes written, per layer kind and scaled to "
                             "the shape's full depth (no timing; the planner's launch and traffic figures)")
    parser.add_argument("--quant", choices=("none", "card"), default="none",
                        help="card: quantize the random model as the app does for a 16 GB card (NF4 experts, INT8 "
                             "projections, shared experts and LM head) before measuring")
    parser.add_argument("--vram-gb", type=flags.GIB, default=None, metavar="G",
                        help="with --quant card: place the experts as the planner does for a G GiB card (the "
                             "clover-35b-a3b shape: streamed layers in pinned host memory, a slot pool), and on CUDA "
                             "cap the process at G GiB: the card's code path")
    parser.add_argument("--stream", type=flags.integer(1, MAX_LAYERS), default=None, metavar="N",
                        help="with --quant card: stream the experts of the last N layers through a slot pool of "
                             "2 x top-k x N experts (any shape; the CPU tests of the placed path)")
    parser.add_argument("--device-pool", action="store_true",
                        help="with --vram-gb / --stream: AR steps and diffusion block passes fetch the streamed "
                             "experts through device-side slot tables (engine.placement.device_pool: no host read, the step one "
                             "CUDA graph, a block pass too with the fused MoE kernel) instead of the host pool's "
                             "bookkeeping")
    parser.add_argument("--compile", action="store_true",
                        help="also time the engine with its decoder layers compiled (engine.kernels.fastpath), same tokens")
    parser.add_argument("--real-width", action="store_true",
                        help="the engine and llama.cpp on the same Q4_K_M file at Clover's real widths (--layers, default "
                             "4; built once, ~14 GB in ~/.cache/clover-desk/bench; needs llama-cpp-python)")
    parser.add_argument("--compare-llama-cpp", action="store_true",
                        help="also run the same weights as an F32 GGUF (upstream qwen35moe layout) through llama.cpp "
                             "(llama-cpp-python, built from source: not a dependency) and compare greedy tokens")
    parser.add_argument("--compare-transformers", action="store_true",
                        help="also run the same checkpoint through transformers' generate (test dependency)")


def run(args: argparse.Namespace) -> int:
    from engine.errors import CloverError

    try:
        if args.real_width:
            from clover_desk.bench.real_width import run_real_width

            return run_real_width(args)
        return _run(args)
    except CloverError as exc:
        print(f"clover-desk bench speed: error: {exc}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------------------------------------------


MIB = 2**20


def _config(shape: str, model_type: str, layers: int | None = None) -> tuple[dict[str, Any], Any]:
    from engine.model.config import parse_config
    from engine.weights.tiny import config_dict_for, tiny_text_config

    fields = dict(SHAPES[shape])
    if layers is not None:
        fields["layers"] = layers
    text = tiny_text_config(**fields)
    data = config_dict_for(model_type, text, SPECIAL)
    return data, parse_config(data, source=f"bench shape {shape}")


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _best(fn: Callable[[], Any], repeats: int, device: str) -> float:
    """Best wall time of ``repeats`` calls after one warm-up (seconds)."""
    fn()
    _sync(device)
    times = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def _random_init_(model: Any, seed: int) -> None:
    """Fill a model's (uninitialized) parameters in place, on their own device, with scales that keep activations
    and logits in a realistic range: fan-in scaled matrices, small zero-centred norms, GDN decays in range."""
    import torch

    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(math.log(0.05), math.log(2.0), generator=gen)
            elif name.endswith("dt_bias"):
                p.uniform_(-1.0, 1.0, generator=gen)
            elif name.endswith("linear_attn.norm.weight") or name.endswith("bd_logit_scale.weight"):
                p.uniform_(0.8, 1.2, generator=gen)  # plain-weight norm / ln(L) coefficient
            elif p.dim() == 1:
                p.normal_(0.0, 0.1, generator=gen)  # zero-centred (1 + w) norms, history bias
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0, generator=gen)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 2.0 * p.shape[-1] ** -0.5, generator=gen)  # a peaky router
            else:
                p.normal_(0.0, 0.5 * p.shape[-1] ** -0.5, generator=gen)


def _build_random_model(config: Any, dtype: Any, device: str, seed: int, quant: str = "none") -> Any:
    from engine.model.clover import CloverModel

    model = CloverModel(config, dtype=dtype, device=device)
    _random_init_(model, seed)
    if quant == "card":
        from engine.weights.quant import quantize_model_

        quantize_model_(model)  # the default policy: NF4 experts, INT8 projections / shared experts / LM head
    return model.eval()


@contextlib.contextmanager
def _dispatch_as_on_a_gpu() -> Iterator[None]:
    """Within: the choices engine code makes by device type made as on a GPU, so that a CPU count describes the
    card's forward: expert groups sized by ``engine.model.experts.GROUP_BYTES["cuda"]`` (on the CPU a group is one expert,
    named by a host read of its id), and no CPU int8 GEMV (``engine.weights.quant.INT8_GEMV_MAX_ROWS``) for projections
    and the LM head, which a GPU dequantizes in chunks."""
    from engine.model import experts
    from engine.weights import quant

    groups, gemv = experts.GROUP_BYTES["cpu"], quant.INT8_GEMV_MAX_ROWS
    experts.GROUP_BYTES["cpu"], quant.INT8_GEMV_MAX_ROWS = experts.GROUP_BYTES["cuda"], 0
    try:
        yield
    finally:
        experts.GROUP_BYTES["cpu"], quant.INT8_GEMV_MAX_ROWS = groups, gemv


def _device_dtype(args: argparse.Namespace) -> tuple[str, Any]:
    """``--device`` (refused in one line when CUDA is asked for and absent) and ``--dtype`` (default: bf16 on CUDA,
    fp32 on the CPU)."""
    import torch

    from engine.api import parse_dtype
    from engine.errors import ConfigError

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but CUDA is not available here")
    return args.device, parse_dtype(args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))


def _run_count(args: argparse.Namespace) -> int:
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
    if args.vram_gb is not None or args.stream is not None:
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

    from engine.placement import offload

    rt = offload.runtime_of(model)
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
    from engine.model.experts import present

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
    from engine.defaults import DEFAULT_CTX_TOKENS
    from engine.placement import planner
    from engine.placement.offload import manifest_from_model
    from engine.weights.formats import format_of_torch_dtype

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
    from engine.kernels.step_graphs import StepGraphs, streamed_layers

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


def _settings(config: Any, mode: str, max_new: int) -> Any:
    from engine.decode.generate import DecodeSettings

    return DecodeSettings(
        mode=mode, max_new_tokens=max_new, block_size=config.block_size, threshold=config.threshold,
        mask_token_id=config.mask_token_id, eos_token_ids=(), max_positions=config.max_position_embeddings,
        shift_logits=config.shift_logits,
    )


def _finished(events: Any) -> Any:
    from engine.decode.events import Finished

    last = None
    for event in events:
        last = event
    assert isinstance(last, Finished)
    return last


def _engine_figures(
    model: Any, config: Any, prompt: list[int], args: argparse.Namespace, device: str, count_ops: bool = True
) -> dict[str, float]:
    import torch

    from engine.decode.generate import generate_ar, generate_diffusion, generate_spec, loop_hooks
    from engine.placement import offload

    B = config.block_size
    P = len(prompt)
    ids = torch.tensor(prompt, device=device)
    figures: dict[str, float] = {}

    def prefill_block() -> None:
        model.forward(ids, 0, model.new_cache(P + B), block_size=B, write_cache=True, last_only=True, prefill=True)

    def prefill_causal() -> None:
        model.forward(ids, 0, model.new_cache(P + B), block_size=None, write_cache=True, last_only=True)

    with torch.inference_mode():
        figures["prefill_block_tok_s"] = P / _best(prefill_block, args.repeats, device)
        figures["prefill_causal_tok_s"] = P / _best(prefill_causal, args.repeats, device)

        # one read-only denoising pass over a 32-slot block after a block-aligned prefix
        aligned = (P // B) * B
        cache = model.new_cache(aligned + B)
        model.forward(ids[:aligned], 0, cache, block_size=B, write_cache=True, last_only=True, prefill=True)
        block = torch.full((B,), config.mask_token_id, dtype=torch.long, device=device)
        block[: B // 4] = ids[: B // 4]
        offload.begin_block(model)  # the passes of one block, as the loop runs them (streamed: the block's pins)
        t = _best(lambda: model.forward(block, aligned, cache, block_size=B, write_cache=False), args.repeats, device)
        figures["diffusion_passes_s"] = 1.0 / t
        if count_ops:  # (a compiled forward runs generated kernels, not torch ops: not counted)
            count = _forward_ops(lambda: model.forward(block, aligned, cache, block_size=B, write_cache=False))
            figures["pass_ops"], figures["pass_scalar_reads"] = count["ops"], count["reads"]
            figures["pass_written"] = count["written"]
        offload.end_block(model)
        if count_ops:
            step = ids[aligned - 1 : aligned]
            count = _forward_ops(lambda: model.forward(step, aligned, cache, block_size=None, write_cache=False))
            figures["ar_step_ops"], figures["ar_step_scalar_reads"] = count["ops"], count["reads"]
            figures["ar_step_written"] = count["written"]

    if not count_ops:  # compiled: the first AR steps and commit passes compile their own variants; not timed
        _finished(generate_ar(model, prompt, _settings(config, "ar", 3)))
        _finished(generate_diffusion(model, prompt, _settings(config, "diffusion", 2 * B)))

    before = offload.accounting(model)
    done = _finished(generate_ar(model, prompt, _settings(config, "ar", args.decode_tokens), hooks=loop_hooks(model)))
    figures["ar_decode_tok_s"] = done.tokens_per_s
    figures["ar_tokens"] = done.tokens
    if before:  # streamed layers: bytes over PCIe, slot misses and host reads (syncs on a GPU) per AR token
        after = offload.accounting(model)
        for key in ("h2d_bytes", "slot_misses", "host_reads"):
            figures[f"ar_{key}_per_token"] = (after[key] - before[key]) / max(done.tokens, 1)
    before = offload.accounting(model)
    done = _finished(generate_diffusion(model, prompt, _settings(config, "diffusion", args.diffusion_tokens),
                                        hooks=loop_hooks(model)))
    if before:
        after = offload.accounting(model)
        for key in ("h2d_bytes", "slot_misses", "host_reads"):
            figures[f"diffusion_{key}_per_token"] = (after[key] - before[key]) / max(done.tokens, 1)
        looked = after["slot_hits"] + after["slot_misses"] - before["slot_hits"] - before["slot_misses"]
        figures["diffusion_slot_hit_rate"] = (after["slot_hits"] - before["slot_hits"]) / max(looked, 1)
    figures["diffusion_tokens_per_pass"] = done.tokens_per_pass
    figures["diffusion_tok_s"] = done.tokens_per_s
    figures["diffusion_passes"] = done.passes
    figures["diffusion_tokens"] = done.tokens
    if getattr(args, "mode", "ar-diffusion") == "spec":  # greedy AR's tokens, drafted by diffusion
        ar = _finished(generate_ar(model, prompt, _settings(config, "ar", args.diffusion_tokens)))
        done = _finished(generate_spec(model, prompt, _settings(config, "spec", args.diffusion_tokens),
                                       hooks=loop_hooks(model)))
        figures.update(spec_tok_s=done.tokens_per_s, spec_tokens=done.tokens, spec_passes=done.passes,
                       spec_forwards_per_token=done.forwards_per_token,
                       spec_accepted_per_verify=done.accepted_per_verify, spec_verify_passes=done.verify_passes,
                       spec_equals_ar=float(done.token_ids == ar.token_ids), ar_forwards_per_token=1.0,
                       diffusion_forwards_per_token=figures["diffusion_passes"] / max(figures["diffusion_tokens"], 1))
    return figures


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


def _print_figures(title: str, f: dict[str, float], block: int, prompt_tokens: int) -> None:
    print(f"== {title}")
    print(f"prefill, block mode ({prompt_tokens} tokens):   {f['prefill_block_tok_s']:10.1f} tok/s")
    print(f"prefill, causal ({prompt_tokens} tokens):       {f['prefill_causal_tok_s']:10.1f} tok/s")
    print(f"AR decode (greedy, {int(f['ar_tokens'])} tokens):         {f['ar_decode_tok_s']:10.1f} tok/s")
    print(f"diffusion pass, one {block}-slot block:       {f['diffusion_passes_s']:10.1f} passes/s")
    if "ar_step_ops" in f:
        print(
            f"torch ops per forward (host reads: syncs on a GPU): AR step {int(f['ar_step_ops'])} "
            f"({int(f['ar_step_scalar_reads'])}), denoising pass {int(f['pass_ops'])} ({int(f['pass_scalar_reads'])})"
        )
        print(f"bytes the ops write per forward: AR step {f['ar_step_written'] / 1e6:.2f} MB, denoising pass "
              f"{f['pass_written'] / 1e6:.2f} MB")
    print(
        f"diffusion run ({int(f['diffusion_tokens'])} tokens, {int(f['diffusion_passes'])} passes): "
        f"{f['diffusion_tokens_per_pass']:.2f} tokens/pass, {f['diffusion_tok_s']:.1f} tok/s"
    )
    if "spec_tok_s" in f:
        print(
            f"spec run ({int(f['spec_tokens'])} tokens, {int(f['spec_passes'])} forwards, "
            f"{int(f['spec_verify_passes'])} verify passes): {f['spec_accepted_per_verify']:.2f} drafts accepted per "
            f"verify pass, {f['spec_tok_s']:.1f} tok/s, tokens {'equal to' if f['spec_equals_ar'] else 'NOT equal to'} AR's"
        )
        print(f"forwards per token: AR {f['ar_forwards_per_token']:.2f}, diffusion "
              f"{f['diffusion_forwards_per_token']:.2f}, spec {f['spec_forwards_per_token']:.2f}")
    # a trained model commits ~3 tokens per pass (a random one ~1): a block then takes block/3 passes and a commit
    at3 = f["diffusion_passes_s"] * block / (block / 3 + 1)
    print(f"diffusion at 3 committed tokens per pass (from the pass rate, with the commit pass): {at3:.1f} tok/s")
    if "ar_h2d_bytes_per_token" in f:
        def per_token(mode: str) -> str:
            return (f"{f[mode + '_h2d_bytes_per_token'] / 2**10:,.0f} KiB host-to-device, "
                    f"{f[mode + '_slot_misses_per_token']:.1f} slot misses, {f[mode + '_host_reads_per_token']:.1f} "
                    f"host reads per token")

        print(f"streamed experts: AR {per_token('ar')}; diffusion {per_token('diffusion')}, slot hit rate "
              f"{f['diffusion_slot_hit_rate']:.1%}")


def _run(args: argparse.Namespace) -> int:
    import torch

    from engine.errors import ConfigError

    if args.device_pool and args.vram_gb is None and args.stream is None:
        raise ConfigError("--device-pool changes how streamed experts are fetched: add --vram-gb G or --stream N")
    # the placing flags' combinations, refused before a model is built (the 35B shape takes minutes to build)
    if (args.vram_gb is not None or args.stream is not None) and args.quant != "card":
        raise ConfigError("--vram-gb / --stream place quantized experts: add --quant card")
    if args.vram_gb is not None and args.stream is None and args.shape != "clover-35b-a3b":
        raise ConfigError(f"--vram-gb plans the clover-35b-a3b shape, not {args.shape!r} (use --stream N)")
    if args.moe_only:
        return _run_moe_only(args)
    if args.count:
        return _run_count(args)

    device, dtype = _device_dtype(args)
    full = args.shape == "clover-35b-a3b"
    if full and device != "cuda":
        print("warning: the full 35B shape on CPU needs ~140 GB of RAM in float32", file=sys.stderr)
    prompt_tokens = args.prompt_tokens or (1024 if full else 256)
    _, config = _config(args.shape, "clover_moe", args.layers)
    _check_stream(args, config)
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(16, config.vocab_size, (prompt_tokens,), generator=gen).tolist()
    print(
        f"bench speed: shape {args.shape} ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_experts} experts top-{config.num_experts_per_tok}, vocab {config.vocab_size}), device {device}, "
        f"{str(dtype).replace('torch.', '')}, torch threads {torch.get_num_threads()}"
    )
    t0 = time.perf_counter()
    model = _build_random_model(config, dtype, device, args.seed, args.quant)
    _sync(device)
    n_params = sum(p.numel() for p in model.parameters())
    held = "quantized: NF4 experts, INT8 dense" if args.quant == "card" else f"{n_params / 1e9:.2f} B parameters"
    print(f"random model built on {device} in {time.perf_counter() - t0:.1f} s ({held})")
    plan = None
    if args.vram_gb is not None or args.stream is not None:
        plan = _place(model, config, args, device)
    if device == "cuda":
        print(f"GPU memory allocated: {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    title = "Clover Desk engine (clover_moe, block mode with Clover extras and coreset)"
    if args.compare_llama_cpp:
        _compare_llama_cpp(args, device, dtype, prompt)
    figures = _engine_figures(model, config, prompt, args, device)
    _print_figures(title + ", eager", figures, config.block_size, prompt_tokens)
    if plan is not None and args.layers is None:  # the plan is for the full depth: so is this model
        print(_launch_cost_line(plan.predicted_tok_s["ar_bound"], figures))
    if device == "cuda":
        print(_peak_vram_line(torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), plan))
    if args.compile:
        _compiled_figures(model, config, prompt, args, device, figures)
        if device == "cuda":
            print(_peak_vram_line(torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), plan)
                  + " (after the compiled runs and their CUDA graphs)")
    del model
    if args.compare_transformers:
        _compare_transformers(args, device, dtype, prompt)
    return 0


def _launch_cost_line(ar_bound_tok_s: float, figures: dict[str, float]) -> str:
    """What one eager launch cost in the AR steps just timed: the step time above the planner's hardware bound for
    this placement, over the ops the step dispatches (``Roofline.launch_us``, an assumption until a GPU says)."""
    ar, ops = figures["ar_decode_tok_s"], figures["ar_step_ops"]
    us = (1.0 / ar - 1.0 / ar_bound_tok_s) / ops * 1e6
    return (f"implied cost of one eager launch: {us:.1f} us = (1 / {ar:.1f} tok/s - 1 / {ar_bound_tok_s:.0f} tok/s, "
            f"the planner's hardware bound for this placement) / {int(ops)} ops per AR step (Roofline.launch_us "
            f"assumes 10)")


def _peak_vram_line(allocated: int, reserved: int, plan: Any) -> str:
    """The most GPU memory torch's allocator held during the runs, next to what the plan counted for it: its total
    less the CUDA context, which the allocator does not see (its workspace and allocator slack are in)."""
    line = f"peak GPU memory (torch): {allocated / 2**30:.2f} GiB allocated, {reserved / 2**30:.2f} GiB reserved"
    if plan is None:
        return line
    from engine.placement.planner import CUDA_CONTEXT_BYTES

    counted = plan.vram_bytes - CUDA_CONTEXT_BYTES
    ws = plan.vram_breakdown["workspace"]
    return (f"{line}; the plan counts {counted / 2**30:.2f} GiB for them (its {plan.vram_bytes / 2**30:.2f} GiB less "
            f"the CUDA context; workspace {ws / 2**30:.2f} GiB): reserved is {reserved / counted:.0%} of that")


def _check_stream(args: argparse.Namespace, config: Any) -> None:
    """``--stream N`` names at most the model's layers (checked from the config, before the model is built)."""
    from engine.errors import ConfigError

    n = config.num_hidden_layers
    if args.stream is not None and args.stream > n:
        raise ConfigError(f"--stream {args.stream}: the model has {n} layers (allowed: 1..{n})")


def _place(model: Any, config: Any, args: argparse.Namespace, device: str) -> Any:
    """Place the experts as a plan says (``--vram-gb``: the planner's plan for the shape; ``--stream N``: the last N
    layers streamed), and on CUDA cap the process at ``--vram-gb``. Returns the plan (None for ``--stream``). The
    flags' combinations and ``--stream``'s range were checked before the model was built (``_run``)."""
    import torch

    from engine.errors import ConfigError
    from engine.placement import offload

    n = config.num_hidden_layers
    if args.stream is not None:
        plan = None
        streamed = list(range(n - args.stream, n))
        # two tokens' experts per streamed layer, and at least one whole layer's (a prompt or a pass may touch all)
        slots = max(2 * config.num_experts_per_tok * len(streamed), config.num_experts)
    else:
        from engine.placement.planner import SHAPE_PREFIX, plan_model, probe_hardware

        plan = plan_model(SHAPE_PREFIX + args.shape, int(args.vram_gb * 2**30), 4096, probe_hardware())
        if not plan.fits:
            raise ConfigError(f"--vram-gb {args.vram_gb}: {plan.reason}")
        streamed = [i for i in plan.streamed_expert_layers if i < n]
        slots = plan.slot_pool_experts
    resident = [i for i in range(n) if i not in streamed]
    # the planner keeps the embedding table in host memory (a lookup sends T rows): so does the card's path
    rt = offload.apply_plan(model, offload.SimplePlan(tuple(resident), tuple(streamed), slots), device,
                            host_embedding=args.vram_gb is not None, device_pool=args.device_pool)
    print(f"placed: {len(resident)} resident / {len(streamed)} streamed expert layers, slot pool of {slots} experts")
    if args.device_pool:
        print(f"device slot tables: {'on' if rt.tables is not None else 'refused: ' + rt.device_pool_refused}")
    if device == "cuda" and args.vram_gb is not None:
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.vram_gb * 2**30 / total))
        print(f"process capped at {args.vram_gb:g} GiB of {total / 2**30:.0f} GiB")
    return plan


def _compiled_figures(
    model: Any, config: Any, prompt: list[int], args: argparse.Namespace, device: str, eager: dict[str, float]
) -> None:
    from engine.decode.generate import generate_ar
    from engine.kernels.fastpath import compile_layers

    eager_tokens = _finished(generate_ar(model, prompt, _settings(config, "ar", args.decode_tokens))).token_ids
    compile_layers(model)
    t0 = time.perf_counter()
    print("compiling the decoder layers (first use of each pass shape) ...", flush=True)
    figures = _engine_figures(model, config, prompt, args, device, count_ops=False)
    print(f"compiled and timed in {time.perf_counter() - t0:.1f} s")
    _print_figures("same engine, decoder layers compiled (engine.kernels.fastpath)", figures, config.block_size,
                   len(prompt))
    tokens = _finished(generate_ar(model, prompt, _settings(config, "ar", args.decode_tokens))).token_ids
    print(_step_graph_line(model))
    same = sum(a == b for a, b in zip(tokens, eager_tokens))
    print(f"compiled vs eager: AR decode x{figures['ar_decode_tok_s'] / eager['ar_decode_tok_s']:.2f}, diffusion "
          f"passes x{figures['diffusion_passes_s'] / eager['diffusion_passes_s']:.2f}; greedy tokens identical: "
          f"{same}/{len(eager_tokens)}")


def _step_graph_line(model: Any) -> str:
    """How the compiled model ran its AR steps (CloverModel.step_graph)."""
    from engine.kernels.step_graphs import StepGraphs

    runner = getattr(model, "step_graph", None)
    if isinstance(runner, StepGraphs):
        b = model.config.block_size

        def cut(t: int) -> str:
            pieces = runner.pieces_for(t)
            parts = [stages[0][0] for kind, stages in pieces if kind == "eager"]
            return (f"{sum(kind == 'graph' for kind, _ in pieces)} graph(s) around {parts.count('fetch')} streamed "
                    f"fetch(es) and {parts.count('bank')} eager expert bank(s)")

        ar, block = cut(1), cut(b)
        line = (f"CUDA graphs (engine.kernels.step_graphs): an AR step is {ar}, a {b}-slot pass "
                f"{'the same' if block == ar else block}; "
                f"{runner.recorded} recorded, {runner.replays} AR steps and {runner.pass_replays} block passes "
                f"replayed")
        return line + (f"; {runner.failed}" if runner.failed else "")
    if runner is not None:
        return "AR steps as one compiled graph over all layers (CloverModel.step_graph)"
    return "AR steps layer by layer (streamed layers: no whole-step graph)"


# ---------------------------------------------------------------------------------------------------------------
# --compare-llama-cpp


def _compare_llama_cpp(args: argparse.Namespace, device: str, dtype: Any, prompt: list[int]) -> None:
    """The same random weights (the causal qwen3_5_moe model: llama.cpp has no block diffusion) written as an F32
    GGUF in the upstream converter's layout, decoded greedily by llama.cpp and by the engine (eager, and compiled
    with --compile), in this process, one after the other."""
    import torch

    from engine.errors import ConfigError

    try:
        import llama_cpp
    except ImportError:
        raise ConfigError(
            "--compare-llama-cpp needs llama-cpp-python, built from source: "
            "CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install --no-binary llama-cpp-python llama-cpp-python"
        ) from None
    if device != "cpu" or dtype != torch.float32:
        raise ConfigError("--compare-llama-cpp compares float32 on the CPU (the GGUF is written as F32)")
    from engine.decode.generate import generate_ar
    from engine.weights.checkpoint import write_checkpoint
    from engine.weights.gguf.writer import write_gguf
    from engine.weights.tiny import train_tiny_tokenizer

    data, config = _config(args.shape, "qwen3_5_moe", args.layers)
    model = _build_random_model(config, dtype, device, args.seed)
    n_new = args.decode_tokens
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="clover-bench-gguf-") as tmp:
        folder = Path(tmp)
        write_checkpoint(folder, model.state_dict(), data, max_shard_bytes=1 << 40)
        train_tiny_tokenizer(folder, config.vocab_size)  # llama.cpp needs a vocabulary; ids are fed directly
        gguf_path = folder / "model-f32.gguf"
        write_gguf(folder, gguf_path, "F32", layout="upstream", arch="qwen35moe")
        llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=len(prompt) + n_new + 8, n_batch=len(prompt),
                              n_threads=threads, logits_all=True, verbose=False)

        def llama_greedy() -> tuple[list[int], float]:
            llm.reset()
            llm.eval(prompt)
            out: list[int] = []
            t0 = time.perf_counter()
            for _ in range(n_new):
                tok = int(llm.scores[llm.n_tokens - 1].argmax())
                out.append(tok)
                llm.eval([tok])
            return out, time.perf_counter() - t0

        # Every figure is the best of ``runs`` timed runs after a warm-up, llama.cpp's runs interleaved with the
        # engine's (this machine is shared and noisy: a slow minute then costs both sides, not one).
        runs = max(1, min(args.repeats, 3))
        settings = _settings(config, "ar", n_new)
        llama_greedy()  # warm-up
        llama_runs: list[tuple[list[int], float]] = []

        def best_engine_run() -> tuple[float, tuple[int, ...]]:
            _finished(generate_ar(model, prompt, settings))  # warm-up (compiles the prefill and step variants)
            done = []
            for _ in range(runs):
                llama_runs.append(llama_greedy())
                done.append(_finished(generate_ar(model, prompt, settings)))
            return max(d.tokens_per_s for d in done), done[0].token_ids

        rows = [("engine, eager", *best_engine_run())]
        if args.compile:
            from engine.kernels.fastpath import compile_layers

            compile_layers(model)
            rows.append(("engine, compiled layers", *best_engine_run()))
        llama_tokens, t_llama = llama_runs[0][0], min(t for _, t in llama_runs)
        llm.close()  # its memory back before the engine's figures are printed
    llama_rate = n_new / t_llama
    print(f"== same weights as GGUF F32 (qwen35moe), greedy AR, {n_new} tokens after {len(prompt)}, "
          f"{threads} threads, best of {len(llama_runs)} / {runs} runs, interleaved: llama.cpp {llama_cpp.__version__} (llama-cpp-python)")
    print(f"AR decode, llama.cpp:                 {llama_rate:10.1f} tok/s")
    for name, rate, tokens in rows:
        same = sum(a == b for a, b in zip(tokens, llama_tokens))
        print(f"AR decode, {name + ':':27s}{rate:10.1f} tok/s  ({rate / llama_rate:.2f}x llama.cpp; greedy tokens "
              f"identical {same}/{n_new})")


# ---------------------------------------------------------------------------------------------------------------
# --compare-transformers


def _compare_transformers(args: argparse.Namespace, device: str, dtype: Any, prompt: list[int]) -> None:
    import torch

    from engine.errors import ConfigError

    if device != "cuda":
        # transformers takes fla's GDN kernels whenever fla imports, and they need a GPU: keep it on its own path
        sys.modules.setdefault("fla", None)
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "--compare-transformers needs the test dependency transformers (pip install -e '.[test]')"
        ) from None
    from engine.decode.generate import generate_ar
    from engine.weights.checkpoint import load_model

    data, _ = _config(args.shape, "qwen3_5_moe", args.layers)
    text = {k: v for k, v in data["text_config"].items() if k not in ("model_type", "eos_token_id", "dtype")}
    half = int(text["head_dim"] * text["partial_rotary_factor"]) // 2  # rotary frequency pairs
    side = round(half * 11 / 32)  # 35B-A3B: [11, 11, 10]; identical text positions make the split irrelevant
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [side, side, half - 2 * side],
                               "mrope_interleaved": True}
    hf_config = transformers.Qwen3_5MoeTextConfig(**text, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(args.seed)
    hf = transformers.Qwen3_5MoeForCausalLM(hf_config).eval()
    _randomize_hf(hf, args.seed)
    n_new = args.decode_tokens
    P = len(prompt)
    with tempfile.TemporaryDirectory(prefix="clover-bench-") as tmp:
        hf.save_pretrained(tmp)
        hf = hf.to(device=device, dtype=dtype)
        ours = load_model(Path(tmp), dtype=dtype, device=device)
        config = ours.config
        ids = torch.tensor([prompt], device=device)
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            t_hf_prefill = _best(lambda: hf(input_ids=ids, attention_mask=mask, use_cache=False), args.repeats, device)
            t_our_prefill = _best(
                lambda: ours.forward(ids[0], 0, ours.new_cache(P), write_cache=True, last_only=True),
                args.repeats, device,
            )

            def hf_generate() -> list[int]:
                out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
                return out[0, P:].tolist()

            hf_generate()  # warm-up
            hf_prefill_once = t_hf_prefill
        settings = _settings(config, "ar", n_new)
        # best of ``runs`` timed runs each, transformers' runs interleaved with the engine's (a noisy machine)
        runs = max(1, min(args.repeats, 3))
        hf_times: list[float] = []
        hf_tokens: list[int] = []

        def best_of_runs() -> Any:
            nonlocal hf_tokens
            _finished(generate_ar(ours, prompt, settings))  # warm-up (compiles, when compiled)
            done = []
            for _ in range(runs):
                with torch.inference_mode():
                    _sync(device)
                    t0 = time.perf_counter()
                    hf_tokens = hf_generate()
                    _sync(device)
                    hf_times.append(time.perf_counter() - t0)
                done.append(_finished(generate_ar(ours, prompt, settings)))
            return max(done, key=lambda d: d.tokens_per_s)

        done = best_of_runs()
        compiled = None
        if args.compile:  # the same checkpoint with its layers compiled, next to transformers in this one run
            from engine.kernels.fastpath import compile_layers

            compile_layers(ours)
            compiled = best_of_runs()
        t_hf = min(hf_times)
    # transformers' generate time includes its prefill; subtract one measured prefill for a decode-only rate
    hf_decode = max(t_hf - hf_prefill_once, 1e-9)
    same = sum(a == b for a, b in zip(done.token_ids, hf_tokens))
    print(f"== same checkpoint (Qwen3_5MoeForCausalLM, save_pretrained, {config.model_type}), greedy, {n_new} tokens, "
          f"best of {len(hf_times)} / {runs} runs, interleaved")
    print(f"prefill, causal ({P} tokens):  engine {P / t_our_prefill:10.1f} tok/s | transformers {P / t_hf_prefill:10.1f} tok/s")
    print(f"AR decode:                   engine {done.tokens_per_s:10.1f} tok/s | transformers {n_new / hf_decode:10.1f} tok/s"
          f" (generate incl. prefill: {n_new / t_hf:.1f} tok/s)")
    if compiled is not None:
        same_c = sum(a == b for a, b in zip(compiled.token_ids, hf_tokens))
        print(f"AR decode, compiled layers:  engine {compiled.tokens_per_s:10.1f} tok/s "
              f"({compiled.tokens_per_s * hf_decode / n_new:.2f}x transformers; greedy tokens identical {same_c}/{n_new})")
    print(f"greedy tokens identical: {same}/{n_new}" + ("" if same == n_new else
          f" (first difference at token {next(i for i, (a, b) in enumerate(zip(done.token_ids, hf_tokens)) if a != b)})"))


def _randomize_hf(model: Any, seed: int) -> None:
    """transformers initializes norms to zero and matrices with std 0.02, which makes every logit nearly equal;
    use the same scales as the engine's random model so greedy decoding has clear winners."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue  # transformers' own init is in range
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(noise)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(noise * 2.0 * p.shape[-1] ** -0.5)
            else:
                p.copy_(noise * 0.5 * p.shape[-1] ** -0.5)


# ---------------------------------------------------------------------------------------------------------------
# --moe-only: one MoE layer's routed experts
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

    from engine.weights.quant import ExpertLayout, QuantExpertBank

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

    from engine.weights.gguf import quants as gq
    from engine.weights.gguf.model import GGUFExpertBank, GGUFExpertLayout

    layout = GGUFExpertLayout(e, d, i, (gq.Q4_0, gq.Q4_0, gq.Q4_0))
    packed = torch.randint(0, 256, (e, layout.nbytes), dtype=torch.uint8, generator=gen)  # [E, R]
    blocks = packed.view(e, -1, gq.BLOCK[gq.Q4_0][1])  # [E, blocks, 18]
    scales = torch.empty(blocks.shape[:2]).uniform_(0.002, 0.006, generator=gen).to(torch.float16)  # [E, blocks]
    blocks[:, :, :2] = scales.view(torch.uint8).view(e, -1, 2)
    return GGUFExpertBank(layout, packed)


def _run_moe_only(args: argparse.Namespace) -> int:
    import torch

    from engine.model.experts import DenseExpertBank

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
        from engine.model.experts import routed_reference as dense_reference
        from engine.weights.quant import routed_reference as quant_reference
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

    from engine.kernels import triton_linear
    from engine.weights.quant import QuantLinear

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

    from engine.kernels import gdn_kernels
    from engine.model.clover import GatedDeltaNet, _Pass

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
        p = _Pass(start_pos=start, length=x.shape[0], block_size=None, cache=None, write_cache=False, cos=empty,
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

    from engine.weights.quant import _bnb_functional

    lay = bank.layout
    inter, hidden = lay.intermediate_size, lay.hidden_size
    code = _bnb_functional().get_4bit_type("nf4", device=x.device)  # [16] fp32, bitsandbytes' NF4 table
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
    host rows mapped into the device, engine.placement.offload.in_place_view), and resident (the rows already in device
    memory: the floor). The rows' bytes over the time give each path's effective rate; on a GPU this decides
    whether AR steps read streamed experts in place (CLOVER_DESK_ZERO_COPY). On the CPU host and device memory are
    one: the three differ by the copies only."""

    import torch

    from engine.kernels import triton_moe
    from engine.placement import offload

    dev = torch.device(device)
    layout = bank.layout
    rows, pinned = offload.alloc_host_rows(tuple(bank.packed.shape), dev.type == "cuda", offload.PinBudget(None), 0)
    rows.copy_(bank.packed.cpu())
    store = offload.HostExpertStore(0, rows, pinned)
    runtime, streamed = _one_streamed_layer(store, layout, k, dev)
    view, why = offload.in_place_view(rows, dev)
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
    wired by hand: engine.placement.offload.place_model places whole models."""
    from engine.placement import offload

    ledger = offload.DeviceLedger(dev)
    runtime = offload.OffloadRuntime(dev, offload.SlotPool(slots, layout, dev, ledger), ledger, prefetch=False)
    runtime.stores, runtime.streamed_layers = {0: store}, (0,)
    return runtime, offload.StreamedExpertBank(0, layout, store, runtime)


def _device_tables_part(resident: Any, store: Any, view: Any, why: str, x: Any, routings: list[Any], dev: Any,
                        steps: Callable[[Callable[[Any, Any], Any]], float]) -> str:
    """The same AR steps through device slot tables (engine.placement.device_pool) in a pool of 2k slots: the placing and the
    copy of the missing rows on the device (two Triton programs on CUDA), no host read, then the compute; its output
    against the resident bank's."""
    from engine.placement.device_pool import DeviceSlotTables

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

    from engine.model import experts

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

    from engine.kernels import triton_moe

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

    from engine.model.experts import GROUP_BYTES, moe_grouped
    from engine.weights.quant import unpack_rows

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
