"""Shared test set-up: headless Qt, and tiny checkpoints made on demand into temporary folders."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from clover_desk.storage.store import ChatStore

# transformers 5.23 takes flash-linear-attention's GDN kernels whenever `fla` imports, whatever the device, and they
# cannot run on a CPU outside Triton's interpreter: the numerical reference must stay on its PyTorch path. (The fla
# tests run their kernels in child processes, under the interpreter.)
sys.modules.setdefault("fla", None)
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("QTWEBENGINE_DISABLE_SANDBOX", "1")
# The download tests run the real huggingface_hub client against a Hub stand-in on 127.0.0.1: online mode, whatever
# the environment says, and no telemetry (set before any test module imports huggingface_hub, which reads them once).
os.environ["HF_HUB_OFFLINE"] = "0"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# Tiny models on a 2-core machine: one torch thread per process is several times faster than the default
# (inherited by the worker and CLI subprocesses the tests start).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest hook signature
    """Before any QApplication exists: torch's compiler stack (it loads Triton's native library, which segfaults when
    loaded after Qt WebEngine's Chromium: a worker that ran GUI tests and then built a model; the full suite imports
    it at collection anyway, this makes any selection of files safe; the app's GUI process never imports torch), the
    PySide6 refcount guard and the preview's custom URL scheme."""
    import torch._dynamo  # noqa: F401

    from clover_desk.qt_compat import guard_pyside_bool_refcounts

    guard_pyside_bool_refcounts()
    try:
        from clover_desk.ui.preview_sandbox import register_schemes
    except ImportError:
        return  # no QtWebEngine: the webengine-marked tests skip
    register_schemes()


@pytest.fixture
def cpu_kernels_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The portable dequantizing expert path (what a GPU runs) in place of the CPU kernels, for tests that pin its
    numbers, op counts, piece cuts or syncs. The CPU kernels read the codes in place and round activations to int8
    blocks (tested in tests/engine/test_cpu_quant_own.py and by the KL bound in tests/engine/test_quant_cache.py). Off for
    this process and, through CLOVER_DESK_CPU_KERNELS=0, for whatever re-reads ``GpuPaths.from_env()`` (Engine.load's
    callers, the CLI commands and subprocesses a test runs). Use it with
    ``pytestmark = pytest.mark.usefixtures("cpu_kernels_off")``."""
    from clover_desk.engine.kernels import cpu_quant

    monkeypatch.setenv("CLOVER_DESK_CPU_KERNELS", "0")
    before = cpu_quant.set_enabled(False)
    yield
    cpu_quant.set_enabled(before)


@pytest.fixture
def sigint_deliverable() -> Iterator[None]:
    """SIGINT reaches the child processes this test starts as a terminal's Ctrl+C reaches a command: a child inherits
    an ignored SIGINT and the forking thread's signal mask, and native code loaded earlier in this long-lived test
    process could have left either behind (once, three Ctrl+C tests of one full run saw their child ignore SIGINT
    and finish normally; they pass alone). Python's handler is installed again at the OS level (exec resets it to
    the default) and SIGINT unblocked in this thread, both as before afterwards."""
    import signal

    handler = signal.getsignal(signal.SIGINT)
    forced = handler in (signal.SIG_IGN, None)
    signal.signal(signal.SIGINT, signal.default_int_handler if forced else handler)
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        if forced:
            signal.signal(signal.SIGINT, signal.SIG_IGN if handler == signal.SIG_IGN else signal.SIG_DFL)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ChatStore]:
    """A new chat store (real SQLite) in the test's folder, closed after the test. (A test module that needs a
    subclass, one that fails on purpose or counts, defines its own ``store``.)"""
    from clover_desk.storage.store import ChatStore

    with ChatStore(tmp_path / "chats.sqlite3") as s:
        yield s
