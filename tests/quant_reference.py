"""Reference builders for the CPU quantized kernels' tests (engine.kernels.cpu_quant): random quantized weights, the
activation rounding the kernels do, fp64 references for matmuls and routed experts, and the checks against them; and
the fixtures ``kern`` (the process-wide build) and ``scalar`` (a build of the portable scalar dots), which the test
modules import (skipped where no C compiler is found).

Two references per case (the tests' module docstrings say more):

* tight: x rounded to int8 blocks exactly as the kernel does (scale amax/127, round half to even, in fp32), then an
  fp64 matmul with the weights the kernel multiplies by. Integer dots are exact, so only fp32 rounding remains:
  |err| <= 1e-5 * (|xq| @ |W|.T).
* bound: the unrounded x and the true dequantized weights. Each activation value moves by at most half its block's
  step, d/2 = amax_block/254 (NF4's int8 table moves each code by at most 0.5/127 of its block's absmax).
"""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from torch import Tensor

from clover_desk.engine.kernels import cpu_quant as cq
from clover_desk.engine.weights import quant as wq
from clover_desk.engine.weights.formats import NF4_CODE
from clover_desk.engine.weights.gguf import quants as gq


def built_kernels(scalar: bool = False) -> cq.Kernels:
    """The process-wide build, or (``scalar``) one of the portable scalar dots; skips the test without a compiler."""
    if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")):
        pytest.skip("no C compiler: cpu_quant kernels cannot be built")
    k = cq.Kernels(scalar=True) if scalar else cq.kernels()
    assert k.ok, k.reason
    assert not (scalar and k.simd)
    return k


@pytest.fixture(scope="module")
def kern() -> cq.Kernels:
    return built_kernels()


@pytest.fixture(scope="module")
def scalar() -> cq.Kernels:
    return built_kernels(scalar=True)

K_TYPES = (cq.Q4_K, cq.Q6_K, cq.Q5_K)


