"""Which shared libraries Qt's X11 platform plugin (and QtWebEngine) need and this machine lacks, found before Qt
starts.

Without one of the xcb plugin's Qt aborts the process (SIGABRT, "could not load the Qt platform plugin xcb") before
Python can say anything, and without one of QtWebEngine's the window's first import fails with a traceback naming a
file, not a package. So ``clover-desk gui`` reads the plugin's ELF dynamic section (``DT_NEEDED``, ``DT_RUNPATH``/
``DT_RPATH``) itself, follows every needed library the way the dynamic loader looks for it (``LD_LIBRARY_PATH``, the
object's run path with ``$ORIGIN``, the folders of ``/etc/ld.so.conf``, the default folders), and names each library
it cannot find with the Debian package that ships it (:data:`DEBIAN_PACKAGES`). Nothing is loaded or executed: a
missing library cannot abort the check. Stdlib only.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import struct
from dataclasses import dataclass
from pathlib import Path

# soname -> the Debian 12 package that ships it: every library outside PySide6 that libqxcb.so and PySide6's
# QtWebEngine modules load, directly or through Qt's own libraries (checked with dpkg -S / apt-file search on
# Debian 12, PySide6 6.12).
DEBIAN_PACKAGES = {
    "libXcomposite.so.1": "libxcomposite1",
    "libXdamage.so.1": "libxdamage1",
    "libXext.so.6": "libxext6",
    "libXfixes.so.3": "libxfixes3",
    "libXrandr.so.2": "libxrandr2",
    "libXrender.so.1": "libxrender1",
    "libXtst.so.6": "libxtst6",
    "libasound.so.2": "libasound2",
    "libcap.so.2": "libcap2",
    "libcom_err.so.2": "libcom-err2",
    "libdrm.so.2": "libdrm2",
    "libffi.so.8": "libffi8",
    "libgbm.so.1": "libgbm1",
    "libgssapi_krb5.so.2": "libgssapi-krb5-2",
    "libk5crypto.so.3": "libk5crypto3",
    "libkeyutils.so.1": "libkeyutils1",
    "libkrb5.so.3": "libkrb5-3",
    "libkrb5support.so.0": "libkrb5support0",
    "libnspr4.so": "libnspr4",
    "libnss3.so": "libnss3",
    "libnssutil3.so": "libnss3",
    "libplc4.so": "libnspr4",
    "libplds4.so": "libnspr4",
    "libsmime3.so": "libnss3",
    "libudev.so.1": "libudev1",
    "libwayland-server.so.0": "libwayland-server0",
    "libEGL.so.1": "libegl1",
    "libGL.so.1": "libgl1",
    "libGLX.so.0": "libglx0",
    "libGLdispatch.so.0": "libglvnd0",
    "libOpenGL.so.0": "libopengl0",
    "libX11-xcb.so.1": "libx11-xcb1",
    "libX11.so.6": "libx11-6",
    "libXau.so.6": "libxau6",
    "libXdmcp.so.6": "libxdmcp6",
    "libbrotlicommon.so.1": "libbrotli1",
    "libbrotlidec.so.1": "libbrotli1",
    "libbsd.so.0": "libbsd0",
    "libdbus-1.so.3": "libdbus-1-3",
    "libexpat.so.1": "libexpat1",
    "libfontconfig.so.1": "libfontconfig1",
    "libfreetype.so.6": "libfreetype6",
    "libglib-2.0.so.0": "libglib2.0-0",
    "libgthread-2.0.so.0": "libglib2.0-0",
    "libpcre2-8.so.0": "libpcre2-8-0",
    "libpng16.so.16": "libpng16-16",
    "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-image.so.0": "libxcb-image0",
    "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-randr.so.0": "libxcb-randr0",
    "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-render.so.0": "libxcb-render0",
    "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-shm.so.0": "libxcb-shm0",
    "libxcb-sync.so.1": "libxcb-sync1",
    "libxcb-util.so.1": "libxcb-util1",
    "libxcb-xfixes.so.0": "libxcb-xfixes0",
    "libxcb-xkb.so.1": "libxcb-xkb1",
    "libxcb.so.1": "libxcb1",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libxkbcommon.so.0": "libxkbcommon0",
    "libxkbfile.so.1": "libxkbfile1",
    "libz.so.1": "zlib1g",
    "libzstd.so.1": "libzstd1",
}

DEFAULT_DIRS = ("/lib64", "/usr/lib64", "/lib", "/usr/lib")
_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_RPATH, _DT_RUNPATH = 0, 1, 5, 15, 29


class NotELF(ValueError):
    """The file is not an ELF shared object this parser reads."""


@dataclass(frozen=True)
class ElfDeps:
    """What one ELF object asks the loader for: its needed sonames, its run path, and its kind (class, byte order,
    machine), which a candidate library must share to be loaded beside it."""

    needed: tuple[str, ...]
    runpath: tuple[str, ...]  # DT_RUNPATH, or DT_RPATH when there is no DT_RUNPATH; $ORIGIN not expanded
    kind: tuple[int, int, int]


def read_elf_deps(path: Path) -> ElfDeps:
    """The dynamic section of the ELF file ``path`` (NotELF when it is not one)."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] not in (1, 2) or data[5] not in (1, 2):
        raise NotELF(f"{path}: not an ELF file")
    wide, order = data[4] == 2, "<" if data[5] == 1 else ">"
    try:
        (machine,) = struct.unpack_from(order + "H", data, 18)
        if wide:
            phoff, phentsize, phnum = (struct.unpack_from(order + "Q", data, 0x20)[0],
                                       *struct.unpack_from(order + "HH", data, 0x36))
        else:
            phoff, phentsize, phnum = (struct.unpack_from(order + "I", data, 0x1C)[0],
                                       *struct.unpack_from(order + "HH", data, 0x2A))
        loads, dynamic = [], None
        for i in range(phnum):
            if wide:
                p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = struct.unpack_from(order + "IIQQQQQQ", data,
                                                                                      phoff + i * phentsize)
            else:
                p_type, p_offset, p_vaddr, _, p_filesz, _, _, _ = struct.unpack_from(order + "IIIIIIII", data,
                                                                                      phoff + i * phentsize)
            if p_type == _PT_LOAD:
                loads.append((p_vaddr, p_offset, p_filesz))
            elif p_type == _PT_DYNAMIC:
                dynamic = (p_offset, p_filesz)
        entries = _dynamic_entries(data, order, wide, dynamic) if dynamic else []
    except struct.error as exc:
        raise NotELF(f"{path}: truncated ELF headers") from exc
    strtab = next((value for tag, value in entries if tag == _DT_STRTAB), None)
    if strtab is None:
        return ElfDeps((), (), (data[4], data[5], machine))
    base = next((off + strtab - vaddr for vaddr, off, size in loads if vaddr <= strtab < vaddr + size), None)
    if base is None:
        raise NotELF(f"{path}: its string table is outside every loaded segment")

    def text(offset: int) -> str:
        end = data.index(b"\0", base + offset)
        return data[base + offset:end].decode("utf-8", "replace")

    needed = tuple(text(value) for tag, value in entries if tag == _DT_NEEDED)
    runpath = [text(value) for tag, value in entries if tag == _DT_RUNPATH]
    if not runpath:
        runpath = [text(value) for tag, value in entries if tag == _DT_RPATH]
    dirs = tuple(d for entry in runpath for d in entry.split(":") if d)
    return ElfDeps(needed, dirs, (data[4], data[5], machine))


