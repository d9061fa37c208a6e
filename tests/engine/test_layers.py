"""The model's zero-centred RMSNorm (``engine.model.layers.RMSNorm``): an eager float32 norm of a step's few rows on
the CPU is one C call (``clover_rms_norm`` through ``engine.kernels.cpu_quant.rms_norm``), equal bit for bit to the
torch formula it replaces, at tiny widths (hidden 48 and 24, not powers of two) and at the real ones (hidden 2048, 16
attention heads of 256, also strided as the attention's q heads lie); other inputs (bfloat16, many rows) keep the
torch ops.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from clover_desk.engine.kernels import cpu_quant
from clover_desk.engine.model.layers import ONE_CALL_VALUES, RMSNorm

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler for the CPU kernels")


@pytest.fixture
def norm_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, ...]]]:
    """The shapes the C norm was called with (the real kernel still runs)."""
    calls: list[tuple[int, ...]] = []
    real = cpu_quant.rms_norm

    def counted(x: torch.Tensor, weight: torch.Tensor, eps: float, lanes: int) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return real(x, weight, eps, lanes)

    monkeypatch.setattr(cpu_quant, "rms_norm", counted)
    yield calls


def _torch_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The torch formula of RMSNorm.forward."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
    return (y * (1.0 + norm.weight.float())).to(x.dtype)


@pytest.mark.parametrize("shape", [(1, 48), (3, 24), (1, 2048), (1, 16, 256), (2, 2, 256)],
                         ids=["tiny", "tiny-rows", "hidden", "q-heads", "k-heads"])
def test_the_c_norm_equals_the_torch_formula_bit_for_bit(shape: tuple[int, ...],
                                                         norm_calls: list[tuple[int, ...]]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], 1e-6)
    norm.weight.data = torch.randn(shape[-1], generator=gen) * 0.3
    for scale in (1e-3, 1.0, 40.0):
        x = torch.randn(shape, generator=gen) * scale
        assert torch.equal(norm(x), _torch_norm(norm, x))
    assert norm_calls == [shape] * 3


def test_strided_heads_take_the_c_norm_too(norm_calls: list[tuple[int, ...]]) -> None:
    norm = RMSNorm(256, 1e-6)
    norm.weight.data = torch.randn(256) * 0.3
    q = torch.randn(1, 16, 512)[..., :256]  # the attention's q heads: [query | gate] per head
    assert torch.equal(norm(q), _torch_norm(norm, q))
    assert norm_calls == [(1, 16, 256)]


def test_other_inputs_keep_the_torch_ops(norm_calls: list[tuple[int, ...]]) -> None:
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64) * 0.3
    many = torch.randn(ONE_CALL_VALUES // 64 + 1, 64)
    assert torch.equal(norm(many), _torch_norm(norm, many))
    half = RMSNorm(64, 1e-6)
    half.weight.data = norm.weight.data.bfloat16()
    x = torch.randn(1, 64).bfloat16()
    assert torch.equal(half(x), _torch_norm(half, x))
    assert norm_calls == []
