"""Expert offload: host expert store, device slot pool (LRU), streamed expert bank, plan application, accounting.

Placement (``apply_plan``): the planner decides which MoE layers keep all their experts on the device
("resident") and which are "streamed", and how many expert slots the device pool has. Streamed layers keep their
quantized experts in host memory, ONE contiguous row per expert (``engine.weights.quant.ExpertLayout``), so one copy fills
one preallocated device slot. Host rows are pinned when the device is CUDA; where pinning fails or its budget is
spent (Windows/WSL cap pinned memory), rows stay pageable and go through a small pinned staging ring.

Slot pool: one device tensor [S, row_bytes] shared by all streamed layers, keyed by (layer, expert), LRU.
Per diffusion block (``begin_block`` / ``end_block``) every slot a streamed layer touches is pinned for the rest of
the block, so the block's working set is loaded once and reused by all its denoising passes. Pins are a
preference: when a layer needs a slot and only other layers' block pins remain, the least recently used of those
is evicted (counted as ``block_pin_evictions``), so any pool of at least one layer (E slots) works.
The experts in use by the running forward are never evicted.

Copies run on a side CUDA stream; a per-slot "ready" event gates compute, a per-slot "done" event gates reuse.
On CPU (tests, CI) the same code does plain copies. Numbers never depend on the plan: resident and streamed
banks run the same ``engine.weights.quant.routed_forward`` on the same bytes.

One host read per streamed layer and forward (``StreamedExpertBank.prepare_for``): the experts it touches and the
prefetch guess come back together as one presence mask. Prefetch: the next streamed layer's router is applied to
this layer's input (a speculative guess, as in mixtral-offloading), and its top-k experts are copied into free or
unpinned slots as soon as this layer's own copies are issued (``ready``), so they overlap this layer's compute.
Under CUDA graphs (``engine.kernels.step_graphs``) only that fetch runs eagerly: the compute reads a fixed slot table.

Zero-copy (opt-in: ``place_model(expert_fetch="zero_copy")`` on CUDA, from ``engine.settings.GpuPaths``, or
``place_model(zero_copy=True)``): a forward of at most
:data:`ZERO_COPY_PAIRS` (token, expert) pairs, an AR step, reads its streamed experts where they lie. On CUDA the
page-locked rows are mapped into the device's address space (:func:`in_place_view`), so the routed compute gathers
its k rows over PCIe itself: no fetch, no host read, no pool slot, and the step is one CUDA graph. Each step then
reads all its streamed experts over PCIe (the pool's hits are lost), against a host read and a copy per streamed
layer; ``bench speed --moe-only`` times both on a GPU, which decides. Block passes always go through the pool,
whose slots their passes share.

Device tables (opt-in: ``place_model(expert_fetch="device_tables")`` on CUDA, or
``place_model(device_pool=True)``): AR steps keep the
pool, its hits and its prefetch, but do its bookkeeping on the device (``engine.placement.device_pool``): no host read, and
the step is one CUDA graph. A prompt or block pass reads the tables back first. Exclusive with zero-copy.

CPU experts (the plan's ``cpu_experts``, chosen per mode by the planner's speed model, as llama.cpp's
``--n-cpu-moe`` keeps some layers' experts on the CPU): in the modes named ("ar": AR steps, "pass": a block's
passes) a streamed layer computes its routed experts on the CPU from its host rows (``engine.kernels.cpu_quant``),
sending only the layer's input and output across; no fetch, no pool slot. Prompts always stream.

Accounting (``accounting(model)``) is a JSON-safe dict for ``Finished.accounting``.

Letters: E experts, S slots, R row bytes per expert, T tokens, K top-k, D hidden size.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from clover_desk.engine.errors import OutOfMemory, PlanError  # noqa: F401 (OutOfMemory re-exported: callers import it from here too)
from clover_desk.engine.model.experts import SMALL_SLOTS, DenseExpertBank, ExpertBank, present
from clover_desk.engine.placement.device_pool import COUNTS, DeviceSlotTables
from clover_desk.engine.placement.planner import CPU_EXPERT_MODES, Plan
from clover_desk.engine.settings import EXPERT_FETCH
from clover_desk.engine.weights.formats import format_of_torch_dtype
from clover_desk.engine.weights.quant import (
    QuantExpertBank,
    QuantLinear,
    QuantPolicy,
    RowExpertBank,
    RowLayout,
    routed_forward,
    rows_sync_free,
    set_submodule,
)

log = logging.getLogger(__name__)

GiB = 1024**3
# A forward with at most this many (token, expert) pairs reads streamed experts in place when zero-copy is on: an AR
# step's top-8. Its compute gathers one row per pair (engine.model.experts.SMALL_SLOTS), so it needs no sort and no sync.
ZERO_COPY_PAIRS = SMALL_SLOTS
WINDOWS_PIN_BUDGET = 2 * GiB  # pinned host memory a loaded process can usually get under WDDM; the rest is staged
_LAYER_RX = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts$")


@dataclass
class SimplePlan:
    """A plan written by hand (tests, benchmarks): the placement fields of ``engine.placement.planner.Plan``, under
    the same names, without the byte counts a planner makes."""

    resident_expert_layers: tuple[int, ...]
    streamed_expert_layers: tuple[int, ...]
    slot_pool_experts: int
    vram_breakdown: dict[str, int] = field(default_factory=dict)
    fits: bool = True
    reason: str = ""


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
# Host store and staging ring
# ---------------------------------------------------------------------------------------------------------------


class PinBudget:
    """How many more bytes may be page-locked (None: no cap). Pinning only happens for CUDA devices."""

    def __init__(self, limit_bytes: int | None) -> None:
        self.left = limit_bytes

    def take(self, nbytes: int) -> bool:
        if self.left is None:
            return True
        if nbytes > self.left:
            return False
        self.left -= nbytes
        return True


class HostExpertStore:
    """One streamed layer's experts in host memory: ``rows`` uint8 [E, R], one contiguous row per expert
    (page-locked when ``pinned``; placement allocates and fills them, see :func:`alloc_host_rows`)."""

    def __init__(self, layer: int, rows: Tensor, pinned: bool) -> None:
        self.layer = layer
        self.rows = rows
        self.pinned = pinned

    def row(self, e: int) -> Tensor:
        return self.rows[e]

    @property
    def nbytes(self) -> int:
        return self.rows.numel()


class _MappedRows:
    """Page-locked host rows offered to torch as device memory (``__cuda_array_interface__``): under CUDA's unified
    addressing a page-locked buffer has the same address on the device as on the host. The tensor torch builds
    from it holds this object, and with it the host tensor, alive."""

    def __init__(self, rows: Tensor) -> None:
        self.rows = rows
        self.__cuda_array_interface__ = {
            "shape": tuple(rows.shape),
            "typestr": "|u1",
            "data": (rows.data_ptr(), False),
            "strides": None,
            "version": 2,
        }


def in_place_view(rows: Tensor, device: torch.device) -> tuple[Tensor | None, str]:
    """A tensor on ``device`` whose bytes are host ``rows`` [E, R] uint8 where they lie (zero-copy), or None and why
    not. CPU: ``rows`` itself. CUDA: page-locked rows mapped into the device's address space, checked once: the view
    must be at the rows' own address (not a copy in VRAM) and read back the first and last row's first bytes."""
    if device.type == "cpu":
        return rows, ""
    if device.type != "cuda":
        return None, f"no zero-copy reads on {device.type}"
    if not rows.is_pinned():
        return None, "the rows are pageable (pinned memory was refused or its budget spent)"
    try:
        view = torch.as_tensor(_MappedRows(rows), device=device)
        probe = torch.tensor([0, rows.shape[0] - 1])
        n = min(64, rows.shape[1])
        seen = view[probe.to(device), :n].cpu()  # a sync, once per layer at placement
    except Exception as exc:  # noqa: BLE001 - any failure means: copy through the pool as before
        return None, f"mapping page-locked memory failed: {exc}"
    if view.device.type != "cuda" or view.data_ptr() != rows.data_ptr():
        return None, "torch copied the rows instead of mapping them"
    if not torch.equal(seen, rows[probe, :n]):
        return None, "reading the mapped rows through the device gave other bytes"
    return view, ""


class StagingRing:
    """A few pinned buffers of one row each: pageable rows are memcpy'd here first, then copied to the device.

    Pinned when the device is CUDA (``pin`` overrides); if even these few rows cannot be page-locked (a driver cap
    already spent, WSL), they stay pageable with a warning: copies are then synchronous, slower, never wrong."""

    def __init__(self, row_bytes: int, slots: int, device: torch.device, pin: bool | None = None) -> None:
        cuda = device.type == "cuda"
        self.pinned = cuda if pin is None else pin  # False once a pin was refused: the rest stay pageable
        self.buffers: list[Tensor] = []
        for _ in range(slots):
            if self.pinned:
                try:
                    self.buffers.append(torch.empty(row_bytes, dtype=torch.uint8, pin_memory=True))
                    continue
                except RuntimeError as exc:  # page-locked memory refused: pageable staging, no crash
                    log.warning("pinning %d staging rows of %d KiB failed (%s); staging in pageable memory",
                                slots, row_bytes >> 10, exc)
                    self.pinned = False
            self.buffers.append(torch.empty(row_bytes, dtype=torch.uint8))
        self.events: list[Any] = [torch.cuda.Event() if cuda else None for _ in range(slots)]
        self.next = 0

    def stage(self, row: Tensor) -> tuple[Tensor, int]:
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        ev = self.events[i]
        if ev is not None:
            ev.synchronize()  # the previous H2D copy out of this buffer has finished
        self.buffers[i].copy_(row)
        return self.buffers[i], i


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


# ---------------------------------------------------------------------------------------------------------------
# Streamed bank and runtime
# ---------------------------------------------------------------------------------------------------------------


class StreamedExpertBank(ExpertBank):
    """ExpertBank for a streamed layer: experts live in a :class:`HostExpertStore`, compute reads pool slots."""

    needs_prepare = True

    def __init__(self, layer: int, layout: RowLayout, store: HostExpertStore, runtime: "OffloadRuntime") -> None:
        super().__init__()
        self.layer = layer
        self.layout = layout
        self.num_experts = layout.num_experts
        self.hidden_size = layout.hidden_size
        self.intermediate_size = layout.intermediate_size
        self.store = store
        self.runtime = runtime
        self._slots: dict[int, int] = {}
        self.next_router: nn.Module | None = None  # router of the next streamed layer (prefetch)
        self.next_layer: int | None = None
        self._guess: list[int] | None = None  # the next streamed layer's experts to prefetch (prepare_for)
        self.slot_table: Tensor | None = None  # [E] long on the pool's device: expert -> pool row (ready)
        self.in_place: Tensor | None = None  # [E, R] the host rows as the device reads them (zero-copy), or None

    def computes_on_host(self, pairs: int, in_block: bool | None = None) -> bool:
        """Whether a forward over ``pairs`` (token, expert) pairs runs this layer's experts on the CPU from the host
        rows (the plan's ``cpu_experts``: "ar" for an AR step's few pairs, "pass" for a block's passes; a prompt
        always streams): no fetch, no pool slot, only the layer's input and output cross."""
        modes = self.runtime.cpu_experts
        if not modes:
            return False
        if self.runtime.in_block if in_block is None else in_block:
            return "pass" in modes
        return "ar" in modes and pairs <= ZERO_COPY_PAIRS

    def reads_in_place(self, pairs: int) -> bool:
        """Whether a forward over ``pairs`` (token, expert) pairs reads this layer's experts where they lie in host
        memory, with no fetch (zero-copy on, this layer's rows mapped, an AR step's few pairs)."""
        return self.in_place is not None and self.runtime.zero_copy and pairs <= ZERO_COPY_PAIRS

    def device_fetches(self, pairs: int, in_block: bool | None = None) -> bool:
        """Whether a forward over ``pairs`` pairs fetches through the device tables (``engine.placement.device_pool``), with
        no host read: an AR step (one token's top-k), and every pass of a diffusion block (the block's pins are
        kept on the device). Not a prompt, which fetches on the host. ``in_block``: whether the forward is a
        block's pass (default: whether a block is open now)."""
        tables = self.runtime.tables
        if tables is None:  # (first: a compiled layer without tables guards on nothing else here)
            return False
        return (self.runtime.in_block if in_block is None else in_block) or pairs == tables.k

    def fetches(self, pairs: int, in_block: bool | None = None) -> bool:
        """Whether a forward over ``pairs`` pairs fetches its experts into the pool on the host first (a host
        read): not where it reads them in place, nor where the device tables fetch them."""
        return not (self.computes_on_host(pairs, in_block) or self.reads_in_place(pairs)
                    or self.device_fetches(pairs, in_block))

    def sync_free(self, pairs: int, device: torch.device, dtype: torch.dtype) -> bool:
        """The whole bank reads nothing on the host only where no host fetch runs (see :meth:`fetches`)."""
        return not self.fetches(pairs) and self.compute_sync_free(pairs, device, dtype)

    # Never traced (``torch.compiler.disable``), like engine.model.experts._moe_sorted: the slot bookkeeping is host-side
    # Python state that changes every step; traced, it would be baked into a compiled layer as constants (and the
    # pool's acquire / release calls replayed wrongly). A compiled layer calls prepare_for and forward eagerly (a
    # graph break each); engine.kernels.step_graphs calls prepare_for, ready and finish between recorded pieces.
    @torch.compiler.disable
    def prepare_for(self, x: Tensor, topk_idx: Tensor) -> None:
        """One host read for this layer: the experts it touches and, when it prefetches, the guess of the next
        streamed layer's (that layer's router on this layer's MoE input), one [1 or 2, E] presence mask copied once.
        (They were two ``torch.unique(...).cpu()`` calls, each a sync for its size and one for the copy.)"""
        tables = self.runtime.tables
        if tables is not None and tables.on_device:  # passes ran on the device tables: take them back first
            self.runtime.tables_to_host()
        self.runtime.on_layer_start(self.layer)
        rows = [present(topk_idx, self.num_experts)]
        guess = self.runtime.wants_prefetch() and self.next_router is not None and self.next_layer is not None
        if guess:
            assert self.next_router is not None
            with torch.no_grad():
                rows.append(present(self.next_router(x).topk(topk_idx.shape[-1], dim=-1).indices, self.num_experts))
        host = torch.stack(rows).cpu()  # [1 or 2, E] bool: the read
        self.runtime.stats.host_reads += 1
        self._guess = host[1].nonzero().flatten().tolist() if guess else None
        experts = host[0].nonzero().flatten().tolist()
        self._slots = self.runtime.pool.acquire(self.layer, experts, self.store, in_block=self.runtime.in_block)
        self.runtime.note_experts(self.layer, experts)

    @torch.compiler.disable
    def ready(self) -> None:
        """After :meth:`prepare_for`: make this forward's compute wait for its copies, write the slot table (expert
        -> pool row, a fixed device buffer: a recorded :meth:`compute` reads it), and start copying the guessed
        experts of the next streamed layer (they go to free or unpinned slots, never to this forward's)."""
        pool = self.runtime.pool
        pool.wait_ready(list(self._slots.values()))
        slot_of = torch.zeros(self.num_experts, dtype=torch.long)  # [E]
        slot_of[list(self._slots)] = torch.tensor(list(self._slots.values()), dtype=torch.long)
        if self.slot_table is None:  # (a normal tensor even when the first forward runs under inference_mode)
            with torch.inference_mode(False):
                self.slot_table = torch.zeros(self.num_experts, dtype=torch.long, device=pool.buf.device)
        # the pageable source is staged at once, so non_blocking needs no sync; the copy is ordered on the stream
        # after the compute that read the table's previous contents
        self.slot_table.copy_(slot_of, non_blocking=True)
        if self._guess is not None and self.next_layer is not None:  # read with this layer's experts (prepare_for)
            pool.prefetch(self.next_layer, self._guess, self.runtime.stores[self.next_layer])
        self._guess = None

    def compute(self, x: Tensor, topk_idx: Tensor, topk_w: Tensor) -> Tensor:
        """The routed experts from the pool rows the slot table names (after :meth:`ready`). No host read where
        :meth:`compute_sync_free` says so, so a CUDA graph can record it."""
        assert self.slot_table is not None
        pool = self.runtime.pool
        return routed_forward(x, topk_idx, topk_w, self.num_experts, self.layout, source=pool.buf,
                              row_index=self.slot_table)

    def compute_sync_free(self, pairs: int, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether :meth:`compute` over ``pairs`` (token, slot) pairs reads nothing on the host (the same compute
        as a resident bank's: :func:`engine.weights.quant.rows_sync_free`). Experts computed on the CPU for a GPU's
        forward read the host (their input and output cross)."""
        if device.type != "cpu" and self.computes_on_host(pairs):
            return False
        return rows_sync_free(pairs, device, self.layout)

    @torch.compiler.disable
    def finish(self) -> None:
        """After :meth:`compute` was issued: its slots become reusable once it has run."""
        self.runtime.pool.release(self.layer, list(self._slots))
        self._slots = {}

    def forward(self, x: Tensor, topk_idx: Tensor, topk_w: Tensor) -> Tensor:
        if self.computes_on_host(topk_idx.numel()):  # CPU experts: computed where they lie, nothing fetched
            return self._host_forward(x, topk_idx, topk_w)
        if self.reads_in_place(topk_idx.numel()):  # zero-copy: traced and recorded like a resident bank
            assert self.in_place is not None
            return routed_forward(x, topk_idx, topk_w, self.num_experts, self.layout, source=self.in_place)
        if self.device_fetches(topk_idx.numel()):  # device tables: traced and recorded too
            return self._device_forward(x, topk_idx, topk_w)
        return self._fetch_and_compute(x, topk_idx, topk_w)

    def _device_forward(self, x: Tensor, topk_idx: Tensor, topk_w: Tensor) -> Tensor:
        """An AR step or a block's pass through the device tables: this layer's fetch, the next streamed layer's
        prefetch (its router on this layer's input, as :meth:`prepare_for` guesses; in a block on its first pass
        only, a device flag), the compute from the pool."""
        rt = self.runtime
        tables = rt.tables
        assert tables is not None and rt.pool is not None
        if not torch.compiler.is_compiling() and not tables.on_device:  # eager: take the tables (compiled or
            rt.tables_to_device()  # replayed passes have them from CloverModel.forward's call to before_pass)
        guess = None
        # In a block, only its first pass prefetches: told by the tables' gate on the device, so that a CUDA graph
        # recorded on any pass serves them all; elsewhere the later passes skip the router and placing outright
        wanted = not rt.in_block or rt.block_prefetch or x.is_cuda
        if rt.prefetch and wanted and self.next_router is not None and self.next_layer is not None:
            guess = self.next_router(x).topk(topk_idx.shape[-1], dim=-1).indices
        if rt.in_block:
            tables.fetch_set(self.layer, present(topk_idx, self.num_experts))
            if guess is not None:
                tables.prefetch_set(self.next_layer, present(guess, self.num_experts))  # type: ignore[arg-type]
        else:
            tables.fetch(self.layer, topk_idx)
            if guess is not None:
                tables.prefetch(self.next_layer, guess)  # type: ignore[arg-type]
        return routed_forward(x, topk_idx, topk_w, self.num_experts, self.layout, source=rt.pool.buf,
                              row_index=tables.row_index(self.layer))

    @torch.compiler.disable
    def _host_forward(self, x: Tensor, topk_idx: Tensor, topk_w: Tensor) -> Tensor:
        """The routed experts on the CPU from this layer's host rows (llama.cpp's ``--n-cpu-moe``): the CPU kernels
        read only the routed experts' rows (engine.kernels.cpu_quant, through the same
        :func:`engine.weights.quant.routed_forward` as every bank, so the numbers are a resident bank's on the CPU);
        a GPU's forward sends the layer's input and routing over and takes the [T, D] result back."""
        rt = self.runtime
        rt.stats.host_computes += 1
        rt.on_layer_start(self.layer)  # passes and blocks are counted as the pool's forwards count them
        idx = topk_idx if x.device.type == "cpu" else topk_idx.cpu()
        if rt.in_block:  # the block's distinct experts (the ids are on the host already)
            rt.note_experts(self.layer, present(idx, self.num_experts).nonzero().flatten().tolist())
        if x.device.type == "cpu":
            return routed_forward(x, idx, topk_w, self.num_experts, self.layout, source=self.store.rows)
        y = routed_forward(x.cpu(), idx, topk_w.cpu(), self.num_experts, self.layout, source=self.store.rows)
        return y.to(x.device)

    @torch.compiler.disable
    def _fetch_and_compute(self, x: Tensor, topk_idx: Tensor, topk_w: Tensor) -> Tensor:
        if not self._slots:  # prepare_for() was not called for this forward: find the experts (a host read)
            self.prepare_for(x, topk_idx)
        # prepare_for() received exactly the experts of topk_idx: reuse them instead of a second host read
        self.ready()
        out = self.compute(x, topk_idx, topk_w)
        self.finish()
        return out

    def extra_repr(self) -> str:
        lay = self.layout
        return (f"layer={self.layer}, experts={self.num_experts}, row_bytes={lay.nbytes}, pinned={self.store.pinned}, "
                f"in_place={self.in_place is not None}")


class OffloadRuntime:
    """Everything ``apply_plan`` set up for one model: pool, stores, ledger, block state, statistics."""

    def __init__(self, device: torch.device, pool: SlotPool | None, ledger: DeviceLedger, prefetch: bool) -> None:
        self.device = device
        self.pool = pool
        self.ledger = ledger
        self.prefetch = prefetch
        self.stores: dict[int, HostExpertStore] = {}
        self.resident_layers: tuple[int, ...] = ()
        self.streamed_layers: tuple[int, ...] = ()
        self.block_passes = 0
        self.block_experts: dict[int, set[int]] = {}
        self.in_block = False  # between begin_block() and end_block()
        self.zero_copy = False  # AR steps read the mapped layers' experts in place (StreamedExpertBank.in_place)
        self.zero_copy_refused: dict[int, str] = {}  # layer -> why its rows could not be mapped
        self.tables: DeviceSlotTables | None = None  # AR steps' bookkeeping on the device (set_device_pool)
        self.device_pool_refused = ""  # why device tables were refused, when they were asked for
        self.block_prefetch = True  # this block pass prefetches (its block's first; set by before_pass)
        # the modes whose streamed experts run on the CPU where they lie ("ar", "pass": the plan's cpu_experts)
        self.cpu_experts: frozenset[str] = frozenset()

    @property
    def stats(self) -> Stats:
        return self.pool.stats if self.pool is not None else Stats()

    def before_pass(self, tokens: int, block_size: int | None = None) -> None:
        """Called before every forward (``CloverModel.forward``). Experts still marked in use were left so by a
        forward that raised (they would never be evicted again, and the next forward could find the pool too small):
        released. A causal forward (``block_size`` None) inside a block means the block was abandoned (a pass raised,
        or its generator was dropped before ``end_block``): the block is closed, its pins released. A one-token pass
        runs on the device tables, so they are written from the host pool here if the host's were live (outside any
        graph: a replayed step only runs its recorded kernels)."""
        if block_size is None and self.in_block:
            log.info("a causal forward inside a diffusion block: the block was abandoned; its pins are released")
            self._close_block()
        if self.pool is not None and self.pool.in_use:  # left by a forward that raised: nothing is in use now
            log.info("slot pool: %d experts left in use by a forward that did not finish, released",
                     len(self.pool.in_use))
            self.pool.in_use.clear()
        tables = self.tables
        if tables is None:
            return
        if self.in_block:  # a block's pass (block_size set: see above) runs on the device tables
            if not tables.on_device:
                self.tables_to_device()
            self.block_passes += 1  # (the host pool's banks count it in on_layer_start)
            self.block_prefetch = self.wants_prefetch()
            tables.set_gate(self.block_prefetch)
        elif tokens == 1 and not tables.on_device:
            self.tables_to_device()

    def tables_to_device(self) -> None:
        """The device tables become live (``DeviceSlotTables.push``), with the open block's experts so far."""
        assert self.tables is not None
        self.tables.push(self.block_experts if self.in_block else None)
        self.block_experts = {}

    def tables_to_host(self) -> None:
        """The host pool becomes live (``DeviceSlotTables.pull``: one host read); the experts the open block
        touched on the device join the host's count."""
        assert self.tables is not None
        for layer, experts in self.tables.pull().items():
            if self.in_block:
                self.block_experts.setdefault(layer, set()).update(experts)

    # --- block boundaries: explicit hooks only (the generation loop calls them around a diffusion block) ---
    def begin_block(self) -> None:
        """A diffusion block starts (its denoising passes and commit pass follow): the experts its streamed layers
        touch stay pinned in the pool until :meth:`end_block`."""
        if self.in_block:
            self._close_block()
        self.in_block = True

    def end_block(self) -> None:
        if self.in_block:
            self._close_block()

    def _close_block(self) -> None:
        st = self.stats
        on_device = self.tables is not None and self.tables.on_device
        if self.block_passes:
            st.blocks += 1
            st.passes_per_block.append(self.block_passes)
            if not on_device:  # (on the device: its distinct sums, DeviceSlotTables.end_block)
                for layer in self.streamed_layers:
                    st.distinct_per_block.setdefault(layer, []).append(len(self.block_experts.get(layer, ())))
        if on_device:
            assert self.tables is not None
            self.tables.end_block(count=self.block_passes > 0)
        self.block_passes = 0
        self.block_experts = {}
        self.in_block = False
        if self.pool is not None:
            self.pool.end_block()

    def on_layer_start(self, layer: int) -> None:
        """Called by each streamed bank; the first streamed layer of a forward counts a pass."""
        if self.streamed_layers and layer == self.streamed_layers[0]:
            self.stats.passes += 1
            if self.in_block:
                self.block_passes += 1

    def wants_prefetch(self) -> bool:
        """Prefetch outside blocks (AR steps) and on a block's first pass only: later passes of a block find their
        working set pinned, and guesses would only churn the unpinned slots."""
        return self.prefetch and (not self.in_block or self.block_passes <= 1)

    def note_experts(self, layer: int, experts: list[int]) -> None:
        if self.in_block:
            self.block_experts.setdefault(layer, set()).update(experts)

    def accounting(self) -> dict[str, Any]:
        if self.tables is not None:
            self.tables.merge_counts()  # the device counters of AR steps (a host read, outside any forward)
        st = self.stats
        looked = st.slot_hits + st.slot_misses
        per_block = [x for v in st.distinct_per_block.values() for x in v]
        distinct_n = len(per_block) + st.distinct_device_count
        return {
            "streamed_layers": list(self.streamed_layers),
            "resident_layers": list(self.resident_layers),
            "slot_pool_experts": self.pool.num_slots if self.pool else 0,
            "expert_row_bytes": self.pool.layout.nbytes if self.pool else 0,
            "h2d_bytes": st.h2d_bytes,
            "slot_hits": st.slot_hits,
            "slot_misses": st.slot_misses,
            "hit_rate": st.slot_hits / looked if looked else 0.0,
            "evictions": st.evictions,
            "block_pin_evictions": st.block_pin_evictions,
            "prefetched": st.prefetched,
            "prefetch_hits": st.prefetch_hits,
            "prefetch_wasted": st.prefetch_wasted,
            "staged_copies": st.staged_copies,
            "host_reads": st.host_reads,
            "zero_copy": self.zero_copy,
            "zero_copy_layers": [i for i in self.streamed_layers if i not in self.zero_copy_refused]
            if self.zero_copy else [],
            "device_pool": self.tables is not None,
            "cpu_experts": sorted(self.cpu_experts),
            "host_computes": st.host_computes,
            "blocks": st.blocks,
            "passes": st.passes,
            "passes_per_block": sum(st.passes_per_block) / len(st.passes_per_block) if st.passes_per_block else 0.0,
            "distinct_experts_per_layer_block": (sum(per_block) + st.distinct_device_total) / distinct_n
            if distinct_n else 0.0,
            "pinned_host_bytes": sum(s.nbytes for s in self.stores.values() if s.pinned),
            "pageable_host_bytes": sum(s.nbytes for s in self.stores.values() if not s.pinned),
            "device_bytes": dict(self.ledger.by_kind),
        }

    def reset_stats(self) -> None:
        """Zero the counters (the open block's counts too; slots and pins are kept)."""
        if self.pool is not None:
            self.pool.stats = Stats()
        if self.tables is not None:
            self.tables.counts.zero_()
            self.tables.distinct.zero_()
            self.tables.seen.zero_()
            self.tables.blocks_closed = 0
        self.block_passes = 0
        self.block_experts = {}


