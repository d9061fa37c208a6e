"""The offload state of one placed model (:class:`OffloadRuntime`: pool, host stores, ledger, device tables, block
state, statistics) and the hooks the generation loop calls on a model: block boundaries, uncounted warm-up passes,
accounting.

Accounting (``accounting(model)``) is a JSON-safe dict for ``Finished.accounting``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from clover_desk.engine.placement.device_pool import COUNTS, DeviceSlotTables
from clover_desk.engine.placement.expert_store import HostExpertStore
from clover_desk.engine.placement.slot_pool import DeviceLedger, SlotPool, Stats

log = logging.getLogger(__name__)


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
