"""``clover-desk make-tiny DIR``: write a random model folder (official HF layout; its output is noise).

    clover-desk make-tiny DIR [--model-type clover_moe|qwen3_5_moe] [--seed N]
                              [--shape tiny|clover-35b-a3b] [--layers N]

``--shape tiny`` (default): hidden 64, 16 experts, a few hundred KB; ``--layers`` overrides its 4 layers.
``--shape clover-35b-a3b``: the real Clover-35B-A3B widths (hidden 2048, vocab 248,320, 256 experts) with
``--layers`` layers (default 4, ~8.8 GB; ~1.7 GB per extra layer), streamed to disk in bounded memory, with a
progress line on stderr. ``--layers`` takes 1..40 for both shapes; with fewer than 4 layers there is no
full-attention layer (the real pattern puts one at every 4th layer), which the engine runs fine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from clover_desk.cli import flags

SHAPES = ("tiny", "clover-35b-a3b")
MIN_LAYERS, MAX_LAYERS = 1, 40
DEFAULT_LAYERS = 4
PROGRESS_EVERY_S = 2.0


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory: ``resource`` on Linux/macOS (POSIX only), psutil's peak working set on
    Windows, None where neither can tell."""
    try:
        import resource
    except ImportError:
        import psutil

        peak = getattr(psutil.Process().memory_info(), "peak_wset", None)  # Windows only
        return int(peak) if peak is not None else None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="output folder (created; existing model files are overwritten)")
    parser.add_argument("--model-type", choices=("clover_moe", "qwen3_5_moe"), default="clover_moe")
    parser.add_argument("--seed", type=flags.SEED, default=0, help="random seed for the weights")
    parser.add_argument(
        "--shape", choices=SHAPES, default="tiny",
        help="tiny (default: hidden 64, 16 experts) or clover-35b-a3b (the real widths, ~1.7 GB per layer)",
    )
    # parsed in run(), not by argparse, so a bad value is one line on stderr (argparse adds the usage text)
    parser.add_argument(
        "--layers", metavar="N", default=None,
        help=f"number of layers, {MIN_LAYERS}..{MAX_LAYERS} (default {DEFAULT_LAYERS}); fewer than 4 means no "
        "full-attention layer",
    )


def _parse_layers(value: str | None) -> int | None:
    """The --layers value, or None (after printing one line on stderr) when it is not an integer in range."""
    if value is None:
        return DEFAULT_LAYERS
    try:
        layers = int(value)
    except ValueError:
        layers = None
    if layers is None or not MIN_LAYERS <= layers <= MAX_LAYERS:
        print(
            f"clover-desk make-tiny: error: --layers must be an integer from {MIN_LAYERS} to {MAX_LAYERS}, got {value!r}",
            file=sys.stderr,
        )
        return None
    return layers


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


class _Progress:
    """One stderr line at most every PROGRESS_EVERY_S: rewritten in place on a terminal, appended otherwise."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.last = 0.0
        self.tty = sys.stderr.isatty()
        self.printed = False

    def __call__(self, done: int, total: int, fname: str) -> None:
        now = time.monotonic()
        if now - self.last < PROGRESS_EVERY_S and done < total:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        line = f"writing {fname}: {_gb(done)} / {_gb(total)} ({100 * done / max(total, 1):.0f}%, {rate / 1e6:.0f} MB/s)"
        if self.tty:
            print("\r" + line + "\x1b[K", end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)
        self.printed = True

    def finish(self) -> None:
        if self.tty and self.printed:
            print(file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from clover_desk.engine.errors import CloverError

    layers = _parse_layers(args.layers)
    if layers is None:
        return 2
    out_dir = Path(args.dir)
    progress = _Progress() if args.shape != "tiny" else None
    try:
        if args.shape == "tiny":
            from clover_desk.engine.weights.tiny import make_tiny

            out = make_tiny(out_dir, model_type=args.model_type, seed=args.seed, layers=layers)
        else:
            from clover_desk.engine.weights.tiny import make_real_shape

            out = make_real_shape(out_dir, shape=args.shape, layers=layers, model_type=args.model_type, seed=args.seed,
                                  progress=progress)
    except CloverError as exc:
        print(f"clover-desk make-tiny: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"clover-desk make-tiny: error: cannot write {args.dir}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    finally:
        if progress is not None:
            progress.finish()
    files = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    if args.shape == "tiny":
        print(f"wrote a tiny {args.model_type} model to {out} ({len(files)} files: {', '.join(files)})")
        return 0
    peak = peak_rss_bytes()
    print(
        f"wrote a {args.shape}-wide {args.model_type} model with {layers} layer{'s' if layers != 1 else ''} to {out}: "
        f"{_gb(_folder_bytes(out))} in {len(files)} files, peak RSS "
        + (f"{peak / 2**20:.0f} MiB" if peak is not None else "unknown")
    )
    return 0
