"""The fused NF4 MoE Triton kernel (``engine.triton_moe``) against the dequantize-then-matmul reference, run on the
CPU by Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is first imported) at small shapes: routed
output equal within float32 rounding, for a resident bank (rows = expert ids) and a slot pool (rows from a
device-side expert -> slot table), with ragged sizes that exercise the masks."""

from __future__ import annotations

import pytest

from tests.triton_child import run_interpreted


CHILD = r'''
import torch
from engine.quant import QuantExpertBank, routed_forward_reference
from engine.triton_moe import fused_nf4_moe

torch.manual_seed(0)
for e, d, i, t, k in ((8, 64, 32, 1, 2), (8, 128, 96, 5, 3), (16, 96, 80, 4, 4)):
    bank = QuantExpertBank.from_dense(torch.randn(e, 2 * i, d) * 0.1, torch.randn(e, d, i) * 0.1, "nf4", 64)
    x = torch.randn(t, d)
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k), -1)
    ref = routed_forward_reference(x, idx, w, e, bank.layout, lambda j: bank.packed[j])
    fused = fused_nf4_moe(x, bank.packed, bank.layout, idx, w)
    err = (fused - ref).abs().max().item() / ref.abs().max().item()
    assert err < 1e-5, (e, d, i, t, k, err)
    # a slot pool: the experts sit in other rows, named by a table
    slot_of = torch.randperm(e)
    pool = torch.empty_like(bank.packed)
    pool[slot_of] = bank.packed
    pooled = fused_nf4_moe(x, pool, bank.layout, slot_of[idx], w)
    assert torch.equal(pooled, fused)
print("ok")
'''


def test_fused_nf4_moe_equals_the_dequantize_then_matmul_reference() -> None:
    pytest.importorskip("triton")
    run_interpreted(CHILD)
