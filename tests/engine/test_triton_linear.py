"""The fused weight-only INT8 linear (``engine.kernels.triton_linear``) against the dequantize-then-matmul reference, run on
the CPU by Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is first imported) at small, ragged
shapes (the masks of partial row, output and input tiles), with and without a bias, in fp32 and fp16 (bf16, which
the interpreter does not emulate, in the gpu-marked test)."""

from __future__ import annotations

import pytest
import torch

from tests.triton_child import run_interpreted

CHILD = r'''
import torch
from clover_desk.engine.weights.quant import dequantize_int8_reference, quantize_int8
from clover_desk.engine.kernels.triton_linear import int8_linear

torch.manual_seed(0)
for r, n, o, bias, dtype in ((1, 64, 96, False, torch.float32), (5, 130, 70, True, torch.float32),
                             (33, 128, 200, True, torch.float32), (3, 96, 80, False, torch.float16)):
    w = torch.randn(o, n) * 0.1
    codes, scales = quantize_int8(w)
    b = torch.randn(o) if bias else None
    x = torch.randn(2, r, n).to(dtype)  # leading dims flattened into rows
    ref = torch.nn.functional.linear(x.float(), dequantize_int8_reference(codes, scales, (o, n)), b)
    out = int8_linear(x, codes, scales, b)
    assert out.shape == (2, r, o) and out.dtype == dtype, (out.shape, out.dtype)
    err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # fp16: the activations' own rounding
    assert err < tol, (r, n, o, bias, dtype, err)
print("ok")
'''


def test_fused_int8_linear_equals_the_dequantize_then_matmul_reference() -> None:
    pytest.importorskip("triton")
    run_interpreted(CHILD)


def test_the_fused_kernel_is_taken_only_on_cuda_when_opted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    from clover_desk.engine.kernels import triton_linear

    codes = torch.zeros(8, 16, dtype=torch.int8)
    monkeypatch.setattr(triton_linear, "_enabled", True)
    assert not triton_linear.enabled_for(torch.zeros(1, 16), "int8", codes)  # a CPU tensor: never


@pytest.mark.gpu
def test_quant_linear_takes_the_fused_kernel_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from clover_desk.engine.kernels import triton_linear
    from clover_desk.engine.weights.quant import QuantLinear

    lin = torch.nn.Linear(256, 1000, bias=True)
    q = QuantLinear.from_linear(lin, "int8").to("cuda")
    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    q.bias.data = q.bias.data.to(torch.bfloat16)
    chunked = q(x).float()
    monkeypatch.setattr(triton_linear, "_enabled", True)
    assert triton_linear.enabled_for(x, "int8", q.codes)
    fused = q(x).float()
    assert (fused - chunked).abs().max().item() < 2e-2 * chunked.abs().max().item()
