"""``scripts/gpu_check.sh``, the one prepared run for a lent GPU machine (15 minutes in all, never on CI): every
step must start. Each ``clover_desk.cli.main`` command line in it parses with today's flags, each environment switch it
sets is an opt-in the engine reads, each test file it names exists, and its step names are unique (a second call
names the steps the first left). A flag renamed or narrowed here would otherwise first fail on the GPU machine."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from clover_desk.cli import main as cli
from clover_desk.engine.settings import OPT_IN

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def logical_lines(text: str) -> list[str]:
    """The script's lines with backslash continuations joined, comments dropped."""
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if not current and line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        lines.append(current + line)
        current = ""
    return [line for line in lines if line.strip()]


def steps() -> list[tuple[str, list[str]]]:
    """(name, words after the time limit) of every ``step NAME SECONDS COMMAND...`` line."""
    out = []
    for line in logical_lines(SCRIPT.read_text()):
        words = shlex.split(line.strip())
        if words and words[0] == "step":
            out.append((words[1], words[3:]))
    return out


def cli_args(words: list[str]) -> list[str]:
    """The arguments after ``-m clover_desk.cli.main``."""
    return words[words.index("clover_desk.cli.main") + 1 :]


def test_the_script_has_its_steps_once_each() -> None:
    names = [name for name, _ in steps()]
    assert len(names) >= 8 and len(set(names)) == len(names), names
    assert names[:3] == ["pytest_gpu", "card_fast", "card_device_pool"]  # what decides the fast path, first


@pytest.mark.parametrize("name, words", [s for s in steps() if "clover_desk.cli.main" in s[1]], ids=lambda v: v
                         if isinstance(v, str) else "")
def test_every_cli_step_parses_with_todays_flags(name: str, words: list[str]) -> None:
    args = cli.parse_args(cli_args(words))  # argparse exits 2 on a flag it does not know or a value out of range
    assert args.command == "bench", name
    env = [w.split("=", 1) for w in words[1 : words.index("$py")]] if words[0] == "env" else []
    for key, value in env:
        assert key in OPT_IN and value == "1", (name, key, value)


def test_the_gpu_tests_it_runs_exist_and_are_marked() -> None:
    (words,) = [w for name, w in steps() if name == "pytest_gpu"]
    files = [w for w in words if w.startswith("tests/")]
    assert files and all((ROOT / f).is_file() for f in files), files
    for f in files:
        assert "pytest.mark.gpu" in (ROOT / f).read_text() or "mark.gpu" in (ROOT / f).read_text(), f
