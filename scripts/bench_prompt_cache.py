"""A chat's second turn with and without the engine's prompt cache (engine.generate.PromptCache), side by side in one
process: ``.venv/bin/python scripts/bench_prompt_cache.py [--shape mid] [--first 2000] [--shared 1990] [--new 60]``.

The model is the bench's random one of that shape (``clover-desk bench speed``), in fp32 on the CPU. Each engine
first reads a prompt of ``--first`` tokens (chat A), then another chat's prompt as long (chat B), then A's next turn,
which shares A's first ``--shared`` tokens and adds ``--new``. Three engines: no prompt cache, one that keeps only the
last prompt's entry (``host_bytes=0``: B's request drops A's), and the default one that moves A's entry to host
memory when B comes. Printed, in both modes: B's whole request (it pays for the move) and A's next turn: its
prefill time, first token and whole request.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from clover_desk.cmd_bench_speed import _build_random_model, _config  # noqa: E402
from engine.api import Engine  # noqa: E402
from engine.config import GenerationDefaults  # noqa: E402
from engine.events import GenerationParams, PromptInfo  # noqa: E402
from engine.generate import PromptCache  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mid", choices=("mid", "deep-narrow", "tiny"))
    parser.add_argument("--first", type=int, default=2000)
    parser.add_argument("--shared", type=int, default=1990)
    parser.add_argument("--new", type=int, default=60)
    args = parser.parse_args()
    if not 0 < args.shared <= args.first or args.new < 1:
        print("bench_prompt_cache: --shared must be 1..--first and --new at least 1", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    _, config = _config(args.shape, "clover_moe")
    model = _build_random_model(config, torch.float32, "cpu", 0)
    draw = lambda n: [int(i) for i in torch.randint(10, config.vocab_size - 10, (n,))]  # noqa: E731
    first = draw(args.first)
    second = first[: args.shared] + draw(args.new)
    other = draw(args.first)
    setups = (("off", lambda: None), ("last only", lambda: PromptCache(host_bytes=0)), ("with saved", PromptCache))
    for mode in ("diffusion", "ar"):
        for name, make in setups:
            engine = Engine(model, config, GenerationDefaults(), None)
            engine.prompt_cache = make()
            params = GenerationParams(mode=mode, max_new_tokens=4, do_sample=False)
            list(engine.generate(prompt_ids=first, params=params))
            t0 = time.perf_counter()
            list(engine.generate(prompt_ids=other, params=params))
            switch = time.perf_counter() - t0
            t0 = time.perf_counter()
            events = list(engine.generate(prompt_ids=second, params=params))
            total = time.perf_counter() - t0
            info = next(e for e in events if isinstance(e, PromptInfo))
            done = events[-1]
            print(f"{args.shape} {mode:9s} prompt cache {name:10s}: chat B {switch:.2f} s; then A's next turn "
                  f"{len(second):,} tokens ({info.cached_tokens:,} cached): prefill {done.prefill_s:.2f} s, first "
                  f"token {done.time_to_first_token_s:.2f} s, request {total:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
