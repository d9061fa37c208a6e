"""The main window with a real ChatStore and a scripted engine client (the real engine: test_gui_e2e.py)."""

from __future__ import annotations

import pytest
from fakes_ui import FakeEngineClient, fake_plan
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QApplication, QWidget

from clover_desk.engine.decode.events import EngineError, Finished, LoadProgress, TextDelta
from clover_desk.engine.defaults import DEFAULT_CTX_TOKENS
from clover_desk.qt_compat import guard_pyside_bool_refcounts  # noqa: E402
from clover_desk.storage.recorder import StreamRecorder
from clover_desk.storage.store import ChatStore
from clover_desk.ui.generation import GenerationSettings, expert_hit_rate
from clover_desk.ui.html_extract import extract_html
from clover_desk.ui.main_window import MainWindow
from clover_desk.ui.vram_panel import VramPanel

# PySide6 6.12 on CPython < 3.12 drops a reference to None/True on every void call or emit (see there);
# without this the process aborts after some thousands of paints. Must run before the first widget exists.
guard_pyside_bool_refcounts()

HTML_ANSWER = "A page:\n\n```html\n<!DOCTYPE html>\n<html><body>hi</body></html>\n```"
# Split on spaces into 6 blocks of 2 words by FakeEngineClient: the page starts in the 2nd block's delta.
LIST_ANSWER = ("Here is the page:\n\n```html\n<!DOCTYPE html>\n<html><body>\n<h1 id=t>Shopping list</h1>\n<ul>\n"
               "<li>apples</li> <li>pears</li> <li>plums</li> <li>figs</li>\n</ul>\n<script>document.title "
               "= 'done'</script>\n</body></html>\n```\nEnjoy!")


class CountingStore(ChatStore):
    """The real store, counting streaming appends (one per committed block is the contract)."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.appends: list[tuple[int, str, str]] = []

    def append_streaming(self, message_id: int, answer_delta: str = "", thinking_delta: str = "") -> None:
        self.appends.append((message_id, answer_delta, thinking_delta))
        super().append_streaming(message_id, answer_delta, thinking_delta)


class FakePreview(QWidget):
    """The HtmlPreview contract, recording what it was given (the real pane: test_preview_streaming.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.shown: list[str] = []
        self.document_ids: list[str | None] = []
        self.flushes = 0

    def set_html(self, text: str, document_id: str | None = None) -> None:
        self.shown.append(text)
        self.document_ids.append(document_id)

    def flush(self) -> None:
        self.flushes += 1


class FakeModelManager(QWidget):
    modelChosen = Signal(str)


@pytest.fixture
def store(tmp_path):
    with CountingStore(tmp_path / "chats.sqlite3") as s:
        yield s


def make_window(qtbot, store, client=None, **kwargs) -> tuple[MainWindow, FakeEngineClient]:
    client = client or FakeEngineClient(blocks=3, pass_ms=2, thinking="plan the answer")
    kwargs.setdefault("model_dir", "/models/tiny")
    window = MainWindow(client, store, StreamRecorder, **kwargs)
    qtbot.addWidget(window)
    window.show()
    return window, client


def answering(qtbot, store, text: str, **client_kwargs) -> tuple[MainWindow, FakeEngineClient]:
    """A window (its fake engine at 5 ms a pass) answering ``text`` sent with Enter: a block committed, not done."""
    client = FakeEngineClient(pass_ms=5, **client_kwargs)
    window, _ = make_window(qtbot, store, client)
    window.composer.input.setPlainText(text)
    qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: window.denoise.model.blocks_committed >= 1, timeout=3000)
    return window, client


def send(qtbot, window: MainWindow, text: str) -> None:
    window.composer.input.setPlainText(text)
    with qtbot.waitSignal(window.generationFinished, timeout=5000):
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)


