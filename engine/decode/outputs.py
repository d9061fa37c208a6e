"""What a decoding loop's commits turn into: text by channel (thinking or answer,
:class:`ChannelText`) and, for a request that asks, log probabilities (:func:`row_logprobs` for causal rows,
:class:`SlotLogprobs` for a diffusion block's slots).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from clover_desk.engine.decode.events import TextDelta, TokenLogprobs
from clover_desk.engine.decode.settings import DecodeSettings
from clover_desk.engine.decode.tokenizer import StreamDecoder


def thinking_open_after(ids: Sequence[int], think_start: int | None, think_end: int | None) -> bool:
    """Whether a ``<think>`` is open at the end of ``ids`` (the last think marker is ``<think>``)."""
    for tok in reversed(ids):
        if tok == think_end:
            return False
        if tok == think_start:
            return True
    return False


class ChannelText:
    """Routes committed ids to the "thinking" or "answer" text stream; markers and EOS are not text."""

    def __init__(self, decode: Callable[..., str] | None, s: DecodeSettings, thinking_open: bool) -> None:
        self._s = s
        self._eos = set(s.eos_token_ids)
        self.thinking_open = thinking_open
        self._streams = {name: StreamDecoder(decode) if decode else None for name in ("thinking", "answer")}

    def _push(self, channel: str, ids: list[int], out: list[TextDelta]) -> None:
        stream = self._streams[channel]
        if stream is None or not ids:
            return
        text = stream.push(ids)
        if text:
            if out and out[-1].channel == channel:
                out[-1] = TextDelta(out[-1].text + text, channel)
            else:
                out.append(TextDelta(text, channel))

    def _flush(self, channel: str, out: list[TextDelta]) -> None:
        stream = self._streams[channel]
        text = stream.flush() if stream is not None else ""
        if text:
            out.append(TextDelta(text, channel))

    def feed(self, ids: Sequence[int]) -> list[TextDelta]:
        out: list[TextDelta] = []
        run: list[int] = []
        for tok in ids:
            channel = "thinking" if self.thinking_open else "answer"
            if tok == self._s.think_start_id or tok == self._s.think_end_id:
                self._push(channel, run, out)
                run = []
                self._flush(channel, out)
                self.thinking_open = tok == self._s.think_start_id
            elif tok not in self._eos:
                run.append(tok)
        self._push("thinking" if self.thinking_open else "answer", run, out)
        return out

    def finish(self) -> list[TextDelta]:
        out: list[TextDelta] = []
        self._flush("thinking", out)
        self._flush("answer", out)
        return out

    def text(self, channel: str) -> str:
        stream = self._streams[channel]
        return stream.text if stream is not None else ""

    def kinds(self, ids: Sequence[int]) -> tuple[str, ...]:
        """Where :meth:`feed` will put each of ``ids`` (call it before): "thinking", "answer", "marker" or "eos"."""
        thinking, out = self.thinking_open, []
        for tok in ids:
            if tok == self._s.think_start_id or tok == self._s.think_end_id:
                out.append("marker")
                thinking = tok == self._s.think_start_id
            else:
                out.append("eos" if tok in self._eos else "thinking" if thinking else "answer")
        return tuple(out)


def _top_of(lp: Tensor, top: int) -> tuple[Tensor, Tensor]:
    """The ``top`` best log probabilities of each row of ``lp`` [T, V] and their ids, best first: ([T, top] x2)."""
    if top <= 0:
        return lp.new_zeros(lp.shape[0], 0), torch.zeros(lp.shape[0], 0, dtype=torch.long, device=lp.device)
    values, ids = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
    return values, ids


def _logprob_event(picked: Tensor, top_lp: Tensor, top_ids: Tensor, ids: Sequence[int],
                   channels: tuple[str, ...]) -> TokenLogprobs:
    """One host read of what :func:`row_logprobs` or :class:`SlotLogprobs` gathered for ``ids``."""
    host = torch.cat([picked.view(-1, 1).float(), top_lp.float(), top_ids.float()], dim=1).tolist()  # [T, 1 + 2k]
    top = top_lp.shape[1]
    return TokenLogprobs(
        token_ids=tuple(int(t) for t in ids), logprobs=tuple(row[0] for row in host), channels=channels, top=top,
        top_ids=tuple(int(v) for row in host for v in row[1 + top:]),
        top_logprobs=tuple(v for row in host for v in row[1:1 + top]),
    )


def row_logprobs(rows: Tensor, ids: Sequence[int], top: int, channels: tuple[str, ...]) -> TokenLogprobs:
    """The event for tokens ``ids`` [T] each chosen from its row of the raw logits ``rows`` [T, V] (AR, spec)."""
    lp = torch.log_softmax(rows.float(), dim=-1)  # [T, V]
    chosen = torch.tensor(list(ids), dtype=torch.long, device=rows.device).view(-1, 1)
    values, top_ids = _top_of(lp, top)
    return _logprob_event(lp.gather(-1, chosen).squeeze(-1), values, top_ids, ids, channels)


class SlotLogprobs:
    """A diffusion block's log probabilities, slot by slot, as the passes commit them: kept on the device (no host
    read per pass), read once when the block's tokens go out."""

    def __init__(self, block_size: int, top: int, device: torch.device) -> None:
        self.top = top
        self.picked = torch.zeros(block_size, device=device)  # [B]
        self.top_lp = torch.zeros(block_size, top, device=device)  # [B, top]
        self.top_ids = torch.zeros(block_size, top, dtype=torch.long, device=device)  # [B, top]

    def update(self, logits: Tensor, x: Tensor, commit: Tensor) -> None:
        """A pass's (shifted) raw logits [B, V], the block after it x [B] and its commits [B]."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        self.picked = torch.where(commit, lp.gather(-1, x.view(-1, 1)).squeeze(-1), self.picked)
        values, ids = _top_of(lp, self.top)
        self.top_lp = torch.where(commit[:, None], values, self.top_lp)
        self.top_ids = torch.where(commit[:, None], ids, self.top_ids)

    def event(self, start: int, ids: Sequence[int], channels: tuple[str, ...]) -> TokenLogprobs:
        """The event for the block's output ``ids``, slots ``start`` on."""
        span = slice(start, start + len(ids))
        return _logprob_event(self.picked[span], self.top_lp[span], self.top_ids[span], ids, channels)