def _dynamic_entries(data: bytes, order: str, wide: bool, dynamic: tuple[int, int]) -> list[tuple[int, int]]:
    offset, size = dynamic
    fmt = order + ("qQ" if wide else "iI")
    step = struct.calcsize(fmt)
    entries = []
    for at in range(offset, offset + size - step + 1, step):
        tag, value = struct.unpack_from(fmt, data, at)
        if tag == _DT_NULL:
            break
        entries.append((tag, value))
    return entries


def ld_so_conf_dirs(conf: Path = Path("/etc/ld.so.conf")) -> list[str]:
    """The folders ``ldconfig`` caches, from ``/etc/ld.so.conf`` and its ``include`` lines (recursively)."""
    dirs: list[str] = []
    seen: set[Path] = set()

    def read(path: Path) -> None:
        if path in seen:
            return
        seen.add(path)
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            return
        for line in lines:
            line = line.split("#", 1)[0].strip()
            if line.startswith("include"):
                pattern = line[len("include"):].strip()
                pattern = pattern if os.path.isabs(pattern) else str(path.parent / pattern)
                for included in sorted(glob.glob(pattern)):
                    read(Path(included))
            elif line:
                dirs.append(line)

    read(conf)
    return dirs


def missing_libraries(objects: "list[Path] | Path", env: dict[str, str], system_dirs: list[str]) -> list[str]:
    """The sonames that ``objects`` need, directly or through the libraries they load, and that the loader would not
    find (in the order met). ``system_dirs``: the loader's folders after the run paths (ld.so.conf's, the defaults)."""
    objects = [Path(objects)] if isinstance(objects, (str, Path)) else [Path(o) for o in objects]
    queue: list[tuple[Path, ElfDeps]] = [(path, read_elf_deps(path)) for path in objects]
    kind = queue[0][1].kind if queue else (0, 0, 0)
    env_dirs = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
    found: dict[str, Path | None] = {}
    while queue:
        path, deps = queue.pop(0)
        origin = str(path.resolve().parent)
        runpath = [d.replace("${ORIGIN}", origin).replace("$ORIGIN", origin) for d in deps.runpath]
        for soname in deps.needed:
            if soname in found:
                continue
            hit = _find(soname, [*env_dirs, *runpath, *system_dirs], kind)
            found[soname] = hit[0] if hit else None
            if hit:
                queue.append(hit)
    return [soname for soname, where in found.items() if where is None]


