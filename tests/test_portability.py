"""Windows portability of the engine: no POSIX-only call without a fallback, and the fallbacks give the same bytes.

* The quantized cache is built and loaded with ``os.preadv`` / ``os.pwrite`` taken away (as on Windows): the cache
  file is byte-identical and the model's logits are identical.
* Page-locked memory refused (a WDDM cap, WSL): expert rows and the staging ring fall back to pageable memory with a
  warning instead of crashing.
* A scan of engine/ and clover_desk/ finds no POSIX-only module, ``os`` function or signal outside a guard (an
  ``if`` on ``os.name`` / ``sys.platform`` / ``hasattr``, or a ``try`` that catches the ImportError / AttributeError).
"""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from clover_desk.engine.model.config import parse_config
from clover_desk.engine.placement import expert_store
from clover_desk.engine.weights import quant_cache_build, quant_cache_files
from clover_desk.engine.weights.checkpoint import random_state_dict, write_checkpoint
from clover_desk.engine.weights.quant import make_policy
from clover_desk.engine.weights.quant_cache import load_from_cache
from clover_desk.engine.weights.quant_cache_build import build_cache
from clover_desk.engine.weights.quant_cache_files import DATA_NAME, MANIFEST_NAME
from clover_desk.engine.weights.tiny import config_dict_for, tiny_text_config
from tests.helpers_model import one_thread

ROOT = Path(__file__).resolve().parents[1]
SPECIAL = {"<|endoftext|>": 1, "<|im_end|>": 2, "<|mask|>": 3, "</think>": 4}
POLICY = make_policy()  # experts NF4, projections and lm_head INT8, the rest kept (bf16)


