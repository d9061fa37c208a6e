"""Hostile GGUF headers, built byte by byte (the ``gguf`` package's writer would refuse to write them)."""

from __future__ import annotations

import struct
from pathlib import Path

ARRAY, UINT8, STRING = 9, 0, 8


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _head(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def huge_array(path: Path) -> Path:
    """A 165-byte file whose one metadata array declares 2^62 bytes (GGUFReader reads them one by one, each read
    past the end of the file empty: it never ends)."""
    body = _head(0, 1) + _string("tokenizer.ggml.token_type") + struct.pack("<IIQ", ARRAY, UINT8, 1 << 62)
    path.write_bytes(body.ljust(165, b"\1"))
    return path


def nested_arrays(path: Path, depth: int = 5000) -> Path:
    """A file of ``depth`` arrays each holding the next (about 60 KB for 5,000)."""
    body = _head(0, 1) + _string("general.nested") + struct.pack("<I", ARRAY)
    body += struct.pack("<IQ", ARRAY, 1) * depth + struct.pack("<IQ", UINT8, 0)
    path.write_bytes(body)
    return path


def huge_tensor(path: Path) -> Path:
    """A file with one tensor of 2^40 x 2^40 F32 values and no data."""
    body = _head(1, 0) + _string("token_embd.weight") + struct.pack("<I", 2) + struct.pack("<QQ", 1 << 40, 1 << 40)
    body += struct.pack("<IQ", 0, 0)
    path.write_bytes(body)
    return path


def huge_string(path: Path) -> Path:
    """A vocabulary of three strings, the second of which declares 2^63 bytes."""
    body = _head(0, 1) + _string("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, 3)
    body += _string("a") + struct.pack("<Q", 1 << 63) + b"bc" + _string("d") * 4
    path.write_bytes(body)
    return path
