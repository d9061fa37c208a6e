"""The AR step replayed as a CUDA graph: one launch for the whole step instead of ~1,500 kernel launches.

A decode step at batch one is launch-bound on a GPU: 40 layers of small kernels (norms, projections, the routed
experts, the recurrent GDN update) take longer to launch from Python than to run. A CUDA graph records the
kernels of one step once and replays them with a single call. What it needs from the step:

- no host read inside it (the compiled fast path already guarantees that: ``engine.fastpath``);
- fixed addresses and shapes: :meth:`engine.model.CloverModel.static_step` takes the embedded token and its
  position as tensors (written here into static buffers before each replay) and reads the keys up to a fixed
  length, a *bucket* (256, 512, 1024, ... up to the cache size), masking those past the position. One graph per
  bucket, recorded when a step first needs it; a step at position 700 replays the 1024-key graph.
- the same cache tensors: the graphs belong to one :class:`engine.model.ModelCache`; a new cache (the next
  request) records them again (tens of milliseconds each).

Recording runs the step twice on a side stream first (so the kernels are loaded and, compiled, their graphs
selected). Those runs write the step's K/V, which the replay rewrites with the same values, and advance the GDN
recurrent and convolution states, which are put back from a copy before the replay. A streamed expert bank decides
on the host which experts to fetch (a sync), so with streamed layers the step is recorded in pieces
(:func:`pieces_of`): each run of resident layers is one graph, each streamed layer runs eagerly between two
replays, all of them reading and writing the same static buffers (on a 16 GB card with 18 of 40 layers resident,
18 graphs replace those layers' ~1,900 launches). If recording fails, the reason is logged once and the steps run
uncaptured.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

FIRST_BUCKET = 256  # the shortest key length a step graph reads


def bucket(length: int, max_len: int) -> int:
    """The key length of the graph serving a step that needs ``length`` keys: the next power of two from
    :data:`FIRST_BUCKET`, never past ``max_len`` (the cache size)."""
    if not 0 < length <= max_len:
        raise ValueError(f"a step needs 1..{max_len} keys, got {length}")
    size = FIRST_BUCKET
    while size < length:
        size *= 2
    return min(size, max_len)


def streamed_layers(model: Any) -> list[int]:
    """The layers whose experts are streamed from host memory (their bank fetches experts on the host per pass)."""
    return [i for i, moe in enumerate(model.moe_layers()) if getattr(moe.experts, "needs_prepare", False)]


def capturable(model: Any) -> str | None:
    """Why ``model``'s AR step cannot be recorded as CUDA graphs, or None."""
    if model.device.type != "cuda":
        return f"CUDA graphs need the layers on a CUDA device, not {model.device.type}"
    return None


def pieces_of(n_layers: int, streamed: set[int]) -> list[tuple[str, int, int]]:
    """How a step is cut: ``("graph", lo, hi)`` for each run of layers without streamed experts (recorded),
    ``("eager", i, i + 1)`` for each streamed layer (its bank decides on the host which experts to fetch), and a
    ``("graph", n, n)`` head piece when the last layer is streamed. The first piece also refreshes the pass's
    rotary angles and key mask from the position, the last one ends with the final norm and the LM head."""
    pieces: list[tuple[str, int, int]] = []
    lo = 0
    for i in range(n_layers):
        if i in streamed:
            if lo < i:
                pieces.append(("graph", lo, i))
            pieces.append(("eager", i, i + 1))
            lo = i + 1
    if lo < n_layers or not pieces or pieces[-1][0] == "eager":
        pieces.append(("graph", lo, n_layers))
    return pieces


class _Piece:
    """One part of a step: ``fn`` reads and writes only static buffers, so that replaying its recorded ``graph``
    (None: not recorded, or an eager piece) is the same as calling it."""

    def __init__(self, kind: str, fn: Any) -> None:
        self.kind, self.fn, self.graph = kind, fn, None

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()


class _Step:
    def __init__(self, pieces: list[_Piece], out: Tensor) -> None:
        self.pieces, self.out = pieces, out

    def run(self) -> None:
        for piece in self.pieces:
            piece.run()


