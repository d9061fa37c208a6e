"""The chat settings drawer's sampling settings, context length, presets and default system prompt (issue 32):
ranges from the engine's one limits table, what is off in each mode, what reaches the engine, and what survives a
restart (window.ini). The real window over a real ChatStore with a scripted engine client."""

from __future__ import annotations

from fakes_ui import FakeEngineClient
from PySide6.QtCore import QSettings, Qt

from clover_desk.engine.decode.limits import GENERATION_LIMITS, INT32_MAX
from clover_desk.qt_compat import guard_pyside_bool_refcounts
from clover_desk.storage.recorder import StreamRecorder
from clover_desk.storage.store import ChatStore
from clover_desk.ui.generation import GenerationSettings, defaults_from_model
from clover_desk.ui.main_window import MainWindow
from clover_desk.ui.settings_drawer import SettingsDrawer

guard_pyside_bool_refcounts()


def make_window(qtbot, store, ini) -> tuple[MainWindow, FakeEngineClient]:  # noqa: ANN001
    client = FakeEngineClient(blocks=2, pass_ms=2)
    window = MainWindow(client, store, StreamRecorder, model_dir="/models/tiny",
                        ui_settings=QSettings(str(ini), QSettings.Format.IniFormat))
    qtbot.addWidget(window)
    window.show()
    return window, client


def send(qtbot, window, text: str) -> None:  # noqa: ANN001
    window.composer.input.setPlainText(text)
    with qtbot.waitSignal(window.generationFinished, timeout=5000):
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)


def test_the_ranges_are_the_engines(qtbot) -> None:
    drawer = SettingsDrawer()
    qtbot.addWidget(drawer)
    limits = GENERATION_LIMITS
    assert 0 < drawer.top_p.minimum() <= 0.01 and drawer.top_p.maximum() == limits["top_p"].hi
    assert (drawer.top_k.minimum(), drawer.top_k.maximum()) == (0, min(int(limits["top_k"].hi), INT32_MAX))
    assert (drawer.presence_penalty.minimum(), drawer.presence_penalty.maximum()) == (
        limits["presence_penalty"].lo, limits["presence_penalty"].hi)
    assert (drawer.repetition_penalty.minimum(), drawer.repetition_penalty.maximum()) == (
        limits["repetition_penalty"].lo, limits["repetition_penalty"].hi)
    assert limits["top_p"].allowed in drawer.top_p.toolTip()


def test_sampling_settings_reach_the_engine_and_greedy_turns_them_off(qtbot, store, tmp_path) -> None:
    window, client = make_window(qtbot, store, tmp_path / "window.ini")
    d = window.drawer
    assert not d.top_p.isEnabled() and not d.top_k.isEnabled() and not d.seed.isEnabled()  # greedy by default
    assert "only when sampling" in d.top_p.toolTip().lower()
    d.temperature.setValue(0.7)
    assert d.top_p.isEnabled() and d.top_k.isEnabled() and d.seed.isEnabled()
    d.top_p.setValue(0.9)
    d.top_k.setValue(40)
    d.presence_penalty.setValue(0.5)
    d.repetition_penalty.setValue(1.1)
    d.seed.setText("1234")
    send(qtbot, window, "hello")
    params = client.requests[-1][1]
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.7, 0.9, 40, 1234)
    assert (params.presence_penalty, params.repetition_penalty) == (0.5, 1.1)
    saved = GenerationSettings.from_dict(store.get_conversation(window.conversation_id).settings)
    assert (saved.top_k, saved.seed, saved.repetition_penalty) == (40, 1234, 1.1)  # kept with the chat
    d.temperature.setValue(0.0)
    assert not d.seed.isEnabled()
    send(qtbot, window, "again")
    params = client.requests[-1][1]
    assert (params.top_p, params.top_k, params.seed) == (None, None, None)  # greedy: the model's own
    assert params.repetition_penalty == 1.1  # penalties apply greedy too


def test_a_bad_seed_is_named_and_not_used(qtbot) -> None:
    drawer = SettingsDrawer()
    qtbot.addWidget(drawer)
    for text in ("abc", "-1", str(2**63)):
        drawer.seed.setText(text)
        assert drawer.settings().seed is None and "Not used: seed must be a whole number" in drawer.seed.toolTip()
    drawer.seed.setText(" 42 ")
    assert drawer.settings().seed == 42 and "Not used" not in drawer.seed.toolTip()


