"""The fused GGUF MoE Triton kernels (``engine.kernels.triton_moe.fused_gguf_moe``) against the dequantize-then-matmul
reference (``engine.weights.quant.routed_forward`` on the CPU, which dequantizes with ``engine.weights.gguf.quants``), run by
Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is first imported) in a child process:

* the element decode of every supported ggml type (the kernels' ``gguf_at``) equal bit for bit to
  ``gguf_quants.dequantize``, on quantized weights and on random block bytes (every bit of every field used);
* the routed output equal within float32 rounding for each quantized type, a Q4_K_M-like mix (Q4_K gate / up,
  Q6_K down), float experts and a non-square ragged shape (D != I, tiles cut by the masks), for a resident bank
  (rows = expert ids) and a slot pool (experts in permuted rows of a larger pool, named by a table).

K formats need rows of 256 values, so the shapes are D, I in {256, 512} with a few experts and tokens.

Letters: E experts, S pool rows, D hidden, I expert intermediate, T tokens, K experts per token.
"""

from __future__ import annotations

import pytest
import torch

from clover_desk.engine.kernels import triton_moe
from clover_desk.engine.weights.gguf import quants as gq
from clover_desk.engine.weights.gguf.model import GGUFExpertLayout
from tests.triton_child import run_interpreted

# shared by the child scripts: random GGUF block bytes and a packed expert bank
COMMON = r'''
import torch
from clover_desk.engine.weights.gguf import quants as gq
from clover_desk.engine.weights.gguf.model import GGUFExpertLayout
from clover_desk.engine.kernels import cpu_quant

cpu_quant.set_enabled(False)  # the references here are the dequantizing path

F16_FIELDS = {gq.Q8_0: (0,), gq.Q4_0: (0,), gq.Q4_K: (0, 2), gq.Q5_K: (0, 2), gq.Q6_K: (208,)}


def random_blocks(rows: int, ncols: int, qtype: int) -> torch.Tensor:
    """[rows, row_bytes] uint8 of random bytes, the fp16 fields set to finite random values (random bits there
    could be inf / NaN); the float types: random finite values."""
    if qtype in gq.FLOAT_TYPES:
        return gq.quantize(torch.randn(rows, ncols) * 4.0, qtype)
    elems, nbytes = gq.BLOCK[qtype]
    blocks = torch.randint(0, 256, (rows * ncols // elems, nbytes), dtype=torch.uint8)
    for off in F16_FIELDS[qtype]:
        blocks[:, off : off + 2] = (torch.randn(len(blocks)) * 0.1).to(torch.float16).view(torch.uint8).view(-1, 2)
    return blocks.reshape(rows, -1)


def packed_bank(e: int, d: int, i: int, qtypes: tuple[int, int, int]) -> tuple[GGUFExpertLayout, torch.Tensor]:
    """A layout and its packed rows [E, nbytes] from random dense weights quantized per matrix (one row per expert:
    gate [I, D], up [I, D], down [D, I] blocks at the layout's segments)."""
    layout = GGUFExpertLayout(e, d, i, qtypes)
    packed = torch.empty(e, layout.nbytes, dtype=torch.uint8)
    shapes = ((i, d), (i, d), (d, i))
    for (off, n), q, shape in zip(layout.segments, qtypes, shapes):
        raw = gq.quantize(torch.randn(e, *shape) * 0.1, q)  # [E, rows, row_bytes]
        packed[:, off : off + n] = raw.reshape(e, -1)
    return layout, packed
'''

HELPERS = COMMON + r'''
from clover_desk.engine.kernels.triton_moe import gguf_dequantize

torch.manual_seed(0)
for qt in (gq.Q8_0, gq.Q4_0, gq.Q4_K, gq.Q5_K, gq.Q6_K, gq.F16, gq.BF16, gq.F32):
    for name, raw in (("quantized", gq.quantize(torch.randn(5, 512) * 0.3, qt)), ("random", random_blocks(7, 512, qt))):
        ref = gq.dequantize(raw, qt, 512)
        got = gguf_dequantize(raw, qt, 512)
        assert torch.isfinite(ref).all()
        bad = (got != ref).sum().item()
        assert bad == 0, (gq.TYPE_NAMES[qt], name, bad, (got - ref).abs().max().item())
print("ok")
'''

