"""GPU preflight: can this machine's torch, NVIDIA driver and bitsandbytes run the engine on its GPU?

Stdlib only at import time (the window's process may ask, through ``clover-desk doctor --json``). Two steps:

    facts = gather_facts()     # probes torch, NVML and bitsandbytes' files; each may be missing, none raises
    findings = check(facts)    # pure: what is wrong and what to install, from the facts alone

:func:`preflight` does both. Each :class:`Finding` is one line a person can act on; ``level`` "error" means the GPU
will not be used (or the engine fails on it) until the fix it names is applied, "warning" that it runs with a
caveat, "info" and "ok" are for the record.

Rules (each a pure function of the facts, tested with made-up ones):

* no NVIDIA GPU (NVML sees none and torch has no CUDA device): the engine runs on the CPU; nothing to fix.
* a GPU, but torch is a CPU-only build (``torch.version.cuda`` is None): install a CUDA build of the same torch.
* a CUDA build, ``torch.cuda.is_available()`` False, NVML sees the GPU: ``CUDA_VISIBLE_DEVICES`` hides it, or the
  driver supports an older CUDA than torch was built for (``nvmlSystemGetCudaDriverVersion``): update the driver.
* the card's compute capability against ``torch.cuda.get_arch_list()``: a cubin runs on its own major version at an
  equal or higher minor (sm_86 runs sm_80 code); PTX (``compute_XY``) can be compiled for any newer card when first
  used (slow start); otherwise no kernel runs. RTX 50-series cards are sm_120 and need a CUDA 12.8+ build.
* bitsandbytes (NF4 experts, CPU and GPU): missing, or shipping no native library for torch's CUDA major version.
* the GPU-path switches (``engine.settings.SWITCHES``, each "1" or "0"; the opt-in paths are
  ``engine.settings.OPT_IN``): which opt-in paths are on and that they do nothing without a CUDA GPU; a value the
  engine refuses (neither "1" nor "0", or both expert fetches) is an error, in ``GpuPaths.from_env``'s words.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from clover_desk.engine.kernels import cpu_build
from clover_desk.engine.settings import GpuPaths, SettingsError, switches_set

LEVELS = ("ok", "info", "warning", "error")
TORCH_INDEX = "https://download.pytorch.org/whl"

# The first CUDA toolkit that can build kernels for a compute capability (highest key <= the card's applies).
MIN_CUDA_FOR_CAPABILITY: dict[tuple[int, int], tuple[int, int]] = {
    (8, 0): (11, 0),
    (8, 6): (11, 1),
    (8, 9): (11, 8),
    (9, 0): (11, 8),
    (10, 0): (12, 8),
    (10, 3): (12, 9),
    (11, 0): (13, 0),
    (12, 0): (12, 8),
}
# PyTorch wheel indexes by CUDA version (download.pytorch.org/whl/<tag>); the newest the driver and card allow wins.
TORCH_CUDA_TAGS: dict[tuple[int, int], str] = {(11, 8): "cu118", (12, 6): "cu126", (12, 8): "cu128", (13, 0): "cu130"}


@dataclass(frozen=True)
class GpuFacts:
    """What the probes found. Every field has a "not known / not there" value, so tests build any machine."""

    platform: str = sys.platform
    torch_version: str | None = None  # None: torch does not import (torch_error says why)
    torch_error: str | None = None
    torch_cuda: str | None = None  # torch.version.cuda, e.g. "12.8"; None: a CPU-only (or ROCm) build
    cuda_available: bool = False  # torch.cuda.is_available()
    cuda_warning: str | None = None  # what torch warned while looking for the GPU (e.g. "driver too old")
    arch_list: tuple[str, ...] = ()  # torch.cuda.get_arch_list(): the kernels built into this torch
    capability: tuple[int, int] | None = None  # the GPU's compute capability (torch, else NVML)
    gpu_name: str | None = None  # (NVML, else torch)
    nvml_gpu_count: int = 0  # GPUs the NVIDIA driver reports (0: no GPU, no driver, or no pynvml)
    driver_version: str | None = None  # e.g. "570.86.15"
    driver_cuda: tuple[int, int] | None = None  # the newest CUDA the driver supports
    cuda_visible_devices: str | None = None  # $CUDA_VISIBLE_DEVICES when set
    bnb_version: str | None = None  # None: bitsandbytes is not installed
    bnb_cuda_libs: tuple[tuple[int, int], ...] = ()  # CUDA versions bitsandbytes ships native libraries for
    bnb_cuda_override: str | None = None  # $BNB_CUDA_VERSION when set
    opt_in: tuple[tuple[str, str], ...] = ()  # (switch, value) of the engine.settings.SWITCHES that are set
    # what the CPU kernels run on (engine.kernels.cpu_build.describe); None: no C compiler and no prebuilt library
    cpu_kernels: str | None = "not checked"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Finding:
    level: str  # one of LEVELS
    key: str  # what it is about: "gpu", "torch", "driver", "arch", "bitsandbytes"
    message: str  # one line: what is wrong and what to install

    def line(self) -> str:
        return f"{self.level.upper():7} {self.key}: {self.message}"

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------------------------
# Pure rules
# ---------------------------------------------------------------------------------------------------------------


def parse_version(text: str | None) -> tuple[int, int] | None:
    """'12.8' / '12.8.1' -> (12, 8); None for anything else."""
    m = re.match(r"^(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_arch(name: str) -> tuple[str, tuple[int, int], bool] | None:
    """'sm_86' -> ('sm', (8, 6), False); 'sm_120' -> ('sm', (12, 0), False); 'sm_90a' -> ('sm', (9, 0), True);
    'compute_90' -> ('compute', (9, 0), False). The trailing digit is the minor version; a letter suffix marks
    architecture-specific code that runs on that exact capability only."""
    m = re.match(r"^(sm|compute)_(\d+)(\d)([a-z]?)$", name.strip())
    if not m:
        return None
    return m.group(1), (int(m.group(2)), int(m.group(3))), bool(m.group(4))


def sm(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def arch_support(capability: tuple[int, int], arch_list: tuple[str, ...] | list[str]) -> str:
    """How a torch built for ``arch_list`` runs on a card of ``capability``: "native" (a cubin of the same major at
    an equal or lower minor), "ptx" (only PTX of an equal or older capability: compiled at first use) or "none"."""
    parsed = [p for p in (parse_arch(a) for a in arch_list) if p is not None]
    for kind, cap, specific in parsed:
        if kind == "sm" and (cap == capability or (not specific and cap[0] == capability[0] and cap[1] <= capability[1])):
            return "native"
    if any(kind == "compute" and not specific and cap <= capability for kind, cap, specific in parsed):
        return "ptx"
    return "none"


def min_cuda_for(capability: tuple[int, int]) -> tuple[int, int] | None:
    keys = [k for k in MIN_CUDA_FOR_CAPABILITY if k <= capability]
    return MIN_CUDA_FOR_CAPABILITY[max(keys)] if keys else None


def torch_index_for(capability: tuple[int, int] | None, driver_cuda: tuple[int, int] | None) -> str | None:
    """The PyTorch wheel index tag to install for this card and driver: at least the CUDA the card needs, at most
    what the driver supports (the newest of those; cu128 when the driver is unknown). None: the driver is too old
    for every build the card can use."""
    need = (min_cuda_for(capability) if capability else None) or (0, 0)
    top = (12, 6) if capability is not None and capability < (7, 5) else (99, 0)  # cu128+ wheels dropped pre-Turing
    usable = sorted(v for v in TORCH_CUDA_TAGS if need <= v <= top and (driver_cuda is None or v <= driver_cuda))
    if not usable:
        return None
    if driver_cuda is None:
        preferred = [v for v in usable if v >= (12, 8)]  # runs every RTX card from the 20- to the 50-series
        return TORCH_CUDA_TAGS[preferred[0] if preferred else usable[-1]]
    return TORCH_CUDA_TAGS[usable[-1]]


def _v(version: tuple[int, int] | None) -> str:
    return f"{version[0]}.{version[1]}" if version else "?"


def _torch_base(version: str) -> str:
    return version.split("+", 1)[0]


def _install_torch(facts: GpuFacts) -> str:
    base = _torch_base(facts.torch_version or "")
    tag = torch_index_for(facts.capability, facts.driver_cuda)
    pin = f"'torch=={base}'" if base else "torch"
    if tag is None:
        return "update the NVIDIA driver first: it supports no CUDA version this card can use"
    return f"pip install --force-reinstall {pin} --index-url {TORCH_INDEX}/{tag}"


def _gpu(facts: GpuFacts) -> str:
    name = facts.gpu_name or "the NVIDIA GPU"
    return f"{name} ({sm(facts.capability)})" if facts.capability else name


def check(facts: GpuFacts) -> list[Finding]:
    """Findings for ``facts``, most important first (errors before warnings before the rest)."""
    out: list[Finding] = []
    out.extend(_check_bitsandbytes_installed(facts))
    out.extend(check_opt_in(facts))
    if facts.cpu_kernels is None:
        out.append(Finding("warning", "cpu-kernels", "no C compiler and no prebuilt CPU kernels for this CPU: "
                           "quantized weights on the CPU are unpacked every forward, ~30x slower: install gcc "
                           "(Debian / Ubuntu: sudo apt install gcc; Fedora: sudo dnf install gcc)"))
    if facts.torch_version is None:
        out.append(Finding("error", "torch", f"torch does not import ({facts.torch_error or 'not installed'}): "
                                             "reinstall Clover Desk (pipx reinstall clover-desk) or its torch"))
        return _sorted(out)
    has_gpu = facts.nvml_gpu_count > 0 or facts.cuda_available
    if not has_gpu:
        out.append(Finding("info", "gpu", "no NVIDIA GPU found (no card, or no NVIDIA driver): the engine runs on "
                                          "the CPU from system RAM, slowly; with an NVIDIA card, install its driver"))
        return _sorted(out)
    if facts.torch_cuda is None:
        out.append(Finding("error", "torch", f"torch {facts.torch_version} is a CPU-only build, but the driver sees "
                                             f"{_gpu(facts)}: install a CUDA build: {_install_torch(facts)}"))
        return _sorted(out)
    if not facts.cuda_available:
        out.append(_why_no_cuda(facts))
        return _sorted(out)
    out.extend(_check_arch(facts))
    out.extend(_check_bitsandbytes_cuda(facts))
    return _sorted(out)


def _why_no_cuda(facts: GpuFacts) -> Finding:
    torch_cuda = parse_version(facts.torch_cuda)
    visible = facts.cuda_visible_devices
    if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        return Finding("error", "gpu", f"CUDA_VISIBLE_DEVICES={visible!r} hides the GPU from torch: unset it")
    if facts.driver_cuda is not None and torch_cuda is not None and facts.driver_cuda < torch_cuda:
        driver = f"driver {facts.driver_version} " if facts.driver_version else "driver "
        return Finding(
            "error", "driver",
            f"the NVIDIA {driver}supports CUDA up to {_v(facts.driver_cuda)}, but torch {facts.torch_version} is "
            f"built for CUDA {facts.torch_cuda}: update the NVIDIA driver (to one for CUDA {facts.torch_cuda} or "
            f"newer), or install a torch built for CUDA {_v(facts.driver_cuda)} or older",
        )
    said = f" (torch said: {facts.cuda_warning})" if facts.cuda_warning else ""
    return Finding(
        "error", "gpu",
        f"torch {facts.torch_version} (CUDA {facts.torch_cuda}) cannot use {_gpu(facts)} although the driver sees "
        f"it{said}: after a driver update, reboot; check that no other program holds the GPU in exclusive mode",
    )


def _check_arch(facts: GpuFacts) -> list[Finding]:
    if facts.capability is None or not facts.arch_list:
        return [Finding("info", "arch", "the GPU's compute capability or torch's kernel list is unknown; not checked")]
    support = arch_support(facts.capability, facts.arch_list)
    built = ", ".join(facts.arch_list)
    if support == "native":
        return [Finding("ok", "torch", f"torch {facts.torch_version} (CUDA {facts.torch_cuda}) has kernels for "
                                       f"{_gpu(facts)}")]
    need = min_cuda_for(facts.capability)
    needs = f"; {sm(facts.capability)} needs a CUDA {_v(need)}+ build" if need else ""
    if support == "ptx":
        return [Finding("warning", "arch",
                        f"torch {facts.torch_version} has no {sm(facts.capability)} kernels (built for {built}): "
                        f"its PTX is compiled for {_gpu(facts)} at first use (minutes at start){needs}: "
                        f"{_install_torch(facts)}")]
    return [Finding("error", "arch",
                    f"torch {facts.torch_version} (CUDA {facts.torch_cuda}) has kernels for {built}, none of which "
                    f"runs on {_gpu(facts)}{needs}: {_install_torch(facts)}")]


def _check_bitsandbytes_installed(facts: GpuFacts) -> list[Finding]:
    if facts.bnb_version is None:
        return [Finding("error", "bitsandbytes", "bitsandbytes is not installed, and NF4 experts need it: "
                                                 "pip install 'bitsandbytes>=0.50'")]
    return []


def _check_bitsandbytes_cuda(facts: GpuFacts) -> list[Finding]:
    if facts.bnb_version is None:
        return []
    torch_cuda = parse_version(facts.torch_cuda)
    if torch_cuda is None:
        return []
    libs = ", ".join(_v(v) for v in sorted(facts.bnb_cuda_libs)) or "none"
    if facts.bnb_cuda_override:
        wanted = facts.bnb_cuda_override
        if any(f"{a}{b}" == wanted for a, b in facts.bnb_cuda_libs):
            return [Finding("warning", "bitsandbytes", f"BNB_CUDA_VERSION={wanted} forces bitsandbytes' CUDA "
                                                       f"library; unset it unless you mean it")]
        return [Finding("error", "bitsandbytes", f"BNB_CUDA_VERSION={wanted} asks for a CUDA library bitsandbytes "
                                                 f"{facts.bnb_version} does not ship (it has {libs}): unset it")]
    if not any(v[0] == torch_cuda[0] for v in facts.bnb_cuda_libs):
        return [Finding("error", "bitsandbytes",
                        f"bitsandbytes {facts.bnb_version} has no CUDA {torch_cuda[0]}.x library (it ships {libs}) "
                        f"for torch's CUDA {facts.torch_cuda}, so NF4 experts cannot run on the GPU: "
                        "pip install --upgrade 'bitsandbytes>=0.50'")]
    return [Finding("ok", "bitsandbytes", f"bitsandbytes {facts.bnb_version} has a CUDA {torch_cuda[0]}.x library")]


def settings_of(facts: GpuFacts) -> GpuPaths | SettingsError:
    """The :class:`engine.settings.GpuPaths` the switches in ``facts`` give, or the error they are refused with."""
    try:
        return GpuPaths.from_env(dict(facts.opt_in))
    except SettingsError as exc:
        return exc


def opt_in_on(facts: GpuFacts) -> list[str]:
    """The opt-in paths (:data:`engine.settings.OPT_IN`) that are on (none when the switches are refused)."""
    paths = settings_of(facts)
    return [] if isinstance(paths, SettingsError) else paths.opt_in()


def check_opt_in(facts: GpuFacts) -> list[Finding]:
    """The GPU-path switches: refused values (as an engine process would refuse them), which opt-in paths are on
    and whether they can act."""
    paths = settings_of(facts)
    if isinstance(paths, SettingsError):
        return [Finding("error", "opt-in", f"{paths}: an engine refuses to start with it")]
    on = paths.opt_in()
    if not on:
        return []
    gpu = facts.cuda_available and facts.torch_cuda is not None
    return [Finding("info", "opt-in", f"experimental GPU paths on: {', '.join(on)} (not yet measured on a GPU)"
                                      + ("" if gpu else "; they do nothing without a CUDA GPU"))]


def _sorted(findings: list[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: -LEVELS.index(f.level))


# ---------------------------------------------------------------------------------------------------------------
# Probes (each optional; imported here, never at module import)
# ---------------------------------------------------------------------------------------------------------------


def _torch_facts(index: int) -> dict[str, Any]:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - ImportError, or OSError from a DLL that fails to load on Windows
        return {"torch_version": None, "torch_error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    out: dict[str, Any] = {"torch_version": str(torch.__version__), "torch_cuda": torch.version.cuda}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["cuda_available"] = bool(torch.cuda.is_available())
    if caught:
        out["cuda_warning"] = str(caught[0].message).strip().splitlines()[0]
    if out["cuda_available"]:
        try:
            out["arch_list"] = tuple(torch.cuda.get_arch_list())
            out["capability"] = tuple(torch.cuda.get_device_capability(index))
            out["gpu_name"] = torch.cuda.get_device_name(index)
        except (RuntimeError, AssertionError) as exc:
            out["cuda_warning"] = str(exc).splitlines()[0]
    return out


def _nvml_facts(index: int) -> dict[str, Any]:
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return {}
    out: dict[str, Any] = {}
    try:
        out["nvml_gpu_count"] = int(pynvml.nvmlDeviceGetCount())
        version = pynvml.nvmlSystemGetDriverVersion()
        out["driver_version"] = version.decode() if isinstance(version, bytes) else str(version)
        cuda = int(pynvml.nvmlSystemGetCudaDriverVersion())  # e.g. 12080
        out["driver_cuda"] = (cuda // 1000, cuda % 1000 // 10)
        if out["nvml_gpu_count"] > index:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            out["gpu_name"] = name.decode() if isinstance(name, bytes) else str(name)
            out["capability"] = tuple(int(x) for x in pynvml.nvmlDeviceGetCudaComputeCapability(handle))
    except pynvml.NVMLError:
        pass  # what was read so far stands
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return out


def _bnb_facts() -> dict[str, Any]:
    """bitsandbytes' version and the CUDA versions of its native libraries, from its files (no import: importing it
    loads a CUDA library and logs warnings)."""
    spec = importlib.util.find_spec("bitsandbytes")
    if spec is None:
        return {}
    try:
        from importlib.metadata import PackageNotFoundError, version

        out: dict[str, Any] = {"bnb_version": version("bitsandbytes")}
    except PackageNotFoundError:
        out = {"bnb_version": "(version unknown)"}
    libs: set[tuple[int, int]] = set()
    for folder in spec.submodule_search_locations or ():
        for path in Path(folder).glob("libbitsandbytes_cuda*"):
            m = re.match(r"^libbitsandbytes_cuda(\d+)(\d)\.(so|dll|dylib)$", path.name)
            if m:
                libs.add((int(m.group(1)), int(m.group(2))))
    out["bnb_cuda_libs"] = tuple(sorted(libs))
    return out


def gather_facts(index: int = 0) -> GpuFacts:
    """Probe this machine (GPU ``index``): NVML, then torch (imported here), then bitsandbytes' files."""
    facts: dict[str, Any] = {
        "platform": sys.platform,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "bnb_cuda_override": os.environ.get("BNB_CUDA_VERSION"),
        "opt_in": switches_set(),
    }
    facts.update(_nvml_facts(index))
    nvml_name, nvml_cap = facts.get("gpu_name"), facts.get("capability")
    facts.update(_torch_facts(index))
    facts["gpu_name"] = facts.get("gpu_name") or nvml_name
    facts["capability"] = facts.get("capability") or nvml_cap
    facts.update(_bnb_facts())
    facts["cpu_kernels"] = cpu_build.describe()
    return GpuFacts(**facts)


def preflight(index: int = 0) -> list[Finding]:
    """The findings for this machine (imports torch: call it off the GUI process, e.g. ``clover-desk doctor``)."""
    return check(gather_facts(index))
