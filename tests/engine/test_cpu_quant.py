"""engine.kernels.cpu_quant: matmuls straight from GGUF blocks against fp64 references.

Two references per case:

* tight: x rounded to int8 blocks exactly as the kernel does (scale amax/127, round half to even, in fp32), then
  an fp64 matmul with the dequantized weights. The kernel's integer dots are exact, so only fp32 rounding of the
  block scales and sums remains: |err| <= 1e-5 * (|xq| @ |W|.T) (about 100 fp32 ulps of the absolute sum).
* bound: the unrounded x. Each activation value moves by at most half its block's step, d/2 = amax_block/254, so
  |err| <= sum over blocks of d_b/2 * sum_{k in block} |W[n, k]| (plus the fp32 slack above). This is the tolerance
  the int8 activation rounding justifies; measured errors sit far below it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch import Tensor

from clover_desk.engine.kernels import cpu_quant as cq
from clover_desk.engine.weights.gguf import quants as gq

K_TYPES = (cq.Q4_K, cq.Q6_K, cq.Q5_K)
ALL_TYPES = (cq.Q4_K, cq.Q6_K, cq.Q8_0, cq.Q5_K, cq.Q4_0)


def _have_compiler() -> bool:
    import os

    return bool(os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc"))


@pytest.fixture(scope="module")
def kern() -> cq.Kernels:
    if not _have_compiler():
        pytest.skip("no C compiler: cpu_quant kernels cannot be built")
    k = cq.kernels()
    assert k.ok, k.reason
    return k


@pytest.fixture(scope="module")
def scalar() -> cq.Kernels:
    if not _have_compiler():
        pytest.skip("no C compiler: cpu_quant kernels cannot be built")
    k = cq.Kernels(scalar=True)
    assert k.ok, k.reason
    assert not k.simd
    return k


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


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: cq.TYPE_NAMES[q])
@pytest.mark.parametrize("t", [1, 3, 32])
def test_qmatmul_matches_reference(kern: cq.Kernels, qtype: int, t: int) -> None:
    k = 768 if qtype in K_TYPES else 96  # 3 blocks: not a multiple of anything the kernel tiles by
    w = make_weights(qtype, 37, k, seed=qtype)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
    check_qmatmul(cq.qmatmul(x, w, qtype), x, w, qtype)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: cq.TYPE_NAMES[q])
def test_scalar_path_agrees(kern: cq.Kernels, scalar: cq.Kernels, qtype: int) -> None:
    k = 512 if qtype in K_TYPES else 64
    w = make_weights(qtype, 19, k, seed=1)
    for t in (1, 5):
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
        ys = scalar.qmatmul(x, w, qtype)
        check_qmatmul(ys, x, w, qtype)
        y = kern.qmatmul(x, w, qtype)
        assert torch.allclose(ys, y, rtol=1e-5, atol=1e-5 * float(y.abs().max()))


def test_many_rows_cross_the_tile(kern: cq.Kernels) -> None:
    """T = 70 > the 64-row accumulator tile of the decoded path; rows of zeros and a huge row."""
    w = make_weights(cq.Q6_K, 21, 512, seed=3)
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(0))
    x[5] = 0.0
    x[6] *= 1e4
    check_qmatmul(cq.qmatmul(x, w, cq.Q6_K), x, w, cq.Q6_K)


@pytest.mark.parametrize("qtype", [cq.Q6_K, cq.Q4_K, cq.Q8_0], ids=lambda q: cq.TYPE_NAMES[q])
def test_qmatmul_rows(kern: cq.Kernels, qtype: int) -> None:
    k = 512 if qtype in K_TYPES else 128
    w = make_weights(qtype, 50, k, seed=2)
    rows = torch.tensor([49, 0, 7, 7, 23], dtype=torch.int64)
    for t in (1, 4):
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
        y = cq.qmatmul_rows(x, w, qtype, rows)
        check_qmatmul(y, x, w, qtype, rows)
        assert torch.equal(y, cq.qmatmul(x, w, qtype, rows=rows))
        assert torch.allclose(y, cq.qmatmul(x, w, qtype)[:, rows], rtol=1e-6, atol=1e-6)
    with pytest.raises(IndexError):
        kern.qmatmul(x, w, qtype, torch.tensor([50]))


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


@pytest.mark.parametrize("qtypes", [(cq.Q4_K, cq.Q4_K, cq.Q6_K), (cq.Q5_K, cq.Q5_K, cq.Q8_0),
                                    (cq.Q8_0, cq.Q4_0, cq.Q4_0), (cq.Q6_K, cq.Q6_K, cq.Q4_K)],
                         ids=lambda qs: "/".join(cq.TYPE_NAMES[q] for q in qs))
def test_moe_matches_reference(kern: cq.Kernels, qtypes: tuple[int, int, int]) -> None:
    e, d, i = 6, 512, 256
    banks = make_bank(qtypes, e, d, i)
    packed = torch.cat([b.reshape(e, -1) for b in banks], dim=1)  # [E, gate | up | down]
    for t, k in ((1, 2), (5, 4), (32, 3)):
        idx, wts = routing(t, e, k, seed=t)
        x = torch.randn(t, d, generator=torch.Generator().manual_seed(t))
        ref = moe_reference(x, banks, qtypes, idx, wts)
        y = cq.moe(x, *banks, qtypes, idx, wts)
        assert y.shape == (t, d) and y.dtype == torch.float32
        assert_moe_close(y, ref)
        assert torch.equal(cq.moe_packed(x, packed, i, qtypes, idx, wts), y)


def test_moe_scalar_agrees(kern: cq.Kernels, scalar: cq.Kernels) -> None:
    qtypes = (cq.Q4_K, cq.Q4_K, cq.Q6_K)
    banks = make_bank(qtypes, 5, 256, 256)
    idx, wts = routing(9, 5, 3, seed=0)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(0))
    ys, y = scalar.moe(x, *banks, qtypes, idx, wts), kern.moe(x, *banks, qtypes, idx, wts)
    assert torch.allclose(ys, y, rtol=1e-4, atol=1e-4 * float(y.abs().max()))


def test_real_width_smoke(kern: cq.Kernels) -> None:
    """One layer at the model's widths: an expert's gate (512 x 2048 Q4_K), a small bank of real width (E=8,
    D=2048, I=512) and a slice of the output head (4096 x 2048 Q6_K)."""
    w = make_weights(cq.Q4_K, 512, 2048, seed=4)
    for t in (1, 32):
        x = torch.randn(t, 2048, generator=torch.Generator().manual_seed(t))
        check_qmatmul(cq.qmatmul(x, w, cq.Q4_K), x, w, cq.Q4_K)
    head = make_weights(cq.Q6_K, 4096, 2048, seed=5)
    x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(9))
    check_qmatmul(cq.qmatmul(x, head, cq.Q6_K), x, head, cq.Q6_K)
    qtypes = (cq.Q4_K, cq.Q4_K, cq.Q6_K)
    banks = make_bank(qtypes, 8, 2048, 512)
    for t in (1, 32):
        idx, wts = routing(t, 8, 4, seed=t)
        x = torch.randn(t, 2048, generator=torch.Generator().manual_seed(t))
        ref = moe_reference(x, banks, qtypes, idx, wts)
        assert_moe_close(cq.moe(x, *banks, qtypes, idx, wts), ref)


def test_torch_compile_fullgraph(kern: cq.Kernels) -> None:
    w = make_weights(cq.Q4_K, 64, 256, seed=6)
    qtypes = (cq.Q4_K, cq.Q4_K, cq.Q4_K)
    banks = make_bank(qtypes, 4, 256, 256)
    rows = torch.tensor([3, 1, 60])

    def f(x: Tensor, idx: Tensor, wts: Tensor) -> Tensor:
        h = cq.qmatmul(x * 2.0, w, cq.Q4_K).relu()  # [T, 64]
        m = cq.moe(x, *banks, qtypes, idx, wts)  # [T, 256]
        return h.sum(-1, keepdim=True) + m + cq.qmatmul_rows(x, w, cq.Q4_K, rows).mean(-1, keepdim=True)

    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    idx, wts = routing(3, 4, 2, seed=0)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, idx, wts), f(x, idx, wts))


def test_validation_errors(kern: cq.Kernels) -> None:
    w = make_weights(cq.Q4_K, 4, 256)
    with pytest.raises(ValueError):
        kern.qmatmul(torch.randn(1, 512), w, cq.Q4_K)  # rows hold 256 values
    with pytest.raises(ValueError):
        kern.qmatmul(torch.randn(1, 256), w, cq.F16)  # float weights stay on torch
    assert kern.qmatmul(torch.randn(2, 256, dtype=torch.bfloat16), w, cq.Q4_K).dtype == torch.float32


def test_failed_build_is_reported_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    k = cq.Kernels(cc="/bin/false", out_dir=tmp_path)
    assert not k.ok and k.reason and "\n" not in k.reason
    with pytest.raises(RuntimeError, match="unavailable"):
        k.qmatmul(torch.randn(1, 256), make_weights(cq.Q4_K, 2, 256), cq.Q4_K)
    missing = cq.Kernels(cc=str(tmp_path / "no-such-cc"), out_dir=tmp_path)
    assert not missing.ok and missing.reason
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("CLOVER_DESK_KERNEL_CACHE", str(tmp_path / "cache"))
    cq._reset()
    try:
        assert cq.available() is False
        assert cq.reason()
    finally:
        cq._reset()
