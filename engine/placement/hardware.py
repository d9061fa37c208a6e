"""What the planner needs to know about this machine: GPU memory and bandwidths, PCIe link, system RAM.

Stdlib only at import time. :func:`probe_hardware` reads NVML through ``pynvml`` (package ``nvidia-ml-py``) and
system memory through ``psutil``; both are imported inside the function. A machine without an NVIDIA GPU, without
the driver or without ``pynvml`` is a normal case: the probe returns ``gpu_name=None`` and the planner falls back to
the assumed desktop card of :data:`DEFAULT_HARDWARE`.

Bandwidth rules:
* PCIe host-to-device, pinned: lanes x per-lane rate x :data:`PCIE_EFFICIENCY`. Measured pinned H2D is 80-84 % of
  the raw rate (25.1 GB/s on PCIe 4.0 x16, 52.7 on 5.0 x16, 13.2 on 3.0 x16).
* VRAM: NVML memory bus width x max memory clock x 2 (NVML reports the memory clock at half the per-pin data rate
  for GDDR6/6X/7 and HBM alike: a 4090 gives 10501 MHz x 2 x 384 bit / 8 = 1008 GB/s). When NVML cannot say, a
  table by card name, else :data:`DEFAULT_VRAM_GBPS`.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger(__name__)

GB = 1_000_000_000

# Raw PCIe rate per lane and direction, GB/s (after 8b/10b or 128b/130b encoding).
PCIE_LANE_GBPS: dict[int, float] = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
PCIE_EFFICIENCY = 0.80  # measured pinned H2D / raw rate (see module docstring)

# Memory bandwidth by card name (GB/s), used only when NVML cannot give bus width and clock. Longest match wins.
VRAM_GBPS_BY_NAME: dict[str, float] = {
    "RTX 4060 Ti": 288.0,
    "RTX 4070 Ti SUPER": 672.0,
    "RTX 4080 SUPER": 736.0,
    "RTX 4080": 716.8,
    "RTX 4090": 1008.0,
    "RTX 3090": 936.0,
    "RTX 5060 Ti": 448.0,
    "RTX 5070 Ti": 896.0,
    "RTX 5080": 960.0,
    "RTX 5090": 1792.0,
    "H100": 3350.0,
    "H200": 4800.0,
}

# The design target when nothing is known: a 16 GB RTX 4070 Ti SUPER-class card on PCIe 4.0 x16.
DEFAULT_VRAM_GBPS = 672.0
DEFAULT_PCIE_GEN = 4
DEFAULT_PCIE_WIDTH = 16


def pcie_gbps(gen: int, width: int) -> float:
    """Usable pinned host-to-device GB/s of a PCIe link (raw rate x :data:`PCIE_EFFICIENCY`)."""
    if gen not in PCIE_LANE_GBPS:
        raise ValueError(f"unknown PCIe generation {gen!r} (known: {sorted(PCIE_LANE_GBPS)})")
    if width <= 0:
        raise ValueError(f"PCIe width must be positive, got {width!r}")
    return PCIE_LANE_GBPS[gen] * width * PCIE_EFFICIENCY


def vram_gbps_for_name(name: str | None) -> float | None:
    """Table look-up of a card's memory bandwidth by (a substring of) its name; None when unknown."""
    if not name:
        return None
    hits = [key for key in VRAM_GBPS_BY_NAME if key.lower() in name.lower()]
    if not hits:
        return None
    return VRAM_GBPS_BY_NAME[max(hits, key=len)]


@dataclass(frozen=True)
class Hardware:
    """One GPU (or none) and the host. Bandwidths in GB/s (10^9 bytes), sizes in bytes."""

    gpu_name: str | None = None
    vram_total_bytes: int | None = None
    vram_free_bytes: int | None = None
    pcie_gen: int = DEFAULT_PCIE_GEN
    pcie_width: int = DEFAULT_PCIE_WIDTH
    pcie_gbps: float = field(default_factory=lambda: pcie_gbps(DEFAULT_PCIE_GEN, DEFAULT_PCIE_WIDTH))
    vram_gbps: float = DEFAULT_VRAM_GBPS
    ram_total_bytes: int | None = None
    ram_available_bytes: int | None = None
    # Where each number came from ("nvml", "table", "default", "psutil"), for the CLI and the UI to show.
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("pcie_gbps", "vram_gbps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"Hardware.{name} must be a positive number of GB/s, got {value!r}")

    @property
    def gpu(self) -> str | None:
        return self.gpu_name

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULT_HARDWARE = Hardware(sources={"gpu": "default", "pcie": "default", "vram_gbps": "default"})


def _probe_ram() -> tuple[int | None, int | None, str]:
    try:
        import psutil
    except ImportError:
        log.info("psutil is not installed; system RAM unknown")
        return None, None, "unknown"
    mem = psutil.virtual_memory()
    return int(mem.total), int(mem.available), "psutil"


def _probe_nvml(index: int) -> dict[str, Any] | None:
    """NVML facts of GPU ``index``, or None when there is no GPU / driver / pynvml."""
    try:
        import pynvml
    except ImportError:
        log.info("pynvml (nvidia-ml-py) is not installed; no GPU information")
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.info("NVML unavailable (%s): treating this machine as having no NVIDIA GPU", exc)
        return None
    try:
        if index >= pynvml.nvmlDeviceGetCount():
            log.info("NVML sees no GPU with index %d", index)
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        if isinstance(name, bytes):
            name = name.decode("utf-8", "replace")
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        facts: dict[str, Any] = {"name": str(name), "total": int(mem.total), "free": int(mem.free)}
        # Each optional query may be unsupported on a given GPU/driver; a missing one falls back, never fails.
        for key, getter, args in (
            ("pcie_gen", pynvml.nvmlDeviceGetMaxPcieLinkGeneration, ()),
            ("pcie_width", pynvml.nvmlDeviceGetMaxPcieLinkWidth, ()),
            ("bus_width_bits", pynvml.nvmlDeviceGetMemoryBusWidth, ()),
            ("mem_clock_mhz", pynvml.nvmlDeviceGetMaxClockInfo, (pynvml.NVML_CLOCK_MEM,)),
        ):
            try:
                facts[key] = int(getter(handle, *args))
            except pynvml.NVMLError as exc:
                log.debug("NVML %s unavailable: %s", key, exc)
        return facts
    except pynvml.NVMLError as exc:
        log.warning("NVML query failed (%s): treating this machine as having no NVIDIA GPU", exc)
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)