# ---------------------------------------------------------------------------------------------------------------
# Plan application
# ---------------------------------------------------------------------------------------------------------------


def expert_banks(model: nn.Module) -> dict[int, tuple[str, ExpertBank]]:
    """{layer index: (module name, bank)} for every ``layers.N.mlp.experts`` bank."""
    out: dict[int, tuple[str, ExpertBank]] = {}
    for name, mod in model.named_modules():
        m = _LAYER_RX.search(name)
        if m and isinstance(mod, ExpertBank):
            out[int(m.group(1))] = (name, mod)
    return dict(sorted(out.items()))


def min_slot_pool(model: nn.Module) -> int:
    """Smallest pool that can run any forward: one whole layer (a prefill or a 32-slot pass may touch all E)."""
    banks = expert_banks(model)
    return max((b.num_experts for _, b in banks.values()), default=0)


def manifest_from_model(model: nn.Module, policy: QuantPolicy | None = None) -> dict[str, Any]:
    """A planner manifest (cache manifest format, ``version`` 1) counted from a loaded model: its quantized banks
    and projections as stored, an unquantized bank's stacked weights as they are (before, such a bank was left
    out, and a model with none quantized planned as if it had no experts)."""
    tensors: dict[str, dict[str, Any]] = {}
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(mod, (QuantExpertBank, StreamedExpertBank)):
            lay = mod.layout
            gu = lay.gate_up_codes[1] + lay.gate_up_scales[1]
            e = lay.num_experts
            tensors[f"{prefix}gate_up_proj"] = {"shape": [e, *lay.gate_up_shape], "format": lay.fmt, "bytes": e * gu}
            tensors[f"{prefix}down_proj"] = {
                "shape": [e, *lay.down_shape],
                "format": lay.fmt,
                "bytes": e * (lay.nbytes - gu),
            }
        elif isinstance(mod, QuantLinear):
            nbytes = mod.codes.numel() * mod.codes.element_size() + mod.scales.numel() * 4
            tensors[f"{prefix}weight"] = {
                "shape": [mod.out_features, mod.in_features],
                "format": mod.fmt,
                "bytes": nbytes,
            }
            if mod.bias is not None:
                tensors[f"{prefix}bias"] = _plain_entry(mod.bias)
        elif isinstance(mod, DenseExpertBank) or not isinstance(mod, ExpertBank):
            for pname, p in mod.named_parameters(recurse=False):
                tensors[f"{prefix}{pname}"] = _plain_entry(p)
    return {
        "version": 1,
        "policy": policy.to_dict() if policy else {},
        "source": {"model": type(model).__name__},
        "tensors": tensors,
    }


