"""The bounded GGUF header reader (engine.weights.gguf.header): hostile headers (a 2^62-element array, 5,000 nested
arrays, a tensor of 2^80 values) are one CheckpointError line naming the file, fast and small, through every reader
of GGUF headers (open_gguf, gguf-fix, ``clover-desk generate``); real files still read the same; a fuzzer over a
real tiny GGUF finds no other outcome than "opens" or one CloverError line."""

from __future__ import annotations

import random
import struct
import subprocess
import sys
import time
from pathlib import Path

import gguf
import pytest
from fixtures_tiny import tiny_clover_dir  # noqa: F401
from hostile_gguf import huge_array, huge_string, huge_tensor, nested_arrays

from clover_desk.engine.errors import CheckpointError, CloverError
from clover_desk.engine.weights.gguf.file import open_gguf
from clover_desk.engine.weights.gguf.fix import fix_gguf
from clover_desk.engine.weights.gguf.header import MAX_NESTING, ArrayInfo, GGUFFormatError, read_header
from clover_desk.engine.weights.gguf.writer import write_gguf

ROOT = Path(__file__).resolve().parents[2]
HOSTILE = {"huge_array": (huge_array, "elements of 'tokenizer.ggml.token_type'"),
           "nested_arrays": (nested_arrays, f"nests arrays more than {MAX_NESTING} deep"),
           "huge_tensor": (huge_tensor, "too many elements"),
           "huge_string": (huge_string, "string 1 of 'tokenizer.ggml.tokens' (9,223,372,036,854,775,808 bytes)")}


@pytest.fixture(scope="module")
def tiny_gguf(tiny_clover_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny_clover_dir, tmp_path_factory.mktemp("gguf") / "tiny-Q8_0.gguf", "Q8_0")[0]


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_header_is_one_checkpoint_error(kind: str, tmp_path: Path) -> None:
    make, says = HOSTILE[kind]
    path = make(tmp_path / f"{kind}.gguf")
    start = time.monotonic()
    with pytest.raises(CheckpointError) as err:
        open_gguf(path)
    assert time.monotonic() - start < 1.0
    message = str(err.value)
    assert message.startswith(f"{path}: ") and says in message and "\n" not in message


def test_hostile_header_sizes(tmp_path: Path) -> None:
    """The two files of the issue: 165 bytes and about 60 KB."""
    assert huge_array(tmp_path / "a.gguf").stat().st_size == 165
    assert 55_000 < nested_arrays(tmp_path / "n.gguf").stat().st_size < 65_000


def test_nesting_up_to_the_cap_is_read(tmp_path: Path) -> None:
    ok = read_header(nested_arrays(tmp_path / "ok.gguf", depth=MAX_NESTING - 1))
    assert ok.metadata["general.nested"] == [[[[[[[[]]]]]]]]
    with pytest.raises(GGUFFormatError, match="deep"):
        read_header(nested_arrays(tmp_path / "deep.gguf", depth=MAX_NESTING))


def test_real_file_reads_as_gguf_reader_does(tiny_gguf: Path) -> None:
    header = read_header(tiny_gguf)
    reader = gguf.GGUFReader(tiny_gguf)
    assert header.data_offset == reader.data_offset
    assert [(t.name, t.qtype, t.dims, t.nbytes) for t in header.tensors] == [
        (t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.n_bytes)) for t in reader.tensors]
    for name, fld in reader.fields.items():
        if not name.startswith("GGUF."):
            assert header.metadata[name] == pytest.approx(fld.contents()), name
    lean = read_header(tiny_gguf, keep_arrays=False)
    assert lean.metadata["tokenizer.ggml.tokens"] == ArrayInfo(8, len(header.metadata["tokenizer.ggml.tokens"]))


def test_header_limits(tiny_gguf: Path) -> None:
    with pytest.raises(GGUFFormatError, match="header too large"):
        read_header(tiny_gguf, max_header_bytes=2000)
    with pytest.raises(GGUFFormatError, match="not read within the time allowed"):
        read_header(tiny_gguf, deadline_s=0.0)


def test_tensor_past_the_end(tiny_gguf: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:-1])
    with pytest.raises(GGUFFormatError, match=r"ends at byte .*past the end of the file"):
        read_header(cut)


