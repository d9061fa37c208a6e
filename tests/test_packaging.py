"""Packaging files (packaging/): desktop entry, AppStream metadata, icons, the PyInstaller spec and entry point, and
the Makefile's install stamps. The bundle itself is built and run by packaging/smoke_test.sh, not here (minutes)."""

from __future__ import annotations

import configparser
import importlib.util
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGING = ROOT / "packaging"
METAINFO = PACKAGING / "io.github.clover_desk.metainfo.xml"
DESKTOP = PACKAGING / "clover-desk.desktop"


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _desktop_entry() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read(DESKTOP, encoding="utf-8")
    return parser["Desktop Entry"]


def test_desktop_entry_metainfo_and_command_agree() -> None:
    entry = _desktop_entry()
    assert entry["Type"] == "Application" and entry["Exec"] == "clover-desk" and entry["Icon"] == "clover-desk"
    component = ET.parse(METAINFO).getroot()  # well-formed XML, or this raises
    assert component.tag == "component" and component.get("type") == "desktop-application"
    assert component.findtext("id") == "io.github.clover_desk"
    for tag in ("name", "summary", "metadata_license", "project_license", "description"):
        assert component.find(tag) is not None, f"metainfo lacks <{tag}>"
    assert component.findtext("launchable") == DESKTOP.name
    assert component.findtext("icon") == entry["Icon"]
    assert component.findtext("provides/binary") == entry["Exec"]


def test_metainfo_agrees_with_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    entry, component = _desktop_entry(), ET.parse(METAINFO).getroot()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert entry["Exec"] in project["scripts"] and component.findtext("project_license") == project["license"]
    assert component.find("releases/release").get("version") == project["version"]  # type: ignore[union-attr]


@pytest.mark.skipif(shutil.which("appstreamcli") is None, reason="appstreamcli is not installed")
def test_metainfo_passes_appstreamcli() -> None:
    result = subprocess.run(["appstreamcli", "validate", "--no-net", str(METAINFO)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_icons_exist_at_every_size(qapp: object) -> None:
    make_icons = _load(PACKAGING / "make_icons.py")
    assert make_icons.SIZES == (16, 32, 48, 64, 128, 256, 512)
    assert make_icons.check() == []
    assert make_icons.SVG.exists()


def test_spec_and_scripts_parse() -> None:
    compile((PACKAGING / "clover-desk.spec").read_text(encoding="utf-8"), "clover-desk.spec", "exec")
    for script in ("build.sh", "smoke_test.sh"):
        subprocess.run(["bash", "-n", str(PACKAGING / script)], check=True)


def _launcher(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(PACKAGING / "launcher.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_launcher_runs_clover_desk_modules_with_their_arguments() -> None:
    """The bundle's program is started as ``EXE -m clover_desk.worker.process`` by the window: -m must reach the module."""
    result = _launcher("-m", "clover_desk.cli.main", "bench")
    assert result.returncode == 2 and "name a suite: speed" in result.stderr  # cli's main saw argv ["bench"]
    result = _launcher("-m", "json.tool", "--help")
    assert result.returncode == 2 and "only Clover Desk's own modules" in result.stderr
    result = _launcher("bench")  # no -m: the clover-desk command line
    assert result.returncode == 2 and "name a suite" in result.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_run_installs_only_the_app_and_make_test_the_test_extra() -> None:
    def dry(target: str) -> str:
        return subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout

    run = dry("run")
    assert "pip install -q -e .\n" in run and "[test]" not in run and "[packaging]" not in run
    assert "pip install -q -e '.[test]'" in dry("test")
    assert "packaging/build.sh" in dry("package")


@pytest.mark.slow
def test_the_wheel_builds_quietly_with_all_its_data(tmp_path: Path) -> None:
    """``pip install -e .`` once flooded setuptools warnings ("Package 'clover_desk.assets.icons' is absent from the
    `packages` configuration"): every data folder is a listed package, and its files are in the wheel."""
    import zipfile

    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build",
                                                                "dist", "tests", "docs"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w",
                           str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    output = done.stdout + done.stderr
    assert "absent from" not in output and "_Warning" not in output, output[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"clover_desk/assets/style.qss", "clover_desk/assets/icons/clover-desk.svg",
            "clover_desk/engine/data/chat_template.jinja", "clover_desk/engine/kernels/csrc/quant_cpu.c",
            "clover_desk/ui/main_window.py", "clover_desk/engine/api.py"} <= names
    # one installed import name (issue 29): everything but the metadata lies under clover_desk/
    assert {name.split("/")[0] for name in names if ".dist-info/" not in name} == {"clover_desk"}
