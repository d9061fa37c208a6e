"""The own cache's tensor codecs: one ``quantize_x`` / fast ``dequantize_x`` / slow ``dequantize_x_reference`` triple
per format (NF4 through bitsandbytes, per-row INT8 and Q6_K in torch), picked by format in :func:`quantize_tensor` /
:func:`dequantize_tensor`, and each format's worst-case rounding error (:func:`error_bound`). The formats themselves
are described in :mod:`engine.weights.quant`, which re-exports all of this.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from clover_desk.engine.weights.bnb import bnb_functional
from clover_desk.engine.weights.formats import NF4_CODE, QUANT_FORMATS
from clover_desk.engine.weights.gguf import quants as gq

# Largest gap between neighbouring NF4 codes: rounding error is at most half of it, times the block absmax.
NF4_MAX_HALF_GAP = max(b - a for a, b in zip(NF4_CODE, NF4_CODE[1:])) / 2


# ---------------------------------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------------------------------


def quantize_nf4(w: Tensor, blocksize: int = 64) -> tuple[Tensor, Tensor]:
    """w (any shape, float) -> (codes uint8 [ceil(numel/2)], absmax fp32 [ceil(numel/blocksize)])."""
    if w.numel() % 2:
        raise ValueError(f"NF4 needs an even number of elements, got shape {tuple(w.shape)}")
    src = w.detach().reshape(-1).to(torch.float32)  # same codes whatever the stored dtype (bf16 -> fp32 is exact)
    packed, state = bnb_functional().quantize_4bit(
        src.contiguous(), blocksize=blocksize, compress_statistics=False, quant_type="nf4"
    )
    return packed.reshape(-1), state.absmax.reshape(-1).to(torch.float32)


def dequantize_nf4(codes: Tensor, absmax: Tensor, shape: tuple[int, ...], blocksize: int, dtype: torch.dtype) -> Tensor:
    """Fast dequantize through bitsandbytes (CUDA or CPU kernel). Flat shape: see the module docstring."""
    numel = math.prod(shape)
    bnb_functional()  # registers torch.ops.bitsandbytes in a process that only reads an existing cache
    # (1, numel), not (numel,): the same flat blocks, and on the CPU the kernel returns [1, numel] for either while
    # the op's fake (what torch.compile plans its buffers by) follows the shape asked: a flat shape made every
    # compiled NF4 forward fail there ("wrong number of dimensions2 for op ... dequantize_4bit")
    out = torch.ops.bitsandbytes.dequantize_4bit(codes.view(torch.uint8), absmax, blocksize, "nf4", (1, numel), dtype)
    return out.reshape(shape)


def dequantize_nf4_reference(
    codes: Tensor, absmax: Tensor, shape: tuple[int, ...], blocksize: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Slow pure-torch NF4 dequantize: unpack nibbles (high first), look up the code, scale by the block absmax."""
    numel = math.prod(shape)
    b = codes.view(torch.uint8).to(torch.int64).cpu()  # [numel/2]
    idx = torch.stack([b >> 4, b & 0x0F], dim=1).reshape(-1)[:numel]  # [numel], element 2i from the high nibble
    table = torch.tensor(NF4_CODE, dtype=torch.float32)
    values = table[idx]  # [numel] in [-1, 1]
    scale = absmax.cpu().to(torch.float32).repeat_interleave(blocksize)[:numel]  # [numel] block absmax per element
    return (values * scale).reshape(shape).to(dtype)


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [..., N] -> (codes int8 [..., N], scale fp32 [prod(...)]) with scale = row absmax / 127."""
    w2 = w.detach().reshape(-1, w.shape[-1]).to(torch.float32)  # [R, N]
    scale = w2.abs().amax(dim=1) / 127.0  # [R]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w2 / safe[:, None]).clamp_(-127, 127).to(torch.int8)  # [R, N]
    return q.reshape(w.shape), scale


def dequantize_int8(q: Tensor, scale: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Fast dequantize: one broadcast multiply computed in fp32 (int8 codes times the fp32 row scale) and rounded to
    ``dtype`` as each element is stored: bit for bit what widening to fp32, multiplying and casting give, without
    writing an fp32 copy of the weight (6 bytes written per element -> 2 in bf16; ``bench speed --count``)."""
    q2 = q.view(torch.int8).reshape(-1, shape[-1])  # [R, N]
    out = torch.empty(q2.shape, dtype=dtype, device=q2.device)
    torch.mul(q2, scale.view(-1, 1).to(torch.float32), out=out)
    return out.reshape(shape)


