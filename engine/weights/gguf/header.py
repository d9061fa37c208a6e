"""A bounded reader for GGUF headers: every count, length, dimension and offset the file declares is checked against
the bytes that are left *before* anything is allocated or looped over.

The ``gguf`` package's ``GGUFReader`` trusts the header: an array that declares 2^62 elements is read element by
element (past the end of the file every read is empty, so the loop never ends and memory grows), and arrays nested
a few thousand deep end in a RecursionError. :func:`read_header` walks the same structure with ``struct`` over a
memory map and refuses, with one :class:`GGUFFormatError` line naming the file and the fault:

* a string, array or tensor table that needs more bytes than remain (each element's smallest encoding is counted);
* arrays nested deeper than :data:`MAX_NESTING` (real files nest none);
* an unknown value type or ggml tensor type, more than :data:`MAX_DIMS` dimensions, a row that does not hold whole
  quantization blocks, element counts that overflow, tensor data outside the file or off the alignment;
* duplicate keys or tensor names, keys or names that are not UTF-8, a bad ``general.alignment``;
* a header larger than ``max_header_bytes`` or taking longer than ``deadline_s`` (the models page's scan sets both).

Only then is the file handed to ``GGUFReader`` (:func:`engine.weights.gguf.file.open_gguf`), whose work is then
bounded by the file's size. Big-endian files (the version's low half zero) are read like ``GGUFReader`` reads them.
"""

from __future__ import annotations

import functools
import mmap
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clover_desk.engine.errors import CheckpointError, ConfigError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_NESTING = 8  # arrays inside arrays; real files use none (llama.cpp refuses any)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 62
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
# value type -> (struct code, size); STRING and ARRAY are variable
SCALARS: dict[int, tuple[str, int]] = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
                                       6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
# the fewest bytes one element of a type can take: a string is its 8-byte length, an array its type and count
MIN_SIZE = {**{t: size for t, (_, size) in SCALARS.items()}, STRING: 8, ARRAY: 12}
_CHECK_EVERY = 4096  # elements between two deadline checks (the first one included)


