"""Cancel during "Compile the layers" falls back to the uncompiled model within seconds (issue 32).

The worker checks the cancel between passes, but a pass that inductor is compiling cannot be interrupted (30 s to
minutes): the window waited for it and ended in "No model". Now the window's EngineClient ends the compiling worker
(with the compile helpers it started) once the cancel goes unanswered for ``compile_cancel_grace_ms``, and loads the
same model uncompiled in a fresh worker. The real window, the real EngineClient and a real worker process on the tiny
checkpoint, whose compile hangs in the warm-up for ten minutes the way inductor's does (tests/slow_compile_engine.py:
a ``torch.compile`` backend that sleeps and has started a helper process, as inductor starts compile workers).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
from fixtures_tiny import tiny_clover_dir  # noqa: F401 (session fixture)
from slow_compile_engine import HELPER_PID_ENV

from clover_desk.engine.decode.events import Finished, GenerationParams
from clover_desk.qt_compat import guard_pyside_bool_refcounts
from clover_desk.ui.contracts import EngineState

guard_pyside_bool_refcounts()

START_MS = 120_000  # a worker importing torch and tracing the tiny model's first pass on two busy cores
GRACE_MS = 2000
# Cancel to the uncompiled model loaded: the grace, a fresh worker's start and a tiny model's load (27 s measured
# with the 2 cores at load average 12, where importing torch alone took up to 39 s); the compile hangs for 600 s
RELOAD_LIMIT_S = 120.0
END_SLACK_S = 5.0  # the compiling worker ends within the grace plus this (2.1 s measured)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_cancel_during_a_hanging_compile_loads_the_model_uncompiled_within_seconds(
    qtbot, tmp_path: Path, tiny_clover_dir: Path,  # noqa: ANN001, F811
) -> None:
    from clover_desk.app import AppSettings, CloverDeskApp
    from clover_desk.storage.store import ChatStore
    from clover_desk.worker.client import EngineClient

    home = tmp_path / "home"
    home.mkdir()
    store = ChatStore(home / "chats.db")
    kept = store.create_conversation("a chat from before")
    store.add_message(kept.id, "user", "hello from before the cancel")
    helper_pid_file = tmp_path / "compile-helper.pid"
    client = EngineClient(worker_args=["--engine-factory", "tests.slow_compile_engine:load"],
                          env={HELPER_PID_ENV: str(helper_pid_file), "OMP_NUM_THREADS": "1"},
                          compile_cancel_grace_ms=GRACE_MS)
    settings = AppSettings(model_dir=str(tiny_clover_dir), device="cpu", compile_layers=True)
    desk = CloverDeskApp(home, client=client, settings=settings, store=store, with_preview=False, start_engine=False)
    window = desk.window
    qtbot.addWidget(window)
    window.show()
    readies: list[int] = []
    client.ready.connect(lambda: readies.append(1))
    states: list[tuple[float, str]] = []
    client.stateChanged.connect(lambda state: states.append((time.monotonic(), state)))
    try:
        client.start()
        qtbot.waitUntil(helper_pid_file.exists, timeout=START_MS)  # the warm-up's first pass is being compiled
        compiling_worker, helper = client.pid, int(helper_pid_file.read_text(encoding="ascii"))
        assert compiling_worker and _running(compiling_worker) and _running(helper)
        assert window.load_banner.isVisible() and window.load_banner.label.text() == "Compiling the layers…"
        assert window.model_library.compile_choice.isChecked()

        clicked = time.monotonic()
        with qtbot.waitSignal(client.loaded, timeout=int(RELOAD_LIMIT_S * 1000)) as done:
            window.load_banner.cancel.click()
        elapsed = time.monotonic() - clicked
        # the compiling worker was ended once the grace ran out, not when its compile would have finished
        ended_at = next(t for t, state in states if state == "stopping" and t >= clicked)
        print(f"Cancel: worker ended after {ended_at - clicked:.1f} s, "  # noqa: T201 - the figures, with -s
              f"the uncompiled model loaded after {elapsed:.1f} s")
        assert ended_at - clicked < GRACE_MS / 1000 + END_SLACK_S
        assert elapsed < RELOAD_LIMIT_S
        # ... with its compile helper: nothing left running, nothing orphaned
        assert not _running(compiling_worker) and not _running(helper)
        assert client.pid not in (None, compiling_worker) and _running(client.pid)
        assert readies == [1]  # to the window the fallback was the same load going on (no second "ready")

        info = done.args[0]
        assert info["compile_cancelled"] is True and info["compiled"] is False
        assert info["model_dir"] == str(tiny_clover_dir)
        assert window.engine_status.state is EngineState.READY and not window.load_banner.isVisible()
        assert window.model_label.text() == tiny_clover_dir.name  # not "no model"
        # the box unticked and saved: the next start does not compile again
        assert not window.model_library.compile_choice.isChecked() and not desk.settings.compile_layers
        assert json.loads((home / "settings.json").read_text(encoding="utf-8"))["compile_layers"] is False
        # said once
        text = window.info_banner.label.text()
        assert window.info_banner.isVisible() and text.count("cancelled") == 1 and "uncompiled" in text, text

        # the model answers
        finished: list[Finished] = []
        client.event.connect(lambda _rid, event: finished.append(event) if isinstance(event, Finished) else None)
        client.generate([{"role": "user", "content": "hello"}],
                        GenerationParams(mode="ar", max_new_tokens=4, do_sample=False))
        qtbot.waitUntil(lambda: bool(finished), timeout=60_000)
        assert finished[0].tokens > 0 and finished[0].stop_reason != "cancelled"
        # chats untouched
        assert [c.id for c in store.list_conversations()] == [kept.id]
        assert [m.content for m in store.messages(kept.id)] == ["hello from before the cancel"]
    finally:
        desk.shutdown(wait_ms=5000)
    assert not _running(compiling_worker) and not _running(helper)
