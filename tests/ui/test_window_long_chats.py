"""Chats longer than the model's context (issue 10), through the real MainWindow with a real ChatStore, the real
token counter on a tiny model's tokenizer and chat template, and the scripted engine client: the meter beside Send,
and the choice offered when a message would not fit (leave the oldest turns out, or a new chat carrying a summary),
never a bare refusal. The real engine: test_gui_long_work.py."""

from __future__ import annotations

import pytest
from fakes_ui import FakeEngineClient
from fixtures_tiny import tiny_clover_dir  # noqa: F401 (session fixture)
from PySide6.QtCore import Qt

from clover_desk.engine.decode.tokenizer import CloverTokenizer
from clover_desk.qt_compat import guard_pyside_bool_refcounts
from clover_desk.storage.recorder import StreamRecorder
from clover_desk.storage.store import ChatStore
from clover_desk.ui.context_meter import ContextFullDialog, meter_text
from clover_desk.ui.context_window import (
    DROP_OLDEST,
    OVERFLOW_KEY,
    SUMMARY_HEADER,
    SUMMARY_INSTRUCTION,
    answer_reserve,
    context_limit,
    fit_messages,
    shift_slack,
)
from clover_desk.ui.main_window import MainWindow
from clover_desk.worker.token_counter import TokenCounter

guard_pyside_bool_refcounts()

LIMIT = 600  # the planned context of these tests
TURN = "Tell me more about the history of the lighthouse keepers on the northern islands and their families. " * 3
ANSWER = "The keepers lived in small stone houses beside the towers and rowed to the mainland once a month. " * 3


@pytest.fixture
def counter(qapp, tiny_clover_dir):  # noqa: ANN001, ANN201, F811
    c = TokenCounter()
    c.set_model(str(tiny_clover_dir))
    yield c
    c.shutdown()


@pytest.fixture
def tokenizer(tiny_clover_dir) -> CloverTokenizer:  # noqa: F811
    return CloverTokenizer.from_dir(tiny_clover_dir)


def make_window(qtbot, store, counter, client=None, limit: int = LIMIT) -> MainWindow:  # noqa: ANN001
    client = client or FakeEngineClient(blocks=1, pass_ms=2, answer="Fine.")
    window = MainWindow(client, store, StreamRecorder, model_dir="/models/tiny", token_counter=counter)
    qtbot.addWidget(window)
    window.show()
    window.chat_settings.set_model_info({"config": {"max_position_embeddings": 131072}, "plan": {"ctx_tokens": limit}})
    return window


def long_chat(store: ChatStore, turns: int, system: str = "You are a careful historian.") -> int:
    conv = store.create_conversation("Lighthouses", system_prompt=system, settings={"max_new_tokens": 64})
    for _ in range(turns):
        store.add_message(conv.id, "user", TURN)
        store.add_message(conv.id, "assistant", ANSWER)
    return conv.id


def open_dialog(qtbot, window: MainWindow, text: str) -> ContextFullDialog:  # noqa: ANN001
    window.composer.input.setPlainText(text)
    with qtbot.waitSignal(window.long_chats.dialogOpened, timeout=5000) as opened:
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    return opened.args[0]


def test_the_counter_counts_what_the_engine_prefills(qtbot, counter, tokenizer) -> None:  # noqa: ANN001
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TURN}]
    expected = len(tokenizer.encode_chat(chat, enable_thinking=False))
    assert counter.count_now(chat, enable_thinking=False) == expected
    with qtbot.waitSignal(counter.counted, timeout=5000) as answer:
        counter.count(7, chat, False)
    assert answer.args == [7, expected]
    counter.set_model(None)
    assert counter.count_now(chat) is None  # no model: nothing to count with, never a wrong figure


