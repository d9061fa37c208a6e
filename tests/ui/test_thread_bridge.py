"""ui.thread_bridge: Python threads hand results to the GUI thread without touching a Qt object.

A thread that emits a signal of a QObject deleted meanwhile crashes the app. Here the owner is deleted (for real:
``shiboken6.delete``, or ``deleteLater`` and the deferred delete processed) while a thread still runs; then the
thread reports. The report must be dropped, no exception may escape the thread, and nothing may crash. Posts arrive
in order, on the GUI thread. The same is checked through the real users: the remote runner, the model library and
the model manager's download.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import shiboken6
from PySide6.QtCore import QCoreApplication, QEvent, QObject, QThread, Signal

from clover_desk.engine.decode.events import EngineError, GenerationParams, TextDelta
from clover_desk.qt_compat import guard_pyside_bool_refcounts
from clover_desk.ui.thread_bridge import ThreadBridge

guard_pyside_bool_refcounts()

WAIT_S = 10.0


@pytest.fixture
def thread_errors(monkeypatch) -> list[threading.ExceptHookArgs]:  # noqa: ANN001
    """Exceptions that escaped a thread (a late emit on a deleted object raises there, when it does not crash)."""
    seen: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", seen.append)
    return seen


def _on_gui_thread() -> bool:
    return QThread.currentThread() == QCoreApplication.instance().thread() and \
        threading.current_thread() is threading.main_thread()


def _delete(owner: QObject, how: str) -> None:
    if how == "delete":
        shiboken6.delete(owner)
    else:
        owner.deleteLater()
        QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete.value)
    assert not shiboken6.isValid(owner)


class Owner(QObject):
    report = Signal(int)


# ---- the bridge itself --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["delete", "deleteLater"])
def test_a_post_after_the_owner_was_deleted_is_dropped(qtbot, thread_errors, how: str) -> None:  # noqa: ANN001
    owner = Owner()
    bridge = ThreadBridge(owner)
    received: list[int] = []
    owner.report.connect(received.append)
    emit = owner.report  # resolved on the GUI thread, as the users do
    go, posted = threading.Event(), []

    def work() -> None:
        bridge.post(emit, 1)  # waits in the bridge: never delivered, the owner goes first
        go.wait(WAIT_S)
        posted.append(bridge.post(emit, 2))
        posted.append(bridge.post(received.append, 3))

    thread = bridge.spawn(work)
    _delete(owner, how)
    go.set()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    qtbot.wait(100)  # a timer, had one survived, would fire now
    assert posted == [False, False] and received == []
    assert bridge.closed and bridge.dropped == 3 and bridge.pending() == 0
    assert thread_errors == []


def test_many_posts_from_threads_arrive_in_order_on_the_gui_thread(qtbot, thread_errors) -> None:  # noqa: ANN001
    owner = Owner()
    bridge = ThreadBridge(owner)
    by_signal: list[int] = []
    by_call: list[tuple[str, int]] = []
    off_gui: list[object] = []

    def on_report(i: int) -> None:
        if not _on_gui_thread():
            off_gui.append(i)
        by_signal.append(i)

    def on_call(name: str, i: int) -> None:
        if not _on_gui_thread():
            off_gui.append((name, i))
        by_call.append((name, i))

    owner.report.connect(on_report)
    n = 5000

    def work(name: str) -> None:
        for i in range(n):
            if name == "a":
                bridge.post(owner_report, i)
            bridge.post(on_call, name, i)

    owner_report = owner.report
    threads = [bridge.spawn(work, name) for name in ("a", "b")]
    qtbot.waitUntil(lambda: len(by_call) == 2 * n and not bridge.busy(), timeout=int(WAIT_S * 1000))
    assert all(not t.is_alive() for t in threads)
    assert by_signal == list(range(n))
    for name in ("a", "b"):  # each thread's posts in its order (the two threads interleave)
        assert [i for who, i in by_call if who == name] == list(range(n))
    assert off_gui == [] and thread_errors == []
    qtbot.waitUntil(lambda: not bridge._timer.isActive(), timeout=1000)  # idle once nothing runs or waits
    assert bridge.delivered == 3 * n and bridge.pending() == 0
    shiboken6.delete(owner)


def test_a_thread_spawned_by_a_delivered_call_is_waited_for(qtbot) -> None:  # noqa: ANN001
    """Work that starts more work when its result comes (the library scans again after a delete): the second
    thread's result arrives too, though the first thread had ended when it was delivered."""
    owner = Owner()
    bridge = ThreadBridge(owner)
    got: list[str] = []
    release = threading.Event()

    def second() -> None:
        release.wait(WAIT_S)
        bridge.post(got.append, "second")

    def on_first(text: str) -> None:
        got.append(text)
        bridge.spawn(second)

    first = bridge.spawn(lambda: bridge.post(on_first, "first"))
    first.join(WAIT_S)
    qtbot.waitUntil(lambda: got == ["first"], timeout=1000)
    qtbot.wait(3 * 20)  # several timer periods with the second thread still waiting
    release.set()
    qtbot.waitUntil(lambda: got == ["first", "second"], timeout=1000)
    shiboken6.delete(owner)


