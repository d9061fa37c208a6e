"""engine.kernels.cpu_quant on the engine's own cache formats (NF4 and per-row INT8: codes + separate fp32 scales),
against fp64 references, and the real-width smoke of every CPU kernel path.

References (as in test_cpu_quant.py):

* tight: x rounded to int8 blocks of 32 exactly as the kernel does, times the weights the kernel multiplies by
  (INT8: the codes times the row scale; NF4: each code's int8 table value round(127 * code) / 127 times the block
  absmax), in fp64. Integer dots are exact, so only fp32 rounding remains: <= 1e-5 * (|xq| @ |W|.T).
* bound: the unrounded x and the true dequantized weights. The activation rounding moves each value by at most
  d/2 per block; NF4's table moves each code by at most 0.5/127 of its block's absmax.
"""

from __future__ import annotations

import math

import pytest
import torch

from clover_desk.engine.kernels import cpu_quant as cq
from clover_desk.engine.weights import quant as wq
from clover_desk.engine.weights.gguf import quants as gq
from clover_desk.engine.weights.gguf.model import GGUFLinear
from tests.quant_reference import (
    assert_moe_close,
    check_qmatmul,
    check_smatmul,
    kern,  # noqa: F401 - a fixture
    make_bank,
    make_weights,
    moe_reference,
    own_bank_reference,
    quantized,
    routing,
    scalar,  # noqa: F401 - a fixture
)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize("t", [1, 3, 32])
def test_smatmul_matches_reference(kern: cq.Kernels, fmt: str, t: int) -> None:
    codes, scales, bs = quantized(fmt, 37, 96, seed=t)  # 96 = 1.5 NF4 blocks: blocks straddle rows
    x = torch.randn(t, 96, generator=torch.Generator().manual_seed(t))
    check_smatmul(kern.smatmul(x, codes, scales, cq.SPLIT_OF_FORMAT[fmt], bs), x, codes, scales, fmt, bs)


def test_nf4_blocksize_128_and_nibble_order(kern: cq.Kernels) -> None:
    codes, scales, bs = quantized("nf4", 10, 256, blocksize=128, seed=5)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    check_smatmul(kern.smatmul(x, codes, scales, cq.NF4, bs), x, codes, scales, "nf4", bs)
    # one code, by hand: value 0 of row 0 is the HIGH nibble of byte 0
    one = torch.zeros(16, dtype=torch.uint8)
    one[0] = 0xF0  # value 0 -> code 15 (+1.0), value 1 -> code 0 (-1.0)
    e0 = torch.zeros(1, 32)
    e0[0, 0] = 1.0
    y = kern.smatmul(e0, one, torch.tensor([2.0]), cq.NF4, 32)
    assert float(y) == pytest.approx(2.0, rel=1e-6)
    e0[0, 0], e0[0, 1] = 0.0, 1.0
    assert float(kern.smatmul(e0, one, torch.tensor([2.0]), cq.NF4, 32)) == pytest.approx(-2.0, rel=1e-6)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_scalar_path_agrees(kern: cq.Kernels, scalar: cq.Kernels, fmt: str) -> None:
    codes, scales, bs = quantized(fmt, 19, 128, seed=1)
    for t in (1, 5):
        x = torch.randn(t, 128, generator=torch.Generator().manual_seed(t))
        qt = cq.SPLIT_OF_FORMAT[fmt]
        ys, y = scalar.smatmul(x, codes, scales, qt, bs), kern.smatmul(x, codes, scales, qt, bs)
        check_smatmul(ys, x, codes, scales, fmt, bs)
        assert torch.allclose(ys, y, rtol=1e-5, atol=1e-5 * float(y.abs().max()))


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_own_expert_rows_match_reference(kern: cq.Kernels, fmt: str) -> None:
    e, d, i = 6, 128, 64
    g = torch.Generator().manual_seed(0)
    bank = wq.QuantExpertBank.from_dense(torch.randn(e, 2 * i, d, generator=g), torch.randn(e, d, i, generator=g), fmt)
    for t, k in ((1, 2), (5, 4), (32, 3)):
        idx, wts = routing(t, e, k, seed=t)
        x = torch.randn(t, d, generator=torch.Generator().manual_seed(t))
        y = bank(x, idx, wts)  # routed_forward: the kernels (on by default)
        assert_moe_close(y, own_bank_reference(bank, x, idx, wts))
        before = cq.set_enabled(False)
        try:
            old = bank(x, idx, wts)  # the dequantizing path
        finally:
            cq.set_enabled(before)
        assert not torch.equal(y, old)  # the kernels ran
        assert float((y - old).abs().max() / old.abs().max()) < 3e-2
        # a streamed layer finds its experts through a row index: the same rows, the same numbers
        perm = torch.randperm(e, generator=g)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(e)
        y2 = wq.routed_forward(x, idx, wts, e, bank.layout, source=bank.packed[perm], row_index=inv)
        assert torch.equal(y2, y)


