"""Clover's plain building blocks: the zero-centred :class:`RMSNorm` and :class:`Linear` (``nn.Linear`` with a
generated one-row product when compiled for the CPU). Shape letters: :mod:`engine.model.clover`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from clover_desk.engine.kernels import cpu_quant
from clover_desk.engine.kernels.torch_lanes import torch_lanes

# At most this many values (a step's rows: one token's hidden state, its attention heads), an eager float32 RMSNorm on
# the CPU is one C call (cpu_quant.rms_norm, the torch forward's bits) instead of ~8 small torch ops.
ONE_CALL_VALUES = 32768


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: y = x * rsqrt(mean(x^2) + eps) * (1 + w), computed in fp32, cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        if self._one_call(x):
            return cpu_quant.rms_norm(x.contiguous(), self.weight, self.eps, torch_lanes())
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)

    def _one_call(self, x: Tensor) -> bool:
        """Whether this norm is one C call (see :data:`ONE_CALL_VALUES`; a strided x, such as the attention's q
        heads, copied first): eager, the CPU kernels on, float32."""
        return (x.device.type == "cpu" and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and x.numel() <= ONE_CALL_VALUES and not torch.compiler.is_compiling() and cpu_quant.usable()
                and x.shape[-1] >= torch_lanes())  # last: measured on first use, never inside a compiled trace


class Linear(nn.Linear):
    """``nn.Linear`` whose one-row product (an AR step), when compiled for the CPU, is written as multiply-and-sum
    over the input features: inductor then generates the matrix-vector product inside the layer's own kernel,
    reading the weight rows straight through, instead of calling the BLAS ``mm`` (measured: MKL's one-row product
    costs ~10 us a call on the deep-narrow shape, 7 calls a layer, and reads weights not in cache at ~10 GB/s against
    ~18 GB/s for the generated loop on one core). Eager, CUDA and multi-row passes call ``F.linear``: same math,
    another summation order."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2 and x.shape[0] == 1 and x.device.type == "cpu" and torch.compiler.is_compiling():
            y = (x[:, None, :] * self.weight[None, :, :]).sum(-1)  # [1, O]
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)
