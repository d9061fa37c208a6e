"""Argument types for the numeric flags of every command: a value outside its range is refused by argparse with
one line naming the flag and what is allowed (exit status 2), before any work starts.

    parser.add_argument("--top-p", type=flags.TOP_P)
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from clover_desk.engine.decode.limits import GENERATION_LIMITS, INT32_MAX

MAX_GIB = 65_536.0  # 64 TiB: a budget above is a typo, and would overflow byte counts downstream


def number(lo: float, hi: float, *, lo_open: bool = False, what: str = "") -> Callable[[str], float]:
    """A finite float in [lo, hi] (or (lo, hi] with ``lo_open``)."""
    allowed = what or f"a finite number {'>' if lo_open else '>='} {lo:g} and <= {hi:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        if not math.isfinite(value) or not ((value > lo) if lo_open else (value >= lo)) or value > hi:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    return parse


def integer(lo: int, hi: int, what: str = "") -> Callable[[str], int]:
    """A whole number in [lo, hi]."""
    allowed = what or f"a whole number from {lo} to {hi}"

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    return parse


def generation(name: str) -> Callable[[str], int | float]:
    """The type of the flag for generation parameter ``name``: its range is ``engine.decode.limits.GENERATION_LIMITS``,
    the table the worker and generation_config.json's validation use too."""
    limit = GENERATION_LIMITS[name]

    def parse(text: str) -> int | float:
        try:
            return limit.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = name
    return parse


GIB = number(0.0, MAX_GIB, lo_open=True, what=f"a finite number of GiB > 0 and <= {MAX_GIB:g}")
GIB_BYTES = 1 << 30


def vram_budget(text: str) -> int:
    """``--vram-gb``: GiB for people, bytes from here on (``dest="vram_budget_bytes"``; the engine's one unit)."""
    return max(1, int(round(GIB(text) * GIB_BYTES)))  # a positive budget stays positive


TOKENS = integer(1, INT32_MAX, f"a whole number of tokens from 1 to {INT32_MAX}")
MAX_CACHE_RAM_MIB = 1 << 24  # 16 TiB: more is a typo
CACHE_RAM = integer(0, MAX_CACHE_RAM_MIB, f"a whole number of MiB from 0 to {MAX_CACHE_RAM_MIB}")
TOKENS_PER_PASS = number(0.0, 4096.0, lo_open=True)
# generation parameters: one flag type per entry of engine.decode.limits.GENERATION_LIMITS
temperature = generation("temperature")
MAX_NEW_TOKENS = generation("max_new_tokens")
TOP_P = generation("top_p")
TOP_K = generation("top_k")
SEED = generation("seed")
THRESHOLD = generation("threshold")
BLOCK = generation("block_size")
PRESENCE_PENALTY = generation("presence_penalty")
REPETITION_PENALTY = generation("repetition_penalty")

__all__ = ["BLOCK", "GIB", "GIB_BYTES", "MAX_NEW_TOKENS", "PRESENCE_PENALTY", "REPETITION_PENALTY", "SEED", "THRESHOLD", "TOKENS",
           "TOKENS_PER_PASS", "TOP_K", "TOP_P", "generation", "integer", "number", "temperature",
           "vram_budget"]
