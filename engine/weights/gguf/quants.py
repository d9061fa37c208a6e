"""GGUF (ggml) block formats in torch: the reference dequantize of every type the engine reads, and a quantizer for
the K formats (the ``gguf`` package quantizes Q8_0 / Q4_0 itself but not Q4_K / Q5_K / Q6_K).

Dequantize matches ``gguf.quants.dequantize`` bit for bit (same fp32 operations in the same order; tests compare
on random blocks). Block layouts (ggml-common.h), per block of ``BLOCK_ELEMS`` values:

* Q8_0 (32 values, 34 bytes): fp16 d, 32 x int8 q; x = q * d.
* Q4_0 (32 values, 18 bytes): fp16 d, 16 bytes of nibbles: value i < 16 in the low nibble of byte i, value 16 + i
  in its high nibble; x = d * (q - 8).
* Q4_K (256 values, 144 bytes): fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles
  (32-byte chunk c holds sub-block 2c in its low nibbles, 2c + 1 in its high); x = (d * sc) * q - dmin * m.
* Q5_K (256 values, 176 bytes): as Q4_K plus 32 bytes of high bits (bit j of byte l = bit 4 of value l of
  sub-block j) before the nibbles.
* Q6_K (256 values, 210 bytes): 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales (one per
  16 values), fp16 d; x = (d * scale) * (q - 32).

Raw tensors are uint8 ``[..., row_bytes]``: one GGUF row (``ne0`` values) per last-dim row, whole blocks only.

Letters: N blocks, R rows, B bytes per block.
"""

from __future__ import annotations

import torch
from torch import Tensor

# ggml type ids (gguf.GGMLQuantizationType values; the file format fixes them)
F32, F16, Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 8, 12, 13, 14, 30
TYPE_NAMES = {F32: "F32", F16: "F16", BF16: "BF16", Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
# type -> (values per block, bytes per block)
BLOCK = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q8_0: (32, 34), Q4_0: (32, 18), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
FLOAT_TYPES = (F32, F16, BF16)
QK_K = 256


def row_bytes(qtype: int, ncols: int) -> int:
    """Bytes of one row of ``ncols`` values (a whole number of blocks)."""
    elems, nbytes = BLOCK[qtype]
    if ncols % elems:
        raise ValueError(f"{TYPE_NAMES[qtype]} rows need a multiple of {elems} values, got {ncols}")
    return ncols // elems * nbytes


def _f16(b: Tensor) -> Tensor:
    """[N, 2] uint8 -> [N, 1] fp32 (little-endian fp16)."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: Tensor, groups: int, width: int) -> Tensor:
    """qs [N, groups*width] uint8 -> [N, groups*2, width]: group g gives rows 2g (low nibbles) and 2g+1 (high)."""
    n = qs.shape[0]
    q = qs.reshape(n, groups, 1, width)
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=qs.device).view(1, 1, 2, 1)
    return ((q >> shifts) & 0x0F).reshape(n, groups * 2, width)


def _scale_min_k4(scales: Tensor) -> tuple[Tensor, Tensor]:
    """The 12 packed bytes of Q4_K / Q5_K -> (sc [N, 8], m [N, 8]) uint8 6-bit values."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]  # [N, 4] each
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def q6_k_values(bits: Tensor) -> Tensor:
    """Q6_K's 192 value bytes [N, 192] (ql, then qh) -> its 256 values [N, 256] uint8, 0-63, in block order."""
    n = bits.shape[0]
    low = _nibbles(bits[:, :128], 2, 64).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=bits.device).view(1, 1, 4, 1)
    high = ((bits[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 0x03).reshape(n, 8, 32)
    return (low | (high << 4)).reshape(n, QK_K)


def q6_k_bits(q: Tensor) -> Tensor:
    """The inverse of :func:`q6_k_values`: values [N, 256] uint8 (0-63) -> ql | qh [N, 192]. Element e = h*128 +
    s*64 + l (l < 64) -> low nibble s of ql[h*64 + l]; e = h*128 + k*32 + l (l < 32) -> bits 2k..2k+1 of qh[h*32 + l]."""
    n = q.shape[0]
    ql = _pack_nibbles((q & 0x0F).reshape(n, 4, 64), 2, 64)  # [N, 128]
    hi = (q >> 4).reshape(n, 2, 4, 32)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
    return torch.cat([ql, qh], dim=-1)


def _deq_blocks(blocks: Tensor, qtype: int) -> Tensor:
    """blocks [N, B] uint8 -> [N, values per block] fp32."""
    n = blocks.shape[0]
    if qtype == Q8_0:
        d = _f16(blocks[:, :2])  # [N, 1]
        return blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32) * d
    if qtype == Q4_0:
        d = _f16(blocks[:, :2])
        q = _nibbles(blocks[:, 2:], 1, 16).reshape(n, 32).to(torch.int8) - 8  # [N, 32]
        return d * q.to(torch.float32)
    if qtype in (Q4_K, Q5_K):
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])  # [N, 1]
        sc, mn = _scale_min_k4(blocks[:, 4:16])
        dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
        ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
        if qtype == Q4_K:
            q = _nibbles(blocks[:, 16:], 4, 32)  # [N, 8, 32]
        else:
            qh = blocks[:, 16:48].reshape(n, 1, 1, 32)
            bits = torch.arange(8, dtype=torch.uint8, device=blocks.device).view(1, 1, 8, 1)
            high = ((qh >> bits) & 1).reshape(n, 8, 32)  # sub-block j: bit j of each byte
            q = _nibbles(blocks[:, 48:], 4, 32) | (high << 4)
        return (dl * q.to(torch.float32) - ml).reshape(n, QK_K)
    if qtype == Q6_K:
        scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)  # [N, 16]
        d = _f16(blocks[:, 208:210])
        dl = (d * scales).reshape(n, 16, 1)
        q = q6_k_values(blocks[:, :192]).to(torch.int8) - 32
        return (dl * q.reshape(n, 16, 16).to(torch.float32)).reshape(n, QK_K)
    raise ValueError(f"ggml type {qtype} has no block dequantize here")


