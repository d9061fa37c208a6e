"""``clover-desk doctor``: can this machine run the engine on its GPU? What to install if not.

    clover-desk doctor [--json]

Prints what was found (torch and its CUDA build, the GPU and its compute capability, the NVIDIA driver,
bitsandbytes' CUDA libraries, what the CPU kernels are built with) and the GPU paths and kernel switches an engine would run with
(``engine.settings.GpuPaths``, read from the same switches as ``generate``, ``serve`` and the window), then one line
per finding (``engine.placement.preflight``): errors first, each naming what to
install. ``--json`` prints ``{"facts": {...}, "findings": [{"level", "key", "message"}, ...], "report": [lines]}``
instead (``report``: the facts as printed above; ``facts.gpu_settings``: the settings' fields, or null when
a switch is refused): the window's Help ▸ Check this machine's GPU runs this command in
a child process (its own process never imports torch) and shows both (``ui/gpu_check.py``).

Exit status: 0 no error found (the engine can run, on the GPU or on the CPU), 1 at least one error (a refused
switch is one: the other commands exit 2 on it).
"""

from __future__ import annotations

import argparse
import json
import sys

from clover_desk.engine.placement.preflight import Finding, GpuFacts, check, gather_facts, opt_in_on, settings_of
from clover_desk.engine.settings import OPT_IN, SettingsError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print facts and findings as one JSON object")


def report_lines(facts: GpuFacts, findings: list[Finding], frozen: bool = False) -> list[str]:
    """The human report: the facts in a few lines, then the findings."""
    torch = facts.torch_version or "not importable"
    build = f"CUDA {facts.torch_cuda}" if facts.torch_cuda else "CPU-only build"
    gpu = facts.gpu_name or "none found"
    if facts.capability:
        gpu += f" (compute capability {facts.capability[0]}.{facts.capability[1]})"
    driver = facts.driver_version or "not found"
    if facts.driver_cuda:
        driver += f" (CUDA up to {facts.driver_cuda[0]}.{facts.driver_cuda[1]})"
    bnb = facts.bnb_version or "not installed"
    if facts.bnb_version:
        cuda_libs = ", ".join(f"{a}.{b}" for a, b in facts.bnb_cuda_libs)
        bnb += f" (CUDA libraries: {cuda_libs or 'none'})"
    on = opt_in_on(facts)
    paths = settings_of(facts)
    settings = [f"refused: {paths}"] if isinstance(paths, SettingsError) else paths.lines()
    lines = [
        f"torch          {torch}" + (f", {build}" if facts.torch_version else ""),
        f"GPU            {gpu}",
        f"NVIDIA driver  {driver}",
        f"bitsandbytes   {bnb}",
        f"CPU kernels    {facts.cpu_kernels or 'none: no C compiler, no prebuilt library for this CPU'}",
        f"opt-in paths   {', '.join(on) if on else 'none on'} (of {', '.join(OPT_IN)}: =1 turns one on)",
        "GPU paths and kernel switches (engine.settings.GpuPaths):",
        *(f"  {line}" for line in settings),
        "",
        *(f.line() for f in findings),
    ]
    if frozen and any(f.level == "error" and "pip install" in f.message for f in findings):
        lines.append("note: this is the packaged app, whose torch and bitsandbytes are fixed when it is built: install "
                     "with pipx to choose them (see packaging/README.md)")
    return lines


def run(args: argparse.Namespace) -> int:
    facts = gather_facts()
    findings = check(facts)
    if args.json:
        frozen = bool(getattr(sys, "frozen", False))
        report = [line for line in report_lines(facts, [], frozen=frozen) if line]  # the facts as the CLI prints them
        paths = settings_of(facts)
        settings = None if isinstance(paths, SettingsError) else paths.to_dict()
        print(json.dumps({"facts": {**facts.to_dict(), "gpu_settings": settings}, "findings": [f.to_dict() for f in findings], "report": report}))
    else:
        print("\n".join(report_lines(facts, findings, frozen=bool(getattr(sys, "frozen", False)))))
    return 1 if any(f.level == "error" for f in findings) else 0
