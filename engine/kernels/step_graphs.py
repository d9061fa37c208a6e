"""AR steps and whole-block passes replayed as CUDA graphs: a few launches per pass instead of thousands.

A decode step at batch one is launch-bound on a GPU: 40 layers of small kernels (norms, projections, the routed
experts, the recurrent GDN update) take longer to launch from Python than to run, and a 32-slot denoising pass
is too (counted at the 35B shape: ~4,300 ops per AR step, ~7,800 per pass; at ~10 us a launch, 43 and 78 ms of
host time against a roofline of a few ms to ~20 ms of GPU work). A CUDA graph records the kernels of a pass once
and replays them with a single call. What it needs from the pass:

- no host read inside it: the AR step and the block passes read none outside the routed experts (the compiled
  fast path proves it: ``engine.kernels.fastpath``); the routed experts that do are cut out (below);
- fixed addresses and shapes: :meth:`engine.model.clover.CloverModel.static_pass` takes the first position as a tensor
  (written here into a static buffer before each replay, as is the embedded input) and reads the keys up to a
  fixed length, a *bucket* (256, 512, 1024, ... up to the cache size), masking those past the pass. One graph set
  per pass kind (AR step, denoising pass, commit pass) and bucket, recorded when a pass first needs it; a step at
  position 700 replays the 1024-key graphs. A denoising pass writes its block's K/V into the cache's free slots and
  puts back what was there, as the uncaptured pass does;
- the same cache tensors: the graphs belong to one :class:`engine.model.clover.ModelCache`. The model keeps one cache
  while it replays graphs and empties it for the next request (``CloverModel.new_cache``), so a request replays
  the graphs of the one before; a request that needs a longer cache gets a new one, and the graphs are recorded
  again (a few eager passes and the captures per pass kind and key bucket).

Recording runs the pass twice on a side stream first (so the kernels are loaded and, compiled, their graphs
selected). Those runs write the pass's K/V, which the replay rewrites with the same values, and (AR step, commit
pass) advance the GDN recurrent and convolution states, which are put back from a copy before the replay.

What reads the host runs eagerly between recorded pieces (:func:`cuts`, :func:`pieces_of`): a streamed bank's
fetch (it decides on the host which experts to copy, then writes a fixed slot table that its recorded compute
reads), and routed experts that size their groups on the host: a quantized bank over a block's 256 pairs unless
the fused kernel (``engine.kernels.triton_moe``) is on, resident or streamed. Everything else is recorded: on a 16 GB card
with 22 of 40 layers' experts streamed, an AR step is 23 graphs around 22 eager fetches; a block pass is too with
the fused kernel, and 41 graphs around 40 eager banks without it. If recording fails, the reason is logged once
and the passes run uncaptured.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from clover_desk.engine.placement.offload_runtime import uncounted_passes

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


Stage = tuple[str, int]  # (part, layer index; the head's is the layer count): see pieces_of
EAGER_STAGES = ("bank", "fetch")  # the stages that read the host


def streamed_layers(model: Any, pairs: int | None = None) -> list[int]:
    """The layers whose experts are streamed from host memory; with ``pairs``, only those whose bank fetches its
    experts on the host for a pass of that many (token, expert) pairs (a zero-copy bank reads an AR step's in place:
    ``engine.placement.streamed_bank.StreamedExpertBank.fetches``)."""
    return [i for i, moe in enumerate(model.moe_layers())
            if getattr(moe.experts, "needs_prepare", False) and (pairs is None or moe.experts.fetches(pairs))]


def cuts(model: Any, t: int) -> dict[int, str]:
    """Where a pass of ``t`` tokens must leave its graphs: layer -> ``"bank"`` when its routed experts read the
    host (:meth:`engine.model.experts.ExpertBank.sync_free`: a quantized bank sizing its dequantizing groups on the
    host), ``"fetch"`` for a streamed bank whose compute reads nothing (only the fetch runs eagerly: it decides on
    the host which experts to copy; :meth:`engine.placement.streamed_bank.StreamedExpertBank.compute_sync_free`), and ``"bank"``
    for a streamed bank whose compute reads the host too. Layers not named are recorded whole, a streamed bank that
    reads this pass's experts in place (zero-copy) included."""
    pairs = t * model.config.num_experts_per_tok
    device, dtype = model.device, model.dtype
    out: dict[int, str] = {}
    for i, moe in enumerate(model.moe_layers()):
        bank = moe.experts
        if getattr(bank, "needs_prepare", False):  # streamed; a pass of t > 1 here is a block's (StepGraphs.serves)
            if bank.fetches(pairs, in_block=t > 1):
                out[i] = "fetch" if bank.compute_sync_free(pairs, device, dtype) else "bank"
            elif not bank.compute_sync_free(pairs, device, dtype):
                out[i] = "bank"
        elif not bank.sync_free(pairs, device, dtype):
            out[i] = "bank"
    return out


