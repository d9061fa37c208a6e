"""Reading a built library's instructions with binutils' objdump (the kernels' instruction-set tests)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

INSN = re.compile(r"^\s*[0-9a-f]+:\t((?:[0-9a-f]{2} )+)\s*\t(.*)$")


def disassembly(path: Path) -> str:
    objdump = shutil.which("objdump")
    if not objdump:
        pytest.skip("needs binutils' objdump")
    return subprocess.run([objdump, "-d", str(path)], capture_output=True, text=True, check=True, timeout=120).stdout


def function(dis: str, name: str) -> str:
    start = dis.index(f"<{name}>:\n")
    return dis[start:dis.index("\n\n", start)]


def mnemonics(dis: str) -> tuple[dict[str, int], list[str]]:
    """-> (count per mnemonic, "{vex} " kept as part of it; the EVEX-encoded instructions' text)."""
    counts: dict[str, int] = {}
    evex = []
    for line in dis.splitlines():
        m = INSN.match(line)
        if not m:
            continue
        raw, text = m.groups()
        if raw.startswith("62 "):  # 0x62 opens an EVEX prefix in 64-bit mode (BOUND does not exist there)
            evex.append(text)
        words = text.split()
        if not words:
            continue
        name = f"{words[0]} {words[1]}" if words[0] == "{vex}" and len(words) > 1 else words[0]
        counts[name] = counts.get(name, 0) + 1
    return counts, evex


def assert_vex_vnni_only(dis: str) -> None:
    """VNNI in VEX form only (AVX-VNNI), and no EVEX instruction at all (no AVX-512: one would stop such a CPU)."""
    counts, evex = mnemonics(dis)
    assert not evex, f"EVEX-encoded instructions in an AVX-VNNI build: {evex[:5]}"
    assert counts.get("{vex} vpdpbusd", 0) > 0 and counts.get("{vex} vpdpwssd", 0) > 0, \
        {k: v for k, v in counts.items() if "vpdp" in k}
    assert not any(k.startswith(("vpdpbusd", "vpdpwssd")) for k in counts), "a VNNI form without the VEX prefix"