def test_the_meter_beside_send_counts_the_chat_and_the_draft(qtbot, store, counter, tokenizer) -> None:  # noqa: ANN001
    cid = long_chat(store, 1)
    window = make_window(qtbot, store, counter)
    window.conversations.open(cid)
    meter = window.long_chats.meter
    assert meter.isVisible() and meter.parentWidget() is window.composer
    chat = store.chat_messages(cid)
    thinking = window.drawer.settings().enable_thinking
    history = len(tokenizer.encode_chat(chat, enable_thinking=thinking))
    qtbot.waitUntil(lambda: meter.text() == f"{history:,} / {LIMIT:,} tokens", timeout=5000)
    window.composer.input.setPlainText("And the lighthouse on the cape?")
    with_draft = len(tokenizer.encode_chat([*chat, {"role": "user", "content": "And the lighthouse on the cape?"}],
                                           enable_thinking=thinking))
    qtbot.waitUntil(lambda: meter.text() == f"{with_draft:,} / {LIMIT:,} tokens", timeout=5000)
    assert meter.level in ("ok", "warn") and "kept for the answer" in meter.toolTip()
    assert meter_text(None, None) == "– tokens" and meter_text(1234, 16384) == "1,234 / 16,384 tokens"


def test_the_context_is_the_plans_or_the_models() -> None:
    assert context_limit({"config": {"max_position_embeddings": 262144}, "plan": {"ctx_tokens": 16384}}) == 16384
    assert context_limit({"config": {"max_position_embeddings": 4096}, "plan": None}) == 4096
    assert context_limit({"model_dir": "/m"}) is None
    assert answer_reserve(16384, 24576) == 1024 and answer_reserve(600, 64) == 64 and answer_reserve(200, 999) == 50


def test_a_message_that_does_not_fit_is_not_sent_and_the_choice_is_offered(qtbot, store, counter) -> None:  # noqa: ANN001
    cid = long_chat(store, 4)
    client = FakeEngineClient(blocks=1, pass_ms=2, answer="Fine.")
    window = make_window(qtbot, store, counter, client)
    window.conversations.open(cid)
    qtbot.waitUntil(lambda: window.long_chats.meter.level == "over", timeout=5000)
    assert window.long_chats.meter.property("class") == "dangerText"
    dialog = open_dialog(qtbot, window, "One more question about the keepers?")
    assert dialog.isVisible() and dialog.drop_button.isVisible() and dialog.summary_button.isEnabled()
    assert f"at most {LIMIT:,} tokens" in _text_of(dialog)
    assert client.requests == [] and window.request_id is None  # nothing went
    assert window.composer.input.toPlainText() == "One more question about the keepers?"
    assert len(store.messages(cid)) == 8  # nothing was saved either
    dialog.cancel_button.click()
    assert not dialog.isVisible() and client.requests == []
    assert window.composer.input.toPlainText() == "One more question about the keepers?"


def _text_of(dialog: ContextFullDialog) -> str:
    from PySide6.QtWidgets import QLabel

    return dialog.findChild(QLabel, "contextFullText").text()