def _plain_entry(t: Tensor) -> dict[str, Any]:
    return {"shape": list(t.shape), "format": format_of_torch_dtype(t.dtype), "bytes": t.numel() * t.element_size()}


class TensorSource(Protocol):
    """Where placement reads a tensor's values from: the model's own tensors (:class:`ModelSource`) or the
    quantized cache file (``engine.weights.quant_cache.CacheSource``). Names are the model's state-dict names."""

    def dtype_of(self, name: str) -> torch.dtype: ...

    def fill(self, name: str, dst: Tensor) -> None: ...


class ModelSource:
    """The current tensors of a model already in memory (tests, benchmarks): placement copies from them."""

    def __init__(self, model: nn.Module) -> None:
        self.tensors = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}

    def dtype_of(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def fill(self, name: str, dst: Tensor) -> None:
        dst.copy_(self.tensors[name].detach())


def _iter_tensors(module: nn.Module, skip: set[int]) -> Iterator[tuple[nn.Module, str, str, Tensor, bool]]:
    """(owner module, attr, full name, tensor, is_param) for every param/buffer outside the skipped modules."""
    for mod_name, mod in module.named_modules():
        if id(mod) in skip:
            continue
        prefix = f"{mod_name}." if mod_name else ""
        for pname, p in mod.named_parameters(recurse=False):
            yield mod, pname, prefix + pname, p, True
        for bname, b in mod.named_buffers(recurse=False):
            if b is not None:
                yield mod, bname, prefix + bname, b, False


def alloc_host_rows(shape: tuple[int, int], pin: bool, budget: PinBudget, layer: int) -> tuple[Tensor, bool]:
    """Host memory for one streamed layer's expert rows: page-locked when asked and allowed, else pageable."""
    if pin and budget.take(math.prod(shape)):
        try:
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True), True
        except RuntimeError as exc:  # pinning refused (driver cap, WSL) -> pageable + staging ring
            log.warning("layer %d: pinning %d MiB of experts failed (%s); using the staging ring", layer,
                        math.prod(shape) >> 20, exc)
    return torch.empty(shape, dtype=torch.uint8), False


