"""Quantized weight cache: convert a Hugging Face checkpoint once, load the quantized model fast afterwards.

Where: ``<model_dir>/.clover-cache/<policy hash>/`` (beside the model, so deleting the model deletes its cache);
when the model folder is not writable, ``$XDG_CACHE_HOME/clover-desk/quant/<hash of the model path>/<policy hash>/``
(default ``~/.cache/...``). ``cache_root`` overrides both.

What: ``weights.safetensors`` (a real safetensors file) + ``manifest.json``::

    {"version": 2,
     "policy": {...QuantPolicy.to_dict(), "hash": ...},
     "source": {"model_dir", "config_sha256", "files": {name: {"size", "mtime_ns", "header_sha256"}}},
     "tensors": {model name: {"shape", "format": "nf4"|"int8"|"bf16"|"fp32"|"fp16", "bytes", "stored": [keys]}},
     "experts": {bank name: ExpertLayout dict},
     "files": {"weights.safetensors": {"size", "header_sha256", "sha256", "crc32": {key: crc}}},
     "complete": true,
     "checks": ["finite"]}

Stored keys are the quantized model's state-dict names: a quantized linear ``X.weight`` is ``X.codes`` +
``X.scales`` (the :class:`QuantLinear` buffers); an expert bank
``layers.N.mlp.experts`` is ``layers.N.mlp.experts.packed`` uint8 [E, R] (one contiguous row per expert, exactly the
host-store layout of ``engine/placement/expert_store.py``); anything else keeps its name.

Conversion streams: tensor by tensor, and big tensors in row chunks (experts one at a time), read with ``pread``
(no mmap, so resident memory stays at one chunk) and written with ``pwrite`` at precomputed offsets (where the OS has
no ``os.preadv`` / ``os.pwrite``, as on Windows, a seek and a read or write under a lock; same bytes). Progress is
reported as :class:`LoadProgress` (bytes, tensor, ETA); a set ``cancel`` event raises :class:`CancelledError`.
Atomicity: everything is written into a temporary sibling folder, fsync'd, then renamed into place; a killed
conversion leaves only a ``.tmp-*`` folder, never a cache that looks complete (leftovers are removed next time).

On load the cache is checked: missing, incomplete, another policy, another checkpoint, stale (a source file's
size / mtime / header changed), corrupt (size or hash mismatch) or unchecked (written before the conversion refused
NaN / infinite weights: no ``"checks"`` in its manifest) -> the reason is logged, returned, and the cache is rebuilt;
it is never used silently.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import shutil
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from clover_desk.engine.decode.events import LoadProgress
from clover_desk.engine.errors import CancelledError, CheckpointError
from clover_desk.engine.model.clover import CloverModel
from clover_desk.engine.model.config import CloverConfig, load_config
from clover_desk.engine.placement import placer
from clover_desk.engine.weights import checkpoint
from clover_desk.engine.weights.checkpoint import (
    TORCH_DTYPES,
    Target,
    check_checkpoint,
    check_finite,
    read_safetensors_header_raw,
    sanitize_name,
    sanitize_shape,
    sanitize_tensor,
)
from clover_desk.engine.weights.formats import SAFETENSORS_DTYPES, TAG_OF_FORMAT, checkpoint_files
from clover_desk.engine.weights.quant import (
    DEFAULT_POLICY,
    QUANT_FORMATS,
    ExpertLayout,
    QuantExpertBank,
    QuantLinear,
    QuantPolicy,
    quantize_tensor,
    quantized_sizes,
    set_submodule,
)

log = logging.getLogger(__name__)

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
_ST = {
    tag: (TORCH_DTYPES[tag], SAFETENSORS_DTYPES[tag][1], SAFETENSORS_DTYPES[tag][0])
    for tag in ("F32", "BF16", "F16", "U8", "I8", "I64")
}
_TAG_OF = {v[0]: k for k, v in _ST.items()}

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
        if e.dtype not in _ST:
            raise CheckpointError(f"{path}: tensor {e.name!r} has dtype {e.dtype!r}, which the quantizer does not read")
    out = {name: SrcTensor(name, path, e.dtype, e.shape, e.offset, e.nbytes) for name, e in entries.items()}
    return out, hashlib.sha256(raw).hexdigest(), 8 + len(raw)


# Positional reads and writes. os.preadv / os.pwrite are POSIX-only (Windows has neither): without them a seek
# followed by a read or write does the same, under one lock so two threads never interleave a seek with another's
# read on the same descriptor. The choice is made at each call (tests take the POSIX calls away to run the fallback).
_SEEK_LOCK = threading.Lock()
_O_BINARY = getattr(os, "O_BINARY", 0)  # Windows opens descriptors in text mode (newline translation) without it


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


def _pread(fd: int, offset: int, nbytes: int, what: str) -> bytearray:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        n = _read_at(fd, view[got:], offset + got)
        if n <= 0:
            raise CheckpointError(f"{what}: unexpected end of file at byte {offset + got}")
        got += n
    return buf


def _read_rows(fd: int, src: SrcTensor, r0: int, r1: int) -> Tensor:
    """Rows r0..r1 of the tensor's first dim (a CPU tensor in its stored dtype)."""
    dtype, esize, _ = _ST[src.dtype]
    row_numel = math.prod(src.shape[1:]) if len(src.shape) > 1 else 1
    row_bytes = row_numel * esize
    buf = _pread(fd, src.begin + r0 * row_bytes, (r1 - r0) * row_bytes, f"{src.path}: tensor {src.name!r}")
    t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
    t = t.reshape((r1 - r0, *src.shape[1:]) if len(src.shape) > 1 else (r1 - r0,))
    check_finite(t, src.path, src.name, r0)  # every source chunk passes here once, as it is converted
    return t


