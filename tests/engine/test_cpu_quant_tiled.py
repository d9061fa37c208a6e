"""NF4 with many activation rows (issue 30): each weight row decoded once for all rows of x (``cpu_quant.set_tiled``,
on by default) instead of once per row. The per-(row, token) fp32 operations are the same, in the same order, so
both paths must give bit-identical results; against the fp64 references of test_cpu_quant_own.py as well, at tiny
widths and at the model's real widths (hidden 2048, expert width 512), on the AVX2 build and the scalar one.

The C side decodes once from 8 activation rows of one matrix on (``SPLIT_DEC_MIN_ROWS``), so the cases below mix
experts with more and fewer tokens than that, and widths whose NF4 blocks straddle rows. Widths of whole 256-value
groups (all of Clover's) take the tiled split kernel instead (``kts``, tests/engine/test_cpu_quant_ktiles.py) under
either setting, so here they only show that the setting changes nothing; the widths that test the decode-once
path itself are the ones that are not multiples of 256.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor

from clover_desk.engine.kernels import cpu_quant as cq
from clover_desk.engine.weights import quant as wq
from tests.quant_reference import (
    assert_moe_close,
    check_smatmul,
    kern,  # noqa: F401 - a fixture
    own_bank_reference,
    quantized,
    scalar,  # noqa: F401 - a fixture
)


@pytest.fixture(autouse=True)
def tiled_restored() -> Iterator[None]:
    before = cq.set_tiled(True)
    yield
    cq.set_tiled(before)


def both_paths(fn: Callable[[], Tensor]) -> tuple[Tensor, Tensor]:
    """(decoded once, decoded per row) results of the same call."""
    cq.set_tiled(True)
    once = fn()
    cq.set_tiled(False)
    per_row = fn()
    cq.set_tiled(True)
    return once, per_row


def skewed_routing(t: int, e: int, k: int, seed: int) -> tuple[Tensor, Tensor]:
    """Expert 0 in every token's top-k (>= 8 tokens: decoded once), the rest spread (some with fewer than 8)."""
    g = torch.Generator().manual_seed(seed)
    rest = torch.stack([torch.randperm(e - 1, generator=g)[: k - 1] + 1 for _ in range(t)])
    idx = torch.cat([torch.zeros(t, 1, dtype=torch.int64), rest], dim=1)
    wts = torch.softmax(torch.randn(t, k, generator=g), -1)
    return idx, wts


@pytest.mark.parametrize("t", [2, 8, 9, 33, 70])
@pytest.mark.parametrize(("n", "k", "bs"), [(37, 128, 64), (5, 96, 32), (3, 64, 128)])
def test_nf4_decoded_once_is_bit_identical(kern: cq.Kernels, t: int, n: int, k: int, bs: int) -> None:
    """Odd row counts, odd activation-step counts (96 = 3 steps: the odd step goes to the first accumulator) and
    blocks straddling rows (64-wide rows of 128-value blocks); T across the 8-row threshold and the 64-row tile."""
    codes, scales, bs = quantized("nf4", n, k, blocksize=bs, seed=t)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(100 + t))
    once, per_row = both_paths(lambda: kern.smatmul(x, codes, scales, cq.NF4, bs))
    assert torch.equal(once, per_row)
    check_smatmul(once, x, codes, scales, "nf4", bs)


def test_int8_keeps_its_path(kern: cq.Kernels) -> None:
    codes, scales, bs = quantized("int8", 19, 128, seed=2)
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(2))
    once, per_row = both_paths(lambda: kern.smatmul(x, codes, scales, cq.INT8, bs))
    assert torch.equal(once, per_row)
    check_smatmul(once, x, codes, scales, "int8", bs)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_own_expert_rows_decoded_once(kern: cq.Kernels, fmt: str) -> None:
    """moe_rows through the tiled driver: bit-identical to the per-row path and close to the fp64 reference."""
    e, d, i, t = 12, 256, 96, 24
    g = torch.Generator().manual_seed(11)
    bank = wq.QuantExpertBank.from_dense(torch.randn(e, 2 * i, d, generator=g) * 0.05,
                                         torch.randn(e, d, i, generator=g) * 0.05, fmt)
    x = torch.randn(t, d, generator=g)
    idx, wts = skewed_routing(t, e, 3, seed=4)
    assert int((idx == 0).sum()) >= 8 and int(torch.bincount(idx.reshape(-1), minlength=e).min()) < 8
    once, per_row = both_paths(lambda: bank(x, idx, wts))
    assert torch.equal(once, per_row)
    assert_moe_close(once, own_bank_reference(bank, x, idx, wts))


