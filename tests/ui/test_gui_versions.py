"""Answer versions end to end: the real window over the real engine (EngineClient → worker process → Engine) on a
scripted tiny model. Regenerate twice, step back with the arrows, go on from the first answer: the engine gets the
chosen branch and its prompt cache still reads only what is new; then the app again on the same data folder, and
the three versions are still there."""

from __future__ import annotations

import pytest
from gui_desk import running_desk
from PySide6.QtCore import Qt
from scripted_model import build_scripted_model

from clover_desk.qt_compat import guard_pyside_bool_refcounts

guard_pyside_bool_refcounts()  # PySide6 6.12 refcount leak on CPython < 3.12 (see there)

pytestmark = pytest.mark.slow

LOAD_MS = 60_000
GEN_MS = 60_000
QUESTION = "Tell me about the lighthouse keepers of the northern islands, their families and their work. " * 2


def _finish(qtbot, window, action) -> dict:  # noqa: ANN001
    with qtbot.waitSignal(window.generationFinished, timeout=GEN_MS) as blocker:
        action()
    assert blocker.args[1] == "eos"
    return dict(window.chat.widgets[-1].data.stats)


def test_regenerate_twice_switch_and_restart(qtbot, qapp, tmp_path_factory) -> None:  # noqa: ANN001
    from clover_desk.app import AppSettings

    model = build_scripted_model(tmp_path_factory.mktemp("versions_model"),
                                 thinking="Let me think</think>Sure.<|im_end|>")
    home = tmp_path_factory.mktemp("desk_home")
    settings = AppSettings(model_dir=str(model.path))
    with running_desk(home, settings, load_ms=LOAD_MS, with_model_manager=False) as app:
        window = app.window

        def send(text: str) -> None:
            window.composer.input.setPlainText(text)
            qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)

        _finish(qtbot, window, lambda: send(QUESTION))
        first_id = window.chat.widgets[-1].data.message_id
        regenerated = [_finish(qtbot, window, window.chat.widgets[-1].regen_button.click) for _ in range(2)]
        assert all(s["cached_tokens"] > 0 for s in regenerated)  # the question came from the prompt cache
        answer = window.chat.widgets[-1]
        assert answer.version_label.text() == "3/3"
        answer.version_prev.click()
        window.chat.widgets[-1].version_prev.click()
        assert window.chat.widgets[-1].data.message_id == first_id
        assert window.chat.widgets[-1].version_label.text() == "1/3"
        follow = _finish(qtbot, window, lambda: send("And the ships?"))
        assert follow["cached_tokens"] > 0
        chat = app.store.chat_messages(window.conversation_id)
        assert [m["role"] for m in chat] == ["user", "assistant", "user", "assistant"]
        cid = window.conversation_id

    with running_desk(home, settings, load_ms=LOAD_MS, with_model_manager=False) as app:  # the app again
        window = app.window
        window.conversations.open(cid)
        assert [w.data.role for w in window.chat.widgets] == ["user", "assistant", "user", "assistant"]
        assert window.chat.widgets[1].data.message_id == first_id
        assert window.chat.widgets[1].version_label.text() == "1/3"
        window.chat.widgets[1].version_next.click()
        assert len(window.chat.widgets) == 2 and window.chat.widgets[1].version_label.text() == "2/3"