def capturable(model: Any) -> str | None:
    """Why ``model``'s passes cannot be recorded as CUDA graphs, or None."""
    if model.device.type != "cuda":
        return f"CUDA graphs need the layers on a CUDA device, not {model.device.type}"
    return None


def pieces_of(n_layers: int, cut: Mapping[int, str]) -> list[tuple[str, tuple[Stage, ...]]]:
    """How a pass is cut (``cut`` from :func:`cuts`). Its stages: ``("layer", i)`` for a layer run whole; for a
    layer in ``cut``, ``("front", i)`` (mixer, MoE norm, routing), then ``("bank", i)`` (the routed experts, eager)
    or ``("fetch", i)`` (a streamed bank's fetch, eager) and ``("compute", i)`` (its experts from the slot table),
    then ``("back", i)`` (shared expert, residual); last ``("head", n_layers)`` (final norm, LM head). Each eager
    stage is an ``"eager"`` piece, the stages between them form ``"graph"`` pieces (recorded), the last one ending
    with the head. The first piece also refreshes the pass's positions, rotary angles and key mask."""
    stages: list[Stage] = []
    for i in range(n_layers):
        kind = cut.get(i)
        if kind is None:
            stages.append(("layer", i))
        elif kind == "bank":
            stages += [("front", i), ("bank", i), ("back", i)]
        elif kind == "fetch":
            stages += [("front", i), ("fetch", i), ("compute", i), ("back", i)]
        else:
            raise ValueError(f"cut {kind!r} for layer {i}: allowed 'bank', 'fetch'")
    stages.append(("head", n_layers))
    pieces: list[tuple[str, tuple[Stage, ...]]] = []
    run: list[Stage] = []
    for stage in stages:
        if stage[0] in EAGER_STAGES:
            if run:
                pieces.append(("graph", tuple(run)))
                run = []
            pieces.append(("eager", (stage,)))
        else:
            run.append(stage)
    pieces.append(("graph", tuple(run)))
    return pieces


class _Piece:
    """One part of a pass: ``fn`` reads and writes only static buffers, so that replaying its recorded ``graph``
    (None: not recorded, or an eager piece) is the same as calling it."""

    def __init__(self, kind: str, fn: Any) -> None:
        self.kind, self.fn, self.graph = kind, fn, None

    def run(self, eager: bool = False) -> None:
        if self.graph is not None and not eager:
            self.graph.replay()
        else:
            self.fn()


class _Step:
    """The pieces of one pass, and the streamed banks whose slots go back to the pool once the piece that computes
    from them has been issued (the next eager piece, or the end of the pass, releases them)."""

    def __init__(self, pieces: list[_Piece], out: Tensor, pending: list[Any]) -> None:
        self.pieces, self.out, self.pending = pieces, out, pending

    def run(self, eager: bool = False) -> None:
        """Replay (``eager``: call every piece, as the warm-up before recording does)."""
        for piece in self.pieces:
            if piece.kind == "eager":
                self.finish()
            piece.run(eager)
        self.finish()

    def finish(self) -> None:
        for bank in self.pending:
            bank.finish()
        self.pending.clear()


class _Buffers:
    """What crosses a cut between pieces: h [T, D] the residual stream, and at a layer's eager bank its MoE input
    x [T, D], routing w [T, k] fp32 / idx [T, k] long, and the bank's output r [T, D]."""

    def __init__(self, t: int, model: Any) -> None:
        d, k, device = model.config.hidden_size, model.config.num_experts_per_tok, model.device
        self.h = torch.zeros(t, d, dtype=model.dtype, device=device)
        self.x = torch.zeros_like(self.h)
        self.r = torch.zeros_like(self.h)
        self.w = torch.zeros(t, k, dtype=torch.float32, device=device)
        self.idx = torch.zeros(t, k, dtype=torch.long, device=device)
        self._vocab = model.config.vocab_size
        self._out: dict[bool, Tensor] = {}

    def out(self, last_only: bool) -> Tensor:
        """The fp32 logits the head piece writes: [1, V] or [T, V]. One per shape, shared by the passes of every key
        length (one pass runs at a time, and the caller gets a clone): a 32-slot pass's is 32 MB at Clover's
        vocabulary, which one per key bucket would hold again for each (7 buckets at a 16K context)."""
        if last_only not in self._out:
            rows = 1 if last_only else self.h.shape[0]
            self._out[last_only] = torch.empty(rows, self._vocab, dtype=torch.float32, device=self.h.device)
        return self._out[last_only]


