"""Writing safetensors checkpoints too big to hold in memory (full-width random models): the header from the
tensor specs alone, the data chunk by chunk from a fill function, Hugging Face shards and index.

The in-memory writer and the reader are in :mod:`engine.weights.checkpoint`.
"""


from __future__ import annotations

import json
import logging
import math
import os
import queue
import re
import secrets
import struct
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from clover_desk.engine.errors import CheckpointError
from clover_desk.engine.weights.checkpoint import TORCH_DTYPES
from clover_desk.engine.weights.formats import INDEX_NAME, SINGLE_NAME

log = logging.getLogger(__name__)


SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_TAG_OF_DTYPE: dict[torch.dtype, str] = {dtype: tag for tag, dtype in TORCH_DTYPES.items()}


class TensorSpec(NamedTuple):
    """One tensor of a file written by :func:`write_safetensors_streaming`: full checkpoint name, shape, dtype.

    The header is computed from specs alone, so the data can be produced (and forgotten) chunk by chunk."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


# fill(spec) -> the tensor's data as chunks, in row-major order, each of dtype spec.dtype (any shape, any count).
# The writer may still be writing a chunk while the next one is produced (that overlap is what makes streaming as
# fast as the slower of the two), so a fill must not modify a chunk once yielded: give a fresh tensor each time.
FillFn = Callable[[TensorSpec], Iterable[Tensor]]


def safetensors_header(specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte little-endian length plus the JSON header of a safetensors file holding ``specs`` in order.

    safetensors demands data offsets that tile the data area without gaps (in order here) and a header whose
    length keeps the data 8-byte aligned, so the JSON is padded with spaces to a multiple of 8."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for spec in specs:
        tag = _TAG_OF_DTYPE.get(spec.dtype)
        if tag is None:
            raise ValueError(f"tensor {spec.name!r}: dtype {spec.dtype} has no safetensors tag")
        if spec.name in header or spec.name == "__metadata__":
            raise ValueError(f"tensor name {spec.name!r} appears twice (or is reserved)")
        if any(int(n) < 0 for n in spec.shape):
            raise ValueError(f"tensor {spec.name!r}: negative dimension in shape {list(spec.shape)}")
        header[spec.name] = {"dtype": tag, "shape": [int(n) for n in spec.shape], "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _chunk_bytes(chunk: Tensor) -> Any:
    """A zero-copy byte view (numpy uint8) of a CPU tensor's data; numpy has no bf16, uint8 covers every dtype."""
    flat = chunk.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


