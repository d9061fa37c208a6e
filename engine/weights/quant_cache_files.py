"""The quantized cache's files: their names and manifest version, the safetensors header reader, positional reads
and writes, digests, the source checkpoint's fingerprint, where a cache lives and whether it is current.

The format and the rules are described in :mod:`engine.weights.quant_cache`; the converter that writes a cache is
:mod:`engine.weights.quant_cache_build`.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from clover_desk.engine.decode.events import LoadProgress
from clover_desk.engine.errors import CancelledError, CheckpointError
from clover_desk.engine.weights.checkpoint import (
    TORCH_DTYPES,
    check_finite,
    read_safetensors_header_raw,
)
from clover_desk.engine.weights.formats import SAFETENSORS_DTYPES, checkpoint_files
from clover_desk.engine.weights.quant import (
    DEFAULT_POLICY,
    QuantPolicy,
)

CACHE_DIRNAME = ".clover-cache"
MANIFEST_NAME = "manifest.json"
DATA_NAME = "weights.safetensors"
VERSION = 2  # 2: per-tensor crc32 of the data, checked as each tensor is read
# what the conversion checked in the source, as listed in the manifest's "checks": "finite" (no NaN or infinity in
# any weight, engine.weights.checkpoint.check_finite). Caches of format 2 written before that check existed have no
# "checks": they are rebuilt once, so that damaged weights converted then are refused, naming the source tensor.
CHECKS = ("finite",)
_CHECK_WORDS = {"finite": "NaN and infinite values"}
CHUNK_BYTES = 32 << 20  # source bytes read per chunk of a big tensor

# safetensors tag -> (torch dtype, element size, manifest format): the dtypes the quantizer reads and writes, from
# the one dtype table (engine.weights.formats)
DTYPES = {
    tag: (TORCH_DTYPES[tag], SAFETENSORS_DTYPES[tag][1], SAFETENSORS_DTYPES[tag][0])
    for tag in ("F32", "BF16", "F16", "U8", "I8", "I64")
}
TAG_OF_DTYPE = {v[0]: k for k, v in DTYPES.items()}

Progress = Callable[[LoadProgress], None]


# ---------------------------------------------------------------------------------------------------------------
# safetensors headers and raw reads
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SrcTensor:
    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the data
    nbytes: int


def read_header(path: Path) -> tuple[dict[str, SrcTensor], str, int]:
    """(tensors, sha256 of the header bytes, data start) of a safetensors file; CheckpointError if malformed."""
    entries, raw = read_safetensors_header_raw(path)  # the one validating parser (engine.weights.checkpoint)
    for e in entries.values():
        if e.dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {e.name!r} has dtype {e.dtype!r}, which the quantizer does not read")
    out = {name: SrcTensor(name, path, e.dtype, e.shape, e.offset, e.nbytes) for name, e in entries.items()}
    return out, hashlib.sha256(raw).hexdigest(), 8 + len(raw)


# Positional reads and writes. os.preadv / os.pwrite are POSIX-only (Windows has neither): without them a seek
# followed by a read or write does the same, under one lock so two threads never interleave a seek with another's
# read on the same descriptor. The choice is made at each call (tests take the POSIX calls away to run the fallback).
_SEEK_LOCK = threading.Lock()
O_BINARY = getattr(os, "O_BINARY", 0)  # Windows opens descriptors in text mode (newline translation) without it


def _read_at(fd: int, view: memoryview, offset: int) -> int:
    """Read into ``view`` from byte ``offset`` of ``fd``: the number of bytes read (0 at the end of the file)."""
    preadv = getattr(os, "preadv", None)
    if preadv is not None:
        return preadv(fd, [view], offset)
    with _SEEK_LOCK, io.FileIO(fd, "rb", closefd=False) as f:
        f.seek(offset)
        return f.readinto(view) or 0


def _write_at(fd: int, view: memoryview, offset: int) -> int:
    """Write (part of) ``view`` at byte ``offset`` of ``fd``: the number of bytes written."""
    pwrite = getattr(os, "pwrite", None)
    if pwrite is not None:
        return pwrite(fd, view, offset)
    with _SEEK_LOCK:
        os.lseek(fd, offset, os.SEEK_SET)
        return os.write(fd, view)


def pread_all(fd: int, offset: int, nbytes: int, what: str) -> bytearray:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        n = _read_at(fd, view[got:], offset + got)
        if n <= 0:
            raise CheckpointError(f"{what}: unexpected end of file at byte {offset + got}")
        got += n
    return buf


def read_rows(fd: int, src: SrcTensor, r0: int, r1: int) -> Tensor:
    """Rows r0..r1 of the tensor's first dim (a CPU tensor in its stored dtype)."""
    dtype, esize, _ = DTYPES[src.dtype]
    row_numel = math.prod(src.shape[1:]) if len(src.shape) > 1 else 1
    row_bytes = row_numel * esize
    buf = pread_all(fd, src.begin + r0 * row_bytes, (r1 - r0) * row_bytes, f"{src.path}: tensor {src.name!r}")
    t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
    t = t.reshape((r1 - r0, *src.shape[1:]) if len(src.shape) > 1 else (r1 - r0,))
    check_finite(t, src.path, src.name, r0)  # every source chunk passes here once, as it is converted
    return t


