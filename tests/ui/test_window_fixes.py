"""The window's bugs of issue 32 (part A), each through the real widgets with pytest-qt: links in message text,
the mouse wheel over unfocused choosers, and the small ones (labels, shortcuts, dialogs, elided status texts)."""

from __future__ import annotations

from fixtures_tiny import one_torch_thread, tiny_clover_dir  # noqa: F401 (session fixtures)

from clover_desk.ui.chat_view import ChatView, MessageData


def _anchors(browser) -> list[tuple[str, str]]:  # noqa: ANN001
    """(text, href) of each link in a QTextBrowser's document."""
    found: list[tuple[str, str]] = []
    block = browser.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fragment = it.fragment()
            if fragment.charFormat().isAnchor():
                found.append((fragment.text(), fragment.charFormat().anchorHref()))
            it += 1
        block = block.next()
    return found


def test_links_in_user_and_model_text_keep_the_text_around_them(qtbot) -> None:
    """Before: `link "http://example.com/a" then x` showed `"http://example.com/a&quot; then x` with `&quot` in the
    link target, and a URL before `</html>` showed a literal `&gt;`."""
    view = ChatView()
    qtbot.addWidget(view)
    text = 'link "http://example.com/a" then x; page at http://example.com/p</html> and http://x.org/?a=1&b=2.'
    user = view.add_message(MessageData(role="user", content=text))
    model = view.add_message(MessageData(role="assistant", content=text))
    for widget in (user, model):
        shown = widget.body.toPlainText()
        assert shown == text, shown
        assert _anchors(widget.body) == [("http://example.com/a", "http://example.com/a"),
                                         ("http://example.com/p", "http://example.com/p"),
                                         ("http://x.org/?a=1&b=2", "http://x.org/?a=1&b=2")]


def _wheel(widget, steps: int = -1) -> None:  # noqa: ANN001
    """One real wheel notch over ``widget``'s centre, delivered as Qt delivers it (through the application)."""
    from PySide6.QtCore import QPoint, QPointF, Qt
    from PySide6.QtGui import QWheelEvent
    from PySide6.QtWidgets import QApplication

    centre = QPointF(widget.rect().center())
    event = QWheelEvent(centre, QPointF(widget.mapToGlobal(centre.toPoint())), QPoint(0, 0), QPoint(0, 120 * steps),
                        Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase, False)
    QApplication.sendEvent(widget, event)


def test_the_wheel_leaves_unfocused_choosers_alone_on_the_models_page(qtbot, tmp_path) -> None:
    """Before: scrolling the models page changed the download choice when the pointer passed over "What"."""
    from fakes_ui import FakeEngineClient
    from PySide6.QtWidgets import QDoubleSpinBox

    from clover_desk.app import AppSettings, CloverDeskApp
    from clover_desk.ui.widgets import install_wheel_guard

    desk = CloverDeskApp(tmp_path, client=FakeEngineClient(), settings=AppSettings(), with_preview=False)
    qtbot.addWidget(desk.window)
    desk.window.resize(1000, 500)
    desk.window.show()
    desk.window.show_models_page()
    combo = desk.model_manager.download_choice
    assert combo.count() > 1
    combo.setCurrentIndex(0)
    page = desk.window.pages.currentWidget()
    page.verticalScrollBar().setValue(0)
    desk.window.sidebar.setFocus()
    _wheel(combo)
    assert combo.currentIndex() == 0  # the choice stays
    assert page.verticalScrollBar().value() > 0  # the page scrolled instead
    combo.setFocus()
    qtbot.waitUntil(combo.hasFocus)
    _wheel(combo)
    assert combo.currentIndex() == 1  # focused on purpose: the wheel picks
    spin = QDoubleSpinBox(desk.window.drawer)  # a box added after the window was built: guarded when asked again
    install_wheel_guard(desk.window)
    spin.setValue(1.0)
    _wheel(spin, steps=1)
    assert spin.value() == 1.0
    desk.shutdown()


def test_the_serve_dialogs_key_label_is_a_mnemonic_not_an_ampersand(qtbot) -> None:
    """Before: the label read "API &key" (a row that is a layout gets no buddy, so the "&" showed)."""
    from PySide6.QtWidgets import QLabel

    from clover_desk.ui.serve_panel import ServeDialog

    dialog = ServeDialog()
    qtbot.addWidget(dialog)
    dialog.show()
    (label,) = [w for w in dialog.findChildren(QLabel) if w.text() == "API &key"]
    assert label.buddy() is dialog.api_key  # Alt+K focuses the key; the "&" is drawn as an underline