FUSED = COMMON + r'''
from clover_desk.engine.weights.quant import routed_forward
from clover_desk.engine.kernels.triton_moe import fused_gguf_moe, fused_moe

CASES = (  # (gate, up, down) types, E, D, I, T, K
    ((gq.Q8_0,) * 3, 6, 256, 256, 2, 2),
    ((gq.Q4_0,) * 3, 6, 256, 256, 2, 2),
    ((gq.Q4_K,) * 3, 6, 256, 256, 2, 2),
    ((gq.Q5_K,) * 3, 6, 256, 256, 2, 2),
    ((gq.Q6_K,) * 3, 6, 256, 256, 2, 2),
    ((gq.Q4_K, gq.Q4_K, gq.Q6_K), 6, 256, 512, 2, 2),  # Q4_K_M's mix, D != I
    ((gq.F16, gq.BF16, gq.F32), 4, 96, 160, 2, 2),  # float experts, ragged tiles
    ((gq.Q8_0, gq.Q4_0, gq.Q8_0), 5, 96, 160, 3, 3),  # block types, ragged tiles
    # >= GROUPED_MIN_PAIRS pairs: the grouped kernels (blocks of one expert's pairs, tl.dot)
    ((gq.Q4_K, gq.Q4_K, gq.Q6_K), 6, 256, 512, 20, 4),
    ((gq.Q8_0, gq.Q4_0, gq.Q8_0), 5, 96, 160, 24, 3),
)
torch.manual_seed(0)
for qtypes, e, d, i, t, k in CASES:
    case = ("/".join(gq.TYPE_NAMES[q] for q in qtypes), e, d, i, t, k)
    layout, packed = packed_bank(e, d, i, qtypes)
    x = torch.randn(t, d)
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k), -1)
    ref = routed_forward(x, idx, w, e, layout, source=packed)  # CPU: the dequantize-then-matmul path
    fused = fused_gguf_moe(x, packed, layout, idx, w)
    err = (fused - ref).abs().max().item() / ref.abs().max().item()
    assert err < 1e-5, (case, err)
    if qtypes[0] != gq.Q8_0:  # (a row's address does not depend on its types: the pool is checked on the Q8_0-led
        continue  # cases, per-pair and grouped, the interpreter's quickest)
    # a slot pool: more rows than experts, the experts in permuted rows named by a device-side table
    slot_of = torch.randperm(e + 2)[:e]
    pool = torch.randint(0, 256, (e + 2, layout.nbytes), dtype=torch.uint8)
    pool[slot_of] = packed
    pooled = fused_moe(x, pool, layout, slot_of[idx], w)  # the dispatcher routed_forward calls
    assert torch.equal(pooled, fused), case
    ref_pool = routed_forward(x, idx, w, e, layout, source=pool, row_index=slot_of)
    assert torch.equal(ref_pool, ref), case
print("ok")
'''



def test_gguf_element_decode_equals_gguf_quants_dequantize_bit_for_bit() -> None:
    pytest.importorskip("triton")
    run_interpreted(HELPERS)


@pytest.mark.heavy  # ~1.5-2.5 min on 2 cores: make test-heavy
def test_fused_gguf_moe_equals_the_dequantize_then_matmul_reference() -> None:
    pytest.importorskip("triton")
    run_interpreted(FUSED)


def test_fused_kernel_selection_for_gguf_layouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """GGUF layouts with decodable types are supported (Q4_K_M's mix, float experts), any other type is not (the
    reference path takes it); CPU activations never select a fused kernel."""
    monkeypatch.setattr(triton_moe, "_enabled", True)
    assert triton_moe.supports(GGUFExpertLayout(8, 256, 256, (gq.Q4_K, gq.Q4_K, gq.Q6_K)))
    assert triton_moe.supports(GGUFExpertLayout(8, 256, 256, (gq.F16, gq.F16, gq.F16)))
    q2_k = 10  # a ggml type without a decode here
    assert not triton_moe.supports(GGUFExpertLayout(8, 256, 256, (gq.Q4_K, gq.Q4_K, q2_k)))
    layout = GGUFExpertLayout(8, 256, 256, (gq.Q8_0, gq.Q8_0, gq.Q8_0))
    assert not triton_moe.enabled_for(torch.zeros(1, 256), layout)
