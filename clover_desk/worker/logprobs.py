"""OpenAI's ``logprobs`` for the HTTP server (the request fields are checked in :mod:`openai_schema`): the engine's
:class:`~engine.decode.events.TokenLogprobs` shaped as OpenAI's answers give them.

* ``/v1/chat/completions``: ``logprobs: true`` and ``top_logprobs`` 0 to 20 (alternatives per token; it needs
  ``logprobs: true``). ``choices[].logprobs`` is ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}, ...]}, ...], "refusal": null}``, one entry per token of the answer channel
  (``reasoning_content`` tokens, the ``<think>`` markers and the end-of-text token are not listed; a tool call's
  tokens are, as the answer's text). A stream's chunks carry the entries of the tokens committed since the
  previous chunk (text held back, such as a possible stop sequence or ``<tool_call>``, may come a chunk later
  than its entries).
* ``/v1/completions``: ``logprobs`` 0 to 5; ``choices[].logprobs`` is ``{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}``: every token of the text (thinking and its markers included, as the text is),
  ``top_logprobs`` a ``{token: logprob}`` object of the N best and the chosen one, ``text_offset`` each token's
  start in the choice's text.

With a stop sequence, the tokens from the one that reaches it on are left out. The values are the engine's: the
model's own distribution (raw logits; :class:`engine.decode.events.TokenLogprobs` says which row per mode).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from clover_desk.engine.decode.events import TokenLogprobs

FLOOR = -9999.0  # OpenAI's stand-in for the log of 0 (JSON has no -Infinity)


@dataclass(frozen=True)
class Entry:
    """One token as the answer lists it: its text, log probability, alternatives and start in its channel."""

    token_id: int
    text: str
    logprob: float
    alternatives: tuple[tuple[int, float], ...]
    offset: int


def _value(logprob: float) -> float:
    return FLOOR if math.isnan(logprob) or logprob < FLOOR else float(logprob)


class LogprobTrack:
    """The entries of one answer as the engine's events come (``add``), handed out once each (``take``).

    ``completion``: every token of the text (both channels and the think markers), else the answer channel's.
    ``tokenizer``: the engine's (``decode``, ``token_bytes``)."""

    def __init__(self, tokenizer: Any, completion: bool) -> None:
        self._tokenizer = tokenizer
        self._kinds = ("thinking", "answer", "marker") if completion else ("answer",)
        self.entries: list[Entry] = []
        self._chars = 0  # the channel's text so far, as the tokens' texts add up
        self._sent = 0
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        if token_id not in self._texts:
            self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return self._texts[token_id]

    def add(self, event: TokenLogprobs) -> None:
        for i, (token_id, logprob, kind) in enumerate(zip(event.token_ids, event.logprobs, event.channels)):
            if kind not in self._kinds:
                continue
            text = self.text(token_id)
            self.entries.append(Entry(token_id, text, _value(logprob), tuple(event.alternatives(i)), self._chars))
            self._chars += len(text)

    def take(self, limit: int | None = None) -> list[Entry]:
        """The entries not handed out yet; with ``limit`` (the channel's length at a stop sequence), only those that
        start before it (the others are dropped)."""
        new = self.entries[self._sent:]
        self._sent = len(self.entries)
        return [e for e in new if limit is None or e.offset < limit]

    # ---- OpenAI's shapes ----
    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": self.text(token_id), "logprob": _value(logprob),
                "bytes": list(self._tokenizer.token_bytes(token_id))}

    def chat(self, entries: Sequence[Entry]) -> dict[str, Any]:
        """``choices[].logprobs`` of a chat answer (or chunk)."""
        return {"content": [{**self._token(e.token_id, e.logprob),
                             "top_logprobs": [self._token(i, v) for i, v in e.alternatives]} for e in entries],
                "refusal": None}

    def legacy(self, entries: Sequence[Entry]) -> dict[str, Any]:
        """``choices[].logprobs`` of a completion (or chunk; a stream's offsets count from the start of the whole
        text, as OpenAI's do)."""
        tops = []
        for e in entries:
            top = {self.text(i): _value(v) for i, v in e.alternatives}
            top.setdefault(e.text, e.logprob)
            tops.append(top)
        return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": tops, "text_offset": [e.offset for e in entries]}
