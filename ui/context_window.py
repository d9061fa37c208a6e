"""Chats longer than the model's context: how big the context is, what a new message needs, and which oldest turns to
leave out so the rest fits. Plain functions, no Qt (the meter and the dialog are in ``ui.context_meter``).

The context is the engine's own limit for the loaded model: the planned context of its VRAM plan when it runs under
one (the KV cache was sized for it), else the model's ``max_position_embeddings`` (``engine.api.Engine.generate``
holds a request to the smaller of the two). A message is sent only if the conversation with it, as the chat template
lays it out, leaves room for an answer (:func:`answer_reserve`); when it does not, the window asks what to do:
leave the oldest turns out (the system prompt stays; the chat keeps them on screen and on disk) or start a new chat
that carries a summary of this one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

Messages = list[dict[str, str]]
Counter = Callable[[Messages], "int | None"]  # tokens of a conversation as the engine reads it (None: unknown)

MAX_ANSWER_RESERVE = 1024  # room kept for the answer: at most this many tokens...
RESERVE_SHARE = 4  # ...and at most a quarter of the context
DROP_OLDEST = "drop-oldest"  # the chat setting (``Conversation.settings["context_overflow"]``) once chosen
OVERFLOW_KEY = "context_overflow"
SUMMARY_TOKENS = 512  # the summary's length limit
SHIFT_SHARE = 4  # a chat past its context drops turns until a quarter of its room is free (shift_slack)
SUMMARY_INSTRUCTION = (
    "Summarize our conversation so far for a fresh chat that continues it: the facts, names, numbers, decisions, "
    "code and open questions the continuation needs. Write only the summary, in a few short paragraphs or bullets."
)
SUMMARY_HEADER = "Summary of an earlier conversation that this chat continues:"


def context_limit(info: Mapping[str, Any] | None) -> int | None:
    """The context the engine holds a request to, from a ``loaded`` record (or the same keys read from the model
    folder): the plan's ``ctx_tokens`` when it runs under a plan, capped by the config's
    ``max_position_embeddings``; without a plan, the ``ctx_tokens`` the model was loaded with (the VRAM panel's
    applied context, which the engine holds requests to as well). None when none is known."""
    if not info:
        return None
    config = info.get("config") if isinstance(info.get("config"), Mapping) else {}
    plan = info.get("plan") if isinstance(info.get("plan"), Mapping) else {}
    limits = [v for v in (config.get("max_position_embeddings"), plan.get("ctx_tokens"), info.get("ctx_tokens"))
              if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min(limits) if limits else None


def answer_reserve(limit: int, max_new_tokens: int) -> int:
    """Tokens kept free for the answer when deciding whether a message fits."""
    return max(1, min(max_new_tokens, MAX_ANSWER_RESERVE, limit // RESERVE_SHARE))


def fits(tokens: int, limit: int, reserve: int) -> bool:
    return tokens + reserve <= limit


def turn_starts(messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Where the turns begin (each user message), after a leading system prompt."""
    first = 1 if messages and messages[0].get("role") == "system" else 0
    return [i for i in range(first, len(messages)) if messages[i].get("role") == "user"]


def fit_messages(messages: Messages, count: Counter, limit: int, reserve: int, keep: int = 0,
                 slack: int = 0) -> tuple[Messages, int] | None:
    """The conversation with its oldest turns left out as far as needed for it to leave ``reserve`` tokens of
    ``limit``: ``(messages to send, how many messages were left out)``. The system prompt and the last turn always
    stay; None when even they do not fit (or the tokens cannot be counted). A binary search over the turn starts: a
    handful of counts however long the chat.

    ``keep``: how many messages (after the system prompt) the last send left out; when the chat still fits from
    there, it starts there again, so that successive sends begin with the same tokens (the engine's prompt cache then
    reads only the new turn). ``slack``: when the start has to move, it moves until ``slack`` more tokens are free,
    so that the next turns fit from there too (as llama.cpp's context shift drops half of the context at once);
    as far as needed when even the last turn does not leave that much."""
    system = messages[:1] if messages and messages[0].get("role") == "system" else []
    whole = count(messages)
    if whole is not None and fits(whole, limit, reserve):
        return messages, 0
    starts = turn_starts(messages)
    if keep > 0 and len(system) + keep in starts and _fits_from(messages, system, len(system) + keep, count, limit,
                                                                 reserve):
        return system + messages[len(system) + keep:], keep
    if not starts or not _fits_from(messages, system, starts[-1], count, limit, reserve):
        return None
    free = reserve + slack
    if slack <= 0 or not _fits_from(messages, system, starts[-1], count, limit, free):
        free = reserve
    lo, hi = -1, len(starts) - 1  # from starts[lo] it does not fit (-1: the whole chat), from starts[hi] it does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits_from(messages, system, starts[mid], count, limit, free):
            hi = mid
        else:
            lo = mid
    start = starts[hi]
    return system + messages[start:], start - len(system)


def shift_slack(limit: int, reserve: int) -> int:
    """The ``slack`` of :func:`fit_messages` in the window: a quarter of the room the chat has."""
    return max(0, limit - reserve) // SHIFT_SHARE


def _fits_from(messages: Messages, system: Messages, start: int, count: Counter, limit: int, reserve: int) -> bool:
    tokens = count(system + messages[start:])
    return tokens is not None and fits(tokens, limit, reserve)


def summary_request(messages: Messages) -> Messages:
    """The conversation followed by the request for its summary (sent with thinking off)."""
    return [*messages, {"role": "user", "content": SUMMARY_INSTRUCTION}]


def continued_system_prompt(system_prompt: str, summary: str) -> str:
    """The new chat's system prompt: the old one (kept) and the summary it carries."""
    carried = f"{SUMMARY_HEADER}\n\n{summary.strip()}"
    return f"{system_prompt.strip()}\n\n{carried}" if system_prompt.strip() else carried


def continued_title(title: str) -> str:
    return title if title.endswith("(continued)") else f"{title} (continued)"
