"""Every numeric flag refuses values outside its range with one line naming the flag and what is allowed (exit 2),
before any work starts (no model is read: the folder below does not exist)."""

from __future__ import annotations

import pytest

from clover_desk import cli

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
                                         ("--seed", str(2**63 - 1)), ("--threshold", "0.95"), ("--vram-gb", "0.5")])
def test_edge_values_are_accepted(flag: str, value: str) -> None:
    args = cli.parse_args([*GENERATE, flag, value])
    assert getattr(args, flag.lstrip("-").replace("-", "_")) == pytest.approx(float(value))
