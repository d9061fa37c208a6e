"""``clover-desk models`` and ``--model NAME``: the models the window knows (its recent models, the app's models
folder, the one it loads now), by name, in generate / chat / serve; an unknown name is one line with the close
matches and exit status 2. A real app-data folder (``CLOVER_DESK_HOME``) and a real tiny model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fixtures_tiny import one_torch_thread, tiny_clover_dir  # noqa: F401

from clover_desk import paths
from clover_desk.cli import main as cli
from clover_desk.cli.models import known_models


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_clover_dir: Path) -> Path:
    """An app-data folder as the window leaves it: a model in models/, a recent GGUF elsewhere, the current one."""
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    shutil.copytree(tiny_clover_dir, home / "models" / "clover-tiny")
    (home / "models" / "not-a-model").mkdir()  # no config.json: not listed
    elsewhere = tmp_path / "downloads"
    elsewhere.mkdir()
    gguf = elsewhere / "Clover-35B-A3B-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    gone = str(tmp_path / "deleted-model")
    (home / "recent_models.json").write_text(json.dumps([str(gguf), gone]), encoding="utf-8")
    (home / paths.SETTINGS_NAME).write_text(json.dumps({"model_dir": str(home / "models" / "clover-tiny")}),
                                            encoding="utf-8")
    monkeypatch.setenv(paths.HOME_ENV, str(home))
    return home


def test_models_lists_what_the_window_knows(capsys, home: Path) -> None:
    code, out, err = run_cli(capsys, "models")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert len(lines) == 2  # the recent GGUF first (the models page's order), then the models folder; no gone one
    assert "Clover-35B-A3B-Q4_K_M" in lines[0] and "gguf" in lines[0] and not lines[0].startswith("*")
    assert lines[1].startswith("* clover-tiny") and str(home / "models" / "clover-tiny") in lines[1]
    code, out, _ = run_cli(capsys, "models", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["name"], r["kind"], r["current"]) for r in rows] == [
        ("Clover-35B-A3B-Q4_K_M", "gguf", False), ("clover-tiny", "folder", True)]


def test_the_app_and_the_command_line_read_the_same_files(home: Path) -> None:
    from clover_desk import app
    from clover_desk.ui.model_paths import MODELS_DIR_NAME, RECENT_FILE_NAME

    assert app.SETTINGS_NAME == paths.SETTINGS_NAME
    source = Path(app.__file__).read_text(encoding="utf-8")
    assert "self.home / MODELS_DIR_NAME" in source and "self.home / RECENT_FILE_NAME" in source
    assert (MODELS_DIR_NAME, RECENT_FILE_NAME) == ("models", "recent_models.json")


def test_no_models_yet(capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path / "empty"))
    code, out, err = run_cli(capsys, "models")
    assert code == 0 and out == "" and "no models yet" in err
    assert known_models() == []


def test_generate_takes_a_name(capsys, home: Path, one_torch_thread: None) -> None:
    code, out, err = run_cli(capsys, "generate", "--model", "clover-tiny", "--prompt", "Hi", "--no-think",
                             "--max-new-tokens", "4", "--block-size", "8", "--json")
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["event"] == "finished"
    code, _, err = run_cli(capsys, "generate", "--model", "CLOVER-TINY", "--prompt", "Hi", "--no-think",
                           "--max-new-tokens", "2", "--block-size", "8")
    assert code == 0, err  # case does not matter when only one model matches


@pytest.mark.parametrize("command", [["generate", "--prompt", "Hi"], ["chat"], ["serve", "--port", "0"]])
def test_an_unknown_name_is_one_line_with_close_matches(capsys, home: Path, command: list[str]) -> None:
    code, out, err = run_cli(capsys, command[0], "--model", "clover-tin", *command[1:])
    assert code == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.count("error:") == 1
    assert "--model clover-tin" in err and "close matches: clover-tiny" in err and "clover-desk models" in err
    code, _, err = run_cli(capsys, command[0], "--model", "zzzz", *command[1:])
    assert code == 2 and "known: Clover-35B-A3B-Q4_K_M, clover-tiny" in err


def test_two_models_of_one_name_need_a_path(capsys, home: Path, tmp_path: Path) -> None:
    other = tmp_path / "other" / "clover-tiny"
    other.mkdir(parents=True)
    (other / "config.json").write_text("{}", encoding="utf-8")
    recent = json.loads((home / "recent_models.json").read_text(encoding="utf-8"))
    (home / "recent_models.json").write_text(json.dumps([str(other), *recent]), encoding="utf-8")
    code, _, err = run_cli(capsys, "generate", "--model", "clover-tiny", "--prompt", "Hi")
    assert code == 2 and "2 models have that name" in err and str(other) in err


def test_a_path_is_still_a_path(capsys, home: Path, tmp_path: Path) -> None:
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "Hi")
    assert code == 2 and "no model of that name" not in err  # the loader's own message for a missing folder
