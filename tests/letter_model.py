"""A scripted stand-in for the model and tokenizer that the decode loops take: row p of every forward peaks at
``target(p)``, each id is one letter. It checks the loops' model contract (each forward starts right after the
committed prefix, block forwards are block-aligned) and records every call. Shared by the decode-loop tests and the
window test that runs the real loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from clover_desk.engine.decode.settings import DecodeSettings

V = 64
MASK = 63
EOS = 2
THINK, END_THINK = 3, 4


@dataclass
class FakeCache:
    max_len: int
    tokens: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class Call:
    start_pos: int
    ids: list[int]
    block_size: int | None
    write_cache: bool
    last_only: bool


class ScriptedModel:
    """Row for absolute position p peaks at ``target(p)`` with logit margin ``margin(p)`` (0 elsewhere).

    It follows the model contract: it checks that every forward starts right after the committed prefix and that
    block-mode forwards are block-aligned, and it records each call. ``shift`` makes row i predict position i+1.
    """

    def __init__(
        self, target: Callable[[int], int], margin: Callable[[int], float] = lambda p: 12.0, shift: bool = False
    ) -> None:
        self.target, self.margin, self.shift = target, margin, shift
        self.calls: list[Call] = []
        self.caches: list[FakeCache] = []

    def new_cache(self, max_len: int) -> FakeCache:
        self.caches.append(FakeCache(max_len))
        return self.caches[-1]

    def forward(
        self, ids: torch.Tensor, start_pos: int, cache: FakeCache, block_size: int | None = None,
        write_cache: bool = True, last_only: bool = False, prefill: bool = False,
    ) -> torch.Tensor:
        assert ids.dtype == torch.long and ids.dim() == 1
        assert start_pos == cache.length, "a forward must start right after the committed prefix"
        if block_size is not None:
            assert start_pos % block_size == 0
        assert not prefill or (start_pos == 0 and write_cache and block_size is not None)
        self.calls.append(Call(start_pos, ids.tolist(), block_size, write_cache, last_only))
        T = ids.shape[0]
        logits = torch.zeros(T, V)
        for i in range(T):
            p = start_pos + i + (1 if self.shift else 0)
            logits[i, self.target(p)] = self.margin(p)
        if write_cache:
            cache.tokens.extend(ids.tolist())
            assert cache.length <= cache.max_len
        return logits[-1:] if last_only else logits


def settings(**kw: object) -> DecodeSettings:
    base = dict(mode="diffusion", max_new_tokens=64, block_size=8, threshold=0.95, mask_token_id=MASK,
                eos_token_ids=(EOS,), think_start_id=THINK, think_end_id=END_THINK, max_positions=4096)
    base.update(kw)
    return DecodeSettings(**base)  # type: ignore[arg-type]


def letters(p: int) -> int:
    return 10 + p % 40  # never EOS / think / mask


class LetterTokenizer:
    """id -> one letter; the think markers and EOS are special tokens (skipped as text)."""

    specials = {EOS: "<eos>", THINK: "<think>", END_THINK: "</think>", MASK: "<mask>"}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            if i in self.specials:
                if not skip_special_tokens:
                    out.append(self.specials[i])
            else:
                out.append(chr(ord("a") + (i - 10) % 26))
        return "".join(out)
