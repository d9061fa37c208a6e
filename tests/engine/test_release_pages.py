"""release_pages: a GGUF load copies the file out of its memory map and drops the copied pages from the process, so
the load peaks near the model's size, not twice it; nothing but a read-only file map is ever touched."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import psutil
import pytest

from clover_desk.engine.weights.gguf.file import release_pages

pytestmark = pytest.mark.skipif(not hasattr(mmap.mmap, "madvise") or sys.platform == "win32",
                                reason="madvise is POSIX")

SIZE = 96 << 20


def _rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.fixture()
def mapped(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(np.arange(SIZE, dtype=np.uint8).tobytes())
    return np.memmap(path, mode="r")


def test_copied_pages_leave_the_process(mapped):
    view = mapped[4096 + 7 : SIZE - 5]  # unaligned ends: the pages under it are rounded outwards
    assert int(view.sum(dtype=np.int64)) > 0  # every page faulted in
    before = _rss()
    assert release_pages(view)
    dropped = before - _rss()
    assert dropped > 0.8 * SIZE, f"only {dropped / 2**20:.1f} MiB left the resident set"
    # the bytes are still there: a later read faults them back in from the page cache
    assert np.array_equal(view[:1000], (np.arange(4096 + 7, 4096 + 1007) % 256).astype(np.uint8))


def test_anything_but_a_read_only_file_map_is_left_alone(tmp_path, mapped):
    anonymous = np.arange(1 << 20, dtype=np.uint8)
    assert not release_pages(anonymous)
    assert anonymous[12345] == 12345 % 256
    path = tmp_path / "rw.bin"
    path.write_bytes(b"\x07" * (1 << 20))
    writable = np.memmap(path, mode="c")  # copy-on-write: DONTNEED would lose the write
    writable[:10] = 9
    assert not release_pages(writable)
    assert writable[0] == 9
    strided = mapped[::2]
    assert not release_pages(strided)
