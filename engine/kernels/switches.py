"""The kernels' switches set from one :class:`engine.settings.GpuPaths`: what ``engine.api.Engine.load`` (and a
benchmark that builds its model by hand) calls with the settings its process started with.

The optional kernels are chosen per process (one engine a process; a compiled layer sees the choice as a constant),
so each kernel module keeps its own switch, off or on as the settings say, and none reads the environment.
The expert fetch (``GpuPaths.expert_fetch``) is per model: ``engine.placement.placer.place_model`` takes it.
"""

from __future__ import annotations

import logging

from clover_desk.engine.kernels import cpu_quant, gdn_kernels, triton_linear, triton_moe
from clover_desk.engine.settings import GpuPaths

log = logging.getLogger(__name__)


def use(paths: GpuPaths) -> None:
    """Set every kernel switch of this process as ``paths`` says."""
    triton_moe.set_enabled(paths.fused_moe)
    triton_linear.set_enabled(paths.fused_int8)
    gdn_kernels.set_enabled(paths.fla_gdn)
    cpu_quant.set_enabled(paths.cpu_kernels)
    cpu_quant.set_scalar(paths.scalar_kernels)
    log.debug("kernel switches: %s", paths.to_dict())


def current() -> GpuPaths:
    """The kernel switches this process runs with now (``expert_fetch`` is per model: the default here)."""
    return GpuPaths(
        fused_moe=triton_moe._enabled, fused_int8=triton_linear._enabled, fla_gdn=gdn_kernels.OPTED_IN,
        cpu_kernels=cpu_quant._enabled, scalar_kernels=cpu_quant._scalar,
    )
