"""The import rule: engine/ never imports Qt, ui/ never imports torch.

Each side is imported in a fresh interpreter and ``sys.modules`` is inspected, so a transitive import is caught too.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# the one installed name: engine/ and ui/ are the subpackages clover_desk.engine and clover_desk.ui (pyproject.toml's
# package-dir), so a module's name is clover_desk.<path> for every folder but clover_desk/ itself
INSTALLED_AS = {"engine": "clover_desk.engine", "ui": "clover_desk.ui", "clover_desk": "clover_desk"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([INSTALLED_AS[parts[0]], *parts[1:]])


def _modules_of(package: str) -> list[str]:
    return [_module_name(path) for path in sorted((ROOT / package).rglob("*.py"))]


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
    assert "clover_desk.ui" in modules
    loaded = _loaded_after_import(modules)
    assert "PySide6" in loaded or len(modules) == 1  # the check ran against real Qt code once ui has widgets
    assert not any(m == "torch" or m.startswith("torch.") for m in loaded), "ui/ pulled in torch"


def test_engine_never_imports_qt() -> None:
    modules = _modules_of("engine")
    loaded = _loaded_after_import(modules)
    assert "clover_desk.engine.model.config" in loaded
    assert not any(m == "PySide6" or m.startswith("PySide6.") for m in loaded), "engine/ pulled in PySide6"


def test_plain_data_modules_are_torch_free() -> None:
    """The UI sees the engine only through these modules, so they must not pull torch in either."""
    # the planner and the low-level tables it shares with the torch side (one header parser, dtype table, policy)
    plain = ["clover_desk.engine.decode.events", "clover_desk.engine.errors", "clover_desk.engine.model.config", "clover_desk.engine.defaults", "clover_desk.engine.weights.formats", "clover_desk.engine.placement.manifest",
             "clover_desk.engine.placement.speed", "clover_desk.engine.placement.planner", "clover_desk.engine.settings"]
    loaded = _loaded_after_import(plain)
    assert not any(m == "torch" or m.startswith("torch.") for m in loaded)


def test_ui_never_imports_clover_desk() -> None:
    """ui/ is handed its services (engine client, chat store, downloader) by clover_desk.app; it never reaches up
    into the application side of clover_desk (the cli, worker, storage...)."""
    loaded = _loaded_after_import(_modules_of("ui"))
    assert "clover_desk.ui.main_window" in loaded
    # clover_desk itself is only the package both live in (its __init__ holds a version string)
    app = sorted(m for m in loaded if m.startswith("clover_desk.") and m.split(".")[1] not in ("ui", "engine"))
    assert app == []


# ---------------------------------------------------------------------------------------------------------------
# the import graph: no cycles, imports at the top, one name per module
# ---------------------------------------------------------------------------------------------------------------

PACKAGES = ("engine", "clover_desk", "ui")
# Triton programs: imported where a kernel is launched, since ``triton`` is an optional dependency (the test extra and
# CUDA installs have it, a plain CPU install does not)
OPTIONAL_BACKENDS = frozenset(
    {"clover_desk.engine.kernels.triton_copy_kernels", "clover_desk.engine.kernels.triton_linear_kernels", "clover_desk.engine.kernels.triton_moe_kernels"}
)
# command modules import their engine side when their command runs, so `clover-desk plan` never pays for torch and
# `--help` stays fast (the lazy registry in clover_desk.cli.main)
LAZY_MODULES = ("clover_desk.cli.", "clover_desk.bench.")


def _project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            modules[_module_name(path)] = path
    return modules


def _imports(modules: dict[str, Path]) -> list[tuple[str, str, int, bool]]:
    """(importer, imported project module, line, inside a function) for every import statement, at any depth
    (``if TYPE_CHECKING:`` blocks included: a cycle hidden there is still a cycle in the design)."""

    def resolve(name: str, attr: str | None = None) -> str | None:
        if attr and f"{name}.{attr}" in modules:
            return f"{name}.{attr}"
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found = []
    for module, path in modules.items():
        def visit(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                targets: list[str | None] = []
                if isinstance(child, ast.Import):
                    targets = [resolve(a.name) for a in child.names if a.name.split(".")[0] == "clover_desk"]
                elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                    if child.module.split(".")[0] == "clover_desk":
                        targets = [resolve(child.module, a.name) for a in child.names]
                found.extend((module, t, child.lineno, in_function) for t in targets if t and t != module)
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return found


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    """Imports anywhere in a module count (top level, functions, TYPE_CHECKING), except the optional Triton programs."""
    modules = _project_modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for importer, imported, _line, _local in _imports(modules):
        if imported not in OPTIONAL_BACKENDS:
            edges[importer].add(imported)
    assert "clover_desk.engine.placement.offload_runtime" in edges["clover_desk.engine.decode.loop_parts"]  # the graph is the real one
    assert _cycles(edges) == []


def test_project_imports_sit_at_the_top_of_their_module() -> None:
    """A function-level import of the project's own modules hides a cycle or a hidden cost; only the lazy command
    modules and the launches of the optional Triton programs keep them."""
    local = [
        f"{importer}:{line} imports {imported}"
        for importer, imported, line, in_function in _imports(_project_modules())
        if in_function and not importer.startswith(LAZY_MODULES) and imported not in OPTIONAL_BACKENDS
    ]
    assert local == []


def test_each_module_is_loaded_under_one_name() -> None:
    """Every module imported in one interpreter: no file of the project is loaded twice under two names, and none
    under the old top-level names ``engine`` / ``ui`` (the installed name is ``clover_desk`` alone)."""
    modules = sorted(_project_modules())
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "files = {}\n"
        "for name, mod in list(sys.modules.items()):\n"
        "    f = getattr(mod, '__file__', None)\n"
        "    if f and f.startswith(tuple(sys.argv[1:])): files.setdefault(f, []).append(name)\n"
        "twice = {f: n for f, n in files.items() if len(n) > 1}\n"
        "old = sorted(n for n in sys.modules if n.split('.')[0] in ('engine', 'ui'))\n"
        "print(json.dumps([twice, old]))\n"
    )
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    homes = [str(ROOT / package) + os.sep for package in PACKAGES]  # the project's files (not a venv inside ROOT)
    out = subprocess.run([sys.executable, "-c", code, *homes], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True)
    twice, old_names = json.loads(out.stdout.strip().splitlines()[-1])
    assert twice == {}
    assert old_names == []  # the top-level names engine and ui are never used (issue 29: one installed name)


def test_ruff_is_clean() -> None:
    """The lint the project keeps (pyproject.toml [tool.ruff]: pyflakes, pycodestyle errors, import sorting, bugbear,
    pyupgrade) finds nothing."""
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]


# the house rule (issue 29): no module over 800 lines, no class over 400, in engine/, clover_desk/ and ui/ alike
MAX_CLASS_LINES = 400
MAX_MODULE_LINES = 800
# Known exceptions, each being split by its own piece of issue 29 at the time of writing; a split that lands
# takes its line out (test_size_exceptions_are_still_needed fails until it does). A module listed here is
# excepted for its classes too.
SIZE_EXCEPTIONS = frozenset({
})
CLASS_SIZE_EXCEPTIONS: frozenset[str] = frozenset()  # "path:Class", as above


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    """(lines of each module, lines of each class from its ``class`` line to its last) by path relative to the
    repository, for every module of the three packages."""
    modules, classes = {}, {}
    for path in _project_modules().values():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8")
        modules[rel] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                classes[f"{rel}:{node.name}"] = node.end_lineno - node.lineno + 1
    return modules, classes


def _too_big(modules: dict[str, int], classes: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    big_modules = {m: n for m, n in modules.items() if n > MAX_MODULE_LINES and m not in SIZE_EXCEPTIONS}
    big_classes = {c: n for c, n in classes.items() if n > MAX_CLASS_LINES and c not in CLASS_SIZE_EXCEPTIONS
                   and c.split(":")[0] not in SIZE_EXCEPTIONS}
    return big_modules, big_classes


def test_the_size_check_sees_every_package() -> None:
    modules, classes = _sizes()
    assert {m.split("/")[0] for m in modules} == set(PACKAGES)
    assert classes["ui/main_window.py:MainWindow"] > 100 and classes["clover_desk/storage/store.py:ChatStore"] > 100
    # it would catch a module or class over the limit anywhere
    assert _too_big({"engine/x.py": MAX_MODULE_LINES + 1}, {"ui/y.py:Y": MAX_CLASS_LINES + 1}) == (
        {"engine/x.py": MAX_MODULE_LINES + 1}, {"ui/y.py:Y": MAX_CLASS_LINES + 1})


def test_classes_and_modules_stay_small() -> None:
    assert _too_big(*_sizes()) == ({}, {})


def test_size_exceptions_are_still_needed() -> None:
    """An exception whose module (or class) has come under the limit, or is gone, is taken off the list."""
    modules, classes = _sizes()
    stale = sorted(m for m in SIZE_EXCEPTIONS if modules.get(m, 0) <= MAX_MODULE_LINES)
    stale += sorted(c for c in CLASS_SIZE_EXCEPTIONS if classes.get(c, 0) <= MAX_CLASS_LINES)
    assert stale == []
