"""The import rule: engine/ never imports Qt, ui/ never imports torch.

Each side is imported in a fresh interpreter and ``sys.modules`` is inspected, so a transitive import is caught too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules_of(package: str) -> list[str]:
    names = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


def _loaded_after_import(modules: list[str]) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_ui_never_imports_torch() -> None:
    modules = _modules_of("ui")
    assert "ui" in modules
    loaded = _loaded_after_import(modules)
    assert "PySide6" in loaded or len(modules) == 1  # the check ran against real Qt code once ui has widgets
    assert not any(m == "torch" or m.startswith("torch.") for m in loaded), "ui/ pulled in torch"


def test_engine_never_imports_qt() -> None:
    modules = _modules_of("engine")
    loaded = _loaded_after_import(modules)
    assert "engine.config" in loaded
    assert not any(m == "PySide6" or m.startswith("PySide6.") for m in loaded), "engine/ pulled in PySide6"


def test_plain_data_modules_are_torch_free() -> None:
    """The UI sees the engine only through these modules, so they must not pull torch in either."""
    # the planner and the low-level tables it shares with the torch side (one header parser, dtype table, policy)
    plain = ["engine.events", "engine.errors", "engine.config", "engine.defaults", "engine.formats", "engine.manifest",
             "engine.speed", "engine.planner"]
    loaded = _loaded_after_import(plain)
    assert not any(m == "torch" or m.startswith("torch.") for m in loaded)


def test_ui_never_imports_clover_desk() -> None:
    """ui/ is handed its services (engine client, chat store, downloader) by clover_desk.app; it never reaches up."""
    loaded = _loaded_after_import(_modules_of("ui"))
    assert "ui.main_window" in loaded
    assert not any(m == "clover_desk" or m.startswith("clover_desk.") for m in loaded), sorted(
        m for m in loaded if m.startswith("clover_desk")
    )
