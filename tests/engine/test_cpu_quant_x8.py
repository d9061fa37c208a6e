"""Q4_K / Q6_K expert rows interleaved in groups of 8 (engine.kernels.x8; the kernels' T_Q4_KX8 / T_Q6_KX8, issue
30): the layout keeps every byte, the kernels read it to the fp64 reference, a token's experts give the same bits
alone or in any batch (the many-token kernels' arithmetic at any token count), and a GGUF model on the CPU interleaves
its experts at load and still dequantizes them exactly where the kernels are off."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from clover_desk.engine.kernels import cpu_quant as cq
from clover_desk.engine.kernels import triton_moe, x8
from clover_desk.engine.weights.gguf.model import GGUFExpertBank, load_gguf_model
from clover_desk.engine.weights.gguf.writer import write_gguf
from clover_desk.engine.weights.tiny import make_tiny
from tests.quant_reference import assert_moe_close, built_kernels, make_bank, moe_reference, routing

D, I, E = 512, 256, 12  # whole Q4_K blocks over both widths; rows in whole groups of 8


def _packed(qtypes: tuple[int, int, int]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    banks = make_bank(qtypes, E, D, I)
    return torch.cat([b.reshape(E, -1) for b in banks], 1).contiguous(), banks


def _interleaved(packed: torch.Tensor, qtypes: tuple[int, int, int]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The bank with its Q4_K / Q6_K matrices interleaved (C), and the kernel types."""
    out, at, kinds = packed.clone(), 0, []
    for q, rows, width in zip(qtypes, (I, I, D), (D, D, I)):
        rb = cq.row_bytes(q, width)
        if q in x8.KERNEL_TYPE:
            x8.pack_bank(out, at, rows, rb, q)
        kinds.append(x8.KERNEL_TYPE.get(q, q))
        at += rows * rb
    return out, tuple(kinds)


def test_the_layout_keeps_every_byte_and_unpacks_to_the_rows() -> None:
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 256, (3, 16, 2 * 144), dtype=torch.uint8, generator=g)
    packed = x8.pack(rows)
    assert packed.shape == rows.shape and not torch.equal(packed, rows)
    assert torch.equal(x8.unpack(packed), rows)
    assert torch.equal(packed.flatten().sort().values, rows.flatten().sort().values)  # a permutation of the bytes
    # the documented places: group 1 (rows 8-15) of matrix 2, its block 1 (bytes 1152 .. 2303 of the group)
    grp = packed[2, 8:16].reshape(-1)[1152:2304]
    for r in range(8):
        one = rows[2, 8 + r, 144:288]  # row 8 + r's block 1
        assert torch.equal(grp[2 * r : 2 * r + 2], one[0:2])  # d
        assert torch.equal(grp[16 + 2 * r : 18 + 2 * r], one[2:4])  # dmin
        for k in range(3):  # the packed scales, dword k
            assert torch.equal(grp[32 + 32 * k + 4 * r : 36 + 32 * k + 4 * r], one[4 + 4 * k : 8 + 4 * k])
        for c in range(4):
            for i in range(8):  # nibble bytes 4i .. 4i+3 of chunk c
                at = 128 + ((8 * c + i) * 8 + r) * 4
                assert torch.equal(grp[at : at + 4], one[16 + 32 * c + 4 * i : 20 + 32 * c + 4 * i])
    with pytest.raises(ValueError, match="multiple of 8"):
        x8.pack(rows[:, :12])


def _q6_value(one: torch.Tensor, v: int) -> int:
    """Value v (0-255) of a 210-byte Q6_K block, 0-63, spelled out from the format (ql low nibbles for the first
    64 values of each half, high nibbles for the next 64; two bits each from qh)."""
    h, m, l = v // 128, v % 128 // 32, v % 32
    lo, hb = int(one[64 * h + l + 32 * (m % 2)]), int(one[128 + 32 * h + l])
    return ((lo & 15) if m < 2 else (lo >> 4)) | ((hb >> (2 * m)) & 3) << 4


