"""8 or more activation rows (issue 30: prefill segments and denoising passes), where ``quant_cpu.c`` interleaves
the activation rows in tiles of 8 and adds 4 products per row lane with one vpdpbusd: the K formats (``kt_matmul``)
and the own cache's NF4 / INT8 with whole 256-value groups (``kts_matmul``), dense and routed. Checked against the
fp64 references of ``tests/quant_reference.py``, at the integer extremes of each format, for rows that do not
depend on the call they are in, and against the VNNI-free build's bits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clover_desk.engine.kernels import cpu_quant as cq
from clover_desk.engine.weights import quant as wq
from tests.quant_reference import (  # noqa: F401 - kern: a fixture
    K_TYPES,
    assert_moe_close,
    check_qmatmul,
    check_smatmul,
    kern,
    make_bank,
    make_weights,
    moe_reference,
    own_bank_reference,
    quantized,
    routing,
)

NAMES = {q: cq.TYPE_NAMES[q] for q in K_TYPES}


def _x(t: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(seed))
    return x * torch.rand(t, 1, generator=torch.Generator().manual_seed(seed + 1)).add(0.05)


@pytest.mark.parametrize("qtype", K_TYPES, ids=NAMES.get)
@pytest.mark.parametrize("t", [8, 9, 16, 31, 33, 64, 70, 129])
def test_many_rows_match_the_reference(kern: cq.Kernels, qtype: int, t: int) -> None:
    """Whole and partial tiles, one and several tile groups (64 rows each), 37 weight rows (an odd last pair)."""
    w = make_weights(qtype, 37, 768, seed=qtype + t)
    x = _x(t, 768, seed=t)
    x[t // 2] = 0.0
    check_qmatmul(kern.qmatmul(x, w, qtype), x, w, qtype)


def _extreme_block(qtype: int, sign: int) -> bytes:
    """One 256-value block at the format's largest integers: every value at its top code, the largest multipliers
    (Q6_K: 127 or -128; Q4_K / Q5_K: 63, the 6-bit maximum, for scales and mins), d = dmin = 1."""
    one = np.float16(1.0).tobytes()
    if qtype == cq.Q6_K:
        sc = bytes([127 if sign > 0 else 128]) * 16  # int8 127 / -128
        return b"\xff" * 128 + b"\xff" * 64 + sc + one
    qs = b"\xff" * 128
    head = one + one + b"\xff" * 12  # d, dmin, 8 scales and 8 mins of 63
    return head + (b"\xff" * 32 + qs if qtype == cq.Q5_K else qs)


@pytest.mark.parametrize("qtype", K_TYPES, ids=NAMES.get)
def test_the_integer_sums_do_not_overflow_at_the_extremes(kern: cq.Kernels, qtype: int) -> None:
    """Weights at their top codes and multipliers against activation rows at +-127 in every value: the largest
    per-block sums of each format (Q6_K: 16 groups x 127 x 16 x 63 x 127, ~2.6e8 of int32's 2.1e9)."""
    k = 1024
    rows = [_extreme_block(qtype, s) * (k // 256) for s in (1, -1)]
    w = torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8).reshape(2, -1)
    x = torch.ones(12, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3] *= 1e6
    check_qmatmul(kern.qmatmul(x, w, qtype), x, w, qtype)


@pytest.mark.parametrize("qtype", K_TYPES, ids=NAMES.get)
def test_a_row_s_result_does_not_depend_on_its_call(kern: cq.Kernels, qtype: int) -> None:
    """The same activation row gives the same bits whatever the call's row count, its place in a tile or the
    tile's place in the call (a prompt cache and a pass rely on a row's logits not depending on its neighbours)."""
    w = make_weights(qtype, 21, 512, seed=4)
    x = _x(40, 512, seed=5)
    full = kern.qmatmul(x, w, qtype)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(6))
    assert torch.equal(kern.qmatmul(x[perm], w, qtype), full[perm])
    for lo, hi in ((0, 8), (3, 12), (17, 40), (31, 40)):
        assert torch.equal(kern.qmatmul(x[lo:hi], w, qtype), full[lo:hi]), (lo, hi)
    rows = torch.tensor([20, 0, 5, 5, 13], dtype=torch.int64)
    assert torch.equal(kern.qmatmul(x, w, qtype, rows=rows), full[:, rows])


@pytest.mark.parametrize("qtype", K_TYPES, ids=NAMES.get)
def test_the_tiled_kernel_is_the_one_that_runs_from_8_rows(kern: cq.Kernels, qtype: int) -> None:
    """From 8 rows on the products take the tiled kernel: each row's 256-value block becomes one integer sum, not
    row_dots' eight fp32 lanes, so the last bits differ from 7-row calls (both within the reference)."""
    if not kern.simd:
        pytest.skip("the scalar build has no tiled kernel")
    w = make_weights(qtype, 64, 2048, seed=7)
    x = _x(8, 2048, seed=8)
    eight, seven = kern.qmatmul(x, w, qtype), kern.qmatmul(x[:7], w, qtype)
    assert not torch.equal(eight[:7], seven)
    torch.testing.assert_close(eight[:7], seven, rtol=1e-5, atol=1e-5 * float(seven.abs().max()))


def test_merged_products_give_each_matrix_s_bits(kern: cq.Kernels) -> None:
    """qmatmul_many (a layer's merged input projections) with 8+ rows: each matrix as its own qmatmul."""
    ws = [make_weights(cq.Q4_K, n, 512, seed=n) for n in (24, 9, 3)]
    x = _x(33, 512, seed=9)
    outs = kern.qmatmul_many(x, ws, cq.Q4_K)
    for out, w in zip(outs, ws, strict=True):
        assert torch.equal(out, kern.qmatmul(x, w, cq.Q4_K))


def test_the_vnni_free_build_gives_the_same_bits(kern: cq.Kernels) -> None:
    """AVX2 without VNNI spells vpdpbusd as maddubs + madd by ones: the same integers (no int16 saturation with
    weights <= 63 and |activations| <= 127), so the same bits, at the extremes too."""
    if not kern.simd:
        pytest.skip("no AVX2 here: both builds are the scalar dots")
    plain = cq.Kernels(vnni=False)
    assert plain.ok and not plain.vnni
    for qtype in K_TYPES:
        w = make_weights(qtype, 19, 1024, seed=qtype)
        ext = torch.frombuffer(bytearray(_extreme_block(qtype, 1) * 4), dtype=torch.uint8).reshape(1, -1)
        for x in (_x(13, 1024, seed=10), torch.ones(8, 1024)):
            for m in (w, ext):
                assert torch.equal(kern.qmatmul(x, m, qtype), plain.qmatmul(x, m, qtype)), NAMES[qtype]


@pytest.mark.parametrize("qtypes", [(cq.Q4_K, cq.Q4_K, cq.Q6_K), (cq.Q5_K, cq.Q5_K, cq.Q4_K)],
                         ids=lambda qs: "/".join(cq.TYPE_NAMES[q] for q in qs))
def test_routed_experts_with_8_or_more_tokens(kern: cq.Kernels, qtypes: tuple[int, int, int]) -> None:
    """Experts with >= 8 of the call's tokens take the tiled kernel for gate, up and down, the others row_dots, in
    one call: against the fp64 loop, the packed banks and the VNNI-free build."""
    e, d, i = 5, 512, 256
    banks = make_bank(qtypes, e, d, i)
    packed = torch.cat([b.reshape(e, -1) for b in banks], dim=1)
    plain = cq.Kernels(vnni=False) if kern.simd else kern
    for t, k in ((40, 2), (17, 3), (70, 4)):
        idx, wts = routing(t, e, k, seed=t)
        idx[:, 0] = 0  # expert 0: every token (tiles); the rest spread
        counts = torch.bincount(idx.flatten(), minlength=e)
        assert int(counts.max()) >= 8
        x = _x(t, d, seed=t)
        y = kern.moe(x, *banks, qtypes, idx, wts)
        assert_moe_close(y, moe_reference(x, banks, qtypes, idx, wts))
        assert torch.equal(kern.moe_packed(x, packed, i, qtypes, idx, wts), y)
        assert torch.equal(plain.moe(x, *banks, qtypes, idx, wts), y)



@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize(("k", "bs"), [(512, 64), (768, 512), (256, 32)])
def test_split_formats_with_many_rows_match_the_reference(kern: cq.Kernels, fmt: str, k: int, bs: int) -> None:
    """NF4 and INT8 rows of whole 256-value groups against 8+ activation rows; (768, 512): NF4 scale blocks that
    straddle two rows."""
    qt = cq.SPLIT_OF_FORMAT[fmt]
    codes, scales, b = quantized(fmt, 37, k, blocksize=bs, seed=k)
    plain = cq.Kernels(vnni=False) if kern.simd else kern
    for t in (8, 13, 33, 70):
        x = _x(t, k, seed=t)
        x[1] = 0.0
        y = kern.smatmul(x, codes, scales, qt, b)
        check_smatmul(y, x, codes, scales, fmt, b)
        assert torch.equal(y, plain.smatmul(x, codes, scales, qt, b)), t
        perm = torch.randperm(t, generator=torch.Generator().manual_seed(t))
        assert torch.equal(kern.smatmul(x[perm], codes, scales, qt, b), y[perm])
        assert torch.equal(kern.smatmul(x[:8], codes, scales, qt, b), y[:8])


def test_int8_codes_at_their_extremes(kern: cq.Kernels) -> None:
    """INT8 codes of -128, -127 and 127 against activation values of +-127: VNNI reads them as w + 128 (0, 1, 255)
    and takes 128 x sum(a) off, AVX2 as |w| with the sign moved onto a; both exact."""
    k = 512
    codes = torch.tensor([-128, -127, 127, 0], dtype=torch.int8).repeat(k // 4 * 3).reshape(3, k)
    codes[1] = 127
    codes[2] = -128
    scales = torch.tensor([0.5, 2.0, 1.0])
    x = torch.ones(9, k)
    x[1] = -1.0
    x[2, ::3] = -1.0
    y = kern.smatmul(x, codes, scales, cq.INT8, k)
    check_smatmul(y, x, codes, scales, "int8", k)
    if kern.simd:
        assert torch.equal(y, cq.Kernels(vnni=False).smatmul(x, codes, scales, cq.INT8, k))


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_own_expert_rows_with_8_or_more_tokens(kern: cq.Kernels, fmt: str) -> None:
    """The own cache's experts (NF4 / INT8 rows, 512 x 256): an expert with >= 8 of the call's tokens takes the tiled
    split kernel for gate, up and down, the others their dots, in one call."""
    e, d, i = 5, 512, 256
    g = torch.Generator().manual_seed(1)
    bank = wq.QuantExpertBank.from_dense(torch.randn(e, 2 * i, d, generator=g) * 0.05,
                                         torch.randn(e, d, i, generator=g) * 0.05, fmt)
    for t, k in ((40, 2), (17, 3)):
        idx, wts = routing(t, e, k, seed=t)
        idx[:, 0] = 0
        x = _x(t, d, seed=t)
        y = bank(x, idx, wts)
        assert_moe_close(y, own_bank_reference(bank, x, idx, wts))


def test_real_width_smoke(kern: cq.Kernels) -> None:
    """CI's smoke at the model's widths for each tiled path: 64 rows of 2,048 (a projection's, the head's) and of 512
    (an expert's down) against a 32-slot pass's activation rows, every format, against the fp64 references."""
    for k in (2048, 512):
        x = _x(32, k, seed=k)
        for qtype in K_TYPES:
            w = make_weights(qtype, 64, k, seed=qtype)
            assert check_qmatmul(kern.qmatmul(x, w, qtype), x, w, qtype) < 2e-2
        for fmt in ("nf4", "int8"):
            codes, scales, bs = quantized(fmt, 64, k, seed=k)
            y = kern.smatmul(x, codes, scales, cq.SPLIT_OF_FORMAT[fmt], bs)
            assert check_smatmul(y, x, codes, scales, fmt, bs) < 2e-2
