"""The prompt cache: what a prompt's prefill left (the KV rows, the Gated DeltaNet states and the last logit row at
a point the model splits a prefill at), kept for a later request that starts with the same tokens, with checkpoints
at earlier points and entries of other chats moved to host memory. The decoding loops (:mod:`engine.decode.generate`) take
a cache from it and hand it the points their prefills reach."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from clover_desk.engine.defaults import PROMPT_CACHE_RAM_MIB
from clover_desk.engine.model.cache import ModelCache
from clover_desk.engine.model.clover import CloverModel

log = logging.getLogger(__name__)


@dataclass
class _Saved:
    """A prompt cache entry moved to host memory: the kept keys and values (rows below ``len(ids)``), the GDN
    states and the last logit row, and its checkpoints (earlier points: states and logit rows only, ``kv`` empty,
    their rows being the first of the entry's). A checkpoint alone is one of these too."""

    ids: tuple[int, ...]
    block_size: int | None
    kv: list[tuple[int, Tensor, Tensor]]  # (layer, key rows, value rows) [Hkv, n, hd]
    gdn: list[tuple[int, Tensor, Tensor]]  # (layer, conv, state)
    row: Tensor | None
    nbytes: int  # its own and its checkpoints'
    backs: list[_Saved] = field(default_factory=list)  # shorter first
    scope: str = ""  # whose entry it is (PromptCache.scoped): only requests of the same scope use it


def _nbytes(pairs: list[tuple[int, Tensor, Tensor]], row: Tensor | None = None) -> int:
    size = sum(a.numel() * a.element_size() + b.numel() * b.element_size() for _, a, b in pairs)
    return size + (0 if row is None else row.numel() * row.element_size())


# host memory the prompt cache's saved entries may take (PromptCache.host_bytes), and what it leaves free
SAVED_BYTES = PROMPT_CACHE_RAM_MIB << 20
SAVED_FREE_MARGIN = 2 << 30
# earlier points of the last prompt's entry kept reachable (PromptCache.checkpoints); each costs host memory for
# the GDN states at that point (about 60 MiB at Clover's shape), as llama.cpp's context checkpoints for
# recurrent and hybrid models do (8 by default there too)
CHECKPOINTS = 8


class PromptCache:
    """What a prompt's prefill left, for a later request that starts with the same tokens (a chat's next turn
    re-sends the whole chat): the cache itself, whose keys and values below the kept length stay valid (later writes
    land past it), plus copies of the Gated DeltaNet states and the last logit row at that point. Kept at a boundary
    the model itself splits a prefill at (a whole block in block mode, a whole GDN chunk in causal mode), so going on
    from it is the same arithmetic as one long prefill. One generation runs at a time (the engine's lock).

    Checkpoints: a GDN layer's state holds one point only, so the entry also keeps up to ``checkpoints`` earlier
    points reachable (the chat's turn starts a prefill passed, and each point a later request went on from), their
    states and logit rows copied to host memory, their keys and values being the entry's first rows. A request that
    starts with one of them but not with the rest (Regenerate, an older message edited and sent again, a branch from
    an older answer) goes back to the longest one it starts with, in place, and reads only from there.

    The last prompt's entry lives in the cache the request ran in. When a request starts otherwise (another chat),
    that entry moves to host memory first, as a copy of its rows and states (and its checkpoints), and the request
    looks among the saved entries and their checkpoints for the longest point it starts with (a saved entry used
    from one of its checkpoints stays saved for its own chat); past ``host_bytes`` together, checkpoints go before
    whole entries, the least recently used first (:meth:`_save`), and none is saved, nor a checkpoint made, that
    would leave the machine less than ``SAVED_FREE_MARGIN`` of available memory. ``host_bytes=0`` keeps only the
    last prompt's entry.

    With a model that hands every request the same cache for its CUDA graphs (``CloverModel.new_cache``), the kept
    cache is that one: a request that goes on from it replays the graphs recorded for it; one that does not gets it
    back emptied (or filled from a saved entry), as without a prompt cache.

    Scopes: every entry belongs to the scope of the request that made it (:meth:`scoped`: the HTTP server's client
    identity and ``cache_salt``, or the process's own chats), and only requests of that scope go on from it or from
    its checkpoints. To a request of another scope an entry is another chat's: it reads its whole prompt, so neither
    its ``cached_tokens`` nor its time to first token tells whether someone else sent the same prompt before."""

    def __init__(self, host_bytes: int = SAVED_BYTES, checkpoints: int = CHECKPOINTS) -> None:
        self.host_bytes = host_bytes
        self.checkpoints = checkpoints
        self.ids: tuple[int, ...] = ()
        self.block_size: int | None = None
        self.scope = ""  # the last prompt's entry's scope
        self._cache: ModelCache | None = None
        self._gdn: list[tuple[int, Tensor, Tensor]] = []  # (layer, conv, state) copies at len(ids)
        self._row: Tensor | None = None  # [V] logits of the last kept position
        self._backs: list[_Saved] = []  # the entry's checkpoints (host memory), shorter first
        self.saved: list[_Saved] = []  # in host memory, least recently used first

    @staticmethod
    def for_model(prompt_cache: PromptCache | ScopedPromptCache | None,
                  model: Any) -> PromptCache | ScopedPromptCache | None:
        """``prompt_cache`` where ``model`` can use one (a CloverModel), else None: the loops then neither look it
        up nor keep copies for it."""
        return prompt_cache if isinstance(model, CloverModel) else None

    @property
    def saved_bytes(self) -> int:
        return sum(e.nbytes for e in self.saved)

    @property
    def checkpoint_lengths(self) -> list[int]:
        """How many tokens each of the last prompt's checkpoints holds, shorter first."""
        return [len(b.ids) for b in self._backs]

    def scoped(self, scope: str) -> ScopedPromptCache:
        """This cache as the requests of ``scope`` see it (what the decoding loops are handed)."""
        return ScopedPromptCache(self, scope)

    def take(self, model: Any, prompt: Sequence[int], limit: int, max_len: int,
             block_size: int | None, scope: str = "") -> tuple[Any, int, Tensor | None]:
        """(a cache for ``max_len`` positions, how many of ``prompt``'s first positions it holds already, at most
        ``limit``, and the logit row after them), or a new empty cache, 0 and None. Only entries of ``scope`` count."""
        prompt = tuple(prompt)

        def usable(ids: tuple[int, ...], mode: int | None, owner: str) -> int:
            """How many first tokens of an entry of ``ids`` kept in ``mode`` can start the prompt: its checkpoints
            are prefixes of it, so one comparison per entry, not per point."""
            return min(_shared(prompt, ids), limit) if mode == block_size and owner == scope else 0

        kept = self._cache
        live = usable(self.ids, self.block_size, self.scope) if kept is not None else 0
        here = 0 < len(self.ids) <= live
        back = None if here else max((b for b in self._backs if 0 < len(b.ids) <= live), key=lambda b: len(b.ids),
                                     default=None)
        found: list[tuple[_Saved, _Saved]] = []  # (a point, the saved entry it belongs to)
        for e in self.saved:
            n = usable(e.ids, e.block_size, e.scope)
            found += [(p, e) for p in (e, *e.backs) if 0 < len(p.ids) <= n]
        point, entry = max(found, key=lambda pe: len(pe[0].ids), default=(None, None))
        reach = len(self.ids) if here else len(back.ids) if back is not None else 0  # in place (0: not at all)
        if not reach or (point is not None and len(point.ids) > reach):
            # the longest point is saved (another chat's entry, or one of its checkpoints), or there is none
            if entry is not None:
                self.saved.remove(entry)
                if point is not entry:  # used from a checkpoint: it stays saved, as the most recently used
                    self.saved.append(entry)
            if kept is not None:
                self._save(kept)
            self.clear()  # its cache goes before the new one is made
            return self._restore(model, entry, point, max_len)
        if back is not None:
            # back to an earlier point of the entry, in place (the rows below it are the same; the later ones get
            # written over)
            dev = kept.tensors()[0].device
            self.ids, self.block_size = back.ids, back.block_size
            self._gdn, self._row = _moved(back.gdn, dev), _moved_row(back.row, dev)
            self._backs = [b for b in self._backs if len(b.ids) < len(back.ids)]
        n = len(self.ids)
        # a longer request, or a model that keeps one cache for its graphs and a longer request replaced it: the
        # kept keys and values move into a cache that fits it, one the model hands out
        if kept.max_len < max_len or not model.hands_out(kept):
            rows = [(i, k[:, :n].clone(), v[:, :n].clone()) for i, k, v in _kv(kept)]
            self._cache = kept = None  # the old cache goes before the bigger one is made (only its rows stay)
            self._cache = kept = model.new_cache(max_len)
            _put_rows(kept, rows)
            del rows
        _put_states(kept, self._gdn, n)
        return kept, n, self._row

    def keep(self, prompt: Sequence[int], cache: Any, row: Tensor | None, block_size: int | None,
             scope: str = "") -> None:
        """Remember ``cache`` as it is now, holding ``prompt`` (its length), whose last logit row is ``row``. When
        that goes on from the entry kept before in the same cache (a chat's next turn, a chat read ahead, the next
        turn start of a prefill), the earlier point becomes a checkpoint: its states are copied to host memory."""
        if not isinstance(cache, ModelCache) or not prompt or cache.length != len(prompt):
            self.clear()
            return
        ids = tuple(int(i) for i in prompt)
        n = len(self.ids)
        if cache is self._cache and 0 < n <= len(ids) and ids[:n] == self.ids and scope == self.scope:
            if n < len(ids):
                self._checkpoint()
        else:
            self._backs = []
        self.ids, self.block_size, self._cache, self.scope = ids, block_size, cache, scope
        self._gdn = [(i, c.clone(), st.clone()) for i, (c, st) in enumerate(zip(cache.conv, cache.state))
                     if c is not None and st is not None]
        self._row = None if row is None else row.detach().clone()

    def clear(self) -> None:
        """Forget the last prompt's entry and its checkpoints (the saved entries stay)."""
        self.ids, self._cache, self._gdn, self._row, self._backs, self.scope = (), None, [], None, [], ""

    def _checkpoint(self) -> None:
        """Make the entry's point a checkpoint (the oldest goes past ``checkpoints``)."""
        if self.checkpoints <= 0:
            return
        need = _nbytes(self._gdn, self._row)
        import psutil

        if psutil.virtual_memory().available - need < SAVED_FREE_MARGIN:
            log.info("prompt cache: no checkpoint at %d tokens: the machine is short of memory", len(self.ids))
            return
        self._backs.append(_Saved(ids=self.ids, block_size=self.block_size, kv=[],
                                  gdn=_moved(self._gdn, _HOST, True), row=_moved_row(self._row, _HOST, True),
                                  nbytes=need))
        del self._backs[: -self.checkpoints]

    def _save(self, kept: ModelCache) -> None:
        """Copy the last prompt's entry (in ``kept``) to host memory with its checkpoints. Room within
        ``host_bytes`` is made by checkpoints before whole entries (going back to another chat is commoner than
        editing its older messages): first the saved entries' (the least recently used entry's first, each entry's
        oldest first), then this entry's own oldest, then the least recently used entries."""
        n = len(self.ids)
        if not n or self.host_bytes <= 0:
            return
        rows = [(i, k[:, :n], v[:, :n]) for i, k, v in _kv(kept)]
        own = _nbytes(rows) + _nbytes(self._gdn, self._row)
        if own > self.host_bytes:
            return
        backs = list(self._backs)
        over = self.saved_bytes + own + sum(b.nbytes for b in backs) - self.host_bytes
        cut = [0] * len(self.saved)  # per saved entry: how many of its oldest checkpoints go
        for at, entry in enumerate(self.saved):
            while over > 0 and cut[at] < len(entry.backs):
                over -= entry.backs[cut[at]].nbytes
                cut[at] += 1
        mine = 0  # this entry's oldest checkpoints that go
        while over > 0 and mine < len(backs):
            over -= backs[mine].nbytes
            mine += 1
        evict = 0  # the least recently used entries that go (their checkpoints are counted out already)
        while over > 0:
            entry = self.saved[evict]
            over -= entry.nbytes - sum(b.nbytes for b in entry.backs[: cut[evict]])
            evict += 1
        backs = backs[mine:]
        need = own + sum(b.nbytes for b in backs)
        freed = self.saved_bytes + need - self.host_bytes - over  # what the cuts and evictions give back
        import psutil

        if psutil.virtual_memory().available + max(freed, 0) - need < SAVED_FREE_MARGIN:
            log.info("prompt cache: not saving %d tokens (%.0f MB): the machine is short of memory", n, need / 1e6)
            return  # (and the saved ones stay as they are)
        for entry, k in zip(self.saved, cut):
            entry.nbytes -= sum(b.nbytes for b in entry.backs[:k])
            entry.backs = entry.backs[k:]
        del self.saved[:evict]
        self.saved.append(_Saved(ids=self.ids, block_size=self.block_size, kv=_moved(rows, _HOST, True),
                                 gdn=_moved(self._gdn, _HOST, True), row=_moved_row(self._row, _HOST, True),
                                 nbytes=need, backs=backs, scope=self.scope))

    def _restore(self, model: Any, entry: _Saved | None, point: _Saved | None,
                 max_len: int) -> tuple[Any, int, Tensor | None]:
        """A new cache for ``max_len`` positions, filled from ``entry`` up to ``point`` (the entry or one of its
        checkpoints), which becomes the last prompt's entry, and what :meth:`take` returns."""
        cache = model.new_cache(max_len)
        if entry is None or point is None:
            return cache, 0, None
        n, dev = len(point.ids), cache.tensors()[0].device
        _put_rows(cache, [(i, k[:, :n], v[:, :n]) for i, k, v in entry.kv])
        self._gdn, self._row = _moved(point.gdn, dev), _moved_row(point.row, dev)
        _put_states(cache, self._gdn, n)
        self.ids, self.block_size, self._cache, self.scope = point.ids, point.block_size, cache, entry.scope
        self._backs = [b for b in entry.backs if len(b.ids) < n]
        return cache, n, self._row


class ScopedPromptCache:
    """A :class:`PromptCache` as the requests of one scope see it: what the decoding loops take and keep."""

    def __init__(self, cache: PromptCache, scope: str) -> None:
        self.cache = cache
        self.scope = scope

    @property
    def checkpoints(self) -> int:
        return self.cache.checkpoints

    def take(self, model: Any, prompt: Sequence[int], limit: int, max_len: int,
             block_size: int | None) -> tuple[Any, int, Tensor | None]:
        return self.cache.take(model, prompt, limit, max_len, block_size, self.scope)

    def keep(self, prompt: Sequence[int], cache: Any, row: Tensor | None, block_size: int | None) -> None:
        self.cache.keep(prompt, cache, row, block_size, self.scope)


def _shared(prompt: tuple[int, ...], ids: tuple[int, ...]) -> int:
    """How many first tokens ``prompt`` and ``ids`` have in common: slice comparisons (C speed) over windows that
    double from 64 tokens, then a binary search in the window that differs; about twice the shared length in
    element comparisons, so an entry of another chat costs next to nothing."""
    n = min(len(prompt), len(ids))
    lo, step = 0, 64
    while True:  # the first lo agree
        hi = min(n, lo + step)
        if prompt[lo:hi] != ids[lo:hi]:
            break  # the first hi do not
        if hi == n:
            return n
        lo, step = hi, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if prompt[lo:mid] == ids[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _kv(cache: ModelCache) -> list[tuple[int, Tensor, Tensor]]:
    return [(i, k, v) for i, (k, v) in enumerate(zip(cache.key, cache.value)) if k is not None and v is not None]


_HOST = torch.device("cpu")


def _moved(pairs: list[tuple[int, Tensor, Tensor]], device: torch.device,
           copy: bool = False) -> list[tuple[int, Tensor, Tensor]]:
    """Per-layer tensor pairs (key and value rows, or conv and recurrent state) on ``device``; ``copy``: always
    copies (what goes to host memory must not be a view of the cache, which later writes change)."""
    return [(i, a.to(device, copy=copy), b.to(device, copy=copy)) for i, a, b in pairs]


def _moved_row(row: Tensor | None, device: torch.device, copy: bool = False) -> Tensor | None:
    return None if row is None else row.to(device, copy=copy)


def _put_states(cache: ModelCache, gdn: list[tuple[int, Tensor, Tensor]], length: int) -> None:
    """Write each GDN layer's (conv, recurrent) state into ``cache``, which then holds ``length`` positions."""
    for i, conv, state in gdn:
        cache.conv[i].copy_(conv)  # type: ignore[union-attr]
        cache.state[i].copy_(state)  # type: ignore[union-attr]
    cache.length = length


def _put_rows(cache: ModelCache, rows: list[tuple[int, Tensor, Tensor]]) -> None:
    """Write each layer's first key and value rows into ``cache``."""
    for i, k, v in rows:
        cache.key[i][:, : k.shape[1]].copy_(k)  # type: ignore[index]
        cache.value[i][:, : v.shape[1]].copy_(v)  # type: ignore[index]
