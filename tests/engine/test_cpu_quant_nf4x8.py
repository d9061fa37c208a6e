"""The own cache's NF4 expert rows interleaved in groups of 8 (engine.kernels.x8's NF4 part; the kernels' T_NF4X8,
issue 30): every code and scale keeps its value in a documented place, the kernels read the layout to the fp64
reference with the many-token kernels' bits at any token count (a token's experts are the same alone or in any
batch, on every build), and a CPU load of the cache interleaves its resident banks in memory, leaving the file as
bitsandbytes wrote it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from clover_desk.engine.kernels import cpu_quant as cq
from clover_desk.engine.kernels import triton_moe, x8
from clover_desk.engine.weights import quant as wq
from clover_desk.engine.weights.quant_cache import load_quantized
from clover_desk.engine.weights.tiny import make_tiny
from tests.quant_reference import assert_moe_close, built_kernels, own_bank_reference, routing

D, I, E = 512, 256, 12  # whole 256-value groups over both widths (so the plain rows take the tiled kernels too)


def _bank(e: int = E, d: int = D, i: int = I) -> wq.QuantExpertBank:
    g = torch.Generator().manual_seed(0)
    return wq.QuantExpertBank.from_dense(torch.randn(e, 2 * i, d, generator=g), torch.randn(e, d, i, generator=g))


def _interleaved(bank: wq.QuantExpertBank) -> torch.Tensor:
    lay, out = bank.layout, bank.packed.clone()
    x8.pack_nf4_bank(out, lay.gate_up_codes[0], lay.gate_up_scales[0], 2 * lay.intermediate_size, lay.hidden_size, 64)
    x8.pack_nf4_bank(out, lay.down_codes[0], lay.down_scales[0], lay.hidden_size, lay.intermediate_size, 64)
    return out


def _offsets(lay: wq.ExpertLayout) -> tuple[int, int, int, int]:
    return lay.gate_up_codes[0], lay.down_codes[0], lay.gate_up_scales[0], lay.down_scales[0]


def test_the_nf4_layout_moves_each_code_and_scale_to_its_documented_place() -> None:
    g = torch.Generator().manual_seed(1)
    r, k, bs = 16, 128, 64
    codes = torch.randint(0, 256, (3, r * k // 2), dtype=torch.uint8, generator=g)
    scales = torch.rand(3, r * k // bs, generator=g)
    pc, ps = x8.nf4_pack(codes, scales, k)
    assert pc.shape == codes.shape and ps.shape == scales.shape and not torch.equal(pc, codes)
    uc, us = x8.nf4_unpack(pc, ps, k)
    assert torch.equal(uc, codes) and torch.equal(us, scales)
    plain = codes[2].reshape(r, k // 2)
    value = torch.stack([plain >> 4, plain & 15], -1).reshape(r, k)  # bitsandbytes: the first code high
    grp = pc[2].reshape(2, 8 * k // 2)[1]  # group 1: rows 8-15
    for row in range(8):
        for v in range(k):  # step c's 128 bytes; byte 32 (quad % 4) + 4 row + v % 4; the high nibble for l >= 16
            c, l = divmod(v, 32)
            byte = int(grp[128 * c + 32 * (l % 16 // 4) + 4 * row + l % 4])
            assert (byte >> 4 if l >= 16 else byte & 15) == int(value[8 + row, v]), (row, v)
        for j in range(k // bs):  # scale j of row 8 + row at 8 j + row of the group's scales
            assert ps[2, 8 * (k // bs) + 8 * j + row] == scales[2, (8 + row) * (k // bs) + j]
    with pytest.raises(ValueError, match="multiple of 8"):
        x8.nf4_pack(codes[:, : 12 * k // 2], scales[:, : 12 * k // bs], k)


def test_the_c_packing_of_an_nf4_bank_equals_the_reference_and_undoes() -> None:
    bank = _bank(e=5, d=256, i=64)
    lay, got = bank.layout, _interleaved(bank)
    want = bank.packed.clone()
    for (co, cn), (so, sn), width in ((lay.gate_up_codes, lay.gate_up_scales, lay.hidden_size),
                                      (lay.down_codes, lay.down_scales, lay.intermediate_size)):
        c, s = x8.nf4_pack(bank.packed[:, co : co + cn], bank.packed[:, so : so + sn].contiguous().view(torch.float32),
                           width)
        want[:, co : co + cn], want[:, so : so + sn] = c, s.contiguous().view(torch.uint8)
    assert torch.equal(got, want)
    x8.pack_nf4_bank(got, lay.gate_up_codes[0], lay.gate_up_scales[0], 128, 256, 64, undo=True)
    x8.pack_nf4_bank(got, lay.down_codes[0], lay.down_scales[0], 256, 64, 64, undo=True)
    assert torch.equal(got, bank.packed)
    with pytest.raises(ValueError, match="does not fit"):
        x8.pack_nf4_bank(got, lay.down_codes[0], lay.down_scales[0], 256, 96, 64)  # 96 values: not whole blocks


@pytest.mark.parametrize("build", ["native", "no-vnni", "scalar"])
def test_interleaved_nf4_experts_match_the_reference_with_the_same_bits_alone_or_batched(build: str) -> None:
    native = built_kernels()
    kern = {"native": native, "scalar": built_kernels(scalar=True), "no-vnni": cq.Kernels(vnni=False)}[build]
    assert kern.ok, kern.reason
    bank = _bank()
    lay, p8 = bank.layout, _interleaved(bank)
    for t in (1, 2, 5, 40):  # 40 tokens of 4 experts over 12: every expert >= 8 tokens (the plain rows' tiles)
        x = torch.randn(t, D, generator=torch.Generator().manual_seed(t))
        idx, wts = routing(t, E, 4, seed=t)
        y = kern.moe_rows(x, p8, _offsets(lay), I, cq.NF4X8, (64, 64), idx, wts)
        assert_moe_close(y, own_bank_reference(bank, x, idx, wts))
        if build != "native":  # the integers are exact and the fp32 steps the same: every build's bits are one
            assert torch.equal(y, native.moe_rows(x, p8, _offsets(lay), I, cq.NF4X8, (64, 64), idx, wts))
        for j in range(t):  # each token alone
            one = kern.moe_rows(x[j : j + 1], p8, _offsets(lay), I, cq.NF4X8, (64, 64), idx[j : j + 1], wts[j : j + 1])
            assert torch.equal(one[0], y[j])
    assert int(idx.flatten().bincount(minlength=E).min()) >= 8
    plain = native.moe_rows(x, bank.packed, _offsets(lay), I, cq.NF4, (64, 64), idx, wts)
    assert torch.equal(plain, y)  # the plain rows' tiled kernels: the same bits
    assert not torch.equal(native.moe_rows(x[:1], bank.packed, _offsets(lay), I, cq.NF4, (64, 64), idx[:1], wts[:1])[0],
                           y[0])  # (unlike their one-token dots, two fp32 chains a row)


def test_a_cpu_load_of_the_cache_interleaves_its_nf4_experts_in_memory_only(wide: Path, tmp_path: Path) -> None:
    if not cq.available():
        pytest.skip(f"CPU kernels unavailable: {cq.reason()}")
    ids = torch.tensor([5, 17, 30, 41, 9, 25, 7, 66, 12, 3, 99, 114])
    model, report = load_quantized(wide, cache_root=tmp_path)
    banks = [m for m in model.modules() if isinstance(m, wq.QuantExpertBank)]
    assert banks and all(b.layout.x8 for b in banks)
    assert "x8" not in banks[0].layout.to_dict()  # never written to a manifest
    assert not triton_moe.supports(banks[0].layout)  # the GPU kernel reads bitsandbytes' order only
    assert triton_moe.supports(dataclasses.replace(banks[0].layout, x8=False))
    before = cq.set_enabled(False)
    try:  # the file's rows, dequantized: what the bank holds, back in the cache's order
        plain, _ = load_quantized(wide, cache_root=tmp_path, verify="full")  # the file still checks: not rewritten
        assert not any(b.layout.x8 for b in plain.modules() if isinstance(b, wq.QuantExpertBank))
        with torch.no_grad():
            want = plain(ids, 0, None).float()
            torch.testing.assert_close(model(ids, 0, None).float(), want, rtol=1e-5, atol=1e-5)
    finally:
        cq.set_enabled(before)
    with torch.no_grad():
        got = model(ids, 0, None).float()
        one = model(ids[:1], 0, None).float()  # one token: the AR step's whole-block C call (engine.kernels.cpu_token)
        one_plain = plain(ids[:1], 0, None).float()  # the plain rows' one-token dots (other roundings)
    assert _kl(want, got) <= 1e-3
    assert 0 < _kl(one_plain, one) <= 1e-5
    bank = banks[0]  # the kernels' path through the layer's bank: the reference on the rows in the cache's order
    x = torch.randn(6, bank.hidden_size, generator=torch.Generator().manual_seed(2))
    idx, wts = routing(6, bank.num_experts, 4, seed=2)
    plain_bank = next(b for b in plain.modules() if isinstance(b, wq.QuantExpertBank))
    assert_moe_close(bank(x, idx, wts), own_bank_reference(plain_bank, x, idx, wts))
    assert torch.equal(own_bank_reference(bank, x, idx, wts), own_bank_reference(plain_bank, x, idx, wts))


def _kl(want: torch.Tensor, got: torch.Tensor) -> float:
    """Mean over positions of KL(softmax(want) || softmax(got)), logits [T, V]."""
    logp, logq = want.double().log_softmax(-1), got.double().log_softmax(-1)
    return float((logp.exp() * (logp - logq)).sum(-1).mean())


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Clover whose experts are 64 wide (whole NF4 blocks a row) with hidden 256."""
    return make_tiny(tmp_path_factory.mktemp("wide-nf4x8"), seed=4, hidden=256, moe_intermediate=64,
                     tokenizer_vocab=512)
