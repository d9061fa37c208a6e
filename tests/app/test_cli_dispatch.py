"""The ``clover-desk`` dispatcher: no subcommand opens the window with its options; bench needs a suite."""

from __future__ import annotations

import pytest

from clover_desk.cli.main import parse_args


def test_no_subcommand_is_the_gui_with_its_options() -> None:
    args = parse_args([])
    assert args.command == "gui" and args.home is None and args.model is None
    args = parse_args(["--verbose"])
    assert args.command == "gui" and args.verbose


def test_subcommands_get_their_own_options() -> None:
    args = parse_args(["plan", "--shape", "clover-35b-a3b", "--vram-gb", "16"])
    assert args.command == "plan" and args.vram_budget_bytes == 16 << 30  # GiB on the command line, bytes after
    args = parse_args(["bench", "offload", "--tiny"])
    assert (args.command, args.suite, args.tiny) == ("bench", "offload", True)


def test_bench_without_a_suite_names_the_suites_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["bench"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1  # one line, no usage block
    assert all(suite in captured.err for suite in ("speed", "offload", "load", "gguf"))


def test_gui_options_without_the_subcommand() -> None:
    args = parse_args(["--model", "/models/clover", "--vram-gb", "12"])
    assert (args.command, args.model, args.vram_budget_bytes) == ("gui", "/models/clover", 12 << 30)


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    """``clover-desk plan --json | head -1``: no BrokenPipeError traceback, SIGPIPE's status."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import sys; from clover_desk.cli.main import main; "
                             "sys.exit(main(['plan', '--shape', 'clover-35b-a3b', '--json']))"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # gone before the command (still importing) writes a byte
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""