def place_model(
    model: nn.Module,
    plan: Plan | SimplePlan,
    device: torch.device | str,
    source: TensorSource,
    *,
    pin: bool = True,
    pin_budget_bytes: int | None = None,
    staging_slots: int = 4,
    device_cap_bytes: int | None = None,
    prefetch: bool = True,
    host_embedding: bool = True,
    staging: bool | None = None,
    zero_copy: bool | None = None,
    device_pool: bool | None = None,
    expert_fetch: str = "pool",
    cpu_experts: list[str] | tuple[str, ...] | None = None,
) -> OffloadRuntime:
    """Place ``model`` exactly as ``plan`` says, reading every tensor once from ``source`` straight into its final
    place: the device (non-expert weights, resident experts, the slot pool), a host row store per streamed layer
    (page-locked on CUDA), or host RAM (the embedding table, kept in its stored dtype; only looked-up rows travel).

    ``model`` may be a skeleton on the meta device (loading from the quantized cache: nothing is in memory twice)
    or a model in memory (:func:`apply_plan`). Transactional: every tensor is created and filled first and the
    model is changed only when all succeeded, so an out-of-memory (real, or past ``device_cap_bytes``) leaves it as
    it was and raises :class:`OutOfMemory`. Never plans: the plan is placed as given.

    ``zero_copy``: AR steps read the streamed experts in place (:func:`set_zero_copy`); None: as ``expert_fetch``
    says ("zero_copy"), on CUDA only. ``device_pool``: AR steps fetch through device tables (:func:`set_device_pool`);
    None: as ``expert_fetch`` says ("device_tables"), on CUDA only. Not both. ``expert_fetch``: one of
    ``engine.settings.EXPERT_FETCH`` (``GpuPaths.expert_fetch``, what ``engine.api.Engine.load`` passes).
    ``cpu_experts``: the modes whose streamed experts run on the CPU where they lie (:func:`set_cpu_experts`);
    None: the plan's ``cpu_experts`` (none for a plan without the field)."""
    dev = torch.device(device)
    if not getattr(plan, "fits", True):
        raise PlanError(f"the plan does not fit: {getattr(plan, 'reason', '') or 'budget below the minimum'}")
    banks = expert_banks(model)
    streamed = tuple(sorted(int(i) for i in plan.streamed_expert_layers))
    unknown = [i for i in streamed if i not in banks]
    if unknown:
        raise PlanError(f"plan streams layers {unknown}, but the model has MoE layers {list(banks)}")
    resident = tuple(i for i in banks if i not in streamed)
    layouts = set()
    for i in streamed:
        bank = banks[i][1]
        if not isinstance(bank, RowExpertBank):  # NF4 / INT8 rows, or GGUF blocks (engine.weights.gguf.model)
            raise PlanError(
                f"layer {i}: only quantized expert banks can be streamed (got {type(bank).__name__}); "
                "load through the quantized cache"
            )
        layouts.add(bank.layout)
    if len(layouts) > 1:
        raise PlanError("streamed layers have different expert layouts; one slot pool needs one row size")
    slots = int(plan.slot_pool_experts) if streamed else 0
    need = min_slot_pool(model)
    if streamed and slots < need:
        raise PlanError(f"slot pool of {slots} experts is below the minimum {need} (one layer's experts)")

    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    host_embedding = host_embedding and not tied  # a tied table is also lm_head's weight: it lives on the device
    ledger = DeviceLedger(dev, device_cap_bytes)
    skip = {id(banks[i][1]) for i in streamed}
    placed: list[tuple[nn.Module, str, Tensor, bool]] = []
    host_keep = 0
    done: dict[int, Tensor] = {}  # tied parameters (lm_head = embed_tokens) are placed once
    for owner, attr, name, t, is_param in _iter_tensors(model, skip):
        if id(t) in done:
            placed.append((owner, attr, done[id(t)], is_param))
            continue
        if host_embedding and name.endswith(("embed_tokens.weight", "embed_tokens.raw")):  # raw: GGUF blocks
            new = torch.empty(tuple(t.shape), dtype=source.dtype_of(name))  # stored dtype: rows cast on lookup
            host_keep += new.numel() * new.element_size()
        else:
            kind = "resident_experts" if isinstance(owner, ExpertBank) else "non_expert"
            new = ledger.empty(kind, name, tuple(t.shape), t.dtype)
        source.fill(name, new)
        done[id(t)] = new
        placed.append((owner, attr, new, is_param))

    runtime_pool: SlotPool | None = None
    if streamed:
        runtime_pool = SlotPool(slots, next(iter(layouts)), dev, ledger)
    runtime = OffloadRuntime(dev, runtime_pool, ledger, prefetch)
    runtime.resident_layers, runtime.streamed_layers = resident, streamed
    if pin_budget_bytes is None and os.name == "nt":
        pin_budget_bytes = WINDOWS_PIN_BUDGET  # WDDM caps page-locked memory per process
    budget = PinBudget(pin_budget_bytes)
    for i in streamed:
        name, bank = banks[i]
        assert isinstance(bank, RowExpertBank)
        rows, pinned = alloc_host_rows(tuple(bank.packed.shape), pin and dev.type == "cuda", budget, i)
        source.fill(f"{name}.packed", rows)
        runtime.stores[i] = HostExpertStore(i, rows, pinned)
    unpinned = any(not st.pinned for st in runtime.stores.values())
    # pageable rows go through a pinned staging ring on CUDA (auto); ``staging=True`` forces it (CPU tests)
    if runtime_pool is not None and unpinned and (staging or (staging is None and dev.type == "cuda")):
        runtime_pool.staging = StagingRing(runtime_pool.layout.nbytes, max(staging_slots, 2), dev)

    # --- commit: nothing above touched the model ---
    for owner, attr, t, is_param in placed:
        if is_param:
            setattr(owner, attr, nn.Parameter(t, requires_grad=False))
        else:
            setattr(owner, attr, t)
    if tied and hasattr(model, "lm_head"):
        model.lm_head.weight = model.embed_tokens.weight
    new_banks: dict[int, StreamedExpertBank] = {}
    for i in streamed:
        name, bank = banks[i]
        sb = StreamedExpertBank(i, bank.layout, runtime.stores[i], runtime)  # type: ignore[arg-type]
        set_submodule(model, name, sb)
        new_banks[i] = sb
    for a, b in zip(streamed, streamed[1:]):
        router = _router_of(model, banks[b][0])
        if router is not None:
            new_banks[a].next_router = router
            new_banks[a].next_layer = b
    model._offload_runtime = runtime  # plain attribute (not a submodule)
    if expert_fetch not in EXPERT_FETCH:
        raise PlanError(f"expert_fetch {expert_fetch!r} is not one of {', '.join(EXPERT_FETCH)}")
    if zero_copy is None:
        zero_copy = dev.type == "cuda" and expert_fetch == "zero_copy"
    if device_pool is None:
        device_pool = dev.type == "cuda" and expert_fetch == "device_tables"
    if zero_copy and device_pool:
        raise PlanError("zero-copy reads and device slot tables exclude each other: choose one expert fetch")
    if zero_copy and streamed:
        set_zero_copy(model, True)
    if device_pool and streamed:
        set_device_pool(model, True)
    set_cpu_experts(model, getattr(plan, "cpu_experts", []) if cpu_experts is None else cpu_experts)
    log.info(
        "plan placed: %d resident, %d streamed layers, %d slots, %.1f MiB on %s (+%.1f MiB kept on host)",
        len(resident),
        len(streamed),
        slots,
        ledger.total / 2**20,
        dev,
        host_keep / 2**20,
    )
    return runtime


