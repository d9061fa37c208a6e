"""What the engine accepts, defined once (stdlib only: the CLI, the worker and the window import it).

* :data:`GENERATION_LIMITS`: the type and range of every numeric generation parameter. The CLI's flag types
  (``clover_desk.cli.flags``), the worker's command checks (``clover_desk.worker.process``), generation_config.json's validation
  (``engine.model.config``) and ``Engine.generate`` all read this one table, so a value one of them refuses, all refuse.
* Text: :func:`decode_utf8` for bytes from files and pipes, :func:`check_text` for strings from argv or JSON (which
  can carry lone surrogates: undecodable argv bytes, or a ``"\\udcff"`` escape).
* Chat templates (``engine.decode.tokenizer``): how long a render may run and how much it may build.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from clover_desk.engine.errors import CloverError, PromptError

INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1

# A prompt longer than this can never fit a context (config.json allows at most 16,777,216 positions, a few bytes
# of text per token), so a bigger prompt file is refused before it is read into memory.
MAX_PROMPT_BYTES = 64 * 1024 * 1024

# Chat templates are code from the model folder, run in a sandbox with these limits (engine.decode.tokenizer).
TEMPLATE_TIMEOUT_S = 2.0  # a render running longer is stopped (ordinary templates take milliseconds)
TEMPLATE_MAX_SOURCE_CHARS = 1 << 20  # released templates are a few KB
# What one render may build, in characters (elements for lists), output included: a base plus a multiple of its
# input (the characters of the messages and tools), so a long conversation renders and a template that multiplies
# its input is stopped before it fills the memory.
TEMPLATE_BASE_CHARS = 1 << 20
TEMPLATE_CHARS_PER_INPUT_CHAR = 8
TEMPLATE_MAX_INT_BITS = 4096  # integers a template computes (``10 ** 10 ** 9`` would run for hours in one C call)


@dataclass(frozen=True)
class Limit:
    """The type and range of one parameter: a whole number (``kind`` "int") or a finite number ("number") from
    ``lo`` to ``hi`` (``lo`` itself excluded with ``lo_open``). Positive numbers below ``gap_to`` are refused too
    (temperature: 0 means greedy, and a tiny positive one scales the logits past the float range)."""

    kind: str
    lo: float
    hi: float
    allowed: str  # in words, for "must be <allowed>, got <value>"
    lo_open: bool = False
    gap_to: float = 0.0

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` (a Python / JSON value) has the right type and lies in the range."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind == "int" and not isinstance(value, int):
            return False
        try:
            if not math.isfinite(value):
                return False
        except OverflowError:  # an int too large for a float is past every bound here
            return False
        if value < self.lo or (self.lo_open and value == self.lo) or value > self.hi:
            return False
        return not 0 < value < self.gap_to

    def parse(self, text: str) -> int | float:
        """A command-line value; ``ValueError("must be <allowed>, got '<text>'")`` when it is not one."""
        refusal = ValueError(f"must be {self.allowed}, got {text!r}")
        try:
            value: int | float = int(text, 10) if self.kind == "int" else float(text)
        except ValueError:
            raise refusal from None
        if not self.accepts(value):
            raise refusal
        return value


# Numeric generation parameters: engine.decode.events.GenerationParams' fields, then generation_config.json's Clover ramps
# (engine.decode.decoding). Biases and penalties are added to (or divide) logits of a few tens: past 100 they only force
# or forbid tokens, and far past it they overflow.
GENERATION_LIMITS: dict[str, Limit] = {
    "max_new_tokens": Limit("int", 1, INT32_MAX, f"a whole number from 1 to {INT32_MAX}"),
    "temperature": Limit("number", 0.0, 100.0, "0 (greedy) or a finite number from 0.001 to 100", gap_to=1e-3),
    "top_p": Limit("number", 0.0, 1.0, "a number in (0, 1]", lo_open=True),
    "top_k": Limit("int", 0, INT32_MAX, f"a whole number from 0 (off) to {INT32_MAX}"),
    "presence_penalty": Limit("number", -100.0, 100.0, "a number from -100 to 100 (0 = off)"),
    "repetition_penalty": Limit("number", 0.01, 100.0, "a number from 0.01 to 100 (1 = off)"),
    "block_size": Limit("int", 1, 4096, "a whole number from 1 to 4096"),
    "threshold": Limit("number", 0.0, 1.0, "a number in [0, 1]"),
    "seed": Limit("int", 0, SEED_MAX, f"a whole number from 0 to {SEED_MAX}"),
    "dllm_length_penalty": Limit("number", -100.0, 100.0, "a number from -100 to 100 (0 = off)"),
    "dllm_length_penalty_start": Limit("int", 0, INT32_MAX, f"a whole number of tokens from 0 to {INT32_MAX}"),
    "dllm_length_penalty_window": Limit("int", 0, INT32_MAX, f"a whole number of tokens from 0 to {INT32_MAX}"),
    "dllm_think_end_bias": Limit("number", -100.0, 100.0, "a number from -100 to 100 (0 = off)"),
    "dllm_think_end_bias_start": Limit("int", 0, INT32_MAX, f"a whole number of tokens from 0 to {INT32_MAX}"),
    "dllm_think_end_bias_window": Limit("int", 0, INT32_MAX, f"a whole number of tokens from 0 to {INT32_MAX}"),
}


def check_generation_params(params: Any) -> None:
    """Refuse request parameters (a ``GenerationParams``) outside :data:`GENERATION_LIMITS` with a PromptError
    naming the first bad one; ``None`` fields mean "the model's default" and pass."""
    for name, limit in GENERATION_LIMITS.items():
        value = getattr(params, name, None)
        if value is not None and not limit.accepts(value):
            raise PromptError(f"generation parameter {name} must be {limit.allowed}, got {value!r}")


def decode_utf8(data: bytes, where: str, error: type[CloverError] = PromptError) -> str:
    """``data`` as UTF-8 text, or ``error("<where>: not UTF-8 text (byte 0x.. at offset N)")``."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{where}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start:,})") from None


def check_text(text: str, where: str, error: type[CloverError] = PromptError) -> str:
    """``text`` when it can be written as UTF-8, else ``error`` naming the first lone surrogate: one that stands
    for an undecodable byte (how Python passes non-UTF-8 argv bytes) is shown as that byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
        raise error(f"{where}: not UTF-8 text ({what} at character {exc.start:,})") from None
    return text


__all__ = [
    "GENERATION_LIMITS",
    "INT32_MAX",
    "Limit",
    "MAX_PROMPT_BYTES",
    "SEED_MAX",
    "TEMPLATE_BASE_CHARS",
    "TEMPLATE_CHARS_PER_INPUT_CHAR",
    "TEMPLATE_MAX_INT_BITS",
    "TEMPLATE_MAX_SOURCE_CHARS",
    "TEMPLATE_TIMEOUT_S",
    "check_generation_params",
    "check_text",
    "decode_utf8",
]
