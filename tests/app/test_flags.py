"""Every numeric flag refuses values outside its range with one line naming the flag and what is allowed (exit 2),
before any work starts (no model is read: the folder below does not exist)."""

from __future__ import annotations

import pytest

from clover_desk.cli import main as cli

GENERATE = ["generate", "--model", "/nonexistent", "--prompt", "hi"]
BAD = {
    "--temperature": ["inf", "nan", "-1", "1e-300", "1e9", "x"],
    "--top-p": ["0", "1.5", "nan", "-0.1"],
    "--top-k": ["-1", "1.5", "99999999999"],
    "--seed": ["-1", str(2**70), "x"],
    "--threshold": ["1.01", "-0.1", "inf"],
    "--block-size": ["0", "100000", "3.5"],
    "--max-new-tokens": ["0", "-5", str(2**40)],
    "--vram-gb": ["0", "nan", "inf", "1e300", "-2"],
    "--ctx": ["0", "-1", "1e3"],
}


@pytest.mark.parametrize("flag, value", [(f, v) for f, values in BAD.items() for v in values])
def test_generate_refuses_out_of_range_numbers(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*GENERATE, flag, value])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.count("\n") == 1 and f"argument {flag}: must be" in err and repr(value) in err, err


@pytest.mark.parametrize("flag, value", [("--temperature", "0"), ("--temperature", "0.7"), ("--top-p", "1"),
                                         ("--seed", str(2**63 - 1)), ("--threshold", "0.95")])
def test_edge_values_are_accepted(flag: str, value: str) -> None:
    args = cli.parse_args([*GENERATE, flag, value])
    assert getattr(args, flag.lstrip("-").replace("-", "_")) == pytest.approx(float(value))


@pytest.mark.parametrize("value, budget", [("0.5", 1 << 29), ("16", 16 << 30), ("65536", 1 << 46), ("1e-9", 1)])
def test_vram_gb_is_read_as_bytes(value: str, budget: int) -> None:
    """--vram-gb is GiB for people, and bytes (vram_budget_bytes, a whole number) from the moment it is parsed."""
    args = cli.parse_args([*GENERATE, "--vram-gb", value])
    assert args.vram_budget_bytes == budget and isinstance(args.vram_budget_bytes, int)
    assert not hasattr(args, "vram_gb")


# The other commands' sizing flags: refused at parse time, before a model is built or a file is read
OTHER_BAD = [
    (["bench", "speed"], "--prompt-tokens", ["0", "-1", "65537"]),
    (["bench", "speed"], "--decode-tokens", ["0", "4097"]),
    (["bench", "speed"], "--diffusion-tokens", ["-1", "0"]),
    (["bench", "speed"], "--repeats", ["0", "1e3"]),
    (["bench", "speed"], "--layers", ["0", "-3"]),
    (["bench", "speed"], "--seed", ["-1"]),
    (["bench", "speed"], "--moe-distinct", ["0", "7", "257"]),
    (["bench", "speed"], "--vram-gb", ["nan", "-2", "0"]),
    (["bench", "speed"], "--stream", ["0", "-1"]),
    (["bench", "offload"], "--vram-gb", ["nan", "-1"]),
    (["bench", "offload"], "--ctx", ["0"]),
    (["bench", "offload"], "--tokens-per-pass", ["0", "33", "nan"]),
    (["bench", "offload"], "--target-distinct", ["0", "9999"]),
    (["bench", "offload"], "--block-reuse", ["0", "0.5"]),
    (["bench", "offload"], "--blocks", ["0", "100000000"]),
    (["bench", "offload"], "--gpu-mem-gb", ["-1", "inf"]),
    (["bench", "load", "--model", "/nonexistent"], "--vram-gb", ["-1", "nan"]),
    (["bench", "load", "--model", "/nonexistent", "--vram-gb", "16"], "--ctx", ["0", "-5"]),
    (["make-tiny", "/nonexistent/out"], "--seed", ["-1", "x"]),
    (["preview", "/nonexistent.html"], "--wait-ms", ["-5", "99999999"]),
    (["gui"], "--vram-gb", ["0", "1e300", "inf", "x"]),
    (["bench", "gguf"], "--values", ["0", "2047", str(2**40)]),
    (["bench", "gguf"], "--repeat", ["0", "100000"]),
    (["bench", "gguf"], "--threads", ["0", "-1"]),
]


@pytest.mark.parametrize("command, flag, value", [(c, f, v) for c, f, values in OTHER_BAD for v in values])
def test_other_commands_refuse_out_of_range_numbers(command: list[str], flag: str, value: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    args = [*command, flag, value]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.count("\n") == 1 and f"argument {flag}: must be" in err and repr(value) in err, err


@pytest.mark.parametrize("argv, says", [
    (["--stream", "2"], "add --quant card"),
    (["--vram-gb", "16"], "add --quant card"),
    (["--vram-gb", "16", "--quant", "card"], "plans the clover-35b-a3b shape, not 'mid'"),
    (["--stream", "9", "--quant", "card", "--shape", "tiny"], "--stream 9: the model has 4 layers (allowed: 1..4)"),
    (["--stream", "41", "--quant", "card", "--shape", "clover-35b-a3b", "--count"], "the model has 40 layers"),
])
def test_bench_speed_refuses_placing_flags_before_building_a_model(argv: list[str], says: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A wrong combination of the placing flags is one line, exit 2, and no model is built first (the 35B shape's
    random model takes minutes to build)."""
    code = cli.main(["bench", "speed", *argv])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.count("\n") == 1 and says in err, err
    assert "model built" not in out and "built" not in err, out