# the key of one recorded pass: (tokens, block size or None, writes the cache, last row only, key length)
Key = tuple[int, int | None, bool, bool, int]


class StepGraphs:
    """Replays ``model``'s AR steps and whole-block passes from CUDA graphs. Called as ``model._forward_pass`` is,
    for the passes it :meth:`serves` (``model.step_graph`` and ``model.pass_graph``); anything else raises.

    An AR step is 1 token written to the cache; a block pass is one whole block after the cache (the denoising
    pass, which leaves the cache as it was, and the commit pass, which writes it). A pass is cut into pieces
    (:func:`pieces_of`) around what reads the host (:func:`cuts`: a streamed bank's fetch, and routed experts that
    size their groups on the host). The rest, the mixers, routers and shared experts of every layer included, is
    recorded, one graph per piece, all reading and writing the same static buffers (:class:`_Buffers`, a streamed
    bank's slot table). ``record=False`` runs every piece eagerly through those buffers (the CPU tests of the
    cutting and the data flow); ``cut`` then overrides :func:`cuts`."""

    def __init__(self, model: Any, record: bool = True, cut: Mapping[int, str] | None = None) -> None:
        reason = capturable(model) if record else None
        if reason is not None:
            raise ValueError(reason)
        self.model = model
        self.record = record
        self._cut = cut
        self._pieces: dict[int, list[tuple[str, tuple[Stage, ...]]]] = {}
        self._pos = torch.zeros(1, dtype=torch.long, device=model.device)  # [1] the pass's first position
        self._bufs: dict[int, _Buffers] = {}
        self._cache_ref: weakref.ReferenceType[Any] | None = None
        self._steps: dict[Key, _Step] = {}
        self._pool: Any = None
        self.failed: str | None = None  # why recording failed (then every pass runs uncaptured)
        self.recorded = 0  # graphs recorded so far (all caches, shapes and buckets)
        self.replays = 0  # AR steps run through the pieces
        self.pass_replays = 0  # block passes run through the pieces
        self.keeps_cache = True  # the model hands every request the same cache (CloverModel.new_cache)

    def forget(self) -> None:
        """Drop the passes recorded for the current cache (their graphs, and with them the cache's memory), and how
        passes are cut (a placement change, such as zero-copy reads, changes what reads the host)."""
        self._steps.clear()
        self._pieces.clear()
        self._cache_ref = None

    def pieces_for(self, t: int) -> list[tuple[str, tuple[Stage, ...]]]:
        """The pieces of a pass of ``t`` tokens."""
        if t not in self._pieces:
            cut = self._cut if self._cut is not None else cuts(self.model, t)
            self._pieces[t] = pieces_of(len(self.model.layers), cut)
        return self._pieces[t]

    @property
    def pieces(self) -> list[tuple[str, tuple[Stage, ...]]]:
        """The pieces of an AR step."""
        return self.pieces_for(1)

    @staticmethod
    def serves(t: int, block_size: int | None, write_cache: bool, prefill: bool = False,
               causal_inside_block: bool = False) -> bool:
        """An AR step (1 token, causal, written to the cache), or one whole block that is not the prompt's."""
        if block_size is None:
            return t == 1 and write_cache
        return t == block_size and not prefill and not causal_inside_block

    def __call__(
        self, ids: Tensor, start_pos: int, cache: Any, block_size: int | None, write_cache: bool, last_only: bool,
        prefill: bool, causal_inside_block: bool,
    ) -> Tensor:
        t = ids.shape[0]
        if cache is None or not self.serves(t, block_size, write_cache, prefill, causal_inside_block):
            raise ValueError("StepGraphs runs AR steps (one token, causal, written to a cache) and whole blocks "
                             "after a cache")
        if self.failed is None:
            if self._cache_ref is None or self._cache_ref() is not cache:
                self._steps.clear()  # passes of an earlier cache (their graphs' memory goes back to the pool)
                self._cache_ref = weakref.ref(cache)
            key: Key = (t, block_size, write_cache, last_only or t == 1, bucket(start_pos + t, cache.max_len))
            self._buffers(t).h.copy_(self.model.embed(ids))
            self._pos.fill_(start_pos)
            step = self._steps.get(key) or self._make(cache, key)
            if step is not None:  # (None: recording failed, said once; this pass and the later ones run uncaptured)
                self._steps[key] = step
                step.run()
                if block_size is None:
                    self.replays += 1
                else:
                    self.pass_replays += 1
                if write_cache:
                    cache.length = start_pos + t
                return step.out.clone()  # the last piece's buffer is overwritten by the next pass
        return self.model._forward_pass(ids, start_pos, cache, block_size, write_cache, last_only, prefill,
                                        causal_inside_block)

    def pieces_of_pass(
        self, ids: Tensor, start_pos: int, cache: Any, block_size: int | None, write_cache: bool, last_only: bool
    ) -> _Step:
        """The pieces of one pass with its input and position in their buffers, never recorded: run them one by one
        (``bench speed --count`` counts what each leaves outside the graphs), then :meth:`_Step.finish`. The cache
        length is left to the caller."""
        t = ids.shape[0]
        self._buffers(t).h.copy_(self.model.embed(ids))
        self._pos.fill_(start_pos)
        return self._build(cache, (t, block_size, write_cache, last_only or t == 1, bucket(start_pos + t, cache.max_len)))

    def _buffers(self, t: int) -> _Buffers:
        if t not in self._bufs:
            self._bufs[t] = _Buffers(t, self.model)
        return self._bufs[t]

    def _build(self, cache: Any, key: Key) -> _Step:
        """The pieces of a pass for this cache and key, over static buffers: the pass's angles and mask (refreshed
        by the first piece from the position), and :class:`_Buffers` between pieces."""
        model = self.model
        t, block_size, write_cache, last_only, kv_len = key
        p = model.static_pass(self._pos, cache, kv_len, t, block_size, write_cache)  # its tensors: static buffers
        b = self._buffers(t)
        out = b.out(last_only)

        def refresh() -> None:
            fresh = model.static_pass(self._pos, cache, kv_len, t, block_size, write_cache)
            p.pos.copy_(fresh.pos)  # [T] the positions the K/V are written at
            p.cos.copy_(fresh.cos)
            p.sin.copy_(fresh.sin)
            p.attn_mask.copy_(fresh.attn_mask)

        def run_graph(stages: tuple[Stage, ...], first: bool) -> None:
            if first:
                refresh()
            h, x, w, idx, r = b.h, b.x, b.w, b.idx, b.r
            for part, i in stages:
                if part == "layer":
                    h = model.layers[i](h, p, cache.layer(i))
                elif part == "front":
                    h, x, w, idx = model.layers[i].front(h, p, cache.layer(i))
                elif part == "compute":  # a streamed bank's experts, from the slot table its fetch wrote
                    r = model.layers[i].mlp.experts.compute(x, idx, w)
                elif part == "back":
                    h = model.layers[i].back(h, x, r)
                else:  # head
                    out.copy_(model.head(h[-1:] if last_only else h))
            end = stages[-1][0]
            if end == "front":
                for buf, value in ((b.h, h), (b.x, x), (b.w, w), (b.idx, idx)):
                    buf.copy_(value)
            elif end != "head":
                b.h.copy_(h)

        pending: list[Any] = []  # streamed banks fetched, to release once their compute is issued (_Step)

        def run_eager(part: str, i: int) -> None:
            moe = model.layers[i].mlp
            if part == "bank":
                b.r.copy_(moe.routed(b.x, b.w, b.idx))
            else:  # fetch: the one host read of a streamed layer, its copies, its slot table
                moe.last_topk_idx, moe.last_topk_w = b.idx, b.w
                moe.experts.prepare_for(b.x, b.idx)
                moe.experts.ready()
                pending.append(moe.experts)

        pieces: list[_Piece] = []
        for k, (kind, stages) in enumerate(self.pieces_for(t)):
            if kind == "eager":
                pieces.append(_Piece(kind, lambda stage=stages[0]: run_eager(*stage)))
            else:
                pieces.append(_Piece(kind, lambda stages=stages, first=k == 0: run_graph(stages, first)))
        return _Step(pieces, out, pending)

    def _make(self, cache: Any, key: Key) -> _Step | None:
        step = self._build(cache, key)
        if not self.record:
            return step

        states = [t for group in (cache.conv, cache.state) for t in group if t is not None]
        saved = [t.clone() for t in states]
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), uncounted_passes(self.model):
                for _ in range(2):
                    step.run(eager=True)
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
        except Exception as exc:  # noqa: BLE001 - a capture error (CUDA's, a kernel's): the passes run uncaptured
            for t, copy in zip(states, saved):
                t.copy_(copy)
            what = "the AR step" if key[1] is None else "a block pass"
            self.failed = f"recording {what} as CUDA graphs failed ({exc}); passes run uncaptured"
            log.warning("%s", self.failed)
            return None
        log.info("recorded a %d-token pass as %d CUDA graph(s) for %d keys",
                 key[0], sum(kind == "graph" for kind, _ in self.pieces_for(key[0])), key[4])
        return step