def test_each_mode_says_what_applies_and_disables_what_does_not(qtbot) -> None:
    drawer = SettingsDrawer()
    qtbot.addWidget(drawer)
    drawer.show()
    assert "each slot's proposal" in drawer.mode_note.text()
    assert drawer.block_size.isEnabled() and drawer.threshold.isEnabled()
    drawer.mode.setCurrentIndex(drawer.mode.findData("ar"))
    assert not drawer.block_size.isEnabled() and not drawer.threshold.isEnabled()
    assert "one token per step" in drawer.mode_note.text() and "are off" in drawer.mode_note.text()
    assert drawer.presence_penalty.isEnabled() and drawer.repetition_penalty.isEnabled()


def test_presets_and_the_default_system_prompt_survive_a_restart(qtbot, tmp_path) -> None:
    ini, path = tmp_path / "window.ini", tmp_path / "chats.sqlite3"
    store = ChatStore(path)
    window, client = make_window(qtbot, store, ini)
    d = window.drawer
    assert not d.preset_box.preset_load.isEnabled()  # none yet
    d.system_prompt.setPlainText("You are a pirate.")
    d.temperature.setValue(0.8)
    d.top_k.setValue(20)
    d.preset_box.preset_save.click()
    assert "Not saved: a preset needs a name" in d.preset_box.preset_status.text()
    d.preset_box.preset_name.setText("  Pirate   mode ")
    d.preset_box.preset_save.click()
    assert [d.preset_box.preset_choice.itemText(i) for i in range(d.preset_box.preset_choice.count())] == ["Pirate mode"]
    d.preset_box.default_system_prompt.setPlainText("Answer in French.")
    window.close()
    store.close()

    store = ChatStore(path)  # the app again
    window, client = make_window(qtbot, store, ini)
    d = window.drawer
    assert d.system_prompt.toPlainText() == "Answer in French."  # a new chat starts from the default
    assert d.temperature.value() == 0.0
    d.preset_box.preset_choice.setCurrentIndex(d.preset_box.preset_choice.findText("Pirate mode"))
    d.preset_box.preset_load.click()
    assert (d.temperature.value(), d.top_k.value(), d.system_prompt.toPlainText()) == (0.8, 20, "You are a pirate.")
    send(qtbot, window, "ahoy")
    assert client.requests[-1][0][0] == {"role": "system", "content": "You are a pirate."}
    assert client.requests[-1][1].top_k == 20
    window.conversations.on_new()
    assert d.system_prompt.toPlainText() == "Answer in French."
    send(qtbot, window, "bonjour")
    assert client.requests[-1][0][0] == {"role": "system", "content": "Answer in French."}
    d.preset_box.preset_delete.click()
    assert d.preset_box.preset_choice.count() == 0 and not d.preset_box.preset_load.isEnabled()
    store.close()


def test_context_length_caps_what_a_send_may_hold(qtbot, store, tmp_path) -> None:
    window, _ = make_window(qtbot, store, tmp_path / "window.ini")
    window.chat_settings.set_model_info({"config": {"max_position_embeddings": 4096}})
    d = window.drawer
    assert d.context_length.maximum() == 4096 and d.context_length.specialValueText() == "the model's (4,096)"
    assert window.long_chats.model_limit == 4096
    window.long_chats.blocks_send("hi")
    assert window.long_chats.limit == 4096
    d.context_length.setValue(1000)
    window.long_chats.blocks_send("hi")
    assert window.long_chats.limit == 1000
    assert window.long_chats.meter.limit_room() < 1000


def test_a_models_own_sampling_defaults_are_a_new_chats() -> None:
    s = defaults_from_model({}, {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                 "presence_penalty": 0.9, "repetition_penalty": 1.05})
    assert (s.temperature, s.top_p, s.top_k, s.presence_penalty, s.repetition_penalty) == (0.6, 0.95, 20, 0.9, 1.05)
    bad = defaults_from_model({}, {"top_p": 0.0, "top_k": -3, "repetition_penalty": "x"})  # outside the limits
    assert (bad.top_p, bad.top_k, bad.repetition_penalty) == (1.0, 0, 1.0)
