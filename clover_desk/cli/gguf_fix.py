"""``clover-desk gguf-fix IN OUT``: write a copy of an official Clover GGUF that upstream llama.cpp loads.

Adds the missing ``{arch}.expert_shared_count`` key, drops the 120 diffusion-only tensors and rewrites ``ssm_a`` from
raw ``A_log`` to ``-exp(A_log)``; everything else is byte-copied (:func:`engine.weights.gguf.fix.fix_gguf`). Streams with a
progress line, never loads the file into memory, and replaces OUT only once the new file is complete on disk. A split
set (``-00001-of-0000N.gguf``) becomes a split set of the same shape.

Exit status: 0 done; 2 bad input (not a fork-layout Clover GGUF, truncated, a missing split part, OUT = IN).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", type=Path, metavar="IN", help="the official GGUF file (or any part of a split set)")
    parser.add_argument("out", type=Path, metavar="OUT", help="where to write the upstream-loadable copy")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


class _Progress:
    """One stderr line, redrawn at most every 0.2 s."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.last = 0.0
        self.t0 = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if self.quiet or (now - self.last < 0.2 and done < total):
            return
        self.last = now
        rate = done / max(now - self.t0, 1e-9) / 1e9
        sys.stderr.write(f"\rgguf-fix: {done / 1e9:.2f} of {total / 1e9:.2f} GB ({100 * done / max(total, 1):.0f} %), "
                         f"{rate:.2f} GB/s")
        sys.stderr.flush()


def run(args: argparse.Namespace) -> int:
    from clover_desk.engine.errors import CloverError
    from clover_desk.engine.weights.gguf.fix import fix_gguf

    progress = _Progress(args.quiet)
    try:
        report = fix_gguf(args.src, args.out, progress=progress)
    except (CloverError, OSError) as exc:
        if not args.quiet:
            sys.stderr.write("\n" if progress.last else "")
        print(f"clover-desk gguf-fix: error: {exc}", file=sys.stderr)
        return 2
    if not args.quiet:
        sys.stderr.write("\n")
    key = f"added {report.added_key}" if report.added_key else "the shared-expert key was present"
    print(
        f"wrote {', '.join(str(p) for p in report.outputs)}: {report.dropped_tensors} diffusion tensors dropped, "
        f"{report.rewritten_ssm_a} ssm_a rewritten to -exp(A_log), {key}; {report.bytes_written:,} bytes in "
        f"{report.seconds:.1f} s"
    )
    return 0
