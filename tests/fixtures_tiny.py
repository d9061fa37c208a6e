"""Session-scoped tiny checkpoints for engine tests, made by :func:`engine.weights.tiny.make_tiny` into temporary folders.

Use in a test module with ``from fixtures_tiny import tiny_clover_dir, tiny_qwen_dir  # noqa: F401`` (pytest puts
``tests/`` on ``sys.path``), or list ``"fixtures_tiny"`` in a conftest's ``pytest_plugins``. Each folder is made
once per session; tests that change files must copy it first (see :func:`copy_model`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_clover_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random ``clover_moe`` folder (4 layers, hidden 64, 16 experts, 3+ shards, tokenizer, templates)."""
    from clover_desk.engine.weights.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny_clover"), model_type="clover_moe", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random ``qwen3_5_moe`` folder (the non-diffusion base layout: nested text_config, no mask id)."""
    from clover_desk.engine.weights.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny_qwen"), model_type="qwen3_5_moe", seed=1)


@pytest.fixture(scope="module")
def one_torch_thread():  # type: ignore[no-untyped-def]
    """Run a module's model code on one torch thread (restored afterwards).

    The CI box has 2 cores shared by parallel jobs; OpenMP threads spinning against each other made a tiny
    forward ~20x slower than on one thread.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def copy_model(src: Path, dst: Path) -> Path:
    """A private copy of a session model folder, for tests that damage files: its files, without a quantized cache
    an earlier test's load built beside it."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".clover-cache"))
    return dst
