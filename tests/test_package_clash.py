"""Clover Desk installs the generic top-level import names ``engine`` and ``ui``. When another project's package of
that name comes first on the path, importing ``clover_desk`` fails at once with one line naming the clash, instead
of running (or half-running) the wrong code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clover_desk import package_clash

ROOT = Path(__file__).resolve().parents[1]


def test_this_checkout_has_no_clash() -> None:
    assert package_clash() is None


def _import_clover_desk_with(path_first: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path_first), str(ROOT)]))
    code = "import clover_desk.cli.main; print('imported')"
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)


@pytest.mark.parametrize("name", ["engine", "ui"])
def test_a_foreign_package_of_the_same_name_fails_loudly(name: str, tmp_path: Path) -> None:
    foreign = tmp_path / "site"
    (foreign / name).mkdir(parents=True)
    (foreign / name / "__init__.py").write_text("RAN = True  # another project's package\n")
    result = _import_clover_desk_with(foreign, tmp_path)
    assert result.returncode != 0 and "imported" not in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: clover-desk: the import name")
    assert f"{name!r} resolves to {(foreign / name).resolve()}" in last and "pipx" in last


def test_a_bare_folder_of_the_same_name_does_not_shadow_the_package(tmp_path: Path) -> None:
    """A folder named engine/ without __init__.py (a namespace portion) loses to the real package: no clash."""
    (tmp_path / "site" / "engine").mkdir(parents=True)
    result = _import_clover_desk_with(tmp_path / "site", tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "imported", result.stderr


def test_a_missing_package_is_named() -> None:
    message = package_clash(("clover_desk_no_such_package",))
    assert message is not None and "'clover_desk_no_such_package' package is missing" in message