class StepGraphs:
    """Replays ``model``'s AR steps from CUDA graphs. Called as ``model._forward_pass`` is, for the passes
    :meth:`CloverModel.is_hot_pass` selects (``model.step_graph``); anything else raises.

    With streamed layers the step is cut into pieces (:func:`pieces_of`): each run of resident layers is one graph,
    each streamed layer runs eagerly between them, reading and writing the same static buffers. ``record=False``
    runs every piece eagerly through those buffers (the CPU tests of the cutting and the data flow)."""

    def __init__(self, model: Any, record: bool = True) -> None:
        reason = capturable(model) if record else None
        if reason is not None:
            raise ValueError(reason)
        self.model = model
        self.record = record
        device = model.device
        self.pieces = pieces_of(len(model.layers), set(streamed_layers(model)))
        self._h = torch.zeros(1, model.config.hidden_size, dtype=model.dtype, device=device)  # [1, D]
        self._pos = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self._cache_ref: weakref.ReferenceType[Any] | None = None
        self._steps: dict[int, _Step] = {}
        self._pool: Any = None
        self.failed: str | None = None  # why recording failed (then every step runs uncaptured)
        self.recorded = 0  # graphs recorded so far (all caches and buckets)
        self.replays = 0  # steps run through the pieces

    def __call__(
        self, ids: Tensor, start_pos: int, cache: Any, block_size: int | None, write_cache: bool, last_only: bool,
        prefill: bool, causal_inside_block: bool,
    ) -> Tensor:
        if ids.shape[0] != 1 or block_size is not None or not write_cache or cache is None:
            raise ValueError("StepGraphs runs AR steps only (one token, causal, written to a cache)")
        if self.failed is None:
            if self._cache_ref is None or self._cache_ref() is not cache:
                self._steps.clear()  # steps of an earlier cache (their graphs' memory goes back to the pool)
                self._cache_ref = weakref.ref(cache)
            kv_len = bucket(start_pos + 1, cache.max_len)
            self._h.copy_(self.model.embed(ids))
            self._pos.fill_(start_pos)
            step = self._steps.get(kv_len) or self._make(cache, kv_len)
            if step is not None:  # (None: recording failed, said once; this step and the later ones run uncaptured)
                self._steps[kv_len] = step
                step.run()
                self.replays += 1
                cache.length = start_pos + 1
                return step.out.clone()  # the last piece's buffer is overwritten by the next step
        return self.model._forward_pass(ids, start_pos, cache, None, True, last_only, prefill, causal_inside_block)

    def _build(self, cache: Any, kv_len: int) -> _Step:
        """The pieces of a step for this cache and key length, over static buffers: the pass's angles and mask
        (refreshed by the first piece from the position), and one [1, D] buffer between consecutive pieces."""
        model = self.model
        p = model.static_pass(self._pos, cache, kv_len)  # its tensors are the static buffers

        def refresh() -> None:
            fresh = model.static_pass(self._pos, cache, kv_len)
            p.cos.copy_(fresh.cos)
            p.sin.copy_(fresh.sin)
            p.attn_mask.copy_(fresh.attn_mask)

        pieces: list[_Piece] = []
        src = self._h
        for k, (kind, lo, hi) in enumerate(self.pieces):
            first, last = k == 0, k == len(self.pieces) - 1
            if last:
                dst = torch.empty(1, model.config.vocab_size, dtype=torch.float32, device=src.device)  # logits
            else:
                dst = torch.empty_like(src)

            def fn(src: Tensor = src, dst: Tensor = dst, lo: int = lo, hi: int = hi, first: bool = first,
                   last: bool = last) -> None:
                if first:
                    refresh()
                h = model.static_layers(src, p, cache, lo, hi)
                dst.copy_(model.head(h) if last else h)

            pieces.append(_Piece(kind, fn))
            src = dst
        return _Step(pieces, src)

    def _make(self, cache: Any, kv_len: int) -> _Step | None:
        step = self._build(cache, kv_len)
        if not self.record:
            return step
        states = [t for group in (cache.conv, cache.state) for t in group if t is not None]
        saved = [t.clone() for t in states]
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    for piece in step.pieces:
                        piece.fn()
            torch.cuda.current_stream().wait_stream(side)
            for t, copy in zip(states, saved):
                t.copy_(copy)
            for piece in step.pieces:
                if piece.kind == "graph":
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self._pool):
                        piece.fn()
                    self._pool = graph.pool()
                    piece.graph = graph
                    self.recorded += 1
        except RuntimeError as exc:
            for t, copy in zip(states, saved):
                t.copy_(copy)
            self.failed = f"recording the AR step as CUDA graphs failed ({exc}); steps run uncaptured"
            log.warning("%s", self.failed)
            return None
        log.info("recorded the AR step as %d CUDA graph(s) for %d keys",
                 sum(k == "graph" for k, _, _ in self.pieces), kv_len)
        return step