def test_send_streams_saves_each_block_and_shows_stats(qtbot, store) -> None:
    window, client = make_window(qtbot, store)
    send(qtbot, window, "Explain block diffusion")
    cid = window.conversation_id
    messages = store.messages(cid)
    assert [m.role for m in messages] == ["user", "assistant"]
    answer = messages[1]
    assert answer.status == "complete" and answer.content.startswith("Block diffusion fills")
    assert answer.thinking == "plan the answer" and answer.thinking_seconds is not None
    assert answer.stats["tokens_per_s"] == 41.5 and answer.stats["accounting"] == {"hits": 930, "misses": 70}
    # saved as blocks committed: one append per block (3), none after Finished
    assert len([a for a in store.appends if a[0] == answer.id]) == 3
    assert "".join(a[1] for a in store.appends) == answer.content
    # the conversation got a title and is listed
    assert store.get_conversation(cid).title == "Explain block diffusion"
    assert window.sidebar.list.count() == 1
    # the views
    assert window.denoise.model.blocks_committed == 3
    assert window.chat.widgets[-1].thinking_toggle.text().startswith("Thought for")
    assert window.engine_status.speed_label.text() == "41.5 tok/s"
    assert window.engine_status.hit_label.text() == "Expert cache 93% hits"
    assert client.requests[0][0] == [{"role": "user", "content": "Explain block diffusion"}]
    assert not window.composer.generating


def test_shift_enter_adds_a_line_and_empty_text_is_not_sent(qtbot, store) -> None:
    window, client = make_window(qtbot, store)
    qtbot.keyClicks(window.composer.input, "line one")
    qtbot.keyClick(window.composer.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(window.composer.input, "line two")
    assert window.composer.input.toPlainText() == "line one\nline two"
    assert client.requests == []
    window.composer.input.setPlainText("   ")
    qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    assert client.requests == []


def test_escape_stops_and_keeps_the_partial_answer(qtbot, store) -> None:
    client = FakeEngineClient(blocks=20, pass_ms=5)
    window, _ = make_window(qtbot, store, client)
    window.composer.input.setPlainText("long answer please")
    qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    assert window.composer.send_button.text() == "Stop"
    qtbot.waitUntil(lambda: window.denoise.model.blocks_committed >= 1, timeout=3000)
    with qtbot.waitSignal(window.generationFinished, timeout=3000) as blocker:
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Escape)
    assert blocker.args[1] == "cancelled"
    assert client.cancelled == [blocker.args[0]]
    answer = store.messages(window.conversation_id)[-1]
    assert answer.status == "stopped" and answer.stats["stop_reason"] == "cancelled"
    assert window.chat.widgets[-1].meta_label.text().endswith("stopped")
    assert window.composer.send_button.text() == "Send"


def test_stop_then_continue_goes_on_with_the_same_answer(qtbot, store) -> None:
    window, client = answering(qtbot, store, "long answer please", blocks=20, thinking="plan the answer")
    with qtbot.waitSignal(window.generationFinished, timeout=3000):
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Escape)
    widget = window.chat.widgets[-1]
    before = store.messages(window.conversation_id)[-1]
    assert before.stats["stop_reason"] == "cancelled" and widget.continue_button.isVisible()
    assert window.menus.continue_action.isEnabled()

    client.blocks = 2
    with qtbot.waitSignal(window.generationFinished, timeout=5000) as blocker:
        widget.continue_button.click()
        assert widget.data.status == "streaming" and not widget.continue_button.isVisible()
        assert store.get_message(before.id).status == "streaming"
    assert blocker.args[1] == "eos"
    messages, params = client.requests[-1]
    assert messages == [{"role": "user", "content": "long answer please"},
                        {"role": "assistant", "content": before.content, "reasoning_content": before.thinking}]
    assert params.continue_final_message is True and client.requests[0][1].continue_final_message is False
    finished = [e for e in client._make_script(params) if isinstance(e, Finished)][0]
    assert window.chat.widgets[-1] is widget and len(window.chat.widgets) == 2  # the same message, grown
    after = store.get_message(before.id)
    assert after.content == before.content + finished.text == widget.data.content
    assert after.thinking == before.thinking + finished.thinking == widget.data.thinking
    assert after.status == "complete" and after.stats["continued"] == 1 == widget.data.stats["continued"]
    assert after.stats["tokens"] == before.stats["tokens"] + finished.tokens == widget.data.stats["tokens"]
    assert not widget.continue_button.isVisible() and not window.menus.continue_action.isEnabled()  # it ended: eos


