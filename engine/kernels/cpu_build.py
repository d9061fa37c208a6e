"""Building the CPU kernels' C library (``csrc/quant_cpu.c``) with the system compiler: one ``.so`` per hash of
source, flags and compiler version in ``$CLOVER_DESK_KERNEL_CACHE`` (else ``~/.cache/clover-desk/kernels``), written
under a temporary name and renamed, so a concurrent builder finds either nothing or the whole library.
:class:`engine.kernels.cpu_quant.Kernels` loads what this builds; nothing here raises: a failed build is one line.

Machines without a C compiler (most desktops) take a **prebuilt** library instead, as llama.cpp's CPU backend ships
one per instruction-set level and loads the best the CPU runs: :func:`prebuild` compiles :data:`VARIANTS` (AVX-512
VNNI, AVX-VNNI, AVX2, baseline x86-64) into a folder with the OpenMP runtime they link (found beside them through
their ``$ORIGIN`` run path) and the hash of the source they came from; :func:`prebuilt` picks the first variant whose
CPU flags ``/proc/cpuinfo`` lists, only where that hash is the current source's. The Linux bundle carries them
(``packaging/build.sh``); a checkout or a pip install builds from source.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE_FILE = Path(__file__).resolve().parent / "csrc" / "quant_cpu.c"
PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"  # where the bundle puts them (absent in a checkout)
PREBUILT_MANIFEST = "manifest.json"
BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11")
# tried in order: the first that builds is used (a compiler without -march=native or OpenMP still gets a library)
FLAG_SETS = (("-march=native", "-fopenmp"), ("-fopenmp",), ())
# what the library's clover_vnni() answers -> the instruction sets its dots use
ISA_NAMES = {0: "AVX2", 1: "AVX2 + AVX-512 VNNI", 2: "AVX2 + AVX-VNNI"}

# the prebuilt libraries, best first: name, compiler flags, the /proc/cpuinfo flags a CPU needs to run it
# (x86-64-v3: AVX2, FMA, F16C, BMI1/2, LZCNT ("abm"), MOVBE; x86-64-v4 adds AVX-512 F/BW/CD/DQ/VL)
_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
VARIANTS: tuple[tuple[str, tuple[str, ...], frozenset[str]], ...] = (
    ("avx512vnni", ("-march=x86-64-v4", "-mavx512vnni"), _V4 | {"avx512_vnni"}),
    ("avxvnni", ("-march=x86-64-v3", "-mavxvnni"), _V3 | {"avx_vnni"}),
    ("avx2", ("-march=x86-64-v3",), _V3),
    ("x86-64", ("-march=x86-64",), frozenset()),  # the scalar dots
)
SCALAR_VARIANT = "x86-64"
VNNI_VARIANTS = ("avx512vnni", "avxvnni")
# generic tuning, OpenMP, and the folder itself searched first for the OpenMP runtime copied beside them
PREBUILT_FLAGS = ("-mtune=generic", "-fopenmp", "-Wl,-rpath,$ORIGIN")


def cache_dir() -> Path:
    env = os.environ.get("CLOVER_DESK_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "clover-desk" / "kernels"


def compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return cc
    return shutil.which("gcc") or shutil.which("cc")


def compiler_version(cc: str) -> str:
    try:
        done = subprocess.run([*shlex.split(cc), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    return done.stdout.strip() or f"unknown (exit {done.returncode})"


def build(cc: str, flags: tuple[str, ...], out_dir: Path, source: Path = SOURCE_FILE) -> tuple[Path | None, str]:
    """Compile ``source`` with ``flags`` unless a cached library exists -> (path, "") or (None, one-line reason)."""
    try:
        src = source.read_bytes()
    except OSError as exc:
        return None, f"kernel source missing: {exc}"
    key = hashlib.sha256(src + "\0".join((cc, *flags)).encode() + compiler_version(cc).encode()).hexdigest()[:20]
    target = out_dir / f"quant_cpu-{key}.so"
    if target.exists():
        return target, ""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".quant_cpu-", suffix=".so", dir=out_dir)
        os.close(fd)
    except OSError as exc:
        return None, f"cannot write the kernel cache {out_dir}: {exc}"
    cmd = [*shlex.split(cc), *flags, str(source), "-o", tmp, "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        os.unlink(tmp)
        return None, f"{cc} failed to run: {exc}"
    if done.returncode != 0:
        os.unlink(tmp)
        lines = done.stderr.strip().splitlines()
        first = next((ln for ln in lines if "error" in ln), lines[0] if lines else f"exit status {done.returncode}")
        return None, f"{cc} {' '.join(flags)} failed: {first.strip()}"
    os.replace(tmp, target)  # atomic: a concurrent builder finds either nothing or the whole library
    return target, ""


# -- prebuilt libraries ------------------------------------------------------------------------------------------


def source_hash(source: Path = SOURCE_FILE) -> str:
    return hashlib.sha256(source.read_bytes()).hexdigest()


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags as Linux lists them, or None where there is no /proc/cpuinfo to read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        return None
    return frozenset()


def pick_variant(flags: frozenset[str], *, scalar: bool = False, vnni: bool = True) -> str:
    """The best of :data:`VARIANTS` a CPU with ``flags`` runs (``scalar``: the scalar one; ``vnni`` False: none of
    the VNNI ones)."""
    for name, _, needs in VARIANTS:
        if scalar and name != SCALAR_VARIANT or not vnni and name in VNNI_VARIANTS:
            continue
        if needs <= flags:
            return name
    return SCALAR_VARIANT


def prebuild(out_dir: Path, cc: str | None = None, source: Path = SOURCE_FILE) -> list[Path]:
    """Compile :data:`VARIANTS` into ``out_dir`` as ``quant_cpu-<name>.so``, copy the compiler's
    OpenMP runtime beside them and write the manifest (the source's hash, the variants). Raises RuntimeError with
    the compiler's first error line where one fails (a bundle must not ship without them)."""
    cc = cc or compiler()
    if not cc:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    out_dir.mkdir(parents=True, exist_ok=True)
    built = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags, _ in VARIANTS:
            path, why = build(cc, (*BASE_FLAGS, *flags, *PREBUILT_FLAGS), Path(tmp), source)
            if path is None:
                raise RuntimeError(f"prebuilt variant {name}: {why}")
            target = out_dir / f"quant_cpu-{name}.so"
            shutil.copyfile(path, target)
            built.append(target)
    gomp = subprocess.run([*shlex.split(cc), "-print-file-name=libgomp.so.1"], capture_output=True, text=True,
                          timeout=60).stdout.strip()
    if not gomp or not Path(gomp).is_file():
        raise RuntimeError(f"{cc} does not say where its OpenMP runtime libgomp.so.1 is")
    shutil.copyfile(Path(gomp).resolve(), out_dir / "libgomp.so.1")
    version = compiler_version(cc)
    manifest = {"source_sha256": source_hash(source), "variants": [p.name for p in built],
                "compiler": version.splitlines()[0] if version else cc}
    (out_dir / PREBUILT_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return built


def prebuilt(folder: Path = PREBUILT_DIR, source: Path = SOURCE_FILE, *, scalar: bool = False, vnni: bool = True,
             flags: frozenset[str] | None = None) -> tuple[Path | None, str]:
    """The prebuilt library this CPU should load -> (path, "") or (None, one line saying why there is none)."""
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"no prebuilt kernels for {sys.platform} {platform.machine()}"
    try:
        manifest = json.loads((folder / PREBUILT_MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, f"no prebuilt kernels in {folder}"
    try:
        current = source_hash(source)
    except OSError as exc:
        return None, f"kernel source missing: {exc}"
    if manifest.get("source_sha256") != current:
        return None, f"the prebuilt kernels in {folder} come from another version of {source.name}"
    flags = cpu_flags() if flags is None else flags
    name = pick_variant(flags or frozenset(), scalar=scalar, vnni=vnni)
    path = folder / f"quant_cpu-{name}.so"
    return (path, "") if path.is_file() else (None, f"{path} is missing")


def describe(folder: Path = PREBUILT_DIR) -> str | None:
    """What the CPU kernels will run on, found without building: None where there is neither a C compiler nor a
    prebuilt library for this CPU (the engine then dequantizes every forward on the CPU, ~30x slower)."""
    cc = compiler()
    if cc and shutil.which(shlex.split(cc)[0]):
        return f"built from source by {cc} on first use, cached in {cache_dir()}"
    path, _ = prebuilt(folder)
    if path is None:
        return None
    try:  # what Kernels will do: the library and the OpenMP runtime beside it load (no build, instant)
        ctypes.CDLL(str(path))
    except OSError:
        return None
    return f"prebuilt {path.name} (no C compiler)"
