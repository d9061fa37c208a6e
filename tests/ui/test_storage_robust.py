"""The chat store under hostile conditions, with real components only.

* a second application instance on the same database (a real second process) is refused by the single-instance
  lock and never touches the first one's streaming answer;
* a read-only data folder (a read-only tmpfs) and a full disk (a real 1 MiB tmpfs, filled) give one clear error
  and leave the store usable; the window keeps the typed text and stops a generation whose block save failed.

The mounts need root (or CAP_SYS_ADMIN) on Linux; where ``mount`` is refused those tests skip and say why.
"""

from __future__ import annotations

import errno
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clover_desk.engine.decode.events import BlockCommitted, PromptInfo, TextDelta
from clover_desk.paths import CHATS_DB_NAME, DataDirError, writable_app_data_dir
from clover_desk.storage.errors import StorageWriteError, StoreLockedError, write_failure_reason
from clover_desk.storage.lock import LOCK_SUFFIX
from clover_desk.storage.recorder import StreamRecorder
from clover_desk.storage.store import ChatStore

ROOT = Path(__file__).resolve().parents[2]
FAKE = ["--engine-factory", "tests.fake_engine:make"]
GUI_ENV = {"QT_QPA_PLATFORM": "offscreen", "QTWEBENGINE_DISABLE_SANDBOX": "1"}

# A second Clover Desk as a real process: opens the store, streams one block of an answer, then obeys stdin.
HOLDER = r"""
import subprocess, sys
from clover_desk.storage.store import ChatStore
store = ChatStore(sys.argv[1])
c = store.create_conversation("live")
store.add_message(c.id, "user", "hi")
a = store.add_message(c.id, "assistant", status="streaming")
store.append_streaming(a.id, "first block ")
print(a.id, flush=True)
for line in sys.stdin:
    word = line.strip()
    if word == "block":
        store.append_streaming(a.id, "next block ")
        print("saved", flush=True)
    elif word == "finish":
        store.finish_message(a.id, "complete")
        print("finished", flush=True)
    elif word == "spawn":  # a child that inherits every inheritable descriptor, as the engine worker does
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], close_fds=False)
        print(child.pid, flush=True)
    elif word == "exit":
        store.close()
        break
"""


# ----------------------------------------------------------------------------------------------- helpers


def _holder(db: Path) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(db)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first.strip().isdigit(), f"holder failed: {first!r} {proc.stderr.read() if proc.stderr else ''}"
    return proc, int(first)


