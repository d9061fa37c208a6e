"""Grouped routed-expert compute (engine.model.experts.moe_grouped) against the per-expert loop it replaced.

Letters: T tokens, K top-k, E experts, D hidden size, I expert intermediate size.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from clover_desk.engine.model import experts as ex
from clover_desk.engine.model.experts import DenseExpertBank, moe_grouped, routed_reference
from clover_desk.engine.weights.quant import QuantExpertBank, routed_forward, routed_forward_reference, unpack_rows

pytestmark = pytest.mark.usefixtures("cpu_kernels_off")

E, D, I, K = 16, 64, 32, 4  # NF4: 2I*D and D*I are whole blocks of 64 -> one dequantize call per group
GROUPS = [None, 1, 3, 64]  # default (CPU: 1), small, uneven, all used experts at once


def _dense(e: int = E, d: int = D, i: int = I, seed: int = 0) -> DenseExpertBank:
    gen = torch.Generator().manual_seed(seed)
    bank = DenseExpertBank(e, d, i)
    with torch.no_grad():
        bank.gate_up_proj.normal_(0.0, d**-0.5, generator=gen)
        bank.down_proj.normal_(0.0, i**-0.5, generator=gen)
    return bank


def _routing(
    t: int, e: int = E, k: int = K, seed: int = 1, pool: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_idx [T, K], topk_w [T, K]. With ``pool``, tokens route only to that many experts: the others get zero
    tokens. The last token's slots after the first are weight-0 copies of its first expert (how the block coreset
    pads tokens that have fewer than K experts in the coreset)."""
    assert pool is None or pool >= k
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.randperm(e, generator=gen)[: pool or e]
    idx = torch.stack([allowed[torch.randperm(allowed.numel(), generator=gen)[:k]] for _ in range(t)])  # [T, K]
    w = torch.rand(t, k, generator=gen) + 0.05
    w = w / w.sum(-1, keepdim=True)
    if k > 1:
        idx[-1, 1:] = idx[-1, 0]
        w[-1, 1:] = 0.0
        w[-1, 0] = 1.0
    return idx, w


def _x(t: int, d: int = D, seed: int = 2) -> torch.Tensor:
    return torch.randn(t, d, generator=torch.Generator().manual_seed(seed))


SHAPES = [(1, None), (2, None), (32, 6), (32, None), (9, 5)]  # (T, experts in use): AR, N = 8, 32-token passes


@pytest.fixture
def grouped_mm_on_cpu() -> Iterator[None]:
    """Run the torch._grouped_mm branches on CPU (torch 2.13 has a CPU fallback; production uses it on CUDA)."""
    key = (torch.device("cpu").type, torch.float32)
    old = ex._GROUPED_MM_OK.get(key)
    ex._GROUPED_MM_OK[key] = True
    yield
    if old is None:
        ex._GROUPED_MM_OK.pop(key, None)
    else:
        ex._GROUPED_MM_OK[key] = old


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"max |diff| {(a - b).abs().max().item():.3e}"


# ---------------------------------------------------------------------------------------------------------------
# dense


@pytest.mark.parametrize("t, pool", SHAPES)
def test_dense_bank_equals_the_per_expert_loop(t: int, pool: int | None) -> None:
    bank = _dense()
    idx, w = _routing(t, pool=pool)
    x = _x(t)
    _close(bank(x, idx, w), routed_reference(bank, x, idx, w))


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("t, pool", SHAPES)
def test_dense_gathered_groups_equal_the_per_expert_loop(t: int, pool: int | None, group: int | None) -> None:
    """The padded-bmm path a GPU without grouped mm takes (gathered copies, several experts per group)."""
    bank = _dense()
    idx, w = _routing(t, pool=pool)
    x = _x(t)
    got = moe_grouped(x, idx, w, E, bank.gather, 3 * I, group_experts=group)
    _close(got, routed_reference(bank, x, idx, w))


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("t, pool", SHAPES)
def test_dense_grouped_mm_paths_equal_the_per_expert_loop(
    grouped_mm_on_cpu: None, t: int, pool: int | None, group: int | None
) -> None:
    bank = _dense()
    idx, w = _routing(t, pool=pool)
    x = _x(t)
    ref = routed_reference(bank, x, idx, w)
    # resident weights read in place, all E experts as groups (most of them empty)
    _close(moe_grouped(x, idx, w, E, bank.gather, 3 * I, resident=(bank.gate_up_proj, bank.down_proj)), ref)
    # gathered groups with offsets (what a quantized bank does on a GPU)
    _close(moe_grouped(x, idx, w, E, bank.gather, 3 * I, group_experts=group), ref)