def test_kernels_off_or_odd_widths_keep_the_dequantizing_path(kern: cq.Kernels) -> None:
    lin = torch.nn.Linear(48, 8)  # 48 is not a multiple of 32
    q = wq.QuantLinear.from_linear(lin, "int8")
    x = torch.randn(3, 48)
    torch.testing.assert_close(q(x), torch.nn.functional.linear(x, q.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert not wq.rows_sync_free(64, torch.device("cpu"), wq.ExpertLayout.build(4, 48, 32, "nf4"))
    assert wq.rows_sync_free(64, torch.device("cpu"), wq.ExpertLayout.build(4, 64, 32, "nf4"))
    before = cq.set_enabled(False)
    try:
        assert not wq.rows_sync_free(64, torch.device("cpu"), wq.ExpertLayout.build(4, 64, 32, "nf4"))
    finally:
        cq.set_enabled(before)


@pytest.mark.parametrize("qtype", [cq.Q4_K, cq.Q5_K, cq.Q6_K, cq.Q8_0, cq.Q4_0, cq.NF4, cq.INT8],
                         ids=lambda q: cq.TYPE_NAMES.get(q) or cq.SPLIT_NAMES[q])
def test_real_width_smoke(kern: cq.Kernels, qtype: int) -> None:
    """CI smoke of each CPU kernel path at the model's widths (hidden 2048, expert width 512): 64 rows of an
    expert's gate [512, 2048] and of its down [2048, 512] for T = 1 and 32, and a one-layer bank of 4 real-width
    experts, against the references."""
    for n, k in ((64, 2048), (64, 512)):
        for t in (1, 32):
            x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
            if qtype in cq.SPLIT_NAMES:
                fmt = "nf4" if qtype == cq.NF4 else "int8"
                codes, scales, bs = quantized(fmt, n, k, seed=t)
                assert check_smatmul(cq.smatmul(x, codes, scales, qtype, bs, n), x, codes, scales, fmt, bs) < 2e-2
            else:
                w = make_weights(qtype, n, k, seed=t)
                assert check_qmatmul(cq.qmatmul(x, w, qtype), x, w, qtype) < 2e-2
    e, d, i = 4, 2048, 512
    idx, wts = routing(32, e, 2, seed=1)
    x = torch.randn(32, d, generator=torch.Generator().manual_seed(3))
    if qtype in cq.SPLIT_NAMES:
        g = torch.Generator().manual_seed(7)
        fmt = "nf4" if qtype == cq.NF4 else "int8"
        bank = wq.QuantExpertBank.from_dense(torch.randn(e, 2 * i, d, generator=g) * 0.02,
                                             torch.randn(e, d, i, generator=g) * 0.02, fmt)
        assert_moe_close(bank(x, idx, wts), own_bank_reference(bank, x, idx, wts))
    else:
        banks = make_bank((qtype,) * 3, e, d, i)
        assert_moe_close(cq.moe(x, *banks, (qtype,) * 3, idx, wts), moe_reference(x, banks, (qtype,) * 3, idx, wts))


@pytest.mark.parametrize("t", [1, 32])
def test_q6_k_head_at_real_width_is_the_gguf_paths_product(kern: cq.Kernels, t: int) -> None:
    """The own cache's Q6_K head (a QuantLinear of format q6_k) at Clover's width (K = 2048; 64 of the head's
    rows): the same blocks through the GGUF path's GGUFLinear give the same bits (one kernel), and both hold the
    references against the dequantized blocks (tests/quant_reference.py)."""
    g = torch.Generator().manual_seed(t)
    lin = torch.nn.Linear(2048, 64, bias=False)
    lin.weight.data = torch.randn(64, 2048, generator=g) * 0.02
    own = wq.QuantLinear.from_linear(lin, "q6_k")
    file = GGUFLinear(gq.quantize(lin.weight.data, gq.Q6_K), gq.Q6_K, 2048)
    assert torch.equal(own.codes, file.raw)
    x = torch.randn(t, 2048, generator=g)
    with torch.no_grad():
        y = own(x)
        assert torch.equal(y, file(x))
    assert check_qmatmul(y, x, own.codes, cq.Q6_K) < 2e-2
    before = cq.set_enabled(False)  # the kernels did run: the dequantizing path does not round x to int8 blocks
    try:
        with torch.no_grad():
            assert not torch.equal(own(x), y)
    finally:
        cq.set_enabled(before)


def test_routing_checked_for_both_expert_layouts(kern: cq.Kernels) -> None:
    """moe (GGUF banks) and moe_rows (own rows) check topk_idx / topk_w against x the same way, and a call with no
    tokens returns an empty float32 [0, D] without running the kernel."""
    e, d, i = 2, 256, 256
    banks = make_bank((cq.Q4_K,) * 3, e, d, i)
    bank = wq.QuantExpertBank.from_dense(torch.randn(e, 2 * i, d) * 0.02, torch.randn(e, d, i) * 0.02, "nf4")
    lay = bank.layout
    offsets = (lay.gate_up_codes[0], lay.down_codes[0], lay.gate_up_scales[0], lay.down_scales[0])
    calls = (lambda x, idx, wts: kern.moe(x, *banks, (cq.Q4_K,) * 3, idx, wts),
             lambda x, idx, wts: kern.moe_rows(x, bank.packed, offsets, i, cq.NF4, (lay.blocksize,) * 2, idx, wts))
    idx, wts = routing(3, e, 2, seed=0)
    for call in calls:
        with pytest.raises(ValueError, match="topk_idx"):
            call(torch.randn(2, d), idx, wts)  # 3 rows of routing for 2 tokens
        with pytest.raises(ValueError, match="topk_idx"):
            call(torch.randn(3, d), idx, wts[:, :1])
        empty = call(torch.randn(0, d), idx[:0], wts[:0])
        assert empty.shape == (0, d) and empty.dtype == torch.float32


def test_split_validation_errors(kern: cq.Kernels) -> None:
    codes, scales, bs = quantized("nf4", 4, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        kern.smatmul(torch.randn(1, 48), codes, scales, cq.NF4, bs)
    with pytest.raises(ValueError, match="blocksize"):
        kern.smatmul(torch.randn(1, 64), codes, scales, cq.NF4, 48)
    with pytest.raises(ValueError, match="scales"):
        kern.smatmul(torch.randn(1, 64), codes, scales[:2], cq.NF4, bs)
    with pytest.raises(ValueError, match="split format"):
        kern.smatmul(torch.randn(1, 64), codes, scales, cq.Q4_K, bs)
    with pytest.raises(RuntimeError, match="unsupported"):  # the ggml entry refuses a split type
        cq._raise_for(kern.lib().clover_qmatmul(0, 0, 64, 0, 0, cq.NF4, None, 0, 0, 1), "qmatmul")
    assert math.isfinite(float(kern.smatmul(torch.randn(2, 64, dtype=torch.bfloat16), codes, scales, cq.NF4,
                                            bs).sum()))
