"""The engine's GPU-path settings, in one frozen object: :class:`GpuPaths` (stdlib only: the window imports it).

Which way a streamed expert reaches the GPU (``expert_fetch``) and which optional kernels run (the fused Triton
MoE and INT8 kernels, flash-linear-attention's GDN kernels, the CPU kernels for GGUF blocks and their portable
scalar build). Every field has its default here; nothing else in the engine reads the environment for them.

The environment switches (:data:`SWITCHES`) are parsed here and only here, by :meth:`GpuPaths.from_env`, once where
an engine process starts (the CLI commands that load a model, the window's worker process, ``doctor``); the object
is then passed down (``engine.api.Engine.load(gpu_paths=...)``, which hands the kernels their switches and the
placement its fetch). A bad value is one :class:`SettingsError` line naming the variable and the values allowed
(the CLI exits 2 on it). The window chooses its paths by switch name (:data:`OPT_IN`, at most one of
:data:`EXCLUSIVE`) and gives its worker the environment :func:`opt_in_env` writes.

    paths = GpuPaths.from_env()          # os.environ by default; any mapping in tests
    engine = Engine.load(model, device="cuda", gpu_paths=paths)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from clover_desk.engine.errors import ConfigError

# How AR steps (and, with device tables, diffusion passes) reach the experts of a streamed layer
# (engine.placement.streamed_bank): "pool": copied into the device slot pool; "zero_copy": read in place from page-locked
# host memory; "device_tables": fetched through slot tables kept on the GPU (engine.placement.device_pool).
EXPERT_FETCH = ("pool", "zero_copy", "device_tables")

# The opt-in GPU paths: environment switch -> what "1" turns on (none is measured on a GPU yet). The window offers
# them by these names; the two expert fetches of EXCLUSIVE exclude each other.
OPT_IN: dict[str, str] = {
    "CLOVER_DESK_FUSED_MOE": "routed experts through the fused Triton MoE kernels (NF4 rows, GGUF blocks)",
    "CLOVER_DESK_FUSED_INT8": "INT8 projections and the LM head through the fused Triton kernel",
    "CLOVER_DESK_FLA_GDN": "Gated DeltaNet steps and causal prefills through flash-linear-attention",
    "CLOVER_DESK_ZERO_COPY": "AR steps reading streamed experts in place from page-locked memory",
    "CLOVER_DESK_DEVICE_POOL": "AR steps and diffusion passes fetching streamed experts through slot tables on the GPU",
}
EXCLUSIVE = ("CLOVER_DESK_ZERO_COPY", "CLOVER_DESK_DEVICE_POOL")
_FETCH_OF_SWITCH = {"CLOVER_DESK_ZERO_COPY": "zero_copy", "CLOVER_DESK_DEVICE_POOL": "device_tables"}

# Every environment switch: name -> (GpuPaths field, what "1" means). Each takes "1" (on) or "0" (off); unset or
# empty is the field's default. The expert fetch's two switches set ``expert_fetch``.
SWITCHES: dict[str, tuple[str, str]] = {
    "CLOVER_DESK_FUSED_MOE": ("fused_moe", OPT_IN["CLOVER_DESK_FUSED_MOE"]),
    "CLOVER_DESK_FUSED_INT8": ("fused_int8", OPT_IN["CLOVER_DESK_FUSED_INT8"]),
    "CLOVER_DESK_FLA_GDN": ("fla_gdn", OPT_IN["CLOVER_DESK_FLA_GDN"]),
    "CLOVER_DESK_ZERO_COPY": ("expert_fetch", OPT_IN["CLOVER_DESK_ZERO_COPY"]),
    "CLOVER_DESK_DEVICE_POOL": ("expert_fetch", OPT_IN["CLOVER_DESK_DEVICE_POOL"]),
    "CLOVER_DESK_CPU_KERNELS": ("cpu_kernels", "GGUF blocks read by the CPU kernels (0: dequantized first, the old path)"),
    "CLOVER_DESK_KERNEL_SCALAR": ("scalar_kernels", "the CPU kernels built portable (no SIMD intrinsics)"),
}
ALLOWED_VALUES = ("0", "1")


class SettingsError(ConfigError, ValueError):
    """A GPU-path setting that is not allowed (one line naming the variable or field and what is allowed)."""


@dataclass(frozen=True)
class GpuPaths:
    """The GPU paths and kernel switches an engine runs with (defaults: the measured, standard paths)."""

    expert_fetch: str = "pool"  # one of EXPERT_FETCH; acts on CUDA only (on the CPU the pool is the only fetch)
    fused_moe: bool = False  # engine.kernels.triton_moe (CUDA)
    fused_int8: bool = False  # engine.kernels.triton_linear (CUDA)
    fla_gdn: bool = False  # engine.kernels.gdn_kernels (CUDA, or the CPU under Triton's interpreter)
    cpu_kernels: bool = True  # engine.kernels.cpu_quant for GGUF blocks on the CPU (else dequantize, then matmul)
    scalar_kernels: bool = False  # build engine.kernels.cpu_quant without SIMD intrinsics

    def __post_init__(self) -> None:
        if self.expert_fetch not in EXPERT_FETCH:
            raise SettingsError(f"expert_fetch {self.expert_fetch!r} is not one of {', '.join(EXPERT_FETCH)}")
        for f in fields(self):
            if f.name != "expert_fetch" and not isinstance(getattr(self, f.name), bool):
                raise SettingsError(f"{f.name} {getattr(self, f.name)!r} is not true or false")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GpuPaths:
        """The settings the switches of ``environ`` (default: this process's) ask for. A value other than "0", "1"
        or empty, or both of :data:`EXCLUSIVE` at "1", is a :class:`SettingsError` naming the variable."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        fetch_on = []
        for name, (field_name, _) in SWITCHES.items():
            raw = env.get(name, "").strip()
            if raw == "":
                continue
            if raw not in ALLOWED_VALUES:
                raise SettingsError(f"{name}={raw!r} is not allowed: set it to 1 (on) or 0 (off), or unset it")
            if field_name == "expert_fetch":
                if raw == "1":
                    fetch_on.append(name)
                continue
            values[field_name] = raw == "1"
        if len(fetch_on) > 1:
            raise SettingsError(f"{' and '.join(fetch_on)} exclude each other (one expert fetch at a time): "
                                "set one of them to 1, not both")
        if fetch_on:
            values["expert_fetch"] = _FETCH_OF_SWITCH[fetch_on[0]]
        return cls(**values)

    @classmethod
    def from_opt_in(cls, on: Iterable[str], base: GpuPaths | None = None) -> GpuPaths:
        """``base`` (default: the defaults) with exactly the :data:`OPT_IN` switches in ``on`` turned on (the
        window's choice). An unknown name, or both of :data:`EXCLUSIVE`, is a :class:`SettingsError`."""
        return GpuPaths.from_env({**(base or cls()).to_env(), **opt_in_env(on)})

    def opt_in(self) -> list[str]:
        """The :data:`OPT_IN` switches these settings turn on, in the table's order."""
        env = self.to_env()
        return [name for name in OPT_IN if env[name] == "1"]

    def to_env(self) -> dict[str, str]:
        """Every switch of :data:`SWITCHES` at "1" or "0": the environment that gives a child process exactly
        these settings (``GpuPaths.from_env(paths.to_env()) == paths``)."""
        out = {}
        for name, (field_name, _) in SWITCHES.items():
            if field_name == "expert_fetch":
                on = self.expert_fetch == _FETCH_OF_SWITCH[name]
            else:
                on = bool(getattr(self, field_name))
            out[name] = "1" if on else "0"
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        """The settings as ``doctor`` prints them, one field a line, a changed default marked."""
        default = GpuPaths()
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            shown = value if isinstance(value, str) else ("on" if value else "off")
            out.append(f"{f.name:15}{shown}" + ("" if value == getattr(default, f.name) else "  (changed)"))
        return out


def opt_in_env(on: Iterable[str]) -> dict[str, str]:
    """Every :data:`OPT_IN` switch, "1" for those in ``on`` and "0" for the rest: the environment a worker is given
    so that it runs exactly the chosen paths, whatever the parent's environment says. An unknown name, or both of
    :data:`EXCLUSIVE`, is a :class:`SettingsError` naming it."""
    chosen = set(on)
    unknown = sorted(chosen - set(OPT_IN))
    if unknown:
        raise SettingsError(f"unknown GPU path {unknown[0]!r} (allowed: {', '.join(OPT_IN)})")
    if all(name in chosen for name in EXCLUSIVE):
        raise SettingsError(f"{' and '.join(EXCLUSIVE)} exclude each other: choose one")
    return {name: "1" if name in chosen else "0" for name in OPT_IN}


def switches_set(environ: Mapping[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    """(name, value) of the :data:`SWITCHES` set in ``environ`` (default: this process's), as they are, bad values
    included: what ``doctor`` reports."""
    env = os.environ if environ is None else environ
    return tuple((name, env[name]) for name in SWITCHES if name in env)


__all__ = ["ALLOWED_VALUES", "EXCLUSIVE", "EXPERT_FETCH", "GpuPaths", "OPT_IN", "SWITCHES", "SettingsError",
           "opt_in_env", "switches_set"]