def test_a_continuation_the_engine_refuses_leaves_the_answer_as_it_was(qtbot, store) -> None:
    """E.g. the chat plus the answer no longer fit the context: the answer is not turned into an error (it would
    leave the chat's context); it stays, cut short, and the banner says why it did not go on."""
    c = store.create_conversation("full")
    store.add_message(c.id, "user", "one")
    cut = store.add_message(c.id, "assistant", "so far", thinking="hmm", status="complete",
                            stats={"stop_reason": "max_new_tokens", "tokens": 16})
    window, client = make_window(qtbot, store)
    window.conversations.open(c.id)
    client.paused = True
    widget = window.chat.widgets[-1]
    widget.continue_button.click()
    assert window.is_generating()
    message = "prompt is 4,100 tokens; the context holds 4,096 positions, leaving no room to generate"
    with qtbot.waitSignal(window.generationFinished, timeout=2000):
        client.event.emit(window.request_id, EngineError("PromptError", message))
    saved = store.get_message(cut.id)
    assert (saved.status, saved.content, saved.thinking) == ("stopped", "so far", "hmm")
    assert saved.stats["stop_reason"] == "error" and saved.stats["tokens"] == 16 and message in saved.stats["error"]
    assert (widget.data.status, widget.data.content) == ("stopped", "so far")
    assert "Error" not in widget.body.toPlainText()
    banner = window.info_banner
    assert banner.isVisible() and "The answer was not continued: PromptError" in banner.label.text()
    assert not widget.continue_button.isVisible()  # it would fail the same way: Regenerate, or a new chat
    assert store.chat_messages(c.id)[-1] == {"role": "assistant", "content": "so far"}  # still in the context


def test_a_restart_mid_answer_ends_it_stopped_on_screen_as_on_disk(qtbot, store) -> None:
    """The client ends a request the worker can no longer answer with EngineError WorkerStopped: the recorder saves
    the answer stopped (cancelled), and the window shows it so (it showed an error until the chat was reopened)."""
    client = FakeEngineClient(blocks=20, pass_ms=5)
    window, _ = make_window(qtbot, store, client)
    client.paused = True
    window.composer.input.setPlainText("long answer please")
    qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    client.emit_until(TextDelta, 2)
    with qtbot.waitSignal(window.generationFinished, timeout=2000):
        client.event.emit(window.request_id, EngineError("WorkerStopped", "the engine was restarted"))
    saved = store.messages(window.conversation_id)[-1]
    widget = window.chat.widgets[-1]
    assert (saved.status, saved.stats["stop_reason"]) == ("stopped", "cancelled")
    assert (widget.data.status, widget.data.stats["stop_reason"]) == ("stopped", "cancelled")
    assert widget.data.content == saved.content != "" and "Error" not in widget.body.toPlainText()
    assert widget.continue_button.isVisible()


def test_continue_is_offered_for_the_last_answer_cut_short_only(qtbot, store) -> None:
    c = store.create_conversation("cut")
    store.add_message(c.id, "user", "one")
    old = store.add_message(c.id, "assistant", "partial", status="complete", stats={"stop_reason": "max_new_tokens"})
    store.add_message(c.id, "user", "two")
    last = store.add_message(c.id, "assistant", "", thinking="hmm", status="stopped",
                             stats={"stop_reason": "interrupted"})
    window, client = make_window(qtbot, store)
    window.conversations.open(c.id)
    widgets = window.chat.widgets
    assert not widgets[1].continue_button.isVisible()  # not the last answer
    assert widgets[3].continue_button.isVisible() and window.menus.continue_action.isEnabled()
    widgets[1].continueRequested.emit(widgets[1])  # an older answer cannot be continued
    assert client.requests == [] and store.get_message(old.id).status == "complete"
    window.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is window, timeout=2000)  # shortcuts need it active
    window.composer.input.setFocus()
    window.composer.input.setPlainText("typed, not sent")
    with qtbot.waitSignal(window.generationFinished, timeout=5000):  # the shortcut, from the message box
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return,
                       Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.ShiftModifier)
    assert [params.continue_final_message for _, params in client.requests] == [True]
    assert client.requests[0][0][-1] == {"role": "assistant", "content": "", "reasoning_content": "hmm"}
    assert window.composer.input.toPlainText() == "typed, not sent"
    store.finish_message(last.id, "complete", stats={"stop_reason": "context"})  # the context is full: no room
    window.conversations.open(c.id)
    assert not window.chat.widgets[3].continue_button.isVisible() and not window.menus.continue_action.isEnabled()
    window.menus.continue_action.trigger()
    assert len(client.requests) == 1


