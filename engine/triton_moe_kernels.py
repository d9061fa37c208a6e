"""The Triton kernels of :mod:`engine.triton_moe` (imported only when Triton is; see that module)."""

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


@triton.jit
def gate_up_kernel(
    x_ptr, pool_ptr, rows_ptr, toks_ptr, table_ptr, h_ptr, row_stride,
    D: tl.constexpr, I: tl.constexpr, blocksize: tl.constexpr, codes_off: tl.constexpr,
    scales_off: tl.constexpr, BI: tl.constexpr, BD: tl.constexpr,
):
    p = tl.program_id(0)
    row = tl.load(rows_ptr + p).to(tl.int64)
    tok = tl.load(toks_ptr + p).to(tl.int64)
    base = pool_ptr + row * row_stride
    codes = base + codes_off
    scales = (base + scales_off).to(tl.pointer_type(tl.float32))
    i = tl.program_id(1) * BI + tl.arange(0, BI)  # [BI]
    i_ok = i < I
    acc_g = tl.zeros([BI], dtype=tl.float32)
    acc_u = tl.zeros([BI], dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)  # [BD]
        d_ok = d < D
        xv = tl.load(x_ptr + tok * D + d, mask=d_ok, other=0.0).to(tl.float32)  # [BD]
        ok = i_ok[:, None] & d_ok[None, :]
        e_gate = i[:, None].to(tl.int64) * D + d[None, :]  # gate_up rows 0..I-1: gate
        e_up = (i[:, None] + I).to(tl.int64) * D + d[None, :]  # rows I..2I-1: up
        acc_g += tl.sum(nf4_at(codes, scales, table_ptr, e_gate, blocksize, ok) * xv[None, :], axis=1)
        acc_u += tl.sum(nf4_at(codes, scales, table_ptr, e_up, blocksize, ok) * xv[None, :], axis=1)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up
    tl.store(h_ptr + p * I + i, h, mask=i_ok)


@triton.jit
def down_kernel(
    h_ptr, pool_ptr, rows_ptr, w_ptr, table_ptr, out_ptr, row_stride,
    D: tl.constexpr, I: tl.constexpr, blocksize: tl.constexpr, codes_off: tl.constexpr,
    scales_off: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    p = tl.program_id(0)
    row = tl.load(rows_ptr + p).to(tl.int64)
    base = pool_ptr + row * row_stride
    codes = base + codes_off
    scales = (base + scales_off).to(tl.pointer_type(tl.float32))
    n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN] hidden rows of down [D, I]
    n_ok = n < D
    acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < I
        hv = tl.load(h_ptr + p * I + k, mask=k_ok, other=0.0)  # [BK]
        e = n[:, None].to(tl.int64) * I + k[None, :]
        w = nf4_at(codes, scales, table_ptr, e, blocksize, n_ok[:, None] & k_ok[None, :])
        acc += tl.sum(w * hv[None, :], axis=1)
    weight = tl.load(w_ptr + p)
    tl.store(out_ptr + p * D + n, acc * weight, mask=n_ok)
