"""A chat's second turn with and without the engine's prompt cache (engine.decode.prompt_cache.PromptCache), side by side in one
process: ``.venv/bin/python scripts/bench_prompt_cache.py [--shape mid] [--first 2000] [--shared 1990] [--new 60]``.

The model is the bench's random one of that shape (``clover-desk bench speed``), in fp32 on the CPU (``--device cuda``:
bf16 on the GPU, where the moves to and from host memory cross PCIe). Each engine
first reads a prompt of ``--first`` tokens (chat A), then another chat's prompt as long (chat B), then A's next turn,
which shares A's first ``--shared`` tokens and adds ``--new``. Three engines: no prompt cache, one that keeps only the
last prompt's entry (``host_bytes=0``: B's request drops A's), and the default one that moves A's entry to host
memory when B comes. Printed, in both modes: B's whole request (it pays for the move) and A's next turn: its
prefill time, first token and whole request.

``--scenario edit`` (the prompt cache's checkpoints): a chat of ``--turns`` turns, ``--first`` tokens in all, each turn
opening with the chat template's turn-start token, is read in one prefill (a chat opened and read ahead); then its
message ``--back`` turns from the end is edited and sent again. Two engines: no checkpoints (``checkpoints=0``) and the
default. Printed, in both modes: the first read (it pays for making the checkpoints) and the edited request: how many
tokens it found cached, its prefill time and first token.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from clover_desk.bench.random_model import _build_random_model, _config  # noqa: E402
from clover_desk.engine.api import Engine  # noqa: E402
from clover_desk.engine.decode.events import GenerationParams, PromptInfo  # noqa: E402
from clover_desk.engine.decode.prompt_cache import PromptCache  # noqa: E402
from clover_desk.engine.model.config import GenerationDefaults  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mid", choices=("mid", "deep-narrow", "tiny"))
    parser.add_argument("--first", type=int, default=2000)
    parser.add_argument("--shared", type=int, default=1990)
    parser.add_argument("--new", type=int, default=60)
    parser.add_argument("--scenario", choices=("switch", "edit"), default="switch")
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--back", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                        help="default: float32 on the CPU, bfloat16 on CUDA")
    args = parser.parse_args()
    if args.scenario == "switch" and (not 0 < args.shared <= args.first or args.new < 1):
        print("bench_prompt_cache: --shared must be 1..--first and --new at least 1", file=sys.stderr)
        return 2
    if args.scenario == "edit" and (not 0 < args.back < args.turns or args.first < 4 * args.turns):
        print("bench_prompt_cache: --back must be 1..--turns - 1, and --first at least 4 tokens a turn",
              file=sys.stderr)
        return 2
    torch.manual_seed(0)
    _, config = _config(args.shape, "clover_moe")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_prompt_cache: --device cuda needs a CUDA GPU (this torch sees none)", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    model = _build_random_model(config, dtype, args.device, 0)
    draw = lambda n: [int(i) for i in torch.randint(10, config.vocab_size - 10, (n,))]  # noqa: E731
    if args.scenario == "edit":
        return edit(args, model, config, draw)
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


def edit(args: argparse.Namespace, model: Any, config: Any, draw: Any) -> int:
    """The ``edit`` scenario (module docstring)."""
    from clover_desk.engine.decode.tokenizer import CloverTokenizer
    from clover_desk.engine.weights.tiny import make_tiny

    with tempfile.TemporaryDirectory() as tmp:  # the chat template's special tokens (a tiny model's tokenizer)
        tokenizer = CloverTokenizer.from_dir(make_tiny(Path(tmp), model_type="clover_moe", seed=0))
    start = tokenizer.turn_start_id
    per = args.first // args.turns
    turns = [[start, *draw(per - 1)] for _ in range(args.turns)]
    chat = [t for turn in turns for t in turn] + [start]  # read ahead: the chat, then the generation prompt
    cut = args.turns - args.back  # the edited message: turn ``cut``
    edited = [t for turn in turns[:cut] for t in turn] + [start, *draw(per - 1), start]
    for mode in ("diffusion", "ar"):
        for name, checkpoints in (("no checkpoints", 0), ("checkpoints", 8)):
            engine = Engine(model, config, GenerationDefaults(), tokenizer)
            engine.prompt_cache = PromptCache(checkpoints=checkpoints)
            params = GenerationParams(mode=mode, max_new_tokens=4, do_sample=False)
            t0 = time.perf_counter()
            list(engine.generate(prompt_ids=chat, params=params, prefill_only=True))
            read = time.perf_counter() - t0
            made = len(engine.prompt_cache.checkpoint_lengths)
            done = list(engine.generate(prompt_ids=edited, params=params))[-1]
            print(f"{args.shape} {mode:9s} {name:14s}: read {len(chat):,} tokens in {read:.2f} s ({made} "
                  f"checkpoints); message {args.back} turns back edited, {len(edited):,} tokens "
                  f"({done.cached_tokens:,} cached): prefill {done.prefill_s:.2f} s, first token "
                  f"{done.time_to_first_token_s:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
