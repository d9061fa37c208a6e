"""One table of generation-parameter ranges (engine.decode.limits.GENERATION_LIMITS): the CLI's flags, the worker's
command checks (in process and through the real worker process), generation_config.json's validation and
``Engine.generate``'s own check refuse the same values and accept the same values.

The values are derived from the table (just outside each end, inside the gap, the wrong type), so a range that
drifts in one place but not the others fails here."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from worker_proc import FAKE, WorkerProc

from clover_desk.cli import main as cli
from clover_desk.engine.decode.events import MODES, GenerationParams
from clover_desk.engine.decode.limits import GENERATION_LIMITS, Limit, check_generation_params
from clover_desk.engine.errors import ConfigError, PromptError
from clover_desk.engine.model.config import load_generation_defaults
from clover_desk.worker.protocol import PARAM_FIELDS, ProtocolError, _param_field, check_params

REQUEST_FIELDS = [f.name for f in dataclasses.fields(GenerationParams) if f.name in GENERATION_LIMITS]
GENERATE = ["generate", "--model", "/nonexistent", "--prompt", "hi"]


def outside(limit: Limit) -> list[object]:
    """Values each end of ``limit`` refuses, and the wrong types."""
    if limit.kind == "int":
        return [int(limit.lo) - 1, int(limit.hi) + 1, 1.5, "7", True, [1]]
    step = max(abs(limit.hi), 1.0) * 1e-6
    values: list[object] = [limit.lo - step, limit.hi + step, limit.hi * 10 + 1, math.nan, math.inf, "0.5", True]
    if limit.lo_open:
        values.append(limit.lo)
    if limit.gap_to:
        values += [limit.gap_to / 2, 1e-300]
    return values


def inside(limit: Limit) -> list[int | float]:
    ends = [limit.hi] + ([] if limit.lo_open else [limit.lo]) + ([limit.gap_to] if limit.gap_to else [])
    middle = (limit.lo + limit.hi) / 2
    return [int(v) for v in [*ends, middle]] if limit.kind == "int" else [float(v) for v in [*ends, middle]]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _cli_text(value: object) -> str:
    return repr(value) if isinstance(value, float) and math.isfinite(value) else str(value)


OUTSIDE = [(name, value) for name in REQUEST_FIELDS for value in outside(GENERATION_LIMITS[name])]
INSIDE = [(name, value) for name in REQUEST_FIELDS for value in inside(GENERATION_LIMITS[name])]
NUMBERS = [(n, v) for n, v in OUTSIDE if not isinstance(v, (str, bool, list))]  # what a command line can say


def test_the_table_covers_every_numeric_request_parameter() -> None:
    """(and each has a ``generate`` flag: the accept test below gives every one on the command line)"""
    numeric = {f.name for f in dataclasses.fields(GenerationParams)} - {"mode", "do_sample", "enable_thinking",
                                                                       "continue_final_message", "structured"}
    assert set(REQUEST_FIELDS) == numeric


@pytest.mark.parametrize("name, value", NUMBERS, ids=[f"{n}={v!r}" for n, v in NUMBERS])
def test_cli_refuses_what_the_table_refuses(name: str, value: object, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args([*GENERATE, f"{_flag(name)}={_cli_text(value)}"])  # "=": argparse takes -1e-06 for a flag
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"argument {_flag(name)}: must be {GENERATION_LIMITS[name].allowed}, got" in err and err.count("\n") == 1


@pytest.mark.parametrize("name, value", OUTSIDE, ids=[f"{n}={v!r}" for n, v in OUTSIDE])
def test_worker_config_and_engine_refuse_what_the_table_refuses(name: str, value: object, tmp_path: Path) -> None:
    allowed = GENERATION_LIMITS[name].allowed
    with pytest.raises(ProtocolError) as err:
        check_params({name: value})
    assert f"field '{name}' must be {allowed}" in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "generation_config.json").write_text(json.dumps({name: value}))
    with pytest.raises(ConfigError) as err:
        load_generation_defaults(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'generation_config.json'}: field '{name}' must be {allowed}, got")
    with pytest.raises(PromptError) as err:
        check_generation_params(dataclasses.replace(GenerationParams(), **{name: value}))
    assert f"generation parameter {name} must be {allowed}" in str(err.value)


@pytest.mark.parametrize("name, value", INSIDE, ids=[f"{n}={v!r}" for n, v in INSIDE])
def test_every_place_accepts_what_the_table_accepts(name: str, value: int | float, tmp_path: Path) -> None:
    args = cli.parse_args([*GENERATE, _flag(name), _cli_text(value)])
    assert getattr(args, name) == value
    assert getattr(check_params({name: value}), name) == value
    (tmp_path / "generation_config.json").write_text(json.dumps({name: value}))
    load_generation_defaults(tmp_path)
    check_generation_params(GenerationParams(**{name: value}))
    assert PARAM_FIELDS[name][1] == f"{GENERATION_LIMITS[name].allowed}, or null"


def test_the_worker_process_refuses_the_same_values() -> None:
    """Every out-of-range value through the real worker process: one ProtocolError each, naming the field and the
    allowed range, and the worker still serves afterwards."""
    w = WorkerProc(*FAKE)
    try:
        w.expect_event("ready")
        w.send(cmd="load", model_dir="/models/fake")
        w.expect_event("loaded")
        for i, (name, value) in enumerate(OUTSIDE):
            params = {name: value}  # NaN and inf travel as the NaN / Infinity literals Python's json reads
            w.send(cmd="generate", id=f"r{i}", messages=[{"role": "user", "content": "hi"}], params=params)
            answer = w.expect(lambda r, i=i: r.get("id") == f"r{i}")
            assert answer["event"] == "error" and answer["kind"] == "ProtocolError", (params, answer)
            assert f"'{name}' must be {GENERATION_LIMITS[name].allowed}" in answer["message"]
        w.send(cmd="generate", id="ok", messages=[{"role": "user", "content": "hi"}], params={"temperature": 100})
        assert w.expect(lambda r: r.get("id") == "ok" and r["event"] in ("finished", "error"))["event"] == "finished"
    finally:
        w.close()


def test_the_wire_schema_is_made_from_generation_params() -> None:
    """The worker's checks of ``params`` are generated from GenerationParams' fields: the numeric ones from the
    table, the mode from clover_desk.engine.decode.events.MODES (the CLI's --mode choices too), the flags by their default; a
    field with no rule is refused when the table is built, not left unchecked."""
    assert list(PARAM_FIELDS) == [f.name for f in dataclasses.fields(GenerationParams)]
    assert PARAM_FIELDS["mode"][1] == '"diffusion", "ar" or "spec"' and MODES == ("diffusion", "ar", "spec")
    assert all(PARAM_FIELDS["mode"][0](m) for m in MODES) and not PARAM_FIELDS["mode"][0]("fast")
    assert PARAM_FIELDS["do_sample"][1] == "true, false or null" and PARAM_FIELDS["enable_thinking"][1] == "true or false"
    assert cli.parse_args(GENERATE).mode == "diffusion"
    odd = dataclasses.make_dataclass("Odd", [("style", str, "plain")])
    with pytest.raises(TypeError, match="GenerationParams.style: no wire check"):
        _param_field(dataclasses.fields(odd)[0])