def read_into(fd: int, src: SrcTensor, dst: Tensor) -> None:
    """Read a whole tensor's bytes into ``dst`` (contiguous CPU tensor of the same dtype and size)."""
    view = memoryview(dst.reshape(-1).view(torch.uint8).numpy())
    got = 0
    while got < src.nbytes:
        n = _read_at(fd, view[got:], src.begin + got)
        if n <= 0:
            raise CheckpointError(f"{src.path}: unexpected end of file in tensor {src.name!r}")
        got += n


def write_tensor(fd: int, offset: int, t: Tensor) -> None:
    write_all(fd, t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), offset)


def write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    done = 0
    while done < len(data):
        done += _write_at(fd, view[done:], offset + done)


# ---------------------------------------------------------------------------------------------------------------
# Source fingerprint and cache location
# ---------------------------------------------------------------------------------------------------------------


def source_files(model_dir: Path) -> list[Path]:
    return checkpoint_files(model_dir)[0]


def source_fingerprint(model_dir: str | Path) -> dict[str, Any]:
    """Sizes, mtimes and header hashes of the checkpoint's files, and the config hash (no data is read)."""
    model_dir = Path(model_dir).resolve()
    files: dict[str, Any] = {}
    for path in source_files(model_dir):
        st = path.stat()
        _, header_sha, _ = read_header(path)
        files[path.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "header_sha256": header_sha}
    config_path = model_dir / "config.json"
    config_sha = hashlib.sha256(config_path.read_bytes()).hexdigest() if config_path.exists() else ""
    return {"model_dir": str(model_dir), "config_sha256": config_sha, "files": files}


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK | os.X_OK)


def cache_dir_for(
    model_dir: str | Path, policy: QuantPolicy = DEFAULT_POLICY, cache_root: str | Path | None = None
) -> Path:
    """Where the cache of ``model_dir`` under ``policy`` lives (see the module docstring)."""
    model_dir = Path(model_dir).resolve()
    if cache_root is not None:
        return Path(cache_root) / policy.hash
    if _writable(model_dir):
        return model_dir / CACHE_DIRNAME / policy.hash
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clover-desk" / "quant"
    return base / hashlib.sha256(str(model_dir).encode()).hexdigest()[:16] / policy.hash


# ---------------------------------------------------------------------------------------------------------------
# Cache check
# ---------------------------------------------------------------------------------------------------------------


def _file_sha256(path: Path, cancel: threading.Event | None = None) -> str:
    return file_digests(path, {}, cancel)[0]


def file_digests(
    path: Path, spans: dict[str, tuple[int, int]], cancel: threading.Event | None = None
) -> tuple[str, dict[str, int]]:
    """(sha256 of the whole file, crc32 of each tensor's bytes) in one read. ``spans``: key -> (offset, nbytes)."""
    h = hashlib.sha256()
    crcs = {key: 0 for key in spans}
    ends = sorted(((off, off + n, key) for key, (off, n) in spans.items()))
    pos, i = 0, 0
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            if cancel is not None and cancel.is_set():
                raise CancelledError(f"hashing {path} was cancelled")
            h.update(chunk)
            lo, hi = pos, pos + len(chunk)
            while i < len(ends) and ends[i][1] <= lo:
                i += 1
            j = i
            while j < len(ends) and ends[j][0] < hi:  # tensors overlapping this chunk (they do not overlap each other)
                a, b, key = ends[j]
                crcs[key] = zlib.crc32(memoryview(chunk)[max(a, lo) - lo : min(b, hi) - lo], crcs[key])
                j += 1
            pos = hi
    return h.hexdigest(), crcs


