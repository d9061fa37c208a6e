"""``clover-desk plan``: the JSON contract through the installed entry point, the table, and the exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clover_desk.cli import main as cli
from clover_desk.engine.placement.planner import GiB, manifest_for_shape
from tests.plan_contract import BREAKDOWN_KEYS, CONTRACT_KEYS

ENTRY = Path(sys.executable).with_name("clover-desk")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    if not ENTRY.exists():
        pytest.skip(f"{ENTRY} is not installed (pip install -e .)")
    return subprocess.run([str(ENTRY), *args], capture_output=True, text=True, timeout=120)


def test_json_contract_through_the_entry_point() -> None:
    out = _run("plan", "--shape", "clover-35b-a3b", "--vram-gb", "16", "--ram-gb", "64", "--json")  # not this machine's free RAM
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert CONTRACT_KEYS <= set(plan)
    assert plan["fits"] is True and plan["reason"] == ""
    assert set(plan["vram_breakdown"]) == BREAKDOWN_KEYS
    assert plan["vram_used_bytes"] == sum(plan["vram_breakdown"].values()) <= 16 * GiB
    assert sorted(plan["resident_expert_layers"] + plan["streamed_expert_layers"]) == list(range(40))
    assert plan["vram_breakdown"]["kv_cache"] == 20_480 * 16_384  # default --ctx 16384
    assert plan["predicted_tok_s"]["ar"] > 0 and plan["predicted_tok_s"]["diffusion"] > 0
    assert plan["min_vram_bytes"] < 16 * GiB


def test_does_not_fit_exits_3_with_the_minimum() -> None:
    out = _run("plan", "--shape", "clover-35b-a3b", "--vram-gb", "2", "--json")
    assert out.returncode == 3, out.stderr
    plan = json.loads(out.stdout)
    assert plan["fits"] is False and "VRAM" in plan["reason"]
    assert plan["min_vram_bytes"] > 2 * GiB


def test_missing_model_folder_exits_2_without_a_traceback(tmp_path: Path) -> None:
    out = _run("plan", "--model", str(tmp_path / "nope"), "--vram-gb", "16")
    assert out.returncode == 2
    assert "nope" in out.stderr and "no such file or folder" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def test_human_table(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["plan", "--shape", "clover-35b-a3b", "--vram-gb", "12", "--ctx", "8192", "--ram-gb", "64"])
    text = capsys.readouterr().out
    assert rc == 0
    for label in ("non-expert weights", "resident experts", "expert slot pool", "KV cache", "GDN state", "workspace", "reserve", "total"):
        assert label in text, label
    assert "MiB" in text and "GiB" in text
    assert "context 8,192 tokens" in text
    assert "layers resident" in text and "layers streamed" in text
    assert "RAM needed" in text and "tok/s" in text
    assert "Fits." in text and "Smallest budget that fits" in text


def test_table_for_a_refusal_names_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["plan", "--shape", "clover-35b-a3b", "--vram-gb", "16", "--ram-gb", "2"])
    text = capsys.readouterr().out
    assert rc == 3
    assert "Does not fit: RAM" in text and "of 2.00 GiB given" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--vram-gb", "-1"], "argument --vram-gb: must be a finite number of GiB > 0"),
        (["--vram-gb", "1e300"], "argument --vram-gb: must be a finite number of GiB > 0 and <= 65536, got '1e300'"),
        (["--vram-gb", "16", "--ctx", "0"], "argument --ctx: must be a whole number of tokens from 1"),
        (["--vram-gb", "16", "--ram-gb", "nan"], "argument --ram-gb: must be a finite number of GiB"),
        (["--vram-gb", "inf"], "argument --vram-gb: must be a finite number"),
    ],
)
def test_bad_numbers_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "--shape", "clover-35b-a3b", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.count("\n") == 1, err


def test_model_from_a_quantized_cache_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = manifest_for_shape("clover-35b-a3b")
    data = {
        "version": 1,
        "policy": {},
        "source": {},
        "tensors": {e.name: {"shape": list(e.shape), "format": e.format, "bytes": e.bytes} for e in manifest},
    }
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    rc = cli.main(["plan", "--model", str(tmp_path), "--vram-gb", "16", "--json"])
    from_cache = json.loads(capsys.readouterr().out)
    rc_shape = cli.main(["plan", "--shape", "clover-35b-a3b", "--vram-gb", "16", "--json"])
    from_shape = json.loads(capsys.readouterr().out)
    assert rc == rc_shape == 0
    assert from_cache["vram_breakdown"] == from_shape["vram_breakdown"]
    assert from_cache["resident_expert_layers"] == from_shape["resident_expert_layers"]


def test_malformed_manifest_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "manifest.json"
    path.write_text("{not json")
    rc = cli.main(["plan", "--model", str(path), "--vram-gb", "16"])
    assert rc == 2 and "not valid JSON" in capsys.readouterr().err


def test_checkpoint_folder_is_planned_quantized_unless_as_stored(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.engine.test_planner import write_tiny_checkpoint

    folder, _ = write_tiny_checkpoint(tmp_path)
    rc = cli.main(["plan", "--model", str(folder), "--vram-gb", "4", "--ctx", "256", "--json"])
    quantized = json.loads(capsys.readouterr().out)
    rc_stored = cli.main(["plan", "--model", str(folder), "--vram-gb", "4", "--ctx", "256", "--json", "--as-stored"])
    stored = json.loads(capsys.readouterr().out)
    assert rc == rc_stored == 0
    assert quantized["vram_breakdown"]["resident_experts"] * 3 < stored["vram_breakdown"]["resident_experts"]


def test_the_readme_table_is_what_the_planner_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """README's per-card table is `plan --shape clover-35b-a3b --budget-table`, verbatim."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    start, end = readme.index("<!-- budget-table -->\n"), readme.index("<!-- /budget-table -->")
    assert cli.main(["plan", "--shape", "clover-35b-a3b", "--budget-table"]) == 0
    printed = capsys.readouterr().out
    assert len(printed.splitlines()) == 6  # the header, its rule and the four cards
    assert readme[start + len("<!-- budget-table -->\n") : end] == printed


def test_the_budget_table_needs_a_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--model", "x", "--budget-table"]) == 2
    assert "--budget-table needs --shape" in capsys.readouterr().err