def _tell(proc: subprocess.Popen[str], word: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(word + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def _peek(db: Path, message_id: int) -> tuple[str, str]:
    """(status, content) of a message, read without ChatStore (a read-only SQLite connection, no recovery)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        status, content = conn.execute("SELECT status, content FROM messages WHERE id = ?", (message_id,)).fetchone()
    finally:
        conn.close()
    return status, content


def _gui(home: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **GUI_ENV}
    env.pop("CLOVER_DESK_HOME", None)
    return subprocess.run(
        [sys.executable, "-m", "clover_desk.cli.main", "gui", "--home", str(home)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=timeout,
    )


def _one_clear_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    ours = [line for line in stderr.splitlines() if line.startswith("clover-desk:")]
    assert len(ours) == 1, stderr
    return ours[0]


def _mount(path: Path, options: str) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("mounting a tmpfs needs Linux")
    path.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                              capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no mount command here: cannot make a small or read-only file system")
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here ({done.stderr.strip()}); needs root or CAP_SYS_ADMIN")


def _umount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _remount_read_only(path: Path) -> None:
    done = subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot remount {path} read-only here ({done.stderr.strip()})")


def _tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` at ``mount_point`` while the caller holds it, unmounted afterwards."""
    _mount(mount_point, f"size={size},mode=0755")
    try:
        yield mount_point
    finally:
        _umount(mount_point)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB file system (tmpfs), unmounted afterwards."""
    yield from _tmpfs(tmp_path / "small", "1m")


@pytest.fixture
def read_only_fs(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs, populated by the test and then remounted read-only with :func:`_remount_read_only`."""
    yield from _tmpfs(tmp_path / "ro", "4m")


def _empty_wal(db: Path) -> None:
    """Checkpoint and truncate the WAL (from a second plain connection), so the next write must grow a file."""
    conn = sqlite3.connect(db)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    finally:
        conn.close()


def _sql(db: Path, statement: str) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute(statement)
    finally:
        conn.close()


def _fill(folder: Path) -> Path:
    """Fill the file system holding ``folder`` to the last byte; returns the filler file (unlink it to free)."""
    filler = folder / "filler.bin"
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 16, 4096, 512, 1):
            block = b"\0" * size
            while True:
                try:
                    f.write(block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    assert os.statvfs(folder).f_bavail == 0
    return filler


# ----------------------------------------------------------------------------------------------- the lock


def test_second_store_on_one_database_is_refused_until_the_first_closes(tmp_path: Path) -> None:
    db = tmp_path / CHATS_DB_NAME
    first = ChatStore(db)
    try:
        with pytest.raises(StoreLockedError, match="already running with this data folder") as refused:
            ChatStore(db)
        assert str(tmp_path) in str(refused.value) and "CLOVER_DESK_HOME" in str(refused.value)
        assert f"process {os.getpid()}" in str(refused.value)
        first.create_conversation("still mine")  # the holder is unaffected
    finally:
        first.close()
    with ChatStore(db) as second:  # released on close
        assert [c.title for c in second.list_conversations()] == ["still mine"]
    assert (tmp_path / (CHATS_DB_NAME + LOCK_SUFFIX)).exists()


def test_second_instance_never_recovers_the_live_instance_streaming_answer(tmp_path: Path) -> None:
    """The hostile review's case: instance 2 used to mark instance 1's answer "stopped", and 1's saves then failed."""
    db = tmp_path / CHATS_DB_NAME
    live, answer_id = _holder(db)
    try:
        with pytest.raises(StoreLockedError, match="already running") as refused:
            ChatStore(db)
        assert f"process {live.pid}" in str(refused.value)
        assert _peek(db, answer_id) == ("streaming", "first block ")  # untouched: no crash recovery ran
        # the live instance keeps saving blocks and finishes its answer without an error
        assert _tell(live, "block") == "saved"
        assert _tell(live, "finish") == "finished"
        _tell(live, "exit")
        assert live.wait(30) == 0, live.stderr.read() if live.stderr else ""
    finally:
        if live.poll() is None:
            live.kill()
            live.wait(10)
    with ChatStore(db) as store:
        assert store.recovered_message_ids == ()
        answer = store.get_message(answer_id)
        assert (answer.status, answer.content) == ("complete", "first block next block ")


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    db = tmp_path / CHATS_DB_NAME
    live, answer_id = _holder(db)
    os.kill(live.pid, signal.SIGKILL)
    live.wait(10)
    with ChatStore(db) as store:  # the OS dropped the lock with the process: recovery runs now, and only now
        assert store.recovered_message_ids == (answer_id,)
        assert store.get_message(answer_id).status == "stopped"


def test_a_killed_app_whose_child_lives_on_leaves_no_lock(tmp_path: Path) -> None:
    """The engine worker is a child of the app and may outlive it for a moment: it must not hold the lock."""
    db = tmp_path / CHATS_DB_NAME
    live, answer_id = _holder(db)
    grandchild = int(_tell(live, "spawn"))
    try:
        os.kill(live.pid, signal.SIGKILL)
        live.wait(10)
        os.kill(grandchild, 0)  # still running
        with ChatStore(db) as store:
            assert store.recovered_message_ids == (answer_id,)
    finally:
        try:
            os.kill(grandchild, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_gui_refuses_a_second_instance_with_status_2(tmp_path: Path) -> None:
    home = tmp_path / "home"
    holder = ChatStore(home / CHATS_DB_NAME)
    try:
        done = _gui(home)
    finally:
        holder.close()
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    line = _one_clear_line(done.stderr)
    assert "Clover Desk is already running with this data folder" in line and str(home) in line


# ----------------------------------------------------------------------------------------------- read-only folder


@pytest.mark.parametrize("with_chats", [False, True], ids=["empty-folder", "existing-chats"])
def test_gui_on_a_read_only_data_folder_exits_2_with_one_line(read_only_fs: Path, with_chats: bool) -> None:
    if with_chats:
        with ChatStore(read_only_fs / CHATS_DB_NAME) as store:
            store.add_message(store.create_conversation("kept").id, "user", "hello")
    _remount_read_only(read_only_fs)
    done = _gui(read_only_fs)
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    line = _one_clear_line(done.stderr)
    assert str(read_only_fs) in line and "read-only" in line and "CLOVER_DESK_HOME" in line


def test_store_and_data_dir_on_a_read_only_folder_say_what_to_do(read_only_fs: Path) -> None:
    with ChatStore(read_only_fs / CHATS_DB_NAME) as store:
        store.create_conversation("kept")
    _remount_read_only(read_only_fs)
    with pytest.raises(DataDirError, match="read-only") as not_writable:
        writable_app_data_dir(read_only_fs)
    assert str(read_only_fs) in str(not_writable.value) and "CLOVER_DESK_HOME" in str(not_writable.value)
    with pytest.raises(StorageWriteError) as refused:
        ChatStore(read_only_fs / CHATS_DB_NAME)
    assert refused.value.reason == "read-only"
    assert str(read_only_fs) in str(refused.value) and "CLOVER_DESK_HOME" in str(refused.value)
    with pytest.raises(StorageWriteError, match="read-only"):
        ChatStore(read_only_fs / "sub" / CHATS_DB_NAME)  # a folder that cannot even be created


# ----------------------------------------------------------------------------------------------- full disk


def test_every_write_on_a_full_disk_fails_cleanly_and_the_store_stays_usable(small_fs: Path) -> None:
    db = small_fs / CHATS_DB_NAME
    with ChatStore(db) as store:
        conv = store.create_conversation("before")
        user = store.add_message(conv.id, "user", "question")
        answer = store.add_message(conv.id, "assistant", status="streaming")
        store.append_streaming(answer.id, "saved part ")
        before = store.messages(conv.id)
        _empty_wal(db)
        filler = _fill(small_fs)
        writes = {
            "create_conversation": lambda: store.create_conversation("new"),
            "add_message": lambda: store.add_message(conv.id, "user", "lost?"),
            "append_streaming": lambda: store.append_streaming(answer.id, "more"),
            "finish_message": lambda: store.finish_message(answer.id, "complete"),
            "update_conversation": lambda: store.update_conversation(conv.id, settings={"temperature": 1.0}),
            "rename_conversation": lambda: store.rename_conversation(conv.id, "renamed"),
            "edit_message": lambda: store.edit_message(user.id, "edited"),
            "truncate_after": lambda: store.truncate_after(user.id),
            "delete_conversation": lambda: store.delete_conversation(conv.id),
            "big add_message": lambda: store.add_message(conv.id, "user", "x" * (2 << 20)),
        }
        for name, write in writes.items():
            with pytest.raises(StorageWriteError) as failed:
                write()
            assert failed.value.reason == "disk-full", name
            text = str(failed.value)
            assert str(db) in text and "disk is full" in text and "\n" not in text, (name, text)
            assert not store._conn.in_transaction, name  # rolled back: the next write can begin
        assert store.messages(conv.id) == before  # nothing half-written
        assert [c.title for c in store.list_conversations()] == ["before"]
        filler.unlink()
        # space again: the same store writes, without reopening
        store.append_streaming(answer.id, "more")
        store.finish_message(answer.id, "complete")
        store.add_message(conv.id, "user", "after")
        assert [m.content for m in store.messages(conv.id)] == ["question", "saved part more", "after"]


def test_recorder_stops_on_a_failed_block_save(small_fs: Path) -> None:
    db = small_fs / CHATS_DB_NAME
    store = ChatStore(db)
    conv = store.create_conversation("c")
    answer = store.add_message(conv.id, "assistant", status="streaming")
    recorder = StreamRecorder(store, answer.id)
    recorder.on_event(PromptInfo(3, 4, 0, 3))
    recorder.on_event(TextDelta("block one "))
    recorder.on_event(BlockCommitted(0, 4, (1, 2)))
    _empty_wal(db)
    filler = _fill(small_fs)
    recorder.on_event(TextDelta("block two "))
    with pytest.raises(StorageWriteError, match="disk is full"):
        recorder.on_event(BlockCommitted(1, 4, (3, 4)))
    assert recorder.done and isinstance(recorder.save_error, StorageWriteError)
    assert recorder.on_event(TextDelta("ignored")) is True  # the recording has ended
    # the best-effort "not saved" mark could not be written either: the message is still streaming on disk
    assert _peek(db, answer.id) == ("streaming", "block one ")
    filler.unlink()
    store.close()
    with ChatStore(db) as reopened:  # ...and the next start keeps it as interrupted, with what was saved
        assert reopened.recovered_message_ids == (answer.id,)
        assert reopened.get_message(answer.id).content == "block one "


def test_open_on_a_full_disk_still_shows_the_chats(small_fs: Path) -> None:
    """Crash recovery is a write: on a full disk it waits for the next start instead of refusing to open."""
    db = small_fs / CHATS_DB_NAME
    with ChatStore(db) as store:
        conv = store.create_conversation("crashed")
        answer = store.add_message(conv.id, "assistant", status="streaming")
        store.append_streaming(answer.id, "partial")
    keep = sqlite3.connect(db)  # keeps -wal / -shm in place (as any other reader would) so the open needs no space
    try:
        keep.execute("SELECT 1 FROM messages").fetchall()
        _empty_wal(db)
        filler = _fill(small_fs)
        with ChatStore(db) as store:
            assert store.recovered_message_ids == ()
            assert [m.content for m in store.messages(conv.id)] == ["partial"]
        filler.unlink()
        with ChatStore(db) as store:
            assert store.recovered_message_ids == (answer.id,)
    finally:
        keep.close()


def test_write_failure_reasons() -> None:
    assert write_failure_reason(OSError(errno.ENOSPC, "No space left on device")) == "disk-full"
    assert write_failure_reason(OSError(errno.EROFS, "Read-only file system")) == "read-only"
    assert write_failure_reason(OSError(errno.EIO, "Input/output error")) == "io"
    assert write_failure_reason(sqlite3.OperationalError("database or disk is full")) == "disk-full"
    assert write_failure_reason(sqlite3.OperationalError("attempt to write a readonly database")) == "read-only"
    assert write_failure_reason(sqlite3.OperationalError("disk I/O error")) == "io"
    assert write_failure_reason(sqlite3.OperationalError("no such table: x")) is None
    assert write_failure_reason(ValueError("x")) is None


# ----------------------------------------------------------------------------------------------- the window


@pytest.fixture
def worker_client(qtbot: Any) -> Iterator[Any]:
    """The real EngineClient and worker process, on the scripted engine, with its model loaded."""
    from clover_desk.worker.client import EngineClient

    client = EngineClient(worker_args=FAKE)
    with qtbot.waitSignal(client.ready, timeout=60_000):
        client.start()
    with qtbot.waitSignal(client.loaded, timeout=60_000):
        client.load("/models/fake")
    yield client
    if client.state != "stopped":
        with qtbot.waitSignal(client.stopped, timeout=15_000):
            client.shutdown()


def _window(qtbot: Any, client: Any, store: ChatStore) -> Any:
    from clover_desk.ui.main_window import MainWindow

    window = MainWindow(client, store, StreamRecorder, model_dir="/models/fake")
    qtbot.addWidget(window)
    window.show()
    return window


def test_failed_send_keeps_the_typed_text_and_says_why(qtbot: Any, small_fs: Path, worker_client: Any) -> None:
    from PySide6.QtCore import Qt

    db = small_fs / CHATS_DB_NAME
    store = ChatStore(db)
    try:
        window = _window(qtbot, worker_client, store)
        _empty_wal(db)
        filler = _fill(small_fs)
        typed = "Please remember this long question\nwith two lines"
        window.composer.input.setPlainText(typed)
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)  # used to raise sqlite3.OperationalError
        assert window.composer.input.toPlainText() == typed
        assert not window.is_generating() and not window.composer.generating
        assert worker_client.current_request is None  # nothing was sent to the engine
        assert window.info_banner.isVisible()
        shown = window.info_banner.label.text()
        assert "not sent" in shown and "disk is full" in shown and str(db) in shown
        filler.unlink()
        with qtbot.waitSignal(window.generationFinished, timeout=30_000) as finished:
            qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)  # the same text, sent once space is back
        assert finished.args[1] == "max_new_tokens"
        assert window.composer.input.toPlainText() == ""
        messages = store.messages(window.conversation_id)
        assert [(m.role, m.status) for m in messages] == [("user", "complete"), ("assistant", "complete")]
        assert messages[0].content == typed.strip()
    finally:
        store.close()


def test_failed_block_save_mid_answer_stops_the_generation_and_keeps_the_answer(
    qtbot: Any, small_fs: Path, worker_client: Any
) -> None:
    from PySide6.QtCore import Qt

    db = small_fs / CHATS_DB_NAME
    store = ChatStore(db)
    try:
        window = _window(qtbot, worker_client, store)
        window.composer.input.setPlainText("endless")  # the scripted engine streams blocks until cancelled
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
        assert window.is_generating()
        request_id = window.request_id
        answer_id = window.reply_data.message_id
        qtbot.waitUntil(lambda: "b1 " in store.get_message(answer_id).content, timeout=30_000)
        _empty_wal(db)
        filler = _fill(small_fs)
        with qtbot.waitSignal(window.generationFinished, timeout=30_000) as ended:
            pass  # the next block's save fails
        assert ended.args == [request_id, "not-saved"]
        assert not window.is_generating() and window.composer.send_button.text() == "Send"
        shown = window.info_banner.label.text()
        assert window.info_banner.isVisible() and "not saved" in shown and "disk is full" in shown
        # the answer stays on screen, with the block that could not be saved, marked as not saved
        widget = window.chat.widgets[-1]
        assert widget.data.status == "error" and widget.data.content.startswith("b0 b1 ")
        assert len(widget.data.content) > len(store.get_message(answer_id).content)
        assert "not saved" in widget.data.stats["error"]
        rendered = widget.body.toPlainText()
        assert rendered.startswith("b0 b1 ") and "not saved" in rendered and "disk is full" in rendered
        # the cancel reached the real worker: the endless generation ended and the engine is free again
        qtbot.waitUntil(lambda: worker_client.state == "idle", timeout=30_000)
        filler.unlink()
        window.composer.input.setPlainText("short one")
        with qtbot.waitSignal(window.generationFinished, timeout=30_000) as again:
            qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
        assert again.args[1] == "max_new_tokens"
        assert store.messages(window.conversation_id)[-1].status == "complete"
    finally:
        store.close()


def _send(qtbot: Any, window: Any, text: str) -> None:
    from PySide6.QtCore import Qt

    window.composer.input.setPlainText(text)
    with qtbot.waitSignal(window.generationFinished, timeout=30_000):
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)