def apply_plan(model: nn.Module, plan: Plan | SimplePlan, device: torch.device | str = "cuda", **kwargs: Any) -> OffloadRuntime:
    """:func:`place_model` for a model already in memory (its tensors are the source). ``plan`` is a planner
    :class:`~engine.placement.planner.Plan` or a :class:`SimplePlan`; this function never plans."""
    if isinstance(plan, (int, float)):
        raise PlanError("apply_plan places a plan; make one with engine.placement.planner.plan_model")
    kwargs.setdefault("host_embedding", False)
    return place_model(model, plan, device, ModelSource(model), **kwargs)


def set_zero_copy(model: nn.Module, on: bool) -> dict[int, str]:
    """Turn zero-copy reads of streamed experts on or off for ``model``'s AR steps (see the module); returns
    {layer: why not} for the streamed layers whose rows could not be mapped (they keep fetching into the pool).
    Graphs recorded before (CUDA graphs of ``engine.kernels.step_graphs``) are dropped: where the experts are read changed."""
    rt = runtime_of(model)
    if rt is None:
        raise PlanError("zero-copy reads need a placed model (engine.placement.offload.place_model / apply_plan)")
    if on and rt.tables is not None:
        raise PlanError("zero-copy reads and device slot tables exclude each other: turn the device tables off first")
    if on:
        for i, (_, bank) in expert_banks(model).items():
            if isinstance(bank, StreamedExpertBank) and bank.in_place is None and i not in rt.zero_copy_refused:
                bank.in_place, why = in_place_view(bank.store.rows, rt.device)
                if bank.in_place is None:
                    rt.zero_copy_refused[i] = why
        if rt.zero_copy_refused:
            log.warning("zero-copy: %d streamed layer(s) keep fetching through the pool: %s",
                        len(rt.zero_copy_refused), next(iter(rt.zero_copy_refused.values())))
    if rt.zero_copy != on:
        rt.zero_copy = on
        forget = getattr(getattr(model, "step_graph", None), "forget", None)
        if callable(forget):
            forget()
    return dict(rt.zero_copy_refused)


