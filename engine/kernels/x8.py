"""Q4_K, Q6_K and NF4 expert rows and INT8 projection rows interleaved in groups of 8 for the CPU kernels
(``T_Q4_KX8`` / ``T_Q6_KX8`` / ``T_NF4X8`` / ``T_I8X8`` in ``csrc/quant_cpu.c``).

A routed expert of a pass or an AR step multiplies 1-3 tokens, and a row's direct dot spends ~25 cycles a Q4_K block
and a token here: two multiplies per 32 products, the block's scales unpacked and its 8 lanes summed for every row.
With 8 rows in the int32 lanes of a vector, one 32-byte load holds 4 values of each row, one ``vpdpbusd`` adds 32
products and each sub-block is scaled once for the 8 rows: 2.1x fewer cycles a block from cache, 1.2x from memory
on one core (measured at 2,048 x 8 blocks). The per-block arithmetic is that of the many-token kernels (``kt``), so
an expert's rows give the same bits for a token whatever the other tokens of the call.

The layout keeps the size. Q4_K keeps every byte: rows 8g .. 8g+7 of a matrix [R, nb * 144] occupy the same 8 rows'
bytes, block b of the group at b * 1152: the 8 rows' fp16 d (16 bytes) and dmin (16), their packed scales (dword k
of row r at 32 + 32k + 4r) and nibbles (bytes 4i .. 4i+3 of Q4_K's 32-byte chunk c of row r at 128 + ((8c + i) * 8 +
r) * 4). Q6_K's groups (1680 bytes a block) hold the 8 rows' fp16 d, their int8 scales (scale j of row r at 16 + 8j +
r) and the 6-bit values re-packed three vectors a quad (at 144 + ((8h + i) * 3 + t) * 32, byte 4r + k = v_t | ((v_3
>> 2t) & 3) << 6, v_m = value 128h + 32m + 4i + k of row r), so that each unpacks in at most 4 operations.
:func:`pack` / :func:`unpack` are the reference (torch, any device); :func:`pack_bank` rewrites an expert bank in
place on the CPU (C, once at load: ``engine.weights.gguf.model.GGUFExpertBank.interleave``).

The own cache's NF4 experts (bitsandbytes' layout on disk, which a GPU reads) are interleaved in memory when the cache
is loaded on the CPU (``engine.weights.quant.QuantExpertBank.interleave``). A group keeps its 8 rows' code bytes and
fp32 scales; the codes of each 32-value step lie in 128 bytes, four 32-byte vectors v whose byte 4r + k holds value
4v + k of row r in its low nibble and value 16 + 4v + k in its high one, and the scales go [block][row]. One load and
two table lookups (``vpshufb``) give 8 values of each of 8 rows, so ``vpdpbusd`` reads them with the activation's 4
values broadcast, as above, with the tiled NF4 kernel's per-step arithmetic (``kts``): 1.8-2.0x the plain rows at
the real widths, from an AR step to a 128-token prefill. :func:`nf4_pack` / :func:`nf4_unpack` are the reference,
:func:`pack_nf4_bank` the C rewrite.

The own cache's INT8 projections (per-row scales; ``engine.weights.quant.QuantLinear.interleave``) likewise: the
codes of each 32-value step of 8 rows lie in 256 bytes, eight 32-byte vectors whose byte 4r + k is value 4v + k of
row r, so one load gives 4 codes of each of 8 rows with no decoding (``T_I8X8``; the scales, one a row, stay in
place). Up to 8 activation rows share each load, two chains of sums a row; the tiled kernels' per-step arithmetic, so
a token's outputs are the same alone or in any batch. :func:`i8_pack` / :func:`i8_unpack` are the reference,
:func:`pack_i8` the C rewrite.
"""

from __future__ import annotations

import torch
from torch import Tensor

from clover_desk.engine.kernels import cpu_quant
from clover_desk.engine.weights.gguf import quants as gq