def test_leaving_the_oldest_turns_out_sends_what_fits_and_is_remembered(qtbot, store, counter, tokenizer) -> None:  # noqa: ANN001
    cid = long_chat(store, 4)
    client = FakeEngineClient(blocks=1, pass_ms=2, answer="Fine.")
    window = make_window(qtbot, store, counter, client)
    window.conversations.open(cid)
    dialog = open_dialog(qtbot, window, "One more question about the keepers?")
    with qtbot.waitSignal(window.generationFinished, timeout=5000):
        dialog.drop_button.click()
    sent, params = client.requests[-1]
    full = store.chat_messages(cid)[:-1]  # (the answer just given is not part of what was sent)
    assert sent[0] == {"role": "system", "content": "You are a careful historian."}  # the system prompt stays
    assert sent[-1] == {"role": "user", "content": "One more question about the keepers?"}
    assert 1 < len(sent) < len(full) and sent[1:] == full[len(full) - len(sent) + 1:]  # the newest turns, whole
    assert sent[1]["role"] == "user"
    reserve = answer_reserve(LIMIT, window.drawer.settings().max_new_tokens)
    assert len(tokenizer.encode_chat(sent, enable_thinking=params.enable_thinking)) + reserve <= LIMIT
    # one turn more would not have fitted: no more was left out than needed
    one_more = [sent[0], *full[len(full) - len(sent) - 1:]]
    assert len(tokenizer.encode_chat(one_more, enable_thinking=params.enable_thinking)) + reserve > LIMIT
    assert store.get_conversation(cid).settings[OVERFLOW_KEY] == DROP_OLDEST
    assert len(store.messages(cid)) == 10  # every message stays in the chat
    assert window.composer.input.toPlainText() == ""
    # remembered with the chat (also across a settings edit): the next long message goes without asking
    window.drawer.temperature.setValue(0.3)
    window.conversations.open(None)
    window.conversations.open(cid)
    window.composer.input.setPlainText("And their children?")
    with qtbot.assertNotEmitted(window.long_chats.dialogOpened):
        with qtbot.waitSignal(window.generationFinished, timeout=5000):
            qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    assert client.requests[-1][0][-1]["content"] == "And their children?"
    qtbot.waitUntil(lambda: "oldest left out" in window.long_chats.meter.text(), timeout=5000)


def test_a_chat_past_its_context_starts_where_its_last_send_did_while_it_fits(qtbot, store, counter,  # noqa: ANN001
                                                                              tokenizer) -> None:
    """Once turns are left out, the start moves a quarter of the room further than needed, and the next sends
    start at the same message while the chat fits from there (the engine's prompt cache then reads only the new
    turn), also after switching chats. Turns here are ~300 tokens; the context 1,400."""
    cid = long_chat(store, 5)
    client = FakeEngineClient(blocks=1, pass_ms=2, answer="Fine.")
    window = make_window(qtbot, store, counter, client, limit=1400)
    window.conversations.open(cid)
    dialog = open_dialog(qtbot, window, "One more question about the keepers?")
    with qtbot.waitSignal(window.generationFinished, timeout=5000):
        dialog.drop_button.click()
    first, params = client.requests[-1]
    count = lambda m: len(tokenizer.encode_chat(m, enable_thinking=params.enable_thinking))  # noqa: E731
    reserve = answer_reserve(1400, window.drawer.settings().max_new_tokens)
    assert len(first) == 1 + 3 * 2 + 1  # 3 of 5 turns: 4 would fit (as far as needed) but leave < a quarter free
    assert count(first) + reserve + shift_slack(1400, reserve) <= 1400
    window.conversations.open(None)
    window.conversations.open(cid)
    window.composer.input.setPlainText(TURN)  # a long one: from a start moved as that rule says it would move again
    with qtbot.waitSignal(window.generationFinished, timeout=5000):
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    second = client.requests[-1][0]
    assert second[: len(first)] == first and second[len(first):] == [{"role": "assistant", "content": "Fine."},
                                                                     {"role": "user", "content": TURN.strip()}]
    assert count(second) + reserve + shift_slack(1400, reserve) > 1400


