"""Continue, end to end: the real window over the real engine (EngineClient → worker process → Engine) on a
scripted tiny model that thinks 20 words and answers 20 (tests/scripted_model.py). With Max tokens at 16 the answer
is cut twice; Continue goes on each time, and the chat, the store and the statistics end up holding the whole
answer as if it had never been cut."""

from __future__ import annotations

import pytest
from gui_desk import running_desk
from PySide6.QtCore import Qt
from scripted_model import build_scripted_model

from clover_desk.qt_compat import guard_pyside_bool_refcounts

guard_pyside_bool_refcounts()  # PySide6 6.12 refcount leak on CPython < 3.12 (see there)

LOAD_MS = 60_000
GEN_MS = 60_000
THINK = ["t00", *(f" t{i:02d}" for i in range(1, 20))]
ANSWER = ["a00", *(f" a{i:02d}" for i in range(1, 20))]
THINKING, TEXT = "".join(THINK), "".join(ANSWER)


@pytest.fixture(scope="module")
def desk(qapp, tmp_path_factory):  # noqa: ANN001, ANN201
    from clover_desk.app import AppSettings

    model = build_scripted_model(tmp_path_factory.mktemp("continue_model"),
                                 thinking=f"{THINKING}</think>{TEXT}<|im_end|>", extra_tokens=THINK + ANSWER)
    with running_desk(tmp_path_factory.mktemp("desk_home"), AppSettings(model_dir=str(model.path)),
                      load_ms=LOAD_MS, prepare=lambda app: app.window.drawer.max_tokens.setValue(16),
                      with_model_manager=False) as app:
        yield app


def test_continue_twice_gives_the_whole_answer(qtbot, desk) -> None:  # noqa: ANN001
    window = desk.window
    window.composer.input.setPlainText("Count for me")
    with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS) as blocker:
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    assert blocker.args[1] == "max_new_tokens"
    widget = window.chat.widgets[-1]
    assert (widget.data.thinking, widget.data.content) == ("".join(THINK[:16]), "")
    assert widget.continue_button.isVisible() and window.menus.continue_action.isEnabled()
    assert "Continue lets it think on" in widget.note.text()

    with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS) as blocker:
        widget.continue_button.click()
        assert window.is_generating() and not window.menus.continue_action.isEnabled()
    assert blocker.args[1] == "max_new_tokens"
    assert window.chat.widgets[-1] is widget  # the same message grew: no new one
    assert (widget.data.thinking, widget.data.content) == (THINKING, "".join(ANSWER[:11]))
    assert not widget.note.isVisible()

    with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS) as blocker:
        window.menus.continue_action.trigger()  # Edit ▸ Continue last answer
    assert blocker.args[1] == "eos"
    assert (widget.data.thinking, widget.data.content) == (THINKING, TEXT)
    assert not widget.continue_button.isVisible() and not window.menus.continue_action.isEnabled()  # it ended on its own
    stats = widget.data.stats
    assert (stats["tokens"], stats["continued"], stats["stop_reason"]) == (42, 2, "eos")  # 40 words, 2 markers
    assert "continued 2×" in widget.meta_label.text()

    saved = desk.store.messages(window.conversation_id)
    assert [m.role for m in saved] == ["user", "assistant"]
    answer = saved[-1]
    assert (answer.thinking, answer.content, answer.status) == (THINKING, TEXT, "complete")
    assert (answer.stats["tokens"], answer.stats["continued"]) == (42, 2)
    assert answer.thinking_seconds is not None and answer.thinking_seconds > 0