def test_a_download_error_and_what_to_do_are_two_sentences(qtbot, tmp_path) -> None:
    """Before: "... Name or service not known Press Resume to try again"."""
    from clover_desk.ui.model_manager import ModelManagerPanel

    panel = ModelManagerPanel(models_dir=tmp_path / "models")
    qtbot.addWidget(panel)
    panel._on_download_failed("cannot reach huggingface.co: Name or service not known", False)
    assert "not known. Press Resume to try again" in panel.download_status.text()
    panel._on_download_failed("disk full.", False)
    assert "disk full. Press Resume" in panel.download_status.text()


def test_f2_renames_the_chat_while_the_composer_has_focus(qtbot, tmp_path) -> None:
    """Before: F2 did nothing unless the chat list had the focus, though Edit ▸ Rename chat advertises it."""
    from fakes_ui import FakeEngineClient
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QAbstractItemView

    from clover_desk.storage.recorder import StreamRecorder
    from clover_desk.storage.store import ChatStore
    from clover_desk.ui.main_window import MainWindow

    store = ChatStore(tmp_path / "chats.db")
    conversation = store.create_conversation("Lighthouses")
    window = MainWindow(FakeEngineClient(), store, StreamRecorder, model_dir="/models/tiny")
    qtbot.addWidget(window)
    window.show()
    window.conversations.open(conversation.id)
    window.composer.input.setFocus()
    qtbot.waitUntil(window.composer.input.hasFocus)
    qtbot.keyClick(window.composer.input, Qt.Key.Key_F2)
    assert window.sidebar.list.state() == QAbstractItemView.State.EditingState
    window.close()
    store.close()


def test_a_second_demo_model_gets_a_new_folder(qtbot, tmp_path) -> None:
    """Before: "Create demo model" again wrote over the first demo (perhaps the model loaded)."""
    from clover_desk.ui.model_manager import DEMO_FOLDER_NAME, ModelManagerPanel

    models = tmp_path / "models"
    (models / DEMO_FOLDER_NAME).mkdir(parents=True)
    (models / f"{DEMO_FOLDER_NAME}-2").mkdir()
    panel = ModelManagerPanel(models_dir=models, python="true")  # (a child that makes nothing: the folder is the test)
    qtbot.addWidget(panel)
    with qtbot.waitSignal(panel.demoEnded, timeout=30_000):
        panel.demo.button.click()
    assert panel.demo.folder == models / f"{DEMO_FOLDER_NAME}-3"
    assert sorted(p.name for p in models.iterdir()) == [DEMO_FOLDER_NAME, f"{DEMO_FOLDER_NAME}-2"]