def _find(soname: str, dirs: list[str], kind: tuple[int, int, int]) -> tuple[Path, ElfDeps] | None:
    if "/" in soname:
        dirs, soname = [os.path.dirname(soname)], os.path.basename(soname)
    for folder in dirs:
        candidate = Path(folder) / soname
        if not candidate.is_file():
            continue
        try:
            deps = read_elf_deps(candidate)
        except (OSError, NotELF):
            continue
        if deps.kind == kind:  # the loader skips a library of another class or machine
            return candidate, deps
    return None


def _pyside_dirs() -> list[Path]:
    spec = importlib.util.find_spec("PySide6")
    return [Path(loc) for loc in (spec.submodule_search_locations or [])] if spec is not None else []


def xcb_plugin(env: dict[str, str]) -> Path | None:
    """PySide6's ``libqxcb.so`` (QT_PLUGIN_PATH's first, as Qt looks there first), or None when there is none."""
    roots = [d for d in env.get("QT_PLUGIN_PATH", "").split(os.pathsep) if d]
    roots += [str(folder / "Qt" / "plugins") for folder in _pyside_dirs()]
    for root in roots:
        candidate = Path(root) / "platforms" / "libqxcb.so"
        if candidate.is_file():
            return candidate
    return None


def webengine_modules() -> list[Path]:
    """PySide6's QtWebEngine extension modules (the preview's imports), none when PySide6 has no QtWebEngine."""
    return [module for folder in _pyside_dirs() for name in ("QtWebEngineCore", "QtWebEngineWidgets")
            for module in sorted(folder.glob(f"{name}.*so"))[:1]]


def problem_line(what: str, objects: list[Path], env: dict[str, str], system_dirs: list[str] | None = None) -> str | None:
    """One line naming every library ``objects`` lack here, each with its Debian package, and the apt command;
    None when nothing is missing or nothing could be read (nothing to tell)."""
    if not objects:
        return None
    dirs = system_dirs if system_dirs is not None else [*ld_so_conf_dirs(), *DEFAULT_DIRS]
    try:
        missing = missing_libraries(objects, env, dirs)
    except (OSError, NotELF):
        return None
    if not missing:
        return None
    packages = list(dict.fromkeys(DEBIAN_PACKAGES[s] for s in missing if s in DEBIAN_PACKAGES))
    named = ", ".join(f"{s} ({DEBIAN_PACKAGES.get(s, 'package unknown: apt-file search ' + s)})" for s in missing)
    install = f"; Debian/Ubuntu: sudo apt install {' '.join(packages)}" if packages else ""
    return f"{what} needs {named}, not installed{install}"


def xcb_problem(env: dict[str, str], plugin: Path | None = None, system_dirs: list[str] | None = None) -> str | None:
    """What Qt's X11 plugin lacks here (:func:`problem_line`); None when nothing or the plugin is not found."""
    plugin = plugin if plugin is not None else xcb_plugin(env)
    if plugin is None:
        return None
    return problem_line(f"Qt's X11 platform plugin {plugin}", [plugin], env, system_dirs)


def webengine_problem(env: dict[str, str], modules: list[Path] | None = None,
                      system_dirs: list[str] | None = None) -> str | None:
    """What QtWebEngine (the window imports it for the preview, on every platform plugin) lacks here."""
    modules = modules if modules is not None else webengine_modules()
    return problem_line("QtWebEngine (the HTML preview)", modules, env, system_dirs)