def dequantize_int8_reference(
    q: Tensor, scale: Tensor, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> Tensor:
    """Slow reference: row by row, element value times its row's scale."""
    q2 = q.view(torch.int8).reshape(-1, shape[-1]).cpu()
    rows = [q2[r].to(torch.float32) * float(scale[r]) for r in range(q2.shape[0])]
    return torch.stack(rows).reshape(shape).to(dtype)


def quantize_q6_k(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [O, N] (N a multiple of 256) -> (Q6_K blocks uint8 [O, N / 256 * 210], no scales: fp32 [0])."""
    if w.dim() != 2 or w.shape[1] % gq.QK_K:
        raise ValueError(f"Q6_K needs 2-D rows of whole {gq.QK_K}-value blocks, got shape {tuple(w.shape)}")
    return gq.quantize(w, gq.Q6_K), torch.zeros(0, dtype=torch.float32)


def dequantize_q6_k(codes: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Q6_K blocks [O, row bytes] (or flat) -> [O, N] in ``dtype``, on the codes' device (torch ops only)."""
    rb = gq.row_bytes(gq.Q6_K, shape[-1])
    return gq.dequantize(codes.view(torch.uint8).reshape(-1, rb), gq.Q6_K, shape[-1]).reshape(shape).to(dtype)


def quantize_tensor(w: Tensor, fmt: str, blocksize: int = 64) -> tuple[Tensor, Tensor]:
    """(codes, scales) of ``w`` in ``fmt`` ("nf4" | "int8" | "q6_k")."""
    if fmt == "nf4":
        return quantize_nf4(w, blocksize)
    if fmt == "int8":
        return quantize_int8(w)
    if fmt == "q6_k":
        return quantize_q6_k(w)
    raise ValueError(f"not a quantized format: {fmt!r} (expected one of {QUANT_FORMATS})")


def dequantize_tensor(
    codes: Tensor,
    scales: Tensor,
    shape: tuple[int, ...],
    fmt: str,
    blocksize: int,
    dtype: torch.dtype = torch.float32,
    reference: bool = False,
) -> Tensor:
    """``codes`` and ``scales`` of ``fmt`` -> the tensor ``shape`` in ``dtype``; ``reference``: the format's slow
    element-by-element reference instead of its fast path."""
    if fmt == "nf4":
        nf4 = dequantize_nf4_reference if reference else dequantize_nf4
        return nf4(codes, scales, shape, blocksize, dtype)
    if fmt == "int8":
        int8 = dequantize_int8_reference if reference else dequantize_int8
        return int8(codes, scales, shape, dtype)
    if fmt == "q6_k":  # one implementation (bit for bit gguf-py's, tests/engine/test_gguf_quants.py)
        return dequantize_q6_k(codes, shape, dtype)
    raise ValueError(f"not a quantized format: {fmt!r}")


def error_bound(w: Tensor, fmt: str, blocksize: int = 64) -> Tensor:
    """Per-element worst-case |w - dequant(quant(w))| of the format (same shape as w, fp32).

    NF4: half the largest code gap times the block absmax (plus fp32 slack). INT8: half a step, scale / 2.
    """
    w32 = w.detach().to(torch.float32)
    if fmt == "nf4":
        flat = w32.reshape(-1)
        nblocks = math.ceil(flat.numel() / blocksize)
        padded = F.pad(flat, (0, nblocks * blocksize - flat.numel()))
        absmax = padded.abs().reshape(nblocks, blocksize).amax(dim=1)  # [blocks]
        bound = absmax.repeat_interleave(blocksize)[: flat.numel()] * (NF4_MAX_HALF_GAP + 1e-6)
        return bound.reshape(w.shape)
    if fmt == "int8":
        w2 = w32.reshape(-1, w32.shape[-1])
        scale = w2.abs().amax(dim=1, keepdim=True) / 127.0
        return (scale * (0.5 + 1e-5)).expand_as(w2).reshape(w.shape)
    raise ValueError(f"not a quantized format: {fmt!r}")