def set_cpu_experts(model: nn.Module, modes: list[str] | tuple[str, ...] | frozenset[str]) -> None:
    """The modes ("ar": AR steps, "pass": diffusion block passes; engine.placement.planner.CPU_EXPERT_MODES) in which
    ``model``'s streamed layers compute their experts on the CPU from the host rows instead of fetching them into
    the pool (:meth:`StreamedExpertBank.computes_on_host`). Graphs recorded before are dropped."""
    rt = runtime_of(model)
    if rt is None:
        raise PlanError("CPU experts need a placed model (engine.placement.offload.place_model / apply_plan)")
    wanted = frozenset(modes)
    unknown = sorted(wanted - set(CPU_EXPERT_MODES))
    if unknown:
        raise PlanError(f"cpu_experts {', '.join(unknown)} unknown: the modes are {', '.join(CPU_EXPERT_MODES)}")
    if rt.cpu_experts != wanted:
        rt.cpu_experts = wanted
        forget = getattr(getattr(model, "step_graph", None), "forget", None)
        if callable(forget):
            forget()


def set_device_pool(model: nn.Module, on: bool) -> str:
    """Turn device slot tables on or off for ``model``'s AR steps (``engine.placement.device_pool``); returns why they were
    refused ("" when on, or off). Refused (and left off, with a warning) when a streamed layer's rows cannot be
    mapped into the device's address space, the pool is under 2 x top-k slots, or Triton is missing on CUDA.
    Turning them off reads the tables back first. Recorded CUDA graphs are dropped."""
    rt = runtime_of(model)
    if rt is None:
        raise PlanError("device slot tables need a placed model (engine.placement.offload.place_model / apply_plan)")
    if on and rt.zero_copy:
        raise PlanError("device slot tables and zero-copy reads exclude each other: turn zero-copy off first")
    changed = on != (rt.tables is not None)
    if on and rt.tables is None:
        top_k = int(model.config.num_experts_per_tok)  # type: ignore[union-attr]
        why = DeviceSlotTables.refusal(rt.pool, top_k, rt.device)
        sources: dict[int, Tensor] = {}
        banks = expert_banks(model)
        for i in rt.streamed_layers:
            if why:
                break
            bank = banks[i][1]
            assert isinstance(bank, StreamedExpertBank)
            view, reason = (bank.in_place, "") if bank.in_place is not None else in_place_view(bank.store.rows, rt.device)
            if view is None:
                why = f"layer {i}: {reason}"
            else:
                sources[i] = view
        if why:
            rt.device_pool_refused = why
            log.warning("device slot tables refused (AR steps keep fetching on the host): %s", why)
            return why
        rt.tables = DeviceSlotTables(rt.pool, rt.streamed_layers, sources, banks[rt.streamed_layers[0]][1].num_experts,
                                     top_k)
        rt.device_pool_refused = ""
    elif not on and rt.tables is not None:
        if rt.tables.on_device:
            rt.tables_to_host()
        rt.tables = None
    if changed:
        forget = getattr(getattr(model, "step_graph", None), "forget", None)
        if callable(forget):
            forget()
    return ""


