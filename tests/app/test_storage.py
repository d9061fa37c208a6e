"""ChatStore on a real SQLite file: CRUD, search, export, migrations, crash recovery."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from clover_desk import paths
from clover_desk.engine.decode.events import BlockCommitted, EngineError, Finished, PromptInfo, TextDelta
from clover_desk.engine.files import atomic_write_text
from clover_desk.storage.errors import NotFoundError, StorageError
from clover_desk.storage.recorder import StreamRecorder
from clover_desk.storage.records import title_from_text
from clover_desk.storage.schema import MIGRATIONS, SCHEMA_VERSION
from clover_desk.storage.store import ChatStore


def _old_database(path: Path, version: int) -> None:
    """A database as an older Clover Desk left it: migrations up to ``version`` only."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(
        "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, description TEXT NOT NULL, applied REAL NOT NULL)"
    )
    for v, description, statements in MIGRATIONS:
        if v > version:
            break
        for s in statements:
            conn.execute(s)
        conn.execute("INSERT INTO schema_migrations VALUES (?, ?, ?)", (v, description, time.time()))
    conn.close()


def test_open_sets_wal_foreign_keys_and_schema(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "chats.sqlite3"
    with ChatStore(path) as s:
        assert s.schema_version == SCHEMA_VERSION
        assert s._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert s._conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        versions = [r[0] for r in s._conn.execute("SELECT version FROM schema_migrations ORDER BY version")]
        assert versions == [m[0] for m in MIGRATIONS]
        assert s._conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    # Reopening runs no migration twice.
    with ChatStore(path) as s:
        assert s.schema_version == SCHEMA_VERSION
        assert s.recovered_message_ids == ()


def test_conversation_crud_and_order(store: ChatStore) -> None:
    a = store.create_conversation("first", system_prompt="be brief", settings={"temperature": 0.7})
    b = store.create_conversation()
    assert b.title == "New chat"
    assert a.settings == {"temperature": 0.7} and a.system_prompt == "be brief"
    assert [c.id for c in store.list_conversations()] == [b.id, a.id]

    store.add_message(a.id, "user", "hello")  # activity moves a to the top
    assert [c.id for c in store.list_conversations()] == [a.id, b.id]
    assert [c.id for c in store.list_conversations(limit=1)] == [a.id]

    renamed = store.rename_conversation(b.id, "second")
    assert renamed.title == "second" and renamed.updated > b.updated
    assert store.list_conversations()[0].id == b.id
    updated = store.update_conversation(a.id, settings={"mode": "ar"}, system_prompt="")
    assert updated.settings == {"mode": "ar"} and updated.system_prompt == "" and updated.title == "first"

    store.delete_conversation(a.id)
    assert [c.id for c in store.list_conversations()] == [b.id]
    # Messages went with it (ON DELETE CASCADE under foreign_keys=ON).
    assert store._conn.execute("SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (a.id,)).fetchone()[0] == 0
    with pytest.raises(NotFoundError):
        store.get_conversation(a.id)
    with pytest.raises(NotFoundError):
        store.delete_conversation(a.id)
    with pytest.raises(NotFoundError):
        store.rename_conversation(9999, "x")
    with pytest.raises(NotFoundError):
        store.add_message(9999, "user", "orphan")


def test_messages_streaming_finish_edit_truncate(store: ChatStore) -> None:
    c = store.create_conversation("chat")
    u = store.add_message(c.id, "user", "What is 2+2?")
    a = store.add_message(c.id, "assistant", status="streaming")
    store.append_streaming(a.id, thinking_delta="Two plus ")
    store.append_streaming(a.id, thinking_delta="two.", answer_delta="It is ")
    store.append_streaming(a.id, answer_delta="4.")
    store.append_streaming(a.id)  # nothing to add: no transaction, no error
    m = store.get_message(a.id)
    assert (m.content, m.thinking, m.status) == ("It is 4.", "Two plus two.", "streaming")

    done = store.finish_message(a.id, stats={"tokens_per_s": 12.5, "stop_reason": "eos"}, thinking_seconds=1.25)
    assert done.status == "complete" and done.stats["tokens_per_s"] == 12.5 and done.thinking_seconds == 1.25
    with pytest.raises(StorageError):
        store.append_streaming(a.id, answer_delta="late")  # only streaming messages grow
    with pytest.raises(ValueError):
        store.finish_message(a.id, status="streaming")
    with pytest.raises(ValueError):
        store.add_message(c.id, "robot", "x")

    u2 = store.add_message(c.id, "user", "and 3+3?")
    store.add_message(c.id, "assistant", "6")
    assert store.chat_messages(c.id) == [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    # Edit-and-resend: the edited message stays, everything after it goes.
    assert store.edit_message(u2.id, "and 5+5?") == 1
    assert [m.content for m in store.messages(c.id)] == ["What is 2+2?", "It is 4.", "and 5+5?"]
    # Regenerate: drop the answer itself too.
    assert store.truncate_after(a.id, include=True) == 2
    assert [m.id for m in store.messages(c.id)] == [u.id]


def test_search_titles_and_text(store: ChatStore) -> None:
    a = store.create_conversation("Pasta recipes")
    b = store.create_conversation("Physics")
    store.add_message(b.id, "user", "Explain the Higgs boson in simple words, please, with an analogy.")
    m = store.add_message(b.id, "assistant", "Think of a crowded room…", thinking="user wants a PASTA analogy?")
    c = store.create_conversation("Odd 100%_match")

    hits = store.search("pasta")
    assert [h.conversation.id for h in hits] == [b.id, a.id]  # most recent first; thinking text counts
    assert hits[0].message_id == m.id and "PASTA" in hits[0].snippet
    assert hits[1].message_id is None and hits[1].snippet == "Pasta recipes"
    higgs = store.search("higgs BOSON")
    assert [h.conversation.id for h in higgs] == [b.id] and "Higgs boson" in higgs[0].snippet
    # LIKE wildcards in the query are literal.
    assert [h.conversation.id for h in store.search("100%_")] == [c.id]
    assert [h.conversation.id for h in store.search("%")] == [c.id]
    assert store.search("no such words") == []
    assert len(store.search("  ")) == 3


def test_export_markdown_and_json(store: ChatStore, tmp_path: Path) -> None:
    c = store.create_conversation("Export me", system_prompt="You are terse.\nVery terse.")
    store.add_message(c.id, "user", "Say *hi*")
    a = store.add_message(c.id, "assistant", status="streaming")
    store.append_streaming(a.id, answer_delta="hi", thinking_delta="greet")
    store.finish_message(a.id, status="stopped", stats={"stop_reason": "cancelled"}, thinking_seconds=0.5)

    md_path = store.export_markdown(c.id, tmp_path / "out" / "chat.md")
    md = md_path.read_text(encoding="utf-8")
    assert md.startswith("# Export me\n")
    assert "> You are terse.\n> Very terse." in md
    assert "## User\n\nSay *hi*" in md
    assert "<summary>Thinking (0.5 s)</summary>" in md and "greet" in md
    assert "*[stopped: cancelled]*" in md

    js_path = store.export_json(c.id, tmp_path / "out" / "chat.json")
    data = json.loads(js_path.read_text(encoding="utf-8"))
    assert data["format"] == "clover-desk-chat" and data["conversation"]["title"] == "Export me"
    assert [(m["role"], m["content"], m["status"]) for m in data["messages"]] == [
        ("user", "Say *hi*", "complete"),
        ("assistant", "hi", "stopped"),
    ]
    # No temporary files left behind.
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["chat.json", "chat.md"]


def test_atomic_write_replaces_whole_file(tmp_path: Path) -> None:
    target = tmp_path / "f.txt"
    atomic_write_text(target, "old contents")
    atomic_write_text(target, "new")
    assert target.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_streaming_message_left_by_a_crash_becomes_stopped(tmp_path: Path) -> None:
    path = tmp_path / "chats.sqlite3"
    s = ChatStore(path)
    c = s.create_conversation("crashy")
    s.add_message(c.id, "user", "tell me a story")
    a = s.add_message(c.id, "assistant", status="streaming")
    s.append_streaming(a.id, answer_delta="Once upon", thinking_delta="story time")
    s.append_streaming(a.id, answer_delta=" a time")
    # No finish_message: the process "dies" here, which also drops its lock (a real SIGKILL is in
    # test_persistence_kill.py; a live holder is never recovered: test_storage_robust.py).
    s.close()

    with ChatStore(path) as s2:
        assert s2.recovered_message_ids == (a.id,)
        m = s2.get_message(a.id)
        assert (m.status, m.content, m.thinking) == ("stopped", "Once upon a time", "story time")
        assert m.stats["stop_reason"] == "interrupted"
    with ChatStore(path) as s3:
        assert s3.recovered_message_ids == ()


def test_migrates_an_older_database_keeping_data(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    _old_database(path, version=1)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("INSERT INTO conversations (id, title, created, updated) VALUES (7, 'kept', 1.0, 2.0)")
    conn.execute(
        "INSERT INTO messages (conversation_id, role, content, status, created) VALUES (7, 'user', 'hi', 'complete', 1.5)"
    )
    conn.close()

    with ChatStore(path) as s:
        assert s.schema_version == SCHEMA_VERSION
        assert [c.title for c in s.list_conversations()] == ["kept"]
        assert [m.content for m in s.messages(7)] == ["hi"]
        indexes = {r[0] for r in s._conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert {"messages_by_conversation", "conversations_by_updated"} <= indexes


def test_message_ids_are_never_reused(store: ChatStore) -> None:
    # A message id names the preview's document (and so the origin holding a page's storage): deleting the newest
    # message, or its whole chat, must not hand its id to the next answer.
    c = store.create_conversation("a")
    store.add_message(c.id, "user", "q")
    newest = store.add_message(c.id, "assistant", "<html>page one</html>")
    store.truncate_after(newest.id, include=True)
    again = store.add_message(c.id, "assistant", "<html>page two</html>")
    assert again.id > newest.id
    store.delete_conversation(c.id)
    d = store.create_conversation("b")
    assert store.add_message(d.id, "user", "x").id > again.id
    last = store.add_message(d.id, "assistant", "w")
    store.edit_message(store.messages(d.id)[0].id, "x2")  # edit-and-resend deletes the later ones, the newest too
    assert store.add_message(d.id, "assistant", "v").id > last.id


def test_migration_to_autoincrement_keeps_every_row_and_stops_id_reuse(tmp_path: Path) -> None:
    """A schema-2 file (plain rowids) with real data: after the migration every row is the same, ids included,
    the indexes and the cascade still work, and ids no longer come back."""
    path = tmp_path / "v2.sqlite3"
    _old_database(path, version=2)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("INSERT INTO conversations (id, title, created, updated, system_prompt, settings) "
                 "VALUES (3, 'old chat', 1.0, 2.0, 'be brief', '{\"temperature\": 0.5}')")
    conn.execute("INSERT INTO conversations (id, title, created, updated) VALUES (4, 'other', 1.0, 3.0)")
    rows = [
        (1, 3, "user", "make a page", "", None, "complete", "{}", 1.1),
        (2, 3, "assistant", "```html\n<p>one</p>\n```", "thinking…", 0.75, "complete", '{"tokens": 9}', 1.2),
        (5, 4, "user", "hi", "", None, "complete", "{}", 1.3),
        (6, 4, "assistant", "half an answ", "", None, "streaming", "{}", 1.4),  # left by a crash
        (7, 3, "assistant", "newest, then deleted", "", None, "complete", "{}", 1.5),
    ]
    conn.executemany("INSERT INTO messages VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    conn.execute("DELETE FROM messages WHERE id = 7")
    # The old schema's flaw, on this very file: the deleted newest id comes back.
    assert conn.execute("INSERT INTO messages (conversation_id, role, created) VALUES (3, 'user', 2.0)").lastrowid == 7
    conn.execute("DELETE FROM messages WHERE id = 7")
    before = conn.execute("SELECT * FROM messages ORDER BY id").fetchall()
    conn.close()

    with ChatStore(path) as s:
        assert s.schema_version == SCHEMA_VERSION == 4  # 3, then 4 (answer versions: test_answer_versions.py)
        assert s._conn.execute("PRAGMA user_version").fetchone()[0] == 4
        sql = s._conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'messages'").fetchone()[0]
        assert "AUTOINCREMENT" in sql
        assert s._conn.execute("SELECT name FROM sqlite_master WHERE name = 'messages_v3'").fetchone() is None
        after = [tuple(r)[:9] for r in s._conn.execute("SELECT * FROM messages ORDER BY id")]  # v3's columns
        # The crash-interrupted answer was recovered as usual (after the migration); everything else is untouched.
        assert s.recovered_message_ids == (6,)
        assert [r for r in after if r[0] != 6] == [r for r in before if r[0] != 6]
        recovered = s.get_message(6)
        assert (recovered.content, recovered.status, recovered.stats) == ("half an answ", "stopped",
                                                                          {"stop_reason": "interrupted"})
        m2 = s.get_message(2)
        assert (m2.thinking, m2.thinking_seconds, m2.stats) == ("thinking…", 0.75, {"tokens": 9})
        assert s.get_conversation(3).settings == {"temperature": 0.5}
        indexes = {r[0] for r in s._conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert {"messages_by_conversation", "messages_streaming", "conversations_by_updated"} <= indexes
        plan = " ".join(str(r[-1]) for r in s._conn.execute(
            "EXPLAIN QUERY PLAN SELECT * FROM messages WHERE conversation_id = 3 ORDER BY id"))
        assert "messages_by_conversation" in plan

        # New ids continue after the largest kept, and a deleted newest id never comes back.
        new = s.add_message(3, "assistant", "a new page")
        assert new.id == 7  # 7 was only ever used before this run: nothing outside the file remembers it
        s.truncate_after(new.id, include=True)
        assert s.add_message(3, "assistant", "another page").id == 8
        # The foreign key and its cascade survived the rebuild.
        with pytest.raises(NotFoundError):
            s.add_message(99, "user", "orphan")
        s.delete_conversation(4)
        assert s._conn.execute("SELECT COUNT(*) FROM messages WHERE conversation_id = 4").fetchone()[0] == 0
        assert s._conn.execute("PRAGMA foreign_key_check").fetchall() == []
        assert s._conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with ChatStore(path) as s:  # reopening migrates nothing again and keeps the sequence
        assert [r[0] for r in s._conn.execute("SELECT version FROM schema_migrations ORDER BY version")] == [1, 2, 3, 4]
        assert s.add_message(3, "user", "later").id == 9


def test_refuses_a_newer_schema_and_a_non_database(tmp_path: Path) -> None:
    path = tmp_path / "future.sqlite3"
    _old_database(path, version=SCHEMA_VERSION)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("INSERT INTO schema_migrations VALUES (?, 'from the future', 0)", (SCHEMA_VERSION + 1,))
    conn.close()
    with pytest.raises(StorageError, match="newer"):
        ChatStore(path)

    junk = tmp_path / "junk.sqlite3"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StorageError, match="unreadable"):
        ChatStore(junk)


def test_store_refuses_other_threads(store: ChatStore) -> None:
    errors: list[BaseException] = []

    def other() -> None:
        try:
            store.list_conversations()
        except sqlite3.ProgrammingError as exc:
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1


def test_title_from_text() -> None:
    assert title_from_text("\n  Why is the sky blue?\nmore") == "Why is the sky blue?"
    assert title_from_text("") == "New chat"
    long = title_from_text("word " * 40, max_chars=20)
    assert long.endswith("…") and len(long) <= 21


@pytest.mark.parametrize(
    ("platform", "env", "expected"),
    [
        ("linux", {}, ".local/share/clover-desk"),
        ("linux", {"XDG_DATA_HOME": "/xdg"}, "/xdg/clover-desk"),
        ("linux", {"XDG_DATA_HOME": "relative"}, ".local/share/clover-desk"),
        ("darwin", {}, "Library/Application Support/Clover Desk"),
        ("win32", {"APPDATA": "C:/Users/u/AppData/Roaming"}, "C:/Users/u/AppData/Roaming/Clover Desk"),
        ("linux", {"CLOVER_DESK_HOME": "/custom", "XDG_DATA_HOME": "/xdg"}, "/custom"),
    ],
)
def test_app_data_dir_per_platform(platform: str, env: dict[str, str], expected: str) -> None:
    home = Path("/home/u")
    got = paths.default_app_data_dir(env=env, platform=platform, home=home)
    want = Path(expected) if Path(expected).is_absolute() or ":" in expected else home / expected
    assert got == want


def test_chats_db_path_honours_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path / "home"))
    db = paths.chats_db_path()
    assert db == tmp_path / "home" / "chats.sqlite3" and db.parent.is_dir()
    assert paths.models_dir() == tmp_path / "home" / "models"


def _finished(text: str, thinking: str, reason: str) -> Finished:
    return Finished(
        token_ids=(1, 2), text=text, thinking=thinking, stop_reason=reason, tokens=2, passes=3, tokens_per_pass=0.67,
        tokens_per_s=9.0, time_to_first_token_s=0.1, prompt_tokens=5, prefill_s=0.01, decode_s=0.2, cached_tokens=4,
    )


def test_stream_recorder_saves_each_committed_block(store: ChatStore) -> None:
    clock = iter(float(t) for t in range(100))
    c = store.create_conversation()
    m = store.add_message(c.id, "assistant", status="streaming")
    rec = StreamRecorder(store, m.id, flush_interval_s=1000, clock=lambda: next(clock))
    rec.on_event(PromptInfo(prompt_tokens=5, block_size=4, first_block=1, tail=1))
    rec.on_event(TextDelta("hmm ", "thinking"))
    assert store.get_message(m.id).thinking == ""  # buffered until the block commits
    rec.on_event(BlockCommitted(1, 3, (7, 8)))
    assert store.get_message(m.id).thinking == "hmm " and rec.blocks_saved == 1
    rec.on_event(TextDelta("Hi", "answer"))
    rec.on_event(BlockCommitted(2, 2, (9,)))
    assert store.get_message(m.id).content == "Hi"
    assert rec.on_event(_finished("Hi!", "hmm ", "eos")) is True
    done = store.get_message(m.id)
    assert (done.status, done.content, done.thinking) == ("complete", "Hi!", "hmm ")
    assert done.stats["tokens_per_s"] == 9.0 and done.stats["stop_reason"] == "eos"
    assert done.stats["cached_tokens"] == 4  # what the prompt cache held of the prompt (the stats line's tooltip)
    assert done.thinking_seconds is not None and done.thinking_seconds > 0


def test_stream_recorder_ar_mode_and_errors(store: ChatStore) -> None:
    now = [0.0]
    c = store.create_conversation()
    m = store.add_message(c.id, "assistant", status="streaming")
    rec = StreamRecorder(store, m.id, flush_interval_s=0.5, clock=lambda: now[0])
    rec.on_event(TextDelta("a"))
    now[0] = 0.6
    rec.on_event(TextDelta("b"))  # no block events in AR mode: flushed by time
    assert store.get_message(m.id).content == "ab"
    rec.on_event(TextDelta("c"))
    rec.on_event(EngineError(kind="WorkerCrashed", message="killed by SIGKILL"))
    failed = store.get_message(m.id)
    assert (failed.status, failed.content) == ("error", "abc")
    assert failed.stats["error"].startswith("WorkerCrashed")

    m2 = store.add_message(c.id, "assistant", status="streaming")
    rec2 = StreamRecorder(store, m2.id)
    rec2.on_event(TextDelta("partial"))
    rec2.on_event(_finished("partial", "", "cancelled"))
    assert store.get_message(m2.id).status == "stopped"


def test_reopen_only_the_last_answer_that_is_complete_or_stopped(store: ChatStore) -> None:
    c = store.create_conversation()
    u = store.add_message(c.id, "user", "count")
    a = store.add_message(c.id, "assistant", "one two", status="stopped", stats={"stop_reason": "cancelled"})
    with pytest.raises(StorageError,
                       match=f"message {u.id} cannot be continued.*role 'user', status 'complete', not the last"):
        store.reopen_message(u.id)
    reopened = store.reopen_message(a.id)
    assert (reopened.status, reopened.content) == ("streaming", "one two")
    assert store.chat_messages(c.id) == [{"role": "user", "content": "count"}]  # what the engine is sent before it
    with pytest.raises(StorageError, match="role 'assistant', status 'streaming'\\)"):
        store.reopen_message(a.id)  # already being written
    store.finish_message(a.id, "error", stats={"error": "boom"})
    with pytest.raises(StorageError, match="status 'error'"):
        store.reopen_message(a.id)  # a failed answer is regenerated, not continued
    with pytest.raises(NotFoundError):
        store.reopen_message(a.id + 100)


def test_stream_recorder_continues_a_reopened_answer(store: ChatStore) -> None:
    clock = iter(float(t) for t in range(100))
    c = store.create_conversation()
    store.add_message(c.id, "user", "count")
    before = {"stop_reason": "max_new_tokens", "tokens": 16, "passes": 8, "decode_s": 2.0, "prefill_s": 0.5,
              "tokens_per_s": 8.0, "time_to_first_token_s": 0.7, "prompt_tokens": 12, "mode": "diffusion"}
    a = store.add_message(c.id, "assistant", "", thinking="t1 t2", thinking_seconds=3.0, status="complete",
                          stats=before)
    store.reopen_message(a.id)
    rec = StreamRecorder(store, a.id, flush_interval_s=1000, clock=lambda: next(clock))
    rec.on_event(PromptInfo(prompt_tokens=20, block_size=4, first_block=5, tail=0))
    rec.on_event(TextDelta(" t3", "thinking"))
    rec.on_event(TextDelta("Three.", "answer"))
    rec.on_event(BlockCommitted(5, 2, (1, 2, 3)))
    assert store.get_message(a.id).content == "Three." and store.get_message(a.id).thinking == "t1 t2 t3"
    rec.on_event(_finished("Three.", " t3", "eos"))
    done = store.get_message(a.id)
    assert (done.status, done.content, done.thinking) == ("complete", "Three.", "t1 t2 t3")
    assert done.thinking_seconds is not None and done.thinking_seconds > 3.0  # the earlier thinking time, plus
    s = done.stats
    assert (s["stop_reason"], s["continued"], s["tokens"], s["prompt_tokens"], s["time_to_first_token_s"]) == (
        "eos", 1, 16 + 2, 12, 0.7)
    assert s["decode_s"] == pytest.approx(2.2) and s["tokens_per_s"] == pytest.approx(18 / 2.2, abs=1e-3)
    assert s["passes"] == 8 + 3 and s["tokens_per_pass"] == pytest.approx(18 / 11, abs=1e-3)


def test_a_crash_while_continuing_keeps_the_whole_answer(tmp_path: Path) -> None:
    path = tmp_path / "chats.sqlite3"
    s = ChatStore(path)
    c = s.create_conversation()
    s.add_message(c.id, "user", "count")
    a = s.add_message(c.id, "assistant", "one two", status="complete", stats={"stop_reason": "max_new_tokens"})
    s.reopen_message(a.id)
    rec = StreamRecorder(s, a.id)
    rec.on_event(TextDelta(" three", "answer"))
    rec.on_event(BlockCommitted(0, 1, (1,)))
    s.close()  # the process dies here
    with ChatStore(path) as again:
        m = again.get_message(a.id)
        assert (m.status, m.content, m.stats["stop_reason"]) == ("stopped", "one two three", "interrupted")
        again.reopen_message(a.id)  # and it can be continued again


def test_branch_copies_the_chat_up_to_a_message(store: ChatStore) -> None:
    c = store.create_conversation("Trip plan", system_prompt="Be brief", settings={"temperature": 0.7})
    u1 = store.add_message(c.id, "user", "Where to?")
    a1 = store.add_message(c.id, "assistant", "Lisbon.", thinking="sunny", thinking_seconds=1.5,
                           stats={"tokens": 3, "stop_reason": "eos"})
    store.add_message(c.id, "user", "And after?")
    store.add_message(c.id, "assistant", "Porto.")
    branch = store.branch_conversation(a1.id)
    assert (branch.title, branch.system_prompt, branch.settings) == ("Trip plan (branch)", "Be brief",
                                                                     {"temperature": 0.7})
    copied = store.messages(branch.id)
    assert [(m.role, m.content, m.thinking, m.thinking_seconds, m.stats) for m in copied] == [
        ("user", "Where to?", "", None, {}), ("assistant", "Lisbon.", "sunny", 1.5, {"tokens": 3, "stop_reason": "eos"})]
    assert copied[0].id > a1.id  # new rows: the branch and the original never share a message
    assert [m.content for m in store.messages(c.id)] == ["Where to?", "Lisbon.", "And after?", "Porto."]
    again = store.branch_conversation(store.messages(branch.id)[0].id)  # a branch of the branch
    assert again.title == "Trip plan (branch 2)" and [m.id for m in store.messages(again.id)] != [u1.id]
    assert store.branch_conversation(store.messages(again.id)[0].id).title == "Trip plan (branch 3)"
    streaming = store.add_message(c.id, "assistant", "half", status="streaming")
    assert [m.content for m in store.messages(store.branch_conversation(streaming.id).id)][-1] == "Porto."
    with pytest.raises(NotFoundError):
        store.branch_conversation(10_000)
