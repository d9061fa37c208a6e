"""A fused weight-only INT8 linear in Triton: ``QuantLinear``'s int8 codes times the activations, scaled per output
row, without materialising the dequantized weight. Today an int8 projection on a GPU is dequantized to bf16 in
chunks and multiplied (``engine.weights.quant.QuantLinear.forward``): for the 35B shape's LM head (248,320 x 2,048) that
writes and re-reads ~1 GB of bf16 per forward to use 0.5 GB of codes; this kernel reads the codes once per tile of
16 rows x 64 outputs.

One program per (16 token rows, 64 output rows) tile; the reduction over the input in steps of 64 with ``tl.dot``
(tensor cores on a GPU; an AR step's single row is padded to 16, which costs nothing in a memory-bound GEMV).
Accumulated in float32; fp32 activations use IEEE products (no TF32).

Status: tested on the CPU with ``TRITON_INTERPRET=1`` against the dequantize-then-matmul reference
(``tests/engine/test_triton_linear.py``); **not measured on a GPU**, so it is opt-in: ``QuantLinear`` takes it on CUDA
for up to :data:`MAX_ROWS` rows only when the engine's settings turn it on
(``engine.settings.GpuPaths.fused_int8``, the switch ``CLOVER_DESK_FUSED_INT8=1``; :func:`set_enabled`). ``clover-desk bench speed --moe-only`` on
CUDA times it against the chunked path at the LM head's shape (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK_R, BLOCK_O, BLOCK_N = 16, 64, 64
MAX_ROWS = 64  # token rows up to which QuantLinear takes the kernel (an AR step, a 32-slot pass)


def available() -> bool:
    """True when Triton can be imported (CUDA builds of torch bring it; on the CPU it runs only interpreted)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


_enabled = False  # engine.settings.GpuPaths.fused_int8, set by engine.kernels.switches.use at load


def set_enabled(on: bool) -> bool:
    """Turn the fused INT8 kernel on or off for this process (``GpuPaths.fused_int8``); returns the previous one."""
    global _enabled
    before, _enabled = _enabled, bool(on)
    return before


def enabled_for(x: Tensor, fmt: str, codes: Tensor) -> bool:
    """Whether ``QuantLinear`` takes the fused kernel: CUDA activations, int8 codes [O, N], at most MAX_ROWS rows,
    opted in (see module)."""
    return (
        x.is_cuda and fmt == "int8" and codes.dim() == 2 and x.numel() // x.shape[-1] <= MAX_ROWS
        and _enabled and available()
    )


def int8_linear(x: Tensor, codes: Tensor, scales: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x`` [..., N] times the weight ``codes`` [O, N] int8 * ``scales`` [O] (per output row), plus ``bias`` [O].
    Returns [..., O] in x's dtype."""
    from clover_desk.engine.kernels.triton_linear_kernels import int8_linear_kernel

    n_out, n_in = codes.shape
    if x.shape[-1] != n_in or codes.dtype != torch.int8:
        raise ValueError(f"int8_linear: x [..., {x.shape[-1]}] and int8 codes [O, N] = {tuple(codes.shape)} "
                         f"({codes.dtype}) do not match")
    rows = x.reshape(-1, n_in).contiguous()  # [R, N]
    r = rows.shape[0]
    out = torch.empty(r, n_out, dtype=torch.float32, device=x.device)
    scales = scales.reshape(n_out).to(torch.float32).contiguous()
    grid = (-(-r // BLOCK_R), -(-n_out // BLOCK_O))
    int8_linear_kernel[grid](
        rows, codes.contiguous(), scales, bias if bias is not None else scales, out, r, n_in, n_out,
        bias is not None, rows.dtype == torch.float32, BLOCK_R, BLOCK_O, BLOCK_N,
    )
    return out.to(x.dtype).reshape(*x.shape[:-1], n_out)