def test_branch_opens_a_new_chat_up_to_that_answer(qtbot, store) -> None:
    window, client = make_window(qtbot, store)
    send(qtbot, window, "first question")
    send(qtbot, window, "second question")
    original = window.conversation_id
    first_answer = window.chat.widgets[1]
    assert first_answer.branch_button.isVisible() and not window.chat.widgets[0].branch_button.isVisible()
    first_answer.branch_button.click()
    assert window.conversation_id != original
    assert [(w.data.role, w.data.content) for w in window.chat.widgets] == [
        (m.role, m.content) for m in store.messages(original)[:2]]
    assert store.get_conversation(window.conversation_id).title == "first question (branch)"
    assert len(store.messages(original)) == 4 and window.sidebar.list.count() == 2
    send(qtbot, window, "a different second question")  # the branch goes its own way
    assert client.requests[-1][0][:2] == client.requests[1][0][:2]  # the same start
    assert [m.content for m in store.messages(window.conversation_id)][2] == "a different second question"
    assert store.messages(original)[2].content == "second question"


def test_regenerate_replaces_the_last_answer(qtbot, store) -> None:
    window, client = make_window(qtbot, store)
    send(qtbot, window, "hello")
    last = window.chat.widgets[-1]
    assert last.regen_button.isVisible()
    with qtbot.waitSignal(window.generationFinished, timeout=5000):
        last.regen_button.click()
    messages = store.messages(window.conversation_id)
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[-1].status == "complete"
    assert len(window.chat.widgets) == 2 and window.chat.widgets[-1] is not last
    assert len(client.requests) == 2
    assert client.requests[1][0] == [{"role": "user", "content": "hello"}]


def test_edit_and_resend_replaces_later_messages(qtbot, store) -> None:
    window, client = make_window(qtbot, store)
    send(qtbot, window, "first question")
    send(qtbot, window, "second question")
    first_user = window.chat.widgets[0]
    first_user.edit_button.click()
    assert window.composer.input.toPlainText() == "first question"
    assert window.composer.edit_note.isVisible()
    window.composer.input.setPlainText("better question")
    with qtbot.waitSignal(window.generationFinished, timeout=5000):
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    messages = store.messages(window.conversation_id)
    assert [(m.role, m.content[:15]) for m in messages][:1] == [("user", "better question")]
    assert len(messages) == 2 and len(window.chat.widgets) == 2
    assert client.requests[-1][0] == [{"role": "user", "content": "better question"}]


def test_settings_drawer_feeds_generation_params(qtbot, store) -> None:
    window, client = make_window(qtbot, store)
    window.settings_button.click()
    assert window.drawer.isVisible()
    d = window.drawer
    d.temperature.setValue(0.7)
    d.block_size.setCurrentIndex(d.block_size.findData(16))
    d.threshold.setValue(0.8)
    d.max_tokens.setValue(256)
    d.system_prompt.setPlainText("Be brief.")
    window.composer.think_button.setChecked(False)  # this message only
    send(qtbot, window, "hi")
    messages, params = client.requests[-1]
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert (params.temperature, params.block_size, params.threshold, params.max_new_tokens) == (0.7, 16, 0.8, 256)
    assert params.do_sample and not params.enable_thinking and params.mode == "diffusion"
    d.mode.setCurrentIndex(d.mode.findData("ar"))
    assert not d.block_size.isEnabled()
    send(qtbot, window, "again")
    params = client.requests[-1][1]
    assert params.mode == "ar" and params.block_size is None
    saved = GenerationSettings.from_dict(store.get_conversation(window.conversation_id).settings)
    assert saved.mode == "ar" and saved.temperature == 0.7
    # self-speculative: greedy (the temperature is off), with the block settings
    d.mode.setCurrentIndex(d.mode.findData("spec"))
    assert d.block_size.isEnabled() and d.threshold.isEnabled() and not d.temperature.isEnabled()
    assert window.composer.mode_label.text() == "self-speculative"
    send(qtbot, window, "exactly")
    params = client.requests[-1][1]
    assert (params.mode, params.do_sample, params.temperature, params.block_size) == ("spec", False, 0.0, 16)


