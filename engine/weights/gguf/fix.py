"""Rewrite an official (fork-layout) Clover GGUF into the layout upstream llama.cpp loads, streaming, never holding
the file in memory:

1. add the key ``{arch}.expert_shared_count`` (= 1, the one shared expert) that upstream refuses to load without;
2. drop the 120 diffusion-only tensors (``ssm_bd_history.weight/.bias``, ``ssm_bd_logit_scale.weight``,
   ``ssm_conv1d.weight_right``), which upstream does not know;
3. rewrite every ``blk.N.ssm_a`` from raw ``A_log`` to ``-exp(A_log)`` (same ggml type, computed in fp32);

every other key and tensor is copied byte for byte (the key/value records are re-emitted from their raw bytes, the
tensor data copied in chunks from the memory map). A split set is fixed part by part into a split set of the same
shape (``split.tensors.count`` updated). Each output is written under a hidden temporary name in its folder,
flushed to disk (fsync) and renamed into place, so an interrupted run never leaves a half-written OUT where a good
file was. Torch-free (numpy and the ``gguf`` package).
"""

from __future__ import annotations

import logging
import os
import secrets
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clover_desk.engine.errors import ConfigError
from clover_desk.engine.weights.gguf.file import ARCHITECTURES, DIFFUSION_SUFFIXES, SPLIT_RE, _reader, split_parts

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20
_GGUF_STRING, _GGUF_UINT32 = 8, 4
_TYPE_OF = {0: np.float32, 1: np.float16}  # ssm_a types rewritten in place (BF16 handled apart)


@dataclass(frozen=True)
class FixReport:
    """What :func:`fix_gguf` did."""

    outputs: tuple[Path, ...]
    dropped_tensors: int
    rewritten_ssm_a: int
    added_key: str | None
    bytes_written: int
    seconds: float


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _field_bytes(field: Any) -> bytes:
    return b"".join(np.ascontiguousarray(part).tobytes() for part in field.parts)


def _output_names(parts: list[Path], out: Path) -> list[Path]:
    if len(parts) == 1:
        return [out]
    m = SPLIT_RE.match(out.name)
    if m and int(m.group("count")) == len(parts):
        base = out.with_name(m.group("base"))
    else:
        base = out.with_name(out.name.removesuffix(".gguf"))
    return [base.with_name(f"{base.name}-{k:05d}-of-{len(parts):05d}.gguf") for k in range(1, len(parts) + 1)]