@functools.cache
def quant_sizes() -> dict[int, tuple[int, int]]:
    """ggml type -> (values per block, bytes per block), the ``gguf`` package's table (imported on first use: this
    module stays stdlib-only at import, for the window)."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(t): sizes for t, sizes in GGML_QUANT_SIZES.items()}


class GGUFFormatError(CheckpointError, ConfigError):
    """A GGUF file whose header is damaged, truncated or hostile. A :class:`CheckpointError` (what the file is) and,
    for the callers that have always caught GGUF problems as such, a :class:`ConfigError`."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header declares it: ``dims`` in ggml order (``ne``), ``offset`` from the data section."""

    name: str
    qtype: int
    dims: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class GGUFHeader:
    """What :func:`read_header` found: metadata (arrays as lists when ``keep_arrays``, else their length as
    ``ArrayInfo``), tensors, where the data section starts and the file's size."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_offset: int
    file_size: int
    header_bytes: int = 0
    types: dict[str, int] = field(default_factory=dict)  # key -> value type


@dataclass(frozen=True)
class ArrayInfo:
    """An array value left unread (``keep_arrays=False``): its element type and count."""

    item_type: int
    count: int


class _Cursor:
    def __init__(self, buf: Any, size: int, path: Path, endian: str, limit: int, deadline: float | None) -> None:
        self.buf = buf
        self.size = size
        self.path = path
        self.endian = endian
        self.pos = 0
        self.limit = min(limit, size)  # the header may not reach past this
        self.deadline = deadline
        self.steps = 0

    def fail(self, what: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.path}: truncated or damaged GGUF file: {what}")

    def left(self) -> int:
        return self.limit - self.pos

    def need(self, nbytes: int, what: str) -> None:
        if nbytes > self.left():
            if self.limit < self.size:
                raise GGUFFormatError(f"{self.path}: GGUF header too large: {what} would reach past the first "
                                      f"{self.limit:,} bytes read for the header")
            raise self.fail(f"{what}: {nbytes:,} bytes needed at offset {self.pos:,}, {self.left():,} left in the file")

    def tick(self) -> None:
        self.steps += 1
        if self.steps % _CHECK_EVERY == 1:
            self.tick_now()

    def tick_now(self) -> None:
        """Check the deadline now."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise GGUFFormatError(f"{self.path}: GGUF header not read within the time allowed "
                                  f"(stopped at offset {self.pos:,})")

    def unpack(self, code: str, size: int, what: str) -> Any:
        self.need(size, what)
        (value,) = struct.unpack_from(self.endian + code, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return int(self.unpack("I", 4, what))

    def u64(self, what: str) -> int:
        return int(self.unpack("Q", 8, what))

    def raw_string(self, what: str) -> bytes:
        n = self.u64(f"the length of {what}")
        self.need(n, f"{what} ({n:,} bytes)")
        data = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return data

    def text(self, what: str) -> str:
        data = self.raw_string(what)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at offset {self.pos - len(data):,} is not UTF-8") from None


def _value(cur: _Cursor, vtype: int, key: str, depth: int, keep: bool) -> Any:
    if vtype in SCALARS:
        code, size = SCALARS[vtype]
        return cur.unpack(code, size, f"the value of {key!r}")
    if vtype == STRING:
        data = cur.raw_string(f"the value of {key!r}")
        return data.decode("utf-8", errors="replace") if keep else None
    if vtype != ARRAY:
        raise cur.fail(f"key {key!r} has value type {vtype}, which is not a GGUF type (0-12)")
    if depth >= MAX_NESTING:
        raise cur.fail(f"key {key!r} nests arrays more than {MAX_NESTING} deep")
    item = cur.u32(f"the element type of {key!r}")
    count = cur.u64(f"the element count of {key!r}")
    if item not in MIN_SIZE:
        raise cur.fail(f"key {key!r} is an array of value type {item}, which is not a GGUF type (0-12)")
    cur.need(count * MIN_SIZE[item], f"the {count:,} elements of {key!r}")
    if item in SCALARS:
        code, size = SCALARS[item]
        start = cur.pos
        cur.pos += count * size
        if not keep:
            return ArrayInfo(item, count)
        return list(struct.unpack_from(f"{cur.endian}{count}{code}", cur.buf, start))
    if item == STRING:
        return _strings(cur, count, key, keep)
    values = []
    for _ in range(count):
        cur.tick()
        v = _value(cur, item, key, depth + 1, keep)
        if keep:
            values.append(v)
    return values if keep else ArrayInfo(item, count)


def _strings(cur: _Cursor, count: int, key: str, keep: bool) -> Any:
    """An array of ``count`` strings (a vocabulary: 150,000 and more), in one tight loop."""
    length = struct.Struct(cur.endian + "Q").unpack_from
    buf, pos, end = cur.buf, cur.pos, cur.limit
    values: list[str] = []
    for i in range(count):
        if i % _CHECK_EVERY == 0:
            cur.pos = pos
            cur.tick_now()
        if pos + 8 > end:
            cur.pos = pos
            cur.need(8, f"the length of string {i:,} of {key!r}")
        (n,) = length(buf, pos)
        if n > end - pos - 8:
            cur.pos = pos + 8
            cur.need(n, f"string {i:,} of {key!r} ({n:,} bytes)")
        if keep:
            values.append(bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8", errors="replace"))
        pos += 8 + n
    cur.pos = pos
    return values if keep else ArrayInfo(STRING, count)


def _tensor(cur: _Cursor, index: int) -> TensorInfo:
    name = cur.text(f"the name of tensor {index}")
    n_dims = cur.u32(f"the dimension count of {name!r}")
    if n_dims > MAX_DIMS:
        raise cur.fail(f"tensor {name!r} has {n_dims:,} dimensions (at most {MAX_DIMS})")
    cur.need(8 * n_dims + 12, f"the header of tensor {name!r}")
    dims = tuple(cur.u64(f"a dimension of {name!r}") for _ in range(n_dims))
    qtype = cur.u32(f"the type of {name!r}")
    offset = cur.u64(f"the data offset of {name!r}")
    sizes = quant_sizes()
    if qtype not in sizes:
        raise cur.fail(f"tensor {name!r} has ggml type {qtype}, which is not a known ggml type")
    elements = 1
    for d in dims:
        elements *= d
        if elements > MAX_ELEMENTS:
            raise cur.fail(f"tensor {name!r} declares dimensions {list(dims)}: too many elements")
    block, type_size = sizes[qtype]
    if dims and dims[0] % block:
        raise cur.fail(f"tensor {name!r} has rows of {dims[0]:,} values, not whole blocks of {block}")
    return TensorInfo(name, qtype, dims, offset, elements // block * type_size)


def _parse(cur: _Cursor, keep_arrays: bool) -> GGUFHeader:
    if bytes(cur.buf[:4]) != MAGIC:
        raise ConfigError(f"{cur.path}: not a GGUF file (it does not start with the GGUF magic)")
    cur.pos = 4
    version = cur.u32("the version")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order: read it as GGUFReader does
        cur.endian = ">"
        (version,) = struct.unpack_from(">I", cur.buf, 4)
    if version not in VERSIONS:
        raise GGUFFormatError(f"{cur.path}: GGUF version {version} is not supported (read: {VERSIONS[0]} and "
                              f"{VERSIONS[1]})")
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.u64("the metadata count")
    cur.need(n_kv * 13, f"{n_kv:,} metadata entries")  # key length, value type, one byte of value at least
    metadata: dict[str, Any] = {}
    types: dict[str, int] = {}
    for i in range(n_kv):
        cur.tick()
        key = cur.text(f"metadata key {i}")
        if key in metadata:
            raise cur.fail(f"metadata key {key!r} appears twice")
        vtype = cur.u32(f"the value type of {key!r}")
        types[key] = vtype
        metadata[key] = _value(cur, vtype, key, 0, keep_arrays or key == "general.alignment")
    cur.need(n_tensors * 24, f"{n_tensors:,} tensor entries")  # name length, dims, type, offset at least
    tensors = []
    names: set[str] = set()
    for i in range(n_tensors):
        cur.tick()
        t = _tensor(cur, i)
        if t.name in names:
            raise cur.fail(f"tensor {t.name!r} appears twice")
        names.add(t.name)
        tensors.append(t)
    header_bytes = cur.pos
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in metadata and (types["general.alignment"] != 4 or alignment <= 0
                                           or alignment & (alignment - 1)):
        raise cur.fail(f"general.alignment is {alignment!r}; it must be a uint32 power of two")
    data_offset = -(-cur.pos // alignment) * alignment
    for t in tensors:
        if t.offset % alignment:
            raise cur.fail(f"tensor {t.name!r} starts at offset {t.offset:,}, not a multiple of the alignment "
                           f"{alignment}")
        end = data_offset + t.offset + t.nbytes
        if end > cur.size:
            raise cur.fail(f"tensor {t.name!r} ({t.nbytes:,} bytes at data offset {t.offset:,}) ends at byte "
                           f"{end:,}, past the end of the file ({cur.size:,} bytes)")
    return GGUFHeader(cur.path, version, metadata, tensors, data_offset, cur.size, header_bytes, types)


def read_header(path: str | Path, *, keep_arrays: bool = True, max_header_bytes: int | None = None,
                deadline_s: float | None = None) -> GGUFHeader:
    """Read and check the header of one GGUF file (see the module's doc). ``keep_arrays=False`` checks arrays
    without building them (:class:`ArrayInfo` in their place). Not GGUF: ConfigError; a damaged, truncated or hostile
    header, or one past ``max_header_bytes`` / ``deadline_s``: :class:`GGUFFormatError`; unreadable: OSError."""
    path = Path(path)
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    with path.open("rb") as f:
        size = f.seek(0, 2)
        if size < 4:
            raise ConfigError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            limit = size if max_header_bytes is None else max_header_bytes
            return _parse(_Cursor(buf, size, path, "<", limit, deadline), keep_arrays)
