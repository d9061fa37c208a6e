"""Prebuilt CPU kernels (engine.kernels.cpu_build): what a machine without a C compiler runs.

The four variants are compiled once into a temporary folder, as packaging/build.sh does for the bundle; a Kernels
whose compiler does not exist then loads the one this CPU runs, with the OpenMP runtime copied beside it, and gives
the bits of the library built here from source. The variants this CPU cannot run are checked by their instructions.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clover_desk.cli.doctor import report_lines
from clover_desk.engine.kernels import cpu_build, x8
from clover_desk.engine.kernels import cpu_quant as cq
from clover_desk.engine.placement.preflight import GpuFacts, check
from clover_desk.engine.weights.codecs import quantize_int8, quantize_nf4
from tests.disasm import assert_vex_vnni_only, disassembly, function, mnemonics
from tests.quant_reference import kern, make_bank, make_weights, routing  # noqa: F401 - kern is a fixture

ZEN4 = frozenset("fpu sse2 avx avx2 fma f16c bmi1 bmi2 abm movbe avx512f avx512bw avx512cd avx512dq avx512vl "
                 "avx512_vnni avx512_bf16".split())
ALDER_LAKE = frozenset("fpu sse2 avx avx2 fma f16c bmi1 bmi2 abm movbe avx_vnni".split())
SKYLAKE_X = frozenset("fpu sse2 avx avx2 fma f16c bmi1 bmi2 abm movbe avx512f avx512bw avx512cd avx512dq "
                      "avx512vl".split())
HASWELL = frozenset("fpu sse2 avx avx2 fma f16c bmi1 bmi2 abm movbe".split())
SANDY_BRIDGE = frozenset("fpu sse2 avx".split())


def test_each_cpu_gets_the_best_variant_it_runs() -> None:
    pick = cpu_build.pick_variant
    assert pick(ZEN4) == "avx512vnni"
    assert pick(ALDER_LAKE) == "avxvnni"
    assert pick(SKYLAKE_X) == "avx2"  # AVX-512 without VNNI: the AVX2 dots
    assert pick(HASWELL) == "avx2"
    assert pick(SANDY_BRIDGE) == "x86-64"
    assert pick(frozenset()) == "x86-64"
    assert pick(ZEN4, vnni=False) == pick(ALDER_LAKE, vnni=False) == "avx2"
    assert pick(ZEN4, scalar=True) == "x86-64"
    assert pick(HASWELL - {"fma"}) == "x86-64"  # one missing flag is enough


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, kern: cq.Kernels) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("prebuilt")
    built = cpu_build.prebuild(out)
    assert [p.name for p in built] == [f"quant_cpu-{name}.so" for name, _, _ in cpu_build.VARIANTS]
    return out


def test_prebuild_writes_the_variants_the_runtime_and_the_manifest(folder: Path) -> None:
    manifest = json.loads((folder / cpu_build.PREBUILT_MANIFEST).read_text())
    assert manifest["source_sha256"] == cpu_build.source_hash()
    assert manifest["variants"] == [f"quant_cpu-{name}.so" for name, _, _ in cpu_build.VARIANTS]
    assert (folder / "libgomp.so.1").is_file()
    for name in manifest["variants"]:  # each finds its OpenMP runtime beside it first ($ORIGIN)
        dynamic = subprocess.run(["readelf", "-d", str(folder / name)], capture_output=True, text=True).stdout
        assert "[$ORIGIN]" in dynamic and "libgomp.so.1" in dynamic, name


def test_each_variant_holds_the_instructions_its_cpus_have(folder: Path) -> None:
    vnni512 = disassembly(folder / "quant_cpu-avx512vnni.so")
    counts, evex = mnemonics(vnni512)
    assert counts.get("vpdpbusd", 0) > 0 and evex  # AVX-512 VNNI's EVEX forms
    assert_vex_vnni_only(disassembly(folder / "quant_cpu-avxvnni.so"))
    avx2 = disassembly(folder / "quant_cpu-avx2.so")
    counts, evex = mnemonics(avx2)
    assert not evex and "vpdpbusd" not in avx2 and counts.get("vpmaddubsw", 0) > 0
    base = disassembly(folder / "quant_cpu-x86-64.so")
    assert "ymm" not in base  # no AVX at all: runs on any x86-64
    assert "xor    %eax,%eax" in function(base, "clover_simd")


def test_without_a_compiler_the_best_prebuilt_library_gives_the_built_bits(folder: Path, kern: cq.Kernels,  # noqa: F811
                                                                            tmp_path: Path) -> None:
    k = cq.Kernels(cc=str(tmp_path / "no-such-cc"), out_dir=tmp_path, prebuilt_dir=folder)
    flags = cpu_build.cpu_flags()
    assert k.ok, k.reason
    assert k.prebuilt == f"quant_cpu-{cpu_build.pick_variant(flags or frozenset())}.so"
    assert k.isa == kern.isa  # this CPU's best: what -march=native compiles here too
    gen = torch.Generator().manual_seed(0)
    for qtype in (cq.Q4_K, cq.Q6_K, cq.Q8_0, cq.Q5_K, cq.Q4_0):
        w = make_weights(qtype, 40, 512, seed=qtype)
        for t in (1, 3, 8, 32):
            x = torch.randn(t, 512, generator=gen)
            assert torch.equal(k.qmatmul(x, w, qtype), kern.qmatmul(x, w, qtype)), (cq.TYPE_NAMES[qtype], t)
    codes, scales = quantize_int8(torch.randn(48, 512, generator=gen) * 0.02)
    pc, ps = x8.i8_pack(codes, scales)
    ncodes, absmax = quantize_nf4(torch.randn(32, 512, generator=gen), 64)
    for t in (1, 5, 32):
        x = torch.randn(t, 512, generator=gen)
        assert torch.equal(k.smatmul(x, pc, ps, cq.INT8X8, 512), kern.smatmul(x, pc, ps, cq.INT8X8, 512))
        assert torch.equal(k.smatmul(x, ncodes, absmax, cq.NF4, 64), kern.smatmul(x, ncodes, absmax, cq.NF4, 64))
    qtypes = (cq.Q4_K, cq.Q4_K, cq.Q6_K)
    banks = make_bank(qtypes, 6, 512, 256)
    idx, wts = routing(12, 6, 3, seed=1)
    x = torch.randn(12, 512, generator=gen)
    assert torch.equal(k.moe(x, *banks, qtypes, idx, wts), kern.moe(x, *banks, qtypes, idx, wts))


def test_every_variant_this_cpu_runs_agrees(folder: Path, kern: cq.Kernels) -> None:  # noqa: F811
    here = cpu_build.cpu_flags() or frozenset()
    runnable = [(name, needs) for name, _, needs in cpu_build.VARIANTS if needs <= here]
    assert runnable[-1][0] == "x86-64"
    w = make_weights(cq.Q4_K, 24, 512, seed=3)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(1))
    k = cq.Kernels(cc="/bin/false", prebuilt_dir=folder)  # picks this CPU's best: load the others directly
    for name, needs in runnable:
        path, why = cpu_build.prebuilt(folder, flags=needs)
        assert path == folder / f"quant_cpu-{name}.so", why
        assert k._load(path, [])
        if name == "x86-64":  # the scalar dots round their float sums in another order
            assert not k.simd
            assert torch.allclose(k.qmatmul(x, w, cq.Q4_K), kern.qmatmul(x, w, cq.Q4_K), rtol=1e-5, atol=1e-4)
        else:
            assert k.simd and torch.equal(k.qmatmul(x, w, cq.Q4_K), kern.qmatmul(x, w, cq.Q4_K)), name


def test_the_openmp_runtime_beside_the_library_is_the_one_loaded(folder: Path) -> None:
    """A machine without gcc may have no libgomp: the copy beside the library is found first ($ORIGIN)."""
    code = ("import ctypes, sys; ctypes.CDLL(sys.argv[1]); "
            "print([l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l][0])")
    done = subprocess.run([sys.executable, "-c", code, str(folder / "quant_cpu-x86-64.so")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == folder / "libgomp.so.1"


def test_prebuilt_libraries_of_another_source_are_not_loaded(folder: Path, tmp_path: Path) -> None:
    stale = tmp_path / "stale"
    stale.mkdir()
    for f in folder.iterdir():
        (stale / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((stale / cpu_build.PREBUILT_MANIFEST).read_text())
    (stale / cpu_build.PREBUILT_MANIFEST).write_text(json.dumps({**manifest, "source_sha256": "0" * 64}))
    path, why = cpu_build.prebuilt(stale)
    assert path is None and "another version of quant_cpu.c" in why
    k = cq.Kernels(cc=str(tmp_path / "no-such-cc"), out_dir=tmp_path, prebuilt_dir=stale)
    assert not k.ok and k.prebuilt is None
    assert cpu_build.prebuilt(tmp_path / "nothing")[0] is None
    broken = tmp_path / "broken"  # the right source, but a library that does not load
    broken.mkdir()
    for f in folder.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    for lib in broken.glob("quant_cpu-*.so"):
        lib.write_bytes(b"not an ELF file")
    k = cq.Kernels(cc=str(tmp_path / "no-such-cc"), out_dir=tmp_path, prebuilt_dir=broken)
    assert not k.ok and "no-such-cc" in k.reason and "cannot load" in k.reason and str(broken) in k.reason
    (stale / "quant_cpu-x86-64.so").unlink()
    manifest_ok = {**manifest, "source_sha256": cpu_build.source_hash()}
    (stale / cpu_build.PREBUILT_MANIFEST).write_text(json.dumps(manifest_ok))
    path, why = cpu_build.prebuilt(stale, scalar=True)
    assert path is None and "quant_cpu-x86-64.so is missing" in why


def test_the_doctor_says_what_the_cpu_kernels_run_on(folder: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    line = cpu_build.describe(folder)
    assert line is not None and line.startswith("prebuilt quant_cpu-") and line.endswith("(no C compiler)")
    assert cpu_build.describe(tmp_path / "empty") is None
    facts = GpuFacts(torch_version="2.13.0", cpu_kernels=None)
    warning = [f for f in check(facts) if f.key == "cpu-kernels"]
    assert len(warning) == 1 and warning[0].level == "warning" and "install gcc" in warning[0].message
    assert any("CPU kernels    none" in ln for ln in report_lines(facts, check(facts)))
    fine = GpuFacts(torch_version="2.13.0", cpu_kernels=line)
    assert not [f for f in check(fine) if f.key == "cpu-kernels"]
    assert f"CPU kernels    {line}" in report_lines(fine, [])
    monkeypatch.setenv("CC", "/bin/true")  # a compiler that exists: built from source
    assert cpu_build.describe(tmp_path / "empty").startswith("built from source by /bin/true")