Q4_KX8, Q6_KX8 = cpu_quant.Q4_KX8, cpu_quant.Q6_KX8
KERNEL_TYPE = {cpu_quant.Q4_K: Q4_KX8, cpu_quant.Q6_K: Q6_KX8}  # a file type -> its interleaved type
GROUP = 8  # rows per group
ROW_BLOCK = {q: cpu_quant.BLOCK[q][1] for q in KERNEL_TYPE}  # bytes of one row's block


def _groups(rows: Tensor, qtype: int) -> tuple[Tensor, int]:
    """uint8 [..., R, nb * row block] -> ([L, G, 8, nb, row block], nb)."""
    if qtype not in ROW_BLOCK:
        raise ValueError(f"x8: ggml type {qtype} is not interleaved (Q4_K {cpu_quant.Q4_K}, Q6_K {cpu_quant.Q6_K})")
    rb = ROW_BLOCK[qtype]
    r, n = rows.shape[-2:]
    if rows.dtype != torch.uint8 or r % GROUP or n % rb:
        raise ValueError(f"x8: expects uint8 [..., R, nb * {rb}] with R a multiple of {GROUP}, got "
                         f"{tuple(rows.shape)} {rows.dtype}")
    nb = n // rb
    return rows.reshape(-1, r // GROUP, GROUP, nb, rb), nb


def _quads(x: Tensor, chunks: int) -> Tensor:
    """[..., 8 rows, 32 * chunks] -> [..., chunks * 8 quads, 8 rows, 4]: 4-byte pieces, rows innermost."""
    return x.reshape(*x.shape[:-2], GROUP, chunks * 8, 4).transpose(-3, -2)


def _rows(x: Tensor, chunks: int) -> Tensor:
    """The inverse of :func:`_quads`, flattened: [..., chunks * 8 * 8 * 4] -> [..., 8 rows, 32 * chunks]."""
    return x.reshape(*x.shape[:-1], chunks * 8, GROUP, 4).transpose(-3, -2).reshape(*x.shape[:-1], GROUP, 32 * chunks)


def pack(rows: Tensor, qtype: int = cpu_quant.Q4_K) -> Tensor:
    """Rows of ``qtype`` (Q4_K or Q6_K) [..., R, nb * block] -> the same bytes interleaved in groups of 8 (a new tensor
    of the same shape)."""
    g, nb = _groups(rows, qtype)
    b = g.permute(0, 1, 3, 2, 4)  # [L, G, nb, 8 rows, block]
    lead = b.shape[:3]
    if qtype == cpu_quant.Q4_K:
        parts = [b[..., 0:2], b[..., 2:4], b[..., 4:16].reshape(*lead, GROUP, 3, 4).transpose(-3, -2),
                 _quads(b[..., 16:], 4)]
    else:  # Q6_K: d, the scales (scale j of every row together), the values re-packed three vectors a quad
        parts = [b[..., 208:210], b[..., 192:208].transpose(-2, -1), _q6_pack(b[..., :192])]
    return torch.cat([p.reshape(*lead, -1) for p in parts], -1).reshape(rows.shape)


def _q6_pack(ql_qh: Tensor) -> Tensor:
    """[..., 8 rows, 192] -> [..., h, i, t, rows, 4]: vector t of quad i = v_t | ((v_3 >> 2t) & 3) << 6."""
    v = gq.q6_k_values(ql_qh.reshape(-1, 192)).reshape(*ql_qh.shape[:-1], 2, 4, 32)  # [..., 8, h, m, l]
    shifts = torch.tensor([0, 2, 4], dtype=torch.uint8, device=v.device)[:, None]
    t = v[..., :3, :] | ((v[..., 3:, :] >> shifts) & 3) << 6  # [..., 8, h, t, l]
    t = t.reshape(*t.shape[:-1], 8, 4)  # [..., 8 rows, h, t, i, k]
    n = t.dim()
    return t.permute(*range(n - 5), n - 4, n - 2, n - 3, n - 5, n - 1)  # [..., h, i, t, rows, k]


def _q6_unpack(packed: Tensor) -> Tensor:
    """The inverse of :func:`_q6_pack`, flattened: [..., 1536] -> Q6_K's ql | qh [..., 8 rows, 192]."""
    t = packed.reshape(*packed.shape[:-1], 2, 8, 3, GROUP, 4)  # [h, i, t, rows, k]
    n = t.dim()
    t = t.permute(*range(n - 5), n - 2, n - 5, n - 3, n - 4, n - 1).reshape(*packed.shape[:-1], GROUP, 2, 3, 32)
    v3 = (t[..., 0, :] >> 6) | (t[..., 1, :] >> 6) << 2 | (t[..., 2, :] >> 6) << 4  # [..., 8, h, l]
    v = torch.cat([t & 63, v3[..., None, :]], -2)  # [..., 8, h, m, l]
    return gq.q6_k_bits(v.reshape(-1, 256)).reshape(*v.shape[:-3], 192)


def unpack(packed: Tensor, qtype: int = cpu_quant.Q4_K) -> Tensor:
    """The inverse of :func:`pack`: interleaved groups [..., R, nb * block] -> plain rows of ``qtype``."""
    g, nb = _groups(packed, qtype)
    b = g.reshape(*g.shape[:2], nb, -1)  # [L, G, nb, 8 * block]
    lead = b.shape[:3]
    if qtype == cpu_quant.Q4_K:
        d, dmin = b[..., 0:16].reshape(*lead, GROUP, 2), b[..., 16:32].reshape(*lead, GROUP, 2)
        scales = b[..., 32:128].reshape(*lead, 3, GROUP, 4).transpose(-3, -2).reshape(*lead, GROUP, 12)
        rows = torch.cat([d, dmin, scales, _rows(b[..., 128:], 4)], -1)  # [L, G, nb, 8, 144]
    else:
        d = b[..., 0:16].reshape(*lead, GROUP, 2)
        scales = b[..., 16:144].reshape(*lead, 16, GROUP).transpose(-2, -1)
        rows = torch.cat([_q6_unpack(b[..., 144:]), scales, d], -1)  # [L, G, nb, 8, 210]
    return rows.permute(0, 1, 3, 2, 4).reshape(packed.shape)


def pack_bank(bank: Tensor, offset: int, rows: int, row_bytes: int, qtype: int = cpu_quant.Q4_K, *,
              undo: bool = False) -> None:
    """Interleave (``undo``: restore) in place the ``qtype`` matrix [rows, row_bytes] at byte ``offset`` of every row
    of ``bank`` uint8 [E, nbytes] (one row per expert, on the CPU), with the C kernels."""
    if qtype not in ROW_BLOCK:
        raise ValueError(f"pack_bank: ggml type {qtype} is not interleaved")
    if bank.device.type != "cpu" or bank.dtype != torch.uint8 or bank.dim() != 2 or bank.stride(1) != 1:
        raise ValueError(f"pack_bank: a CPU uint8 [E, nbytes] bank with unit column stride, got {tuple(bank.shape)} "
                         f"{bank.dtype} on {bank.device}")
    if offset < 0 or offset + rows * row_bytes > bank.shape[1] or row_bytes % ROW_BLOCK[qtype]:
        raise ValueError(f"pack_bank: a matrix [{rows}, {row_bytes}] at {offset} does not fit rows of {bank.shape[1]}")
    if bank.shape[0] == 0:
        return
    rc = cpu_quant.kernels().lib().clover_x8_pack(bank.data_ptr() + offset, bank.shape[0], bank.stride(0), rows,
                                                  row_bytes // ROW_BLOCK[qtype], qtype, int(undo),
                                                  torch.get_num_threads())
    cpu_quant._raise_for(rc, "x8 pack")


# --- NF4 (the engine's own expert rows, ``engine.weights.quant.ExpertLayout``) ---------------------------------


def nf4_pack(codes: Tensor, scales: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """NF4 matrices [..., R, width] (``codes`` uint8 [..., R * width / 2], two a byte, the first in the high nibble;
    ``scales`` fp32 [..., R * width / bs]) -> both interleaved in groups of 8 rows (``T_NF4X8``; new tensors of the same
    shapes). R must be a multiple of 8 and bs divide the width."""
    v, lead, r = _nf4_values(codes, width)  # [L, G, 8, steps, 32]
    q = v.reshape(*v.shape[:4], 2, 4, 4)  # [L, G, 8 rows, steps, high, vector, k]
    q = (q[..., 0, :, :] | q[..., 1, :, :] << 4).permute(0, 1, 3, 4, 2, 5)  # [L, G, steps, vector, 8 rows, k]
    return q.reshape(codes.shape), _nf4_scales(scales, lead, r, False)


def nf4_unpack(codes: Tensor, scales: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """The inverse of :func:`nf4_pack`."""
    lead, r, steps = codes.shape[:-1], codes.shape[-1] * 2 // width, width // 32
    q = codes.reshape(-1, r // GROUP, steps, 4, GROUP, 4).permute(0, 1, 4, 2, 3, 5)  # [L, G, 8, steps, vector, k]
    v = torch.stack([q & 15, q >> 4], -3).reshape(-1, r // GROUP, GROUP, width)  # value 16 h + 4 vector + k of a step
    plain = (v[..., 0::2] << 4 | v[..., 1::2]).reshape(codes.shape)
    return plain, _nf4_scales(scales, lead, r, True)


def _nf4_values(codes: Tensor, width: int) -> tuple[Tensor, torch.Size, int]:
    if codes.dtype != torch.uint8 or width % 32 or (codes.shape[-1] * 2) % width:
        raise ValueError(f"x8: NF4 codes must be uint8 [..., R * {width} / 2] with a width a multiple of 32, got "
                         f"{tuple(codes.shape)} {codes.dtype}")
    r = codes.shape[-1] * 2 // width
    if r % GROUP:
        raise ValueError(f"x8: NF4 rows must be a multiple of {GROUP}, got {r}")
    b = codes.reshape(-1, r // GROUP, GROUP, width // 2)
    v = torch.stack([b >> 4, b & 15], -1).reshape(-1, r // GROUP, GROUP, width // 32, 32)
    return v, codes.shape[:-1], r


def _nf4_scales(scales: Tensor, lead: torch.Size, r: int, undo: bool) -> Tensor:
    """[..., R * n] row-major <-> [..., G, n, 8] per group (``undo``: back)."""
    n = scales.shape[-1] // r
    if scales.shape[:-1] != lead or n * r != scales.shape[-1]:
        raise ValueError(f"x8: NF4 scales {tuple(scales.shape)} do not match {r} rows of codes {tuple(lead)}")
    s = scales.reshape(-1, r // GROUP, *((n, GROUP) if undo else (GROUP, n)))
    return s.transpose(-2, -1).reshape(scales.shape)


def pack_nf4_bank(bank: Tensor, codes: int, scales: int, rows: int, width: int, blocksize: int, *,
                  undo: bool = False) -> None:
    """Interleave (``undo``: restore) in place the NF4 matrix [rows, width] of every row of ``bank`` uint8 [E, nbytes]
    (one row per expert, on the CPU): its codes at byte ``codes``, its fp32 scales (one per ``blocksize`` values) at
    byte ``scales`` of the row, with the C kernels."""
    nbytes = bank.shape[1] if bank.dim() == 2 else 0
    if bank.device.type != "cpu" or bank.dtype != torch.uint8 or bank.dim() != 2 or bank.stride(1) != 1:
        raise ValueError(f"pack_nf4_bank: a CPU uint8 [E, nbytes] bank with unit column stride, got "
                         f"{tuple(bank.shape)} {bank.dtype} on {bank.device}")
    if (min(codes, scales) < 0 or codes + rows * width // 2 > nbytes or scales + 4 * rows * width // blocksize > nbytes
            or rows % GROUP or width % blocksize or blocksize % 32):
        raise ValueError(f"pack_nf4_bank: an NF4 matrix [{rows}, {width}] (blocksize {blocksize}) at {codes} / "
                         f"{scales} does not fit rows of {nbytes} bytes in groups of {GROUP}")
    if bank.shape[0] == 0:
        return
    rc = cpu_quant.kernels().lib().clover_x8_nf4_pack(bank.data_ptr(), bank.shape[0], bank.stride(0), codes, scales,
                                                      rows, width, blocksize, int(undo), torch.get_num_threads())
    cpu_quant._raise_for(rc, "x8 NF4 pack")


# --- INT8 (the own cache's dense projections, ``engine.weights.quant.QuantLinear``) -------------------------------


def i8_pack(codes: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """INT8 matrices [..., R, K] (``codes`` int8 or uint8; ``scales`` fp32 [..., R * K / blocksize], one a row for
    the cache's INT8) -> both interleaved in groups of 8 rows (``T_I8X8``: the codes of 32-value step c of rows 8g .. 8g+7 in
    256 bytes, byte 32v + 4r + k = value 32c + 4v + k of row r; the scales [block][row]); new tensors of the same
    shapes. R must be a multiple of 8."""
    g, steps = _i8_groups(codes)
    q = g.reshape(*g.shape[:3], steps, 8, 4).permute(0, 1, 3, 4, 2, 5)  # [L, G, steps, v, 8 rows, k]
    return q.reshape(codes.shape), _nf4_scales(scales, codes.shape[:-2], codes.shape[-2], False)


def i8_unpack(codes: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """The inverse of :func:`i8_pack`."""
    g, steps = _i8_groups(codes)
    q = g.reshape(*g.shape[:2], steps, 8, GROUP, 4).permute(0, 1, 4, 2, 3, 5)  # [L, G, 8 rows, steps, v, k]
    return q.reshape(codes.shape), _nf4_scales(scales, codes.shape[:-2], codes.shape[-2], True)


def _i8_groups(codes: Tensor) -> tuple[Tensor, int]:
    """[..., R, K] -> ([L, G, 8, K], K / 32), checked."""
    if codes.dim() < 2 or codes.dtype not in (torch.int8, torch.uint8) or codes.shape[-1] % 32 or codes.shape[-2] % GROUP:
        raise ValueError(f"x8: INT8 codes must be int8 [..., R, K] with R a multiple of {GROUP} and K of 32, got "
                         f"{tuple(codes.shape)} {codes.dtype}")
    r, k = codes.shape[-2:]
    return codes.reshape(-1, r // GROUP, GROUP, k), k // 32


def pack_i8(codes: Tensor, scales: Tensor, blocksize: int | None = None, *, undo: bool = False) -> None:
    """Interleave (``undo``: restore) in place one INT8 matrix: ``codes`` int8 [R, K] (contiguous, on the CPU) and
    its fp32 ``scales`` (one per ``blocksize`` values of the flattened matrix; one a row by default), with the C
    kernels."""
    r, k = codes.shape if codes.dim() == 2 else (0, 0)
    bs = blocksize or k
    if (codes.device.type != "cpu" or codes.dtype not in (torch.int8, torch.uint8) or codes.dim() != 2
            or not codes.is_contiguous() or r % GROUP or k % 32 or bs % 32 or k % max(bs, 1)):
        raise ValueError(f"pack_i8: a contiguous CPU int8 [R, K] matrix with R a multiple of {GROUP} and K of 32 "
                         f"(blocksize {bs} dividing K), got {tuple(codes.shape)} {codes.dtype} on {codes.device}")
    if (scales.device.type != "cpu" or scales.dtype != torch.float32 or not scales.is_contiguous()
            or scales.numel() != r * k // bs):
        raise ValueError(f"pack_i8: {r * k // bs} contiguous CPU float32 scales, got {scales.numel()} {scales.dtype}")
    if r == 0:
        return
    rc = cpu_quant.kernels().lib().clover_x8_i8_pack(codes.data_ptr(), scales.data_ptr(), r, k, bs, int(undo),
                                                     torch.get_num_threads())
    cpu_quant._raise_for(rc, "x8 INT8 pack")
