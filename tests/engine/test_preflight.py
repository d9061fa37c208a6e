"""GPU preflight (engine/placement/preflight.py) and ``clover-desk doctor``: the rules run on made-up machines, since the
machines that need them (a CPU-only torch beside an RTX 5090, an old driver, a torch without sm_120 kernels, a
bitsandbytes without CUDA libraries) are not here."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from clover_desk.cli import doctor as cmd_doctor
from clover_desk.cli import main as cli
from clover_desk.engine.placement import preflight
from clover_desk.engine.placement.preflight import Finding, GpuFacts, arch_support, check, torch_index_for

ROOT = Path(__file__).resolve().parents[2]

CU126_ARCHS = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")  # a CUDA 12.6 build's kernel list
CU128_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120")
BNB_LIBS = ((11, 8), (12, 1), (12, 4), (12, 6), (12, 8), (13, 0))

# a healthy machine: RTX 4070 Ti SUPER, CUDA 12.8 torch, recent driver, bitsandbytes with CUDA 12 libraries
GOOD = GpuFacts(
    platform="linux", torch_version="2.13.0+cu128", torch_cuda="12.8", cuda_available=True, arch_list=CU128_ARCHS,
    capability=(8, 9), gpu_name="NVIDIA GeForce RTX 4070 Ti SUPER", nvml_gpu_count=1, driver_version="575.57.08",
    driver_cuda=(12, 9), bnb_version="0.50.2", bnb_cuda_libs=BNB_LIBS,
)
RTX5090 = {"capability": (12, 0), "gpu_name": "NVIDIA GeForce RTX 5090"}


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == "error"]


def test_a_healthy_machine_has_no_error_and_says_so() -> None:
    findings = check(GOOD)
    assert errors(findings) == [] and {f.key for f in findings if f.level == "ok"} == {"torch", "bitsandbytes"}
    assert "RTX 4070 Ti SUPER (sm_89)" in findings[0].message


def test_no_gpu_means_the_cpu_and_nothing_to_install() -> None:
    facts = GpuFacts(torch_version="2.13.0+cpu", bnb_version="0.50.2")
    (finding,) = check(facts)
    assert finding.level == "info" and finding.key == "gpu" and "CPU" in finding.message


def test_cpu_only_torch_beside_an_nvidia_gpu_names_the_cuda_build_to_install() -> None:
    facts = GpuFacts(torch_version="2.13.0+cpu", torch_cuda=None, nvml_gpu_count=1, driver_cuda=(12, 9),
                     bnb_version="0.50.2", **RTX5090)
    (finding,) = errors(check(facts))
    assert finding.key == "torch" and "CPU-only build" in finding.message and "RTX 5090 (sm_120)" in finding.message
    assert "pip install --force-reinstall 'torch==2.13.0' --index-url https://download.pytorch.org/whl/cu128" in (
        finding.message)


def test_driver_older_than_torchs_cuda() -> None:
    facts = replace(GOOD, cuda_available=False, arch_list=(), driver_version="535.104.05", driver_cuda=(12, 2),
                    cuda_warning="The NVIDIA driver on your system is too old (found version 12020).")
    (finding,) = errors(check(facts))
    assert finding.key == "driver"
    assert "535.104.05" in finding.message and "12.2" in finding.message and "CUDA 12.8" in finding.message
    assert "update the NVIDIA driver" in finding.message


def test_hidden_gpu_and_an_unexplained_cuda_failure() -> None:
    hidden = replace(GOOD, cuda_available=False, cuda_visible_devices="")
    (finding,) = errors(check(hidden))
    assert finding.key == "gpu" and "CUDA_VISIBLE_DEVICES" in finding.message and "unset" in finding.message
    odd = replace(GOOD, cuda_available=False, cuda_warning="CUDA unknown error")
    (finding,) = errors(check(odd))
    assert finding.key == "gpu" and "CUDA unknown error" in finding.message


def test_rtx_50_series_on_a_build_without_sm_120() -> None:
    facts = replace(GOOD, torch_version="2.13.0+cu126", torch_cuda="12.6", arch_list=CU126_ARCHS, **RTX5090)
    (finding,) = errors(check(facts))
    assert finding.key == "arch"
    assert "sm_120" in finding.message and "CUDA 12.8+ build" in finding.message and "whl/cu128" in finding.message
    # the same build with PTX for an older card: runs, compiled at first use
    ptx = replace(facts, arch_list=(*CU126_ARCHS, "compute_90"))
    (warning,) = [f for f in check(ptx) if f.key == "arch"]
    assert warning.level == "warning" and "first use" in warning.message
    # a CUDA 12.8 build has sm_120 kernels
    assert errors(check(replace(GOOD, **RTX5090))) == []


def test_sm_120_needs_a_driver_for_cuda_12_8_before_a_new_torch_helps() -> None:
    facts = replace(GOOD, torch_version="2.13.0+cu126", torch_cuda="12.6", arch_list=CU126_ARCHS,
                    driver_cuda=(12, 6), **RTX5090)
    (finding,) = errors(check(facts))
    assert "update the NVIDIA driver first" in finding.message


@pytest.mark.parametrize("capability, archs, expected", [
    ((8, 6), ("sm_80",), "native"),  # same major, higher minor: the sm_80 cubin runs
    ((8, 9), ("sm_80", "sm_86", "sm_90"), "native"),
    ((8, 0), ("sm_86",), "none"),  # a cubin never runs on a lower minor
    ((12, 0), ("sm_90", "sm_100"), "none"),  # nor on another major
    ((12, 1), ("sm_120",), "native"),
    ((12, 0), ("sm_90", "compute_90"), "ptx"),  # PTX compiles for any newer card
    ((9, 0), ("sm_90a",), "native"),  # architecture-specific code: exactly that card
    ((10, 0), ("sm_90a", "compute_100a"), "none"),  # and never forward
    ((7, 5), (), "none"),
])
def test_arch_support(capability: tuple[int, int], archs: tuple[str, ...], expected: str) -> None:
    assert arch_support(capability, archs) == expected


def test_torch_index_for_card_and_driver() -> None:
    assert torch_index_for((12, 0), None) == "cu128"
    assert torch_index_for((12, 0), (12, 4)) is None  # the driver must be updated first
    assert torch_index_for((12, 0), (13, 0)) == "cu130"
    assert torch_index_for((8, 6), (12, 6)) == "cu126"
    assert torch_index_for((8, 6), (12, 4)) == "cu118"
    assert torch_index_for((6, 1), None) == "cu126"  # pre-Turing: not in the CUDA 12.8+ wheels


def test_bitsandbytes_missing_or_without_a_cuda_library_for_torch() -> None:
    missing = replace(GOOD, bnb_version=None, bnb_cuda_libs=())
    (finding,) = errors(check(missing))
    assert finding.key == "bitsandbytes" and "pip install 'bitsandbytes>=0.50'" in finding.message
    assert errors(check(replace(missing, cuda_available=False, nvml_gpu_count=0, torch_cuda=None))) == [finding]
    no_cuda12 = replace(GOOD, bnb_cuda_libs=((11, 8),))
    (finding,) = errors(check(no_cuda12))
    assert finding.key == "bitsandbytes" and "no CUDA 12.x library" in finding.message
    assert "--upgrade" in finding.message
    forced = replace(GOOD, bnb_cuda_override="125")
    (finding,) = errors(check(forced))
    assert "BNB_CUDA_VERSION=125" in finding.message


def test_torch_that_does_not_import() -> None:
    facts = GpuFacts(torch_version=None, torch_error="OSError: [WinError 126] error loading c10.dll",
                     bnb_version="0.50.2")
    (finding,) = check(facts)
    assert finding.level == "error" and finding.key == "torch" and "c10.dll" in finding.message


def test_findings_are_sorted_errors_first() -> None:
    facts = replace(GOOD, torch_cuda="12.6", torch_version="2.13.0+cu126", arch_list=CU126_ARCHS,
                    bnb_cuda_libs=((11, 8),), **RTX5090)
    levels = [f.level for f in check(facts)]
    assert levels == sorted(levels, key=lambda level: -preflight.LEVELS.index(level)) and levels[0] == "error"


# ---- the probes and the command, on this machine ------------------------------------------------------------------


def test_gather_facts_on_this_machine() -> None:
    import torch

    facts = preflight.gather_facts()
    assert facts.torch_version == str(torch.__version__) and facts.torch_cuda == torch.version.cuda
    assert facts.cuda_available == torch.cuda.is_available()
    assert facts.bnb_version is not None  # a dependency
    if not facts.cuda_available and facts.nvml_gpu_count == 0:
        assert [f.key for f in check(facts)] == ["gpu"]


def test_preflight_module_does_not_import_torch() -> None:
    code = "import sys, engine.placement.preflight; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_doctor_prints_facts_and_findings(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor"]) == 0 or any(f.level == "error" for f in preflight.preflight())
    out = capsys.readouterr().out
    assert out.startswith("torch ") and "bitsandbytes" in out
    assert cli.main(["doctor", "--json"]) in (0, 1)
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"facts", "findings", "report"}
    assert all(set(f) == {"level", "key", "message"} for f in data["findings"])
    assert data["report"][0].startswith("torch ") and any(r.startswith("opt-in paths") for r in data["report"])


def test_doctor_exits_1_on_an_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    bad = GpuFacts(torch_version="2.13.0+cpu", nvml_gpu_count=1, bnb_version="0.50.2", **RTX5090)
    monkeypatch.setattr(cmd_doctor, "gather_facts", lambda: bad)
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "ERROR   torch: torch 2.13.0+cpu is a CPU-only build" in out and "RTX 5090" in out
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    assert cli.main(["doctor"]) == 1
    assert "packaged app" in capsys.readouterr().out


def test_the_opt_in_switches_are_checked() -> None:
    """The GPU-path switches: which opt-in paths are on (and that without a CUDA GPU they do nothing), and a
    value an engine refuses (anything but "1" or "0"; both expert fetches), an error in engine.settings' words."""
    assert [f for f in check(GOOD) if f.key == "opt-in"] == []
    on = [f for f in check(replace(GOOD, opt_in=(("CLOVER_DESK_FUSED_MOE", "1"), ("CLOVER_DESK_FLA_GDN", "0"))))
          if f.key == "opt-in"]
    assert [(f.level, f.message) for f in on] == [
        ("info", "experimental GPU paths on: CLOVER_DESK_FUSED_MOE (not yet measured on a GPU)")]
    cpu = GpuFacts(torch_version="2.13.0+cpu", bnb_version="0.50.2", opt_in=(("CLOVER_DESK_DEVICE_POOL", "1"),))
    assert any("do nothing without a CUDA GPU" in f.message for f in check(cpu) if f.key == "opt-in")
    assert [f for f in check(replace(GOOD, opt_in=(("CLOVER_DESK_CPU_KERNELS", "0"),))) if f.key == "opt-in"] == []
    bad = [f for f in check(replace(GOOD, opt_in=(("CLOVER_DESK_ZERO_COPY", "true"),))) if f.key == "opt-in"]
    assert [f.level for f in bad] == ["error"]
    assert bad[0].message.startswith("CLOVER_DESK_ZERO_COPY='true' is not allowed: set it to 1 (on) or 0 (off)")
    both = replace(GOOD, opt_in=(("CLOVER_DESK_ZERO_COPY", "1"), ("CLOVER_DESK_DEVICE_POOL", "1")))
    (clash,) = errors(check(both))
    assert clash.key == "opt-in" and "exclude each other" in clash.message


