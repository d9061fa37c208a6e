"""Run a Triton test script in a child process under Triton's interpreter (``TRITON_INTERPRET=1`` must be set before
Triton is first imported, so not in the pytest process). The script prints "ok" when every check passed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, env: dict[str, str] | None = None, expect_ok: bool = True) -> str:
    """Run ``script``; it must exit 0 (and print just "ok" unless ``expect_ok`` is False). Returns its stdout."""
    env = {**os.environ, **(env or {}), "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0 and (done.stdout.strip() == "ok" or not expect_ok), done.stderr[-3000:]
    return done.stdout
