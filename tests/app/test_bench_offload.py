"""``clover-desk bench offload``: prints figures (none asserted as speed), calibrated trace, tiny end-to-end run."""

from __future__ import annotations

import re

import pytest
import torch

from clover_desk.cli.main import main
from tests.helpers_model import one_thread

_single_thread = pytest.fixture(autouse=True, scope="module")(one_thread)  # tiny matmuls: one thread is fastest


def test_simulation_prints_calibrated_trace_and_bytes_per_token(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "offload", "--blocks", "1"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"distinct experts per 32-slot pass: ([\d.]+) of 256", out)
    assert m and 60 <= float(m.group(1)) <= 80, out
    assert re.search(r"streamed expert layers, slot pool \d+ experts", out)
    ar = re.search(r"AR: [\d.]+ expert loads/token .* = ([\d.]+) MiB host->device per token", out)
    assert ar and float(ar.group(1)) > 0
    ratios = re.findall(r"([\d.]+) MiB/token; AR/diffusion bytes ratio ([\d.]+)x", out)
    assert len(ratios) == 3
    plain, coreset = float(ratios[0][0]), float(ratios[1][0])
    assert 0 < coreset < plain  # the coreset shrinks the block working set, so fewer bytes move


def test_tiny_end_to_end_streams_real_weights_without_changing_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "offload", "--tiny"]) == 0
    out = capsys.readouterr().out
    assert out.count("identical to all-resident") == 2, out
    assert "DIFFERENT" not in out
    kib = [float(x) for x in re.findall(r"host->device ([\d.]+) KiB/token", out)]
    assert len(kib) == 2 and all(x > 0 for x in kib)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_check_fails_cleanly_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "offload", "--gpu"]) == 2
    assert "CUDA is not available" in capsys.readouterr().out


def test_budget_that_cannot_fit_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "offload", "--vram-gb", "1"]) == 2
    assert "does not fit" in capsys.readouterr().out
