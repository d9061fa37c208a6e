"""Work-arounds for the Qt binding, applied once before any QApplication exists (stdlib only)."""

from __future__ import annotations

import ctypes
import sys


def guard_pyside_bool_refcounts() -> None:
    """Work around a PySide6 6.12 reference-count bug on CPython < 3.12.

    ``SignalInstance.emit()`` returns ``True`` without taking a reference (and some void calls drop one on
    ``None``), so each emit from Python lowers ``True``'s count by one until CPython aborts with "bool_dealloc:
    deallocating True or False". CPython 3.12+ makes these singletons immortal; on older versions we add a huge
    count once, which has the same effect. Call before the first signal is emitted; calling again is harmless.
    """
    if sys.implementation.name != "cpython" or sys.version_info >= (3, 12):
        return
    for singleton in (True, False, None):
        ctypes.c_ssize_t.from_address(id(singleton)).value += 1 << 40
