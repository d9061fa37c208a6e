"""The prompt cache, end to end: the real window over the real engine (EngineClient → worker process → Engine) on
a scripted tiny model. Two chats taking turns: while the engine is idle the window has it read the open chat ahead
(its last answer included), so going back to the first chat and sending reads only the new message; the answer's
stats (its tooltip, the store) say how much was cached."""

from __future__ import annotations

import pytest
from gui_desk import running_desk
from PySide6.QtCore import Qt
from scripted_model import build_scripted_model

from clover_desk.engine.decode.tokenizer import CloverTokenizer
from clover_desk.qt_compat import guard_pyside_bool_refcounts

guard_pyside_bool_refcounts()  # PySide6 6.12 refcount leak on CPython < 3.12 (see there)

LOAD_MS = 60_000
GEN_MS = 60_000
A = "Tell me about the lighthouse keepers of the northern islands, their families and their work. " * 2
B = "Explain how a block diffusion model fills a block of masked slots in a few passes, step by step. " * 2


@pytest.fixture(scope="module")
def desk(qapp, tmp_path_factory):  # noqa: ANN001, ANN201
    from clover_desk.app import AppSettings

    model = build_scripted_model(tmp_path_factory.mktemp("cache_model"), thinking="Let me think</think>Sure.<|im_end|>")
    with running_desk(tmp_path_factory.mktemp("desk_home"), AppSettings(model_dir=str(model.path)),
                      load_ms=LOAD_MS, with_model_manager=False) as app:
        app.model_path = model.path
        yield app


def _send(qtbot, window, text: str) -> None:  # noqa: ANN001
    window.composer.input.setPlainText(text)
    with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS) as blocker:
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    assert blocker.args[1] == "eos"


def _kept(tokenizer: CloverTokenizer, chat: list) -> int:
    """The whole blocks before the generation prompt of ``chat`` (what a next turn writes otherwise)."""
    ids = tokenizer.encode_chat(chat)
    return (len(ids) - 1 - ids[::-1].index(ids[0])) // 32 * 32


def test_going_back_to_a_chat_reads_only_its_new_message(qtbot, desk) -> None:  # noqa: ANN001
    window = desk.window
    window.conversations.open(None)
    _send(qtbot, window, A)
    first = window.chat.widgets[-1].data.stats
    a_id = window.conversation_id
    window.conversations.open(None)
    _send(qtbot, window, B)
    assert window.chat.widgets[-1].data.stats["cached_tokens"] == 0  # another chat: nothing of it was read
    with qtbot.waitSignal(desk.client.chatRead, timeout=GEN_MS,
                          check_params_cb=lambda rid, record: rid == window.chat_actions.read_ahead_id) as read:
        window.conversations.open(a_id)  # the engine reads chat A, its answer included, while nothing else runs
    assert read.args[1]["stop_reason"] == "prefilled"
    _send(qtbot, window, "And their children?")
    widget = window.chat.widgets[-1]
    stats = widget.data.stats
    chat_a = desk.store.chat_messages(a_id)[:2]  # the question and its answer
    tokenizer = CloverTokenizer.from_dir(desk.model_path)
    kept = lambda chat: _kept(tokenizer, chat)  # noqa: E731
    # read ahead: chat A with its answer; the first turn alone kept only the question's blocks
    assert stats["cached_tokens"] == kept(chat_a) > kept(chat_a[:1]) and first["prompt_tokens"] > kept(chat_a[:1])
    assert f"{stats['cached_tokens']:,} of them already read (the prompt cache)" in widget.meta_label.toolTip()
    saved = desk.store.messages(a_id)[-1]
    assert saved.stats["cached_tokens"] == stats["cached_tokens"]


def test_an_older_message_edited_and_sent_again_reads_from_the_turn_before_it(qtbot, desk) -> None:  # noqa: ANN001
    """Three turns, then the second question edited: the engine goes back to its checkpoint at that question's
    turn (the prompt cache keeps the state at the chat's recent turn starts) instead of reading the chat again."""
    window = desk.window
    window.conversations.open(None)
    for text in (A, B, "And then? " + A):  # (each turn's kept point further on)
        _send(qtbot, window, text)
    chat = desk.store.chat_messages(window.conversation_id)
    assert [m["role"] for m in chat] == ["user", "assistant"] * 3
    question = window.chat.widgets[2]
    assert question.data.content == chat[2]["content"] == B.strip()
    question.edit_button.click()
    window.composer.input.setPlainText("Explain it once more, in one sentence.")
    with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS):
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    assert [m["content"] for m in desk.store.chat_messages(window.conversation_id)][:3] == [
        chat[0]["content"], chat[1]["content"], "Explain it once more, in one sentence."]
    stats = window.chat.widgets[-1].data.stats
    assert stats["cached_tokens"] == _kept(CloverTokenizer.from_dir(desk.model_path), chat[:2]) > 0