def test_make_tiny_files_all_follow_the_umask(tmp_path) -> None:
    """Before: the safetensors shards were 0600 (the library's own mode) and every other file 0644."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "clover_desk.cli.main", "make-tiny", str(tmp_path / "m")], cwd=root,
                          capture_output=True, text=True, timeout=300, umask=0o027)
    assert done.returncode == 0, done.stderr[-2000:]
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "m").iterdir() if p.is_file()}
    assert any(name.endswith(".safetensors") for name in modes)
    assert set(modes.values()) == {0o640}, {n: oct(m) for n, m in modes.items()}


def test_why_send_waits_is_shown_whole_at_the_smallest_window(qtbot, tmp_path) -> None:
    """Before: "Send works once it is re…" at 1024 px wide."""
    from fakes_ui import FakeEngineClient
    from PySide6.QtCore import Qt

    from clover_desk.storage.recorder import StreamRecorder
    from clover_desk.storage.store import ChatStore
    from clover_desk.ui.contracts import EngineState
    from clover_desk.ui.main_window import MainWindow

    store = ChatStore(tmp_path / "chats.db")
    window = MainWindow(FakeEngineClient(), store, StreamRecorder, model_dir="/models/tiny")
    qtbot.addWidget(window)
    window.resize(1024, 640)
    window.show()
    window.engine_status.set_state(EngineState.LOADING)
    window.chat_actions.update_send_state()
    label = window.composer.blocked_label
    qtbot.waitUntil(label.isVisible)
    qtbot.wait(50)  # (one layout pass)
    rect = label.contentsRect()
    flags = Qt.TextFlag.TextWordWrap if label.wordWrap() else Qt.TextFlag(0)
    needed = label.fontMetrics().boundingRect(rect, flags, label.text())
    assert needed.width() <= rect.width() and needed.height() <= rect.height(), (label.text(), rect, needed)
    window.close()
    store.close()


def test_one_context_size_the_loaded_one_capped_by_the_model(qtbot, tmp_path, tiny_clover_dir) -> None:  # noqa: F811
    """Before: the composer said "x / 131,072 tokens" (the model's max_position_embeddings) while the VRAM panel's
    applied context was 16K and a CPU load sent no context at all."""
    from fakes_ui import FakeEngineClient

    from clover_desk.app import AppSettings, CloverDeskApp

    client = FakeEngineClient(loaded=False)
    settings = AppSettings(model_dir=str(tiny_clover_dir), device="cpu", ctx_tokens=16_384)
    desk = CloverDeskApp(tmp_path, client=client, settings=settings, with_preview=False, with_model_manager=False,
                         start_engine=False)  # (a started client's "ready" would load once more, in between)
    qtbot.addWidget(desk.window)
    assert desk.window.long_chats.limit == 16_384  # before the load: the context it will load with
    with qtbot.waitSignal(client.loaded, timeout=5000):
        desk.load_model()
    assert client.ctx_loads[-1] == 16_384  # the load carries it (no plan on the CPU)
    assert desk.window.long_chats.limit == 16_384 == desk.vram_panel.ctx_tokens()
    desk.settings.ctx_tokens = 262_144  # more than the model takes: capped by max_position_embeddings
    with qtbot.waitSignal(client.loaded, timeout=5000):
        desk.load_model()
    assert desk.window.long_chats.limit == 131_072
    desk.shutdown()


def _remote_window(qtbot, tmp_path, client):  # noqa: ANN001, ANN202
    """A window on ``client`` whose saved backend is a remote server asking for "remote-model"."""
    from PySide6.QtCore import QSettings

    from clover_desk.storage.recorder import StreamRecorder
    from clover_desk.storage.store import ChatStore
    from clover_desk.ui.main_window import MainWindow
    from clover_desk.worker.remote import RemoteBackend

    settings = QSettings(str(tmp_path / "window.ini"), QSettings.Format.IniFormat)
    for key, value in (("backend", "local"), ("remote_url", "http://127.0.0.1:9/v1"), ("remote_model", "remote-model")):
        settings.setValue(key, value)
    store = ChatStore(tmp_path / "chats.db")
    window = MainWindow(client, store, StreamRecorder, model_dir="/models/clover-tiny-demo", ui_settings=settings)
    qtbot.addWidget(window)
    window.set_remote_factory(RemoteBackend)
    window.show()
    return window, store


def test_no_stale_figures_or_names_after_switching_to_the_remote(qtbot, tmp_path) -> None:
    """Before: the status bar showed the local engine's "41.5 tok/s (remote)" before any remote answer, and the chat
    header named the local demo model while the answers came from the remote one."""
    from fakes_ui import FakeEngineClient
    from PySide6.QtCore import Qt

    window, store = _remote_window(qtbot, tmp_path, FakeEngineClient(blocks=2, pass_ms=2))
    window.composer.input.setPlainText("Hello")
    with qtbot.waitSignal(window.generationFinished, timeout=5000):
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    assert window.engine_status.speed_label.text() == "41.5 tok/s" and window.model_label.text() == "clover-tiny-demo"
    dialog = window.remote.dialog
    dialog.remote.click()  # Model ▸ Backend…: the remote server
    window.engine_status.refresh()
    assert window.engine_status.speed_label.text() == "tok/s unavailable (remote)"
    assert window.model_label.text() == "remote-model"
    dialog.local.click()
    window.engine_status.refresh()
    assert window.engine_status.speed_label.text() == "41.5 tok/s" and window.model_label.text() == "clover-tiny-demo"
    window.close()
    store.close()


def test_loading_cancelled_goes_with_another_chat_backend_or_load(qtbot, tmp_path) -> None:
    """Before: "Loading cancelled." stayed over every chat and backend afterwards."""
    from fakes_ui import FakeEngineClient

    from clover_desk.engine.decode.events import LoadProgress

    window, store = _remote_window(qtbot, tmp_path, FakeEngineClient())
    other = store.create_conversation("Another chat")

    def cancelled() -> None:
        window.engine_status.on_engine_error_message("CancelledError", "loading was cancelled")
        assert window.info_banner.isVisible() and window.info_banner.label.text() == "Loading cancelled."

    cancelled()
    window.conversations.open(other.id)
    assert not window.info_banner.isVisible()
    cancelled()
    window.remote.dialog.remote.click()
    assert not window.info_banner.isVisible()
    cancelled()
    window.engine_status.on_load_progress(LoadProgress("reading", 0, 10))
    assert not window.info_banner.isVisible()
    window.close()
    store.close()


def test_reload_now_goes_once_reloaded_and_deleted_models_leave_recent(qtbot, tmp_path, tiny_clover_dir) -> None:  # noqa: F811
    """Before: "Reload now" stayed after the reload; Recent models listed a model deleted since."""
    import json

    from fakes_ui import FakeEngineClient

    from clover_desk.app import AppSettings, CloverDeskApp

    gone = tmp_path / "models" / "deleted-model"
    (tmp_path / "recent_models.json").write_text(json.dumps([str(gone), str(tiny_clover_dir)]), encoding="utf-8")
    client = FakeEngineClient()
    desk = CloverDeskApp(tmp_path, client=client, settings=AppSettings(model_dir=str(tiny_clover_dir)),
                         with_preview=False)
    qtbot.addWidget(desk.window)
    desk.window.show()
    desk.window.show_models_page()
    manager, library = desk.model_manager, desk.model_library
    assert manager.recent_models() == [str(tiny_clover_dir)]
    assert [manager.recent_list.item(i).data(256) for i in range(manager.recent_list.count())] == [str(tiny_clover_dir)]
    library.compile_choice.setChecked(not library.compile_choice.isChecked())  # an option for the next load
    assert library.reload_button.isVisible()
    with qtbot.waitSignal(client.loaded, timeout=5000):
        library.reload_button.click()
    assert library.reload_button.isHidden()  # (hidden itself, whichever page shows now)
    desk.shutdown()


def test_the_compile_warm_up_shows_its_elapsed_time(qtbot) -> None:
    """Before: "one-time warm-up 1 of 2" sat unchanged for 7+ minutes, with no elapsed time."""
    from clover_desk.engine.decode.events import LoadProgress
    from clover_desk.ui.banners import LoadBanner

    now = [100.0]
    banner = LoadBanner(clock=lambda: now[0])
    qtbot.addWidget(banner)
    what = "one-time warm-up 1 of 2: 32 tokens of AR decoding"
    banner.set_progress(LoadProgress("compiling-ar", 0, 0, what))
    assert banner.detail.text() == f"0 s · {what}" and banner.ticker.isActive()
    now[0] += 125
    qtbot.waitUntil(lambda: banner.detail.text() == f"2 min 05 s · {what}", timeout=3000)  # the ticker, by itself
    banner.set_progress(LoadProgress("compiling-ar", 0, 0, what))  # the same stage again: the clock runs on
    assert banner.detail.text().startswith("2 min 05 s")
    banner.hide()
    assert not banner.ticker.isActive()


def test_a_cancelled_compile_leaves_the_model_loaded_uncompiled(tiny_clover_dir, one_torch_thread) -> None:  # noqa: F811
    """Before: Cancel during "Compile the layers" ended in "No model". Now the warm-up stops at its next pass and the
    model stays loaded, running eagerly, with the same tokens as an uncompiled load."""
    import threading

    from clover_desk.engine.api import Engine
    from clover_desk.engine.decode.events import Finished, GenerationParams
    from clover_desk.engine.kernels import fastpath

    if fastpath.unavailable("cpu"):
        import pytest

        pytest.skip(f"no CPU compile here: {fastpath.unavailable('cpu')}")
    cancel = threading.Event()

    def progress(event) -> None:  # noqa: ANN001
        if event.stage.startswith("compiling"):
            cancel.set()  # the user presses Cancel as the warm-up starts

    engine = Engine.load(tiny_clover_dir, compile=True, progress=progress, cancel=cancel)
    assert engine.compile_cancelled and not engine.compiled and "cancelled" in (engine.compile_skipped or "")
    params = GenerationParams(mode="ar", max_new_tokens=8, do_sample=False)
    ours = [e for e in engine.generate(prompt="hello", params=params) if isinstance(e, Finished)][-1]
    eager = [e for e in Engine.load(tiny_clover_dir).generate(prompt="hello", params=params)
             if isinstance(e, Finished)][-1]
    assert ours.token_ids == eager.token_ids


def test_after_a_cancelled_compile_the_box_is_unticked_and_remote_never_compiles(qtbot, tmp_path,
                                                                                 tiny_clover_dir) -> None:  # noqa: F811
    """Before: the box stayed ticked (the next start compiled again), even with the remote backend selected."""
    import json

    from fakes_ui import FakeEngineClient

    from clover_desk.app import AppSettings, CloverDeskApp

    client = FakeEngineClient(loaded=False)
    settings = AppSettings(model_dir=str(tiny_clover_dir), device="cpu", compile_layers=True)
    desk = CloverDeskApp(tmp_path, client=client, settings=settings, with_preview=False, start_engine=False)
    qtbot.addWidget(desk.window)
    with qtbot.waitSignal(client.loaded, timeout=5000):
        desk.load_model()
    assert client.compiles[-1] is True
    info = {"model_dir": str(tiny_clover_dir), "device": "cpu", "compile_cancelled": True,
            "compile_skipped": "compiling was cancelled: the model runs uncompiled"}
    client.loaded.emit(info)  # what the worker answers when Cancel came during the warm-up
    assert not desk.settings.compile_layers and not desk.model_library.compile_choice.isChecked()
    assert json.loads((tmp_path / "settings.json").read_text(encoding="utf-8"))["compile_layers"] is False
    assert "uncompiled" in desk.window.info_banner.label.text() and desk.model_library.reload_button.isHidden()
    desk.settings.compile_layers = True  # ticked again, but the remote server answers
    desk.window.remote.dialog.remote.click()
    with qtbot.waitSignal(client.loaded, timeout=5000):
        desk.load_model()
    assert client.compiles[-1] is False
    desk.shutdown()


def _one_turn(qtbot) -> None:  # noqa: ANN001
    """Let the event loop turn once (what was posted before runs), without sleeping."""
    from PySide6.QtCore import QTimer

    timer = QTimer()
    timer.setSingleShot(True)
    with qtbot.waitSignal(timer.timeout, timeout=2000):
        timer.start(0)


def test_the_wheel_guard_covers_dialogs_created_after_the_window(qtbot, tmp_path) -> None:
    """Issue 32: the guard was installed once, on the boxes the window held when it was built; a dialog opened
    later (Model ▸ Serve over HTTP…, any dialog the window owns) let a passing wheel change its boxes."""
    from fakes_ui import FakeEngineClient
    from PySide6.QtCore import QObject, Signal
    from PySide6.QtWidgets import QComboBox, QDialog, QLineEdit, QSpinBox, QVBoxLayout

    from clover_desk.storage.recorder import StreamRecorder
    from clover_desk.storage.store import ChatStore
    from clover_desk.ui.main_window import MainWindow

    class FakeServer(QObject):  # the ServerControl contract, serving nothing
        serving = Signal(str)
        serveStopped = Signal()
        serveFailed = Signal(str)
        server_url = None
        server_policy = ""

        def start_server(self, host: str, port: int, api_key: str | None = None) -> None: ...

        def stop_server(self) -> None: ...

    store = ChatStore(tmp_path / "chats.db")
    window = MainWindow(FakeEngineClient(), store, StreamRecorder, model_dir="/models/tiny")
    qtbot.addWidget(window)
    window.show()
    dialog = QDialog(window)  # built after the window, opened later
    layout = QVBoxLayout(dialog)
    first, combo, spin = QLineEdit(), QComboBox(), QSpinBox()
    combo.addItems(["one", "two", "three"])
    spin.setValue(5)
    for widget in (first, combo, spin):
        layout.addWidget(widget)
    dialog.show()
    qtbot.waitExposed(dialog)
    _one_turn(qtbot)  # of the event loop, as between a dialog opening and the user's first wheel
    first.setFocus()
    _wheel(combo)
    _wheel(spin, steps=1)
    assert (combo.currentIndex(), spin.value()) == (0, 5)  # the wheel passed over them: nothing changed
    combo.setFocus()
    qtbot.waitUntil(combo.hasFocus)
    _wheel(combo)
    assert combo.currentIndex() == 1  # focused on purpose: the wheel picks
    dialog.close()

    window.set_server_control(FakeServer())  # a real dialog of the window, created after it was built
    window.serve.open()
    port = window.serve.dialog.port
    qtbot.waitExposed(window.serve.dialog)
    _one_turn(qtbot)
    before = port.value()
    window.serve.dialog.host.setFocus()
    _wheel(port, steps=1)
    assert port.value() == before
    window.serve.dialog.close()
    window.close()
    store.close()


def test_stop_in_the_first_block_keeps_the_committed_text_and_offers_continue(qtbot, tmp_path) -> None:
    """Issue 32, bug 3, through the real window: Esc a few passes into the first block of a diffusion answer left an
    empty bubble ("stopped", no text, no Continue) while the denoising panel showed the committed tokens. The client
    here runs the real decode loop (engine.decode.generate, the scripted model of tests/letter_model.py: one slot
    committed per pass) one event per step, in the window's thread, as the worker would stream it."""
    import itertools
    import threading

    from fakes_ui import FakeEngineClient
    from letter_model import MASK, LetterTokenizer, ScriptedModel, letters, settings
    from PySide6.QtCore import Qt

    from clover_desk.engine.decode.events import BlockStep, Finished, TextDelta
    from clover_desk.engine.decode.generate import generate
    from clover_desk.storage.recorder import StreamRecorder
    from clover_desk.storage.store import ChatStore
    from clover_desk.ui.main_window import MainWindow

    class DecodingClient(FakeEngineClient):
        """The engine client's contract over the real decode loop, stepped by the test."""

        def generate(self, messages, params, tools=None) -> str:  # noqa: ANN001
            self._n += 1
            self._rid = f"r{self._n}"
            self.requests.append((list(messages), params))
            self.stop = threading.Event()
            model = ScriptedModel(letters, margin=lambda p: 1.0)  # one slot per pass: many passes per block
            self.events = generate(model, [letters(p) for p in range(8)], settings(max_new_tokens=64),
                                   LetterTokenizer(), self.stop)
            return self._rid

        def step(self) -> object:
            event = next(self.events)
            self.event.emit(self._rid, event)
            return event

        def cancel(self, request_id: str | None = None) -> None:
            self.cancelled.append(request_id or self._rid)
            self.stop.set()  # as the worker's cancel: the loop ends at its next pass

        def drain(self) -> list[object]:
            rest = list(self.events)
            for event in rest:
                self.event.emit(self._rid, event)
            return rest

    store = ChatStore(tmp_path / "chats.db")
    client = DecodingClient()
    window = MainWindow(client, store, StreamRecorder, model_dir="/models/tiny")
    qtbot.addWidget(window)
    window.show()
    window.composer.input.setPlainText("Spell something")
    qtbot.keyClick(window.composer.input, Qt.Key.Key_Return)
    assert window.is_generating()
    event = client.step()
    while not (isinstance(event, BlockStep) and event.pass_index == 2):  # three passes into the first block
        assert not isinstance(event, (TextDelta, Finished))
        event = client.step()
    shown = event.tokens[event.prompt_slots:]
    committed = LetterTokenizer().decode(list(itertools.takewhile(lambda t: t != MASK, shown)))  # the text so far
    assert len(committed) == 3
    bubble = window.chat.widgets[-1]
    assert bubble.data.content == ""  # no block committed yet: only the denoising panel shows the tokens

    with qtbot.waitSignal(window.generationFinished, timeout=5000) as ended:
        qtbot.keyClick(window.composer.input, Qt.Key.Key_Escape)
        assert client.cancelled == ["r1"]
        rest = client.drain()
    assert ended.args[1] == "cancelled" and isinstance(rest[-1], Finished)
    assert (bubble.data.status, bubble.data.content) == ("stopped", committed)
    assert committed in bubble.body.toPlainText()
    assert bubble.continue_button.isVisible() and window.menus.continue_action.isEnabled()
    saved = store.messages(window.conversation_id)[-1]
    assert (saved.status, saved.content) == ("stopped", committed)
    window.close()
    store.close()
