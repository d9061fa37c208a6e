"""How wide torch's CPU sums are on this machine, measured once: the C kernels that give the torch forward's bits
(the RMSNorm, the GDN token mixer: ``engine.kernels.cpu_quant``) sum over vectors of that many floats in torch's
order.

Torch's reported capability does not say it: on an AMD EPYC with AVX-512 it reports "AVX512" while its float sums
still run over 8-float vectors. So the width is the one whose C RMSNorm equals torch's formula bit for bit on a
few probe rows; where neither 8 nor 16 does (another vector unit), 8: a valid summation order, equal to torch's
within float32 rounding (the tests that ask for its bits then say so).
"""

from __future__ import annotations

import logging

import torch

from clover_desk.engine.kernels import cpu_quant

log = logging.getLogger(__name__)

WIDTHS = (8, 16)
_PROBE_ROWS = 6
_measured: int | None = None


def torch_lanes() -> int:
    """8 or 16: the vector width (floats) of torch's CPU sums here (module doc), measured on the first call where
    the C kernels are built. 8 without them (nothing then sums in C)."""
    global _measured
    if _measured is None:
        if not cpu_quant.available():
            return WIDTHS[0]
        _measured = _measure()
    return _measured


def _measure() -> int:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_PROBE_ROWS, 2048, generator=gen) * 1e-3  # [R, n]: a layer's scale, n as the real hidden size
    w = torch.randn(2048, generator=gen) * 0.1
    ref = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * (1.0 + w)  # the torch forward's formula
    for lanes in WIDTHS:
        if torch.equal(cpu_quant.kernels().rms_norm(x, w, 1e-6, lanes), ref):
            log.debug("torch's CPU sums run over %d-float vectors here", lanes)
            return lanes
    log.info("torch's CPU sums match neither 8- nor 16-float vectors here: the C norms sum over 8")
    return WIDTHS[0]
