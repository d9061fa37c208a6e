"""The chat session (ui.chat_session), the window's controller, without widgets: a fake engine client, a plain
fake view and the real ChatStore (SQLite in tmp_path) with its real StreamRecorder. Send -> stream -> finish, Stop
mid-answer keeping the committed text, Regenerate adding a version, Continue, failures, a save failing mid-answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clover_desk.engine.decode.events import BlockCommitted, EngineError, Finished, GenerationParams, TextDelta
from clover_desk.storage.errors import StorageError
from clover_desk.storage.recorder import StreamRecorder
from clover_desk.storage.store import ChatStore
from clover_desk.ui.chat_session import ChatSession, Ending
from clover_desk.ui.generation import GenerationSettings
from clover_desk.ui.messages import MessageData

ROOT = Path(__file__).resolve().parents[2]


def finished(text: str, reason: str = "eos", thinking: str = "", tokens: int = 4) -> Finished:
    return Finished(token_ids=tuple(range(tokens)), text=text, thinking=thinking, stop_reason=reason, tokens=tokens,
                    passes=2, tokens_per_pass=tokens / 2, tokens_per_s=20.0, time_to_first_token_s=0.1,
                    prompt_tokens=9, prefill_s=0.01, decode_s=0.2, accounting={"hits": 3, "misses": 1})


class FakeEngine:
    """The engine client's request side (generate / cancel), recording; events are handed in by the test."""

    def __init__(self) -> None:
        self.requests: list[tuple[list[dict], GenerationParams]] = []
        self.cancelled: list[str] = []

    def generate(self, messages, params, tools=None) -> str:  # noqa: ANN001
        self.requests.append((list(messages), params))
        return f"r{len(self.requests)}"

    def cancel(self, request_id: str | None = None) -> None:
        self.cancelled.append(str(request_id))


class FakeView:
    """The session's view as plain lists: the messages on show and what it was told."""

    def __init__(self, store: ChatStore, settings: GenerationSettings | None = None) -> None:
        self.store = store
        self.settings = settings or GenerationSettings(mode="diffusion", max_new_tokens=64)
        self.messages: list[MessageData] = []
        self.started: list[tuple[str, str, bool]] = []
        self.events: list[object] = []
        self.ended: list[tuple[str, str, MessageData]] = []
        self.errors: list[str] = []
        self.notices: list[str] = []
        self.created: list[int] = []
        self.source: object | None = None  # another answerer (a remote runner); None: the session's client

    def generation_settings(self) -> GenerationSettings:
        return self.settings

    def system_prompt_text(self) -> str:
        return "Be brief."

    def messages_to_send(self, conversation_id: int) -> list[dict]:
        return self.store.chat_messages(conversation_id)

    def request_source(self) -> object:
        return self.source or self.engine

    def shown_messages(self) -> list[MessageData]:
        return list(self.messages)

    def show_message(self, data: MessageData) -> None:
        self.messages.append(data)

    def remove_from(self, data: MessageData) -> None:
        del self.messages[self.messages.index(data):]

    def resume_stream(self, data: MessageData) -> None:
        assert data is self.messages[-1]

    def show_chosen_versions(self) -> None:
        self.messages = [MessageData(m.role, m.content, m.thinking, None, m.status, dict(m.stats), m.id)
                         for m in self.store.messages(self.conversation_id) if m.role in ("user", "assistant")]

    def conversation_created(self, conversation_id: int, title: str) -> None:
        self.created.append(conversation_id)
        self.conversation_id = conversation_id

    def answer_started(self, request_id: str, data: MessageData, mode: str, remote: bool) -> None:
        self.started.append((request_id, mode, remote))

    def answer_event(self, event: object) -> None:
        self.events.append(event)

    def answer_ended(self, request_id: str, reason: str, data: MessageData) -> None:
        self.ended.append((request_id, reason, data))

    def save_failed(self, error: BaseException, what: str) -> None:
        self.errors.append(f"{what}: {error}")

    def notice(self, text: str) -> None:
        self.notices.append(text)


