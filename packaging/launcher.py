"""Entry point of the packaged app (PyInstaller, packaging/clover-desk.spec): ``clover-desk [COMMAND ...]``.

In the bundle ``sys.executable`` is this program, not a Python interpreter, yet the app starts its helpers as
``sys.executable -m MODULE ARGS`` (the engine worker ``clover_desk.worker.process``, the model manager's demo model
``clover_desk.cli.main make-tiny``, ``bench load``'s stages). So ``-m MODULE`` is honoured here for Clover Desk's own
modules (``clover_desk.*``, run as ``__main__``); any other first argument goes to the ``clover-desk`` command line.
"""

from __future__ import annotations

import runpy
import sys


def main(argv: list[str]) -> int:
    if argv[:1] == ["-m"]:
        module = argv[1] if len(argv) > 1 else ""
        if not (module == "clover_desk" or module.startswith("clover_desk.")):
            print(f"clover-desk: -m runs only Clover Desk's own modules (clover_desk.*), not {module!r}", file=sys.stderr)
            return 2
        sys.argv = [sys.argv[0], *argv[2:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)  # its own sys.exit(...) ends the process
        return 0
    from clover_desk.cli.main import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
