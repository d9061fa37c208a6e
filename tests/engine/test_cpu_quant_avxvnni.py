"""The CPU kernels' AVX-VNNI build (Intel's desktop chips from Alder Lake on: VNNI in VEX form, no AVX-512).

This machine cannot run AVX-VNNI (an AMD Zen 4; QEMU's user-mode emulator does not implement it either), so the two
halves of what such a build does are checked apart:

* its instructions: the library built for ``-march=alderlake`` adds its products with the VEX-encoded ``vpdpbusd`` /
  ``vpdpwssd`` (the same operation as AVX-512 VNNI's 256-bit forms, Intel SDM), reports itself as the AVX-VNNI
  build, and holds no EVEX-encoded instruction (no AVX-512 at all: one would stop such a CPU);
* its arithmetic: the VNNI dots sized for 16 vector registers (what the AVX-VNNI build compiles, ``CLOVER_16_REGS``
  on an AVX-512 build) give the bits of the default build, where this machine has AVX-512 VNNI.
"""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from clover_desk.engine.kernels import cpu_build, x8
from clover_desk.engine.kernels import cpu_quant as cq
from clover_desk.engine.weights.codecs import quantize_int8, quantize_nf4
from tests.disasm import assert_vex_vnni_only, disassembly, function
from tests.quant_reference import kern, make_weights  # noqa: F401 - kern is a fixture


def _disassembly(flags: tuple[str, ...]) -> str:
    cc = cpu_build.compiler()
    if not cc:
        pytest.skip("needs a C compiler")
    probe = subprocess.run([cc, *flags, "-x", "c", "-fsyntax-only", "-"], input="int x;\n", capture_output=True,
                           text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"this compiler cannot target {' '.join(flags)}: {probe.stderr.strip()[:200]}")
    path, why = cpu_build.build(cc, (*cpu_build.BASE_FLAGS, *flags), cpu_build.cache_dir())  # cached
    assert path is not None, why  # the compiler targets it, so the source must build for it
    return disassembly(path)


def test_the_avx_vnni_build_uses_vex_vnni_and_no_avx512() -> None:
    dis = _disassembly(("-march=alderlake", "-fopenmp"))
    assert_vex_vnni_only(dis)
    # clover_vnni() answers 2 (Kernels.isa: "AVX2 + AVX-VNNI")
    assert re.search(r"mov\s+\$0x2,%eax", function(dis, "clover_vnni")), function(dis, "clover_vnni")
    assert cpu_build.ISA_NAMES[2] == "AVX2 + AVX-VNNI"


def test_an_avx2_build_has_no_vnni() -> None:
    """The contrast: the same source for a plain AVX2 CPU (Haswell .. Comet Lake, Zen 1-3) has no VNNI form at all."""
    dis = _disassembly(("-march=haswell", "-fopenmp"))
    assert "vpdpbusd" not in dis and "vpdpwssd" not in dis
    assert re.search(r"xor\s+%eax,%eax", function(dis, "clover_vnni"))


def test_vnni_sized_for_16_registers_gives_the_same_bits(kern: cq.Kernels) -> None:  # noqa: F811
    if kern.isa != "AVX2 + AVX-512 VNNI":
        pytest.skip(f"needs AVX-512 VNNI to compare against, the kernels here are {kern.isa}")
    small = cq.Kernels(defines=("CLOVER_16_REGS",))
    assert small.ok and small.isa == kern.isa and "-DCLOVER_16_REGS" in small.flags
    gen = torch.Generator().manual_seed(0)
    codes, scales = quantize_int8(torch.randn(48, 512, generator=gen) * 0.02)
    pc, ps = x8.i8_pack(codes, scales)
    for t in (1, 3, 4, 5, 8, 9, 12, 16, 33, 40):  # the INT8 x8 dot takes 4 rows at once here, 8 on the default build
        x = torch.randn(t, 512, generator=gen)
        assert torch.equal(small.smatmul(x, pc, ps, cq.INT8X8, 512), kern.smatmul(x, pc, ps, cq.INT8X8, 512)), t
        assert torch.equal(small.smatmul(x, codes, scales, cq.INT8, 512), kern.smatmul(x, codes, scales, cq.INT8, 512))
    ncodes, absmax = quantize_nf4(torch.randn(32, 512, generator=gen), 64)
    for t in (1, 5, 32):
        x = torch.randn(t, 512, generator=gen)
        assert torch.equal(small.smatmul(x, ncodes, absmax, cq.NF4, 64), kern.smatmul(x, ncodes, absmax, cq.NF4, 64))
    for qtype in (cq.Q4_K, cq.Q6_K, cq.Q8_0):
        w = make_weights(qtype, 24, 512, seed=qtype)
        for t in (1, 4, 32):
            x = torch.randn(t, 512, generator=gen)
            assert torch.equal(small.qmatmul(x, w, qtype), kern.qmatmul(x, w, qtype)), (cq.TYPE_NAMES[qtype], t)