class _BackgroundWriter:
    """Writes byte buffers to a file on a thread, at most ``depth`` waiting: producing the next chunk (torch,
    GIL released) overlaps the write(2) of the previous one, on 2 cores about twice as fast as one after the other.
    A write error is kept and raised in the producer at its next :meth:`write` or at :meth:`close`."""

    def __init__(self, f: Any, depth: int = 1) -> None:
        self._f = f
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="safetensors-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            data = self._queue.get()
            if data is None:
                return
            if self._error is None:  # after an error keep draining, so the producer never blocks on a full queue
                try:
                    self._f.write(data)
                except BaseException as exc:  # handed to the producer thread, which re-raises it
                    self._error = exc

    def write(self, data: Any) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(data)

    def close(self) -> None:
        """Wait for every queued buffer to be written; raise the first write error, if any."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


def write_safetensors_streaming(
    path: str | Path,
    specs: Iterable[TensorSpec],
    fill: FillFn,
    *,
    metadata: dict[str, str] | None = None,
    progress: Callable[[int], None] | None = None,
    fsync: bool = False,
) -> int:
    """Write one safetensors file tensor by tensor, chunk by chunk, and return its size in bytes.

    Memory stays at three chunks (one being made, one queued, one being written; see :data:`FillFn`), so a 1 GiB
    expert bank never exists as one tensor. The header comes first (from ``specs``), then each tensor's bytes in
    spec order, written on a background thread while ``fill`` makes the next chunk. The file is built under a
    hidden temporary name in the same folder and renamed into place only when complete, so an interrupted or
    killed run never leaves a file that looks finished (the temporary is deleted on any Python-level error).
    ``progress(n)`` gets the bytes of each chunk just written. ``fsync`` flushes to disk before the rename (off
    by default: a process kill cannot lose page-cache data; only a power cut can).

    A fill that yields the wrong dtype or the wrong number of bytes is a ValueError naming the tensor.
    """
    if sys.byteorder != "little":  # safetensors data is little-endian; we write memory as is
        raise RuntimeError("write_safetensors_streaming needs a little-endian machine")
    path = Path(path)
    specs = list(specs)
    head = safetensors_header(specs, metadata)
    expected = len(head) + sum(s.nbytes for s in specs)
    # a hidden, unique name in the same folder (so the rename is atomic); mode 0666 & ~umask like any new file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            writer = _BackgroundWriter(f)
            try:
                writer.write(head)
                for spec in specs:
                    left = spec.nbytes
                    for chunk in fill(spec):
                        if chunk.dtype != spec.dtype:
                            raise ValueError(f"tensor {spec.name!r}: fill gave a {chunk.dtype} chunk, the spec says {spec.dtype}")
                        data = _chunk_bytes(chunk)
                        if data.nbytes > left:
                            raise ValueError(f"tensor {spec.name!r}: fill gave more than its {spec.nbytes} bytes")
                        writer.write(data)
                        left -= data.nbytes
                        if progress is not None:
                            progress(data.nbytes)
                    if left:
                        raise ValueError(f"tensor {spec.name!r}: fill gave {spec.nbytes - left} of its {spec.nbytes} bytes")
            finally:
                writer.close()
            f.flush()
            if f.tell() != expected:  # cannot happen unless the file was changed under us
                raise CheckpointError(f"{tmp}: wrote {f.tell()} bytes, expected {expected}")
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # includes KeyboardInterrupt: never leave a partial file behind
        tmp.unlink(missing_ok=True)
        raise
    return expected


def plan_shards(specs: Iterable[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Split specs, in order, into shards of at most ``max_shard_bytes`` of data (the rule of
    :func:`write_checkpoint`: a tensor that does not fit starts a new shard; one bigger than the limit gets a
    shard of its own)."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_checkpoint_streaming(
    model_dir: str | Path,
    specs: Iterable[TensorSpec],
    fill: FillFn,
    *,
    max_shard_bytes: int = 2 * 1024**3,
    progress: Callable[[str, int], None] | None = None,
) -> list[Path]:
    """Write ``specs`` (full checkpoint names) as Hugging Face shards with :func:`write_safetensors_streaming`.

    Same layout as :func:`write_checkpoint`: one shard -> ``model.safetensors`` (a stale index is removed, or it
    would shadow the new file); more -> ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``,
    written last so a folder whose index exists has all its shards. ``progress(file_name, n)`` gets the bytes of
    each chunk written. Returns the shard paths."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(specs, max_shard_bytes)
    names = (
        [SINGLE_NAME] if len(shards) == 1 else [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    )
    paths: list[Path] = []
    for fname, shard in zip(names, shards):
        report = None if progress is None else (lambda n, _f=fname: progress(_f, n))
        write_safetensors_streaming(model_dir / fname, shard, fill, metadata={"format": "pt"}, progress=report)
        paths.append(model_dir / fname)
        log.debug("wrote %s (%d tensors)", model_dir / fname, len(shard))
    index_path = model_dir / INDEX_NAME
    if len(shards) == 1:
        if index_path.exists():
            log.info("removing the old %s (the checkpoint is now one file)", index_path)
            index_path.unlink()
    else:
        weight_map = {spec.name: fname for fname, shard in zip(names, shards) for spec in shard}
        total = sum(spec.nbytes for shard in shards for spec in shard)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_text_atomic(index_path, json.dumps(index, indent=2))
    return paths