def check_cache(
    cache_dir: str | Path, model_dir: str | Path, policy: QuantPolicy = DEFAULT_POLICY, verify: str = "header"
) -> str | None:
    """None if the cache is complete and current, else why not (one line). ``verify``: "header" (sizes and
    header hash, fast) or "full" (also the sha256 of the whole weights file)."""
    cache_dir = Path(cache_dir)
    manifest_path = cache_dir / MANIFEST_NAME
    if not cache_dir.exists():
        return "missing: no cache yet"
    if not manifest_path.exists():
        return f"incomplete: {cache_dir} has no {MANIFEST_NAME} (an interrupted conversion)"
    try:
        m = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"corrupt: {manifest_path} is unreadable ({exc})"
    if not isinstance(m, dict) or m.get("version") != VERSION or not m.get("complete"):
        return f"corrupt: {manifest_path} is not a complete version-{VERSION} manifest"
    checks = m.get("checks")
    missing = [c for c in CHECKS if not isinstance(checks, list) or c not in checks]
    if missing:
        return (f"unchecked: {manifest_path} was written before the conversion checked the weights for "
                f"{', '.join(_CHECK_WORDS[c] for c in missing)}")
    if m.get("policy", {}).get("hash") != policy.hash:
        return f"other policy: cache built with policy {m.get('policy', {}).get('name')!r}, want {policy.name!r}"
    src = m.get("source", {})
    try:
        now = source_fingerprint(model_dir)
    except CheckpointError as exc:
        return f"stale: the checkpoint cannot be read ({exc})"
    if src.get("config_sha256") != now["config_sha256"] or set(src.get("files", {})) != set(now["files"]):
        return f"other checkpoint: cache was built from {src.get('model_dir')!r} with different config/files"
    for name, info in now["files"].items():
        old = src["files"][name]
        for key in ("size", "header_sha256", "mtime_ns"):
            if old.get(key) != info[key]:
                return f"stale: source file {name} changed ({key} {old.get(key)} -> {info[key]})"
    data = cache_dir / DATA_NAME
    want = m.get("files", {}).get(DATA_NAME, {})
    if not data.exists():
        return f"corrupt: {data} is missing"
    size = data.stat().st_size
    if size != want.get("size"):
        return f"corrupt: {data} is {size} bytes, the manifest says {want.get('size')} (truncated?)"
    try:
        _, header_sha, _ = read_header(data)
    except CheckpointError as exc:
        return f"corrupt: {exc}"
    if header_sha != want.get("header_sha256"):
        return f"corrupt: {data} header hash mismatch"
    if verify == "full" and _file_sha256(data) != want.get("sha256"):
        return f"corrupt: {data} content hash mismatch"
    return None


class ProgressTracker:
    def __init__(self, total: int, callback: Progress | None, cancel: threading.Event | None, stage: str) -> None:
        self.total, self.callback, self.cancel, self.stage = total, callback, cancel, stage
        self.done = 0
        self.t0 = time.monotonic()

    def check(self, what: str) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise CancelledError(f"{what} was cancelled")

    def advance(self, nbytes: int, current: str) -> None:
        self.done += nbytes
        if self.callback is None:
            return
        elapsed = time.monotonic() - self.t0
        eta = elapsed * (self.total - self.done) / self.done if self.done and elapsed > 0 else None
        self.callback(
            LoadProgress(stage=self.stage, done_bytes=self.done, total_bytes=self.total, current=current, eta_s=eta)
        )


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable. POSIX only: Windows cannot open a folder as a file (NTFS journals the
    rename itself)."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def expert_bank_of(name: str) -> tuple[str, str] | None:
    """'layers.3.mlp.experts.gate_up_proj' -> ('layers.3.mlp.experts', 'gate_up_proj')."""
    bank, _, leaf = name.rpartition(".")
    if bank.endswith("mlp.experts") and leaf in ("gate_up_proj", "down_proj"):
        return bank, leaf
    return None
