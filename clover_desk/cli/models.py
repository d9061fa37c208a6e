"""``clover-desk models``: the models the window knows, by name; and ``--model NAME`` for generate / chat / serve.

The window knows a model once it was opened, downloaded or created there (the recent models, ``recent_models.json``
in the app-data folder), or when it sits in the app's models folder (``models/`` there): the list of its Models
page (``ui.model_paths.library_paths``), the model it loads now (``settings.json``) marked. A model's name is its
folder's name, or its GGUF file's name without ``.gguf``; ``--model`` takes such a name wherever it takes a path
(a path that exists always wins). An unknown name is one line naming the close matches, exit status 2.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from clover_desk import paths
from clover_desk.engine.errors import ConfigError
from clover_desk.ui.model_paths import MODELS_DIR_NAME, RECENT_FILE_NAME, library_paths, model_name, read_recent


@dataclass(frozen=True)
class KnownModel:
    name: str
    path: str
    kind: str  # "folder" | "gguf"
    current: bool  # the model the window loads


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object per model per line")


def known_models(home: Path | None = None) -> list[KnownModel]:
    """The models the window knows (its Models page's list, in its order), from the app-data folder ``home``."""
    home = paths.default_app_data_dir() if home is None else Path(home)
    current = _current_model(home / paths.SETTINGS_NAME)
    found = library_paths(home / MODELS_DIR_NAME, read_recent(home / RECENT_FILE_NAME))
    if current and Path(current).exists() and all(not _same(current, p) for p in found):
        found.insert(0, current)
    return [KnownModel(model_name(p), p, "gguf" if p.lower().endswith(".gguf") else "folder",
                       bool(current) and _same(current, p)) for p in found]


def resolve_model(value: str, flag: str = "--model", home: Path | None = None) -> str:
    """``value`` itself when it names a file or folder that exists (or looks like a path); else the path of the
    known model of that name (exact, then ignoring case). Raises ConfigError (one line: the close matches)."""
    if Path(value).expanduser().exists() or os.sep in value or (os.altsep and os.altsep in value) \
            or value.lower().endswith(".gguf") or value.startswith((".", "~")):
        return value
    models = known_models(home)
    for same in (lambda m: m.name == value, lambda m: m.name.lower() == value.lower()):
        hits = [m for m in models if same(m)]
        if len(hits) == 1:
            return hits[0].path
        if hits:
            raise ConfigError(f"{flag} {value}: {len(hits)} models have that name ({', '.join(m.path for m in hits)}); "
                              f"give the path")
    names = [m.name for m in models]
    close = difflib.get_close_matches(value, names, n=3, cutoff=0.5) or \
        [n for n in names if value.lower() in n.lower()][:3]
    if close:
        hint = f"close matches: {', '.join(close)}"
    elif names:
        hint = f"known: {', '.join(names[:8])}{' …' if len(names) > 8 else ''}"
    else:
        hint = "the window knows no models yet (open or download one there, or give a folder or .gguf path)"
    raise ConfigError(f"{flag} {value}: no such file or folder, and no model of that name; {hint} "
                      f"(clover-desk models lists them)")


def run(args: argparse.Namespace) -> int:
    models = known_models()
    if args.json:
        for m in models:
            print(json.dumps(asdict(m)))
        return 0
    if not models:
        print(f"no models yet: the window lists the models it opened and those in "
              f"{paths.default_app_data_dir() / MODELS_DIR_NAME}", file=sys.stderr)
        return 0
    width = max(len(m.name) for m in models)
    for m in models:
        print(f"{'*' if m.current else ' '} {m.name:<{width}}  {m.kind:<6}  {m.path}")
    return 0


def _current_model(settings: Path) -> str | None:
    try:
        value = json.loads(settings.read_text(encoding="utf-8")).get("model_dir")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def _same(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)