def test_failed_edit_keeps_the_edit_and_other_failed_saves_say_why(
    qtbot: Any, small_fs: Path, worker_client: Any, tmp_path: Path
) -> None:
    from PySide6.QtCore import Qt

    db = small_fs / CHATS_DB_NAME
    store = ChatStore(db)
    try:
        window = _window(qtbot, worker_client, store)
        _send(qtbot, window, "first question")
        cid = window.conversation_id
        question = window.chat.messages()[0]
        window.chat_actions.on_edit_requested(question)
        _empty_wal(db)
        filler = _fill(small_fs)
        window.composer.input.setPlainText("better question")
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
        assert window.composer.editing is question and window.composer.input.toPlainText() == "better question"
        assert "not sent" in window.info_banner.label.text() and not window.is_generating()
        assert [m.content for m in store.messages(cid)][0] == "first question"
        # every other write of the window says why instead of raising out of the slot
        window.info_banner.hide()
        window.conversations.on_rename_requested(cid, "renamed")
        assert "not renamed" in window.info_banner.label.text() and store.get_conversation(cid).title != "renamed"
        window.drawer.temperature.setValue(1.5)
        assert "settings were not saved" in window.info_banner.label.text()
        assert window.conversations.export(cid, "markdown", str(small_fs / "chat.md")) is None
        assert "not exported" in window.info_banner.label.text() and "No space left" in window.info_banner.label.text()
        window.chat_actions.on_regenerate_requested(window.chat.messages()[-1])
        assert "not regenerated" in window.info_banner.label.text() and not window.is_generating()
        window.conversations.delete(cid)
        assert "not deleted" in window.info_banner.label.text() and store.get_conversation(cid).id == cid
        filler.unlink()
        with qtbot.waitSignal(window.generationFinished, timeout=30_000):
            window.conversations.open(cid)
            edited = next(m for m in window.chat.messages() if m.role == "user")
            window.chat_actions.on_edit_requested(edited)
            window.composer.input.setPlainText("better question")
            qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
        assert window.composer.editing is None and window.composer.input.toPlainText() == ""
        assert [m.content for m in store.messages(cid)][0] == "better question"
    finally:
        store.close()


def test_a_send_whose_answer_cannot_be_started_is_taken_back(qtbot: Any, tmp_path: Path, worker_client: Any) -> None:
    """The user message saved, then the answer's row refused: the message is taken back, the text stays typed.
    (A real SQLite trigger refuses assistant rows: a full disk cannot be made to fail the second write only.)"""
    from PySide6.QtCore import Qt

    db = tmp_path / CHATS_DB_NAME
    store = ChatStore(db)
    try:
        window = _window(qtbot, worker_client, store)
        _sql(db, "CREATE TRIGGER refuse_answers BEFORE INSERT ON messages WHEN NEW.role = 'assistant' "
                 "BEGIN SELECT RAISE(ABORT, 'answers refused'); END")
        window.composer.input.setPlainText("will it send?")
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
        assert window.composer.input.toPlainText() == "will it send?" and not window.is_generating()
        assert "not sent" in window.info_banner.label.text()
        assert store.messages(window.conversation_id) == [] and window.chat.messages() == []
        _sql(db, "DROP TRIGGER refuse_answers")
        with qtbot.waitSignal(window.generationFinished, timeout=30_000):
            qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
        assert [m.role for m in store.messages(window.conversation_id)] == ["user", "assistant"]  # sent once
    finally:
        store.close()
