"""The Triton kernel of :mod:`engine.kernels.triton_linear` (imported only when Triton is; see that module)."""

import triton
import triton.language as tl


@triton.jit
def int8_linear_kernel(
    x_ptr, codes_ptr, scales_ptr, bias_ptr, out_ptr, rows, n_in, n_out,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[r, o] = scales[o] * sum_n x[r, n] * codes[o, n] (+ bias[o]) for a BLOCK_R x BLOCK_O tile: the int8 codes
    are read once per tile and widened in registers to x's dtype (exact: every int8 is a bf16), never written."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)  # [BO]
    r_ok, o_ok = r < rows, o < n_out
    acc = tl.zeros([BLOCK_R, BLOCK_O], dtype=tl.float32)
    for n0 in range(0, n_in, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BN]
        n_ok = n < n_in
        xs = tl.load(x_ptr + r[:, None] * n_in + n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # [BR, BN]
        w = tl.load(codes_ptr + o[None, :].to(tl.int64) * n_in + n[:, None],
                    mask=o_ok[None, :] & n_ok[:, None], other=0)  # [BN, BO] int8
        if IEEE:  # fp32 activations: a full-precision product (not TF32)
            acc += tl.dot(xs, w.to(xs.dtype), input_precision="ieee")
        else:
            acc += tl.dot(xs, w.to(xs.dtype))
    acc = acc * tl.load(scales_ptr + o, mask=o_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + o, mask=o_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + r[:, None] * n_out + o[None, :], acc, mask=r_ok[:, None] & o_ok[None, :])