def test_weight_zero_slots_and_idle_experts_contribute_nothing() -> None:
    bank = _dense()
    x = _x(3)
    idx = torch.tensor([[5, 5, 5, 5], [2, 9, 5, 5], [7, 7, 7, 7]])  # duplicates, 12 of 16 experts idle
    w = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    got = bank(x, idx, w)
    one = lambda e, xs: bank.expert_forward(e, xs)  # noqa: E731
    want = torch.stack([one(5, x[:1])[0], 0.5 * one(2, x[1:2])[0] + 0.5 * one(9, x[1:2])[0], one(7, x[2:])[0]])
    _close(got, want)
    for group in (1, 2, 64):
        _close(moe_grouped(x, idx, w, E, bank.gather, 3 * I, group_experts=group), want)


def test_dense_bank_dtype_and_shape_follow_x() -> None:
    bank = _dense().to(torch.bfloat16)
    idx, w = _routing(32, pool=6)
    x = _x(32).to(torch.bfloat16)
    out = bank(x, idx, w)
    assert out.dtype == torch.bfloat16 and out.shape == (32, D)
    ref = routed_reference(bank, x, idx, w)
    assert torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------------------------
# quantized (NF4, INT8), resident and streamed


def _qbank(fmt: str, e: int = E, d: int = D, i: int = I) -> QuantExpertBank:
    dense = _dense(e, d, i, seed=3)
    return QuantExpertBank.from_dense(dense.gate_up_proj.data, dense.down_proj.data, fmt)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize("t, pool", SHAPES)
def test_quant_bank_equals_the_per_expert_loop(fmt: str, t: int, pool: int | None) -> None:
    bank = _qbank(fmt)
    idx, w = _routing(t, pool=pool)
    x = _x(t)
    ref = routed_forward_reference(x, idx, w, E, bank.layout, bank.packed.__getitem__)
    _close(bank(x, idx, w), ref)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("t, pool", SHAPES)
