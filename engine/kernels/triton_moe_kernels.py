"""The Triton kernels of :mod:`engine.kernels.triton_moe` (imported only when Triton is; see that module)."""

import triton
import triton.language as tl


@triton.jit
def nf4_at(codes_ptr, scales_ptr, table_ptr, e, blocksize: tl.constexpr, mask):
    """Dequantized values of the NF4 tensor at element indices ``e`` (int64, any shape)."""
    byte = tl.load(codes_ptr + e // 2, mask=mask, other=0).to(tl.int32)
    code = tl.where(e % 2 == 0, byte >> 4, byte & 15)  # element 2j: high nibble
    value = tl.load(table_ptr + code, mask=mask, other=0.0)
    scale = tl.load(scales_ptr + e // blocksize, mask=mask, other=0.0)
    return value * scale


# ---------------------------------------------------------------------------------------------------------------
# GGUF (ggml) blocks: the value of one matrix element, computed from its block (layouts: engine.weights.gguf.quants)
# ---------------------------------------------------------------------------------------------------------------
# ggml type ids (engine.weights.gguf.quants; the file format fixes them), compile-time constants of the kernels
GGML_F32: tl.constexpr = tl.constexpr(0)
GGML_F16: tl.constexpr = tl.constexpr(1)
GGML_Q4_0: tl.constexpr = tl.constexpr(2)
GGML_Q8_0: tl.constexpr = tl.constexpr(8)
GGML_Q4_K: tl.constexpr = tl.constexpr(12)
GGML_Q5_K: tl.constexpr = tl.constexpr(13)
GGML_Q6_K: tl.constexpr = tl.constexpr(14)
GGML_BF16: tl.constexpr = tl.constexpr(30)

# Each ``*_at(ptr, r, c, ncols, mask)`` below: the fp32 value at (row r, column c) of a matrix of ``ncols`` columns
# stored from the uint8 pointer ``ptr`` as whole ggml rows (r, c int32 tensors of one broadcast shape; masked-off
# elements give 0). Within a row, block b = c // elems and element j = c % elems of its ``elems`` values; byte
# offsets are int32 (one expert's row is far below 2 GiB). Multi-byte fields sit at any alignment (a Q8_0 block is
# 34 bytes), so they are loaded byte by byte and bitcast. The fp32 operations are those of gguf_quants.dequantize
# in its order (the interpreter gives its bits; a GPU build may fuse a multiply-add).


@triton.jit
def _byte(ptr, mask):
    """The uint8 at ``ptr`` as int32."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, mask):
    """The little-endian fp16 at ``ptr`` (two bytes, any alignment) as fp32."""
    bits = _byte(ptr, mask) | (_byte(ptr + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _i8(ptr, mask):
    """The int8 at ``ptr`` as fp32."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def f32_at(ptr, r, c, ncols: tl.constexpr, mask):
    e = ptr + (r * ncols + c) * 4
    bits = _byte(e, mask) | (_byte(e + 1, mask) << 8) | (_byte(e + 2, mask) << 16) | (_byte(e + 3, mask) << 24)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def f16_at(ptr, r, c, ncols: tl.constexpr, mask):
    return _f16(ptr + (r * ncols + c) * 2, mask)


@triton.jit
def bf16_at(ptr, r, c, ncols: tl.constexpr, mask):
    e = ptr + (r * ncols + c) * 2
    bits = _byte(e, mask) | (_byte(e + 1, mask) << 8)
    return (bits << 16).to(tl.float32, bitcast=True)  # bf16 = the high half of an fp32


@triton.jit
def q8_0_at(ptr, r, c, ncols: tl.constexpr, mask):
    """Q8_0 (32 values, 34 bytes): fp16 d, 32 int8 q; x = q * d."""
    blk = ptr + (r * (ncols // 32) + c // 32) * 34
    return _i8(blk + 2 + c % 32, mask) * _f16(blk, mask)


@triton.jit
def q4_0_at(ptr, r, c, ncols: tl.constexpr, mask):
    """Q4_0 (32 values, 18 bytes): fp16 d, 16 bytes; j < 16 in the low nibble of byte j, j >= 16 in the high nibble
    of byte j - 16; x = d * (q - 8)."""
    blk = ptr + (r * (ncols // 32) + c // 32) * 18
    j = c % 32
    byte = _byte(blk + 2 + j % 16, mask)
    q = tl.where(j < 16, byte & 15, byte >> 4) - 8
    return _f16(blk, mask) * q.to(tl.float32)


@triton.jit
def _scale_min_k4(blk, sb, mask):
    """6-bit scale and min of sub-block ``sb`` (0..7) from the 12 bytes at blk + 4 (Q4_K / Q5_K), as fp32: sb < 4
    in the low 6 bits of bytes sb / sb + 4; sb >= 4 from the low / high nibble of byte sb + 4 plus the top 2 bits
    of bytes sb - 4 / sb as bits 4-5."""
    lo = sb < 4
    a = _byte(blk + 4 + sb, mask)  # sb < 4: scale byte; sb >= 4: the min's top bits
    b = _byte(blk + 8 + sb, mask)  # sb < 4: min byte; sb >= 4: the packed nibbles (byte sb + 4 of the 12)
    top = _byte(blk + tl.where(lo, 4, 0) + sb, mask)  # sb >= 4: byte sb - 4 (the scale's top bits)
    sc = tl.where(lo, a & 63, (b & 15) | ((top >> 6) << 4))
    m = tl.where(lo, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), m.to(tl.float32)


@triton.jit
def qk_asym_at(ptr, r, c, ncols: tl.constexpr, high_bits: tl.constexpr, mask):
    """Q4_K (144 bytes; ``high_bits`` False) and Q5_K (176 bytes; True), 256 values in 8 sub-blocks of 32: fp16 d,
    fp16 dmin, 12 bytes of scales / mins, [Q5_K: 32 bytes, bit sb of byte l = bit 4 of value l of sub-block sb],
    128 bytes of nibbles (byte (sb // 2) * 32 + l: sub-block sb even in the low nibble, odd in the high);
    x = (d * sc) * q - dmin * m."""
    nbytes: tl.constexpr = 176 if high_bits else 144
    qs: tl.constexpr = 48 if high_bits else 16  # where the nibbles start
    blk = ptr + (r * (ncols // 256) + c // 256) * nbytes
    j = c % 256
    sb = j // 32
    l = j % 32
    byte = _byte(blk + qs + (sb // 2) * 32 + l, mask)
    q = (byte >> ((sb % 2) * 4)) & 15
    if high_bits:
        q = q | (((_byte(blk + 16 + l, mask) >> sb) & 1) << 4)
    sc, m = _scale_min_k4(blk, sb, mask)
    return (_f16(blk, mask) * sc) * q.to(tl.float32) - _f16(blk + 2, mask) * m


@triton.jit
def q6_k_at(ptr, r, c, ncols: tl.constexpr, mask):
    """Q6_K (256 values, 210 bytes): 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, fp16 d.
    Element j = h*128 + q*32 + l (h half, q quarter, l lane): low nibble of byte h*64 + 32*(q%2) + l, shifted by
    4*(q//2); high bits of byte 128 + h*32 + l, shifted by 2q; scale j // 16; x = (d * scale) * (q6 - 32)."""
    blk = ptr + (r * (ncols // 256) + c // 256) * 210
    j = c % 256
    h = j // 128
    q = (j % 128) // 32
    l = j % 32
    low = (_byte(blk + h * 64 + (q % 2) * 32 + l, mask) >> ((q // 2) * 4)) & 15
    high = (_byte(blk + 128 + h * 32 + l, mask) >> (q * 2)) & 3
    q6 = (low | (high << 4)) - 32
    return (_f16(blk + 208, mask) * _i8(blk + 192 + j // 16, mask)) * q6.to(tl.float32)


@triton.jit
def gguf_at(ptr, r, c, ncols: tl.constexpr, qtype: tl.constexpr, mask):
    """fp32 values at (r, c) of a GGUF matrix of ggml type ``qtype`` (a compile-time branch; see the helpers)."""
    if qtype == GGML_Q8_0:
        v = q8_0_at(ptr, r, c, ncols, mask)
    elif qtype == GGML_Q4_0:
        v = q4_0_at(ptr, r, c, ncols, mask)
    elif qtype == GGML_Q4_K:
        v = qk_asym_at(ptr, r, c, ncols, False, mask)
    elif qtype == GGML_Q5_K:
        v = qk_asym_at(ptr, r, c, ncols, True, mask)
    elif qtype == GGML_Q6_K:
        v = q6_k_at(ptr, r, c, ncols, mask)
    elif qtype == GGML_F16:
        v = f16_at(ptr, r, c, ncols, mask)
    elif qtype == GGML_BF16:
        v = bf16_at(ptr, r, c, ncols, mask)
    else:
        tl.static_assert(qtype == GGML_F32, "unsupported ggml type")
        v = f32_at(ptr, r, c, ncols, mask)
    return v


@triton.jit
def gguf_dequant_kernel(
    src_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr, qtype: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr
):
    """out [R, C] fp32 = the GGUF matrix at ``src_ptr`` (R whole ggml rows of C values); one program per BR x BC
    tile. Checks :func:`gguf_at` against the torch dequantize."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR]
    c = tl.program_id(1) * BC + tl.arange(0, BC)  # [BC]
    ok = (r < R)[:, None] & (c < C)[None, :]
    v = gguf_at(src_ptr, r[:, None], c[None, :], C, qtype, ok)
    tl.store(out_ptr + r[:, None].to(tl.int64) * C + c[None, :], v, mask=ok)


# ---------------------------------------------------------------------------------------------------------------
# The MoE kernels: one pair for every format, the weight decode chosen at compile time (weight_at)
# ---------------------------------------------------------------------------------------------------------------
FMT_NF4: tl.constexpr = tl.constexpr(-1)  # not a ggml id: NF4 codes with fp32 block absmax (engine.weights.quant)


@triton.jit
def weight_at(base, off: tl.constexpr, scales_off: tl.constexpr, table_ptr, r, c, ncols: tl.constexpr,
              fmt: tl.constexpr, blocksize: tl.constexpr, mask):
    """fp32 values at (r, c) of a matrix of ``ncols`` columns stored in an expert row (``base``) from byte ``off``:
    NF4 codes when ``fmt`` is FMT_NF4 (fp32 block absmax at byte ``scales_off``, code book ``table_ptr``, blocks of
    ``blocksize``), else whole ggml rows of type ``fmt`` (``scales_off``, ``table_ptr`` and ``blocksize`` unused)."""
    if fmt == FMT_NF4:
        scales = (base + scales_off).to(tl.pointer_type(tl.float32))
        v = nf4_at(base + off, scales, table_ptr, r.to(tl.int64) * ncols + c, blocksize, mask)
    else:
        v = gguf_at(base + off, r, c, ncols, fmt, mask)
    return v


@triton.jit
def gate_up_kernel(
    x_ptr, pool_ptr, rows_ptr, toks_ptr, table_ptr, h_ptr, row_stride,
    D: tl.constexpr, I: tl.constexpr, blocksize: tl.constexpr,
    gate_off: tl.constexpr, gate_scales: tl.constexpr, gate_fmt: tl.constexpr,
    up_off: tl.constexpr, up_scales: tl.constexpr, up_fmt: tl.constexpr, up_row0: tl.constexpr,
    BI: tl.constexpr, BD: tl.constexpr,
):
    """h[p, i] = silu(x[t] · gate[i]) * (x[t] · up[i]) for pair p (token t = toks[p], expert row rows[p] of the
    pool) and the BI rows i of program (p, tile). gate [I, D] at ``gate_off``; up [I, D] from row ``up_row0`` of
    the matrix at ``up_off`` (NF4: the second half of the one gate_up matrix; GGUF: a matrix of its own)."""
    p = tl.program_id(0)
    row = tl.load(rows_ptr + p).to(tl.int64)
    tok = tl.load(toks_ptr + p).to(tl.int64)
    base = pool_ptr + row * row_stride
    i = tl.program_id(1) * BI + tl.arange(0, BI)  # [BI]
    i_ok = i < I
    acc_g = tl.zeros([BI], dtype=tl.float32)
    acc_u = tl.zeros([BI], dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)  # [BD]
        d_ok = d < D
        xv = tl.load(x_ptr + tok * D + d, mask=d_ok, other=0.0).to(tl.float32)  # [BD]
        ok = i_ok[:, None] & d_ok[None, :]
        g = weight_at(base, gate_off, gate_scales, table_ptr, i[:, None], d[None, :], D, gate_fmt, blocksize, ok)
        u = weight_at(base, up_off, up_scales, table_ptr, i[:, None] + up_row0, d[None, :], D, up_fmt, blocksize,
                      ok)  # [BI, BD] each
        acc_g += tl.sum(g * xv[None, :], axis=1)
        acc_u += tl.sum(u * xv[None, :], axis=1)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up
    tl.store(h_ptr + p * I + i, h, mask=i_ok)


@triton.jit
def down_kernel(
    h_ptr, pool_ptr, rows_ptr, w_ptr, table_ptr, out_ptr, row_stride,
    D: tl.constexpr, I: tl.constexpr, blocksize: tl.constexpr,
    down_off: tl.constexpr, down_scales: tl.constexpr, down_fmt: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr,
):
    """out[p, n] = w[p] * (h[p] · down[n]) for the BN hidden rows n of program (p, tile); down [D, I] at
    ``down_off`` in the pair's expert row."""
    p = tl.program_id(0)
    row = tl.load(rows_ptr + p).to(tl.int64)
    base = pool_ptr + row * row_stride
    n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
    n_ok = n < D
    acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        k = k0 + tl.arange(0, BK)  # [BK]
        k_ok = k < I
        hv = tl.load(h_ptr + p * I + k, mask=k_ok, other=0.0)  # [BK]
        w = weight_at(base, down_off, down_scales, table_ptr, n[:, None], k[None, :], I, down_fmt, blocksize,
                      n_ok[:, None] & k_ok[None, :])  # [BN, BK]
        acc += tl.sum(w * hv[None, :], axis=1)
    weight = tl.load(w_ptr + p)
    tl.store(out_ptr + p * D + n, acc * weight, mask=n_ok)


# ---------------------------------------------------------------------------------------------------------------
# Grouped variants (a denoising pass): the pairs sorted by expert row and padded to whole blocks of BM, one program
# per (block, output tile), so an expert's weight tile is decoded once per block of BM pairs and multiplied with
# tl.dot, instead of once per pair. Block b's pairs are pair_ids[b*BM : (b+1)*BM] (-1: padding), all of the pool row
# block_rows[b] (-1: a block past the last group, which returns at once). Same decode (weight_at) as above.
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _block_pairs(block_rows_ptr, pair_ids_ptr, BM: tl.constexpr):
    """Program b's block: its pool row (-1: past the last group) and its BM pairs (-1: padding)."""
    b = tl.program_id(0)
    row = tl.load(block_rows_ptr + b).to(tl.int64)
    return row, tl.load(pair_ids_ptr + b * BM + tl.arange(0, BM))


@triton.jit
def _dot(a, w, IEEE: tl.constexpr):
    """a @ w with w cast to a's dtype, accumulated in fp32; fp32 inputs (``IEEE``) as full-precision products."""
    if IEEE:
        out = tl.dot(a, w.to(a.dtype), input_precision="ieee")
    else:
        out = tl.dot(a, w.to(a.dtype))
    return out


@triton.jit
def grouped_gate_up_kernel(
    x_ptr, pool_ptr, block_rows_ptr, pair_ids_ptr, table_ptr, h_ptr, row_stride,
    D: tl.constexpr, I: tl.constexpr, K: tl.constexpr, blocksize: tl.constexpr,
    gate_off: tl.constexpr, gate_scales: tl.constexpr, gate_fmt: tl.constexpr,
    up_off: tl.constexpr, up_scales: tl.constexpr, up_fmt: tl.constexpr, up_row0: tl.constexpr,
    IEEE: tl.constexpr, BM: tl.constexpr, BI: tl.constexpr, BD: tl.constexpr,
):
    """h[p, i] = silu(x[p // K] · gate[i]) * (x[p // K] · up[i]) for the BM pairs p of block b and BI rows i."""
    row, pairs = _block_pairs(block_rows_ptr, pair_ids_ptr, BM)  # [BM] pairs
    if row >= 0:
        base = pool_ptr + row * row_stride
        p_ok = pairs >= 0
        toks = tl.where(p_ok, pairs // K, 0).to(tl.int64)
        i = tl.program_id(1) * BI + tl.arange(0, BI)  # [BI]
        i_ok = i < I
        acc_g = tl.zeros([BM, BI], dtype=tl.float32)
        acc_u = tl.zeros([BM, BI], dtype=tl.float32)
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)  # [BD]
            d_ok = d < D
            xs = tl.load(x_ptr + toks[:, None] * D + d[None, :], mask=p_ok[:, None] & d_ok[None, :], other=0.0)
            ok = d_ok[:, None] & i_ok[None, :]  # [BD, BI]: the transposed tiles gate[i, d] -> [d, i]
            g = weight_at(base, gate_off, gate_scales, table_ptr, i[None, :], d[:, None], D, gate_fmt, blocksize, ok)
            u = weight_at(base, up_off, up_scales, table_ptr, i[None, :] + up_row0, d[:, None], D, up_fmt, blocksize,
                          ok)
            acc_g += _dot(xs, g, IEEE)
            acc_u += _dot(xs, u, IEEE)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # [BM, BI]
        safe = tl.where(p_ok, pairs, 0).to(tl.int64)
        tl.store(h_ptr + safe[:, None] * I + i[None, :], h.to(h_ptr.dtype.element_ty), mask=p_ok[:, None] & i_ok[None, :])


@triton.jit
def grouped_down_kernel(
    h_ptr, pool_ptr, block_rows_ptr, pair_ids_ptr, w_ptr, table_ptr, out_ptr, row_stride,
    D: tl.constexpr, I: tl.constexpr, blocksize: tl.constexpr,
    down_off: tl.constexpr, down_scales: tl.constexpr, down_fmt: tl.constexpr,
    IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """out[p, n] = w[p] * (h[p] · down[n]) for the BM pairs p of block b and BN hidden rows n (h in x's dtype)."""
    row, pairs = _block_pairs(block_rows_ptr, pair_ids_ptr, BM)  # [BM] pairs
    if row >= 0:
        base = pool_ptr + row * row_stride
        p_ok = pairs >= 0
        safe = tl.where(p_ok, pairs, 0).to(tl.int64)
        n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
        n_ok = n < D
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            k = k0 + tl.arange(0, BK)  # [BK]
            k_ok = k < I
            hs = tl.load(h_ptr + safe[:, None] * I + k[None, :], mask=p_ok[:, None] & k_ok[None, :], other=0.0)
            w = weight_at(base, down_off, down_scales, table_ptr, n[None, :], k[:, None], I, down_fmt, blocksize,
                          k_ok[:, None] & n_ok[None, :])  # [BK, BN] = down[n, k] transposed
            acc += _dot(hs, w, IEEE)
        weight = tl.load(w_ptr + safe, mask=p_ok, other=0.0)  # [BM]
        tl.store(out_ptr + safe[:, None] * D + n[None, :], acc * weight[:, None], mask=p_ok[:, None] & n_ok[None, :])
