"""Fused mixture-of-experts kernels in Triton: the routed experts of a forward computed straight from the packed
expert rows, never materialising a dequantized weight, for NF4 rows (``engine.weights.quant.ExpertLayout``) and for GGUF
rows (``engine.weights.gguf.model.GGUFExpertLayout``: the file's ggml blocks, Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K / F16 / BF16 /
F32, each of gate, up and down in its own type).

Two kernels per format, one program per (token, expert) pair and output tile:

1. gate/up: ``h[p, i] = silu(x[t] · gate[e, i]) * (x[t] · up[e, i])`` over the hidden size in ``BLOCK_D`` chunks, the
   weights decoded in registers: NF4 codes (high nibble first, the 16-value code book, the fp32 block absmax), or
   each GGUF element from its block (its scales, its nibbles / bytes; the type is a compile-time branch);
2. down: ``out[p, n] = w[p] * (h[p] · down[e, n])``, then the K pairs of each token are summed (in torch, in a fixed
   order: deterministic, unlike atomics).

Each pair reads its expert's row from ``pool`` [S, nbytes] at the row ``rows[p]``, a device-side table (the bank's
own rows for a resident bank, the slot of each expert for the streamed slot pool): no host read, no group sizes.
This is the GEMV shape (one token per program): exactly what an AR step needs. From ``GROUPED_MIN_PAIRS`` pairs (a
32-slot pass has 256) the grouped kernels run instead, in the manner of vLLM's fused MoE: the pairs sorted by pool
row on the device (:func:`group_pairs`: no host read, the grid bounded by the shapes), each row's pairs padded to
blocks of ``BLOCK_M``, and one program per (block, output tile) decoding the expert's weight tile once for its block
and multiplying with ``tl.dot`` (tensor cores on a GPU; fp32 activations use IEEE products). The GEMV kernels
re-read an expert's bytes once per pair; the grouped ones once per block of up to 16 pairs.

Status: written and tested on the CPU with ``TRITON_INTERPRET=1`` (``tests/engine/test_triton_moe.py``,
``tests/engine/test_triton_moe_gguf.py``: both variants equal to the dequantize-then-matmul reference within float32
rounding, and the
GGUF element decode equal to ``engine.weights.gguf.quants.dequantize`` bit for bit); **not yet measured on a GPU**, so
nothing selects it by default: :func:`routed_forward <engine.weights.quant.routed_forward>` uses it (:func:`fused_moe`) on
CUDA only when the engine's settings turn it on (``engine.settings.GpuPaths.fused_moe``, the switch
``CLOVER_DESK_FUSED_MOE=1``; :func:`set_enabled`), and ``clover-desk bench speed --moe-only`` on CUDA times the NF4 one
next to the dequantize-then-matmul path (``scripts/gpu_check.sh``; nothing times the GGUF one yet). On a GPU the
GGUF decode may differ from ``gguf_quants.dequantize`` in the last bit where the compiler fuses a multiply-add.
Triton is not a dependency of the CPU install (CUDA builds of torch bring it).

Letters: T tokens, K experts per token, P = T*K (token, expert) pairs, S pool rows, D hidden, I expert intermediate.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from clover_desk.engine.kernels.triton_linear import available  # one Triton check for both kernel modules
from clover_desk.engine.model.experts import RowLayout
from clover_desk.engine.weights.formats import NF4_CODE

BLOCK_I = 32  # intermediate rows per gate/up program
BLOCK_D = 64  # hidden columns per step of the gate/up reduction
BLOCK_N = 32  # hidden rows per down program
BLOCK_K = 64  # intermediate columns per step of the down reduction
BLOCK_M = 16  # pairs per block of the grouped kernels (tl.dot's smallest tile)
GROUPED_MIN_PAIRS = 64  # (token, expert) pairs from which the grouped kernels run (a 32-slot pass: 256; AR: 8)
# Warps per program. Grouped: 8, because at 4 the NF4 grouped gate/up kernel spills registers in bf16 under Triton
# 3.6 (255 registers and 72 B of stack for sm_89; the H200 test machine's Triton), where 8 warps need 194 and no
# stack (tests/triton_aot.py compiles it without a GPU). Triton 3.9 needs 200 at 4 warps. Per pair: 4 (164-244
# registers, no spill). `bench speed --moe-only` times both counts on a GPU; the default follows that measurement.
NUM_WARPS = {"pair": 4, "grouped": 8}


# ggml types the GGUF kernels decode (engine.weights.gguf.quants ids: F32, F16, Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, BF16)
GGUF_TYPES = frozenset({0, 1, 2, 8, 12, 13, 14, 30})


def _gguf_qtypes(layout: RowLayout) -> tuple[int, int, int] | None:
    """(gate, up, down) ggml types of a GGUF layout (``GGUFExpertLayout``, recognised by its ``qtypes``: no import
    of engine.weights.gguf.model here), None for any other layout."""
    qtypes = getattr(layout, "qtypes", None)
    return None if qtypes is None else tuple(int(q) for q in qtypes)  # type: ignore[return-value]


def supports(layout: RowLayout) -> bool:
    """Whether a fused kernel reads this layout's rows: NF4, or GGUF with all three types in ``GGUF_TYPES`` (never
    rows interleaved for the CPU kernels: not the file's or bitsandbytes' order)."""
    qtypes = _gguf_qtypes(layout)
    if qtypes is not None:
        return all(q in GGUF_TYPES for q in qtypes) and not any(getattr(layout, "x8", ()))
    return layout.fmt == "nf4" and not getattr(layout, "x8", False)


_enabled = False  # engine.settings.GpuPaths.fused_moe, set by engine.kernels.switches.use at load


def set_enabled(on: bool) -> bool:
    """Turn the fused kernels on or off for this process (``GpuPaths.fused_moe``); returns the previous setting."""
    global _enabled
    before, _enabled = _enabled, bool(on)
    return before


def enabled_for(x: Tensor, layout: RowLayout) -> bool:
    """Whether :func:`engine.weights.quant.routed_forward` takes the fused kernel: CUDA activations, NF4 or supported GGUF
    experts, opted in (see module)."""
    return enabled_on(x.device, layout)


def enabled_on(device: torch.device, layout: RowLayout) -> bool:
    """:func:`enabled_for` activations on ``device``."""
    return device.type == "cuda" and _enabled and supports(layout) and available()


def fused_moe(x: Tensor, pool: Tensor, layout: RowLayout, rows: Tensor, topk_w: Tensor) -> Tensor:
    """:func:`fused_gguf_moe` for a GGUF layout, :func:`fused_nf4_moe` otherwise (same arguments and result)."""
    if _gguf_qtypes(layout) is not None:
        return fused_gguf_moe(x, pool, layout, rows, topk_w)
    return fused_nf4_moe(x, pool, layout, rows, topk_w)  # type: ignore[arg-type]


@functools.cache
def _code_book(device: torch.device) -> Tensor:
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


NF4 = -1  # the kernels' format id for NF4 rows (triton_moe_kernels.FMT_NF4); GGUF matrices use their ggml type


def _launch(
    x: Tensor, pool: Tensor, rows: Tensor, topk_w: Tensor, d: int, i: int, blocksize: int,
    gate: tuple[int, int, int], up: tuple[int, int, int, int], down: tuple[int, int, int],
) -> Tensor:
    """The two kernels over every (token, expert) pair of ``rows`` [T, K]; ``gate`` / ``down`` = (byte offset,
    scales offset, format), ``up`` = the same and its first row. Returns [T, D] in x's dtype."""
    from clover_desk.engine.kernels.triton_moe_kernels import down_kernel, gate_up_kernel

    t, k = rows.shape
    pairs = t * k
    x = x.contiguous()
    pool = pool.contiguous()
    if pairs >= GROUPED_MIN_PAIRS:
        return _launch_grouped(x, pool, rows, topk_w, d, i, blocksize, gate, up, down)
    flat_rows = rows.reshape(-1).to(torch.int32).contiguous()  # [P] pool row of pair p = t*K + k
    toks = torch.arange(t, device=x.device, dtype=torch.int32).repeat_interleave(k)  # [P]
    weights = topk_w.reshape(-1).to(torch.float32).contiguous()  # [P]
    h = torch.empty(pairs, i, dtype=torch.float32, device=x.device)
    out = torch.empty(pairs, d, dtype=torch.float32, device=x.device)
    table = _code_book(x.device)
    warps = NUM_WARPS["pair"]
    gate_up_kernel[(pairs, -(-i // BLOCK_I))](
        x, pool, flat_rows, toks, table, h, pool.stride(0), d, i, blocksize, *gate, *up, BLOCK_I, BLOCK_D,
        num_warps=warps,
    )
    down_kernel[(pairs, -(-d // BLOCK_N))](
        h, pool, flat_rows, weights, table, out, pool.stride(0), d, i, blocksize, *down, BLOCK_N, BLOCK_K,
        num_warps=warps,
    )
    return out.view(t, k, d).sum(1).to(x.dtype)


def group_pairs(rows: Tensor, n_rows: int, bm: int = BLOCK_M) -> tuple[Tensor, Tensor]:
    """The grouped kernels' tables, built on the device (no host read): the pairs sorted by pool row and each row's
    group padded to whole blocks of ``bm``. ``rows`` [P] (pool row of pair p), ``n_rows`` the pool's rows. Returns
    ``block_rows`` [NB] (the pool row of block b; -1 past the last group) and ``pair_ids`` [NB * bm] int32 (the pair
    at each place of a block; -1 padding), NB = ceil(P / bm) + min(n_rows, P): a bound fixed by the shapes (the
    blocks past the real ones cost a program that returns at once)."""
    rows = rows.reshape(-1).to(torch.int64)
    p, dev = rows.numel(), rows.device
    nb = -(-p // bm) + min(n_rows, p)
    counts = torch.zeros(n_rows, dtype=torch.int64, device=dev).scatter_add_(0, rows, torch.ones_like(rows))
    padded = (counts + bm - 1) // bm * bm
    start = torch.cumsum(counts, 0) - counts  # [S] first sorted place of each row's pairs
    start_pad = torch.cumsum(padded, 0) - padded  # [S] ... and of its padded group
    order = torch.sort(rows, stable=True).indices  # [P] pairs in row order (ties: pair order)
    by_row = rows[order]
    place = start_pad[by_row] + torch.arange(p, device=dev) - start[by_row]  # [P] padded place of each sorted pair
    pair_ids = torch.full((nb * bm,), -1, dtype=torch.int32, device=dev).scatter_(0, place, order.to(torch.int32))
    row_at = torch.full((nb * bm,), -1, dtype=torch.int64, device=dev).scatter_(0, place, by_row)
    return row_at.view(nb, bm)[:, 0].contiguous(), pair_ids  # a group's padding is at its end: place 0 is real


def _launch_grouped(
    x: Tensor, pool: Tensor, rows: Tensor, topk_w: Tensor, d: int, i: int, blocksize: int,
    gate: tuple[int, int, int], up: tuple[int, int, int, int], down: tuple[int, int, int],
) -> Tensor:
    """:func:`_launch` for many pairs: the grouped kernels over blocks of BLOCK_M pairs of one expert row."""
    from clover_desk.engine.kernels.triton_moe_kernels import grouped_down_kernel, grouped_gate_up_kernel

    t, k = rows.shape
    block_rows, pair_ids = group_pairs(rows, pool.shape[0])
    nb = block_rows.numel()
    weights = topk_w.reshape(-1).to(torch.float32).contiguous()  # [P]
    ieee = x.dtype == torch.float32
    h = torch.empty(t * k, i, dtype=x.dtype, device=x.device)  # in x's dtype: the down product's tl.dot input
    out = torch.empty(t * k, d, dtype=torch.float32, device=x.device)
    table = _code_book(x.device)
    warps = NUM_WARPS["grouped"]
    grouped_gate_up_kernel[(nb, -(-i // BLOCK_I))](
        x, pool, block_rows, pair_ids, table, h, pool.stride(0), d, i, k, blocksize, *gate, *up, ieee,
        BLOCK_M, BLOCK_I, BLOCK_D, num_warps=warps,
    )
    grouped_down_kernel[(nb, -(-d // BLOCK_N))](
        h, pool, block_rows, pair_ids, weights, table, out, pool.stride(0), d, i, blocksize, *down, ieee,
        BLOCK_M, BLOCK_N, BLOCK_K, num_warps=warps,
    )
    return out.view(t, k, d).sum(1).to(x.dtype)


def fused_nf4_moe(x: Tensor, pool: Tensor, layout: RowLayout, rows: Tensor, topk_w: Tensor) -> Tensor:
    """Routed experts of ``x`` [T, D] from NF4 rows: ``rows`` [T, K] (long or int) names the row of ``pool``
    [S, nbytes] uint8 holding each (token, k) pair's expert, ``topk_w`` [T, K] its weight. Returns [T, D] in
    x's dtype (accumulated in float32)."""
    if layout.fmt != "nf4":
        raise ValueError(f"the fused kernel reads NF4 rows, not {layout.fmt!r}")
    codes, scales = layout.gate_up_codes[0], layout.gate_up_scales[0]
    return _launch(
        x, pool, rows, topk_w, layout.hidden_size, layout.intermediate_size, layout.blocksize,
        gate=(codes, scales, NF4), up=(codes, scales, NF4, layout.intermediate_size),  # up: rows I..2I-1
        down=(layout.down_codes[0], layout.down_scales[0], NF4),
    )


def fused_gguf_moe(x: Tensor, pool: Tensor, layout: RowLayout, rows: Tensor, topk_w: Tensor) -> Tensor:
    """Routed experts of ``x`` [T, D] from GGUF rows (``GGUFExpertLayout``: ``[gate | up | down]`` blocks in the
    types ``layout.qtypes``): ``rows`` [T, K] (long or int) names the row of ``pool`` [S, nbytes] uint8 holding
    each (token, k) pair's expert, ``topk_w`` [T, K] its weight. Returns [T, D] in x's dtype (accumulated in
    float32)."""
    qtypes = _gguf_qtypes(layout)
    if qtypes is None:
        raise ValueError(f"the fused GGUF kernel reads GGUF rows, not {layout.fmt!r}")
    if not supports(layout):
        raise ValueError(f"the fused GGUF kernel decodes ggml types {sorted(GGUF_TYPES)}, not all of {qtypes}")
    (gate_off, _), (up_off, _), (down_off, _) = layout.segments  # type: ignore[attr-defined]
    return _launch(
        x, pool, rows, topk_w, layout.hidden_size, layout.intermediate_size, 1,
        gate=(gate_off, 0, qtypes[0]), up=(up_off, 0, qtypes[1], 0), down=(down_off, 0, qtypes[2]),
    )


def gguf_dequantize(raw: Tensor, qtype: int, ncols: int) -> Tensor:
    """raw uint8 [R, row_bytes] (R whole ggml rows of ``ncols`` values) -> fp32 [R, ncols], decoded by the kernels'
    element helpers (what ``engine.weights.gguf.quants.dequantize`` gives: the tests compare the two)."""
    from clover_desk.engine.kernels.triton_moe_kernels import gguf_dequant_kernel

    if qtype not in GGUF_TYPES:
        raise ValueError(f"ggml type {qtype} has no kernel decode")
    raw = raw.contiguous()
    r = raw.shape[0]
    out = torch.empty(r, ncols, dtype=torch.float32, device=raw.device)
    br, bc = 16, 64
    gguf_dequant_kernel[(-(-r // br), -(-ncols // bc))](raw, out, r, ncols, qtype, br, bc)
    return out