def _router_of(model: nn.Module, experts_name: str) -> nn.Module | None:
    name = experts_name.rsplit(".", 1)[0] + ".gate"
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def runtime_of(model: nn.Module) -> OffloadRuntime | None:
    rt = getattr(model, "_offload_runtime", None)
    return rt if isinstance(rt, OffloadRuntime) else None


@contextlib.contextmanager
def uncounted_passes(model: nn.Module) -> Iterator[None]:
    """Forwards run inside are not passes of the request (engine.kernels.step_graphs' warm-up runs before a recording): the
    pass counters, and with them the block's pass number that decides prefetching (``wants_prefetch``), stay as
    they were. Their copies and slot look-ups happened and stay counted."""
    rt = runtime_of(model)
    if rt is None:
        yield
        return
    passes, block_passes = rt.stats.passes, rt.block_passes
    tables = rt.tables
    device_passes = tables.counts[COUNTS.index("passes")].clone() if tables is not None else None
    try:
        yield
    finally:
        rt.stats.passes, rt.block_passes = passes, block_passes
        if tables is not None and device_passes is not None:
            tables.counts[COUNTS.index("passes")] = device_passes


def accounting(model: nn.Module) -> dict[str, Any]:
    """Streaming statistics for ``Finished.accounting`` ({} when no plan was applied)."""
    rt = runtime_of(model)
    return rt.accounting() if rt is not None else {}