def test_a_post_from_the_gui_thread_wakes_the_bridge(qtbot) -> None:  # noqa: ANN001
    owner = Owner()
    bridge = ThreadBridge(owner)
    got: list[int] = []
    assert bridge.post(got.append, 7)
    qtbot.waitUntil(lambda: got == [7], timeout=1000)
    bridge.close()
    assert not bridge.post(got.append, 8)
    qtbot.wait(60)
    assert got == [7]
    shiboken6.delete(owner)


# ---- the remote runner --------------------------------------------------------------------------------------------


@dataclass
class FakeFinish:  # what the runner forwards last (it does not look inside)
    finish_reason: str = "stop"


class GatedRemote:
    """A remote that waits for ``gate`` and then streams ``n`` deltas and a finish (or lists one model)."""

    def __init__(self, gate: threading.Event, n: int) -> None:
        self.gate, self.n = gate, n

    def __call__(self, url: str, api_key: str | None, model: str | None) -> GatedRemote:
        return self

    def chat(self, messages: Any, params: Any, tools: Any, cancel: threading.Event) -> Iterator[object]:
        self.gate.wait(WAIT_S)
        for i in range(self.n):
            yield TextDelta(f"t{i} ")
        yield FakeFinish()

    def models(self) -> list[str]:
        self.gate.wait(WAIT_S)
        return ["m"]


def test_remote_tokens_arrive_in_order_then_the_finish_on_the_gui_thread(qtbot, thread_errors) -> None:  # noqa: ANN001
    from clover_desk.ui.remote_chat import RemoteRunner

    gate = threading.Event()
    gate.set()
    runner = RemoteRunner(GatedRemote(gate, 2000))
    runner.configure("http://127.0.0.1:9/v1")
    events: list[tuple[str, object]] = []
    off_gui: list[object] = []

    def on_event(rid: str, event: object) -> None:
        if not _on_gui_thread():
            off_gui.append(event)
        events.append((rid, event))

    runner.event.connect(on_event)
    rid = runner.generate([{"role": "user", "content": "hi"}], GenerationParams())
    qtbot.waitUntil(lambda: bool(events) and isinstance(events[-1][1], FakeFinish), timeout=int(WAIT_S * 1000))
    assert {r for r, _ in events} == {rid}
    assert [e.text for _, e in events[:-1]] == [f"t{i} " for i in range(2000)]  # type: ignore[attr-defined]
    assert off_gui == [] and thread_errors == [] and runner._cancels == {}

    class Broken(GatedRemote):
        def chat(self, *args: Any) -> Iterator[object]:
            yield TextDelta("partial")
            raise ValueError("boom")

    runner._factory = Broken(gate, 0)
    events.clear()
    runner.generate([], GenerationParams())
    qtbot.waitUntil(lambda: len(events) == 2, timeout=int(WAIT_S * 1000))
    assert isinstance(events[0][1], TextDelta) and isinstance(events[1][1], EngineError)
    assert "boom" in events[1][1].message
    runner.shutdown()
    shiboken6.delete(runner)


@pytest.mark.parametrize("how", ["delete", "deleteLater"])
def test_a_remote_runner_deleted_mid_answer_drops_the_rest(qtbot, thread_errors, how: str) -> None:  # noqa: ANN001
    from clover_desk.ui.remote_chat import RemoteRunner

    gate = threading.Event()
    runner = RemoteRunner(GatedRemote(gate, 50))
    runner.configure("http://127.0.0.1:9/v1")
    got: list[object] = []
    runner.event.connect(lambda _rid, event: got.append(event))
    runner.connectionTested.connect(lambda *args: got.append(args))
    bridge = runner.bridge
    runner.generate([], GenerationParams())
    runner.test_connection("http://127.0.0.1:9/v1")
    with bridge._lock:
        threads = list(bridge._threads)
    assert len(threads) == 2
    _delete(runner, how)  # the window closed while the answer and the test still run
    gate.set()
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive()
    qtbot.wait(100)
    assert got == [] and thread_errors == []
    assert bridge.dropped == 50 + 1 + 1  # every delta, the finish, the connection test: each dropped, none emitted


