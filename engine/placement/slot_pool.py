"""The device side of streaming: the byte ledger of everything placement puts on the device, and the expert slot pool.

Slot pool: one device tensor [S, row_bytes] shared by all streamed layers, keyed by (layer, expert), LRU.
Per diffusion block (``begin_block`` / ``end_block``) every slot a streamed layer touches is pinned for the rest of
the block, so the block's working set is loaded once and reused by all its denoising passes. Pins are a
preference: when a layer needs a slot and only other layers' block pins remain, the least recently used of those
is evicted (counted as ``block_pin_evictions``), so any pool of at least one layer (E slots) works.
The experts in use by the running forward are never evicted.

Copies run on a side CUDA stream; a per-slot "ready" event gates compute, a per-slot "done" event gates reuse.
On CPU (tests, CI) the same code does plain copies. Pageable host rows go through the staging ring
(``engine.placement.expert_store``).

Letters: E experts, S slots, R row bytes per expert.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from clover_desk.engine.errors import OutOfMemory, PlanError
from clover_desk.engine.placement.expert_store import HostExpertStore, StagingRing
from clover_desk.engine.weights.quant import RowLayout

# ---------------------------------------------------------------------------------------------------------------
# Device byte ledger (also the simulated-OOM cap)
# ---------------------------------------------------------------------------------------------------------------


class DeviceLedger:
    """Counts the bytes placement puts on the device, by kind. ``cap_bytes`` simulates a smaller device: going
    over it raises :class:`OutOfMemory`, exactly like a real CUDA OOM (which is converted to the same error)."""

    def __init__(self, device: torch.device, cap_bytes: int | None = None) -> None:
        self.device = device
        self.cap_bytes = cap_bytes
        self.by_kind: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def _charge(self, kind: str, what: str, nbytes: int) -> None:
        if self.cap_bytes is not None and self.total + nbytes > self.cap_bytes:
            raise OutOfMemory(
                f"out of device memory placing {what} ({nbytes / 2**20:.1f} MiB): {self.total / 2**20:.1f} MiB "
                f"already placed, cap {self.cap_bytes / 2**20:.1f} MiB"
            )
        self.by_kind[kind] = self.by_kind.get(kind, 0) + nbytes

    def place(self, kind: str, what: str, t: Tensor) -> Tensor:
        nbytes = t.numel() * t.element_size()
        self._charge(kind, what, nbytes)
        try:
            return t.to(self.device)
        except torch.OutOfMemoryError:
            raise OutOfMemory(f"CUDA out of memory placing {what} ({nbytes / 2**20:.1f} MiB)") from None

    def empty(self, kind: str, what: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self._charge(kind, what, nbytes)
        try:
            return torch.empty(shape, dtype=dtype, device=self.device)
        except torch.OutOfMemoryError:
            raise OutOfMemory(f"CUDA out of memory allocating {what} ({nbytes / 2**20:.1f} MiB)") from None


# ---------------------------------------------------------------------------------------------------------------
# Slot pool
# ---------------------------------------------------------------------------------------------------------------

Key = tuple[int, int]  # (layer, expert)


@dataclass
class Stats:
    h2d_bytes: int = 0
    slot_hits: int = 0
    slot_misses: int = 0
    evictions: int = 0
    block_pin_evictions: int = 0
    prefetched: int = 0
    prefetch_hits: int = 0
    prefetch_wasted: int = 0
    staged_copies: int = 0
    host_reads: int = 0  # device-to-host reads of the experts to fetch (a sync each on a GPU): one per layer and forward
    blocks: int = 0
    passes: int = 0
    passes_per_block: list[int] = field(default_factory=list)
    distinct_per_block: dict[int, list[int]] = field(default_factory=dict)  # layer -> distinct experts per block
    # blocks closed on the device tables (engine.placement.device_pool): their distinct experts summed, and (block, layer) pairs
    distinct_device_total: int = 0
    distinct_device_count: int = 0
    host_computes: int = 0  # streamed layers' forwards whose experts ran on the CPU from the host rows (cpu_experts)


class SlotPool:
    """Device expert slots shared by all streamed layers, with LRU replacement and per-block pins."""

    def __init__(self, num_slots: int, layout: RowLayout, device: torch.device, ledger: DeviceLedger) -> None:
        self.num_slots = num_slots
        self.layout = layout
        self.device = device
        self.buf = ledger.empty(
            "expert_slots",
            f"expert slot pool ({num_slots} x {layout.nbytes} B)",
            (num_slots, layout.nbytes),
            torch.uint8,
        )  # [S, R]
        self.slot_of: dict[Key, int] = {}
        self.key_of: list[Key | None] = [None] * num_slots
        self.lru: OrderedDict[Key, None] = OrderedDict()  # oldest first
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.block_pins: set[Key] = set()
        self.in_use: set[Key] = set()
        self.prefetched_unused: set[Key] = set()
        self.stats = Stats()
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device=device) if cuda else None
        self.ready: list[Any] = [torch.cuda.Event() if cuda else None for _ in range(num_slots)]
        self.done: list[Any] = [None] * num_slots  # event after the last compute that read the slot
        self.staging: StagingRing | None = None

    # --- internals ---
    def _victim(self, allow_block_pins: bool) -> Key | None:
        for key in self.lru:
            if key in self.in_use:
                continue
            if key in self.block_pins and not allow_block_pins:
                continue
            return key
        return None

    def _take_slot(self, for_prefetch: bool) -> int | None:
        if self.free:
            return self.free.pop()
        victim = self._victim(allow_block_pins=False)
        if victim is None and not for_prefetch:
            victim = self._victim(allow_block_pins=True)
            if victim is not None:
                self.stats.block_pin_evictions += 1
        if victim is None:
            return None
        slot = self.slot_of.pop(victim)
        del self.lru[victim]
        self.block_pins.discard(victim)
        if victim in self.prefetched_unused:
            self.prefetched_unused.discard(victim)
            self.stats.prefetch_wasted += 1
        self.key_of[slot] = None
        self.stats.evictions += 1
        return slot

    def _copy_in(self, slot: int, store: HostExpertStore, e: int) -> None:
        src = store.row(e)
        staged = None
        if not store.pinned and self.staging is not None:
            src, staged = self.staging.stage(src)
            self.stats.staged_copies += 1
        if self.copy_stream is None:
            self.buf[slot].copy_(src)
        else:
            with torch.cuda.stream(self.copy_stream):
                if self.done[slot] is not None:
                    self.copy_stream.wait_event(self.done[slot])  # compute that read the old expert has finished
                self.buf[slot].copy_(src, non_blocking=True)
                self.ready[slot].record(self.copy_stream)
                if staged is not None:
                    self.staging.events[staged].record(self.copy_stream)  # type: ignore[union-attr]
        self.stats.h2d_bytes += self.layout.nbytes

    # --- API ---
    def acquire(self, layer: int, experts: list[int], store: HostExpertStore, in_block: bool) -> dict[int, int]:
        """Make ``experts`` of ``layer`` resident; returns {expert: slot}. They stay in use until ``release``."""
        keys = [(layer, e) for e in experts]
        self.in_use.update(keys)
        out: dict[int, int] = {}
        for key in keys:
            slot = self.slot_of.get(key)
            if slot is not None:
                self.stats.slot_hits += 1
                self.lru.move_to_end(key)
                if key in self.prefetched_unused:
                    self.prefetched_unused.discard(key)
                    self.stats.prefetch_hits += 1
            else:
                self.stats.slot_misses += 1
                slot = self._take_slot(for_prefetch=False)
                if slot is None:
                    self.in_use.difference_update(keys)
                    raise PlanError(
                        f"expert slot pool too small: layer {layer} needs {len(keys)} experts at once, "
                        f"pool has {self.num_slots} slots"
                    )
                self._copy_in(slot, store, key[1])
                self.slot_of[key] = slot
                self.key_of[slot] = key
                self.lru[key] = None
            if in_block:
                self.block_pins.add(key)
            out[key[1]] = slot
        return out

    def wait_ready(self, slots: list[int]) -> None:
        if self.copy_stream is None:
            return
        cur = torch.cuda.current_stream(self.device)
        for s in slots:
            cur.wait_event(self.ready[s])

    def release(self, layer: int, experts: list[int]) -> None:
        """The forward that used these experts was issued: mark the slots reusable after it completes."""
        if self.copy_stream is not None:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            for e in experts:
                slot = self.slot_of.get((layer, e))
                if slot is not None:
                    self.done[slot] = ev
        self.in_use.difference_update((layer, e) for e in experts)

    def prefetch(self, layer: int, experts: list[int], store: HostExpertStore) -> int:
        """Copy guessed experts into free or unpinned slots; never evicts block pins, experts in use, or the guess
        itself (a guessed expert already present, or one this call placed, is not a victim for another)."""
        n = 0
        kept = {(layer, e) for e in experts} - self.in_use  # protected for the length of this call, as in use
        self.in_use |= kept
        try:
            for e in experts:
                key = (layer, e)
                if key in self.slot_of:
                    continue
                slot = self._take_slot(for_prefetch=True)
                if slot is None:
                    break
                self._copy_in(slot, store, e)
                self.slot_of[key] = slot
                self.key_of[slot] = key
                self.lru[key] = None
                self.prefetched_unused.add(key)
                n += 1
        finally:
            self.in_use -= kept
        self.stats.prefetched += n
        return n

    def end_block(self) -> None:
        self.block_pins.clear()
