"""A fused NF4 mixture-of-experts kernel in Triton: the routed experts of a forward computed straight from the
packed expert rows (``engine.quant.ExpertLayout``), never materialising a dequantized weight.

Two kernels, one program per (token, expert) pair and output tile:

1. gate/up: ``h[p, i] = silu(x[t] · gate[e, i]) * (x[t] · up[e, i])`` over the hidden size in ``BLOCK_D`` chunks, the
   NF4 codes of both rows unpacked in registers (high nibble first, the 16-value code book, the fp32 block absmax);
2. down: ``out[p, n] = w[p] * (h[p] · down[e, n])``, then the K pairs of each token are summed (in torch, in a fixed
   order: deterministic, unlike atomics).

Each pair reads its expert's row from ``pool`` [S, nbytes] at the row ``rows[p]``, a device-side table (the bank's
own rows for a resident bank, the slot of each expert for the streamed slot pool): no host read, no group sizes.
This is the GEMV shape (one token per program): exactly what an AR step needs; a 32-slot pass re-reads an expert's
bytes once per pair routed to it (from L2 on a GPU). A grouped variant with ``tl.dot`` over an expert's tokens is
the next step where measurements show the pass is bound by it.

Status: written and tested on the CPU with ``TRITON_INTERPRET=1`` (``tests/test_triton_moe.py``: equal to the
dequantize-then-matmul reference within float32 rounding); **not yet measured on a GPU**, so nothing selects it by
default: ``QuantExpertBank`` uses it on CUDA only when ``CLOVER_DESK_FUSED_MOE=1``, and ``clover-desk bench speed
--moe-only`` on CUDA times it next to the dequantize-then-matmul path (``scripts/gpu_check.sh``). Triton is not a
dependency of the CPU install (CUDA builds of torch bring it).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import Tensor

from engine.quant import NF4_CODE, ExpertLayout

BLOCK_I = 32  # intermediate rows per gate/up program
BLOCK_D = 64  # hidden columns per step of the gate/up reduction
BLOCK_N = 32  # hidden rows per down program
BLOCK_K = 64  # intermediate columns per step of the down reduction


def available() -> bool:
    """True when Triton can be imported (CUDA builds of torch bring it; on the CPU it runs only interpreted)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def enabled_for(x: Tensor, layout: ExpertLayout) -> bool:
    """Whether ``QuantExpertBank`` takes the fused kernel: CUDA activations, NF4 experts, opted in (see module)."""
    return (
        x.is_cuda and layout.fmt == "nf4" and os.environ.get("CLOVER_DESK_FUSED_MOE") == "1" and available()
    )


def _kernels() -> tuple[Any, Any]:
    from engine.triton_moe_kernels import down_kernel, gate_up_kernel

    return gate_up_kernel, down_kernel


@functools.cache
def _code_book(device: torch.device) -> Tensor:
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


def fused_nf4_moe(x: Tensor, pool: Tensor, layout: ExpertLayout, rows: Tensor, topk_w: Tensor) -> Tensor:
    """Routed experts of ``x`` [T, D] from NF4 rows: ``rows`` [T, K] (long or int) names the row of ``pool``
    [S, nbytes] uint8 holding each (token, k) pair's expert, ``topk_w`` [T, K] its weight. Returns [T, D] in
    x's dtype (accumulated in float32)."""
    if layout.fmt != "nf4":
        raise ValueError(f"the fused kernel reads NF4 rows, not {layout.fmt!r}")
    gate_up_kernel, down_kernel = _kernels()
    t, k = rows.shape
    d, i = layout.hidden_size, layout.intermediate_size
    pairs = t * k
    x = x.contiguous()
    pool = pool.contiguous()
    flat_rows = rows.reshape(-1).to(torch.int32).contiguous()
    toks = torch.arange(t, device=x.device, dtype=torch.int32).repeat_interleave(k)  # [P]
    weights = topk_w.reshape(-1).to(torch.float32).contiguous()
    h = torch.empty(pairs, i, dtype=torch.float32, device=x.device)
    out = torch.empty(pairs, d, dtype=torch.float32, device=x.device)
    table = _code_book(x.device)
    gate_up_kernel[(pairs, -(-i // BLOCK_I))](
        x, pool, flat_rows, toks, table, h, pool.stride(0), d, i, layout.blocksize, layout.gate_up_codes[0],
        layout.gate_up_scales[0], BLOCK_I, BLOCK_D,
    )
    down_kernel[(pairs, -(-d // BLOCK_N))](
        h, pool, flat_rows, weights, table, out, pool.stride(0), d, i, layout.blocksize, layout.down_codes[0],
        layout.down_scales[0], BLOCK_N, BLOCK_K,
    )
    return out.view(t, k, d).sum(1).to(x.dtype)