def make_weights(qtype: int, n: int, k: int, seed: int = 0) -> Tensor:
    """Random rows (varied magnitudes per row) quantized to ``qtype`` -> uint8 [n, row_bytes]."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g).add(0.1)
    if qtype in (cq.Q8_0, cq.Q4_0):
        raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType(qtype))
        return torch.from_numpy(np.ascontiguousarray(raw))
    return gq.quantize(w, qtype)


def act_block(qtype: int) -> int:
    return 256 if qtype in K_TYPES else 32


def round_like_kernel(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """x fp32 [T, K] -> (x rounded as the kernel rounds it, the step d of each value's block), both fp32 [T, K]."""
    t, k = x.shape
    b = x.float().reshape(t, k // block, block)
    amax = b.abs().amax(-1, keepdim=True)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    iscale = torch.tensor(127.0, dtype=torch.float32) / safe
    q = torch.round(b * iscale).clamp(-127, 127)
    d = torch.where(amax > 0, amax / torch.tensor(127.0, dtype=torch.float32), torch.zeros_like(amax))
    return (q * d).reshape(t, k), d.expand_as(b).reshape(t, k)


def check_qmatmul(y: Tensor, x: Tensor, w: Tensor, qtype: int, rows: Tensor | None = None) -> float:
    """Assert both references hold; return the max error relative to max |exact result|."""
    k = x.shape[1]
    deq = gq.dequantize(w, qtype, k).double()  # [N, K]
    if rows is not None:
        deq = deq[rows]
    xq, step = round_like_kernel(x, act_block(qtype))
    absw = deq.abs()
    slack = 1e-5 * (xq.double().abs() @ absw.T) + 1e-30
    tight = xq.double() @ deq.T
    assert y.shape == tight.shape and y.dtype == torch.float32
    assert torch.all((y.double() - tight).abs() <= slack), f"tight: max excess {((y.double() - tight).abs() - slack).max()}"
    exact = x.double() @ deq.T
    bound = (step.double() / 2) @ absw.T * 1.001 + slack
    assert torch.all((y.double() - exact).abs() <= bound)
    return float((y.double() - exact).abs().max() / exact.abs().max())


def moe_reference(x: Tensor, banks: tuple[Tensor, Tensor, Tensor], qtypes: tuple[int, int, int], idx: Tensor,
                  wts: Tensor) -> Tensor:
    """Loop over the used experts in fp64, activations rounded as the kernel rounds them (x and the hidden h)."""
    gate, up, down = banks
    d, i = x.shape[1], gate.shape[1]
    xg = round_like_kernel(x, act_block(qtypes[0]))[0].double()
    xu = round_like_kernel(x, act_block(qtypes[1]))[0].double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in idx.unique().tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        g = xg[tok] @ gq.dequantize(gate[e], qtypes[0], d).double().T
        u = xu[tok] @ gq.dequantize(up[e], qtypes[1], d).double().T
        h = (torch.nn.functional.silu(g) * u).float()
        hq = round_like_kernel(h, act_block(qtypes[2]))[0].double()
        y = hq @ gq.dequantize(down[e], qtypes[2], i).double().T
        out.index_add_(0, tok, y * wts[tok, slot].double()[:, None])
    return out


def assert_moe_close(y: Tensor, ref: Tensor) -> None:
    """Tight (1e-5 of max |ref|) on all but a few tokens. The hidden h = silu(g) * u is rounded to int8 blocks
    after fp32 sums whose order differs from the reference's, so now and then one h value lands on the other side
    of a rounding midpoint (about 1e-4 odds per value at these sizes); that token's whole output row then moves
    by one activation step times one down column (measured up to 5e-4 of max |ref|)."""
    rel = (y.double() - ref).abs().amax(-1) / ref.abs().max()  # [T] worst per token
    assert float(rel.max()) <= 2e-3, rel
    assert int((rel > 1e-5).sum()) <= max(1, y.shape[0] // 8), rel


def make_bank(qtypes: tuple[int, int, int], e: int, d: int, i: int) -> tuple[Tensor, Tensor, Tensor]:
    gate = make_weights(qtypes[0], e * i, d, seed=10).reshape(e, i, -1)
    up = make_weights(qtypes[1], e * i, d, seed=11).reshape(e, i, -1)
    down = make_weights(qtypes[2], e * d, i, seed=12).reshape(e, d, -1)
    return gate, up, down


def routing(t: int, e: int, k: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wts = torch.softmax(torch.randn(t, k, generator=g), -1)
    return idx, wts


NF4_TABLE = torch.round(torch.tensor(NF4_CODE, dtype=torch.float64) * 127) / 127  # what the kernel multiplies by


def quantized(fmt: str, n: int, k: int, blocksize: int = 64, seed: int = 0) -> tuple[Tensor, Tensor, int]:
    """Random rows of varied magnitude -> (codes, scales, values per scale) in the cache's layout."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g).add(0.1)
    codes, scales = wq.quantize_tensor(w, fmt, blocksize)
    return codes, scales, (blocksize if fmt == "nf4" else k)


def weights_as_kernel(codes: Tensor, scales: Tensor, fmt: str, n: int, k: int, bs: int) -> tuple[Tensor, Tensor]:
    """(the weights the kernel multiplies by, the true dequantized weights), fp64 [n, k]."""
    exact = wq.dequantize_tensor(codes, scales, (n, k), fmt, bs, torch.float64, reference=True)
    if fmt == "int8":
        return exact, exact
    b = codes.view(torch.uint8).to(torch.int64).reshape(-1)
    idx = torch.stack([b >> 4, b & 0x0F], dim=1).reshape(-1)
    scale = scales.double().repeat_interleave(bs)[: n * k]
    return (NF4_TABLE[idx] * scale).reshape(n, k), exact


def check_smatmul(y: Tensor, x: Tensor, codes: Tensor, scales: Tensor, fmt: str, bs: int) -> float:
    """Assert both references hold; return the max error relative to max |exact result|."""
    n, k = y.shape[1], x.shape[1]
    w_kernel, w_exact = weights_as_kernel(codes, scales, fmt, n, k, bs)
    xq, step = round_like_kernel(x, 32)
    slack = 1e-5 * (xq.double().abs() @ w_kernel.abs().T) + 1e-30
    tight = xq.double() @ w_kernel.T
    assert y.dtype == torch.float32 and y.shape == tight.shape
    excess = (y.double() - tight).abs() - slack
    assert torch.all(excess <= 0), f"tight: max excess {excess.max()}"
    exact = x.double() @ w_exact.T
    table_err = 0.0 if fmt == "int8" else 0.5 / 127
    absmax = scales.double().repeat_interleave(bs)[: n * k].reshape(n, k) if fmt == "nf4" else torch.zeros(n, k, dtype=torch.float64)
    bound = (step.double() / 2) @ w_exact.abs().T * 1.001 + table_err * (x.double().abs() @ absmax.T) * 1.001 + slack
    assert torch.all((y.double() - exact).abs() <= bound)
    return float((y.double() - exact).abs().max() / exact.abs().max())


def own_bank_reference(bank: wq.QuantExpertBank, x: Tensor, idx: Tensor, wts: Tensor) -> Tensor:
    """moe_reference on the bank's experts as the kernel sees them (NF4 through the int8 table)."""
    lay = bank.layout
    d, i, e = lay.hidden_size, lay.intermediate_size, lay.num_experts
    gates, ups, downs = [], [], []
    for r in range(e):
        gu_c, dn_c, gu_s, dn_s = lay.views(bank.packed[r])
        bs_gu, bs_dn = (lay.blocksize, lay.blocksize) if lay.fmt == "nf4" else (d, i)
        gu = weights_as_kernel(gu_c, gu_s, lay.fmt, 2 * i, d, bs_gu)[0]
        gates.append(gu[:i])
        ups.append(gu[i:])
        downs.append(weights_as_kernel(dn_c, dn_s, lay.fmt, d, i, bs_dn)[0])
    xq = round_like_kernel(x, 32)[0].double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for r in idx.unique().tolist():
        tok, slot = (idx == r).nonzero(as_tuple=True)
        h = (torch.nn.functional.silu(xq[tok] @ gates[r].T) * (xq[tok] @ ups[r].T)).float()
        y = round_like_kernel(h, 32)[0].double() @ downs[r].T
        out.index_add_(0, tok, y * wts[tok, slot].double()[:, None])
    return out