def _read_into(fd: int, src: SrcTensor, dst: Tensor) -> None:
    """Read a whole tensor's bytes into ``dst`` (contiguous CPU tensor of the same dtype and size)."""
    view = memoryview(dst.reshape(-1).view(torch.uint8).numpy())
    got = 0
    while got < src.nbytes:
        n = _read_at(fd, view[got:], src.begin + got)
        if n <= 0:
            raise CheckpointError(f"{src.path}: unexpected end of file in tensor {src.name!r}")
        got += n


def _pwrite(fd: int, offset: int, t: Tensor) -> None:
    _write_all(fd, t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), offset)


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    done = 0
    while done < len(data):
        done += _write_at(fd, view[done:], offset + done)


# ---------------------------------------------------------------------------------------------------------------
# Source fingerprint and cache location
# ---------------------------------------------------------------------------------------------------------------


def _source_files(model_dir: Path) -> list[Path]:
    return checkpoint_files(model_dir)[0]


def source_fingerprint(model_dir: str | Path) -> dict[str, Any]:
    """Sizes, mtimes and header hashes of the checkpoint's files, and the config hash (no data is read)."""
    model_dir = Path(model_dir).resolve()
    files: dict[str, Any] = {}
    for path in _source_files(model_dir):
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
    return _file_digests(path, {}, cancel)[0]