# ---- the model library ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["delete", "deleteLater"])
def test_a_model_library_deleted_mid_scan_drops_the_result(qtbot, thread_errors, tmp_path: Path,  # noqa: ANN001
                                                           monkeypatch, how: str) -> None:  # noqa: ANN001
    import clover_desk.ui.model_library as model_library

    gate = threading.Event()

    def slow_paths(models_dir: Path, recent: Any) -> list[str]:
        gate.wait(WAIT_S)
        return []

    monkeypatch.setattr(model_library, "library_paths", slow_paths)
    library = model_library.ModelLibrary(tmp_path / "models")
    scanned: list[bool] = []
    library.scanned.connect(lambda: scanned.append(True))
    bridge = library.bridge
    library.refresh()
    thread = library._job.thread  # type: ignore[union-attr]
    _delete(library, how)
    gate.set()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    qtbot.wait(100)
    assert scanned == [] and thread_errors == [] and bridge.dropped == 1


def test_the_model_library_scans_on_a_thread_and_shows_on_the_gui_thread(qtbot, tmp_path: Path,  # noqa: ANN001
                                                                         monkeypatch) -> None:  # noqa: ANN001
    import clover_desk.ui.model_library as model_library

    shown_on: list[bool] = []
    show = model_library.ModelLibrary._show
    monkeypatch.setattr(model_library.ModelLibrary, "_show",
                        lambda self, entries: (shown_on.append(_on_gui_thread()), show(self, entries)))
    library = model_library.ModelLibrary(tmp_path / "models")
    qtbot.addWidget(library)
    with qtbot.waitSignal(library.scanned, timeout=int(WAIT_S * 1000)):
        library.refresh()
    assert shown_on == [True] and library.entries == [] and library._job is None


# ---- the model manager's download --------------------------------------------------------------------------------


class GatedDownloader:
    def __init__(self, gate: threading.Event, target: Path, progress: Any, cancel: threading.Event) -> None:
        self.gate, self.target, self.progress, self.cancel = gate, target, progress, cancel

    def run(self) -> Path:
        self.gate.wait(WAIT_S)
        for i in range(3):
            self.progress(SimpleNamespace(done_bytes=i, total_bytes=3, speed_bps=1.0, eta_s=None, state="downloading",
                                          file="a", file_index=0, file_count=1))
        return self.target


@pytest.mark.parametrize("how", ["delete", "deleteLater"])
def test_a_model_manager_deleted_mid_download_drops_the_rest(qtbot, thread_errors, tmp_path: Path,  # noqa: ANN001
                                                             how: str) -> None:
    from clover_desk.ui.model_manager import ModelManagerPanel

    gate = threading.Event()

    def factory(target: Path, repo_id: str, *, progress: Any, cancel: threading.Event, **_: Any) -> GatedDownloader:
        return GatedDownloader(gate, target, progress, cancel)

    panel = ModelManagerPanel(downloader_factory=factory, models_dir=tmp_path / "models", recent_file=None)
    ended: list[object] = []
    panel.downloadEnded.connect(lambda *args: ended.append(args))
    panel.downloadProgress.connect(ended.append)
    bridge = panel.bridge
    panel.start_download("someone/model", tmp_path / "models" / "m")
    thread = panel._job.thread  # type: ignore[union-attr]
    _delete(panel, how)
    gate.set()
    thread.join(WAIT_S)
    assert thread is not None and not thread.is_alive()
    qtbot.wait(100)
    assert ended == [] and thread_errors == [] and bridge.dropped == 3 + 1  # three reports and the end


def test_download_progress_comes_before_the_end_on_the_gui_thread(qtbot, tmp_path: Path) -> None:  # noqa: ANN001
    from clover_desk.ui.model_manager import ModelManagerPanel

    gate = threading.Event()
    gate.set()
    target = tmp_path / "models" / "m"

    def factory(target: Path, repo_id: str, *, progress: Any, cancel: threading.Event, **_: Any) -> GatedDownloader:
        return GatedDownloader(gate, target, progress, cancel)

    panel = ModelManagerPanel(downloader_factory=factory, models_dir=tmp_path / "models", recent_file=None)
    qtbot.addWidget(panel)
    seen: list[object] = []
    panel.downloadProgress.connect(lambda p: seen.append((_on_gui_thread(), p.done_bytes)))
    with qtbot.waitSignal(panel.downloadEnded, timeout=int(WAIT_S * 1000)) as ended:
        panel.start_download("someone/model", target)
    assert seen == [(True, 0), (True, 1), (True, 2)]
    assert ended.args[0] is False and "cannot use it" in ended.args[1]  # (the fake wrote no model there)
    assert not panel.is_busy()