def test_sidebar_new_rename_search_delete(qtbot, store, monkeypatch) -> None:
    window, _ = make_window(qtbot, store)
    send(qtbot, window, "apples and pears")
    first = window.conversation_id
    window.sidebar.new_button.click()
    assert window.conversation_id is None and window.chat.widgets == []
    send(qtbot, window, "bananas")
    second = window.conversation_id
    assert second != first and window.sidebar.list.count() == 2
    item = window.sidebar.item_for(first)
    item.setText("Fruit talk")  # what an in-place edit does
    assert store.get_conversation(first).title == "Fruit talk"
    window.sidebar.search.setText("pears")
    assert window.sidebar.list.count() == 1
    assert window.sidebar.list.item(0).data(Qt.ItemDataRole.UserRole) == first
    window.sidebar.list.setCurrentRow(0)
    assert window.conversation_id == first and window.chat.widgets[0].data.content == "apples and pears"
    window.sidebar.search.clear()
    window.conversations.delete(first)
    assert [c.id for c in store.list_conversations()] == [second]
    assert window.conversation_id is None


def test_deleting_the_chat_being_answered(qtbot, store) -> None:
    window, client = answering(qtbot, store, "doomed", blocks=30)
    cid = window.conversation_id
    with qtbot.waitSignal(window.generationFinished, timeout=3000):
        window.conversations.delete(cid)
    assert store.list_conversations() == [] and client.cancelled
    assert not window.is_generating() and window.chat.widgets == []


def test_crash_banner_keeps_chat_and_restarts(qtbot, store) -> None:
    window, client = answering(qtbot, store, "will crash", blocks=30)
    with qtbot.waitSignal(window.generationFinished, timeout=3000) as blocker:
        client.crashed.emit("worker exited with SIGKILL")
    assert blocker.args[1] == "crashed"
    assert window.crash_banner.isVisible() and "SIGKILL" in window.crash_banner.label.text()
    assert len(window.chat.widgets) == 2  # the chat stays
    answer = store.messages(window.conversation_id)[-1]
    assert answer.status == "error" and answer.content  # the committed blocks were saved
    with qtbot.waitSignal(client.ready, timeout=2000):
        window.crash_banner.action.click()
    assert client.restarts == 1 and not window.crash_banner.isVisible()


def test_load_progress_and_cancel(qtbot, store) -> None:
    window, client = make_window(qtbot, store)
    client.emit_load(2 * 1024**3, 8 * 1024**3)
    assert window.load_banner.isVisible()
    assert window.load_banner.bar.value() == 250
    assert "2.0 / 8.0 GiB" in window.load_banner.detail.text()
    window.load_banner.cancel.click()
    assert client.load_cancelled == 1
    client.errorMessage.emit("CancelledError", "load cancelled")
    assert not window.load_banner.isVisible() and window.info_banner.isVisible()
    client.loadProgress.emit(LoadProgress("reading", 1, 2))
    client.loaded.emit({"model_dir": "/models/tiny"})
    assert not window.load_banner.isVisible() and window.engine_status.engine_label.text() == "● Ready"


def test_out_of_memory_on_load_points_to_the_vram_tab(qtbot, store) -> None:
    panel = VramPanel(fake_plan, 16 * 1024**3, "RTX", None)
    window, client = make_window(qtbot, store, vram_panel=panel)
    client.loadProgress.emit(LoadProgress("placing", 1, 2))
    client.errorMessage.emit("OutOfMemory", "CUDA out of memory while placing layer 12")
    assert window.info_banner.isVisible() and "smaller VRAM budget" in window.info_banner.label.text()
    assert window.engine_status.engine_label.text() == "● Model failed to load"
    window.info_banner.action.click()
    assert window.tabs.currentWidget() is panel and not window.info_banner.isVisible()


