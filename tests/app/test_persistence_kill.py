"""A chat survives SIGKILL of the app mid-answer: everything up to the last committed block, marked "stopped".

Nothing is faked: tests/persist_child.py runs the real worker and engine on a tiny checkpoint through EngineClient
and saves through ChatStore + StreamRecorder, as the window does; this test kills it with SIGKILL once a few blocks
are saved, then reopens the database.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from clover_desk.storage.store import ChatStore

ROOT = Path(__file__).resolve().parents[2]
BLOCKS_BEFORE_KILL = 3
TIMEOUT_S = 120.0  # generous: the test machine may be shared

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX SIGKILL")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from clover_desk.engine.weights.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny") / "model")


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for a reaper counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_sigkill_mid_answer_keeps_every_committed_block(tiny_model: Path, tmp_path: Path) -> None:
    db = tmp_path / "chats.sqlite3"
    log_path = tmp_path / "child.log"
    with open(log_path, "wb") as child_log:
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.persist_child", str(db), str(tiny_model)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=child_log,
            start_new_session=True,  # its own process group, so cleanup can reach the worker too
            env=dict(os.environ, QT_QPA_PLATFORM="offscreen"),
        )
    lines: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def read() -> None:
        assert child.stdout is not None
        for raw in child.stdout:
            lines.put(json.loads(raw))
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    records: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            record = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert record is not None, f"the child ended early; its log:\n{log_path.read_text()[-3000:]}"
            records.append(record)
            assert "crashed" not in record and "error" not in record, record
            if record.get("blocks", 0) >= BLOCKS_BEFORE_KILL:
                break
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(10) == -signal.SIGKILL
        reader.join(10)
        while (record := lines.get_nowait()) is not None:
            records.append(record)

        # The worker notices its parent is gone (stdin closes) and exits: no orphan holding the GPU.
        worker_pid = records[0]["worker_pid"]
        gone_by = time.monotonic() + 30
        while _alive(worker_pid) and time.monotonic() < gone_by:
            time.sleep(0.1)
        assert not _alive(worker_pid), "the worker outlived the killed app"
    finally:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait(10)

    last = [r for r in records if "blocks" in r][-1]
    with ChatStore(db) as store:
        assert last["message"] in store.recovered_message_ids
        conversation = store.list_conversations()[0]
        assert conversation.id == last["conversation"]
        user, answer = store.messages(conversation.id)
        assert user.role == "user" and user.status == "complete"
        assert answer.id == last["message"] and answer.status == "stopped"
        assert answer.stats["stop_reason"] == "interrupted"
        # Everything reported saved is there; at most one more block (saved, then killed before it was reported).
        assert answer.content.startswith(last["content"]) and answer.thinking.startswith(last["thinking"])
        assert len(answer.content) + len(answer.thinking) > 0
        saved_blocks = [r for r in records if r.get("message") == answer.id]
        assert len(saved_blocks) >= BLOCKS_BEFORE_KILL
