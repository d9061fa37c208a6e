"""Q4_K expert rows interleaved in groups of 8 for the CPU kernels (``T_Q4_KX8`` in ``csrc/quant_cpu.c``).

A routed expert of a pass or an AR step multiplies 1-3 tokens, and a row's direct dot spends ~25 cycles a Q4_K block
and a token here: two multiplies per 32 products, the block's scales unpacked and its 8 lanes summed for every row.
With 8 rows in the int32 lanes of a vector, one 32-byte load holds 4 values of each row, one ``vpdpbusd`` adds 32
products and each sub-block is scaled once for the 8 rows: 2.1x fewer cycles a block from cache, 1.2x from memory
on one core (measured at 2,048 x 8 blocks). The per-block arithmetic is that of the many-token kernels (``kt``), so
an expert's rows give the same bits for a token whatever the other tokens of the call.

The layout keeps every byte and the size: rows 8g .. 8g+7 of a matrix [R, nb * 144] occupy the same 8 rows' bytes,
block b of the group at b * 1152: the 8 rows' fp16 d (16 bytes) and dmin (16), their packed scales (dword k of row
r at 32 + 32k + 4r) and nibbles (bytes 4i .. 4i+3 of Q4_K's 32-byte chunk c of row r at 128 + ((8c + i) * 8 + r) *
4). :func:`pack` / :func:`unpack` are the reference (torch, any device); :func:`pack_bank` rewrites an expert bank
in place on the CPU (C, once at load: ``engine.weights.gguf.model.GGUFExpertBank.interleave``).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from clover_desk.engine.kernels import cpu_quant

Q4_KX8 = cpu_quant.Q4_KX8
GROUP = 8  # rows per group
ROW_BLOCK = 144  # bytes of one row's Q4_K block
_SCALES, _CHUNKS = 3, 4  # dwords of packed scales, 32-byte chunks of nibbles per block


def _groups(rows: Tensor) -> tuple[Tensor, int]:
    """uint8 [..., R, nb * 144] -> ([L, G, 8, nb, 144], nb)."""
    r, n = rows.shape[-2:]
    if rows.dtype != torch.uint8 or r % GROUP or n % ROW_BLOCK:
        raise ValueError(f"x8: expects uint8 [..., R, nb * {ROW_BLOCK}] with R a multiple of {GROUP}, got "
                         f"{tuple(rows.shape)} {rows.dtype}")
    nb = n // ROW_BLOCK
    return rows.reshape(-1, r // GROUP, GROUP, nb, ROW_BLOCK), nb


def pack(rows: Tensor) -> Tensor:
    """Q4_K rows [..., R, nb * 144] -> the same bytes interleaved in groups of 8 (a new tensor of the same shape)."""
    g, nb = _groups(rows)
    b = g.permute(0, 1, 3, 2, 4)  # [L, G, nb, 8 rows, 144]
    lead = b.shape[:3]
    d = b[..., 0:2].reshape(*lead, 16)
    dmin = b[..., 2:4].reshape(*lead, 16)
    scales = b[..., 4:16].reshape(*lead, GROUP, _SCALES, 4).transpose(-3, -2).reshape(*lead, 96)
    qs = b[..., 16:].reshape(*lead, GROUP, _CHUNKS * 8, 4).transpose(-3, -2).reshape(*lead, 1024)
    return torch.cat([d, dmin, scales, qs], -1).reshape(rows.shape)


def unpack(packed: Tensor) -> Tensor:
    """The inverse of :func:`pack`: interleaved groups [..., R, nb * 144] -> plain Q4_K rows."""
    g, nb = _groups(packed)
    b = g.reshape(*g.shape[:2], nb, GROUP * ROW_BLOCK)  # [L, G, nb, 1152]
    lead = b.shape[:3]
    d = b[..., 0:16].reshape(*lead, GROUP, 2)
    dmin = b[..., 16:32].reshape(*lead, GROUP, 2)
    scales = b[..., 32:128].reshape(*lead, _SCALES, GROUP, 4).transpose(-3, -2).reshape(*lead, GROUP, 12)
    qs = b[..., 128:].reshape(*lead, _CHUNKS * 8, GROUP, 4).transpose(-3, -2).reshape(*lead, GROUP, 128)
    rows = torch.cat([d, dmin, scales, qs], -1)  # [L, G, nb, 8, 144]
    return rows.permute(0, 1, 3, 2, 4).reshape(packed.shape)


_FN: dict[int, object] = {}


def pack_bank(bank: Tensor, offset: int, rows: int, row_bytes: int, *, undo: bool = False) -> None:
    """Interleave (``undo``: restore) in place the Q4_K matrix [rows, row_bytes] at byte ``offset`` of every row of
    ``bank`` uint8 [E, nbytes] (one row per expert, on the CPU), with the C kernels."""
    if bank.device.type != "cpu" or bank.dtype != torch.uint8 or bank.dim() != 2 or bank.stride(1) != 1:
        raise ValueError(f"pack_bank: a CPU uint8 [E, nbytes] bank with unit column stride, got {tuple(bank.shape)} "
                         f"{bank.dtype} on {bank.device}")
    if offset < 0 or offset + rows * row_bytes > bank.shape[1] or row_bytes % ROW_BLOCK:
        raise ValueError(f"pack_bank: a matrix [{rows}, {row_bytes}] at {offset} does not fit rows of {bank.shape[1]}")
    lib = cpu_quant.kernels().lib()
    fn = _FN.get(id(lib))
    if fn is None:
        fn = _FN[id(lib)] = lib.clover_x8_pack
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                       ctypes.c_int]
    if bank.shape[0] == 0:
        return
    rc = fn(bank.data_ptr() + offset, bank.shape[0], bank.stride(0), rows, row_bytes // ROW_BLOCK, int(undo),
            torch.get_num_threads())
    cpu_quant._raise_for(rc, "x8 pack")
