"""Clover Desk: the application (entry points, chat storage, engine process) wiring engine/ and ui/ together."""

from __future__ import annotations

import importlib.util
from pathlib import Path

__version__ = "0.1.0"

OWN_PACKAGES = ("engine", "ui")  # installed as top-level import names beside clover_desk (not renamed, see README)


def package_clash(names: tuple[str, ...] = OWN_PACKAGES) -> str | None:
    """None when ``engine`` and ``ui`` resolve to the packages installed beside this one, else one line naming the
    first that resolves elsewhere (another project's package of the same name earlier on the path, or none at all).

    Found without importing them (``importlib.util.find_spec``), so the check itself runs no foreign code."""
    home = Path(__file__).resolve().parent.parent  # the folder holding clover_desk/, engine/ and ui/
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError) as exc:  # a broken package of that name, or one without a spec
            return f"clover-desk: the module {name!r} cannot be located ({exc}); {_FIX}"
        found = _package_dir(spec)
        if found is None:
            return f"clover-desk: its {name!r} package is missing (expected {home / name}); {_FIX}"
        if found != home / name:
            return (f"clover-desk: the import name {name!r} resolves to {found}, another project's package, not Clover "
                    f"Desk's {home / name}; {_FIX}")
    return None


_FIX = "install Clover Desk with pipx (its own environment) or run the packaged app, see README 'Install'"


def _package_dir(spec: importlib.machinery.ModuleSpec | None) -> Path | None:
    if spec is None:
        return None
    if spec.origin and spec.has_location:  # a regular package: .../name/__init__.py (or .pyc, frozen)
        return Path(spec.origin).resolve().parent
    locations = list(spec.submodule_search_locations or ())  # a namespace package: a bare folder of that name
    return Path(locations[0]).resolve() if locations else None


_clash = package_clash()
if _clash is not None:
    raise ImportError(_clash)
