"""One token's partial rotary embedding (``engine.model.attention.apply_partial_rope``): eager, float32, on the CPU it
is one C call (``clover_rope`` through ``engine.kernels.cpu_quant.rope``), equal bit for bit to the torch ops it
replaces at a tiny width (head 16, 4 rotary dims) and at the real one (16 query and 2 key heads of 256, 64 rotary
dims); several positions keep the torch ops.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from clover_desk.engine.kernels import cpu_quant
from clover_desk.engine.model.attention import apply_partial_rope, rope_cos_sin

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler for the CPU kernels")


@pytest.fixture
def rope_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, ...]]]:
    """The shapes the C rope was called with (the real kernel still runs)."""
    calls: list[tuple[int, ...]] = []
    real = cpu_quant.rope

    def counted(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return real(x, cos, sin)

    monkeypatch.setattr(cpu_quant, "rope", counted)
    yield calls


def _torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(cpu_quant, "_enabled", False)  # the kernels off: the torch ops
        return apply_partial_rope(x, cos, sin)


@pytest.mark.parametrize("heads,hd,rd", [(3, 16, 4), (16, 256, 64), (2, 256, 64)], ids=["tiny", "q-heads", "k-heads"])
def test_one_token_rope_in_c_equals_the_torch_ops_bit_for_bit(
        heads: int, hd: int, rd: int, monkeypatch: pytest.MonkeyPatch, rope_calls: list[tuple[int, ...]]) -> None:
    gen = torch.Generator().manual_seed(heads * hd)
    for pos in (0, 7, 12_345):
        cos, sin = rope_cos_sin(torch.tensor([pos]), rd, 10_000_000.0)
        x = torch.randn(1, heads, hd, generator=gen)
        assert torch.equal(apply_partial_rope(x, cos, sin), _torch_rope(x, cos, sin, monkeypatch))
    assert rope_calls == [(1, heads, hd)] * 3


def test_several_positions_keep_the_torch_ops(monkeypatch: pytest.MonkeyPatch,
                                              rope_calls: list[tuple[int, ...]]) -> None:
    cos, sin = rope_cos_sin(torch.arange(5), 64, 10_000_000.0)
    x = torch.randn(5, 2, 256)
    assert torch.equal(apply_partial_rope(x, cos, sin), _torch_rope(x, cos, sin, monkeypatch))
    assert rope_calls == []
