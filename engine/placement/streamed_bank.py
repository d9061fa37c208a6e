"""The expert bank of a streamed layer: its experts live in host memory and reach the compute by one of four
paths, chosen per forward.

Pool fetch (the default): one host read per streamed layer and forward (``StreamedExpertBank.prepare_for``): the
experts it touches and the prefetch guess come back together as one presence mask, and the experts are copied into
the device slot pool (``engine.placement.slot_pool``). Prefetch: the next streamed layer's router is applied to
this layer's input (a speculative guess, as in mixtral-offloading), and its top-k experts are copied into free or
unpinned slots as soon as this layer's own copies are issued (``ready``), so they overlap this layer's compute.
Under CUDA graphs (``engine.kernels.step_graphs``) only that fetch runs eagerly: the compute reads a fixed slot table.

Zero-copy (``engine.placement.placer.set_zero_copy``): a forward of at most :data:`ZERO_COPY_PAIRS` (token, expert)
pairs, an AR step, reads its streamed experts where they lie. On CUDA the page-locked rows are mapped into the
device's address space (``engine.placement.expert_store.in_place_view``), so the routed compute gathers its k rows
over PCIe itself: no fetch, no host read, no pool slot, and the step is one CUDA graph. Each step then reads all its
streamed experts over PCIe (the pool's hits are lost), against a host read and a copy per streamed layer;
``bench speed --moe-only`` times both on a GPU, which decides. Block passes always go through the pool, whose slots
their passes share.

Device tables (``engine.placement.placer.set_device_pool``): AR steps keep the pool, its hits and its prefetch, but
do its bookkeeping on the device (``engine.placement.device_pool``): no host read, and the step is one CUDA graph.
A prompt or block pass reads the tables back first. Exclusive with zero-copy.

CPU experts (the plan's ``cpu_experts``, chosen per mode by the planner's speed model, as llama.cpp's
``--n-cpu-moe`` keeps some layers' experts on the CPU): in the modes named ("ar": AR steps, "pass": a block's
passes) a streamed layer computes its routed experts on the CPU from its host rows (``engine.kernels.cpu_quant``),
sending only the layer's input and output across; no fetch, no pool slot. Prompts always stream.

Numbers never depend on the path or the plan: resident and streamed banks run the same
``engine.weights.quant.routed_forward`` on the same bytes.

Letters: E experts, R row bytes per expert, T tokens, K top-k, D hidden size.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from clover_desk.engine.model.experts import SMALL_SLOTS, ExpertBank, present
from clover_desk.engine.placement.expert_store import HostExpertStore
from clover_desk.engine.placement.offload_runtime import OffloadRuntime
from clover_desk.engine.weights.quant import RowLayout, routed_forward, rows_sync_free

# A forward with at most this many (token, expert) pairs reads streamed experts in place when zero-copy is on: an AR
# step's top-8. Its compute gathers one row per pair (engine.model.experts.SMALL_SLOTS), so it needs no sort and no sync.
ZERO_COPY_PAIRS = SMALL_SLOTS


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
