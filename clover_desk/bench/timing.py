"""``clover-desk bench speed``'s figures: prefill, AR and diffusion timing of the engine on the random model, eager
and compiled, placed as planned for a card, and the table they print."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from clover_desk.bench.compare import _compare_llama_cpp, _compare_transformers
from clover_desk.bench.count import _forward_ops
from clover_desk.bench.random_model import (
    _best,
    _build_random_model,
    _check_stream,
    _config,
    _device_dtype,
    _finished,
    _place,
    _settings,
    _sync,
)


def _engine_figures(
    model: Any, config: Any, prompt: list[int], args: argparse.Namespace, device: str, count_ops: bool = True
) -> dict[str, float]:
    import torch

    from clover_desk.engine.decode.generate import generate_ar, generate_diffusion, generate_spec
    from clover_desk.engine.decode.loop_parts import loop_hooks
    from clover_desk.engine.placement import offload_runtime

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
        offload_runtime.begin_block(model)  # the passes of one block, as the loop runs them (streamed: the block's pins)
        t = _best(lambda: model.forward(block, aligned, cache, block_size=B, write_cache=False), args.repeats, device)
        figures["diffusion_passes_s"] = 1.0 / t
        if count_ops:  # (a compiled forward runs generated kernels, not torch ops: not counted)
            count = _forward_ops(lambda: model.forward(block, aligned, cache, block_size=B, write_cache=False))
            figures["pass_ops"], figures["pass_scalar_reads"] = count["ops"], count["reads"]
            figures["pass_written"] = count["written"]
        offload_runtime.end_block(model)
        if count_ops:
            step = ids[aligned - 1 : aligned]
            count = _forward_ops(lambda: model.forward(step, aligned, cache, block_size=None, write_cache=False))
            figures["ar_step_ops"], figures["ar_step_scalar_reads"] = count["ops"], count["reads"]
            figures["ar_step_written"] = count["written"]

    if not count_ops:  # compiled: the first AR steps and commit passes compile their own variants; not timed
        _finished(generate_ar(model, prompt, _settings(config, "ar", 3)))
        _finished(generate_diffusion(model, prompt, _settings(config, "diffusion", 2 * B)))

    before = offload_runtime.accounting(model)
    done = _finished(generate_ar(model, prompt, _settings(config, "ar", args.decode_tokens), hooks=loop_hooks(model)))
    figures["ar_decode_tok_s"] = done.tokens_per_s
    figures["ar_tokens"] = done.tokens
    if before:  # streamed layers: bytes over PCIe, slot misses and host reads (syncs on a GPU) per AR token
        after = offload_runtime.accounting(model)
        for key in ("h2d_bytes", "slot_misses", "host_reads"):
            figures[f"ar_{key}_per_token"] = (after[key] - before[key]) / max(done.tokens, 1)
    before = offload_runtime.accounting(model)
    done = _finished(generate_diffusion(model, prompt, _settings(config, "diffusion", args.diffusion_tokens),
                                        hooks=loop_hooks(model)))
    if before:
        after = offload_runtime.accounting(model)
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


def run_timing(args: argparse.Namespace) -> int:
    """The figures of a plain ``bench speed`` run (its flags already checked by ``clover_desk.bench.speed.run``)."""
    import torch


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
    if args.vram_budget_bytes is not None or args.stream is not None:
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
    from clover_desk.engine.placement.planner import CUDA_CONTEXT_BYTES

    counted = plan.vram_used_bytes - CUDA_CONTEXT_BYTES
    ws = plan.vram_breakdown["workspace"]
    return (f"{line}; the plan counts {counted / 2**30:.2f} GiB for them (its {plan.vram_used_bytes / 2**30:.2f} GiB less "
            f"the CUDA context; workspace {ws / 2**30:.2f} GiB): reserved is {reserved / counted:.0%} of that")


def _compiled_figures(
    model: Any, config: Any, prompt: list[int], args: argparse.Namespace, device: str, eager: dict[str, float]
) -> None:
    from clover_desk.engine.decode.generate import generate_ar
    from clover_desk.engine.kernels.fastpath import compile_layers

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
    from clover_desk.engine.kernels.step_graphs import StepGraphs

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


