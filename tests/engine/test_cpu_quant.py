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

from pathlib import Path

import pytest
import torch
from torch import Tensor

from clover_desk.engine.kernels import cpu_quant as cq
from tests.quant_reference import (
    K_TYPES,
    assert_moe_close,
    check_qmatmul,
    check_smatmul,
    kern,  # noqa: F401 - a fixture
    make_bank,
    make_weights,
    moe_reference,
    quantized,
    routing,
    scalar,  # noqa: F401 - a fixture
)

ALL_TYPES = (cq.Q4_K, cq.Q6_K, cq.Q8_0, cq.Q5_K, cq.Q4_0)


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


def test_the_vnni_build_gives_the_avx2_build_s_bits(kern: cq.Kernels) -> None:
    """Where the compiler targets AVX-512 VNNI, the dots add their products with vpdpwssd (the K formats' scaled
    int16 pairs) and vpdpbusd (Q8_0, Q4_0, NF4, INT8): the same integers as AVX2's maddubs / madd / add, so the same
    bits at every row count (direct dots, the decoded and the decode-once paths) and in the routed experts.
    Elsewhere both builds are the AVX2 one and agree trivially."""
    plain = cq.Kernels(vnni=False)
    assert plain.ok and not plain.vnni
    if not kern.simd:
        pytest.skip("no AVX2 here: both builds are the scalar dots")
    for qtype in ALL_TYPES:
        w = make_weights(qtype, 33, 1024, seed=qtype)
        for t in (1, 2, 5, 32):
            x = torch.randn(t, 1024, generator=torch.Generator().manual_seed(t))
            assert torch.equal(kern.qmatmul(x, w, qtype), plain.qmatmul(x, w, qtype)), (cq.TYPE_NAMES[qtype], t)
    for fmt in ("nf4", "int8"):
        codes, scales, bs = quantized(fmt, 33, 1024, seed=3)
        qtype = cq.SPLIT_OF_FORMAT[fmt]
        for t in (1, 5, 32):  # 32 rows: NF4 decodes each weight row once (the tiled driver)
            x = torch.randn(t, 1024, generator=torch.Generator().manual_seed(t))
            assert torch.equal(kern.smatmul(x, codes, scales, qtype, bs), plain.smatmul(x, codes, scales, qtype, bs)), \
                (fmt, t)
    qtypes = (cq.Q4_K, cq.Q4_K, cq.Q6_K)
    banks = make_bank(qtypes, 6, 512, 256)
    idx, wts = routing(12, 6, 3, seed=1)
    x = torch.randn(12, 512, generator=torch.Generator().manual_seed(2))
    assert torch.equal(kern.moe(x, *banks, qtypes, idx, wts), plain.moe(x, *banks, qtypes, idx, wts))


@pytest.mark.parametrize("t", [2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("blocksize", [64, 128, 32])
def test_nf4_rows_taken_together_give_each_row_s_own_bits(kern: cq.Kernels, t: int, blocksize: int) -> None:
    """NF4 rows of whole 64-value pairs in whole scale blocks (the cache's experts) unpack each pair of codes once
    for up to 4 activation rows; each row keeps the bits of its own one-row product (blocksize 32: single dots),
    and the products stay within the fp64 reference."""
    codes, scales, bs = quantized("nf4", 19, 512, blocksize=blocksize, seed=t)
    x = torch.randn(t, 512, generator=torch.Generator().manual_seed(t))
    x[0] *= 1e3
    together = kern.smatmul(x, codes, scales, cq.SPLIT_OF_FORMAT["nf4"], bs)
    for i in range(t):
        assert torch.equal(together[i], kern.smatmul(x[i:i + 1], codes, scales, cq.SPLIT_OF_FORMAT["nf4"], bs)[0]), i
    check_smatmul(together, x, codes, scales, "nf4", bs)


@pytest.mark.parametrize("t", [2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("qtype", [cq.Q4_K, cq.Q5_K, cq.Q6_K], ids=lambda q: cq.TYPE_NAMES[q])
def test_up_to_seven_rows_give_each_row_s_own_bits(kern: cq.Kernels, qtype: int, t: int) -> None:
    """2-7 activation rows (an expert with a few of a pass's tokens, the head for the slots still masked): each
    weight block is unpacked once for up to 4 rows, with each row's operations in its own order, so each row gets
    the bits of its own one-row product, whatever T below the tiled kernels' 8."""
    w = make_weights(qtype, 21, 768, seed=qtype)
    x = torch.randn(t, 768, generator=torch.Generator().manual_seed(4))
    x[1] *= 1e3
    x[-1] *= 1e-3
    together = kern.qmatmul(x, w, qtype)
    rows = torch.tensor([20, 3, 3], dtype=torch.int64)
    selected = kern.qmatmul(x, w, qtype, rows=rows)
    for i in range(t):
        assert torch.equal(together[i], kern.qmatmul(x[i:i + 1], w, qtype)[0]), i
        assert torch.equal(selected[i], together[i, rows])
