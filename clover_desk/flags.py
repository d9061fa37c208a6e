"""Argument types for the numeric flags of every command: a value outside its range is refused by argparse with
one line naming the flag and what is allowed (exit status 2), before any work starts.

    parser.add_argument("--temperature", type=flags.TEMPERATURE)
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1
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


def temperature(text: str) -> float:
    """0 (greedy) or a finite number from 0.001 to 100: below 0.001 the scaled logits overflow to inf."""
    value = number(0.0, 100.0, what="0 (greedy) or a finite number from 0.001 to 100")(text)
    if 0.0 < value < 1e-3:
        raise argparse.ArgumentTypeError(f"must be 0 (greedy) or a finite number from 0.001 to 100, got {text!r}")
    return value


GIB = number(0.0, MAX_GIB, lo_open=True, what=f"a finite number of GiB > 0 and <= {MAX_GIB:g}")
TOKENS = integer(1, INT32_MAX, f"a whole number of tokens from 1 to {INT32_MAX}")
TOP_P = number(0.0, 1.0, lo_open=True, what="a number in (0, 1]")
TOP_K = integer(0, INT32_MAX)
SEED = integer(0, SEED_MAX)
THRESHOLD = number(0.0, 1.0, what="a number in [0, 1]")
BLOCK = integer(1, 4096)
TOKENS_PER_PASS = number(0.0, 4096.0, lo_open=True)

__all__ = ["BLOCK", "GIB", "SEED", "THRESHOLD", "TOKENS", "TOKENS_PER_PASS", "TOP_K", "TOP_P", "integer", "number",
           "temperature"]
