"""AR decode speed of the engine's own quantized cache (NF4 experts, INT8 projections and head) on the CPU, with the
CPU kernels (``engine.kernels.cpu_quant``) and without them (the dequantizing path), on a real-width checkpoint:
by default the 4-layer one ``clover-desk bench speed --real-width`` builds.

    .venv/bin/python scripts/bench_own_cache_ar.py [--checkpoint DIR] [--cache-root DIR] [--new 32] [--repeats 3]
        [--compile]

Prints best-of-repeats tokens per second (the machine is shared: the best run is the least disturbed one) and the
greedy tokens' agreement between the two paths. ``--compile``: also the compiled model's cold warm-up (first AR
steps, then the first 32-slot denoising pass, as ``--compile`` compiles the layers) and its AR speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
from pathlib import Path

import torch

from clover_desk.engine.decode.events import Finished
from clover_desk.engine.decode.generate import generate_ar
from clover_desk.engine.decode.settings import DecodeSettings
from clover_desk.engine.kernels import cpu_quant, fastpath
from clover_desk.engine.weights.quant import DEFAULT_POLICY
from clover_desk.engine.weights.quant_cache import load_quantized

DEFAULT_CKPT = Path.home() / ".cache" / "clover-desk" / "bench" / "real-width-4L" / "checkpoint"


def ar_tok_s(model: torch.nn.Module, prompt: list[int], settings: DecodeSettings) -> tuple[float, tuple[int, ...]]:
    last = None
    for event in generate_ar(model, prompt, settings):
        last = event
    if not isinstance(last, Finished):
        raise RuntimeError(f"generate_ar ended without Finished: {last!r}")
    return last.tokens_per_s, tuple(last.token_ids)


def best(model: torch.nn.Module, prompt: list[int], settings: DecodeSettings, repeats: int) -> tuple[float, tuple[int, ...]]:
    ar_tok_s(model, prompt, settings)  # warm-up
    runs = [ar_tok_s(model, prompt, settings) for _ in range(repeats)]
    print(f"  runs tok/s: {' '.join(f'{r[0]:.2f}' for r in runs)}", flush=True)
    return max(r[0] for r in runs), runs[-1][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CKPT)
    ap.add_argument("--cache-root", type=Path, default=Path.home() / ".cache" / "clover-desk" / "bench" / "own-cache")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--skip-off", action="store_true", help="do not time the dequantizing path")
    ap.add_argument("--skip-eager", action="store_true", help="do not time the eager model (with --compile)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    t0 = time.perf_counter()
    model, report = load_quantized(args.checkpoint, DEFAULT_POLICY, cache_root=args.cache_root)
    model.eval()
    print(f"loaded in {time.perf_counter() - t0:.1f} s (cache {'rebuilt: ' + report.reason if report.rebuilt else 'used'})")
    config = model.config
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(16, min(240_000, config.vocab_size), (args.prompt,), generator=gen).tolist()
    settings = DecodeSettings(mode="ar", max_new_tokens=args.new, block_size=config.block_size,
                              threshold=config.threshold, mask_token_id=config.mask_token_id, eos_token_ids=(),
                              max_positions=config.max_position_embeddings, shift_logits=config.shift_logits)
    kern = cpu_quant.kernels()
    print(f"CPU kernels: {'on (' + ('AVX2' if kern.simd else 'scalar') + ')' if kern.ok else 'off: ' + kern.reason}")
    with torch.no_grad():
        if not args.skip_eager:
            on, toks_on = best(model, prompt, settings, args.repeats)
            print(f"own cache AR, kernels on : {on:7.2f} tok/s (best of {args.repeats})", flush=True)
        if not args.skip_off and not args.skip_eager:
            before = cpu_quant.set_enabled(False)
            try:
                off, toks_off = best(model, prompt, settings, 1)
            finally:
                cpu_quant.set_enabled(before)
            same = sum(a == b for a, b in zip(toks_on, toks_off))
            print(f"own cache AR, kernels off: {off:7.2f} tok/s   ({on / off:.1f}x; greedy tokens equal: {same}/"
                  f"{len(toks_on)})", flush=True)
        if args.compile:
            compiled_ar(model, prompt, settings, args.repeats)
    print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


def compiled_ar(model: torch.nn.Module, prompt: list[int], settings: DecodeSettings, repeats: int) -> None:
    """``--compile``'s compile (engine.kernels.fastpath.compile_layers): the cold warm-up of the first AR steps and
    of a 32-slot denoising pass, then AR speed through the compiled step."""
    torch._dynamo.reset()
    fastpath.compile_layers(model)
    try:
        t0 = time.perf_counter()
        ar_tok_s(model, prompt, dataclasses.replace(settings, max_new_tokens=2))
        print(f"compiled: first AR steps, prefill included (cold compile) {time.perf_counter() - t0:.1f} s", flush=True)
        start = len(prompt) // 32 * 32
        cache = model.new_cache(start + 32)
        model.forward(torch.tensor(prompt[:start]), 0, cache, block_size=32)
        block = torch.full((32,), model.config.mask_token_id if model.config.mask_token_id is not None else 3)
        t0 = time.perf_counter()
        model.forward(block, start, cache, block_size=32, write_cache=False)
        print(f"compiled: first 32-slot denoising pass (cold compile) {time.perf_counter() - t0:.1f} s", flush=True)
        tps, _ = best(model, prompt, settings, repeats)
        print(f"own cache AR, compiled, kernels on: {tps:7.2f} tok/s (best of {repeats})", flush=True)
    finally:
        fastpath.uncompile_layers(model)

if __name__ == "__main__":
    main()