def test_the_q6_k_layout_re_packs_each_value_and_unpacks_to_the_rows() -> None:
    rows = torch.randint(0, 256, (2, 8, 3 * 210), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = x8.pack(rows, cq.Q6_K)
    assert torch.equal(x8.unpack(packed, cq.Q6_K), rows) and not torch.equal(packed, rows)
    grp = packed[1].reshape(-1)[2 * 1680 : 3 * 1680]  # matrix 1, block 2 of its only group
    for r in range(8):
        one = rows[1, r, 420:630]
        assert torch.equal(grp[2 * r : 2 * r + 2], one[208:210])  # d
        for j in range(16):
            assert grp[16 + 8 * j + r] == one[192 + j]  # scale j
        for h in range(2):
            for i in range(8):
                for k in range(4):  # vector t of quad i: v_t | ((v_3 >> 2t) & 3) << 6
                    v = [_q6_value(one, 128 * h + 32 * m + 4 * i + k) for m in range(4)]
                    for t in range(3):
                        assert int(grp[144 + ((8 * h + i) * 3 + t) * 32 + 4 * r + k]) == v[t] | ((v[3] >> 2 * t) & 3) << 6
    with pytest.raises(ValueError, match="not interleaved"):
        x8.pack(rows, cq.Q5_K)


def test_the_c_packing_of_a_bank_equals_the_reference_and_undoes() -> None:
    built_kernels()
    qtypes = (cq.Q4_K, cq.Q4_K, cq.Q6_K)
    packed, _ = _packed(qtypes)
    p8, _ = _interleaved(packed, qtypes)
    rb, rd = cq.row_bytes(cq.Q4_K, D), cq.row_bytes(cq.Q6_K, I)
    segments = ((0, I, rb, cq.Q4_K), (I * rb, I, rb, cq.Q4_K), (2 * I * rb, D, rd, cq.Q6_K))
    for at, rows, width, q in segments:  # each matrix interleaved as the reference does it
        want = x8.pack(packed[:, at : at + rows * width].reshape(E, rows, width), q).reshape(E, -1)
        assert torch.equal(p8[:, at : at + rows * width], want)
    back = p8.clone()
    for at, rows, width, q in segments:
        x8.pack_bank(back, at, rows, width, q, undo=True)
    assert torch.equal(back, packed)
    with pytest.raises(ValueError, match="does not fit"):
        x8.pack_bank(p8, p8.shape[1] - 10, I, rb)


@pytest.mark.parametrize("build", ["native", "scalar"])
@pytest.mark.parametrize("down", [cq.Q4_K, cq.Q6_K])
def test_interleaved_experts_match_the_reference_and_a_token_s_bits_do_not_depend_on_the_batch(
        build: str, down: int) -> None:
    kern = built_kernels(scalar=build == "scalar")
    qtypes = (cq.Q4_K, cq.Q4_K, down)
    packed, banks = _packed(qtypes)
    p8, kinds = _interleaved(packed, qtypes)
    for t in (1, 2, 5, 40):  # 40 tokens of 4 experts over 12: every expert >= 8 tokens (the many-token kernels)
        x = torch.randn(t, D, generator=torch.Generator().manual_seed(t))
        idx, wts = routing(t, E, 4, seed=t)
        y = kern.moe_packed(x, p8, I, kinds, idx, wts)
        assert_moe_close(y, moe_reference(x, banks, qtypes, idx, wts))
        for j in range(t):  # each token alone: the few-token kernels, the same bits
            assert torch.equal(kern.moe_packed(x[j : j + 1], p8, I, kinds, idx[j : j + 1], wts[j : j + 1])[0], y[j])
    if build == "native":  # the plain rows' many-token kernels: the same bits again
        assert torch.equal(kern.moe_packed(x, packed, I, qtypes, idx, wts), y)
        assert not torch.equal(kern.moe_packed(x[:1], packed, I, qtypes, idx[:1], wts[:1])[0], y[0])  # (unlike
        # their few-token dots, whose 8 lanes per row round apart)


def test_gate_and_up_interleaved_together_or_refused() -> None:
    kern = built_kernels()
    packed, _ = _packed((cq.Q4_K,) * 3)
    x = torch.randn(2, D)
    idx, wts = routing(2, E, 4, seed=1)
    with pytest.raises(RuntimeError, match="unsupported"):
        kern.moe_packed(x, packed, I, (cq.Q4_KX8, cq.Q4_K, cq.Q4_K), idx, wts)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_a_gguf_model_on_the_cpu_interleaves_its_k_quant_experts(wide: Path, tmp_path: Path, qtype: str) -> None:
    if not cq.available():
        pytest.skip(f"CPU kernels unavailable: {cq.reason()}")
    path = write_gguf(wide, tmp_path / f"wide-{qtype}.gguf", qtype, layout="fork")[0]
    prompt = torch.tensor([5, 9, 2, 7, 11, 3, 8, 1])
    before = cq.set_enabled(False)
    try:
        plain = load_gguf_model(path).model
        want = plain(prompt)  # every expert dequantized from the file's rows
    finally:
        cq.set_enabled(before)
    model = load_gguf_model(path).model
    banks = [m for m in model.modules() if isinstance(m, GGUFExpertBank)]
    assert banks and all(b.layout.x8 == (True, True, False) for b in banks)  # Q8_0 down: 32-wide rows
    assert banks[0].layout.kernel_qtypes[:2] == (x8.KERNEL_TYPE[banks[0].layout.qtypes[0]],) * 2
    assert not triton_moe.supports(banks[0].layout)  # the fused GPU kernel reads the file's blocks only
    assert triton_moe.supports(dataclasses.replace(banks[0].layout, x8=(False, False, False)))
    assert all(b.layout.x8 == (False, False, False) for b in plain.modules() if isinstance(b, GGUFExpertBank))
    with torch.no_grad():
        fast = model(prompt)
        logp, logq = want.double().log_softmax(-1), fast.double().log_softmax(-1)
        assert float((logp.exp() * (logp - logq)).sum(-1).mean()) <= 1e-3
        before = cq.set_enabled(False)  # the same interleaved banks dequantized: back in the file's order
        try:
            torch.testing.assert_close(model(prompt), want, rtol=1e-5, atol=1e-5)
        finally:
            cq.set_enabled(before)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Clover with hidden 256 (whole K-format blocks) and experts of 32 rows (whole groups of 8)."""
    return make_tiny(tmp_path_factory.mktemp("wide-x8"), seed=3, hidden=256, tokenizer_vocab=512)
