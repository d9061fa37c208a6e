"""Sandboxed preview of model-written HTML apps: :class:`PreviewPane`, the view with its toolbar and strip.

The sandbox (offline engine, profile, CSP, guard script): :mod:`ui.preview_sandbox`; the page policy:
:mod:`ui.preview_page`; the strip's bounded lists: :mod:`ui.preview_strip`.

Each document gets a random host (so its own origin, never derived from its id) and its own page, so its own
renderer and a clean ``window.name``; revisions of the same document (a streaming answer) keep both. Before a
revision replaces a page, the page is pinged; one that does not answer within :data:`HANG_TIMEOUT_MS` is
stopped (its renderer goes with it) and the revision shown in a fresh page.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import shiboken6
from PySide6.QtCore import (
    Qt,
    QTimer,
    QUrl,
    Signal,
)
from PySide6.QtGui import QDesktopServices
from PySide6.QtWebEngineCore import (
    QWebEngineDownloadRequest,
    QWebEngineLoadingInfo,
    QWebEnginePage,
    QWebEngineScript,
)
from PySide6.QtWebEngineWidgets import QWebEngineView
from PySide6.QtWidgets import (
    QFileDialog,
    QHBoxLayout,
    QMessageBox,
    QPlainTextEdit,
    QSplitter,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from clover_desk.engine.files import atomic_write_text
from clover_desk.ui.preview_page import PreviewPage
from clover_desk.ui.preview_sandbox import (
    HANG_TIMEOUT_MS,
    INDEX_PATH,
    MAX_ESCAPE_RESTORES,
    RELOAD_INTERVAL_MS,
    SCHEME,
    make_preview_profile,
    new_document_host,
)
from clover_desk.ui.preview_strip import (
    PreviewStrip,
    clip_line,
)
from clover_desk.ui.throttle import Throttle
from clover_desk.ui.widgets import documents_dir, tool_button

# ---------------------------------------------------------------------------------------------------------------
# The widget
# ---------------------------------------------------------------------------------------------------------------


def open_outside_sandbox(html: str, host: str) -> bool:
    """Open ``html`` in the system browser from a file in the temporary folder named after its document's host."""
    folder = Path(tempfile.gettempdir()) / "clover-desk-preview"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{host}.html"
    atomic_write_text(path, html)
    return QDesktopServices.openUrl(QUrl.fromLocalFile(str(path)))


def ask_page_path(parent: QWidget, start: str) -> str:
    """The "Save page as" dialog (a seam: tests replace it): the path chosen, or ""."""
    path, _ = QFileDialog.getSaveFileName(parent, "Save page as", start, "HTML files (*.html *.htm)")
    return path


