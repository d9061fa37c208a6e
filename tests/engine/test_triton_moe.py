"""The fused NF4 MoE Triton kernel (``engine.kernels.triton_moe``) against the dequantize-then-matmul reference, run on the
CPU by Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is first imported) at small shapes: routed
output equal within float32 rounding, for a resident bank (rows = expert ids) and a slot pool (rows from a
device-side expert -> slot table), with ragged sizes that exercise the masks."""

from __future__ import annotations

import pytest

from tests.triton_child import run_interpreted

CHILD = r'''
import torch
from clover_desk.engine.weights.quant import QuantExpertBank, routed_forward_reference
from clover_desk.engine.kernels.triton_moe import fused_nf4_moe

torch.manual_seed(0)
# the last two have >= GROUPED_MIN_PAIRS pairs: the grouped kernels (one expert's pairs per block, tl.dot); the
# last routes most tokens to the same few experts (groups of several blocks, most experts unused)
for e, d, i, t, k, skew in ((8, 64, 32, 1, 2, False), (8, 128, 96, 5, 3, False), (16, 96, 80, 4, 4, False),
                            (16, 96, 80, 20, 4, False), (16, 128, 96, 40, 2, True)):
    bank = QuantExpertBank.from_dense(torch.randn(e, 2 * i, d) * 0.1, torch.randn(e, d, i) * 0.1, "nf4", 64)
    x = torch.randn(t, d)
    pick = (lambda: torch.randperm(4)[:k] + 3) if skew else (lambda: torch.randperm(e)[:k])
    idx = torch.stack([pick() for _ in range(t)])
    w = torch.softmax(torch.randn(t, k), -1)
    ref = routed_forward_reference(x, idx, w, e, bank.layout, lambda j: bank.packed[j])
    fused = fused_nf4_moe(x, bank.packed, bank.layout, idx, w)
    err = (fused - ref).abs().max().item() / ref.abs().max().item()
    assert err < 1e-5, (e, d, i, t, k, skew, err)
    # a slot pool: the experts sit in other rows, named by a table
    slot_of = torch.randperm(e)
    pool = torch.empty_like(bank.packed)
    pool[slot_of] = bank.packed
    pooled = fused_nf4_moe(x, pool, bank.layout, slot_of[idx], w)
    assert (pooled - fused).abs().max().item() <= 1e-6 * ref.abs().max().item()  # grouped: other blocks, same sums
print("ok")
'''


def test_fused_nf4_moe_equals_the_dequantize_then_matmul_reference() -> None:
    pytest.importorskip("triton")
    run_interpreted(CHILD)


@pytest.mark.parametrize("skew", [False, True])
def test_group_pairs_puts_every_pair_once_in_blocks_of_one_row(skew: bool) -> None:
    """The grouped kernels' tables (built with torch ops on the device): every pair exactly once, each block's pairs
    all of the block's row, padding only at a group's end, and the blocks past the real ones marked -1."""
    import torch

    from clover_desk.engine.kernels.triton_moe import group_pairs

    gen = torch.Generator().manual_seed(1)
    n_rows, bm = 40, 16
    rows = torch.randint(0, 3 if skew else n_rows, (32, 8), generator=gen)  # [T, K]
    block_rows, pair_ids = group_pairs(rows, n_rows, bm)
    flat = rows.reshape(-1)
    nb = block_rows.numel()
    assert nb == -(-flat.numel() // bm) + min(n_rows, flat.numel()) and pair_ids.numel() == nb * bm
    real = pair_ids[pair_ids >= 0].long()
    assert sorted(real.tolist()) == list(range(flat.numel()))  # every pair once
    blocks = pair_ids.view(nb, bm).long()
    used = 0
    for b in range(nb):
        members = blocks[b][blocks[b] >= 0]
        if block_rows[b] < 0:
            assert members.numel() == 0
            continue
        used += 1
        assert blocks[b][0] >= 0 and (flat[members] == block_rows[b]).all()
        n = members.numel()
        assert (blocks[b][:n] >= 0).all() and (blocks[b][n:] < 0).all()  # padding at the end
    distinct = flat.unique()
    counts = torch.stack([(flat == r).sum() for r in distinct])
    assert used == int(((counts + bm - 1) // bm).sum())


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 32])
def test_fused_nf4_moe_on_cuda_in_bf16_without_a_sync(t: int) -> None:
    """On a GPU, in bf16 (which the interpreter does not emulate): the per-pair kernels (an AR step, T=1) and the
    grouped ones (a 32-slot pass, 256 pairs) against the dequantize-then-matmul path, and neither reads anything
    back to the host (``set_sync_debug_mode("error")``)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton")
    pytest.importorskip("bitsandbytes")
    from clover_desk.engine.kernels.triton_moe import GROUPED_MIN_PAIRS, fused_nf4_moe
    from clover_desk.engine.weights.quant import QuantExpertBank, routed_forward

    e, d, i, k = 64, 256, 128, 8
    gen = torch.Generator().manual_seed(2)
    bank = QuantExpertBank.from_dense(torch.randn(e, 2 * i, d, generator=gen) * d**-0.5,
                                      torch.randn(e, d, i, generator=gen) * i**-0.5, "nf4", 64)
    packed = bank.packed.to("cuda")
    x = torch.randn(t, d, generator=gen).to("cuda", torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to("cuda")
    w = torch.softmax(torch.randn(t, k, generator=gen), -1).to("cuda")
    assert (t * k >= GROUPED_MIN_PAIRS) == (t == 32)
    ref = routed_forward(x, idx, w, e, bank.layout, source=packed).float()
    fused = fused_nf4_moe(x, packed, bank.layout, idx, w)  # first call: compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused = fused_nf4_moe(x, packed, bank.layout, idx, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert fused.dtype == torch.bfloat16
    assert (fused.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
