"""The Clover Desk window: conversations on the left, the chat in the middle, live panels on the right, a menu bar.

The window talks to the engine only through an engine client (:class:`~ui.contracts.EngineClientLike`, a worker
process behind Qt signals) and to the disk only through a chat store (:class:`~ui.contracts.ChatStoreLike`); both
are passed in (see ``clover_desk.app``). :class:`MainWindow` is a view: it builds and lays out the widgets and wires
their signals to the plain classes it owns, each with one job (see docs/DESIGN.md, "The window as a view"):

* :class:`~ui.chat_session.ChatSession` (the chat's controller, no widgets) and :class:`~ui.answer_display.AnswerDisplay`
  (where its calls land on screen): every engine event of an answer goes there (:meth:`MainWindow.on_engine_event`);
  a reply is saved as it streams, each committed block in one transaction, so a crash loses at most that block;
* :class:`~ui.chat_actions.ChatActions`: the user's chat actions, each only when it may (Send waits for a model and
  keeps the text, says why otherwise; Continue is the local engine's only), what answers, the read-ahead;
* :class:`~ui.chat_settings.ChatSettings`: the chat's settings in the drawer, the composer and the store, and the
  model's own defaults a new chat starts from;
* :class:`~ui.conversations.Conversations`: opening a chat, the list and search, rename, delete, export;
* :class:`~ui.engine_status.EngineStatus`: the engine's load / error / crash states, its banners, the status bar;
* :class:`~ui.window_menus.WindowMenus`: the menus, their shortcuts, the Help dialogs;
* :class:`~ui.window_state.WindowState`: size, columns, side tab, theme, export folder, remembered in the
  ``QSettings`` handed in (none: nothing is remembered); :class:`~ui.long_chats.LongChats`: chats longer than the
  context.

A save that fails (a full disk, a read-only folder: the store's ``Error``) is shown in the info banner
(:meth:`MainWindow.show_save_error`) and never loses what the user typed.
"""

from __future__ import annotations

import logging

from PySide6.QtCore import QSettings, QSize, Qt, QTimer, Signal
from PySide6.QtGui import (
    QCloseEvent,
    QGuiApplication,
    QResizeEvent,
    QShowEvent,
)
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QMainWindow,
    QPushButton,
    QScrollArea,
    QSplitter,
    QStackedWidget,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from clover_desk.ui.answer_display import AnswerDisplay
from clover_desk.ui.banners import Banner, LoadBanner
from clover_desk.ui.chat_actions import ChatActions
from clover_desk.ui.chat_presets import ChatPresets
from clover_desk.ui.chat_session import ChatSession
from clover_desk.ui.chat_settings import ChatSettings
from clover_desk.ui.chat_view import (
    ChatView,
    HtmlExtractor,
    MessageData,
)
from clover_desk.ui.composer import Composer
from clover_desk.ui.contracts import (
    ChatStoreLike,
    EngineClientLike,
    EngineState,
    MemoryMonitor,
    RecorderFactory,
    RemoteFactory,
    ServerControl,
    TokenCounterLike,
)
from clover_desk.ui.conversations import Conversations
from clover_desk.ui.denoise_view import DenoiseView
from clover_desk.ui.engine_status import EngineStatus
from clover_desk.ui.generation import GenerationSettings
from clover_desk.ui.long_chats import LongChats
from clover_desk.ui.prompt_progress import PromptProgress
from clover_desk.ui.remote_chat import RemoteBackendControl
from clover_desk.ui.serve_panel import ServeController, ServeDialog
from clover_desk.ui.settings_drawer import SettingsDrawer
from clover_desk.ui.sidebar import ConversationSidebar
from clover_desk.ui.widgets import ElidedLabel, accessible, install_wheel_guard, named, push_button, vbox
from clover_desk.ui.window_menus import APP_NAME, WindowMenus
from clover_desk.ui.window_state import DEFAULT_SIZE, MIN_CHAT_WIDTH, MIN_SIDE_WIDTH, WindowState

log = logging.getLogger(__name__)



def models_page(manager: QWidget, library: QWidget | None) -> QWidget:
    """The models page: the library (the models on disk) above the ways to get another one, scrolling."""
    page = QScrollArea()  # the manager is taller than a 640 px window: it scrolls
    page.setObjectName("modelsPage")
    page.setWidgetResizable(True)
    page.setFrameShape(QFrame.Shape.NoFrame)
    page.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    if library is None:
        page.setWidget(manager)
        return page
    column = QWidget()
    column.setObjectName("modelsColumn")
    layout = QVBoxLayout(column)
    layout.setContentsMargins(0, 0, 0, 0)
    layout.setSpacing(0)
    layout.addWidget(library)
    layout.addWidget(manager, 1)
    page.setWidget(column)
    return page


