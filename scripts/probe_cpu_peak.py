"""The CPU's multiply throughput per core, the ceiling of the int8 kernels in ``engine/kernels/csrc/quant_cpu.c``.

    PYTHONPATH=. python scripts/probe_cpu_peak.py

Compiles a small C probe with the system compiler (``-O2 -march=native``) into a temporary folder and times, on one
thread in thread CPU time (so other processes on a shared machine do not count), ten independent chains of each of:
``vpmaddubsw`` (u8 x s8 pairs -> int16), ``vpmaddwd`` (int16 pairs -> int32), the two mixed (what every int8 dot here
does per 32 multiply-adds), ``vfmadd231ps`` (8 fp32 lanes) and, where the CPU has VNNI, ``vpdpbusd`` (32
multiply-adds in one). Prints the rates and the int8 / fp32 multiply-add
ceilings they imply, per core; docs/STATUS.md (the pass section) uses them for issue 30's arithmetic.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("probe_cpu_peak")

PROBE_C = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define DECL(T, f) T a0 = f(1), a1 = f(2), a2 = f(3), a3 = f(4), a4 = f(5), a5 = f(6), a6 = f(7), a7 = f(8), a8 = f(9), a9 = f(10);
#define STEP(op) a0 = op(a0, b); a1 = op(a1, b); a2 = op(a2, b); a3 = op(a3, b); a4 = op(a4, b); \
    a5 = op(a5, b); a6 = op(a6, b); a7 = op(a7, b); a8 = op(a8, b); a9 = op(a9, b); \
    __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7), "+x"(a8), "+x"(a9));
#define MIX(x, y) _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), y)
#define FMA(x, y) _mm256_fmadd_ps(x, y, y)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(x, y) _mm256_dpbusd_epi32(x, y, y)
#elif defined(__AVXVNNI__)
#define DPBUSD(x, y) _mm256_dpbusd_avx_epi32(x, y, y)
#endif
#define RUN(name, T, f, op, per) { T b = f(3); DECL(T, f) double t0 = now(); \
    for (long n = 0; n < N; n++) { STEP(op) } double t = now() - t0; printf("%s %.3f\n", name, per * 10.0 * N / t / 1e9); }
int main(void) {
    const long N = 50000000;
    RUN("maddubs", __m256i, _mm256_set1_epi8, _mm256_maddubs_epi16, 1.0)
    RUN("madd", __m256i, _mm256_set1_epi16, _mm256_madd_epi16, 1.0)
    RUN("maddubs+madd", __m256i, _mm256_set1_epi16, MIX, 1.0)
    RUN("fma", __m256, _mm256_set1_ps, FMA, 1.0)
#ifdef DPBUSD
    RUN("vpdpbusd", __m256i, _mm256_set1_epi8, DPBUSD, 1.0)
#endif
    return 0;
}
"""


def probe() -> dict[str, float]:
    """Rates in G instructions (or instruction pairs) per second on one core."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler found (gcc or cc)")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "probe.c", Path(tmp) / "probe"
        src.write_text(PROBE_C)
        subprocess.run([cc, "-O2", "-march=native", str(src), "-o", str(exe)], check=True, capture_output=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {name: float(v) for name, v in (line.split() for line in out.splitlines())}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        rates = probe()
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        log.error("probe_cpu_peak: %s", exc)
        return 2
    for name, v in rates.items():
        log.info("%-13s %6.2f G/s per core", name, v)
    log.info("int8 dot (one maddubs + one madd per 32 multiply-adds): %.0f G MAC/s per core",
             rates["maddubs+madd"] * 32)
    log.info("fp32 FMA (8 lanes): %.0f G MAC/s per core", rates["fma"] * 8)
    if "vpdpbusd" in rates:  # VNNI (AVX-512's 256-bit form or AVX-VNNI): one instruction per 32 multiply-adds
        log.info("int8 dot with VNNI (one vpdpbusd per 32 multiply-adds): %.0f G MAC/s per core",
                 rates["vpdpbusd"] * 32)
    return 0


if __name__ == "__main__":
    sys.exit(main())
