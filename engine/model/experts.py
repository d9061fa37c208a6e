"""Expert seam: the routed experts of one MoE layer, behind one small interface.

The MoE layer (``engine.model.clover.SparseMoe``) computes the router, the optional block coreset and top-k, then, for a
bank that streams its experts (``needs_prepare``), calls ``bank.prepare_for(x, topk_idx)`` (one host read of the
experts this forward uses), and ``bank(x, topk_idx, topk_w)``.
Quantized and streamed banks (``engine/placement/offload.py``, ``engine/weights/quant.py``) replace ``layer.mlp.experts`` with the
same interface.

Compute (:func:`moe_grouped`, used by every bank): the (token, slot) pairs are sorted by expert and each group of
used experts runs as one batched SwiGLU: ``torch._grouped_mm`` where torch has its fused kernel (bf16 on
H100/H200-class GPUs, see :func:`grouped_mm_supported`; resident dense weights then need no gather and no group
loop at all), else a zero-padded ``torch.bmm`` over [G, C, D]. Groups hold up to 16 experts on CUDA (a 32-token
pass over ~70 experts: 5 iterations, not 70) and one on CPU (see ``GROUP_BYTES``). An AR step (N <= ``SMALL_SLOTS``
pairs) skips the grouping: it gathers one expert per pair and needs no host sync. The slow per-expert loop is kept
as :func:`routed_reference` for the tests and the benchmark.

Letters: T tokens, K experts per token (top-k), E experts, D hidden size, I expert intermediate size,
N = T*K routed (token, slot) pairs, U experts used by this forward, G experts in one group (chunk) of them,
C rows per expert after padding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

SMALL_SLOTS = 8  # N at or below which each pair gathers its own expert (an AR step: 1 token, top-8): no sort, no sync
# Bytes of expert weights gathered (dense) or dequantized (quantized banks) at once: bounds the transient.
# CUDA: 96 MiB = 16 experts of 35B-A3B in bf16 (the per-expert loop kept 1-2 alive), so a 32-token pass over ~70
# experts is 5 groups, not 70 experts' worth of small kernels. CPU: 2 MiB, about what stays in a core's L2. A CPU
# has little launch overhead to amortize, and big groups cost there (bench speed --moe-only, float32, 2 cores): a
# gather copies the weights, 3x the memory traffic of the matmuls (dense T=1: 23 ms vs 6.6 ms in place), blocks
# over 32 MiB get fresh mmap pages from glibc on every call (page faults), and padding wastes rows; so 35B-A3B's
# experts (6 MiB in fp32) run one per group, read in place, while small experts (a few hundred KiB: the tiny and
# deep-narrow shapes) share a group: an AR step over 8 of them is 2 matmuls instead of 16 (deep-narrow: 9,685 ops
# per token -> 5,965). Dense and quantized banks group alike, so a quantized bank equals a dense bank holding
# its dequantized weights bit for bit.
GROUP_BYTES = {"cuda": 96 * 2**20, "cpu": 2 * 2**20}
# Under torch.compile a pass gathers one expert per (token, slot) pair (static shapes, no host sync: one graph) when
# those copies stay below this; larger passes take the grouped path, whose data-dependent group sizes break the graph.
COMPILED_PAIRWISE_BYTES = 64 * 2**20

# expert ids [G] (long, on the compute device) -> (gate_up [G, 2I, D], down [G, D, I]) in the compute dtype
WeightsFn = Callable[[Tensor], tuple[Tensor, Tensor]]


class ExpertBank(nn.Module):
    """Base class. Subclasses implement :meth:`forward`; :meth:`prepare` is an optional hook."""

    num_experts: int
    needs_prepare = False  # True: the MoE layer calls prepare() first (it costs a host sync: only streamed banks)

    def prepare_for(self, x: Tensor, topk_idx: Tensor) -> None:
        """Called by the MoE layer right before :meth:`forward`, when :attr:`needs_prepare`, with that forward's
        input x [T, D] and routing [T, K]: finds the experts it touches with one host read (a fixed-size presence
        mask: no ``torch.unique``, whose output size is itself a sync on a GPU) and calls :meth:`prepare`."""
        self.prepare(present(topk_idx, self.num_experts).cpu().nonzero().flatten())

    def prepare(self, expert_ids: Tensor) -> None:
        """Called by :meth:`prepare_for` with the sorted distinct expert ids (a CPU LongTensor) this forward will
        touch, so a streaming bank can fetch them."""

    def fetches(self, pairs: int) -> bool:
        """Whether a forward over ``pairs`` (token, expert) pairs calls :meth:`prepare_for` first: a streamed bank
        does unless it reads those pairs' experts in place (``engine.placement.streamed_bank``)."""
        return self.needs_prepare

    def sync_free(self, pairs: int, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether :meth:`forward` over ``pairs`` (token, slot) pairs of ``dtype`` activations on ``device`` reads
        nothing on the host, so that a CUDA graph can record it (``engine.kernels.step_graphs``). False unless a subclass
        knows better."""
        return False

    def forward(self, x: Tensor, topk_idx: Tensor, topk_w: Tensor) -> Tensor:  # pragma: no cover - interface
        """x [T, D], topk_idx [T, K] (long), topk_w [T, K] (float) -> [T, D] in x's dtype."""
        raise NotImplementedError


def present(ids: Tensor, num_experts: int) -> Tensor:
    """[E] bool on ids' device: which experts ``ids`` (any shape, long) name. No host read."""
    return torch.zeros(num_experts, dtype=torch.bool, device=ids.device).index_fill_(0, ids.reshape(-1), True)


def group_by_expert(topk_idx: Tensor, num_experts: int) -> tuple[Tensor, Tensor, list[int], list[int]]:
    """Sort the N = T*K (token, slot) pairs by expert.

    Returns ``order`` [N] (flat pair index, sorted by expert, stable), ``token`` [N] (the token of each sorted
    pair), and two Python lists ``experts`` / ``counts`` for the experts actually used (one host sync here:
    the per-expert segment lengths are data-dependent).
    """
    k = topk_idx.shape[-1]
    flat = topk_idx.reshape(-1)  # [N]
    order = torch.argsort(flat, stable=True)  # [N]
    token = torch.div(order, k, rounding_mode="floor")  # [N]
    counts_all = torch.bincount(flat, minlength=num_experts).cpu()  # [E] host copy: the one sync
    used = counts_all.nonzero().flatten()  # only the experts in use, no loop over all E
    return order, token, used.tolist(), counts_all[used].tolist()


class DenseExpertBank(ExpertBank):
    """All experts resident as two fused tensors, names as in the checkpoint.

    ``gate_up_proj`` [E, 2I, D]: rows 0..I-1 are the gate projection, rows I..2I-1 the up projection.
    ``down_proj`` [E, D, I].
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,  # None: the current default device (meta inside a skeleton)
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device),
            requires_grad=False,
        )

    def expert_forward(self, e: int, xs: Tensor) -> Tensor:
        """One expert's SwiGLU MLP on its tokens: xs [n, D] -> [n, D] (the reference loop's step)."""
        gate, up = F.linear(xs, self.gate_up_proj[e]).chunk(2, dim=-1)  # [n, I] each
        return F.linear(F.silu(gate) * up, self.down_proj[e])  # [n, D]

    def gather(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """ids [G] long -> those experts' (gate_up [G, 2I, D], down [G, D, I]): copies, or views for one expert
        whose id is on the CPU (reading it there is no host sync)."""
        if ids.numel() == 1 and ids.device.type == "cpu" and not torch.compiler.is_compiling():
            e = int(ids)  # reading a CPU id is no device sync, but a compiled graph would break on it
            return self.gate_up_proj[e : e + 1], self.down_proj[e : e + 1]  # [1, 2I, D], [1, D, I] views
        return self.gate_up_proj.index_select(0, ids), self.down_proj.index_select(0, ids)

    def sync_free(self, pairs: int, device: torch.device, dtype: torch.dtype) -> bool:
        """Few pairs gather one expert each; more need ``torch._grouped_mm``'s fused kernel (see
        :func:`moe_grouped`)."""
        return pairs <= SMALL_SLOTS or grouped_mm_supported(device, dtype)

    def forward(self, x: Tensor, topk_idx: Tensor, topk_w: Tensor) -> Tensor:
        # on CPU, groups of one expert (GROUP_BYTES): gather() then returns views, the weights are read in place
        return moe_grouped(
            x, topk_idx, topk_w, self.num_experts, self.gather, 3 * self.intermediate_size,
            resident=(self.gate_up_proj, self.down_proj),
        )


def combine_by_token(ys: Tensor, order: Tensor, topk_w: Tensor) -> Tensor:
    """Weighted sum of the expert outputs per token, deterministic (no atomics), accumulated in fp32.

    ys [N, D] expert outputs in sorted (expert) order, order [N] from :func:`group_by_expert`, topk_w [T, K].
    Returns [T, D] in ys's dtype.
    """
    t, k = topk_w.shape
    unsorted = torch.empty(ys.shape, dtype=torch.float32, device=ys.device)  # [N, D] back in (token, slot) order
    unsorted[order] = ys.to(torch.float32)
    out = (unsorted.view(t, k, -1) * topk_w.to(torch.float32)[:, :, None]).sum(1)  # [T, D]
    return out.to(ys.dtype)


def routed_reference(bank: DenseExpertBank, x: Tensor, topk_idx: Tensor, topk_w: Tensor) -> Tensor:
    """The slow reference: a Python loop over the used experts, one small SwiGLU each (what the dense bank did
    before :func:`moe_grouped`). Tests and ``bench speed --moe-only`` compare against it."""
    order, token, experts, counts = group_by_expert(topk_idx, bank.num_experts)
    xs = x[token]  # [N, D] token rows in expert order
    ys = torch.empty_like(xs)  # [N, D]
    start = 0
    for e, n in zip(experts, counts):
        ys[start : start + n] = bank.expert_forward(e, xs[start : start + n])
        start += n
    return combine_by_token(ys, order, topk_w)


# ---------------------------------------------------------------------------------------------------------------
# Grouped compute
# ---------------------------------------------------------------------------------------------------------------

_GROUPED_MM_OK: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` (a private op) has its fused kernel here and agrees with plain matmuls,
    including an empty group. Probed once per (device type, dtype).

    torch 2.13 runs the fused kernel only for bf16 on compute capability 9.x / 10.x (H100/H200, B200; see
    ``_grouped_mm_cuda`` in aten/src/ATen/native/cuda/GroupedBlas.cpp). Everywhere else, 16 GB consumer cards
    included (8.6, 8.9, 12.0), it falls back to copying the offsets to the host (a sync) and one mm per group,
    empty groups included, which is worse than a padded bmm; on CPU that fallback is slower than bmm too."""
    key = (device.type, dtype)
    if key not in _GROUPED_MM_OK:
        ok = False
        fused = (
            device.type == "cuda"
            and dtype == torch.bfloat16
            and hasattr(torch, "_grouped_mm")
            and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] in (9, 10)
        )
        if fused:
            gen = torch.Generator().manual_seed(0)
            a = torch.randn(24, 64, generator=gen).to(device=device, dtype=dtype)  # [N, D]
            b = torch.randn(3, 32, 64, generator=gen).to(device=device, dtype=dtype)  # [G, O, D] like gate_up
            offs = torch.tensor([8, 8, 24], dtype=torch.int32, device=device)  # group 1 is empty
            try:
                got = torch._grouped_mm(a, b.transpose(-2, -1), offs=offs).float()  # [N, O]
                want = torch.cat([a[:8].float() @ b[0].float().T, a[8:].float() @ b[2].float().T])
                ok = bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2))
            except (RuntimeError, TypeError, NotImplementedError) as exc:
                log.info("torch._grouped_mm failed on %s %s (%s): padded bmm", device, dtype, exc)
        _GROUPED_MM_OK[key] = ok
        log.info("grouped expert matmul on %s %s: %s", device.type, dtype, "torch._grouped_mm" if ok else "torch.bmm")
    return _GROUPED_MM_OK[key]