def test_the_doctor_reads_the_switches_the_engine_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """gather_facts sees the switches as set (engine.settings.switches_set), and the doctor prints the settings
    object they make (engine.settings.GpuPaths), the same one generate, serve and the window's worker get."""
    monkeypatch.setenv("CLOVER_DESK_FUSED_INT8", "1")
    monkeypatch.setenv("CLOVER_DESK_CPU_KERNELS", "0")
    monkeypatch.delenv("CLOVER_DESK_FUSED_MOE", raising=False)
    facts = preflight.gather_facts()
    assert ("CLOVER_DESK_FUSED_INT8", "1") in facts.opt_in and "CLOVER_DESK_FUSED_MOE" not in dict(facts.opt_in)
    lines = cmd_doctor.report_lines(facts, [])
    assert any(line.startswith("opt-in paths   CLOVER_DESK_FUSED_INT8 (of CLOVER_DESK_FUSED_MOE, ") for line in lines)
    assert "  fused_int8     on  (changed)" in lines and "  cpu_kernels    off  (changed)" in lines
    assert "  expert_fetch   pool" in lines
    refused = cmd_doctor.report_lines(replace(facts, opt_in=(("CLOVER_DESK_FLA_GDN", "2"),)), [])
    assert any(line.startswith("  refused: CLOVER_DESK_FLA_GDN='2' is not allowed") for line in refused)