def test_gguf_fix_refuses_a_hostile_file(tmp_path: Path) -> None:
    bad = huge_array(tmp_path / "bad.gguf")
    with pytest.raises(CheckpointError, match=f"{bad}: truncated or damaged"):
        fix_gguf(bad, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


# Runs the command from a small Python (a child forked from pytest would count pytest's own pages in its peak RSS):
# address space capped at 4 GiB so that a runaway fails instead of swapping, killed after the limit; prints the
# child's exit status, CPU seconds and peak RSS (KiB) as its last line.
_MEASURE = """
import resource, subprocess, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
try:
    rc = subprocess.run(sys.argv[2:], stdout=subprocess.DEVNULL, timeout=float(sys.argv[1])).returncode
except subprocess.TimeoutExpired:
    rc = 124
u = resource.getrusage(resource.RUSAGE_CHILDREN)
print(rc, u.ru_utime + u.ru_stime, u.ru_maxrss)
"""


def _run_measured(cmd: list[str], limit_s: float = 20.0) -> tuple[int, str, float, int]:
    """``cmd``'s exit status, stderr, CPU seconds and peak RSS in bytes (see _MEASURE)."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(limit_s), *cmd], capture_output=True, text=True,
                         cwd=ROOT, timeout=limit_s + 30)
    rc, cpu_s, peak_kib = out.stdout.split()
    return int(rc), out.stderr, float(cpu_s), int(peak_kib) * 1024


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_cli_hostile_gguf_is_one_line_fast_and_small(kind: str, tmp_path: Path) -> None:
    make, says = HOSTILE[kind]
    bad = make(tmp_path / f"{kind}.gguf")
    rc, err, cpu_s, peak = _run_measured([sys.executable, "-m", "clover_desk.cli.main", "generate", "--model",
                                          str(bad), "--prompt", "hi"])
    lines = err.strip().splitlines()
    assert rc == 2, err[-2000:]
    assert len(lines) == 1 and str(bad) in lines[0] and says in lines[0]
    assert cpu_s < 1.0, f"{cpu_s:.2f} s of CPU"
    assert peak < 200 << 20, f"peak RSS {peak / 2**20:.0f} MiB"


# ---- fuzzing: mutations and truncations of a real tiny file ---------------------------------------------------

_BIG = (0xFFFFFFFFFFFFFFFF, 1 << 62, 1 << 32, 0x7FFFFFFF, 2**31 + 1, 9, 12, 13, 4, 0)


def _mutate(data: bytes, rng: random.Random, header_end: int) -> bytes:
    buf = bytearray(data)
    kind = rng.randrange(4)
    at = rng.randrange(4, header_end)
    if kind == 0:  # truncate
        return bytes(buf[:rng.randrange(0, len(buf))])
    if kind == 1:  # a few random bytes
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(4, header_end)] = rng.randrange(256)
    elif kind == 2:  # a hostile 64-bit count or length
        buf[at:at + 8] = struct.pack("<Q", rng.choice(_BIG))
    else:  # a hostile 32-bit type or dimension count
        buf[at:at + 4] = struct.pack("<I", rng.choice(_BIG) & 0xFFFFFFFF)
    return bytes(buf[:len(data)])


def _fuzz(tiny_gguf: Path, tmp_path: Path, cases: int, seed: int) -> None:
    data = tiny_gguf.read_bytes()
    header_end = read_header(tiny_gguf).header_bytes
    rng = random.Random(seed)
    path = tmp_path / "fuzz.gguf"
    outcomes = {"opened": 0, "refused": 0}
    for case in range(cases):
        path.write_bytes(_mutate(data, rng, header_end))
        start = time.monotonic()
        try:
            open_gguf(path)
            outcomes["opened"] += 1
        except CloverError as exc:
            assert "\n" not in str(exc) and str(path) in str(exc), (case, str(exc))
            outcomes["refused"] += 1
        assert time.monotonic() - start < 2.0, f"case {case} took {time.monotonic() - start:.1f} s"
    assert outcomes["refused"] > cases // 4, outcomes


def test_fuzz_quick(tiny_gguf: Path, tmp_path: Path) -> None:
    _fuzz(tiny_gguf, tmp_path, 40, seed=1)


@pytest.mark.slow
def test_fuzz_many(tiny_gguf: Path, tmp_path: Path) -> None:
    _fuzz(tiny_gguf, tmp_path, 400, seed=2)