def swiglu_grouped_mm(xs: Tensor, offs: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """xs [N, D] sorted by group, offs [G] int32 (end row of each group), gate_up [G, 2I, D], down [G, D, I]
    -> [N, D]. Rows past offs[-1] are not computed."""
    h = torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs)  # [N, 2I]
    gate, up = h.chunk(2, dim=-1)  # [N, I] each
    return torch._grouped_mm((F.silu(gate) * up).contiguous(), down.transpose(-2, -1), offs=offs)  # [N, D]


def swiglu_batched(xp: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """xp [G, C, D] (C rows per expert, zero padded), gate_up [G, 2I, D], down [G, D, I] -> [G, C, D]."""
    gate, up = torch.bmm(xp, gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [G, C, I] each
    return torch.bmm(F.silu(gate) * up, down.transpose(1, 2))  # [G, C, D]


def _h2d(t: Tensor, device: torch.device) -> Tensor:
    """A small host tensor on ``device`` without a stream sync: CUDA stages a pageable source before the call
    returns, so ``non_blocking`` is safe here and skips the synchronize of a blocking copy."""
    return t.to(device, non_blocking=True)


def sort_by_expert(topk_idx: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Like :func:`group_by_expert` without the host sync: ``order`` [N], ``token`` [N] and ``counts`` [E] (long,
    on the device)."""
    k = topk_idx.shape[-1]
    flat = topk_idx.reshape(-1)  # [N]
    order = torch.argsort(flat, stable=True)  # [N]
    token = torch.div(order, k, rounding_mode="floor")  # [N]
    return order, token, torch.bincount(flat, minlength=num_experts)


def moe_grouped(
    x: Tensor,
    topk_idx: Tensor,
    topk_w: Tensor,
    num_experts: int,
    weights: WeightsFn,
    intermediate3: int,
    resident: tuple[Tensor, Tensor] | None = None,
    group_experts: int | None = None,
    compiled_pairwise: bool = True,
) -> Tensor:
    """Routed-expert SwiGLU of every bank, without a Python loop over experts. x [T, D], topk_idx / topk_w [T, K]
    -> [T, D] in x's dtype (weighted sum over the K slots in fp32, :func:`combine_by_token`).

    ``weights(ids)`` returns the weights of experts ``ids`` in x's dtype (a gather, or a gather + dequantize);
    ``intermediate3`` = 3I (one expert holds 3I x D weights) sizes the groups; ``group_experts`` overrides them
    (tests). ``compiled_pairwise``: whether a compiled pass over more than ``SMALL_SLOTS`` pairs may gather one
    expert per pair (see ``COMPILED_PAIRWISE_BYTES``): right where ``weights`` gathers stored weights, wrong where
    it dequantizes them, since each pair would then dequantize its own copy: a 32-slot block pass (256 pairs over
    a block's coreset of a few dozen experts) dequantized 256. Measured, deep-narrow shape at 8 layers with NF4
    experts, 4 streamed (bench speed --quant card --stream 4 --compile): compiled passes x0.39 of eager with the
    per-pair copies, x1.32 with the grouped path (one host read per bank, as eager).
    ``resident`` = (gate_up [E, 2I, D], down [E, D, I]) when all experts already exist in x's dtype, so
    that ``torch._grouped_mm`` can read them in place (no copy, no host sync).

    Host syncs: none for N <= ``SMALL_SLOTS`` or with ``resident`` + grouped mm; otherwise one (the per-expert
    counts, which size the groups).
    """
    t, k = topk_idx.shape
    n = t * k
    if group_experts is None:
        budget = GROUP_BYTES.get(x.device.type, 0)
        group_experts = max(1, budget // (intermediate3 * x.shape[1] * x.element_size()))
    if resident is not None and grouped_mm_supported(x.device, x.dtype):
        order, token, counts = sort_by_expert(topk_idx, num_experts)
        offs = counts.cumsum(0).to(torch.int32)  # [E] end row of each expert's (possibly empty) group
        ys = swiglu_grouped_mm(x[token], offs, *resident)  # [N, D]
        return combine_by_token(ys, order, topk_w)
    pairwise = n <= SMALL_SLOTS or (
        compiled_pairwise and torch.compiler.is_compiling() and n * intermediate3 * x.shape[1] * x.element_size() <= COMPILED_PAIRWISE_BYTES
    )
    if pairwise:  # one expert per (token, slot) pair: no host sync
        flat = topk_idx.reshape(-1)  # [N]
        xp = x[:, None, :].expand(t, k, x.shape[1]).reshape(n, 1, -1)  # [N, 1, D] token row of each pair
        if n > SMALL_SLOTS:  # (compiled passes only) pairs of one expert next to each other: its weights are read
            # once from memory and then from cache; measured on the deep-narrow 32-slot pass, 14.5 -> 19.9 passes/s
            order = torch.argsort(flat, stable=True)  # [N]
            flat, xp = flat[order], xp[order]
            ys = swiglu_batched(xp, *weights(flat))[:, 0, :]  # [N, D] in expert order
            return combine_by_token(ys, order, topk_w)
        parts = []
        for p0 in range(0, n, group_experts):  # one group on a GPU; CPU: see GROUP_BYTES
            gate_up, down = weights(flat[p0 : p0 + group_experts])  # [G, 2I, D], [G, D, I]
            parts.append(swiglu_batched(xp[p0 : p0 + group_experts], gate_up, down)[:, 0, :])  # [G, D]
            del gate_up, down  # freed before the next group is made (one group's weights at a time)
        ys = torch.cat(parts) if len(parts) > 1 else parts[0]  # [N, D]
        return combine_by_token(ys, torch.arange(n, device=x.device), topk_w)

    return _moe_sorted(x, topk_idx, topk_w, num_experts, weights, group_experts)


@torch.compiler.disable
def _moe_sorted(
    x: Tensor, topk_idx: Tensor, topk_w: Tensor, num_experts: int, weights: WeightsFn, group_experts: int
) -> Tensor:
    """Many pairs (a prefill, or a pass too big for the pairwise gather): group by expert, sized on the host.
    Never traced (``torch.compiler.disable``): its Python depends on the routing (group sizes, how many experts are
    used), which would make a compiled layer recompile for every prefill; a compiled layer calls it eagerly."""
    order, token, counts = sort_by_expert(topk_idx, num_experts)
    counts_host = counts.cpu()  # [E] the one host sync: group sizes are data-dependent
    used = counts_host.nonzero().flatten()  # [U] sorted expert ids
    sizes = counts_host[used].tolist()  # rows of each used expert
    u = len(sizes)
    bounds = [(g0, min(g0 + group_experts, u)) for g0 in range(0, u, group_experts)]  # ceil(U / G) groups
    first_row = [0]
    for c in sizes:
        first_row.append(first_row[-1] + c)
    grouped = grouped_mm_supported(x.device, x.dtype)
    # Per-row index data for every group, built on the host and copied once (no per-group small copies):
    # grouped mm: each group's end offsets; padded bmm: each row's slot in its group's zero-padded [G*C] layout.
    caps = [max(sizes[g0:g1]) for g0, g1 in bounds]  # C per group
    index: Tensor | None = None
    if grouped:
        ends = [first_row[j + 1] - first_row[g0] for g0, g1 in bounds for j in range(g0, g1)]
        index = torch.tensor(ends, dtype=torch.int32)  # [U] end row of each expert inside its group
    elif group_experts > 1:
        sizes_t = torch.tensor(sizes)  # [U]
        expert_of = torch.repeat_interleave(torch.arange(u), sizes_t)  # [N] used-expert number of each row
        rank = torch.arange(len(expert_of)) - (torch.tensor(first_row[:-1]))[expert_of]  # [N] rank in its expert
        slot = torch.arange(u) % group_experts  # [U] place of each expert in its group
        cap = torch.tensor(caps).repeat_interleave(torch.tensor([g1 - g0 for g0, g1 in bounds]))  # [U] its group's C
        index = (slot * cap)[expert_of] + rank  # [N] row of each pair in its group's [G*C] padded layout
    index_dev = _h2d(index, x.device) if index is not None else None
    used_dev = _h2d(used, x.device)  # [U]
    xs = x[token]  # [N, D] token rows in expert order
    ys = torch.empty_like(xs)  # [N, D]
    for gi, (g0, g1) in enumerate(bounds):
        r0, r1 = first_row[g0], first_row[g1]
        gate_up, down = weights(used_dev[g0:g1])  # [G, 2I, D], [G, D, I]
        part = xs[r0:r1]  # [R, D] this group's pairs, expert by expert
        if g1 - g0 == 1 and not grouped:
            ys[r0:r1] = swiglu_batched(part[None], gate_up, down)[0]
        elif grouped:
            assert index_dev is not None
            ys[r0:r1] = swiglu_grouped_mm(part, index_dev[g0:g1], gate_up, down)
        else:
            assert index_dev is not None
            g, c = g1 - g0, caps[gi]
            pos = index_dev[r0:r1]  # [R]
            xp = x.new_zeros(g * c, x.shape[1])  # [G*C, D]
            xp[pos] = part
            yp = swiglu_batched(xp.view(g, c, -1), gate_up, down)  # [G, C, D]
            ys[r0:r1] = yp.view(g * c, -1)[pos]
        # Freed before the next group's weights are made: the caching allocator then hands the same block back, so a
        # pass holds one group's dequantized weights at a time, not two (bench speed --count: the scratch line)
        del gate_up, down
    return combine_by_token(ys, order, topk_w)


class RowLayout(Protocol):
    """What the expert offload (``engine.placement.streamed_bank``) and ``engine.weights.quant.routed_forward`` need of a
    row layout: one contiguous byte row of ``nbytes`` per expert, and the dequantize of a group of rows for the
    compute. ``engine.weights.quant.ExpertLayout`` (NF4 / INT8 rows) and ``engine.weights.gguf.model.GGUFExpertLayout``
    (GGUF blocks as the file stores them) are two."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    fmt: str

    @property
    def nbytes(self) -> int: ...

    def unpack_rows(self, source: Tensor, rows: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]: ...