def dequantize(raw: Tensor, qtype: int, ncols: int | None = None) -> Tensor:
    """raw uint8 [..., row_bytes] (whole rows) -> fp32 [..., ncols]. Float types are viewed, not rescaled."""
    if qtype not in BLOCK:
        raise ValueError(f"ggml type {qtype} is not supported (supported: {', '.join(TYPE_NAMES.values())})")
    lead = raw.shape[:-1]
    raw = raw.contiguous()
    if qtype == F32:
        return raw.view(torch.float32).clone()
    if qtype == F16:
        return raw.view(torch.float16).to(torch.float32)
    if qtype == BF16:
        return raw.view(torch.bfloat16).to(torch.float32)
    elems, nbytes = BLOCK[qtype]
    blocks = raw.reshape(-1, nbytes)  # [N, B]
    out = _deq_blocks(blocks, qtype)  # [N, elems]
    cols = raw.shape[-1] // nbytes * elems
    if ncols is not None and ncols != cols:
        raise ValueError(f"{TYPE_NAMES[qtype]}: rows of {raw.shape[-1]} bytes hold {cols} values, not {ncols}")
    return out.reshape(*lead, cols)


# ---------------------------------------------------------------------------------------------------------------
# quantizers (writer side: test files and benchmarks; any valid encoding of the format, not llama.cpp's search)
# ---------------------------------------------------------------------------------------------------------------


