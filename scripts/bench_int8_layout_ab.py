"""A/B of the own cache's INT8 projections interleaved by 8 (``QuantLinear.interleave``, ``T_I8X8``) against the same
rows in the cache's order, in one model and one process: the real-width checkpoint that ``clover-desk bench speed
--real-width --layers N`` built (run that first), loaded from its own cache on the CPU, then rounds alternating the
two layouts in place. Each round times, per layer and for the head, a 32-slot denoising pass whose slots' experts are
spread as a trained router spreads them (the bench's ``_spread_routing``), an AR step, and a 128-token prefill; the
last lines give each layout's best over the rounds (a shared machine's slow spells cost single rounds, not the best).

    python scripts/bench_int8_layout_ab.py [--layers 4] [--rounds 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from clover_desk.bench import real_width as rw
from clover_desk.engine.kernels import x8
from clover_desk.engine.weights import quant as wq
from clover_desk.engine.weights.quant_cache import load_quantized

BLOCK, PROMPT = 32, 128


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = rw.cache_root(args.layers) / "checkpoint"
    if not folder.is_dir():
        print(f"no real-width checkpoint at {folder}: run clover-desk bench speed --real-width --layers {args.layers}")
        return 2
    model, _ = load_quantized(folder)
    model.eval()
    rows = [m for m in model.modules() if isinstance(m, wq.QuantLinear) and m.x8]
    print(f"{len(rows)} INT8 projections interleaved at load; {args.threads} threads, {args.rounds} rounds")

    def layout(on: bool) -> None:
        for m in rows:
            if m.x8 != on:
                x8.pack_i8(m.codes, m.scales, undo=not on)
                m.x8 = on

    prompt = torch.tensor([16 + i % 200 for i in range(PROMPT)])
    cache = model.new_cache(PROMPT + BLOCK)
    best: dict[bool, list[float]] = {}
    with torch.no_grad():
        model.forward(prompt, 0, cache, block_size=BLOCK)
        block = torch.full((BLOCK,), model.config.mask_token_id if model.config.mask_token_id is not None else 3)
        token = prompt[:1]

        def one_pass() -> None:
            model.forward(block, PROMPT, cache, block_size=BLOCK, write_cache=False)

        def one_step() -> None:
            model.forward(token, PROMPT, cache, write_cache=False)

        def prefill() -> None:
            model.forward(prompt, 0, model.new_cache(PROMPT + BLOCK), block_size=BLOCK)

        for rnd in range(args.rounds):
            for on in (True, False) if rnd % 2 == 0 else (False, True):
                layout(on)
                one_pass()
                one_step()
                with rw._spread_routing(model):
                    spread = rw.LayerClock(model).run(one_pass, 5)
                step = rw.LayerClock(model).run(one_step, 9)
                row = [*spread, *step, _best(prefill, 3)]
                best[on] = row if on not in best else [min(a, b) for a, b in zip(best[on], row)]
                _say(f"round {rnd}", on, row, args.layers)
    for on in (True, False):
        _say("best", on, best[on], args.layers)
    layout(True)
    return 0


def _best(fn: Callable[[], None], n: int) -> float:
    out = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def _say(what: str, on: bool, row: list[float], layers: int) -> None:
    spread, step, prefill = row[: layers + 1], row[layers + 1 : -1], row[-1]
    ms = lambda ts: " ".join(f"{t * 1e3:6.2f}" for t in ts)  # noqa: E731
    print(f"{what:8} {'x8   ' if on else 'plain'} spread pass per layer {ms(spread[:-1])} head {spread[-1] * 1e3:6.1f} | "
          f"AR step {ms(step[:-1])} head {step[-1] * 1e3:5.2f} | prefill {PROMPT} {prefill * 1e3:6.1f} ms", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