def test_a_new_chat_carrying_a_summary_then_sends_the_message(qtbot, store, counter) -> None:  # noqa: ANN001
    cid = long_chat(store, 4)
    client = FakeEngineClient(blocks=1, pass_ms=2, answer="Keepers rowed ashore monthly.")
    window = make_window(qtbot, store, counter, client)
    window.conversations.open(cid)
    dialog = open_dialog(qtbot, window, "One more question about the keepers?")
    with qtbot.waitSignal(window.long_chats.summaryEnded, timeout=5000) as ended:
        dialog.summary_button.click()
        assert window.prompt_progress.isVisible() and "Summarizing" in window.prompt_progress.label.text()
        assert window.composer.send_button.text() == "Stop" and window.engine_status.engine_label.text() == "● Summarizing the chat…"
    assert ended.args == ["done"]
    summary_request, summary_params = client.requests[0]
    assert summary_request[-1] == {"role": "user", "content": SUMMARY_INSTRUCTION}
    assert summary_request[0]["role"] == "system" and not summary_params.enable_thinking
    qtbot.waitUntil(lambda: window.request_id is None and len(client.requests) == 2, timeout=5000)
    new_id = window.conversation_id
    assert new_id != cid
    new = store.get_conversation(new_id)
    assert new.title == "Lighthouses (continued)"
    assert new.system_prompt.startswith("You are a careful historian.")
    assert f"{SUMMARY_HEADER}\n\nKeepers rowed ashore monthly." in new.system_prompt
    sent, _ = client.requests[1]
    assert sent == [{"role": "system", "content": new.system_prompt},
                    {"role": "user", "content": "One more question about the keepers?"}]
    assert [m.role for m in store.messages(new_id)] == ["user", "assistant"]
    assert len(store.messages(cid)) == 8  # the old chat is left as it was
    assert window.composer.input.toPlainText() == "" and not window.prompt_progress.isVisible()


def test_stopping_the_summary_keeps_the_message_in_the_box(qtbot, store, counter) -> None:  # noqa: ANN001
    cid = long_chat(store, 4)
    client = FakeEngineClient(blocks=1, pass_ms=2, answer="unused")
    client.paused = True
    window = make_window(qtbot, store, counter, client)
    window.conversations.open(cid)
    dialog = open_dialog(qtbot, window, "One more question?")
    dialog.summary_button.click()
    with qtbot.waitSignal(window.long_chats.summaryEnded, timeout=5000) as ended:
        window.prompt_progress.stop_button.click()
        client.resume()
    assert ended.args == ["cancelled"] and client.cancelled
    assert window.conversation_id == cid and window.composer.input.toPlainText() == "One more question?"
    assert "summary was stopped" in window.info_banner.label.text() and not window.is_generating()
    assert window.composer.send_button.text() == "Send" and len(client.requests) == 1


def test_a_message_longer_than_the_context_says_so_and_offers_no_way_that_cannot_work(qtbot, store, counter) -> None:  # noqa: ANN001
    client = FakeEngineClient(blocks=1, pass_ms=2)
    window = make_window(qtbot, store, counter, client, limit=200)
    dialog = open_dialog(qtbot, window, TURN * 4)
    assert not dialog.drop_button.isVisible() and not dialog.summary_button.isVisible()
    assert "Your message alone" in _text_of(dialog) and "longer context" in _text_of(dialog)
    dialog.reject()
    assert client.requests == [] and window.composer.input.toPlainText() == TURN * 4


def test_fit_messages_keeps_the_system_prompt_and_whole_newest_turns() -> None:
    chat = [{"role": "system", "content": "s"}]
    for i in range(6):
        chat += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    chat.append({"role": "user", "content": "now"})
    calls: list[int] = []

    def count(messages: list) -> int:  # 10 tokens a message
        calls.append(len(messages))
        return 10 * len(messages)

    sent, left_out = fit_messages(chat, count, limit=60, reserve=10)
    assert sent == [chat[0], *chat[-3:]] and left_out == 10
    assert len(calls) <= 5  # a binary search, not one count per turn
    assert fit_messages(chat, count, limit=500, reserve=10) == (chat, 0)
    assert fit_messages(chat, count, limit=25, reserve=10) is None  # the system prompt and the message alone: 20


