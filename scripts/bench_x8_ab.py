"""Interleaved (``engine/kernels/x8.py``) against plain GGUF expert rows, in one process, on the real-width file of
``clover-desk bench speed --real-width`` (built there first): the same model with its banks restored to the file's
rows and interleaved again between rounds, so both layouts run on the same machine state.

    python scripts/bench_x8_ab.py [--layers 4] [--rounds 4]

Per round and layout: each layer's and the head's best time in a 32-slot pass with each slot's 8 experts drawn at
random (a trained router's spread, as the bench's second pass table), in an AR step, and the AR tok/s of 32 greedy
tokens. Then the best of all rounds per layout. This machine is shared: read the best-of lines, not one round.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from clover_desk.bench.real_width import LayerClock, _ar_settings, _spread_routing, cache_root
from clover_desk.engine.decode.generate import generate_ar
from clover_desk.engine.kernels import x8
from clover_desk.engine.weights.gguf.model import GGUFExpertBank, load_gguf_model


def _set_layout(banks: list[GGUFExpertBank], interleaved: bool) -> None:
    for bank in banks:
        lay = bank.layout
        if interleaved:
            bank.interleave()
        elif any(lay.x8):
            rows = (lay.intermediate_size, lay.intermediate_size, lay.hidden_size)
            for on, (at, n), r, q in zip(lay.x8, lay.segments, rows, lay.qtypes):
                if on:
                    x8.pack_bank(bank.packed, at, r, n // r, q, undo=True)
            bank.layout = dataclasses.replace(lay, x8=(False, False, False))


def _fmt(times: list[float]) -> str:
    return " ".join(f"{t * 1e3:6.2f}" for t in times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    path = cache_root(args.layers) / "model-Q4_K_M-llama.gguf"
    if not path.is_file():
        print(f"{path}: missing; run `clover-desk bench speed --real-width --layers {args.layers}` first",
              file=sys.stderr)
        return 2
    torch.set_num_threads(2)
    model = load_gguf_model(path, torch.float32, "cpu").model
    banks = [m for m in model.modules() if isinstance(m, GGUFExpertBank)]
    print("interleaved at load:", " ".join("".join("x" if f else "-" for f in b.layout.x8) for b in banks))
    prompt = torch.randint(16, 240_000, (128,), generator=torch.Generator().manual_seed(0))
    mask = model.config.mask_token_id if model.config.mask_token_id is not None else 3
    block, token = torch.full((32,), mask), torch.tensor([5])
    settings = _ar_settings(model.config, 32)
    best: dict[bool, tuple[list[float], list[float], float]] = {}
    print("layout       spread pass per layer and head (ms) | AR step per layer and head (ms) | AR tok/s")
    with torch.no_grad():
        for r in range(args.rounds):
            for interleaved in (True, False) if r % 2 else (False, True):
                _set_layout(banks, interleaved)
                cache = model.new_cache(160)
                model.forward(prompt, 0, cache, block_size=32)
                with _spread_routing(model):
                    def one_pass() -> None:
                        model.forward(block, 128, cache, block_size=32, write_cache=False)
                    one_pass()
                    spread = LayerClock(model).run(one_pass, 5)
                ar = LayerClock(model).run(lambda: model.forward(token, 128, cache, last_only=True, write_cache=False), 9)
                tok_s = 0.0
                for _ in range(2):
                    for event in generate_ar(model, prompt[:16].tolist(), settings):
                        last = event
                    tok_s = max(tok_s, last.tokens_per_s)
                name = "interleaved" if interleaved else "plain"
                print(f"{name:12} {_fmt(spread)} | {_fmt(ar)} | {tok_s:.1f}", flush=True)
                before = best.get(interleaved)
                best[interleaved] = (spread, ar, tok_s) if before is None else (
                    [min(a, b) for a, b in zip(before[0], spread)], [min(a, b) for a, b in zip(before[1], ar)],
                    max(before[2], tok_s))
    for interleaved in (False, True):
        spread, ar, tok_s = best[interleaved]
        print(f"best {'interleaved' if interleaved else 'plain':12} {_fmt(spread)} | {_fmt(ar)} | {tok_s:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
