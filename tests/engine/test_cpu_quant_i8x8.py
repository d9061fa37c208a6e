"""The own cache's INT8 projections with their rows interleaved in groups of 8 (engine.kernels.x8's INT8 part; the
kernels' T_I8X8, issue 30): every code and scale keeps its value in a documented place, the kernels read the layout to
the fp64 reference with the tiled kernels' bits at any token count (a token's row is the same alone or in any
batch, on every build), QuantLinear keeps its interface (dequantized weight, state dict, moves) while interleaved,
and a CPU load of the cache interleaves the projections in memory only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from clover_desk.engine.kernels import cpu_quant as cq
from clover_desk.engine.kernels import x8
from clover_desk.engine.weights import quant as wq
from clover_desk.engine.weights.quant_cache import load_quantized
from clover_desk.engine.weights.tiny import make_tiny
from tests.quant_reference import built_kernels, check_smatmul, quantized


def test_the_int8_layout_moves_each_code_and_scale_to_its_documented_place() -> None:
    g = torch.Generator().manual_seed(1)
    r, k, bs = 16, 128, 64
    codes = torch.randint(-127, 128, (3, r, k), dtype=torch.int8, generator=g)
    scales = torch.rand(3, r * k // bs, generator=g)
    pc, ps = x8.i8_pack(codes, scales)
    assert pc.shape == codes.shape and ps.shape == scales.shape and not torch.equal(pc, codes)
    uc, us = x8.i8_unpack(pc, ps)
    assert torch.equal(uc, codes) and torch.equal(us, scales)
    grp = pc[2].reshape(2, 8 * k)[1]  # group 1: rows 8-15
    for row in range(8):
        for v in range(k):  # step c's 256 bytes: byte 32 (l / 4) + 4 row + l % 4
            c, l = divmod(v, 32)
            assert int(grp[256 * c + 32 * (l // 4) + 4 * row + l % 4]) == int(codes[2, 8 + row, v]), (row, v)
        for j in range(k // bs):  # scale j of row 8 + row at 8 j + row of the group's scales
            assert ps[2, 8 * (k // bs) + 8 * j + row] == scales[2, (8 + row) * (k // bs) + j]
    one_a_row = torch.rand(r)  # the cache's INT8: one scale a row, which the layout leaves in place
    assert torch.equal(x8.i8_pack(codes[0], one_a_row)[1], one_a_row)
    with pytest.raises(ValueError, match="multiple of 8"):
        x8.i8_pack(codes[:, :12], scales[:, : 12 * k // bs])


def test_the_c_packing_equals_the_reference_and_undoes() -> None:
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(-127, 128, (24, 96), dtype=torch.int8, generator=g)
    for scales, bs in ((torch.rand(24, generator=g), None), (torch.rand(24 * 96 // 32, generator=g), 32)):
        c, s = codes.clone(), scales.clone()
        x8.pack_i8(c, s, bs)
        want_c, want_s = x8.i8_pack(codes, scales)
        assert torch.equal(c, want_c) and torch.equal(s, want_s)
        x8.pack_i8(c, s, bs, undo=True)
        assert torch.equal(c, codes) and torch.equal(s, scales)
    with pytest.raises(ValueError, match="multiple of 8"):
        x8.pack_i8(codes[:20].clone(), torch.rand(20))
    with pytest.raises(ValueError, match="scales"):
        x8.pack_i8(codes.clone(), torch.rand(23))


@pytest.mark.parametrize("build", ["native", "no-vnni", "scalar"])
@pytest.mark.parametrize("k", [512, 96])  # whole 256-value groups (the plain rows' tiles from 8 rows), and not
def test_interleaved_int8_matches_the_reference_with_the_same_bits_alone_or_batched(build: str, k: int) -> None:
    native = built_kernels()
    kern = {"native": native, "scalar": built_kernels(scalar=True), "no-vnni": cq.Kernels(vnni=False)}[build]
    assert kern.ok, kern.reason
    n = 40
    codes, scales, bs = quantized("int8", n, k, seed=k)
    pc, ps = x8.i8_pack(codes, scales)
    for t in (1, 3, 8, 13, 40):
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
        y = kern.smatmul(x, pc, ps, cq.INT8X8, bs)
        assert check_smatmul(y, x, codes, scales, "int8", bs) < 2e-2
        if build != "native":  # exact integers, the same fp32 steps: one set of bits on every build
            assert torch.equal(y, native.smatmul(x, pc, ps, cq.INT8X8, bs))
        for j in range(t):  # each token alone
            assert torch.equal(kern.smatmul(x[j : j + 1], pc, ps, cq.INT8X8, bs)[0], y[j])
        plain = native.smatmul(x, codes, scales, cq.INT8, bs)
        if k % 256 == 0 and t >= 8:  # the plain rows' tiled kernel: the same bits
            assert torch.equal(plain, y)
    assert not torch.equal(native.smatmul(x[:1], codes, scales, cq.INT8, bs)[0], y[0])  # (its one-row dot: two chains)
    with pytest.raises(ValueError, match="groups of 8"):
        native.smatmul(x, pc[:12], ps[:12], cq.INT8X8, bs)


def test_real_width_smoke() -> None:
    """CI smoke of the interleaved INT8 path at Clover's widths: 64 rows of [., 2048] and [., 512] for T = 1 and 32."""
    built_kernels()
    for n, k in ((64, 2048), (64, 512)):
        for t in (1, 32):
            x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
            codes, scales, bs = quantized("int8", n, k, seed=t)
            pc, ps = x8.i8_pack(codes, scales)
            assert check_smatmul(cq.smatmul(x, pc, ps, cq.INT8X8, bs, n), x, codes, scales, "int8", bs) < 2e-2