def test_no_model_opens_the_model_manager(qtbot, store) -> None:
    manager = FakeModelManager()
    window, _ = make_window(qtbot, store, model_dir=None, model_manager=manager)
    assert window.pages.currentIndex() == 1 and manager.isVisible()
    assert "No model" in window.engine_status.engine_label.text()
    with qtbot.waitSignal(window.modelChosen, timeout=1000) as blocker:
        manager.modelChosen.emit("/models/clover")
    assert blocker.args == ["/models/clover"]
    assert window.pages.currentIndex() == 0 and window.model_label.text() == "clover"


def test_preview_and_vram_tabs(qtbot, store) -> None:
    preview = FakePreview()
    panel = VramPanel(fake_plan, 16 * 1024**3, "RTX", None)
    client = FakeEngineClient(blocks=1, pass_ms=2, answer=HTML_ANSWER)
    window, _ = make_window(qtbot, store, client, preview=preview, vram_panel=panel)
    assert [window.tabs.tabText(i) for i in range(window.tabs.count())] == ["Denoising", "VRAM", "Preview"]
    send(qtbot, window, "make a page")
    answer = window.chat.widgets[-1]
    assert answer.preview_button.isVisible()
    answer.preview_button.click()
    assert preview.shown and preview.shown[-1].startswith("<!DOCTYPE html>")
    assert preview.document_ids[-1] == f"message-{answer.data.message_id}" and preview.flushes == 1
    assert window.tabs.currentWidget() is preview
    assert window.preview_follows is None  # a finished answer: nothing to follow
    with qtbot.waitSignal(window.applyPlanRequested, timeout=1000) as blocker:
        panel.set_vram_budget_bytes(12 * 1024**3)
        panel.apply_button.click()
    assert blocker.args == [12 * 1024**3, DEFAULT_CTX_TOKENS]


def start_paused(qtbot, window: MainWindow, client: FakeEngineClient, text: str) -> None:
    """Send ``text``; the client then emits only what the test hands out (emit_until)."""
    client.paused = True
    window.composer.input.setPlainText(text)
    qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    assert window.is_generating()


def test_preview_follows_the_streaming_answer_until_another_is_opened(qtbot, store) -> None:
    preview = FakePreview()
    client = FakeEngineClient(blocks=1, pass_ms=2, answer=HTML_ANSWER)
    window, _ = make_window(qtbot, store, client, preview=preview)
    send(qtbot, window, "a small page")
    older = window.chat.widgets[-1]
    client.answer, client.blocks = LIST_ANSWER, 6
    start_paused(qtbot, window, client, "a shopping list page")
    streaming = window.chat.widgets[-1]
    doc_id = f"message-{streaming.data.message_id}"
    client.emit_until(TextDelta, 3)  # "... <h1 id=t>Shopping"
    qtbot.waitUntil(streaming.preview_button.isVisible, timeout=2000)  # before Finished
    assert window.is_generating() and streaming.data.status == "streaming"

    streaming.preview_button.click()
    assert window.preview_follows is streaming.data
    assert preview.shown[-1].endswith("Shopping") and preview.document_ids[-1] == doc_id
    assert preview.flushes == 1 and window.tabs.currentWidget() is preview
    client.emit_until(TextDelta)  # each answer delta feeds the preview (its throttle coalesces)
    assert preview.shown[-1].endswith("<li>pears</li>") and preview.document_ids[-1] == doc_id

    older.preview_button.click()  # another message: its page, and the stream is no longer followed
    assert preview.shown[-1] == "<!DOCTYPE html>\n<html><body>hi</body></html>"
    assert preview.document_ids[-1] == f"message-{older.data.message_id}" and window.preview_follows is None
    count = len(preview.shown)
    client.emit_until(TextDelta)
    assert len(preview.shown) == count

    streaming.preview_button.click()  # following again, up to the end: Finished flushes the final page
    flushes = preview.flushes
    with qtbot.waitSignal(window.generationFinished, timeout=2000):
        client.emit_until(Finished)
    assert preview.shown[-1] == extract_html(LIST_ANSWER) and preview.shown[-1].endswith("</html>")
    assert preview.document_ids[-1] == doc_id and preview.flushes == flushes + 1
    assert window.preview_follows is None