def test_nf4_dequantized_groups_equal_the_per_expert_loop(t: int, pool: int | None, group: int | None) -> None:
    bank = _qbank("nf4")
    idx, w = _routing(t, pool=pool)
    x = _x(t)
    ref = routed_forward_reference(x, idx, w, E, bank.layout, bank.packed.__getitem__)

    def weights(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return unpack_rows(bank.layout, bank.packed, ids, x.dtype)

    _close(moe_grouped(x, idx, w, E, weights, 3 * I, group_experts=group), ref)


@pytest.mark.parametrize("t", [4, 32])  # the pairwise loop (16 pairs <= SMALL_SLOTS), the sorted one (128 pairs)
def test_one_group_of_dequantized_weights_is_alive_at_a_time(t: int) -> None:
    """Each group's weights are dropped before the next group's are dequantized: the caching allocator then reuses
    the block, so a 32-slot pass holds one group (96 MiB for the 35B on a GPU), not two (found with bench speed
    --count's scratch line). Groups of 6 experts then hold 3 experts' weights more than groups of 3, not 6 more."""
    from clover_desk.bench.count import _forward_ops

    bank = _qbank("nf4")
    idx, w = _routing(t)
    x = _x(t)

    def weights(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return unpack_rows(bank.layout, bank.packed, ids, x.dtype)

    def scratch(group: int) -> int:
        with torch.inference_mode():
            return _forward_ops(lambda: moe_grouped(x, idx, w, E, weights, 3 * I, group_experts=group))["scratch"]

    expert = 3 * I * D * x.element_size()  # one expert's gate_up [2I, D] and down [D, I] in x's dtype
    assert min(t * K, E) >= 2 * 6  # several groups of either size
    grew = scratch(6) - scratch(3)
    assert 3 * expert <= grew < 5 * expert, (grew, expert)


@pytest.mark.parametrize("group", [None, 3, 64])
def test_nf4_grouped_mm_path_equals_the_per_expert_loop(grouped_mm_on_cpu: None, group: int | None) -> None:
    bank = _qbank("nf4")
    idx, w = _routing(32, pool=6)
    x = _x(32)
    ref = routed_forward_reference(x, idx, w, E, bank.layout, bank.packed.__getitem__)

    def weights(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return unpack_rows(bank.layout, bank.packed, ids, x.dtype)

    _close(moe_grouped(x, idx, w, E, weights, 3 * I, group_experts=group), ref)


def test_one_dequantize_call_per_group_is_exact() -> None:
    """Several experts' NF4 bytes dequantized in one call equal each expert dequantized on its own, bit for bit."""
    bank = _qbank("nf4")
    ids = torch.tensor([11, 0, 7, 3])
    gate_up, down = unpack_rows(bank.layout, bank.packed, ids, torch.float32)  # [4, 2I, D], [4, D, I]
    for j, e in enumerate(ids.tolist()):
        gu, dn = bank.layout.unpack(bank.packed[e], torch.float32, reference=True)
        assert torch.equal(gate_up[j], gu) and torch.equal(down[j], dn)


def test_nf4_shapes_that_split_a_block_fall_back_to_one_call_per_expert() -> None:
    e, d, i = 6, 36, 10  # 2I*D = 720 and D*I = 360 are not multiples of the 64-value block
    bank = _qbank("nf4", e, d, i)
    idx, w = _routing(9, e=e, k=2, pool=4)
    x = _x(9, d)
    ref = routed_forward_reference(x, idx, w, e, bank.layout, bank.packed.__getitem__)

    def weights(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return unpack_rows(bank.layout, bank.packed, ids, x.dtype)

    for group in (None, 4):
        _close(moe_grouped(x, idx, w, e, weights, 3 * i, group_experts=group), ref)


@pytest.mark.parametrize("t, pool", SHAPES)
def test_rows_in_a_slot_pool_give_the_resident_numbers_bit_for_bit(t: int, pool: int | None) -> None:
    """A streamed bank's experts sit in arbitrary pool slots (source + row_index) or come one by one (row_of):
    both equal the resident bank exactly."""
    bank = _qbank("nf4")
    idx, w = _routing(t, pool=pool)
    x = _x(t)
    resident = bank(x, idx, w)
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(4))  # expert e lives in slot perm[e]
    pool_buf = torch.zeros(E + 3, bank.layout.nbytes, dtype=torch.uint8)  # [S, R] more slots than experts
    pool_buf[perm] = bank.packed
    streamed = routed_forward(x, idx, w, E, bank.layout, source=pool_buf, row_index=perm)
    assert torch.equal(streamed, resident)
    by_row = routed_forward(x, idx, w, E, bank.layout, lambda e: pool_buf[int(perm[e])])
    assert torch.equal(by_row, resident)


def test_quant_bank_equals_dense_bank_on_its_dequantized_weights_for_every_shape() -> None:
    bank = _qbank("nf4")
    deq = DenseExpertBank(E, D, I)
    gate_up, down = unpack_rows(bank.layout, bank.packed, torch.arange(E), torch.float32)
    deq.gate_up_proj.data.copy_(gate_up)
    deq.down_proj.data.copy_(down)
    for t, pool in SHAPES:
        idx, w = _routing(t, pool=pool)
        x = _x(t)
        assert torch.equal(bank(x, idx, w), deq(x, idx, w))


# ---------------------------------------------------------------------------------------------------------------
# host syncs


def test_grouped_mm_is_only_probed_on_cuda() -> None:
    """torch 2.13's CPU fallback of _grouped_mm walks every group and is slower than bmm: CPU never uses it."""
    for dtype in (torch.float32, torch.bfloat16):
        assert not ex.grouped_mm_supported(torch.device("cpu"), dtype)


def _cuda() -> bool:
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_cuda_grouped_compute_matches_the_loop_and_ar_needs_no_host_sync() -> None:
    dense = _dense().to("cuda", torch.bfloat16)
    qbank = _qbank("nf4").to("cuda")
    for t, pool in SHAPES:
        idx, w = (a.cuda() for a in _routing(t, pool=pool))
        x = _x(t).to("cuda", torch.bfloat16)
        for bank, ref in ((dense, routed_reference(dense, x, idx, w)),
                          (qbank, routed_forward_reference(x, idx, w, E, qbank.layout, qbank.packed.__getitem__))):
            got = bank(x, idx, w)
            assert torch.allclose(got.float(), ref.float(), rtol=3e-2, atol=3e-2)
    idx, w = (a.cuda() for a in _routing(1))
    x = _x(1).to("cuda", torch.bfloat16)
    dense(x, idx, w), qbank(x, idx, w)  # warm-up (the grouped mm probe syncs once)
    torch.cuda.set_sync_debug_mode("error")
    try:
        dense(x, idx, w)
        qbank(x, idx, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