_single_thread = pytest.fixture(autouse=True, scope="module")(one_thread)  # tiny matmuls: one thread is fastest


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    text = tiny_text_config(vocab_size=128, layers=4, hidden=64, experts=8, experts_per_tok=2)
    text["moe_intermediate_size"] = 32
    cd = config_dict_for("clover_moe", text, SPECIAL)
    sd = random_state_dict(parse_config(cd), seed=7, dtype=torch.bfloat16)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    path = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(path, sd, cd, max_shard_bytes=total // 3 + 1)  # 3 shards: several source files open in turn
    return path


def _without_positional_io(monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows' os module: no preadv / pwrite (nor pread / pwritev)."""
    for name in ("preadv", "pwrite", "pread", "pwritev"):
        monkeypatch.delattr(os, name, raising=False)


# ---- the cache without os.preadv / os.pwrite -------------------------------------------------------------------


def test_cache_built_and_loaded_without_preadv_pwrite_is_identical(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    posix = build_cache(ckpt, POLICY, tmp_path / "posix")
    ref = load_from_cache(posix, ckpt, dtype=torch.float32)

    _without_positional_io(monkeypatch)
    assert not hasattr(os, "preadv") and not hasattr(os, "pwrite")
    portable = build_cache(ckpt, POLICY, tmp_path / "portable")
    assert (portable / DATA_NAME).read_bytes() == (posix / DATA_NAME).read_bytes()
    a, b = (json.loads((p / MANIFEST_NAME).read_text()) for p in (posix, portable))
    for m in (a, b):
        m.pop("created_unix")
    assert a == b  # same tensors, same sha256 and per-tensor crc32
    model = load_from_cache(portable, ckpt, dtype=torch.float32)  # reads through the fallback too

    ids = torch.tensor([5, 17, 33, 9, 60, 61, 2, 40] * 5)  # a full block of 32 and a partial one
    assert torch.equal(model(ids, 0, None, block_size=32), ref(ids, 0, None, block_size=32))
    assert torch.equal(model(ids, 0, None), ref(ids, 0, None))


def test_fallback_reads_and_writes_at_offsets_from_many_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _without_positional_io(monkeypatch)
    data = bytes(range(256)) * 64  # 16 KiB, every offset distinguishable
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_BINARY", 0), 0o644)
    try:
        quant_cache_files.write_all(fd, data[8000:], 8000)  # written back to front, at their offsets
        quant_cache_files.write_all(fd, data[:8000], 0)
        assert path.read_bytes() == data
        errors: list[str] = []

        def reader(seed: int) -> None:
            for i in range(2000):
                offset = (seed * 997 + i * 131) % (len(data) - 300)
                got = quant_cache_files.pread_all(fd, offset, 300, "test")
                if bytes(got) != data[offset : offset + 300]:
                    errors.append(f"thread {seed} read wrong bytes at {offset}")

        threads = [threading.Thread(target=reader, args=(s,)) for s in range(8)]
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # switch threads as often as possible: between a seek and its read, unlocked
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            sys.setswitchinterval(switch)
        assert errors == []
    finally:
        os.close(fd)


# ---- pinned memory refused --------------------------------------------------------------------------------------


@pytest.fixture
def pinning_refused(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """torch.empty(..., pin_memory=True) fails as cudaHostAlloc does when the pinned budget is spent."""
    real_empty = torch.empty
    refused: list[tuple[int, ...]] = []

    def empty(*size, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("pin_memory"):
            refused.append(tuple(size[0]) if size and isinstance(size[0], tuple) else tuple(size))
            raise RuntimeError("CUDA error: out of memory (simulated: page-locked memory refused)")
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    return refused


def test_expert_rows_fall_back_to_pageable_memory_when_pinning_fails(
    pinning_refused: list[tuple[int, ...]], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="clover_desk.engine.placement.expert_store"):
        rows, pinned = expert_store.alloc_host_rows((4, 32), True, expert_store.PinBudget(None), layer=3)
    assert pinning_refused == [(4, 32)]  # it was asked for, and refused
    assert not pinned and tuple(rows.shape) == (4, 32) and not rows.is_pinned()
    assert any("layer 3" in r.getMessage() and "pinning" in r.getMessage() for r in caplog.records)


def test_staging_ring_falls_back_to_pageable_buffers_when_pinning_fails(
    pinning_refused: list[tuple[int, ...]], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="clover_desk.engine.placement.expert_store"):
        ring = expert_store.StagingRing(64, 3, torch.device("cpu"), pin=True)
    assert pinning_refused and not ring.pinned and len(ring.buffers) == 3
    assert any("staging" in r.getMessage() for r in caplog.records)
    row = torch.arange(64, dtype=torch.uint8)
    staged, index = ring.stage(row)
    assert torch.equal(staged, row) and index == 0


# ---- other POSIX-only calls -------------------------------------------------------------------------------------


def test_pid_alive_tells_a_running_process_from_a_finished_one() -> None:
    assert quant_cache_build._pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not quant_cache_build._pid_alive(child.pid)


def test_make_tiny_peak_memory_without_the_resource_module(monkeypatch: pytest.MonkeyPatch) -> None:
    from clover_desk.cli import make_tiny as cmd_make_tiny

    assert cmd_make_tiny.peak_rss_bytes() > 0  # resource, on Linux
    monkeypatch.setitem(sys.modules, "resource", None)  # import resource -> ImportError, as on Windows
    peak = cmd_make_tiny.peak_rss_bytes()  # psutil's peak working set exists on Windows only
    assert peak is None or peak > 0


POSIX_MODULES = {"fcntl", "resource", "termios", "pwd", "grp", "posix", "pty", "tty", "syslog", "crypt"}
POSIX_OS = {
    "preadv", "pwritev", "pread", "pwrite", "readv", "writev", "fork", "forkpty", "kill", "killpg", "wait3", "wait4",
    "getuid", "geteuid", "getgid", "getegid", "setsid", "getpgid", "setpgid", "sched_getaffinity",
    "sched_setaffinity", "posix_fadvise", "posix_fallocate", "sync", "fchown", "chown", "lchown", "mkfifo", "mknod",
    "nice", "getloadavg", "sysconf", "statvfs", "fstatvfs", "sendfile", "O_DIRECT", "O_NOATIME", "getrusage",
}
POSIX_SIGNAL = {"SIGKILL", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGCHLD", "SIGPIPE", "SIGQUIT", "SIGSTOP",
                "SIGCONT", "alarm", "setitimer", "pause", "pthread_kill", "sigwait"}
GUARD_WORDS = ("os.name", "sys.platform", "hasattr", "getattr", "platform.system")


def _is_guard_test(node: ast.AST) -> bool:
    text = ast.unparse(node)
    return any(word in text for word in GUARD_WORDS)


def _posix_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every POSIX-only name used outside a guard in ``tree``."""
    parents: dict[ast.AST, ast.AST] = {}
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            parents[child] = parent

    def guarded(node: ast.AST) -> bool:
        while node in parents:
            parent = parents[node]
            if isinstance(parent, (ast.If, ast.IfExp, ast.While)) and _is_guard_test(parent.test):
                return True
            if isinstance(parent, ast.Try) and node in parent.body and any(
                h.type is not None and any(n in ast.unparse(h.type) for n in ("ImportError", "AttributeError"))
                for h in parent.handlers
            ):
                return True
            if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                isinstance(n, ast.If) and _is_guard_test(n.test) for n in ast.walk(parent)
            ):
                return True  # the function checks the platform or the call's presence before using it
            node = parent
        return False

    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Import):
            names = {a.name.split(".")[0] for a in node.names} & POSIX_MODULES
            what = f"import {', '.join(sorted(names))}" if names else None
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in POSIX_MODULES:
            what = f"from {node.module} import"
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id == "os" and node.attr in POSIX_OS) or (
                node.value.id == "signal" and node.attr in POSIX_SIGNAL
            ):
                what = f"{node.value.id}.{node.attr}"
        if what is not None and not guarded(node):
            found.append((getattr(node, "lineno", 0), what))
    return found


@pytest.mark.parametrize("package", ["engine", "clover_desk"])
def test_no_unguarded_posix_only_call(package: str) -> None:
    problems = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, what in _posix_uses(ast.parse(path.read_text(encoding="utf-8"))):
            problems.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert problems == [], "POSIX-only, with no fallback for Windows:\n" + "\n".join(problems)


def test_the_scan_catches_what_it_looks_for() -> None:
    bad = "import fcntl\nimport os\ndef f(fd):\n    return os.preadv(fd, [], 0)\n"
    good = ("import os, sys\nif sys.platform != 'win32':\n    import fcntl\n"
            "def f(fd):\n    return os.pread(fd, 1, 0) if hasattr(os, 'pread') else b''\n")
    assert [w for _, w in _posix_uses(ast.parse(bad))] == ["import fcntl", "os.preadv"]
    assert _posix_uses(ast.parse(good)) == []