def test_streaming_does_not_extract_per_delta_once_the_button_shows(qtbot, store) -> None:
    calls: list[str] = []

    def counting_extractor(text: str) -> str | None:
        calls.append(text)
        return extract_html(text)

    client = FakeEngineClient(blocks=6, pass_ms=2, answer=LIST_ANSWER)
    window, _ = make_window(qtbot, store, client, html_extractor=counting_extractor)
    start_paused(qtbot, window, client, "a shopping list page")
    streaming = window.chat.widgets[-1]
    client.emit_until(TextDelta, 2)
    qtbot.waitUntil(streaming.preview_button.isVisible, timeout=2000)
    before = len(calls)
    for _ in range(4):
        client.emit_until(TextDelta)
        window.chat.on_stream_refresh()  # a repaint after every delta: still no extraction
    assert "figs" in streaming.body.toPlainText()
    assert len(calls) == before and window.is_generating()
    with qtbot.waitSignal(window.generationFinished, timeout=2000):
        client.emit_until(Finished)
    assert len(calls) == before + 1 and streaming.preview_button.isVisible()  # the finished message: once


def test_reopening_a_conversation_restores_messages(qtbot, store) -> None:
    window, _ = make_window(qtbot, store)
    send(qtbot, window, "remember me")
    window.close()
    again, _ = make_window(qtbot, store)
    assert again.conversation_id is not None
    assert [w.data.role for w in again.chat.widgets] == ["user", "assistant"]
    assert again.chat.widgets[1].data.stats["tokens"] == 96


def test_export_markdown_and_json(qtbot, store, tmp_path) -> None:
    window, _ = make_window(qtbot, store)
    send(qtbot, window, "export me")
    md = window.conversations.export(window.conversation_id, "markdown", str(tmp_path / "chat.md"))
    js = window.conversations.export(window.conversation_id, "json", str(tmp_path / "chat.json"))
    assert "export me" in md.read_text() and '"export me"' in js.read_text()
    assert "Exported to" in window.statusBar().currentMessage()


