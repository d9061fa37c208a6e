"""The real engine on a tiny checkpoint whose compile hangs in the warm-up the way inductor's does, for the test of
Cancel during "Compile the layers" (tests/ui/test_compile_cancel.py).

Selected by the worker's ``--engine-factory tests.slow_compile_engine:load``. ``Engine.load`` as is; a compiled load
gets :func:`hanging_backend` as its ``torch.compile`` backend: the first pass of the warm-up calls it, and it starts a
helper process (as inductor starts its compile workers), writes that helper's pid to the file named by
:data:`HELPER_PID_ENV`, then sleeps :data:`COMPILE_S` without looking at any cancel flag (a pass being compiled cannot
be interrupted). A load without ``compile`` is the plain tiny engine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from clover_desk.engine.api import Engine

COMPILE_S = 600.0  # far longer than any test waits: only ending the worker stops it
HELPER_PID_ENV = "CLOVER_TEST_COMPILE_HELPER_PID_FILE"


def hanging_backend(graph_module: Any, example_inputs: list[Any]) -> Any:
    helper = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({COMPILE_S})"])
    pid_file = os.environ.get(HELPER_PID_ENV)
    if pid_file:
        part = Path(f"{pid_file}.part")  # whole or absent: the test reads the file as soon as it exists
        part.write_text(str(helper.pid), encoding="ascii")
        os.replace(part, pid_file)
    time.sleep(COMPILE_S)
    return graph_module.forward


def load(model_dir: str, *, compile: bool = False, **kwargs: Any) -> Engine:  # noqa: A002 - Engine.load's keyword
    if compile:
        kwargs["compile_backend"] = hanging_backend
    return Engine.load(model_dir, compile=compile, **kwargs)
