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
recurrent and convolution states, which are put back from a copy before the replay. Streamed expert banks fetch
experts on the host (a sync), so a model with any streamed layer is not captured (a piecewise capture around the
streamed layers is not done). If recording fails, the reason is logged once and the steps run uncaptured.
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
    """Why ``model``'s AR step cannot be recorded as a CUDA graph, or None."""
    if model.device.type != "cuda":
        return f"CUDA graphs need the layers on a CUDA device, not {model.device.type}"
    streamed = streamed_layers(model)
    if streamed:
        return f"layers {streamed[0]}..{streamed[-1]} stream their experts from host memory (a host sync per step)"
    return None


class _Entry:
    def __init__(self, graph: Any, out: Tensor) -> None:
        self.graph, self.out = graph, out


class StepGraphs:
    """Replays ``model``'s AR steps from CUDA graphs. Called as ``model._forward_pass`` is, for the passes
    :meth:`CloverModel.is_hot_pass` selects (``model.step_graph``); anything else raises."""

    def __init__(self, model: Any) -> None:
        reason = capturable(model)
        if reason is not None:
            raise ValueError(reason)
        self.model = model
        device = model.device
        self._h = torch.zeros(1, model.config.hidden_size, dtype=model.dtype, device=device)  # [1, D]
        self._pos = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self._cache_ref: weakref.ReferenceType[Any] | None = None
        self._graphs: dict[int, _Entry] = {}
        self._pool: Any = None
        self.failed: str | None = None  # why recording failed (then every step runs uncaptured)
        self.recorded = 0  # graphs recorded so far (all caches)
        self.replays = 0

    def __call__(
        self, ids: Tensor, start_pos: int, cache: Any, block_size: int | None, write_cache: bool, last_only: bool,
        prefill: bool, causal_inside_block: bool,
    ) -> Tensor:
        if ids.shape[0] != 1 or block_size is not None or not write_cache or cache is None:
            raise ValueError("StepGraphs runs AR steps only (one token, causal, written to a cache)")
        if self.failed is None:
            if self._cache_ref is None or self._cache_ref() is not cache:
                self._graphs.clear()  # graphs of an earlier cache (their memory goes back to the pool)
                self._cache_ref = weakref.ref(cache)
            kv_len = bucket(start_pos + 1, cache.max_len)
            self._h.copy_(self.model.embed(ids))
            self._pos.fill_(start_pos)
            entry = self._graphs.get(kv_len) or self._record(cache, kv_len)
            if entry is not None:  # (None: recording failed, said once; this step and the later ones run uncaptured)
                self._graphs[kv_len] = entry
                entry.graph.replay()
                self.replays += 1
                cache.length = start_pos + 1
                return entry.out.clone()  # the graph's output buffer is overwritten by the next replay
        return self.model._forward_pass(ids, start_pos, cache, None, True, last_only, prefill, causal_inside_block)

    def _record(self, cache: Any, kv_len: int) -> _Entry | None:
        model = self.model
        states = [t for group in (cache.conv, cache.state) for t in group if t is not None]
        saved = [t.clone() for t in states]
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    model.static_step(self._h, self._pos, cache, kv_len)
            torch.cuda.current_stream().wait_stream(side)
            for t, copy in zip(states, saved):
                t.copy_(copy)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = model.static_step(self._h, self._pos, cache, kv_len)
            self._pool = graph.pool()
        except RuntimeError as exc:
            for t, copy in zip(states, saved):
                t.copy_(copy)
            self.failed = f"recording the AR step as a CUDA graph failed ({exc}); steps run uncaptured"
            log.warning("%s", self.failed)
            return None
        self.recorded += 1
        log.info("recorded the AR step as a CUDA graph for %d keys", kv_len)
        return _Entry(graph, out)
