"""The shared fixtures of tests/conftest.py do what the test modules that use them rely on."""

from __future__ import annotations

import os

import pytest

from clover_desk.engine.kernels import cpu_quant
from clover_desk.engine.settings import GpuPaths


@pytest.mark.usefixtures("cpu_kernels_off")
def test_cpu_kernels_off_turns_them_off_here_and_for_what_reads_the_environment() -> None:
    assert cpu_quant.set_enabled(False) is False  # was already off in this process
    assert os.environ["CLOVER_DESK_CPU_KERNELS"] == "0"
    assert GpuPaths.from_env().cpu_kernels is False  # what Engine.load's callers and the CLI commands re-read