def test_fit_messages_starts_where_the_last_send_did_and_moves_with_slack() -> None:
    """Successive sends start at the same message while the chat fits from there (the engine's prompt cache then
    reads only the new turn); when the start must move, it moves until ``slack`` more tokens are free."""
    chat = [{"role": "system", "content": "s"}]
    for i in range(6):
        chat += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    chat.append({"role": "user", "content": "now"})  # 14 messages: users at 1, 3, ..., 13

    def count(messages: list) -> int:  # 10 tokens a message
        return 10 * len(messages)

    assert fit_messages(chat, count, limit=100, reserve=10)[1] == 6  # as far as needed: 80 tokens
    sent, left_out = fit_messages(chat, count, limit=100, reserve=10, slack=20)
    assert left_out == 8 and sent == [chat[0], *chat[9:]] and count(sent) + 10 + 20 <= 100
    grown = [*chat, {"role": "assistant", "content": "a"}, {"role": "user", "content": "next"}]
    assert fit_messages(grown, count, limit=100, reserve=10, keep=8, slack=20) == ([chat[0], *grown[9:]], 8)
    assert fit_messages(grown, count, limit=100, reserve=10, slack=20)[1] == 10  # (without keep it would move)
    more = [*grown, {"role": "assistant", "content": "b"}, {"role": "user", "content": "again"}]  # 100 from 9
    assert fit_messages(more, count, limit=100, reserve=10, keep=8, slack=20)[1] == 12  # moved: 60 tokens
    assert fit_messages(more, count, limit=100, reserve=10, keep=9)[1] == 10  # 9 is no turn start (it would fit)
    assert fit_messages(chat, count, limit=100, reserve=10, slack=80)[1] == 6  # the last turn leaves < 80: as needed


def test_without_a_counter_there_is_no_meter_and_send_is_not_held(qtbot, store) -> None:  # noqa: ANN001
    client = FakeEngineClient(blocks=1, pass_ms=2)
    window = make_window(qtbot, store, None, client, limit=50)
    assert window.long_chats.meter.isHidden()
    window.composer.input.setPlainText(TURN)
    with qtbot.waitSignal(window.generationFinished, timeout=5000):
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    assert len(client.requests) == 1  # the engine is the judge then (it says why if it cannot)


# ---- reading the prompt (scripted events; the real engine: test_gui_long_work.py) -------------------------------


def sent_and_held(qtbot, store) -> tuple[MainWindow, FakeEngineClient]:  # noqa: ANN001
    """A window that has sent "hi" to a fake engine holding its events back (``emit_until`` lets them out)."""
    client = FakeEngineClient(blocks=1, pass_ms=2)
    client.paused = True
    window = make_window(qtbot, store, None, client)
    window.composer.input.setPlainText("hi")
    qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    return window, client


def test_a_quick_prompt_never_flashes_the_reading_strip(qtbot, store) -> None:  # noqa: ANN001
    from clover_desk.engine.decode.events import BlockStep, PromptInfo

    window, client = sent_and_held(qtbot, store)
    strip = window.prompt_progress
    client.emit_until(PromptInfo)
    assert strip.active and strip.isHidden()
    assert strip.show_timer.isActive()  # due in SHOW_AFTER_MS if the prompt is still being read then
    client.emit_until(BlockStep)  # the answer started before the strip was due
    assert not strip.active and not strip.show_timer.isActive() and strip.isHidden()
    client.resume()
    qtbot.waitUntil(lambda: window.request_id is None, timeout=5000)


def test_a_slow_single_pass_prompt_shows_the_strip_after_a_moment(qtbot, store) -> None:  # noqa: ANN001
    from clover_desk.engine.decode.events import PromptInfo
    from clover_desk.ui.prompt_progress import SHOW_AFTER_MS

    window, client = sent_and_held(qtbot, store)
    client.emit_until(PromptInfo)
    strip = window.prompt_progress
    assert strip.isHidden()
    qtbot.waitUntil(strip.isVisible, timeout=SHOW_AFTER_MS + 2000)
    assert strip.label.text() == "Reading your message… 12 tokens" and strip.bar.maximum() == 0  # busy
    with qtbot.waitSignal(window.generationFinished, timeout=5000) as done:
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Escape)
        client.resume()
    assert done.args[1] == "cancelled" and strip.isHidden()
