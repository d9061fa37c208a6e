"""Which models the app knows, without Qt (stdlib only): the recent ones and what sits in the models folder.

Shared by the models page (``ui.model_library``) and the command line (``clover-desk models``, ``--model NAME``),
so both list the same models in the same order. The files live in the app-data folder (``clover_desk.paths``):
``recent_models.json`` (a JSON list of paths, newest first, written by the model manager) and ``models/``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

RECENT_FILE_NAME = "recent_models.json"
MODELS_DIR_NAME = "models"


def library_paths(models_dir: Path, recent: Sequence[str]) -> list[str]:
    """The models to list: the recent ones still on disk first, then the folders and GGUF files in ``models_dir``
    (each once)."""
    found: list[str] = [p for p in recent if Path(p).exists()]
    if models_dir.is_dir():
        for child in sorted(models_dir.iterdir()):
            if child.name.startswith("."):
                continue
            if child.is_dir() and (child / "config.json").is_file():
                found.append(str(child))
            elif child.is_dir():
                found += [str(g) for g in sorted(child.glob("*.gguf")) if first_part(g)]
            elif child.suffix.lower() == ".gguf" and first_part(child):
                found.append(str(child))
    seen: set[str] = set()
    out = []
    for path in found:
        key = os.path.realpath(path)
        if key not in seen:
            seen.add(key)
            out.append(path)
    return out


def first_part(path: Path) -> bool:
    """A GGUF file that is whole or the first part of a split set (``-00001-of-0000N``)."""
    return "-of-" not in path.stem or "-00001-of-" in path.stem


def read_recent(path: Path) -> list[str]:
    """The recent models file's paths ([] when it is missing or unreadable)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable recent-models file %s: %s", path, exc)
        return []
    return [str(p) for p in data if isinstance(p, str)] if isinstance(data, list) else []


def model_name(path: str) -> str:
    """The name a model goes by: its folder's name, or its GGUF file's name without ``.gguf``."""
    p = Path(path)
    return p.stem if p.suffix.lower() == ".gguf" else p.name