def test_scalar_build_agrees(kern: cq.Kernels, scalar: cq.Kernels) -> None:
    """The scalar build has no decoded path: the driver must still give its per-row results, close to AVX2's."""
    codes, scales, bs = quantized("nf4", 21, 128, seed=5)
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(5))
    once, per_row = both_paths(lambda: scalar.smatmul(x, codes, scales, cq.NF4, bs))
    assert torch.equal(once, per_row)
    check_smatmul(once, x, codes, scales, "nf4", bs)
    y = kern.smatmul(x, codes, scales, cq.NF4, bs)
    assert torch.allclose(once, y, rtol=1e-5, atol=1e-5 * float(y.abs().max()))


def test_scalar_build_expert_rows_agree(scalar: cq.Kernels) -> None:
    """NF4 moe_rows on the scalar build: the routed-MoE driver in tasks of 4 weight rows (tiled) and of one row
    (plain) gives the same bits, for experts with >= 8 tokens and with fewer."""
    e, d, i, t = 6, 160, 96, 12
    g = torch.Generator().manual_seed(13)
    bank = wq.QuantExpertBank.from_dense(torch.randn(e, 2 * i, d, generator=g) * 0.05,
                                         torch.randn(e, d, i, generator=g) * 0.05, "nf4")
    lay = bank.layout
    offsets = (lay.gate_up_codes[0], lay.down_codes[0], lay.gate_up_scales[0], lay.down_scales[0])
    x = torch.randn(t, d, generator=g)
    idx, wts = skewed_routing(t, e, 3, seed=6)
    once, per_row = both_paths(lambda: scalar.moe_rows(x, bank.packed, offsets, i, cq.NF4, (lay.blocksize,) * 2,
                                                       idx, wts))
    assert torch.equal(once, per_row)
    assert_moe_close(once, own_bank_reference(bank, x, idx, wts))


def test_real_width_smoke(kern: cq.Kernels) -> None:
    """CI smoke at the model's widths: 64 rows of an expert's gate [512, 2048] and of its down [2048, 512] for
    T = 32, and a one-layer bank of 4 real-width NF4 experts at T = 32 (every expert past the 8-row threshold). At
    these widths both settings take the tiled split kernel: the references are the check, the equality says the
    setting changes nothing."""
    for n, k in ((64, 2048), (64, 512)):
        codes, scales, bs = quantized("nf4", n, k, seed=n + k)
        x = torch.randn(32, k, generator=torch.Generator().manual_seed(k))
        once, per_row = both_paths(lambda: kern.smatmul(x, codes, scales, cq.NF4, bs))
        assert torch.equal(once, per_row)
        assert check_smatmul(once, x, codes, scales, "nf4", bs) < 2e-2
    e, d, i = 4, 2048, 512
    g = torch.Generator().manual_seed(7)
    bank = wq.QuantExpertBank.from_dense(torch.randn(e, 2 * i, d, generator=g) * 0.02,
                                         torch.randn(e, d, i, generator=g) * 0.02, "nf4")
    x = torch.randn(32, d, generator=g)
    idx, wts = skewed_routing(32, e, 2, seed=1)
    assert int(torch.bincount(idx.reshape(-1), minlength=e).max()) >= 8
    once, per_row = both_paths(lambda: bank(x, idx, wts))
    assert torch.equal(once, per_row)
    assert_moe_close(once, own_bank_reference(bank, x, idx, wts))
