"""Clover Desk: the application (entry points, chat storage, engine process) wiring its engine and ui together.

One installed import name: the repository's top-level ``engine/``, ``ui/`` and ``assets/`` folders are this package's
``clover_desk.engine``, ``clover_desk.ui`` and ``clover_desk.assets`` (pyproject.toml's ``package-dir``), in a wheel
and in an editable install (``pip install -e .``, what ``make`` does) alike.
"""

from __future__ import annotations

__version__ = "0.1.0"
