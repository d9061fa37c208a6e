"""The Triton kernels compile for the GPUs the product targets, on this machine without one (``tests/triton_aot.py``):
every launch the engine makes (fused NF4 and GGUF MoE for an AR step and a 32-slot pass, the int8 LM head, the GGUF
dequantize kernel) with its real arguments, lowered by Triton and ptxas for the RTX 40 series (sm_89), H100/H200
(sm_90) and the RTX 50 series (sm_120). The interpreter tests prove the arithmetic; this proves the code lowers
(types, layouts, tl.dot shapes) and that no bf16 kernel spills registers to memory. The device pool's placing and
row copy (``engine.kernels.triton_copy``) are compiled at the 16 GiB plan's pool size too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ("sm_89", "sm_90", "sm_120")
LAUNCHES = {  # what launched, and the kernels it launches
    **{f"nf4 T={t} bfloat16": ("gate_up_kernel", "down_kernel") if t == 1 else
       ("grouped_gate_up_kernel", "grouped_down_kernel") for t in (1, 32)},
    "nf4 T=32 float32": ("grouped_gate_up_kernel", "grouped_down_kernel"),
    **{f"{fmt} T={t} bfloat16": ("gate_up_kernel", "down_kernel") if t == 1 else
       ("grouped_gate_up_kernel", "grouped_down_kernel") for fmt in ("q4_0", "q4_k_m", "q8_0", "q5_k") for t in (1, 32)},
    "int8 head R=1 bfloat16": ("int8_linear_kernel",),  # (R=32 is the same compiled kernel: rows are an argument)
    "gguf dequantize q6_k": ("gguf_dequant_kernel",),
    "device pool fetch S=1565 k=8": ("place_kernel",),
    "device pool prefetch S=1565 k=8": ("place_kernel",),
    "device pool block fetch S=1565 E=256": ("place_set_kernel",),
    "device pool block prefetch S=1565 E=256": ("place_set_kernel",),
    "device pool copy nf4 rows": ("copy_rows_kernel",),
}


def _nvidia_backend() -> str | None:
    """Why Triton cannot compile for NVIDIA GPUs here, or None."""
    try:
        import triton
    except ImportError:
        return "Triton is not installed"
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return None if ptxas.exists() else f"Triton has no NVIDIA backend with ptxas ({ptxas})"


@pytest.mark.heavy  # ~1.5-2.5 min on 2 cores: make test-heavy
def test_every_kernel_launch_compiles_for_the_target_gpus(tmp_path: Path) -> None:
    why = _nvidia_backend()
    if why is not None:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    children = []  # one process per target, side by side (the compiles are single-threaded: the cores share them)
    for target in TARGETS:  # each compiled here, not from a cache
        children.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "triton_aot.py"), target],
                                         env={**env, "TRITON_CACHE_DIR": str(tmp_path / f"cache-{target}")}, cwd=ROOT,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    rows = []
    try:
        for child in children:
            out, err = child.communicate(timeout=900)
            assert child.returncode == 0, err[-4000:]
            rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    got = {(r["launch"], r["kernel"], r["target"]) for r in rows}
    want = {(launch, kernel, target) for launch, kernels in LAUNCHES.items() for kernel in kernels for target in TARGETS}
    assert got == want
    from clover_desk.engine.kernels.triton_moe import NUM_WARPS

    for r in rows:
        assert 0 < r["registers"] <= 255, r
        if r["kernel"] in ("gate_up_kernel", "down_kernel", "grouped_gate_up_kernel", "grouped_down_kernel"):
            assert r["num_warps"] == NUM_WARPS["grouped" if r["kernel"].startswith("grouped") else "pair"], r
        if "bfloat16" in r["launch"] or "device pool" in r["launch"]:  # the product's path: registers spilled to
            # the stack would cost memory traffic
            assert r["stack"] == 0 and r["local"] == 0, r