class PreviewPane(QWidget):
    """Preview (or source) of one HTML document, with a strip of blocked attempts, dialogs and console messages.

    ``set_html(text, document_id)`` may be called on every streamed delta: reloads are throttled to one per
    :data:`RELOAD_INTERVAL_MS`, and the last text always gets shown. ``flush()`` shows it at once. ``page`` is the
    page on show now: a new document gets a new one (and a stopped, unresponsive page is replaced).
    """

    # The view finished loading the document asked for (True) or failed (False). A page that changes its own URL
    # while it loads (location.hash, history.replaceState) still counts as that document's load.
    loadFinished = Signal(bool)
    # A line was added to the strip (kind, text): "blocked" | "dialog" | "error" | "warning".
    stripEntryAdded = Signal(str, str)  # (forwarded from the strip's entryAdded)
    # The HTML was saved to this path.
    saved = Signal(str)

    def __init__(self, parent: QWidget | None = None, *, reload_interval_ms: int = RELOAD_INTERVAL_MS,
                 hang_timeout_ms: int = HANG_TIMEOUT_MS) -> None:
        super().__init__(parent)
        self._html = ""
        self._shown_html: str | None = None
        self._document_id = "untitled"
        self.save_dir: Path | None = None  # where the last "Save page as" saved (its dialog starts there)
        self._revision = 0
        self._hosts: dict[str, str] = {}  # document id -> its random host, for this pane's life
        self._page_host: str | None = None  # the document the current page is for (None: a fresh page)
        self._page_committed = False  # the current page has shown one of our documents (so it can be pinged)
        self._renderer_dead = False
        self._expected_url: QUrl | None = None  # the load in flight that loadFinished will report on
        self._load_committed = False  # ... and whether its document has arrived (its URL committed)
        self._escape_restores = 0
        self._hang_timeout_ms = hang_timeout_ms
        self._ping_pending = False
        self._ping_generation = 0
        self.pages_replaced = 0  # pages stopped and replaced (diagnostics, tests)
        self.view = QWebEngineView(self)
        self.view.setObjectName("previewView")
        self.view.setAccessibleName("Page preview (sandboxed)")
        # The profile is given to the pane last of all (end of __init__): children are destroyed in order, and the
        # pages (children of the view) must go before their profile (Qt warns and may crash the other way round).
        self.profile, self.scheme_handler, self.interceptor = make_preview_profile()

        self.source = QPlainTextEdit(self)
        self.source.setReadOnly(True)
        self.source.setAccessibleName("Page source")
        self.source.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.stack = QStackedWidget(self)
        self.stack.addWidget(self.view)
        self.stack.addWidget(self.source)

        # Short labels, the whole story in the tooltips: the side panel can be as narrow as 400 px, and the four
        # buttons must fit there without eliding.
        self.source_button = tool_button(self, "Source", "Show the HTML source instead of the rendered page",
                                         toggled=self.on_source_toggled)
        self.reload_button = tool_button(self, "Reload", "Load the page again (a fresh start, same storage)",
                                         clicked=self.on_reload_clicked)
        self.save_button = tool_button(self, "Save…", "Save the page as an HTML file…", clicked=self.on_save_clicked)
        self.open_button = tool_button(self, "Browser…",
                                       "Open the page in your web browser, outside the sandbox (asks first)",
                                       clicked=self.on_open_in_browser_clicked)
        # The strip of what the page tried (its pages report there, so it comes first); a page that floods it is
        # stopped.
        self.strip = PreviewStrip(self, on_flood=self._stop_page)
        self.page = self._make_page()
        self.view.setPage(self.page)
        self.view.setContextMenuPolicy(Qt.ContextMenuPolicy.NoContextMenu)

        toolbar = QHBoxLayout()
        toolbar.setContentsMargins(6, 6, 6, 4)
        toolbar.setSpacing(4)
        for button in (self.source_button, self.reload_button, self.save_button, self.open_button):
            toolbar.addWidget(button)
        toolbar.addStretch(1)
        # the page over the log strip: drag the handle to give the log room (the window remembers where)
        self.log_splitter = QSplitter(Qt.Orientation.Vertical, self)
        self.log_splitter.setObjectName("previewLogSplitter")
        self.log_splitter.addWidget(self.stack)
        self.log_splitter.addWidget(self.strip)
        self.log_splitter.setStretchFactor(0, 5)
        self.log_splitter.setStretchFactor(1, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(toolbar)
        layout.addWidget(self.log_splitter, 1)

        # Coalesces set_html() calls into page loads (public for diagnostics and tests: its ``calls`` count loads).
        self.reload_throttle = Throttle(self._show_pending, reload_interval_ms, self)
        self._ping_timer = QTimer(self)
        self._ping_timer.setSingleShot(True)
        self._ping_timer.timeout.connect(self.on_ping_timeout)
        self._update_buttons()
        self._connect_signals()
        self.profile.setParent(self)  # the pane's last child (see above)

    def _connect_signals(self) -> None:
        self.interceptor.requestBlocked.connect(self.on_request_blocked)
        self.interceptor.cspViolation.connect(self.on_csp_violation)
        self.profile.downloadRequested.connect(self.on_download_requested)
        self.strip.entryAdded.connect(self.stripEntryAdded)

    def _make_page(self) -> PreviewPage:
        page = PreviewPage(self.profile, self.view, report=self.strip.add)
        # Bound to the page: a replaced page's late signals are recognised and dropped.
        page.loadingChanged.connect(functools.partial(self.on_loading_changed, page))
        page.urlChanged.connect(functools.partial(self.on_url_changed, page))
        page.renderProcessTerminated.connect(functools.partial(self.on_render_process_terminated, page))
        return page

    # ---- public API ----------------------------------------------------------------------------------------

    def html(self) -> str:
        """The latest text given to :meth:`set_html` (the view may still show an older one: reloads are throttled)."""
        return self._html

    def shown_html(self) -> str | None:
        """The text the view was last asked to load: equal to :meth:`html` once no reload is pending, None before
        the current document first loads."""
        return self._shown_html

    def document_id(self) -> str:
        return self._document_id

    def document_host(self, document_id: str | None = None) -> str:
        """The random host (so the origin) of a document (default: the current one), fixed for this pane's life."""
        key = self._document_id if document_id is None else document_id
        host = self._hosts.get(key)
        if host is None:
            host = self._hosts[key] = new_document_host()
        return host

    def url(self) -> QUrl:
        """The URL the current document is (or will be) served at."""
        return QUrl(f"{SCHEME}://{self.document_host()}{INDEX_PATH}?r={self._revision}")

    def set_html(self, text: str, document_id: str | None = None) -> None:
        """Show ``text`` (throttled). A new ``document_id`` means a new origin; None keeps the current one."""
        if document_id is not None and document_id != self._document_id:
            self._document_id = document_id
            self._shown_html = None
        self._html = text
        self._update_buttons()
        self.reload_throttle.request()

    def flush(self) -> None:
        """Show the latest text now (e.g. when the answer finished streaming)."""
        self.reload_throttle.flush()

    def reload(self) -> None:
        """Load the current text again (a fresh page, same origin)."""
        self._shown_html = None
        self.reload_throttle.cancel()
        self._show_pending()

    def show_source(self, on: bool) -> None:
        self.source_button.setChecked(on)

    def save_to(self, path: str | Path) -> Path:
        """Write the current HTML to ``path`` atomically (adds ``.html`` when there is no suffix)."""
        target = Path(path)
        if not target.suffix:
            target = target.with_suffix(".html")
        atomic_write_text(target, self._html)
        self.saved.emit(str(target))
        return target

    def open_in_browser(self, confirm: bool = True) -> bool:
        """Open the page in the system browser, after a confirmation. Returns True if it was opened."""
        if not self._html:
            return False
        if confirm:
            answer = QMessageBox.question(
                self,
                "Open outside the sandbox?",
                "The page will run in your web browser with normal network access: it can load files from the "
                "internet and send data anywhere. Open it anyway?",
                QMessageBox.StandardButton.Open | QMessageBox.StandardButton.Cancel,
                QMessageBox.StandardButton.Cancel,
            )
            if answer != QMessageBox.StandardButton.Open:
                return False
        return open_outside_sandbox(self._html, self.document_host())

    # ---- slots ---------------------------------------------------------------------------------------------

    def on_request_blocked(self, url: str, kind: str) -> None:
        self.strip.add("blocked", "blocked", f"blocked {kind} request to {clip_line(url)}")

    def on_csp_violation(self, host: str, text: str) -> None:
        if host == self._page_host:  # not a late report of a document no longer shown
            self.strip.add("blocked", "blocked", clip_line(text))

    def on_console_message(self, level: str, text: str) -> None:
        """A console line (the page's own words: never counted as a blocked attempt, whatever it says)."""
        if level in ("error", "warning"):
            self.strip.add("console", level, clip_line(text))

    def on_loading_changed(self, page: PreviewPage, info: QWebEngineLoadingInfo) -> None:
        if page is not self.page:
            return
        status, url = info.status(), info.url()
        if status == QWebEngineLoadingInfo.LoadStatus.LoadStartedStatus or self._expected_url is None:
            return
        self._on_sign_of_life()
        # Only the end of the load the pane started counts. Not a refused navigation elsewhere (it also ends in a
        # stopped load, which must not read as "the page failed"), nor an earlier revision's load it superseded
        # (it ends before ours commits). Once ours has committed, it is matched by host, not URL: the page may
        # have changed its own path, query or fragment (history.replaceState, location.hash) while it loaded.
        # Qt may not report a load of its own for a navigation that replaced another (a page that jumped to
        # about:blank while it loaded, put back): hence no reliance on LoadStarted.
        committed_here = self._load_committed and url.scheme() == SCHEME and url.host() == self._page_host
        if url != self._expected_url and not committed_here:
            return
        if status == QWebEngineLoadingInfo.LoadStatus.LoadSucceededStatus:
            self._finish_load(True)
        elif status == QWebEngineLoadingInfo.LoadStatus.LoadStoppedStatus:
            self._finish_load(self._load_committed)  # window.stop() after the document arrived is a load
        else:
            self.strip.add("pane", "error", f"the page failed to load: {info.errorString() or info.errorCode()}")
            self._finish_load(False)

    def _finish_load(self, ok: bool) -> None:
        if self._expected_url is not None:
            self._expected_url = None
            self.loadFinished.emit(ok)

    def _check_quiet_commit(self, page: PreviewPage) -> None:
        # A document put back after a jump to about:blank may commit with no load of its own in Qt's eyes (no
        # LoadStarted, no LoadSucceeded; it has already run when it commits): finished once the page is idle.
        if page is self.page and self._load_committed and not page.isLoading():
            self._finish_load(True)

    def on_url_changed(self, page: PreviewPage, url: QUrl) -> None:
        if page is not self.page:
            return
        if url.scheme() == "about":
            # The page navigated itself to about:blank (Qt never asks acceptNavigationRequest() about it; during
            # the load it is not even a load of its own): the only sign is the URL.
            self._on_escape(url)
            return
        if self._expected_url is not None and url == self._expected_url:
            self._load_committed = self._page_committed = True
            if not page.isLoading():
                QTimer.singleShot(0, functools.partial(self._check_quiet_commit, page))
        self._on_sign_of_life()

    def on_render_process_terminated(
        self, page: PreviewPage, status: QWebEnginePage.RenderProcessTerminationStatus, code: int
    ) -> None:
        if page is not self.page:
            return  # a page the pane stopped on purpose
        self._renderer_dead = True
        self.strip.add("pane", "error", f"the page's renderer stopped ({status.name}, code {code}); press Reload")
        self._on_sign_of_life()  # a pending revision loads at once (in a new renderer)

    def on_download_requested(self, download: QWebEngineDownloadRequest) -> None:
        self.strip.add("blocked", "blocked", f"blocked download of {clip_line(download.suggestedFileName())}")
        download.cancel()

    def on_ping_answer(self, generation: int) -> None:
        if generation == self._ping_generation:
            self._on_sign_of_life()

    def on_ping_timeout(self) -> None:
        if not self._ping_pending:
            return
        self._ping_pending = False
        seconds = self._hang_timeout_ms / 1000
        self.strip.add("pane", "error", f"the page stopped responding (no answer in {seconds:g} s): it was stopped "
                                         "as unresponsive and the new version is shown in a fresh page")
        self._replace_page()
        self._navigate()

    def on_source_toggled(self, on: bool) -> None:
        if on:
            self.source.setPlainText(self._html)
            self.stack.setCurrentWidget(self.source)
        else:
            self.stack.setCurrentWidget(self.view)
        self.source_button.setText("Preview" if on else "Source")

    def on_reload_clicked(self) -> None:
        self.reload()

    def on_save_clicked(self) -> None:
        """Save the page: the dialog starts in the folder of the last save, else Documents (it was the working
        directory, wherever the app was started from)."""
        start = (self.save_dir or documents_dir()) / "page.html"
        path = ask_page_path(self, str(start))
        if path:
            try:
                self.save_to(path)
            except OSError as exc:
                QMessageBox.warning(self, "Could not save", f"Could not save {path}: {exc.strerror or exc}")
                return
            self.save_dir = Path(path).parent

    def on_open_in_browser_clicked(self) -> None:
        self.open_in_browser(confirm=True)

    # ---- internals -----------------------------------------------------------------------------------------

    def _show_pending(self) -> None:
        if self._html == self._shown_html:
            return
        self._shown_html = self._html
        self._revision += 1
        host = self.document_host()
        self.scheme_handler.put(host, self._html)
        if self.stack.currentWidget() is self.source:
            self.source.setPlainText(self._html)
        self._escape_restores = 0
        if host != self._page_host:
            # Another document: a new page (its own renderer, a clean window.name, nothing held by the old one).
            if self._page_host is not None:
                self._replace_page()
            self._page_host = host
            self._navigate()
        elif not self._page_committed or self._renderer_dead:
            self._navigate()
        else:
            self._ping_then_navigate()

    def _navigate(self) -> None:
        url = self.url()
        self._expected_url = url
        self._load_committed = False
        self._renderer_dead = False
        self.page.expect_load(url)
        self.page.load(url)

    def _ping_then_navigate(self) -> None:
        """Load the next revision once the page answers; a page that does not answer in time is replaced."""
        if self._ping_pending:
            return  # the answer (or the timeout) loads the latest revision
        self._ping_pending = True
        self._ping_generation += 1
        generation = self._ping_generation
        world = QWebEngineScript.ScriptWorldId.ApplicationWorld.value  # the page's own scripts cannot answer it
        self.page.runJavaScript("0", world, functools.partial(_ping_answered, self, generation))
        self._ping_timer.start(self._hang_timeout_ms)

    def _on_sign_of_life(self) -> None:
        if self._ping_pending:
            self._ping_pending = False
            self._ping_timer.stop()
            self._navigate()

    def _cancel_ping(self) -> None:
        self._ping_pending = False
        self._ping_generation += 1
        self._ping_timer.stop()

    def _replace_page(self) -> None:
        """A fresh page in the same profile; the old one (and with it its renderer, hung or not) is deleted."""
        self._cancel_ping()
        old = self.page
        old.retired = True
        old.setParent(self)  # so that setPage() does not delete it now (we may be inside one of its signals)
        self.page = self._make_page()
        self.view.setPage(self.page)
        old.setParent(self.view)  # back under the view: destroyed before the profile, whatever happens next
        old.deleteLater()
        self._page_committed = self._renderer_dead = False
        self.pages_replaced += 1

    def _on_escape(self, url: QUrl) -> None:
        """The page navigated itself to about:blank (Qt never submits that for approval): list it, put it back."""
        self.strip.add("blocked", "blocked", f"blocked navigation to {clip_line(url.toString())}")
        if self._escape_restores < MAX_ESCAPE_RESTORES:
            self._escape_restores += 1
            QTimer.singleShot(0, self._restore_document)
            return
        self.strip.add("pane", "error", "the page keeps navigating away to about:blank; press Reload to run it again")
        self._finish_load(False)

    def _restore_document(self) -> None:
        self._cancel_ping()
        self._navigate()

    def _stop_page(self, why: str) -> None:
        """Stop the page on show (its renderer goes with it) and leave a blank one; Reload or a new revision runs
        the document again."""
        self.strip.add("pane", "error", why)
        loading = self._expected_url is not None
        self._replace_page()
        self._expected_url = None
        if loading:
            self.loadFinished.emit(False)

    def _update_buttons(self) -> None:
        has = bool(self._html)
        self.save_button.setEnabled(has)
        self.open_button.setEnabled(has)
        self.reload_button.setEnabled(has)


def _ping_answered(pane: PreviewPane, generation: int, _result: object = None) -> None:
    # May be called while a page (or the pane) is being destroyed: only a live pane acts on it.
    if shiboken6.isValid(pane):
        pane.on_ping_answer(generation)