def begin_block(model: nn.Module) -> None:
    """The generation loop calls this before a diffusion block's first pass."""
    rt = runtime_of(model)
    if rt is not None:
        rt.begin_block()


def end_block(model: nn.Module) -> None:
    """...and this after the block's commit pass: the block's expert pins are released."""
    rt = runtime_of(model)
    if rt is not None:
        rt.end_block()
def device_bytes(model: nn.Module, device: torch.device | str) -> int:
    """Bytes of the model's parameters, buffers and slot pool that live on ``device`` (distinct storages)."""
    dev = torch.device(device)
    seen: set[int] = set()
    total = 0
    tensors: list[Tensor] = [t for t in model.parameters()] + [b for b in model.buffers()]
    rt = runtime_of(model)
    if rt is not None and rt.pool is not None:
        tensors.append(rt.pool.buf)
    for t in tensors:
        if t.device.type != dev.type:
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total


__all__ = [
    "OutOfMemory",
    "SimplePlan",
    "DeviceLedger",
    "HostExpertStore",
    "SlotPool",
    "StreamedExpertBank",
    "OffloadRuntime",
    "apply_plan",
    "accounting",
    "begin_block",
    "end_block",
    "runtime_of",
    "min_slot_pool",
    "manifest_from_model",
    "expert_banks",
    "device_bytes",
    "place_model",
    "set_device_pool",
    "set_zero_copy",
    "ModelSource",
    "TensorSource",
]
