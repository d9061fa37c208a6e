"""``clover-desk make-tiny DIR``: write a tiny random model folder (official HF layout; its output is noise)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="output folder (created; existing model files are overwritten)")
    parser.add_argument("--model-type", choices=("clover_moe", "qwen3_5_moe"), default="clover_moe")
    parser.add_argument("--seed", type=int, default=0, help="random seed for the weights")


def run(args: argparse.Namespace) -> int:
    from engine.errors import CloverError
    from engine.tiny import make_tiny

    try:
        out = make_tiny(Path(args.dir), model_type=args.model_type, seed=args.seed)
    except CloverError as exc:
        print(f"clover-desk make-tiny: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"clover-desk make-tiny: error: cannot write {args.dir}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    files = sorted(p.name for p in out.iterdir())
    print(f"wrote a tiny {args.model_type} model to {out} ({len(files)} files: {', '.join(files)})")
    return 0