def test_gui_process_never_imports_torch() -> None:
    """The window, the composition root and the gui command run in the GUI process: no torch there."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "import clover_desk.app, clover_desk.cli.gui, ui.main_window, ui.vram_panel, ui.denoise_view\n"
        "from clover_desk.engine.placement import planner\n"
        "planner.make_plan(planner.manifest_for_shape('clover-35b-a3b'), 12 << 30, 8192)\n"
        "print('torch' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_composition_root_loads_remembers_and_applies(qtbot, tmp_path) -> None:
    from clover_desk.app import AppSettings, CloverDeskApp
    from clover_desk.engine.placement.hardware import Hardware

    client = FakeEngineClient()
    gpu = Hardware(gpu_name="NVIDIA GeForce RTX 4070 Ti SUPER", vram_total_bytes=16 * 1024**3,
                   ram_total_bytes=64 * 1024**3, ram_available_bytes=48 * 1024**3)
    with qtbot.waitSignal(client.loaded, timeout=2000):
        desk = CloverDeskApp(tmp_path, client=client, settings=AppSettings(model_dir="/models/first"),
                             hardware=gpu, with_preview=False, with_model_manager=False)
    qtbot.addWidget(desk.window)
    # nothing applied yet: the first load on a GPU is planned for the panel's proposal, never the whole BF16 model
    proposed = desk.vram_panel.vram_budget_bytes()
    assert 0 < proposed < 16 * 1024**3
    # the load carries the plan the panel shows (the worker places it as is); the folder does not exist here, so
    # the panel plans for the published model's shape
    assert client.loads == [("/models/first", "cuda", "bfloat16", None)]
    shown = desk.vram_panel.plan_for(proposed, desk.vram_panel.ctx_tokens()).to_dict()
    assert client.plans == [shown] and shown["vram_budget_bytes"] == proposed
    assert client.ctx_loads == [desk.vram_panel.ctx_tokens()]
    assert desk.vram_panel.applied == (proposed, desk.vram_panel.ctx_tokens())
    assert desk.window.engine_status.engine_label.text() == "● Ready"
    assert "RTX 4070 Ti SUPER" in desk.window.engine_status.gpu_label.text()
    with qtbot.waitSignal(client.loaded, timeout=2000):
        desk.window.on_model_chosen("/models/second")
    assert client.loads[-1][0] == "/models/second"
    panel = desk.vram_panel
    panel.set_vram_budget_bytes(12 * 1024**3)
    with qtbot.waitSignal(client.loaded, timeout=2000):
        panel.apply_button.click()
    assert client.plans[-1] == panel.plan_for(12 * 1024**3, panel.ctx_tokens()).to_dict()
    assert client.ctx_loads[-1] == panel.applied[1]  # the KV cache is planned for the context chosen in the panel
    assert panel.applied == (12 * 1024**3, DEFAULT_CTX_TOKENS)
    again = AppSettings.load(tmp_path / "settings.json")
    assert (again.model_dir, again.vram_budget_bytes) == ("/models/second", 12 * 1024**3)
    desk.shutdown()


def test_helpers() -> None:
    assert expert_hit_rate({"hits": 3, "misses": 1}) == 0.75
    assert expert_hit_rate({"hit_rate": 0.5}) == 0.5
    assert expert_hit_rate({}) is None
    assert expert_hit_rate({"slot_hits": 9, "slot_misses": 1, "hit_rate": 0.9}) == 0.9
    assert expert_hit_rate({"slot_hits": 0, "slot_misses": 0, "hit_rate": 0.0}) is None  # all experts resident
    # one title rule: the store's (the window asks it), 60 characters cut at a word
    assert ChatStore.title_for("\n  A fairly long first line that will need to be shortened somewhere  \nmore") == (
        "A fairly long first line that will need to be shortened…"
    )


def test_first_run_opens_on_the_real_model_manager(qtbot, tmp_path) -> None:
    """No model configured yet: the composition root shows the model manager page, not an error."""
    from clover_desk.app import AppSettings, CloverDeskApp
    from clover_desk.ui.model_manager import ModelManagerPanel

    client = FakeEngineClient()
    desk = CloverDeskApp(tmp_path, client=client, settings=AppSettings(), with_preview=False)
    qtbot.addWidget(desk.window)
    assert isinstance(desk.model_manager, ModelManagerPanel)
    assert desk.window.pages.currentWidget().isAncestorOf(desk.model_manager)
    assert client.loads == []  # nothing to load, nothing failed
    desk.shutdown()


def test_the_idle_engine_reads_the_open_chat_ahead(qtbot, store) -> None:
    """After an answer, on opening a chat and once a model loads, the window has the idle local engine read the
    chat (its last answer included) into its prompt cache, so the next message is all a send reads; not while an
    answer streams, not for a chat whose last message is not a finished answer."""
    from clover_desk.ui.chat_actions import READ_AHEAD_MS

    window, client = make_window(qtbot, store)
    send(qtbot, window, "Explain block diffusion")
    qtbot.waitUntil(lambda: len(client.reads) == 1, timeout=READ_AHEAD_MS + 2000)
    chat = store.chat_messages(window.conversation_id)
    assert client.reads[0][0] == chat and [m["role"] for m in chat] == ["user", "assistant"]
    assert client.reads[0][1] == window.drawer.settings().to_params() and window.chat_actions.read_ahead_id == "read-1"
    cid = window.conversation_id
    window.conversations.open(None)
    qtbot.wait(READ_AHEAD_MS + 100)
    assert len(client.reads) == 1  # a new chat: nothing to read
    window.conversations.open(cid)
    qtbot.waitUntil(lambda: len(client.reads) == 2, timeout=READ_AHEAD_MS + 2000)
    assert client.reads[1][0] == chat
    window.engine_status.on_engine_loaded({"model_dir": "/models/tiny"})  # a model (re)loaded: its prompt cache is empty
    qtbot.waitUntil(lambda: len(client.reads) == 3, timeout=READ_AHEAD_MS + 2000)
    lone = store.create_conversation("Asked, never answered")
    store.add_message(lone.id, "user", "Hello?")
    window.conversations.open(lone.id)
    qtbot.wait(READ_AHEAD_MS + 100)
    client.paused = True  # an answer streams: the engine is not idle
    window.conversations.open(cid)
    window.composer.input.setPlainText("And then?")
    qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    assert window.is_generating()
    qtbot.wait(READ_AHEAD_MS + 100)
    assert len(client.reads) == 3
