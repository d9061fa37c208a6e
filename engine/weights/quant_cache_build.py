"""Converting a Hugging Face checkpoint into the quantized cache (:mod:`engine.weights.quant_cache`).

Conversion streams: tensor by tensor, and big tensors in row chunks (experts one at a time), read with ``pread``
(no mmap, so resident memory stays at one chunk) and written with ``pwrite`` at precomputed offsets (where the OS has
no ``os.preadv`` / ``os.pwrite``, as on Windows, a seek and a read or write under a lock, same bytes:
:mod:`engine.weights.quant_cache_files`). Progress is reported as :class:`LoadProgress` (bytes, tensor, ETA); a set
``cancel`` event raises :class:`CancelledError`. Atomicity: everything is written into a temporary sibling folder,
fsync'd, then renamed into place; a killed conversion leaves only a ``.tmp-*`` folder, never a cache that looks
complete (leftovers are removed next time).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from clover_desk.engine.decode.events import LoadProgress
from clover_desk.engine.errors import CheckpointError
from clover_desk.engine.model.config import CloverConfig, load_config
from clover_desk.engine.weights.checkpoint import (
    TORCH_DTYPES,
    Target,
    check_checkpoint,
    sanitize_name,
    sanitize_shape,
    sanitize_tensor,
)
from clover_desk.engine.weights.formats import TAG_OF_FORMAT
from clover_desk.engine.weights.quant import (
    DEFAULT_POLICY,
    QUANT_FORMATS,
    ExpertLayout,
    QuantPolicy,
    quantize_tensor,
    quantized_sizes,
)
from clover_desk.engine.weights.quant_cache_files import (
    CHECKS,
    CHUNK_BYTES,
    DATA_NAME,
    DTYPES,
    MANIFEST_NAME,
    O_BINARY,
    TAG_OF_DTYPE,
    VERSION,
    Progress,
    ProgressTracker,
    SrcTensor,
    cache_dir_for,
    expert_bank_of,
    file_digests,
    fsync_dir,
    read_header,
    read_rows,
    source_files,
    source_fingerprint,
    write_all,
    write_tensor,
)

log = logging.getLogger(__name__)


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
    for path in source_files(model_dir.resolve()):
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
        bank = expert_bank_of(target.name)
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
                dt = _plain_dtype(fmt, DTYPES[src.dtype][0])
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
            codes = _Out(f"{mod}.codes", *_codes_type(fmt, shape, n_codes))
            scales = _Out(f"{mod}.scales", torch.float32, (n_scales // 4,))
            outs[codes.key], outs[scales.key] = codes, scales
            tensors[target.name] = {
                "shape": list(shape),
                "format": fmt,
                "bytes": n_codes + n_scales,
                "stored": [codes.key, scales.key],
            }
        else:
            dt = _plain_dtype(fmt, DTYPES[src.dtype][0])
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
            "dtype": TAG_OF_DTYPE[out.dtype],
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
    tracker = ProgressTracker(sum(s.nbytes for s, _ in jobs), progress, cancel, "quantizing")
    try:
        data_path = tmp / DATA_NAME
        fd = os.open(data_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | O_BINARY, 0o644)
        try:
            write_all(fd, struct.pack("<Q", len(raw)) + raw, 0)
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
                        by_path = {src.path: os.open(src.path, os.O_RDONLY | O_BINARY)}
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
        sha, crcs = file_digests(data_path, spans, cancel)
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
        fsync_dir(tmp)
        if final.exists():
            trash = final.parent / f".tmp-old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("quantized cache written: %s (%.1f MiB)", final, (final / DATA_NAME).stat().st_size / 2**20)
    return final


def _codes_type(fmt: str, shape: tuple[int, ...], n_codes: int) -> tuple[torch.dtype, tuple[int, ...]]:
    """(dtype, shape) of a quantized matrix's stored codes, as :class:`QuantLinear` holds them: NF4 flat uint8
    (two per byte), INT8 int8 [O, N], Q6_K uint8 blocks [O, row bytes]."""
    if fmt == "nf4":
        return torch.uint8, (n_codes,)
    if fmt == "q6_k":
        return torch.uint8, (shape[0], n_codes // shape[0])
    return torch.int8, shape


def _plain_dtype(fmt: str, stored: torch.dtype) -> torch.dtype:
    """The dtype a plain tensor is stored in under the policy format ``fmt`` ("keep": as it came)."""
    return TORCH_DTYPES[TAG_OF_FORMAT[fmt]] if fmt in ("bf16", "fp32", "fp16") else stored


def _fmt_name(dtype: torch.dtype) -> str:
    return DTYPES[TAG_OF_DTYPE[dtype]][2]


def _convert_one(
    sfd: int,
    fd: int,
    src: SrcTensor,
    target: Target,
    policy: QuantPolicy,
    outs: dict[str, _Out],
    layouts: dict[str, ExpertLayout],
    pending: dict[tuple[str, int], dict[str, Tensor]],
    tracker: ProgressTracker,
    config: CloverConfig,
) -> None:
    """Read one source tensor in chunks and write its quantized / cast form at its place in the cache file."""
    bs = policy.blocksize
    bank = expert_bank_of(target.name)
    if bank is not None:
        bank_name, leaf = bank
        lay = layouts.get(bank_name)
        if target.index is None:  # fused [E, ...]: one expert at a time
            for e in range(src.shape[0]):
                tracker.check(f"quantizing {src.name}")
                w = read_rows(sfd, src, e, e + 1)[0]  # [2I, D] or [D, I]
                _write_expert_part(fd, outs, bank_name, leaf, lay, e, w, pending, None)
        else:
            e = int(target.index[0])
            part = None
            if len(target.index) > 1:
                part = "gate" if target.index[1].start == 0 else "up"
            w = read_rows(sfd, src, 0, src.shape[0])  # one expert's matrix
            _write_expert_part(fd, outs, bank_name, leaf, lay, e, w, pending, part, config.moe_intermediate_size)
        return
    stored = outs.get(target.name)
    shape = sanitize_shape(target, src.shape)
    if stored is not None:  # plain tensor: cast chunk by chunk
        rows = _rows_per_chunk(src, 1)
        row_out = stored.nbytes // max(src.shape[0], 1) if src.shape else stored.nbytes
        if not src.shape:
            write_tensor(fd, stored.offset, sanitize_tensor(target, read_rows(sfd, src, 0, 1).reshape(())).to(stored.dtype))
            return
        for r0 in range(0, src.shape[0], rows):
            tracker.check(f"quantizing {src.name}")
            r1 = min(src.shape[0], r0 + rows)
            chunk = read_rows(sfd, src, r0, r1).to(stored.dtype)
            write_tensor(fd, stored.offset + r0 * row_out, chunk)
        return
    mod = target.name[: -len(".weight")] if target.name.endswith(".weight") else target.name
    codes, scales = outs[f"{mod}.codes"], outs[f"{mod}.scales"]
    fmt = policy.format_of(target.name, shape)
    cols = shape[1]
    align = bs // math.gcd(cols, bs) if fmt == "nf4" else 1  # chunk numel must be a whole number of NF4 blocks
    rows = _rows_per_chunk(src, align)
    for r0 in range(0, shape[0], rows):
        tracker.check(f"quantizing {src.name}")
        r1 = min(shape[0], r0 + rows)
        w = read_rows(sfd, src, r0, r1).reshape(r1 - r0, cols)
        c, s = quantize_tensor(w, fmt, bs)
        if fmt == "nf4":
            write_tensor(fd, codes.offset + r0 * cols // 2, c)
            write_tensor(fd, scales.offset + (r0 * cols // bs) * 4, s)
        elif fmt == "q6_k":  # whole rows of blocks; no separate scales
            write_tensor(fd, codes.offset + r0 * codes.shape[1], c)
        else:
            write_tensor(fd, codes.offset + r0 * cols, c)
            write_tensor(fd, scales.offset + r0 * 4, s)


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
        write_tensor(fd, out.offset + e * per, w.to(out.dtype))
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
    write_tensor(fd, base + c_seg[0], c)
    write_tensor(fd, base + s_seg[0], s)


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