def _file_digests(
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


# ---------------------------------------------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _Out:
    """One output tensor of the cache file."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int = 0  # absolute file offset, set once the header is laid out

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class _Progress:
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


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable. POSIX only: Windows cannot open a folder as a file (NTFS journals the
    rename itself)."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _expert_bank_of(name: str) -> tuple[str, str] | None:
    """'layers.3.mlp.experts.gate_up_proj' -> ('layers.3.mlp.experts', 'gate_up_proj')."""
    bank, _, leaf = name.rpartition(".")
    if bank.endswith("mlp.experts") and leaf in ("gate_up_proj", "down_proj"):
        return bank, leaf
    return None


def _rows_per_chunk(src: SrcTensor, align: int) -> int:
    row_bytes = max(1, src.nbytes // max(src.shape[0], 1))
    rows = max(1, CHUNK_BYTES // row_bytes)
    return max(align, rows // align * align)


def build_cache(
    model_dir: str | Path,
    policy: QuantPolicy = DEFAULT_POLICY,
    cache_dir: str | Path | None = None,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
) -> Path:
    """Quantize ``model_dir`` under ``policy`` into ``cache_dir`` (default :func:`cache_dir_for`); returns it."""
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    check_checkpoint(model_dir, config)  # config.json's sizes against the headers, before any output is sized
    final = Path(cache_dir) if cache_dir is not None else cache_dir_for(model_dir, policy)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(final)
    fingerprint = source_fingerprint(model_dir)
    sources: list[SrcTensor] = []
    for path in _source_files(model_dir.resolve()):
        sources.extend(sorted(read_header(path)[0].values(), key=lambda s: s.begin))

    # ---- plan every output tensor from the headers alone ----
    bs = policy.blocksize
    outs: dict[str, _Out] = {}
    tensors: dict[str, dict[str, Any]] = {}
    layouts: dict[str, ExpertLayout] = {}
    jobs: list[tuple[SrcTensor, Target]] = []
    e_cfg, d_cfg, i_cfg = config.num_experts, config.hidden_size, config.moe_intermediate_size
    for src in sources:
        target = sanitize_name(src.name, config)
        if target is None:
            continue
        jobs.append((src, target))
        bank = _expert_bank_of(target.name)
        if bank is not None:
            bank_name = bank[0]
            if bank_name in layouts or bank_name + "#plain" in tensors:
                continue
            fmt = policy.format_of(f"{bank_name}.gate_up_proj", (e_cfg, 2 * i_cfg, d_cfg))
            if fmt in QUANT_FORMATS:
                lay = ExpertLayout.build(e_cfg, d_cfg, i_cfg, fmt, bs)
                layouts[bank_name] = lay
                outs[f"{bank_name}.packed"] = _Out(f"{bank_name}.packed", torch.uint8, (e_cfg, lay.nbytes))
                gu = lay.gate_up_codes[1] + lay.gate_up_scales[1]
                tensors[f"{bank_name}.gate_up_proj"] = {
                    "shape": [e_cfg, 2 * i_cfg, d_cfg],
                    "format": fmt,
                    "bytes": e_cfg * gu,
                    "stored": [f"{bank_name}.packed"],
                }
                tensors[f"{bank_name}.down_proj"] = {
                    "shape": [e_cfg, d_cfg, i_cfg],
                    "format": fmt,
                    "bytes": e_cfg * (lay.nbytes - gu),
                    "stored": [f"{bank_name}.packed"],
                }
            else:
                dt = _plain_dtype(fmt, _ST[src.dtype][0])
                for leaf, shp in (("gate_up_proj", (e_cfg, 2 * i_cfg, d_cfg)), ("down_proj", (e_cfg, d_cfg, i_cfg))):
                    key = f"{bank_name}.{leaf}"
                    outs[key] = _Out(key, dt, shp)
                    tensors[key] = {
                        "shape": list(shp),
                        "format": _fmt_name(dt),
                        "bytes": outs[key].nbytes,
                        "stored": [key],
                    }
                tensors[bank_name + "#plain"] = {}
            continue
        if target.index is not None:
            raise CheckpointError(
                f"{src.path}: tensor {src.name!r} maps to a slice of {target.name}, which is not an expert tensor"
            )
        shape = sanitize_shape(target, src.shape)
        fmt = policy.format_of(target.name, shape)
        if fmt in QUANT_FORMATS and len(shape) == 2:
            n_codes, n_scales = quantized_sizes(shape, fmt, bs)
            mod = target.name[: -len(".weight")] if target.name.endswith(".weight") else target.name
            codes = _Out(
                f"{mod}.codes", torch.uint8 if fmt == "nf4" else torch.int8, (n_codes,) if fmt == "nf4" else shape
            )
            scales = _Out(f"{mod}.scales", torch.float32, (n_scales // 4,))
            outs[codes.key], outs[scales.key] = codes, scales
            tensors[target.name] = {
                "shape": list(shape),
                "format": fmt,
                "bytes": n_codes + n_scales,
                "stored": [codes.key, scales.key],
            }
        else:
            dt = _plain_dtype(fmt, _ST[src.dtype][0])
            out = _Out(target.name, dt, shape)
            outs[out.key] = out
            tensors[target.name] = {
                "shape": list(shape),
                "format": _fmt_name(dt),
                "bytes": out.nbytes,
                "stored": [out.key],
            }
    tensors = {k: v for k, v in tensors.items() if not k.endswith("#plain")}
    if not outs:
        raise CheckpointError(f"{model_dir}: the checkpoint holds no text-model tensors")

    # ---- lay out the file: header, then data in plan order ----
    header: dict[str, Any] = {"__metadata__": {"format": "clover-quant", "policy": policy.hash}}
    pos = 0
    for out in outs.values():
        header[out.key] = {
            "dtype": _TAG_OF[out.dtype],
            "shape": list(out.shape),
            "data_offsets": [pos, pos + out.nbytes],
        }
        out.offset = pos
        pos += out.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    data_start = 8 + len(raw)
    for out in outs.values():
        out.offset += data_start

    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    tracker = _Progress(sum(s.nbytes for s, _ in jobs), progress, cancel, "quantizing")
    try:
        data_path = tmp / DATA_NAME
        fd = os.open(data_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | _O_BINARY, 0o644)
        try:
            _write_all(fd, struct.pack("<Q", len(raw)) + raw, 0)
            os.ftruncate(fd, data_start + pos)
            pending: dict[tuple[str, int], dict[str, Tensor]] = {}
            by_path: dict[Path, int] = {}
            try:
                for src, target in jobs:
                    tracker.check(f"quantizing {model_dir}")
                    sfd = by_path.get(src.path)
                    if sfd is None:
                        for old in by_path.values():  # one source file open at a time
                            os.close(old)
                        by_path = {src.path: os.open(src.path, os.O_RDONLY | _O_BINARY)}
                        sfd = by_path[src.path]
                    _convert_one(sfd, fd, src, target, policy, outs, layouts, pending, tracker, config)
                    tracker.advance(src.nbytes, src.name)
            finally:
                for old in by_path.values():
                    os.close(old)
            if pending:
                (bank, e), parts = next(iter(pending.items()))
                raise CheckpointError(f"{model_dir}: expert {e} of {bank} is incomplete (has only {sorted(parts)})")
            os.fsync(fd)
        finally:
            os.close(fd)
        if progress is not None:
            progress(
                LoadProgress(
                    stage="writing-cache", done_bytes=tracker.done, total_bytes=tracker.total, current=DATA_NAME
                )
            )
        _, header_sha, _ = read_header(data_path)
        spans = {out.key: (out.offset, out.nbytes) for out in outs.values()}
        sha, crcs = _file_digests(data_path, spans, cancel)
        manifest = {
            "version": VERSION,
            "policy": {**policy.to_dict(), "hash": policy.hash},
            "source": fingerprint,
            "tensors": tensors,
            "experts": {k: v.to_dict() for k, v in layouts.items()},
            "files": {
                DATA_NAME: {
                    "size": data_path.stat().st_size,
                    "header_sha256": header_sha,
                    "sha256": sha,
                    "crc32": crcs,  # per stored tensor: checked as it is read, so damaged data never loads silently
                }
            },
            "complete": True,
            "checks": list(CHECKS),  # what this conversion checked in every source tensor
            "created_unix": int(time.time()),
        }
        mpath = tmp / MANIFEST_NAME
        with mpath.open("w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():
            trash = final.parent / f".tmp-old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("quantized cache written: %s (%.1f MiB)", final, (final / DATA_NAME).stat().st_size / 2**20)
    return final


def _plain_dtype(fmt: str, stored: torch.dtype) -> torch.dtype:
    """The dtype a plain tensor is stored in under the policy format ``fmt`` ("keep": as it came)."""
    return TORCH_DTYPES[TAG_OF_FORMAT[fmt]] if fmt in ("bf16", "fp32", "fp16") else stored


def _fmt_name(dtype: torch.dtype) -> str:
    return _ST[_TAG_OF[dtype]][2]


def _convert_one(
    sfd: int,
    fd: int,
    src: SrcTensor,
    target: Target,
    policy: QuantPolicy,
    outs: dict[str, _Out],
    layouts: dict[str, ExpertLayout],
    pending: dict[tuple[str, int], dict[str, Tensor]],
    tracker: _Progress,
    config: CloverConfig,
) -> None:
    """Read one source tensor in chunks and write its quantized / cast form at its place in the cache file."""
    bs = policy.blocksize
    bank = _expert_bank_of(target.name)
    if bank is not None:
        bank_name, leaf = bank
        lay = layouts.get(bank_name)
        if target.index is None:  # fused [E, ...]: one expert at a time
            for e in range(src.shape[0]):
                tracker.check(f"quantizing {src.name}")
                w = _read_rows(sfd, src, e, e + 1)[0]  # [2I, D] or [D, I]
                _write_expert_part(fd, outs, bank_name, leaf, lay, e, w, pending, None)
        else:
            e = int(target.index[0])
            part = None
            if len(target.index) > 1:
                part = "gate" if target.index[1].start == 0 else "up"
            w = _read_rows(sfd, src, 0, src.shape[0])  # one expert's matrix
            _write_expert_part(fd, outs, bank_name, leaf, lay, e, w, pending, part, config.moe_intermediate_size)
        return
    stored = outs.get(target.name)
    shape = sanitize_shape(target, src.shape)
    if stored is not None:  # plain tensor: cast chunk by chunk
        rows = _rows_per_chunk(src, 1)
        row_out = stored.nbytes // max(src.shape[0], 1) if src.shape else stored.nbytes
        if not src.shape:
            _pwrite(fd, stored.offset, sanitize_tensor(target, _read_rows(sfd, src, 0, 1).reshape(())).to(stored.dtype))
            return
        for r0 in range(0, src.shape[0], rows):
            tracker.check(f"quantizing {src.name}")
            r1 = min(src.shape[0], r0 + rows)
            chunk = _read_rows(sfd, src, r0, r1).to(stored.dtype)
            _pwrite(fd, stored.offset + r0 * row_out, chunk)
        return
    mod = target.name[: -len(".weight")] if target.name.endswith(".weight") else target.name
    codes, scales = outs[f"{mod}.codes"], outs[f"{mod}.scales"]
    fmt = "nf4" if codes.dtype == torch.uint8 else "int8"
    cols = shape[1]
    align = bs // math.gcd(cols, bs) if fmt == "nf4" else 1  # chunk numel must be a whole number of NF4 blocks
    rows = _rows_per_chunk(src, align)
    for r0 in range(0, shape[0], rows):
        tracker.check(f"quantizing {src.name}")
        r1 = min(shape[0], r0 + rows)
        w = _read_rows(sfd, src, r0, r1).reshape(r1 - r0, cols)
        c, s = quantize_tensor(w, fmt, bs)
        if fmt == "nf4":
            _pwrite(fd, codes.offset + r0 * cols // 2, c)
            _pwrite(fd, scales.offset + (r0 * cols // bs) * 4, s)
        else:
            _pwrite(fd, codes.offset + r0 * cols, c)
            _pwrite(fd, scales.offset + r0 * 4, s)


def _write_expert_part(
    fd: int,
    outs: dict[str, _Out],
    bank_name: str,
    leaf: str,
    lay: ExpertLayout | None,
    e: int,
    w: Tensor,
    pending: dict[tuple[str, int], dict[str, Tensor]],
    part: str | None,
    inter: int | None = None,
) -> None:
    if part is not None:  # per-expert checkpoint: gate and up arrive separately; quantize them together
        parts = pending.setdefault((bank_name, e), {})
        parts[part] = w
        if len(parts) < 2:
            return
        del pending[(bank_name, e)]
        w = torch.cat([parts["gate"], parts["up"]], dim=0)  # [2I, D]
    if lay is None:  # experts kept unquantized: fused plain tensors
        out = outs[f"{bank_name}.{leaf}"]
        per = out.nbytes // out.shape[0]
        _pwrite(fd, out.offset + e * per, w.to(out.dtype))
        return
    out = outs[f"{bank_name}.packed"]
    base = out.offset + e * lay.nbytes
    c_seg, s_seg, shape = (
        (lay.gate_up_codes, lay.gate_up_scales, lay.gate_up_shape)
        if leaf == "gate_up_proj"
        else (lay.down_codes, lay.down_scales, lay.down_shape)
    )
    if tuple(w.shape) != shape:
        raise CheckpointError(f"expert {e} of {bank_name}.{leaf} has shape {list(w.shape)}, expected {list(shape)}")
    c, s = quantize_tensor(w, lay.fmt, lay.blocksize)
    _pwrite(fd, base + c_seg[0], c)
    _pwrite(fd, base + s_seg[0], s)


def _remove_leftovers(final: Path) -> None:
    """Remove temporary folders of killed conversions of this cache (their pid is gone)."""
    for p in final.parent.glob(f".tmp-{final.name}-*"):
        parts = p.name.split("-")
        pid = int(parts[-2]) if len(parts) >= 2 and parts[-2].isdigit() else None
        if pid is not None and pid != os.getpid() and _pid_alive(pid):
            continue
        log.info("removing a leftover of an interrupted conversion: %s", p)
        shutil.rmtree(p, ignore_errors=True)
    for p in final.parent.glob(f".tmp-old-{final.name}-*"):
        shutil.rmtree(p, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    # psutil, not os.kill(pid, 0): on Windows signal 0 is CTRL_C_EVENT, which would interrupt that process
    import psutil

    return bool(psutil.pid_exists(pid))


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheReport:
    """What ``load_quantized`` did: the cache used, whether it was (re)built, and why."""

    path: Path
    rebuilt: bool
    reason: str  # "" when an existing cache was valid and used
    manifest_path: Path


def ensure_cache(
    model_dir: str | Path,
    policy: QuantPolicy = DEFAULT_POLICY,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    cache_root: str | Path | None = None,
    verify: str = "header",
) -> CacheReport:
    """The checked cache of ``model_dir`` under ``policy``, built (or rebuilt, with the reason logged and returned)
    when needed. Conversion streams tensor by tensor; nothing is loaded."""
    model_dir = Path(model_dir)
    cdir = cache_dir_for(model_dir, policy, cache_root)
    reason = check_cache(cdir, model_dir, policy, verify)
    rebuilt = False
    if reason is not None:
        if not reason.startswith("missing"):
            log.warning("quantized cache %s not used: %s; rebuilding", cdir, reason)
        build_cache(model_dir, policy, cdir, progress, cancel)
        rebuilt = True
    return CacheReport(cdir, rebuilt, reason or "", cdir / MANIFEST_NAME)


def load_quantized(
    model_dir: str | Path,
    policy: QuantPolicy = DEFAULT_POLICY,
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    cache_root: str | Path | None = None,
    verify: str = "header",
) -> tuple[nn.Module, CacheReport]:
    """The quantized model of ``model_dir`` whole on the CPU, through the cache (see :func:`ensure_cache`).

    Internal, as :func:`load_from_cache` is: engines are built by ``engine.api.Engine.load(precision="nf4")``
    (docs/loading.md), which places every tensor directly with :func:`load_from_cache`; this is for the tests of
    this layer and the benchmarks that compare the cache with another format."""
    report = ensure_cache(model_dir, policy, progress, cancel, cache_root, verify)
    model = load_from_cache(report.path, model_dir, dtype, progress, cancel)
    return model, report


class CacheDamaged(CheckpointError):
    """A cached tensor's bytes no longer match the checksum written with them."""


class CacheSource:
    """The cache's ``weights.safetensors`` as a placement source (``engine.placement.placer.TensorSource``): each tensor is
    read once, straight into the tensor placement allocated for it (in bounded chunks when it lives on a GPU or
    needs a dtype cast), with progress and cancel between chunks."""

    def __init__(
        self, data: Path, progress: Progress | None, cancel: threading.Event | None, crcs: dict[str, int] | None = None
    ) -> None:
        self.path = data
        self.crcs = crcs or {}
        self.header, _, _ = read_header(data)
        self.tracker = _Progress(sum(h.nbytes for h in self.header.values()), progress, cancel, "reading")
        self.filled: set[str] = set()
        self.fd = os.open(data, os.O_RDONLY | _O_BINARY)

    def close(self) -> None:
        os.close(self.fd)

    def _entry(self, name: str) -> SrcTensor:
        src = self.header.get(name)
        if src is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the cache")
        return src

    def dtype_of(self, name: str) -> torch.dtype:
        return _ST[self._entry(name).dtype][0]

    def fill(self, name: str, dst: Tensor) -> None:
        src = self._entry(name)
        if tuple(dst.shape) != tuple(src.shape):
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has shape {list(src.shape)}, the model expects {list(dst.shape)}"
            )
        self.tracker.check(f"loading {self.path.parent}")
        dtype, esize, _ = _ST[src.dtype]
        if dst.device.type == "cpu" and dst.dtype == dtype and dst.is_contiguous():
            _read_into(self.fd, src, dst)  # straight into its place: no second copy
            crc = zlib.crc32(memoryview(dst.reshape(-1).view(torch.uint8).numpy())) if name in self.crcs else None
        else:
            crc = 0
            flat = dst.view(-1)
            per = max(1, CHUNK_BYTES // esize)
            numel = src.nbytes // esize
            for a in range(0, numel, per):
                self.tracker.check(f"loading {self.path.parent}")
                b = min(numel, a + per)
                buf = _pread(self.fd, src.begin + a * esize, (b - a) * esize, f"{self.path}: tensor {name!r}")
                crc = zlib.crc32(buf, crc)
                flat[a:b].copy_(torch.frombuffer(buf, dtype=dtype))
        if name in self.crcs and crc != self.crcs[name]:
            raise CacheDamaged(f"{self.path}: tensor {name!r} changed since the cache was written (crc32 mismatch)")
        self.filled.add(name)
        self.tracker.advance(src.nbytes, name)

    def check_complete(self) -> None:
        unused = [k for k in self.header if k not in self.filled]
        if unused:
            raise CheckpointError(f"{self.path}: tensor {unused[0]!r} has no place in the model ({len(unused)} unused)")


def load_from_cache(
    cache_dir: str | Path,
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    plan: Any = None,
    device: torch.device | str = "cpu",
    rebuild_on_damage: bool = True,
    **place_options: Any,
) -> nn.Module:
    """Internal: what ``engine.api.Engine.load(precision="nf4")`` reads the cache with (docs/loading.md).

    Build a CloverModel from a (checked) cache: a skeleton with the quantized modules swapped in, then every
    tensor read once from the file straight into where ``plan`` puts it (``engine.placement.placer.place_model``; with no
    plan, everything on ``device``). Peak memory is the placed model plus one read chunk.

    Every tensor's bytes are checked against the crc32 written with the cache as they are read (~4 GB/s); a
    mismatch (a damaged file of the right size and header) is logged, the cache is rebuilt from the checkpoint and
    the model is read again, once."""

    cache_dir = Path(cache_dir)
    manifest = json.loads((cache_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
    config = load_config(model_dir)
    tensors: dict[str, dict[str, Any]] = manifest["tensors"]
    extras = config.is_diffusion or any(".bd_history." in n or n.endswith("weight_right") for n in tensors)
    model = CloverModel(config, dtype=dtype, device="meta", clover_extras=extras)
    _adapt_extras(model, tensors)
    # swap quantized modules in (empty, on the meta device: placement allocates them where the plan says)
    for name, meta in tensors.items():
        if meta["format"] not in QUANT_FORMATS:
            continue
        bank = _expert_bank_of(name)
        if bank is not None:
            if bank[1] == "gate_up_proj":
                lay = ExpertLayout.from_dict(manifest["experts"][bank[0]])
                set_submodule(model, bank[0], QuantExpertBank(lay, device="meta"))
            continue
        mod_name = name[: -len(".weight")]
        old = model.get_submodule(mod_name)
        if not isinstance(old, nn.Linear):
            raise CheckpointError(
                f"{cache_dir}: {name} is quantized but {mod_name} is a {type(old).__name__}, not a Linear"
            )
        policy_bs = int(manifest["policy"]["blocksize"])
        new = QuantLinear(
            old.in_features, old.out_features, meta["format"], policy_bs, bias=old.bias is not None, device="meta"
        )
        set_submodule(model, mod_name, new)
    if plan is None:  # everything on `device`, the embedding too
        plan = placer.SimplePlan(tuple(placer.expert_banks(model)), (), 0)
        place_options.setdefault("host_embedding", False)
    crcs = manifest.get("files", {}).get(DATA_NAME, {}).get("crc32")
    source = CacheSource(cache_dir / DATA_NAME, progress, cancel, crcs)
    try:
        placer.place_model(model, plan, device, source, **place_options)
        source.check_complete()
    except CacheDamaged as exc:
        if not rebuild_on_damage:
            raise
        log.warning("%s; rebuilding the quantized cache %s", exc, cache_dir)
        policy = QuantPolicy.from_dict({k: v for k, v in manifest["policy"].items() if k != "hash"})
        build_cache(model_dir, policy, cache_dir, progress, cancel)
        return load_from_cache(
            cache_dir, model_dir, dtype, progress, cancel, plan, device, rebuild_on_damage=False, **place_options
        )
    finally:
        source.close()
    if progress is not None:
        total = source.tracker.total
        progress(LoadProgress(stage="done", done_bytes=total, total_bytes=total))
    model.eval()
    return model


def _adapt_extras(model: nn.Module, tensors: dict[str, dict[str, Any]]) -> None:
    """Give the Clover GDN extras the cached shapes, and drop the ones the cache does not have."""

    params = dict(model.named_parameters())
    for name in list(params):
        if not checkpoint._is_extra(name):
            continue
        meta = tensors.get(name)
        if meta is None:
            checkpoint._drop_extra(model, name)
        elif tuple(meta["shape"]) != tuple(params[name].shape):
            entry = checkpoint.TensorEntry(name, Path(MANIFEST_NAME), "BF16", tuple(meta["shape"]), int(meta["bytes"]))
            checkpoint._adapt_extra(model, name, tuple(meta["shape"]), entry)
