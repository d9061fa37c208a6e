"""The slot pool's bookkeeping as device tensors: AR steps and diffusion passes that fetch their streamed experts
with no host read.

An AR step over streamed layers goes through the slot pool (``engine.placement.slot_pool.SlotPool``), whose bookkeeping is
host Python: each streamed layer reads its router's choice back to the host (a sync), looks the experts up, copies
the missing ones, and guesses the next streamed layer's experts to prefetch. On a GPU the step is then cut around
every streamed layer (``engine.kernels.step_graphs``: at 16 GiB, 17 eager fetches between 18 CUDA graphs), and each cut
drains the GPU while Python runs. Zero-copy reads (``engine.placement.expert_store.in_place_view``) remove the cuts but give up
the pool's hits and its prefetch overlap.

Here the same bookkeeping runs on the device, two kernels per streamed layer that a CUDA graph records:

- ``slot_of`` [L*E + 1]: the slot of (layer position, expert), -1 when absent; ``key_of`` [S + 1] the reverse;
  ``stamp`` [S + 1] the LRU order (unique: ``tick * STAMP_STRIDE + rank``; a free slot's is negative, lowest slot
  first; ``fresh`` [S + 1] marks prefetched slots not yet used). The last entry of each is a scratch cell that the
  masked writes aim at.
- A layer's fetch: look its k experts up, choose victims for the misses (the smallest stamps, the hits' slots
  excluded; no host read), write the tables, and copy the missing rows from the host rows mapped into the
  device's address space (the same mapping as zero-copy). On CUDA that is two Triton programs
  (``engine.kernels.triton_copy``: the placing, and a copy that reads only the rows that miss); on the CPU the same as
  ~45 tensor ops (the reference the kernels are tested against).
- The prefetch: the next streamed layer's router on this layer's input, its top-k placed the same way (never into
  this layer's slots, the k most recent), on a side CUDA stream so the copies overlap this layer's compute and the
  layers between; the next streamed layer's fetch waits for it.
- A diffusion block's passes (``fetch_set`` / ``prefetch_set``): a layer's whole set of experts as a presence mask
  [E], pinned for the block (``pinned`` [S + 1]: a pinned slot is a victim only after every unpinned one, and
  never a prefetch's), the block's experts in ``seen`` for its distinct count; a prefetch only on the block's first
  pass (the device flag ``gate``). On CUDA one Triton program (``engine.kernels.triton_copy.place_set``) and the copy; on
  the CPU ~70 tensor ops.

The bookkeeping is the host pool's, decision for decision: experts taken in ascending order, free slots lowest
first, then least recently used; hits refresh their place; a prefetched slot counts a hit when first used and a
waste when evicted unused. ``tests/engine/test_device_pool.py`` runs the same sequence through both and compares every
slot and counter. A miss that was not prefetched is read serially, as in the host pool (there, after a sync).

Ownership: host and device tables are never both live. The device's are written from the host pool (``push``,
no host read, the open block's pins included) before the first AR step or block pass that uses them; a forward
that goes through the host pool (a prompt) first reads them back (``pull``: one host read). Opt-in
(``engine.settings.GpuPaths.expert_fetch`` "device_tables", or ``engine.placement.placer.set_device_pool``) until a GPU run measures it against the host
pool.

Letters: E experts, L streamed layers, S slots, R row bytes, k experts per token.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from clover_desk.engine.kernels.triton_copy import BIG, STAMP_STRIDE, copy_rows, place, place_set
from clover_desk.engine.kernels.triton_linear import available

# the device counters, in order; merged into engine.placement.slot_pool.Stats (same names) by merge_counts
COUNTS = ("slot_hits", "slot_misses", "prefetched", "prefetch_hits", "prefetch_wasted", "evictions", "passes",
          "block_pin_evictions")
# the block pass's one-program placing (engine.kernels.triton_copy.place_set) holds and sorts the slots in registers, and
# packs a stamp with a slot in 58 bits: up to this many slots (stamps below 2^46: 2^36 fetches between prompts,
# whose push renumbers them); a larger pool places its block fetches with the tensor ops
SET_KERNEL_MAX_SLOTS = 4096
PIN_OFFSET = 1 << 52  # added to a pinned slot's stamp by a block fetch: it is a victim only after every unpinned one


class DeviceSlotTables:
    """The slot pool's tables on its device, for AR steps of ``top_k`` experts per streamed layer.

    ``pool`` is the host :class:`engine.placement.slot_pool.SlotPool` (its ``buf`` holds the rows; its Python state is the
    other owner, see the module), ``layers`` the streamed layers in order, ``sources`` {layer: [E, R] uint8} the
    host rows as the device reads them (``engine.placement.expert_store.in_place_view``)."""

    def __init__(self, pool: Any, layers: tuple[int, ...], sources: dict[int, Tensor], num_experts: int,
                 top_k: int) -> None:
        self.pool = pool
        self.layers = tuple(layers)
        self.pos = {layer: i for i, layer in enumerate(self.layers)}
        self.sources = [sources[layer] for layer in self.layers]
        self.E, self.S, self.L, self.k = num_experts, pool.num_slots, len(self.layers), top_k
        if not 0 < top_k < STAMP_STRIDE:
            raise ValueError(f"top_k must be in 1..{STAMP_STRIDE - 1}, got {top_k}")
        dev = pool.buf.device
        self.device = dev
        with torch.inference_mode(False):  # plain tensors, written in place by every step
            self.slot_of = torch.full((self.L * self.E + 1,), -1, dtype=torch.long, device=dev)
            self.key_of = torch.full((self.S + 1,), -1, dtype=torch.long, device=dev)
            self.stamp = torch.full((self.S + 1,), BIG, dtype=torch.long, device=dev)
            self.fresh = torch.zeros(self.S + 1, dtype=torch.bool, device=dev)
            self.tick = torch.zeros((), dtype=torch.long, device=dev)
            self.counts = torch.zeros(len(COUNTS), dtype=torch.long, device=dev)
            self._ranks = torch.arange(top_k, dtype=torch.long, device=dev)
            self._guess = torch.zeros(top_k, dtype=torch.long, device=dev)  # the prefetch stream's input (below)
            # where a fetch's (True) and a prefetch's (False) flag sums go in the counters (COUNTS, see _place)
            self._at = {True: torch.tensor([0, 1, 3, 4, 5], device=dev), False: torch.tensor([2, 4, 5], device=dev)}
            # diffusion blocks (fetch_set / prefetch_set): the slots pinned by the open block, the experts it
            # touched [L*E + 1], the distinct experts of the closed blocks summed per layer [L], and whether this
            # pass prefetches (a block's first pass only: set by the runtime before the pass, read inside it)
            self.pinned = torch.zeros(self.S + 1, dtype=torch.bool, device=dev)
            self.seen = torch.zeros(self.L * self.E + 1, dtype=torch.bool, device=dev)
            self.distinct = torch.zeros(self.L, dtype=torch.long, device=dev)
            self.gate = torch.ones((), dtype=torch.bool, device=dev)
            self._experts = torch.arange(num_experts, dtype=torch.long, device=dev)
            self._guess_set = torch.zeros(num_experts, dtype=torch.bool, device=dev)  # (as _guess, for blocks)
            self._at_set = {True: torch.tensor([0, 1, 3, 4, 5, 7], device=dev),
                            False: torch.tensor([2, 4, 5], device=dev)}
        self._gate_on = True
        self._order: dict[bool, Tensor] = {}  # the set-placing kernel's scratch (order_scratch)
        self.blocks_closed = 0  # blocks closed on the device since the last merge_counts (their distinct sums)
        self.on_device = False  # which tables are live: the device's (True) or the host pool's
        self.use_kernel = dev.type == "cuda"  # one Triton program per placing (engine.kernels.triton_copy); else tensor ops
        self.set_kernel = self.use_kernel and self.S <= SET_KERNEL_MAX_SLOTS  # the same for a block pass's fetches
        self.side = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None  # the prefetch's stream
        self._forked = False  # a prefetch was issued on the side stream and not yet joined

    @staticmethod
    def refusal(pool: Any, top_k: int, device: torch.device) -> str | None:
        """Why device tables cannot serve this pool, or None: a prefetch places up to k experts while a fetch's k
        are in use, so the pool needs 2k slots; on CUDA the copy kernel needs Triton."""
        if pool is None:
            return "no layer is streamed"
        if pool.num_slots < 2 * top_k:
            return f"the slot pool has {pool.num_slots} slots; device tables need at least {2 * top_k} (2 x top-k)"
        if device.type == "cuda":

            if not available():
                return "Triton is not installed (it copies the missing rows on CUDA)"
        elif device.type != "cpu":
            return f"no device tables on {device.type}"
        return None

    # --- ownership ---
    def push(self, seen: dict[int, set[int]] | None = None) -> None:
        """Write the host pool's state into the device tables (no host read); the device tables are live after.
        Inside a diffusion block the pool's pins come along, and ``seen`` (the runtime's experts of the open block
        so far, per layer) is kept on the device for the block's distinct count."""
        pool, E = self.pool, self.E
        # Called between forwards: experts still marked in use were left so by a forward that raised (an
        # out-of-memory, a cancel); kept, they would never be evicted again
        pool.in_use.clear()
        slot_of = [-1] * (self.L * E + 1)
        key_of = [-1] * (self.S + 1)
        stamp = [s - (self.S + 1) for s in range(self.S)] + [BIG]  # free: negative, lowest slot first
        fresh = [False] * (self.S + 1)
        pinned = [False] * (self.S + 1)
        for rank, key in enumerate(pool.lru):  # oldest first
            slot, k = pool.slot_of[key], self.pos[key[0]] * E + key[1]
            slot_of[k], key_of[slot], stamp[slot] = slot, k, rank
            fresh[slot] = key in pool.prefetched_unused
            pinned[slot] = key in pool.block_pins
        seen_at = [False] * (self.L * E + 1)
        for layer, experts in (seen or {}).items():
            for e in experts:
                seen_at[self.pos[layer] * E + e] = True
        pool.block_pins.clear()  # (the device's pins are live now)
        for dst, src in ((self.slot_of, slot_of), (self.key_of, key_of), (self.stamp, stamp), (self.fresh, fresh),
                         (self.pinned, pinned), (self.seen, seen_at)):
            dst.copy_(torch.tensor(src, dtype=dst.dtype))
        self.tick.fill_(math.ceil((len(pool.lru) + 1) / STAMP_STRIDE))  # every new stamp above the ranks
        if pool.copy_stream is not None:  # the host pool's copies land before a device fetch reads its slots
            torch.cuda.current_stream(self.device).wait_stream(pool.copy_stream)
        self.on_device = True

    def pull(self) -> dict[int, set[int]]:
        """Read the device tables back into the host pool (one host read) and merge the counters; the host pool's
        state is live after, the open block's pins included. Returns the experts the open block touched while the
        device's tables were live ({layer: experts}; empty outside a block)."""
        self.join()
        pool, E, S = self.pool, self.E, self.S
        head = torch.stack([self.key_of, self.stamp, self.fresh.long(), self.pinned.long()]).flatten()
        flat = torch.cat([head, self.seen[:-1].long()]).tolist()  # the read
        key_of, stamp, fresh, pinned = (flat[i * (S + 1):(i + 1) * (S + 1)] for i in range(4))
        seen_at = flat[4 * (S + 1):]
        self.seen.zero_()
        self.merge_counts()
        occupied = sorted((s for s in range(S) if key_of[s] >= 0), key=stamp.__getitem__)
        pool.slot_of, pool.lru, pool.key_of = {}, OrderedDict(), [None] * S
        pool.prefetched_unused, pool.block_pins = set(), set()
        for s in occupied:
            lp, e = divmod(key_of[s], E)
            key = (self.layers[lp], e)
            pool.slot_of[key], pool.key_of[s] = s, key
            pool.lru[key] = None
            if fresh[s]:
                pool.prefetched_unused.add(key)
            if pinned[s]:
                pool.block_pins.add(key)
        pool.free = [s for s in range(S - 1, -1, -1) if key_of[s] < 0]  # pop(): lowest first
        pool.done = [None] * S  # the read above waited for every step that read a slot
        self.on_device = False
        seen: dict[int, set[int]] = {}
        for i, v in enumerate(seen_at):
            if v:
                seen.setdefault(self.layers[i // E], set()).add(i % E)
        return seen

    def merge_counts(self) -> None:
        """Add the device counters to the host pool's statistics and zero them (a host read), with the distinct
        experts of the blocks closed on the device."""
        read = torch.cat([self.counts, self.distinct]).tolist()
        values, distinct = read[: len(COUNTS)], read[len(COUNTS):]
        self.counts.zero_()
        self.distinct.zero_()
        st = self.pool.stats
        for name, v in zip(COUNTS, values):
            setattr(st, name, getattr(st, name) + int(v))
        st.h2d_bytes += (values[1] + values[2]) * self.pool.layout.nbytes
        st.distinct_device_total += int(sum(distinct))
        st.distinct_device_count += self.blocks_closed * self.L
        self.blocks_closed = 0

    def end_block(self, count: bool) -> None:
        """A diffusion block closes on the device (no host read): its pins are released and, where ``count`` (it
        ran a pass), its distinct experts per layer added to the sums that :meth:`merge_counts` reads."""
        if count:
            self.distinct.add_(self.seen[:-1].view(self.L, self.E).sum(1))
            self.blocks_closed += 1
        self.seen.zero_()
        self.pinned.zero_()

    def set_gate(self, on: bool) -> None:
        """Whether the next block passes prefetch (a device flag that their recorded or compiled prefetch reads;
        written only when it changes)."""
        if on != self._gate_on:
            self.gate.fill_(on)
            self._gate_on = on

    # --- a step ---
    def row_index(self, layer: int) -> Tensor:
        """[E] expert -> slot of ``layer`` (a view of the live table: what the routed compute gathers by)."""
        lp = self.pos[layer]
        return self.slot_of[lp * self.E : (lp + 1) * self.E]

    def join(self) -> None:
        """The current stream waits for the prefetch issued on the side stream (its copies and table writes), if
        one was. (Only then: while a CUDA graph is recorded, waiting on a stream that was never forked from the
        recording one is not allowed. Recorded, the fork and the join replay as they were issued.)"""
        if self.side is not None:  # (a constant when traced: the CPU's steps trace whole)
            self._join_side()

    @torch.compiler.disable  # streams and the Python flag stay out of a compiled layer (no guard on the flag)
    def _join_side(self) -> None:
        if self._forked and self.side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.side)
            self._forked = False

    def fetch(self, layer: int, idx: Tensor) -> Tensor:
        """Make the experts ``idx`` [k] (distinct) of ``layer`` resident; returns their slots [k] in ascending
        expert order. Counts a pass at the first streamed layer."""
        self.join()
        lp = self.pos[layer]
        idx, target, need = self._place(lp, idx.reshape(-1), touch=True)
        self._copy(lp, idx, target, need)
        return target

    def prefetch(self, layer: int, idx: Tensor) -> None:
        """Place the guessed experts ``idx`` [k] of ``layer`` that are absent. Never into the slots the running
        step reads: its fetch just made them the k most recent, and a pool of 2k slots or more has k older ones.
        On CUDA on the side stream: the next fetch (:meth:`join`) waits for it."""
        if self.side is None:
            self._prefetch(layer, idx)
        else:
            self._on_side(self._prefetch, layer, self._guess, idx)

    @torch.compiler.disable  # streams are not traced; a CUDA graph records the fork and join all the same
    def _on_side(self, run: Callable[[int, Tensor], None], layer: int, buf: Tensor, guess: Tensor) -> None:
        """``run(layer, buf)`` on the side stream, forked from this one, with ``guess`` copied into ``buf``."""
        assert self.side is not None
        # the guess goes into a buffer of the tables' own first (on this stream): the side stream never reads a
        # tensor this stream may free and reuse (record_stream has no place in a CUDA graph's recording)
        buf.copy_(guess.reshape(buf.shape))
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            run(layer, buf)
        self._forked = True

    def _prefetch(self, layer: int, idx: Tensor) -> None:
        lp = self.pos[layer]
        idx, target, need = self._place(lp, idx.reshape(-1), touch=False)
        self._copy(lp, idx, target, need)

    # --- a diffusion block's pass: any set of experts per layer, pinned for the block ---
    def fetch_set(self, layer: int, present: Tensor) -> None:
        """Make the experts ``present`` [E] bool of ``layer`` resident for a pass of a diffusion block and pin them
        until :meth:`end_block`; the compute reads :meth:`row_index`. The host pool's block fetch, decision for
        decision: hits refresh their place, the misses take free slots, then unpinned ones, oldest first, and only
        then the block's own pins (counted); needs S >= E (``engine.placement.placer.min_slot_pool`` makes it so)."""
        self.join()
        lp = self.pos[layer]
        target, need = self._place_set(lp, present, fetch=True)
        self._copy_set(lp, target, need)

    def prefetch_set(self, layer: int, present: Tensor) -> None:
        """Place the guessed experts ``present`` [E] bool of ``layer`` that are absent, where :attr:`gate` is set
        (a block's first pass), into free or unpinned slots, never the block's pins (the running layer's are
        pinned); those that find no slot are dropped. On CUDA on the side stream, as :meth:`prefetch`."""
        if self.side is None:
            self._prefetch_set(layer, present)
        else:
            self._on_side(self._prefetch_set, layer, self._guess_set, present)

    def _prefetch_set(self, layer: int, present: Tensor) -> None:
        lp = self.pos[layer]
        target, need = self._place_set(lp, present if self.set_kernel else present & self.gate, fetch=False)
        self._copy_set(lp, target, need)

    def _place_set(self, lp: int, present: Tensor, fetch: bool) -> tuple[Tensor, Tensor]:
        """Tensor ops over all E experts of layer position ``lp`` (fixed shapes, no host read): look up the
        ``present`` ones, give the absent ones victims in order (a fetch: free slots, then the oldest unpinned, then
        the oldest pinned; a prefetch: never a pinned slot, nor past the last victim there is), write the tables and
        counters. Returns each expert's slot [E] (the scratch cell S where it has none) and which are copied [E]."""
        if self.set_kernel:

            return place_set(self, lp, present, fetch)
        E, S, LE = self.E, self.S, self.L * self.E
        key = self._experts + lp * E  # [E]
        s = self.slot_of[key]  # [E]
        hit = present & (s >= 0)
        need = present & (s < 0)
        st = self.stamp + self.pinned.long() * PIN_OFFSET if fetch else torch.where(self.pinned, BIG, self.stamp)
        st = st.index_fill(0, torch.where(hit, s, S), BIG)  # a hit's slot is not a victim (nor the scratch cell)
        n = min(E, S)
        order = torch.topk(st, n, largest=False)  # the n best victims, in the order the host pool takes them
        rank = (torch.cumsum(need.long(), 0) - 1).clamp(min=0, max=n - 1)
        need = need & (order.values[rank] < BIG)  # (a fetch always finds one: S >= E)
        target = torch.where(need, order.indices[rank], torch.where(hit, s, S))
        upd = (hit | need) if fetch else need
        old = self.key_of[target]
        evict = need & (old >= 0)
        was_fresh = self.fresh[target] & present
        if fetch:  # slot_hits, slot_misses, prefetch_hits, prefetch_wasted, evictions, block_pin_evictions
            flags = torch.stack([hit, need, hit & was_fresh, evict & was_fresh, evict, evict & self.pinned[target]])
        else:  # prefetched, prefetch_wasted, evictions
            flags = torch.stack([need, evict & was_fresh, evict])
        self.slot_of.index_put_((torch.where(evict, old, LE),), torch.full_like(old, -1))
        self.slot_of.index_put_((torch.where(upd, key, LE),), torch.where(upd, target, -1))
        at = torch.where(upd, target, S)
        rank_new = torch.cumsum(upd.long(), 0) - 1  # ascending expert order, as the host pool appends them
        self.key_of.index_put_((at,), torch.where(upd, key, -1))
        self.stamp.index_put_((at,), torch.where(upd, self.tick * STAMP_STRIDE + rank_new, BIG))
        self.fresh.index_put_((at,), upd & (not fetch))
        if fetch:
            self.pinned.index_put_((at,), upd)
            self.seen.index_put_((torch.where(present, key, LE),), present)
        self.tick.add_(1)
        self.counts.index_add_(0, self._at_set[fetch], flags.sum(1))
        if fetch and lp == 0:  # the first streamed layer's fetch: a pass
            self.counts[COUNTS.index("passes")] += 1
        return target, need

    def _place(self, lp: int, idx: Tensor, touch: bool) -> tuple[Tensor, Tensor, Tensor]:
        """Look up the distinct experts ``idx`` [k] of layer position ``lp``, choose slots for the absent ones and
        write the tables. ``touch``: a fetch (hits move to most recent, a fresh hit counts); else a prefetch (hits
        are left alone, the placed slots are fresh). Returns the experts in ascending order [k], their slots [k] and
        which were absent [k] bool. On CUDA one Triton program (``engine.kernels.triton_copy.place``) does it all."""
        if self.use_kernel:

            return place(self, lp, idx, touch)
        E, S, LE = self.E, self.S, self.L * self.E
        idx = idx.sort().values
        k = idx.shape[0]
        key = idx + lp * E  # [k]
        s = self.slot_of[key]  # [k]
        hit = s >= 0
        need = ~hit
        st = self.stamp.clone()
        st.index_fill_(0, torch.where(hit, s, S), BIG)  # a hit's slot is not a victim
        victims = torch.topk(st, k, largest=False).indices  # [k] oldest first (free slots lowest first)
        rank = (torch.cumsum(need.long(), 0) - 1).clamp(min=0)
        target = torch.where(need, victims[rank], s)  # [k] (every entry a real slot: S >= 2k, see refusal)
        upd = torch.ones_like(need) if touch else need
        old = self.key_of[target]
        evict = need & (old >= 0)
        was_fresh = self.fresh[target]
        if touch:  # slot_hits, slot_misses, prefetch_hits, prefetch_wasted, evictions (and a pass at layer 0)
            flags = torch.stack([hit, need, hit & was_fresh, evict & was_fresh, evict])
        else:  # prefetched, prefetch_wasted, evictions
            flags = torch.stack([need, evict & was_fresh, evict])
        self.slot_of.index_put_((torch.where(evict, old, LE),), torch.full_like(old, -1))
        self.slot_of.index_put_((torch.where(upd, key, LE),), torch.where(upd, target, -1))
        at = torch.where(upd, target, S)
        self.key_of.index_put_((at,), torch.where(upd, key, -1))
        self.stamp.index_put_((at,), torch.where(upd, self.tick * STAMP_STRIDE + self._ranks[:k], BIG))
        self.fresh.index_put_((at,), upd & (not touch))
        self.tick.add_(1)
        self.counts.index_add_(0, self._at[touch], flags.sum(1))
        if touch and lp == 0:  # the first streamed layer's fetch: a pass
            self.counts[COUNTS.index("passes")] += 1
        return idx, target, need

    def _copy(self, lp: int, idx: Tensor, target: Tensor, need: Tensor) -> None:
        """Copy the rows of the experts that were absent (``need``) from the host rows into their slots."""
        src, buf = self.sources[lp], self.pool.buf
        if self.use_kernel:

            copy_rows(src, buf, idx, target, need)
            return
        if torch.compiler.is_compiling():  # traced: fixed shapes (the present rows are written back unchanged)
            buf.index_copy_(0, target, torch.where(need[:, None], src.index_select(0, idx), buf.index_select(0, target)))
        else:  # eager on the CPU: the missing rows only (the nonzero is a host read only on a GPU, which has the kernel)
            missing = need.nonzero().flatten()
            buf.index_copy_(0, target[missing], src.index_select(0, idx[missing]))

    def order_scratch(self, fetch: bool, n: int) -> Tensor:
        """A fixed [n] int64 buffer for the placing kernel's sorted victims (one for fetches, one for prefetches,
        which run on another stream)."""
        buf = self._order.get(fetch)
        if buf is None or buf.shape[0] != n:
            with torch.inference_mode(False):
                buf = self._order[fetch] = torch.empty(n, dtype=torch.long, device=self.device)
        return buf

    def _copy_set(self, lp: int, target: Tensor, need: Tensor) -> None:
        """:meth:`_copy` for a set's [E] entries, whose ``target`` is the scratch index S where an expert has no
        slot. Traced (fixed shapes), every entry writes a row: a hit its own row back, an absent expert the same
        row as the first copied entry (or slot 0's own row when nothing is copied), so no two writes to one slot
        differ."""
        if self.use_kernel or not torch.compiler.is_compiling():
            self._copy(lp, self._experts, target, need)  # (the kernel and the eager copy skip what is not needed)
            return
        src, buf, S = self.sources[lp], self.pool.buf, self.S
        first = torch.argmax(need.long()).view(1)  # the first copied entry (0 when none is)
        any_need = need.any()
        absent = target >= S
        dst = torch.where(absent, torch.where(any_need, target.index_select(0, first), 0), target)
        from_src = need | (absent & any_need)
        rows = torch.where(from_src[:, None], src.index_select(0, torch.where(need, self._experts, first)),
                           buf.index_select(0, dst))
        buf.index_copy_(0, dst, rows)

    def check(self) -> list[str]:
        """Consistency of the live tables (a host read; for tests and ``bench``): every key's slot names it back,
        every occupied slot holds its expert's row. Returns what is wrong. (While the host pool's state is live,
        the device tables are stale by design: that state is checked instead.)"""
        bad: list[str] = []
        if not self.on_device:
            pool = self.pool
            for key, s in pool.slot_of.items():
                if pool.key_of[s] != key:
                    bad.append(f"host: {key} -> slot {s}, whose key is {pool.key_of[s]}")
                elif not torch.equal(pool.buf[s].cpu(), self.sources[self.pos[key[0]]][key[1]].cpu()):
                    bad.append(f"host: slot {s} does not hold the row of layer {key[0]} expert {key[1]}")
            return bad
        slot_of, key_of = self.slot_of[:-1].cpu(), self.key_of[:-1].cpu()
        for key in (slot_of >= 0).nonzero().flatten().tolist():
            s = int(slot_of[key])
            if int(key_of[s]) != key:
                bad.append(f"key {key} -> slot {s}, whose key is {int(key_of[s])}")
        for s in (key_of >= 0).nonzero().flatten().tolist():
            lp, e = divmod(int(key_of[s]), self.E)
            if int(slot_of[lp * self.E + e]) != s:
                bad.append(f"slot {s} holds key {int(key_of[s])}, which points to slot {int(slot_of[lp * self.E + e])}")
            elif not torch.equal(self.pool.buf[s].cpu(), self.sources[lp][e].cpu()):
                bad.append(f"slot {s} does not hold the row of layer {self.layers[lp]} expert {e}")
        return bad
