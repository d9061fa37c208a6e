"""Building the CPU kernels' C library (``csrc/quant_cpu.c``) with the system compiler: one ``.so`` per hash of
source, flags and compiler version in ``$CLOVER_DESK_KERNEL_CACHE`` (else ``~/.cache/clover-desk/kernels``), written
under a temporary name and renamed, so a concurrent builder finds either nothing or the whole library.
:class:`engine.kernels.cpu_quant.Kernels` loads what this builds; nothing here raises: a failed build is one line."""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE_FILE = Path(__file__).resolve().parent / "csrc" / "quant_cpu.c"
BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11")
# tried in order: the first that builds is used (a compiler without -march=native or OpenMP still gets a library)
FLAG_SETS = (("-march=native", "-fopenmp"), ("-fopenmp",), ())
# what the library's clover_vnni() answers -> the instruction sets its dots use
ISA_NAMES = {0: "AVX2", 1: "AVX2 + AVX-512 VNNI", 2: "AVX2 + AVX-VNNI"}


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