class MainWindow(QMainWindow):
    """Composition of the views around one engine client and one chat store."""

    conversationChanged = Signal(int)  # the conversation shown (id)
    generationStarted = Signal(str)  # request id
    generationFinished = Signal(str, str)  # (request id, stop reason | "error" | "crashed" | "not-saved")
    modelChosen = Signal(str)  # a model folder was picked in the model manager (the app loads it)
    applyPlanRequested = Signal(object, int)  # (vram bytes as int, ctx tokens) from the VRAM panel
    themeChanged = Signal(str)  # the palette now applied: "light" | "dark"

    def __init__(
        self,
        client: EngineClientLike,
        store: ChatStoreLike,
        recorder_factory: RecorderFactory,
        *,
        model_dir: str | None = None,
        vram_panel: QWidget | None = None,
        preview: QWidget | None = None,  # a QWidget that is also an HtmlPreview
        model_manager: QWidget | None = None,
        model_library: QWidget | None = None,  # shown above the model manager (ui.model_library.ModelLibrary)
        html_extractor: HtmlExtractor | None = None,
        monitor: MemoryMonitor | None = None,
        gpu_name: str | None = None,
        model_defaults: GenerationSettings | None = None,
        ui_settings: QSettings | None = None,
        token_counter: TokenCounterLike | None = None,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle(APP_NAME)
        self.client = client
        self.store = store
        self._save_error: type[Exception] = getattr(store, "Error", OSError)
        self.model_dir = model_dir
        self.monitor = monitor
        self.gpu_name = gpu_name
        self.ui_settings = ui_settings
        self.remote: RemoteBackendControl | None = None  # Model ▸ Backend…: a remote server (set_remote_factory)
        # the chat's controller (no widgets) and where its calls land on screen
        self.answers = AnswerDisplay(self)
        self.session = ChatSession(client, store, recorder_factory, self.answers)
        self.chat_actions = ChatActions(self, self)  # the user's actions, each when it may; the read-ahead
        self.chat_settings = ChatSettings(self, model_defaults)  # the chat's settings: drawer, composer, store
        self.state = WindowState(self, ui_settings)  # size, columns, tab, theme, export folder: remembered
        self.conversations = Conversations(self)  # the list, rename, delete, export

        # -- views
        self.sidebar = ConversationSidebar()
        self.chat = ChatView(html_extractor)
        self.chat.setObjectName("chatView")
        self.composer = Composer()
        self.prompt_progress = PromptProgress()  # reading a long prompt, before the answer's first pass
        self.drawer = SettingsDrawer()
        self.drawer.set_preset_store(ChatPresets(self.ui_settings))  # presets, new chats' system prompt: window.ini
        self.drawer.set_settings(self.chat_settings.model_defaults, self.drawer.new_chat_system_prompt())
        self.long_chats = LongChats(self, token_counter)  # the context meter and what to do when a chat outgrows it
        self.composer.add_status_widget(self.long_chats.meter)
        self.crash_banner = Banner("crashBanner", "Restart engine", "Engine stopped")
        self.info_banner = Banner("infoBanner", what="Notice")
        self.load_banner = LoadBanner()
        self.denoise = DenoiseView()
        self.vram_panel = vram_panel
        self.preview = preview
        self.preview_off: str | None = getattr(preview, "off_reason", None)  # why the preview cannot run here
        self.model_manager = model_manager
        self.model_library = model_library
        self.title_label = named(ElidedLabel("New chat", "title"), "pageTitle", "Page title")
        self.model_label = named(ElidedLabel("", "muted"), "modelName", "Model")
        self.settings_button = push_button("Settings", "settingsButton", style="ghost", checked=False,
                                           tip="System prompt, temperature, block size, threshold… (Ctrl+,)",
                                           name="Chat settings")
        self.panel_button = push_button("Panels", "panelsButton", style="ghost", checked=True,
                                        tip="Show or hide the denoising / VRAM / preview panels (Ctrl+Shift+P)",
                                        name="Side panels")
        self.tabs = QTabWidget()
        self.tabs.setObjectName("sideTabs")
        self.tabs.setDocumentMode(True)
        self.tabs.addTab(self.denoise, "Denoising")
        if vram_panel is not None:
            self.tabs.addTab(vram_panel, "VRAM")
        if preview is not None:
            self.tabs.addTab(preview, "Preview")
        accessible(self.tabs, "Panels")
        self.pages = QStackedWidget()
        self.pages.setObjectName("pages")
        self.chat_page = self._build_chat_page()
        self.pages.addWidget(self.chat_page)
        if model_manager is not None:
            self.pages.addWidget(models_page(model_manager, model_library))
        self.engine_status = EngineStatus(self, self)  # the engine's state, its banners, the status bar
        self._build_layout()
        self.menus = WindowMenus(self)  # the menu bar, its actions and shortcuts, the Help dialogs
        self._build_tab_order()
        self._connect_signals()
        self.chat_settings.sync()
        self.engine_status.start()
        self.state.restore()
        self.conversations.reload()
        conversations = self.store.list_conversations(limit=1)
        if conversations:
            self.conversations.open(conversations[0].id)
        if model_dir is None and model_manager is not None:
            self.show_models_page()
        if self.preview_off:
            self.info_banner.action.setVisible(False)
            self.info_banner.show_message(self.preview_off[:1].upper() + self.preview_off[1:] + ".")
        install_wheel_guard(self)  # no value changes under a passing mouse wheel, in every box the window holds
        self.engine_status.refresh()

    # ----------------------------------------------------------------- the session's state, as the window's
    @property
    def conversation_id(self) -> int | None:
        return self.session.conversation_id

    @conversation_id.setter
    def conversation_id(self, value: int | None) -> None:
        self.session.conversation_id = value

    @property
    def request_id(self) -> str | None:
        return self.session.request_id

    @property
    def reply_data(self) -> MessageData | None:
        return self.session.reply_data

    @property
    def preview_follows(self) -> MessageData | None:
        return self.answers.preview_follows

    # ----------------------------------------------------------------- construction
    def _build_chat_page(self) -> QWidget:
        page = QWidget()
        page.setObjectName("chatPage")
        header = QFrame()
        header.setObjectName("chatHeader")
        h = QHBoxLayout(header)
        h.setContentsMargins(20, 10, 12, 10)
        h.addWidget(self.title_label, 3)
        h.addSpacing(10)
        h.addWidget(self.model_label, 1)
        h.addStretch(0)
        h.addWidget(self.settings_button)
        h.addWidget(self.panel_button)
        center = QWidget()
        banners = vbox(self.crash_banner, self.info_banner, self.load_banner, margins=(20, 8, 20, 0), spacing=6)
        c = vbox(banners, (self.chat, 1), spacing=0, parent=center)
        composer_row = QVBoxLayout()
        composer_row.setContentsMargins(20, 6, 20, 14)
        composer_row.setSpacing(6)
        composer_row.addWidget(self.prompt_progress)
        composer_row.addWidget(self.composer)
        c.addLayout(composer_row)
        layout = QVBoxLayout(page)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        layout.addWidget(header)
        layout.addWidget(center, 1)
        return page

    def _build_layout(self) -> None:
        # one splitter: chats | chat | panels (each remembered; none can be squeezed to nothing)
        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.setObjectName("mainSplitter")
        self.splitter.setChildrenCollapsible(False)
        self.splitter.setHandleWidth(1)
        # the right side: the panels, or the settings drawer slid over them (the chat keeps its width)
        self.side = QStackedWidget()
        self.side.setObjectName("sidePanel")
        self.side.addWidget(self.tabs)
        self.drawer_scroll = QScrollArea()  # the drawer is taller than a 640 px window: it scrolls
        self.drawer_scroll.setObjectName("settingsScroll")
        self.drawer_scroll.setWidgetResizable(True)
        self.drawer_scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.drawer_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.drawer_scroll.setWidget(self.drawer)
        self.side.addWidget(self.drawer_scroll)
        self.side.setMinimumWidth(MIN_SIDE_WIDTH)
        self.pages.setMinimumWidth(MIN_CHAT_WIDTH)
        self.splitter.addWidget(self.sidebar)
        self.splitter.addWidget(self.pages)
        self.splitter.addWidget(self.side)
        self.splitter.setStretchFactor(0, 0)
        self.splitter.setStretchFactor(1, 3)
        self.splitter.setStretchFactor(2, 0)
        self.splitter.setSizes([260, 760, 460])
        central = QWidget()
        central.setObjectName("centralArea")
        layout = QHBoxLayout(central)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        layout.addWidget(self.splitter, 1)
        self.setCentralWidget(central)

    def _build_tab_order(self) -> None:
        """Keyboard-only use: Tab goes sidebar → header → message box → Think → Attach → Send → panels."""
        chain: list[QWidget] = [
            self.sidebar.new_button, self.sidebar.search, self.sidebar.list, self.sidebar.models_button,
            self.settings_button, self.panel_button, self.composer.input, self.composer.think_button,
            self.composer.attach_button, self.composer.send_button, self.tabs,
        ]
        for first, second in zip(chain, chain[1:]):
            QWidget.setTabOrder(first, second)

    def _connect_signals(self) -> None:
        # engine
        self.client.event.connect(self.on_engine_event)
        self.client.loadProgress.connect(self.engine_status.on_load_progress)
        self.client.loaded.connect(self.engine_status.on_engine_loaded)
        self.client.ready.connect(self.engine_status.on_engine_ready)
        self.client.errorMessage.connect(self.engine_status.on_engine_error_message)
        self.client.crashed.connect(self.engine_status.on_engine_crashed)
        # sidebar
        self.sidebar.newRequested.connect(self.conversations.on_new)
        self.sidebar.selected.connect(self.conversations.on_selected)
        self.sidebar.renameRequested.connect(self.conversations.on_rename_requested)
        self.sidebar.deleteRequested.connect(self.conversations.on_delete_requested)
        self.sidebar.exportRequested.connect(self.conversations.on_export_requested)
        self.sidebar.searchChanged.connect(self.conversations.on_search_changed)
        self.sidebar.modelsRequested.connect(self.show_models_page)
        # chat
        self.composer.sendRequested.connect(self.chat_actions.on_send_requested)
        self.composer.stopRequested.connect(self.chat_actions.on_stop_requested)
        self.prompt_progress.stopRequested.connect(self.chat_actions.on_stop_requested)
        self.composer.thinkToggled.connect(self.chat_settings.on_think_toggled)
        self.composer.input.textChanged.connect(self.long_chats.throttle.request)
        self.drawer.changed.connect(self.long_chats.throttle.request)
        self.chat.editRequested.connect(self.chat_actions.on_edit_requested)
        self.chat.regenerateRequested.connect(self.chat_actions.on_regenerate_requested)
        self.chat.continueRequested.connect(self.chat_actions.on_continue_requested)
        self.chat.branchRequested.connect(self.chat_actions.on_branch_requested)
        self.chat.versionRequested.connect(self.chat_actions.on_version_requested)
        self.chat.previewRequested.connect(self.answers.on_preview_requested)
        self.chat.copied.connect(self.on_copied)
        self.drawer.changed.connect(self.chat_settings.on_settings_changed)
        self.drawer.closeRequested.connect(lambda: self.settings_button.setChecked(False))
        self.settings_button.toggled.connect(self.on_settings_toggled)
        self.panel_button.toggled.connect(self.on_panels_toggled)
        # banners
        self.crash_banner.actionClicked.connect(self.engine_status.on_restart_clicked)
        self.load_banner.cancelRequested.connect(self.engine_status.on_cancel_load)
        self.info_banner.actionClicked.connect(self.engine_status.on_open_vram_tab)
        # panels
        if self.vram_panel is not None and hasattr(self.vram_panel, "applyRequested"):
            self.vram_panel.applyRequested.connect(self.applyPlanRequested)
        if self.model_manager is not None and hasattr(self.model_manager, "modelChosen"):
            self.model_manager.modelChosen.connect(self.on_model_chosen)
        self.splitter.splitterMoved.connect(self.state.on_splitter_moved)
        hints = QGuiApplication.styleHints()
        hints.colorSchemeChanged.connect(self.state.on_system_scheme_changed)

    # ----------------------------------------------------------------- what the helpers share
    def on_focus_composer(self) -> None:
        self.show_chat_page()
        self.composer.input.setFocus()

    def is_generating(self) -> bool:
        """An answer streams, or the summary for a new chat is being written."""
        return self.session.generating or self.long_chats.summary is not None

    # ----------------------------------------------------------------- the side column
    def show_panel(self, widget: QWidget | None) -> None:
        """Show one of the side tabs (the drawer closes, the panels open)."""
        if widget is None:
            return
        if self.pages.currentIndex() != 0:
            self.show_chat_page()  # the panels belong to the chat page
        self.settings_button.setChecked(False)
        self.panel_button.setChecked(True)
        self.tabs.setCurrentWidget(widget)

    def on_settings_toggled(self, shown: bool) -> None:
        self.side.setCurrentWidget(self.drawer_scroll if shown else self.tabs)
        self.menus.settings_action.setChecked(shown)
        if shown:
            self.panel_button.setChecked(True)

    def on_panels_toggled(self, shown: bool) -> None:
        self.side.setVisible(shown and self.pages.currentIndex() == 0)
        self.menus.panels_action.setChecked(shown)
        if not shown:
            self.settings_button.setChecked(False)

    def on_copied(self, what: str) -> None:
        self.statusBar().showMessage("Code copied" if what == "code" else "Message copied", 2000)

    def on_engine_event(self, request_id: str, event: object) -> None:
        """Every event of the engine client (and the remote runner): the summary's, or the answer's."""
        if self.long_chats.owns(request_id):
            self.long_chats.on_summary_event(event)
            return
        self.session.on_event(request_id, event)

    def show_save_error(self, error: BaseException, what: str) -> None:
        """One clear message in the info banner for a failed save."""
        log.warning("%s: %s", what, error)
        self.info_banner.action.setVisible(False)
        self.info_banner.show_message(f"{what}: {error}")

    # ----------------------------------------------------------------- the model and its backends
    def on_model_chosen(self, path: str) -> None:
        self.model_dir = path
        self.engine_status.state = EngineState.STARTING  # the app loads it (restarting the worker when one runs)
        self.show_chat_page()
        self.modelChosen.emit(path)
        self.engine_status.refresh()

    def set_server_control(self, control: ServerControl) -> None:
        """Model ▸ Serve over HTTP…: the engine worker's OpenAI-compatible server (:mod:`ui.serve_panel`); its
        address shows in the status bar while it serves."""
        self.serve = ServeController(control, ServeDialog(self), QPushButton(), self.ui_settings, self)
        self.statusBar().addPermanentWidget(self.serve.button)
        self.menus.add_serve_action(self.serve.open)

    def set_remote_factory(self, factory: RemoteFactory) -> None:
        """Model ▸ Backend…: answer from a remote OpenAI-compatible server instead of the local engine
        (:mod:`ui.remote_chat`; the choice and the server are remembered in the window's settings)."""
        self.remote = RemoteBackendControl(factory, self.ui_settings, self)
        self.remote.runner.event.connect(self.on_engine_event)
        self.remote.changed.connect(self.engine_status.refresh)
        self.remote.changed.connect(self.engine_status.clear_load_notice)
        self.menus.add_backend_action(self.remote.open)
        self.engine_status.refresh()

    # ----------------------------------------------------------------- pages, and the window's own events
    def show_models_page(self) -> None:
        """The model manager, full width (the chat's panels have nothing to show for it)."""
        if self.model_manager is not None:
            self.pages.setCurrentIndex(1)
            self.title_label.setText("Models")
            self.side.setVisible(False)

    def show_chat_page(self) -> None:
        self.pages.setCurrentIndex(0)
        self.side.setVisible(self.panel_button.isChecked())
        self.state.fit_splitter()
        if self.conversation_id is None:
            self.title_label.setText("New chat")
        else:
            try:
                self.title_label.setText(self.store.get_conversation(self.conversation_id).title)
            except self._save_error as exc:  # the chat is gone (deleted elsewhere): nothing to title
                log.warning("cannot read chat %s: %s", self.conversation_id, exc)

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802
        self.session.flush()  # keep what streamed so far; the store marks it interrupted on next open
        self.state.save()
        self.engine_status.monitor_timer.stop()
        try:  # the theme is the application's: a closed window no longer follows the desktop's scheme
            QGuiApplication.styleHints().colorSchemeChanged.disconnect(self.state.on_system_scheme_changed)
        except (RuntimeError, TypeError):
            pass
        super().closeEvent(event)

    def sizeHint(self) -> QSize:  # noqa: N802
        return DEFAULT_SIZE

    def resizeEvent(self, event: QResizeEvent) -> None:  # noqa: N802
        super().resizeEvent(event)
        self.state.fit_splitter()

    def showEvent(self, event: QShowEvent) -> None:  # noqa: N802
        super().showEvent(event)
        QTimer.singleShot(0, self, self.state.fit_splitter)  # once laid out (and never after the window is gone)

