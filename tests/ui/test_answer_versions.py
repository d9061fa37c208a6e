"""Answer versions (issue 32): Regenerate and Edit keep the old answer / message as a version, ‹ n/m › switches.

The store (clover_desk.storage, schema 4: a message tree, one chosen version per place), a database written by the
schema before (tests/data/chats_schema3.sql, written by scripts/make_schema3_fixture.py with that schema's code),
and the real window over a real store with a scripted engine client (the real worker: test_gui_versions.py).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from fakes_ui import FakeEngineClient
from PySide6.QtCore import Qt

from clover_desk.qt_compat import guard_pyside_bool_refcounts
from clover_desk.storage.export import conversation_to_markdown
from clover_desk.storage.recorder import StreamRecorder
from clover_desk.storage.schema import SCHEMA_VERSION
from clover_desk.storage.store import ChatStore
from clover_desk.storage.tree import read_chosen_path
from clover_desk.ui.chat_actions import READ_AHEAD_MS
from clover_desk.ui.main_window import MainWindow

guard_pyside_bool_refcounts()

SCHEMA3 = Path(__file__).parent.parent / "data" / "chats_schema3.sql"


def texts(store: ChatStore, cid: int) -> list[str]:
    assert store._path_ids(cid) == read_chosen_path(store._conn, cid)  # the store's cached path is the one on disk
    return [m.content for m in store.messages(cid)]


# ------------------------------------------------------------------------------------------------ the store


def test_a_new_version_keeps_the_old_one_and_the_chat_follows_the_chosen_one(store) -> None:
    c = store.create_conversation("t", system_prompt="sys")
    u1 = store.add_message(c.id, "user", "q1")
    a1 = store.add_message(c.id, "assistant", "long answer, 61 tokens")
    a1b = store.add_message(c.id, "assistant", "short", status="stopped", version_of=a1.id)
    assert texts(store, c.id) == ["q1", "short"]
    assert store.versions(a1.id) == store.versions(a1b.id) == [a1.id, a1b.id]
    # the next turn goes under the chosen answer
    u2 = store.add_message(c.id, "user", "q2 after short")
    store.add_message(c.id, "assistant", "a2")
    store.select_version(a1.id)
    assert texts(store, c.id) == ["q1", "long answer, 61 tokens"]  # that version had no continuation yet
    assert store.chat_messages(c.id) == [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"},
                                         {"role": "assistant", "content": "long answer, 61 tokens"}]
    store.select_version(a1b.id)  # each version kept its own continuation
    assert texts(store, c.id) == ["q1", "short", "q2 after short", "a2"]
    # an edited question is a version too: the old branch stays whole under the old one
    u1b = store.add_message(c.id, "user", "q1, edited", version_of=u1.id)
    store.add_message(c.id, "assistant", "answer to the edit")
    assert texts(store, c.id) == ["q1, edited", "answer to the edit"]
    counts = store.version_counts(c.id)
    assert counts[u1.id] == (1, 2) and counts[u1b.id] == (2, 2) and counts[a1b.id] == (2, 2) and counts[u2.id] == (1, 1)
    store.select_version(u1.id)
    assert texts(store, c.id) == ["q1", "short", "q2 after short", "a2"]
    assert len(store.all_messages(c.id)) == 7


def test_a_tree_that_breaks_the_one_chosen_rule_still_shows_a_chat(store) -> None:
    c = store.create_conversation("t")
    store.add_message(c.id, "user", "q")
    a = store.add_message(c.id, "assistant", "a1")
    b = store.add_message(c.id, "assistant", "a2", version_of=a.id)
    store._conn.execute("UPDATE messages SET selected = 1 WHERE id = ?", (a.id,))  # two chosen (a hand edit)
    store._paths.clear()
    assert texts(store, c.id) == ["q", "a2"]  # the newest chosen one
    store._conn.execute("UPDATE messages SET selected = 0 WHERE id IN (?, ?)", (a.id, b.id))  # none chosen
    store._paths.clear()
    assert texts(store, c.id) == ["q", "a2"]


def test_exports_hold_the_chosen_branch(store, tmp_path) -> None:
    c = store.create_conversation("t")
    store.add_message(c.id, "user", "q")
    a = store.add_message(c.id, "assistant", "first answer")
    b = store.add_message(c.id, "assistant", "second answer", version_of=a.id)
    md = conversation_to_markdown(store.get_conversation(c.id), store.messages(c.id))
    assert "second answer" in md and "first answer" not in md
    store.select_version(a.id)
    data = json.loads(store.export_json(c.id, tmp_path / "x.json").read_text(encoding="utf-8"))
    assert [m["content"] for m in data["messages"]] == ["q", "first answer"]
    assert b.id not in [m["id"] for m in data["messages"]]


def test_continue_branch_and_take_back_work_on_the_chosen_path(store) -> None:
    c = store.create_conversation("t")
    store.add_message(c.id, "user", "q")
    a = store.add_message(c.id, "assistant", "cut", status="stopped", stats={"stop_reason": "cancelled"})
    b = store.add_message(c.id, "assistant", "other", version_of=a.id)
    with pytest.raises(store.Error):
        store.reopen_message(a.id)  # not on the chosen path's end
    store.select_version(a.id)
    assert store.reopen_message(a.id).status == "streaming"
    store.finish_message(a.id, "stopped")
    branch = store.branch_conversation(a.id)
    assert texts(store, branch.id) == ["q", "cut"] and len(store.all_messages(branch.id)) == 2
    # taking back a version (a send that failed) shows the newest one left
    store.select_version(b.id)
    assert texts(store, c.id) == ["q", "other"]
    store.truncate_after(b.id, include=True)
    assert texts(store, c.id) == ["q", "cut"] and store.versions(a.id) == [a.id]


def test_a_schema3_store_migrates_with_every_chat_intact_and_one_version_per_message(tmp_path) -> None:
    path = tmp_path / "chats.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript(SCHEMA3.read_text(encoding="utf-8"))
    before = {cid: [tuple(r) for r in conn.execute(
        "SELECT id, role, content, thinking, thinking_seconds, status, stats FROM messages "
        "WHERE conversation_id = ? ORDER BY id", (cid,))] for (cid,) in conn.execute("SELECT id FROM conversations")}
    titles = dict(conn.execute("SELECT id, title FROM conversations").fetchall())
    conn.close()
    assert sorted(before) == [1, 2, 3, 4] and sum(len(v) for v in before.values()) == 8

    with ChatStore(path) as s:
        assert s.schema_version == SCHEMA_VERSION == 4
        assert s.recovered_message_ids == (10,)  # the crash-cut answer, as before
        assert {c.id: c.title for c in s.list_conversations()} == titles
        for cid, rows in before.items():
            shown = s.messages(cid)
            assert [(m.id, m.role, m.content, m.thinking) for m in shown] == [r[:4] for r in rows]
            assert shown == s.all_messages(cid)  # every message on the path: nothing hidden
            assert all(n == (1, 1) for n in s.version_counts(cid).values())  # one version per message
            assert [m.parent_id for m in shown] == [None, *[m.id for m in shown]][:len(shown)]
        trip = s.messages(1)
        assert trip[1].thinking == "hmm" and trip[1].stats["tokens"] == 61
        assert s.get_conversation(1).system_prompt == "Be brief." and s.get_conversation(1).settings == {
            "temperature": 0.6}
        # and the migrated chat takes versions
        regen = s.add_message(1, "assistant", "Day 3: Cascais.", version_of=trip[-1].id)
        assert s.versions(regen.id) == [trip[-1].id, regen.id]
        assert s._conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


# ------------------------------------------------------------------------------------------------ the window


def make_window(qtbot, store, client=None) -> tuple[MainWindow, FakeEngineClient]:
    client = client or FakeEngineClient(blocks=2, pass_ms=2)
    window = MainWindow(client, store, StreamRecorder, model_dir="/models/tiny")
    qtbot.addWidget(window)
    window.show()
    return window, client


def send(qtbot, window, text: str) -> None:
    window.composer.input.setPlainText(text)
    with qtbot.waitSignal(window.generationFinished, timeout=5000):
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)


def shown(window) -> list[tuple[str, str]]:
    return [(w.data.role, w.data.content) for w in window.chat.widgets]


def test_regenerate_twice_then_switch_with_the_arrows_and_after_a_restart(qtbot, tmp_path) -> None:
    path = tmp_path / "chats.sqlite3"
    store = ChatStore(path)
    client = FakeEngineClient(blocks=2, pass_ms=2, answer="answer one")
    window, _ = make_window(qtbot, store, client)
    send(qtbot, window, "hello")
    for answer in ("answer two", "answer three"):
        client.answer = answer
        with qtbot.waitSignal(window.generationFinished, timeout=5000):
            window.chat.widgets[-1].regen_button.click()
    last = window.chat.widgets[-1]
    assert shown(window) == [("user", "hello"), ("assistant", "answer three")]
    assert last.version_label.text() == "3/3" and last.version_label.isVisible()
    assert last.version_prev.isEnabled() and not last.version_next.isEnabled()
    assert not window.chat.widgets[0].version_label.isVisible()  # one version: no arrows
    # every regenerate sent the same chat: the question, never an old answer
    assert [r[0] for r in client.requests] == [[{"role": "user", "content": "hello"}]] * 3

    qtbot.waitUntil(lambda: bool(client.reads) and client.reads[-1][0][-1]["content"] == "answer three",
                    timeout=READ_AHEAD_MS + 3000)  # read ahead after the answer ended
    reads = len(client.reads)
    window.chat.widgets[-1].version_prev.click()
    assert shown(window)[-1] == ("assistant", "answer two") and window.chat.widgets[-1].version_label.text() == "2/3"
    window.chat.widgets[-1].version_prev.click()
    assert shown(window)[-1] == ("assistant", "answer one")
    assert not window.chat.widgets[-1].version_prev.isEnabled()
    # the engine reads the chosen version ahead (its prompt cache), and the next message goes on from it
    chosen = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "answer one"}]
    qtbot.waitUntil(lambda: len(client.reads) > reads and client.reads[-1][0] == chosen, timeout=READ_AHEAD_MS + 3000)
    client.answer = "follow-up answer"
    send(qtbot, window, "and then?")
    assert client.requests[-1][0] == [{"role": "user", "content": "hello"},
                                      {"role": "assistant", "content": "answer one"},
                                      {"role": "user", "content": "and then?"}]
    window.close()
    store.close()

    store = ChatStore(path)  # the app again
    window, _ = make_window(qtbot, store)
    window.conversations.open(store.list_conversations()[0].id)
    assert shown(window) == [("user", "hello"), ("assistant", "answer one"), ("user", "and then?"),
                             ("assistant", "follow-up answer")]
    assert window.chat.widgets[1].version_label.text() == "1/3"
    window.chat.widgets[1].version_next.click()
    window.chat.widgets[1].version_next.click()
    assert shown(window) == [("user", "hello"), ("assistant", "answer three")]
    window.chat.widgets[1].version_prev.click()
    window.chat.widgets[1].version_prev.click()
    assert len(window.chat.widgets) == 4  # that version's follow-up is still under it
    store.close()


def test_editing_an_older_message_keeps_the_old_branch_behind_the_user_arrows(qtbot, store, tmp_path) -> None:
    client = FakeEngineClient(blocks=2, pass_ms=2, answer="first")
    window, _ = make_window(qtbot, store, client)
    send(qtbot, window, "q1")
    client.answer = "second"
    send(qtbot, window, "q2")
    window.chat.widgets[0].edit_button.click()
    client.answer = "edited answer"
    send(qtbot, window, "q1 edited")
    assert shown(window) == [("user", "q1 edited"), ("assistant", "edited answer")]
    user = window.chat.widgets[0]
    assert user.version_label.text() == "2/2"
    assert client.requests[-1][0] == [{"role": "user", "content": "q1 edited"}]
    user.version_prev.click()
    assert shown(window) == [("user", "q1"), ("assistant", "first"), ("user", "q2"), ("assistant", "second")]
    out = window.conversations.export(window.conversation_id, "markdown", str(tmp_path / "chat.md"))
    md = out.read_text(encoding="utf-8")
    assert "q2" in md and "edited" not in md


def test_no_switching_while_an_answer_streams(qtbot, store) -> None:
    client = FakeEngineClient(blocks=2, pass_ms=2, answer="one")
    window, _ = make_window(qtbot, store, client)
    send(qtbot, window, "q")
    with qtbot.waitSignal(window.generationFinished, timeout=5000):
        window.chat.widgets[-1].regen_button.click()
        assert not window.chat.widgets[-1].version_prev.isEnabled()  # the streaming one
        window.chat_actions.on_version_requested(window.chat.widgets[0].data, 1)  # nothing to switch on a one-version message
        assert window.chat.widgets[-1].data.status == "streaming"
    assert window.chat.widgets[-1].version_label.text() == "2/2"
