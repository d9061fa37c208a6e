"""Q4_K expert rows interleaved in groups of 8 (engine.kernels.x8; the kernels' T_Q4_KX8, issue 30): the layout keeps
every byte, the kernels read it to the fp64 reference, a token's experts give the same bits alone or in any batch
(the many-token kernels' arithmetic at any token count), and a GGUF model on the CPU interleaves its Q4_K experts at
load and still dequantizes them exactly where the kernels are off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clover_desk.engine.kernels import cpu_quant as cq
from clover_desk.engine.kernels import x8
from clover_desk.engine.weights.gguf.model import GGUFExpertBank, load_gguf_model
from clover_desk.engine.weights.gguf.writer import write_gguf
from clover_desk.engine.weights.tiny import make_tiny
from tests.quant_reference import assert_moe_close, built_kernels, make_bank, moe_reference, routing

D, I, E = 512, 256, 12  # whole Q4_K blocks over both widths; rows in whole groups of 8


def _packed(qtypes: tuple[int, int, int]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    banks = make_bank(qtypes, E, D, I)
    return torch.cat([b.reshape(E, -1) for b in banks], 1).contiguous(), banks


def _interleaved(packed: torch.Tensor, qtypes: tuple[int, int, int]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The bank with its Q4_K matrices interleaved (C), and the kernel types."""
    out, at, kinds = packed.clone(), 0, []
    for q, rows, width in zip(qtypes, (I, I, D), (D, D, I)):
        rb = cq.row_bytes(q, width)
        if q == cq.Q4_K:
            x8.pack_bank(out, at, rows, rb)
        kinds.append(cq.Q4_KX8 if q == cq.Q4_K else q)
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


def test_the_c_packing_of_a_bank_equals_the_reference_and_undoes() -> None:
    built_kernels()
    packed, _ = _packed((cq.Q4_K, cq.Q4_K, cq.Q6_K))
    p8, _ = _interleaved(packed, (cq.Q4_K, cq.Q4_K, cq.Q6_K))
    rb = cq.row_bytes(cq.Q4_K, D)
    for at in (0, I * rb):  # gate, up: interleaved as the reference does it
        want = x8.pack(packed[:, at : at + I * rb].reshape(E, I, rb)).reshape(E, -1)
        assert torch.equal(p8[:, at : at + I * rb], want)
    assert torch.equal(p8[:, 2 * I * rb :], packed[:, 2 * I * rb :])  # Q6_K down untouched
    back = p8.clone()
    for at in (0, I * rb):
        x8.pack_bank(back, at, I, rb, undo=True)
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
        for j in range(t if down == cq.Q4_K else 0):  # each token alone: the few-token kernel, the same bits (a
            # Q6_K down, not interleaved, takes its direct dots below 8 tokens: those round apart from its kt)
            assert torch.equal(kern.moe_packed(x[j : j + 1], p8, I, kinds, idx[j : j + 1], wts[j : j + 1])[0], y[j])
    if build == "native" and down == cq.Q4_K:  # the plain rows' many-token kernels: the same bits again
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


def test_a_gguf_model_on_the_cpu_interleaves_its_q4_k_experts(wide_q4k: Path) -> None:
    if not cq.available():
        pytest.skip(f"CPU kernels unavailable: {cq.reason()}")
    prompt = torch.tensor([5, 9, 2, 7, 11, 3, 8, 1])
    before = cq.set_enabled(False)
    try:
        plain = load_gguf_model(wide_q4k).model
        want = plain(prompt)  # every expert dequantized from the file's rows
    finally:
        cq.set_enabled(before)
    model = load_gguf_model(wide_q4k).model
    banks = [m for m in model.modules() if isinstance(m, GGUFExpertBank)]
    assert banks and all(b.layout.x8 == (True, True, False) for b in banks)  # Q8_0 down: 32-wide rows
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
def wide_q4k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = make_tiny(tmp_path_factory.mktemp("wide-x8"), seed=3, hidden=256, tokenizer_vocab=512)
    return write_gguf(d, tmp_path_factory.mktemp("gguf-x8") / "wide-Q4_K.gguf", "Q4_K", layout="fork")[0]
