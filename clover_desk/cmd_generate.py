"""``clover-desk generate``: run one request on a model folder and stream the answer (or JSON events)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from typing import Any, TextIO

DIM, RESET = "\x1b[2m", "\x1b[0m"

from clover_desk import flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="model folder (config.json, weights, tokenizer)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="the user message (or the raw text with --raw)")
    source.add_argument("--prompt-ids", metavar="1,2,3", help="token ids, comma-separated (sent as is)")
    parser.add_argument("--raw", action="store_true", help="send --prompt without the chat template")
    parser.add_argument("--mode", choices=("diffusion", "ar"), default="diffusion", help="decoding mode")
    parser.add_argument("--max-new-tokens", type=flags.TOKENS, default=None, metavar="N")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="compute dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--vram-gb", type=flags.GIB, default=None, help="VRAM budget in GiB: quantize, then place or stream experts by the planner")
    parser.add_argument("--ctx", type=flags.TOKENS, default=None, metavar="N",
                        help="with --vram-gb: context (prompt + answer) the plan reserves KV cache for (default 16384)")
    parser.add_argument("--no-think", action="store_true", help="turn thinking off in the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object per event per line")
    parser.add_argument("--temperature", type=flags.temperature, default=None, help="> 0 samples (default: greedy)")
    parser.add_argument("--top-p", type=flags.TOP_P, default=None)
    parser.add_argument("--top-k", type=flags.TOP_K, default=None)
    parser.add_argument("--seed", type=flags.SEED, default=None)
    parser.add_argument("--threshold", type=flags.THRESHOLD, default=None, help="diffusion commit threshold (default: config)")
    parser.add_argument("--block-size", type=flags.BLOCK, default=None, help="diffusion block size (default: config)")


def _parse_ids(text: str) -> list[int]:
    from engine.errors import PromptError

    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise PromptError(f"--prompt-ids {text!r} is not a comma-separated list of integers") from None


class _Printer:
    """Plain-text output: the answer as it streams, thinking dimmed on a terminal (prefixed otherwise)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.channel = "answer"

    def delta(self, text: str, channel: str) -> None:
        if channel != self.channel:
            if channel == "thinking":
                self.out.write(DIM if self.tty else "[thinking] ")
            else:
                self.out.write(RESET + "\n" if self.tty else "\n[answer] ")
            self.channel = channel
        self.out.write(text)
        self.out.flush()

    def end(self) -> None:
        if self.tty and self.channel == "thinking":
            self.out.write(RESET)
        self.out.write("\n")
        self.out.flush()


def run(args: argparse.Namespace) -> int:
    from engine.errors import CloverError

    try:
        return _run(args)
    except CloverError as exc:
        print(f"clover-desk generate: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from engine.api import Engine, plan_for
    from engine.errors import PlanError
    from engine.events import Finished, GenerationParams, TextDelta, to_dict

    prompt_ids = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    params = GenerationParams(
        mode=args.mode,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        block_size=args.block_size,
        threshold=args.threshold,
        enable_thinking=not args.no_think,
        seed=args.seed,
    )
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    plan = None
    if args.vram_gb is not None:
        # the plan first, from the headers alone (before any conversion or load), as `clover-desk plan --json`
        # prints it; the engine then checks it and places exactly that plan
        plan = plan_for(args.model, args.vram_gb, args.ctx, dtype)
        if args.json:
            sys.stdout.write(json.dumps({"event": "plan", **plan.to_dict()}, ensure_ascii=False) + "\n")
            sys.stdout.flush()
        else:
            print(_plan_line(plan), file=sys.stderr)
        if not plan.fits:
            raise PlanError(plan.reason)
    engine = Engine.load(args.model, device=args.device, dtype=dtype, plan=plan)
    cancel = threading.Event()
    if prompt_ids is not None:
        events = engine.generate(prompt_ids=prompt_ids, params=params, cancel=cancel)
    else:
        events = engine.generate(prompt=args.prompt, raw=args.raw, params=params, cancel=cancel)
    printer = _Printer(sys.stdout)
    try:
        for event in events:
            if args.json:
                sys.stdout.write(json.dumps(to_dict(event), ensure_ascii=False) + "\n")
                sys.stdout.flush()
            elif isinstance(event, TextDelta):
                printer.delta(event.text, event.channel)
            elif isinstance(event, Finished):
                printer.end()
                print(_summary(event), file=sys.stderr)
    except KeyboardInterrupt:
        cancel.set()
        print("\nclover-desk generate: interrupted", file=sys.stderr)
        return 130
    return 0


def _plan_line(plan: Any) -> str:
    gib = 1024**3
    return (
        f"plan: {len(plan.resident_expert_layers)} expert layers resident, {len(plan.streamed_expert_layers)} "
        f"streamed, {plan.slot_pool_experts} slots; VRAM {plan.vram_bytes / gib:.2f} of "
        f"{plan.budget_vram_bytes / gib:.2f} GiB, RAM {plan.ram_bytes / gib:.2f} GiB, context {plan.ctx_tokens:,}"
    )


def _summary(done: Any) -> str:
    ttft = "-" if done.time_to_first_token_s is None else f"{done.time_to_first_token_s:.2f} s"
    return (
        f"[{done.stop_reason}] {done.tokens} tokens in {done.passes} passes ({done.tokens_per_pass:.2f} tokens/pass), "
        f"{done.tokens_per_s:.1f} tokens/s, prompt {done.prompt_tokens} tokens, prefill {done.prefill_s:.2f} s, "
        f"first token {ttft}"
    )