def _neg_exp(data: np.ndarray, qtype: int, name: str, path: Path) -> bytes:
    """-exp(A_log) in the tensor's own type."""
    if qtype in _TYPE_OF:
        values = np.asarray(data).view(_TYPE_OF[qtype]).astype(np.float32)
        return (-np.exp(values)).astype(_TYPE_OF[qtype]).tobytes()
    if qtype == 30:  # BF16: widen, compute, round to nearest even
        values = (np.asarray(data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        bits = (-np.exp(values)).astype(np.float32).view(np.uint32)
        rounded = ((bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return rounded.tobytes()
    raise ConfigError(f"{path}: tensor {name!r} has ggml type {qtype}; ssm_a must be F32, F16 or BF16 to rewrite")


def _copy_range(source: Any, dest: Any, offset: int, nbytes: int, chunk_bytes: int, path: Path) -> None:
    """Copy ``nbytes`` from ``offset`` of ``source`` to ``dest``: in the kernel where it can, else through one buffer
    of ``chunk_bytes``. Bounded memory either way: the data never passes through the reader's memory map, whose
    pages would count against the process."""
    left = nbytes
    if hasattr(os, "copy_file_range"):  # Linux: the kernel copies, nothing passes through this process
        dest.flush()
        try:
            while left:
                n = os.copy_file_range(source.fileno(), dest.fileno(), left, offset + nbytes - left)
                if not n:
                    raise ConfigError(f"{path}: truncated GGUF file (tensor data ends before byte {offset + nbytes:,})")
                left -= n
            dest.seek(0, os.SEEK_END)
            return
        except OSError as exc:  # a file system that cannot (EXDEV, ENOSYS, EINVAL): the buffered copy below
            log.debug("copy_file_range failed (%s), copying through a buffer", exc)
            dest.seek(0, os.SEEK_END)
    view = memoryview(bytearray(min(chunk_bytes, left)))
    source.seek(offset + nbytes - left)
    while left:
        n = source.readinto(view[: min(left, len(view))])
        if not n:
            raise ConfigError(f"{path}: truncated GGUF file (tensor data ends before byte {offset + nbytes:,})")
        dest.write(view[:n])
        left -= n


def fix_gguf(
    src: str | Path,
    out: str | Path,
    progress: Callable[[int, int], None] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> FixReport:
    """Write the upstream-loadable copy of ``src`` (a fork-layout file, or any part of a split set) to ``out``.

    ``progress(done, total)`` gets the data bytes copied so far. A file that is not a fork-layout Clover GGUF (no
    diffusion tensors: already upstream's layout) is a ConfigError naming it, as is any damaged input."""
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    parts = split_parts(src)
    outputs = _output_names(parts, out)
    for o in outputs:
        if o.exists() and any(o.resolve() == p.resolve() for p in parts):
            raise ConfigError(f"{o}: the output would overwrite the input; choose another OUT")
    readers = [_reader(p) for p in parts]
    head = readers[0].fields
    arch_field = head.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{parts[0]}: general.architecture is {arch!r}, not a Clover GGUF ({', '.join(ARCHITECTURES)})")
    dropped = sum(t.name.endswith(DIFFUSION_SUFFIXES) for r in readers for t in r.tensors)
    if dropped == 0:
        raise ConfigError(f"{parts[0]}: has no diffusion tensors, so it is already in upstream llama.cpp's layout "
                          f"(ssm_a would be rewritten twice): nothing to fix")
    shared_key = f"{arch}.expert_shared_count"
    add_key = shared_key if shared_key not in head else None
    kept_total = sum(1 for r in readers for t in r.tensors if not t.name.endswith(DIFFUSION_SUFFIXES))
    total = sum(int(t.n_bytes) for r in readers for t in r.tensors if not t.name.endswith(DIFFUSION_SUFFIXES))
    done = written = rewritten = 0
    temps: list[Path] = []
    try:
        for i, (part, reader, dst) in enumerate(zip(parts, readers, outputs)):
            tmp = dst.with_name(f".{dst.name}.{os.getpid()}.{secrets.token_hex(4)}.partial")
            temps.append(tmp)
            align = int(reader.alignment)
            kept = [t for t in reader.tensors if not t.name.endswith(DIFFUSION_SUFFIXES)]
            kv: list[bytes] = []
            for name, field in reader.fields.items():
                if name.startswith("GGUF."):
                    continue
                if name == "split.tensors.count":
                    vtype = int(field.types[0])
                    fmt = {4: "<I", 5: "<i", 10: "<Q", 11: "<q", 2: "<H", 3: "<h"}.get(vtype)
                    if fmt is None:
                        raise ConfigError(f"{part}: split.tensors.count has an unexpected type {vtype}")
                    kv.append(_string(name) + struct.pack("<I", vtype) + struct.pack(fmt, kept_total))
                    continue
                kv.append(_field_bytes(field))
            if add_key and i == 0:
                kv.append(_string(add_key) + struct.pack("<I", _GGUF_UINT32) + struct.pack("<I", 1))
            infos, offset = [], 0
            for t in kept:
                offset = -(-offset // align) * align
                dims = [int(d) for d in t.shape]
                infos.append(_string(t.name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
                             + struct.pack("<I", int(t.tensor_type)) + struct.pack("<Q", offset))
                offset += int(t.n_bytes)
            version = int(reader.fields["GGUF.version"].parts[0][0])
            header = b"GGUF" + struct.pack("<I", version) + struct.pack("<QQ", len(kept), len(kv))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            with os.fdopen(fd, "wb") as f, part.open("rb") as source:
                f.write(header)
                for record in kv + infos:
                    f.write(record)
                f.write(b"\0" * (-f.tell() % align))
                data_start = f.tell()
                for t in kept:
                    f.write(b"\0" * (-(f.tell() - data_start) % align))
                    if t.name.endswith(".ssm_a"):
                        f.write(_neg_exp(np.asarray(t.data), int(t.tensor_type), t.name, part))
                        rewritten += 1
                    else:
                        _copy_range(source, f, int(t.data_offset), int(t.n_bytes), chunk_bytes, part)
                    done += int(t.n_bytes)
                    if progress is not None:
                        progress(done, total)
                f.flush()
                os.fsync(f.fileno())
                written += f.tell()
        for tmp, dst in zip(temps, outputs):
            os.replace(tmp, dst)
    except BaseException:  # includes KeyboardInterrupt: never leave a partial file behind
        for tmp in temps:
            tmp.unlink(missing_ok=True)
        raise
    seconds = time.perf_counter() - t0
    log.info("fixed %s -> %s: %d tensors dropped, %d ssm_a rewritten, %s", src, outputs[0], dropped, rewritten,
             f"key {add_key} added" if add_key else "key present")
    return FixReport(tuple(outputs), dropped, rewritten, add_key, written, seconds)