def _to_f16_bytes(x: Tensor) -> Tensor:
    """[N] fp32 -> [N, 2] uint8 (fp16, round to nearest)."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)


def _safe_inv(x: Tensor) -> Tensor:
    return torch.where(x != 0, 1.0 / torch.where(x != 0, x, torch.ones_like(x)), torch.zeros_like(x))


def _pack_nibbles(q: Tensor, groups: int, width: int) -> Tensor:
    """Inverse of :func:`_nibbles`: q [N, groups*2, width] (values 0..15) -> [N, groups*width] uint8."""
    n = q.shape[0]
    q = q.to(torch.uint8).reshape(n, groups, 2, width)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, groups * width)


def _quantize_k_asym(x: Tensor, qmax: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [N, 256] fp32 -> (d bytes [N, 2], dmin bytes [N, 2], packed 6-bit scales [N, 12], q [N, 8, 32] in
    0..qmax) for x ~ (d*sc) * q - dmin*m per 32-value sub-block."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = sub.amin(-1).clamp(max=0.0)  # [N, 8] the offset is -min, kept >= 0
    hi = sub.amax(-1)
    scale = (hi - lo) / qmax  # [N, 8]
    offset = -lo
    d = scale.amax(-1) / 63.0  # [N]
    dmin = offset.amax(-1) / 63.0
    d16, dmin16 = d.to(torch.float16).to(torch.float32), dmin.to(torch.float16).to(torch.float32)
    sc = torch.round(scale * _safe_inv(d16)[:, None]).clamp(0, 63).to(torch.uint8)  # [N, 8]
    mn = torch.round(offset * _safe_inv(dmin16)[:, None]).clamp(0, 63).to(torch.uint8)
    eff_d = d16[:, None] * sc.to(torch.float32)  # [N, 8] what the reader will use
    eff_m = dmin16[:, None] * mn.to(torch.float32)
    q = torch.round((sub + eff_m[..., None]) * _safe_inv(eff_d)[..., None]).clamp(0, qmax).to(torch.uint8)
    packed = torch.empty(n, 12, dtype=torch.uint8, device=x.device)
    packed[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return _to_f16_bytes(d), _to_f16_bytes(dmin), packed, q


def quantize(x: Tensor, qtype: int) -> Tensor:
    """x [..., ncols] float -> raw uint8 [..., row_bytes] in ``qtype`` (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K or a float
    type). The encoding is valid for any reader of the format; it is a plain min/max fit, not llama.cpp's search."""
    lead, ncols = x.shape[:-1], x.shape[-1]
    x = x.detach().to(torch.float32).contiguous()
    if qtype == F32:
        return x.view(torch.uint8).reshape(*lead, ncols * 4).clone()
    if qtype in (F16, BF16):
        dt = torch.float16 if qtype == F16 else torch.bfloat16
        return x.to(dt).contiguous().view(torch.uint8).reshape(*lead, ncols * 2)
    elems, nbytes = BLOCK[qtype]
    rb = row_bytes(qtype, ncols)
    blocks = x.reshape(-1, elems)  # [N, elems]
    n = blocks.shape[0]
    if qtype == Q8_0:
        d = blocks.abs().amax(-1) / 127.0
        q = torch.round(blocks * _safe_inv(d)[:, None]).clamp(-127, 127).to(torch.int8)
        out = torch.cat([_to_f16_bytes(d), q.view(torch.uint8)], dim=-1)
    elif qtype == Q4_0:
        idx = blocks.abs().argmax(-1, keepdim=True)
        d = blocks.gather(-1, idx)[:, 0] / -8.0
        q = torch.floor(blocks * _safe_inv(d)[:, None] + 8.5).clamp(0, 15)
        out = torch.cat([_to_f16_bytes(d), _pack_nibbles(q.reshape(n, 2, 16), 1, 16)], dim=-1)
    elif qtype in (Q4_K, Q5_K):
        qmax = 15 if qtype == Q4_K else 31
        d, dmin, packed, q = _quantize_k_asym(blocks, qmax)
        parts = [d, dmin, packed]
        if qtype == Q5_K:
            bits = torch.arange(8, dtype=torch.uint8, device=x.device).view(1, 8, 1)
            qh = (((q >> 4) & 1) << bits).sum(1).to(torch.uint8)  # [N, 32]: bit j from sub-block j
            parts.append(qh)
        parts.append(_pack_nibbles(q & 0x0F, 4, 32))
        out = torch.cat(parts, dim=-1)
    elif qtype == Q6_K:
        sub = blocks.reshape(n, 16, 16)
        idx = sub.abs().argmax(-1, keepdim=True)
        s = sub.gather(-1, idx)[..., 0] / -32.0  # [N, 16]: the largest magnitude maps to -32
        d = s.abs().amax(-1) / 127.0
        d16 = d.to(torch.float16).to(torch.float32)
        sc = torch.round(s * _safe_inv(d16)[:, None]).clamp(-128, 127)  # [N, 16]
        eff = d16[:, None] * sc
        q = (torch.round(sub * _safe_inv(eff)[..., None]).clamp(-32, 31) + 32).to(torch.uint8).reshape(n, 256)
        out = torch.cat([q6_k_bits(q), sc.to(torch.int8).view(torch.uint8), _to_f16_bytes(d)], dim=-1)
    else:
        raise ValueError(f"cannot quantize to ggml type {qtype}")
    assert out.shape[-1] == nbytes
    return out.reshape(*lead, rb)