class FlakyStore(ChatStore):
    """The real store, whose saves fail on demand as on a full disk: the streaming appends, or a new answer."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.full_for_appends = False
        self.full_for_answers = False

    def append_streaming(self, message_id: int, answer_delta: str = "", thinking_delta: str = "") -> None:
        if self.full_for_appends:
            raise StorageError("disk full")
        super().append_streaming(message_id, answer_delta, thinking_delta)

    def add_message(self, conversation_id: int, role: str, content: str, **kw):  # noqa: ANN003, ANN201
        if self.full_for_answers and role == "assistant":
            raise StorageError("disk full")
        return super().add_message(conversation_id, role, content, **kw)


@pytest.fixture
def store(tmp_path):
    with FlakyStore(tmp_path / "chats.sqlite3") as s:
        yield s


@pytest.fixture
def parts(store):
    engine = FakeEngine()
    view = FakeView(store)
    view.engine = engine
    return ChatSession(engine, store, StreamRecorder, view), engine, view


def stream(session: ChatSession, *events: object) -> None:
    for event in events:
        session.on_event(str(session.request_id), event)


def answer(store: ChatStore, session: ChatSession):  # noqa: ANN201
    return store.messages(session.conversation_id)[-1]


def test_the_controller_imports_no_widget_module() -> None:
    """This module and the controller load without QtWidgets (a fresh interpreter)."""
    code = ("import json, sys; sys.path.insert(0, 'tests/ui'); import clover_desk.ui.chat_session, test_chat_session; "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, QT_QPA_PLATFORM="offscreen"),
                         capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "clover_desk.ui.chat_session" in loaded
    assert "PySide6.QtWidgets" not in loaded and "PySide6.QtGui" not in loaded


def test_send_streams_and_finishes(parts, store) -> None:
    session, engine, view = parts
    assert session.send("What is block diffusion?")
    assert view.created == [session.conversation_id] and session.generating
    (messages, params), = engine.requests
    assert messages[-1] == {"role": "user", "content": "What is block diffusion?"} and params.mode == "diffusion"
    assert view.started == [("r1", "diffusion", False)]
    reply = session.reply_data
    assert reply is not None and reply.status == "streaming" and view.messages[-1] is reply
    stream(session, TextDelta("plan", "thinking"), TextDelta("Slots are"), BlockCommitted(0, 2, (1, 2)))
    assert (reply.content, reply.thinking) == ("Slots are", "plan")
    assert store.messages(session.conversation_id)[-1].content == "Slots are"  # saved per committed block
    stream(session, TextDelta(" filled."), BlockCommitted(1, 2, (3, 4)), finished("Slots are filled.", thinking="plan"))
    assert not session.generating and session.reply_data is None
    assert view.ended == [("r1", "eos", reply)]
    assert (reply.status, reply.content, reply.stats["stop_reason"]) == ("complete", "Slots are filled.", "eos")
    saved = answer(store, session)
    assert (saved.status, saved.content, saved.thinking) == ("complete", "Slots are filled.", "plan")
    assert session.last_tok_s == 20.0 and session.last_hit_rate == 0.75 and not session.last_tok_s_remote
    stream(session, TextDelta(" late"))  # after the end: ignored
    assert reply.content == "Slots are filled."


def test_stop_mid_answer_keeps_the_committed_text(parts, store) -> None:
    session, engine, view = parts
    session.send("Count to ten")
    stream(session, TextDelta("one two"), BlockCommitted(0, 3, (1, 2)))
    assert session.stop() and engine.cancelled == ["r1"]
    stream(session, finished("one two", reason="cancelled", tokens=2))
    data = view.ended[-1][2]
    assert view.ended[-1][1] == "cancelled" and (data.status, data.content) == ("stopped", "one two")
    saved = answer(store, session)
    assert (saved.status, saved.content, saved.stats["stop_reason"]) == ("stopped", "one two", "cancelled")
    assert session.answer_to_continue() is data  # cut short with text: Continue can go on
    assert not session.stop()  # nothing in flight


def test_regenerate_adds_a_version_and_keeps_the_old_one(parts, store) -> None:
    session, engine, view = parts
    session.send("Name a colour")
    stream(session, TextDelta("Red"), finished("Red"))
    first = view.messages[-1]
    session.regenerate(first)
    assert session.generating and first not in view.messages
    assert engine.requests[-1][0][-1] == {"role": "user", "content": "Name a colour"}  # not the old answer
    stream(session, TextDelta("Blue"), finished("Blue"))
    second = view.messages[-1]
    assert (second.content, second.version, second.versions) == ("Blue", 2, 2)
    ids = store.versions(second.message_id)
    assert len(ids) == 2 and store.get_message(ids[0]).content == "Red"
    assert session.step_version(second, -1) and answer(store, session).content == "Red"  # the old one, chosen
    assert not session.step_version(second, -5)


def test_continue_goes_on_with_the_same_answer(parts, store) -> None:
    session, engine, view = parts
    session.send("Tell a story")
    stream(session, TextDelta("Once upon"), finished("Once upon", reason="max_new_tokens"))
    cut = view.messages[-1]
    assert session.answer_to_continue() is cut
    session.continue_answer(cut)
    messages, params = engine.requests[-1]
    assert params.continue_final_message and messages[-1]["role"] == "assistant"
    assert messages[-1]["content"] == "Once upon" and session.reply_data is cut
    stream(session, TextDelta(" a time."), finished(" a time.", tokens=3))
    assert view.messages[-1] is cut and len(view.messages) == 2  # the same message grew
    assert (cut.content, cut.status, cut.stats["continued"], cut.stats["tokens"]) == (
        "Once upon a time.", "complete", 1, 7)
    saved = answer(store, session)
    assert (saved.content, saved.status) == ("Once upon a time.", "complete")


def test_a_failure_ends_the_answer_as_an_error_keeping_its_text(parts, store) -> None:
    session, engine, view = parts
    session.send("Hello")
    stream(session, TextDelta("Hi th"), BlockCommitted(0, 1, (1,)), EngineError("OutOfMemory", "CUDA out of memory"))
    data = view.ended[-1][2]
    assert view.ended[-1][1] == "error" and (data.status, data.content) == ("error", "Hi th")
    assert data.stats["error"] == "OutOfMemory: CUDA out of memory"
    assert answer(store, session).status == "error"
    session.send("Again")
    session.fail("the engine stopped: killed", "crashed")  # the worker died before any event
    assert view.ended[-1][1] == "crashed" and answer(store, session).status in ("error", "stopped")
    assert not session.generating


def test_a_failed_continuation_leaves_the_answer_cut_short(parts, store) -> None:
    session, engine, view = parts
    session.send("Tell a story")
    stream(session, TextDelta("Once"), finished("Once", reason="max_new_tokens"))
    cut = view.messages[-1]
    session.continue_answer(cut)
    stream(session, EngineError("RuntimeError", "boom"))
    assert (cut.status, cut.content, cut.stats["stop_reason"]) == ("stopped", "Once", "error")
    assert view.notices == ["The answer was not continued: RuntimeError: boom"]


def test_a_save_failing_mid_answer_stops_it_and_keeps_the_text_on_screen(parts, store) -> None:
    session, engine, view = parts
    session.send("Hello")
    stream(session, TextDelta("kept"), BlockCommitted(0, 1, (1,)))
    store.full_for_appends = True
    stream(session, TextDelta(" and more"), BlockCommitted(1, 1, (2,)))
    data = view.ended[-1][2]
    assert view.ended[-1][1] == "not-saved" and engine.cancelled == ["r1"]
    assert (data.status, data.content) == ("error", "kept and more")
    assert data.stats["stop_reason"] == "not-saved" and not session.generating
    assert view.errors == ["The answer is shown but was not saved; generation stopped: disk full"]
    assert answer(store, session).content == "kept"  # what was saved before the disk filled


def test_a_failed_send_takes_the_message_back(parts, store) -> None:
    session, engine, view = parts
    session.send("First")
    stream(session, finished("ok"))
    store.full_for_answers = True  # the question is saved, its answer cannot be
    assert not session.send("Second")
    assert [m.content for m in view.messages] == ["First", "ok"]
    assert [m.content for m in store.messages(session.conversation_id)] == ["First", "ok"]
    assert view.errors == ["Your message was not sent (it is still in the box): disk full"]


def test_an_ending_is_one_value_applied_once() -> None:
    ending = Ending("eos", "complete", "a", "", None, {"stop_reason": "eos"})
    with pytest.raises(AttributeError):
        ending.reason = "error"  # type: ignore[misc]