def _layer(out: int = 24, inp: int = 256, bias: bool = False) -> wq.QuantLinear:
    g = torch.Generator().manual_seed(3)
    lin = nn.Linear(inp, out, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out, inp, generator=g) * 0.05)
    return wq.QuantLinear.from_linear(lin, "int8")


def test_an_interleaved_quant_linear_keeps_its_interface() -> None:
    built_kernels()
    layer, plain = _layer(), _layer()
    weight, state = plain.dequantized(), {k: v.clone() for k, v in plain.state_dict().items()}
    x32, x1 = torch.randn(32, 256), torch.randn(1, 256)
    y32, mat = plain(x32), plain.cpu_mat()
    assert layer.interleave() and layer.x8 and not layer.interleave()  # once
    assert not torch.equal(layer.codes, plain.codes)
    assert torch.equal(layer(x32), y32)  # the tiled kernel's bits
    torch.testing.assert_close(layer(x1), plain(x1), rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.dequantized(), weight) and torch.equal(layer.weight, weight)
    assert torch.equal(layer.dequantized(torch.float32, (5, 19)), weight[5:19])  # rows across groups
    assert {k: torch.equal(v, state[k]) for k, v in layer.state_dict().items()} == {k: True for k in state}
    assert layer.cpu_mat()[0] == cq.INT8X8 and mat is not None and mat[0] == cq.INT8
    assert not wq._int8_gemv_applies(layer, x1)  # torch's int8 GEMV reads plain rows only
    before = cq.set_enabled(False)
    try:  # kernels off: the dequantized weight, back in the cache's order
        assert torch.equal(layer(x1), nn.functional.linear(x1, weight))
    finally:
        cq.set_enabled(before)
    other = _layer()
    other.interleave()
    other.load_state_dict(state)  # plain codes copied in: no longer interleaved
    assert not other.x8 and torch.equal(other.dequantized(), weight)
    assert not _layer(out=20).interleave() and not _layer(inp=48).interleave()  # not whole groups / steps
    nf4 = wq.QuantLinear.from_linear(nn.Linear(256, 24), "nf4")
    assert not nf4.interleave()


def test_a_move_off_the_cpu_restores_the_rows() -> None:
    built_kernels()
    layer, plain = _layer(), _layer()
    layer.interleave()
    moved = layer.to("meta")
    assert not moved.x8 and moved.codes.device.type == "meta"
    layer2 = _layer()
    layer2.interleave()
    layer2.to("cpu")  # staying on the CPU keeps the layout
    assert layer2.x8 and torch.equal(layer2.dequantized(), plain.dequantized())


def test_a_cpu_load_of_the_cache_interleaves_its_int8_projections_in_memory_only(wide: Path, tmp_path: Path) -> None:
    built_kernels()
    ids = torch.tensor([5, 17, 30, 41, 9, 25, 7, 66, 12, 3, 99, 114])
    model, _ = load_quantized(wide, cache_root=tmp_path)
    int8 = [m for m in model.modules() if isinstance(m, wq.QuantLinear) and m.fmt == "int8"]
    assert int8 and all(m.x8 for m in int8)
    before = cq.set_enabled(False)
    try:  # the file's rows (it still checks: not rewritten), dequantized
        plain, _ = load_quantized(wide, cache_root=tmp_path, verify="full")
        with torch.no_grad():
            want = plain(ids, 0, None).float()
    finally:
        cq.set_enabled(before)
    assert not any(m.x8 for m in plain.modules() if isinstance(m, wq.QuantLinear))
    with torch.no_grad():
        got = model(ids, 0, None).float()
    logp, logq = want.double().log_softmax(-1), got.double().log_softmax(-1)
    assert float((logp.exp() * (logp - logq)).sum(-1).mean()) <= 1e-3


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Clover with hidden 256 (its projections whole groups of 8 rows of 32-value steps)."""
    return make_tiny(tmp_path_factory.mktemp("wide-i8x8"), seed=5, hidden=256, moe_intermediate=64,
                     tokenizer_vocab=512)
