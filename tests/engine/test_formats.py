"""engine.weights.formats: the one safetensors header parser refuses every malformed entry with one line naming the file and
tensor, before any data is read."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from clover_desk.engine.errors import CheckpointError
from clover_desk.engine.weights.formats import read_safetensors_header


def _write(path: Path, entry: Any, data: int = 16) -> Path:
    raw = json.dumps({"w": entry}).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data))
    return path


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"dtype": "F32", "shape": [4], "data_offsets": ["0", "16"]}, "malformed header entry"),
        ({"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}, "malformed header entry"),
        ({"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}, "malformed header entry"),
        ({"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}, "malformed header entry"),
        ({"dtype": "F32", "shape": [4]}, "malformed header entry"),
        ({"dtype": "Q4", "shape": [4], "data_offsets": [0, 16]}, "unsupported dtype 'Q4'"),
        ({"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}, "needs 20"),
        ({"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}, "truncated"),
        ("not an object", "malformed header entry"),
    ],
)
def test_malformed_entries_are_one_line_naming_file_and_tensor(tmp_path: Path, entry: Any, message: str) -> None:
    path = _write(tmp_path / "m.safetensors", entry)
    with pytest.raises(CheckpointError, match=message) as err:
        read_safetensors_header(path)
    text = str(err.value)
    assert str(path) in text and "\n" not in text
    assert "'w'" in text or "unsupported" in text or "truncated" in text


def test_a_valid_entry_reads(tmp_path: Path) -> None:
    entries, _ = read_safetensors_header(_write(tmp_path / "ok.safetensors", {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}))
    assert entries["w"].shape == (4,) and entries["w"].nbytes == 16 and entries["w"].format == "fp32"