def probe_hardware(index: int = 0) -> Hardware:
    """Read GPU ``index`` through NVML and system memory through psutil. Never raises for a missing GPU."""
    ram_total, ram_avail, ram_source = _probe_ram()
    facts = _probe_nvml(index)
    sources = {"ram": ram_source}
    if facts is None:
        sources.update(gpu="none", pcie="default", vram_gbps="default")
        return Hardware(ram_total_bytes=ram_total, ram_available_bytes=ram_avail, sources=sources)

    sources["gpu"] = "nvml"
    gen, width = facts.get("pcie_gen"), facts.get("pcie_width")
    if gen in PCIE_LANE_GBPS and width and width > 0:
        link = pcie_gbps(gen, width)
        sources["pcie"] = "nvml"
    else:
        gen, width = DEFAULT_PCIE_GEN, DEFAULT_PCIE_WIDTH
        link = pcie_gbps(gen, width)
        sources["pcie"] = "default"

    bus, clock = facts.get("bus_width_bits"), facts.get("mem_clock_mhz")
    if bus and clock:
        vram_bw = clock * 1e6 * 2 * bus / 8 / GB
        sources["vram_gbps"] = "nvml"
    else:
        table = vram_gbps_for_name(facts["name"])
        vram_bw = table if table is not None else DEFAULT_VRAM_GBPS
        sources["vram_gbps"] = "table" if table is not None else "default"

    return Hardware(
        gpu_name=facts["name"],
        vram_total_bytes=facts["total"],
        vram_free_bytes=facts["free"],
        pcie_gen=int(gen),
        pcie_width=int(width),
        pcie_gbps=link,
        vram_gbps=vram_bw,
        ram_total_bytes=ram_total,
        ram_available_bytes=ram_avail,
        sources=sources,
    )


class MemoryMonitor:
    """RAM and VRAM in use now, for a status bar that samples every few seconds (the window's; no torch).

    Shares the probes above: system memory through :func:`_probe_ram` (psutil), the GPU through NVML, initialised
    once and kept (a probe per sample would init and shut NVML down each time). A machine without an NVIDIA GPU,
    driver or ``pynvml`` samples RAM only.
    """

    def __init__(self, index: int = 0) -> None:
        self._index = index
        self._handle: Any = None
        self._tried = False

    def _nvml_handle(self) -> Any:
        if not self._tried:
            self._tried = True
            try:
                import pynvml

                pynvml.nvmlInit()
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(self._index)
            except Exception as exc:  # noqa: BLE001 - ImportError or any NVMLError: VRAM is simply not shown
                log.debug("NVML unavailable: %s", exc)
                self._handle = None
        return self._handle

    def sample(self) -> dict[str, int | None]:
        """``ram_used``, ``ram_total``, ``vram_used``, ``vram_total`` in bytes (None: unknown)."""
        out: dict[str, int | None] = {"ram_used": None, "ram_total": None, "vram_used": None, "vram_total": None}
        try:
            total, available, _source = _probe_ram()
        except OSError as exc:
            log.debug("psutil failed: %s", exc)
            total = available = None
        if total is not None and available is not None:
            out["ram_used"], out["ram_total"] = total - available, total
        handle = self._nvml_handle()
        if handle is not None:
            try:
                import pynvml

                info = pynvml.nvmlDeviceGetMemoryInfo(handle)
                out["vram_used"], out["vram_total"] = int(info.used), int(info.total)
            except Exception as exc:  # noqa: BLE001 - a transient NVML error only hides the figure
                log.debug("NVML memory query failed: %s", exc)
        return out
