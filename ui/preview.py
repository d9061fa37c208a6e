"""Sandboxed preview of model-written HTML apps.

The model writes whole pages ("a desktop in one HTML file"); the user looks at them here. The page is untrusted:
it may try to phone home, open windows, navigate away or read files. The defences, each enough on its own for
what it covers, are layered:

* a dedicated off-the-record :class:`QWebEngineProfile` (nothing written to disk, no shared cookies or storage);
* the document is served from memory through the custom scheme ``clover-preview://d<hash>/index.html`` by
  :class:`PreviewSchemeHandler` (never ``setHtml``: that percent-encodes into a ``data:`` URL capped at 2 MB),
  with a Content-Security-Policy response header (:data:`PREVIEW_CSP`): inline script/style only, images from
  ``data:``/``blob:``, no connect/frame/form targets;
* :class:`PreviewRequestInterceptor` blocks every request whose scheme is not ``clover-preview`` (the CSP
  stops most of them earlier; the interceptor is the backstop for whatever CSP does not cover) and records it;
* :class:`PreviewPage` refuses new windows, every permission, file choosers, and every navigation other than
  the load the pane asked for; JavaScript can neither open windows nor touch the clipboard or ``file:`` URLs;
* WebRTC opens its own sockets, past both CSP and the interceptor: its constructors are removed before any page
  script runs, and, since a fresh about:blank iframe still has them, the engine is started with
  :data:`OFFLINE_CHROMIUM_FLAGS` (no unproxied UDP, a dead proxy for everything else, loopback included).

Each document id gets its own host, so its own origin: one page's ``localStorage`` is invisible to another.
Console errors/warnings and blocked attempts are listed in a strip under the view, never swallowed.

The scheme must be registered before the QApplication exists: call :func:`register_schemes` first thing in the
entry point (and in the test session's ``pytest_configure``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QBuffer, QByteArray, QCoreApplication, QIODevice, QObject, Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWebEngineCore import (
    QWebEngineDownloadRequest,
    QWebEngineLoadingInfo,
    QWebEnginePage,
    QWebEnginePermission,
    QWebEngineProfile,
    QWebEngineScript,
    QWebEngineSettings,
    QWebEngineUrlRequestInfo,
    QWebEngineUrlRequestInterceptor,
    QWebEngineUrlRequestJob,
    QWebEngineUrlScheme,
    QWebEngineUrlSchemeHandler,
)
from PySide6.QtWebEngineWidgets import QWebEngineView
from PySide6.QtWidgets import (
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QMessageBox,
    QPlainTextEdit,
    QSplitter,
    QStackedWidget,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from ui.throttle import Throttle

log = logging.getLogger(__name__)

SCHEME = "clover-preview"
SCHEME_BYTES = SCHEME.encode("ascii")
INDEX_PATH = "/index.html"
RELOAD_INTERVAL_MS = 500  # at most one reload per half second while an answer streams
MAX_STRIP_ENTRIES = 500  # a page logging in a loop must not eat the memory

# Offline policy: everything the page needs must be inline. 'unsafe-eval' because generated apps use
# Function()/eval for calculators and the like; it grants no network.
PREVIEW_CSP = (
    "default-src 'none'; "
    "script-src 'unsafe-inline' 'unsafe-eval' blob:; "
    "style-src 'unsafe-inline'; "
    "img-src data: blob:; "
    "font-src data:; "
    "media-src data: blob:; "
    "worker-src blob:; "
    "connect-src 'none'; "
    "frame-src 'none'; "
    "child-src 'none'; "
    "object-src 'none'; "
    "manifest-src 'none'; "
    "form-action 'none'; "
    "base-uri 'none'"
)
RESPONSE_HEADERS = {
    b"Content-Security-Policy": PREVIEW_CSP.encode("ascii"),
    b"X-Content-Type-Options": b"nosniff",
    b"X-DNS-Prefetch-Control": b"off",
    b"Referrer-Policy": b"no-referrer",
    b"Cache-Control": b"no-store",
}
# Schemes the engine may load inside the page without a network round trip (inline images, blobs, about:blank).
_INTERNAL_SCHEMES = frozenset({SCHEME, "data", "blob", "about"})

# Runs before any page script, in every frame: WebRTC would reach the network over UDP/TURN without passing
# through CSP or the interceptor; window.open is refused by the settings anyway, the wrapper only reports it.
_GUARD_SCRIPT = """
(function () {
  for (const name of ['RTCPeerConnection', 'webkitRTCPeerConnection', 'RTCDataChannel', 'RTCSessionDescription',
                      'RTCIceCandidate']) {
    try { delete window[name]; } catch (e) {}
    try { Object.defineProperty(window, name, {value: undefined, writable: false, configurable: false}); } catch (e) {}
  }
  const blockedOpen = function (url) {
    console.warn('clover-preview: blocked window.open(' + String(url === undefined ? '' : url) + ')');
    return null;
  };
  try { Object.defineProperty(window, 'open', {value: blockedOpen, writable: false, configurable: false}); }
  catch (e) {}
})();
"""


# Process-wide Chromium switches for an engine that must never reach the network by itself. WebRTC opens its
# own sockets (STUN/TURN, UDP or TCP), which neither CSP nor the request interceptor sees, and a page can get a
# fresh RTCPeerConnection from a same-origin about:blank iframe before any injected script runs there. So: no UDP
# that is not proxied, and every proxied connection (loopback included) goes to a dead proxy. The app's
# QtWebEngine views only ever show local content, so nothing legitimate is lost.
OFFLINE_CHROMIUM_FLAGS = (
    "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
    "--proxy-server=127.0.0.1:1",
    "--proxy-bypass-list=<-loopback>",
)


def register_schemes(offline_engine: bool = True) -> bool:
    """Register ``clover-preview://`` with QtWebEngine. Must run before the QApplication is created.

    With ``offline_engine`` (the default) it also appends :data:`OFFLINE_CHROMIUM_FLAGS` to
    ``QTWEBENGINE_CHROMIUM_FLAGS``, which QtWebEngine reads when it starts (after the QApplication, at the first
    profile or view). Idempotent. Returns False (and logs an error) when called too late.
    """
    if offline_engine:
        flags = os.environ.get("QTWEBENGINE_CHROMIUM_FLAGS", "").split()
        missing = [f for f in OFFLINE_CHROMIUM_FLAGS if f.split("=")[0] not in {g.split("=")[0] for g in flags}]
        if missing:
            os.environ["QTWEBENGINE_CHROMIUM_FLAGS"] = " ".join([*flags, *missing])
    if QWebEngineUrlScheme.schemeByName(QByteArray(SCHEME_BYTES)).name() == QByteArray(SCHEME_BYTES):
        return True
    if QCoreApplication.instance() is not None:
        log.error("register_schemes() called after the QApplication was created: the preview cannot load pages")
        return False
    scheme = QWebEngineUrlScheme(QByteArray(SCHEME_BYTES))
    scheme.setSyntax(QWebEngineUrlScheme.Syntax.Host)
    # Secure (a secure context, so localStorage and crypto work) but not Local: a LocalScheme origin behaves like
    # file:// and would be opaque.
    scheme.setFlags(QWebEngineUrlScheme.Flag.SecureScheme)
    QWebEngineUrlScheme.registerScheme(scheme)
    return True


# ---------------------------------------------------------------------------------------------------------------
# Finding HTML in an answer (pure functions)
# ---------------------------------------------------------------------------------------------------------------

_FENCE_OPEN = re.compile(r"^[ \t]{0,3}(`{3,}|~{3,})[ \t]*(html|htm|xhtml)\b[^\n]*$", re.IGNORECASE | re.MULTILINE)
_DOC_START = re.compile(r"<!doctype\s+html|<html[\s>]", re.IGNORECASE)
_DOC_END = re.compile(r"</html\s*>", re.IGNORECASE)


def extract_html(markdown_text: str) -> str | None:
    """The HTML document in a model answer, or None.

    Looks first for a fenced ```html block (the longest one, when there are several: that is the page, the
    others are snippets); an unfinished fence (the answer is still streaming) yields what has arrived so far.
    Otherwise, a whole page that starts with ``<!DOCTYPE html>`` or ``<html>`` is taken up to ``</html>`` (or to
    the end while streaming). Text that is merely HTML-ish (a ``<div>`` in prose) is not a document.
    """
    blocks: list[str] = []
    for match in _FENCE_OPEN.finditer(markdown_text):
        fence = match.group(1)
        body_start = match.end() + 1
        close = re.compile(r"^[ \t]{0,3}" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}[ \t]*$", re.MULTILINE)
        end = close.search(markdown_text, body_start)
        body = markdown_text[body_start : end.start() if end else len(markdown_text)]
        blocks.append(body.rstrip("\n") if end else body)
    blocks = [b for b in blocks if b.strip()]
    if blocks:
        return max(blocks, key=len)
    start = _DOC_START.search(markdown_text)
    if start is None:
        return None
    # Only a page that begins a line counts (not "<html>" quoted inside a sentence).
    line_start = markdown_text.rfind("\n", 0, start.start()) + 1
    if markdown_text[line_start : start.start()].strip():
        return None
    end = _DOC_END.search(markdown_text, start.start())
    return markdown_text[start.start() : end.end() if end else len(markdown_text)]


def document_host(document_id: str) -> str:
    """A DNS-safe host for a document id: one origin per document, so storage never leaks between pages."""
    return "d" + hashlib.sha256(document_id.encode("utf-8")).hexdigest()[:32]


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a crash leaves either the old file or the new one, never half."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------------------------
# Engine-side pieces
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StripEntry:
    """One line in the strip under the view."""

    kind: str  # "blocked" | "error" | "warning" | "info"
    text: str


class PreviewSchemeHandler(QWebEngineUrlSchemeHandler):
    """Serves documents from memory at ``clover-preview://<host>/index.html``; everything else is 404."""

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._documents: dict[str, bytes] = {}  # host -> UTF-8 page; only the document on show is kept
        self.served_count = 0  # documents answered (diagnostics, tests)

    def put(self, host: str, html: str) -> None:
        # One document at a time: the view can only show (and reload) the current one, and generated pages can be
        # megabytes each.
        self._documents = {host: html.encode("utf-8", errors="replace")}

    def requestStarted(self, job: QWebEngineUrlRequestJob) -> None:  # noqa: N802 (Qt override)
        url = job.requestUrl()
        method = bytes(job.requestMethod().data())
        data = self._documents.get(url.host())
        if method != b"GET":
            job.fail(QWebEngineUrlRequestJob.Error.RequestDenied)
            return
        if data is None or url.path() not in ("", "/", INDEX_PATH):
            job.fail(QWebEngineUrlRequestJob.Error.UrlNotFound)
            return
        self.served_count += 1
        buffer = QBuffer(job)  # owned by the job: freed with it
        buffer.setData(QByteArray(data))
        buffer.open(QIODevice.OpenModeFlag.ReadOnly)
        # The binding maps QMultiMap to {key: [values]} (a bare QByteArray value would be split into characters).
        job.setAdditionalResponseHeaders({QByteArray(k): [QByteArray(v)] for k, v in RESPONSE_HEADERS.items()})
        job.reply(QByteArray(b"text/html; charset=utf-8"), buffer)


class PreviewRequestInterceptor(QWebEngineUrlRequestInterceptor):
    """Blocks every request that does not stay inside the preview scheme, and reports it."""

    # (url, resource type name) of a refused request. Emitted from whatever thread the engine calls us on.
    requestBlocked = Signal(str, str)

    def interceptRequest(self, info: QWebEngineUrlRequestInfo) -> None:  # noqa: N802 (Qt override)
        url = info.requestUrl()
        if url.scheme().lower() in _INTERNAL_SCHEMES:
            return
        info.block(True)
        kind = info.resourceType().name.removeprefix("ResourceType")
        self.requestBlocked.emit(url.toString(), kind)


class PreviewPage(QWebEnginePage):
    """A page that may only show the document the pane loads into it."""

    # A new window, navigation, permission or file chooser the page asked for and was refused.
    refused = Signal(str)
    # (level: "error" | "warning" | "info", text) from the page's JavaScript console.
    consoleMessage = Signal(str, str)

    def __init__(self, profile: QWebEngineProfile, parent: QObject | None = None) -> None:
        super().__init__(profile, parent)
        self._allowed_url: QUrl | None = None  # the one load the pane asked for, until it is taken
        self._current_url = QUrl()
        self._connect_signals()

    def _connect_signals(self) -> None:
        self.permissionRequested.connect(self.on_permission_requested)
        self.fileSystemAccessRequested.connect(self.on_file_system_access_requested)
        self.fullScreenRequested.connect(self.on_full_screen_requested)
        self.registerProtocolHandlerRequested.connect(self.on_protocol_handler_requested)
        self.desktopMediaRequested.connect(self.on_desktop_media_requested)

    def expect_load(self, url: QUrl) -> None:
        """The next main-frame navigation to exactly ``url`` is allowed (once)."""
        self._allowed_url = QUrl(url)

    def acceptNavigationRequest(  # noqa: N802 (Qt override)
        self, url: QUrl, navigation_type: QWebEnginePage.NavigationType, is_main_frame: bool
    ) -> bool:
        if not is_main_frame:
            # Sub-frames: only about:blank/srcdoc (CSP frame-src 'none' already blocks real sources).
            if url.scheme() == "about":
                return True
            self.refused.emit(f"sub-frame navigation to {url.toString()}")
            return False
        if self._allowed_url is not None and url == self._allowed_url:
            self._allowed_url = None
            self._current_url = QUrl(url)
            return True
        if url.scheme() == SCHEME and self._same_document(url):
            # An in-page anchor (#section) or location.reload() of the same document: harmless.
            return True
        self.refused.emit(f"navigation to {url.toString()} ({navigation_type.name.removeprefix('NavigationType')})")
        return False

    def _same_document(self, url: QUrl) -> bool:
        strip = QUrl.UrlFormattingOption.RemoveFragment
        return not self._current_url.isEmpty() and url.adjusted(strip) == self._current_url.adjusted(strip)

    def createWindow(self, window_type: QWebEnginePage.WebWindowType) -> QWebEnginePage | None:  # noqa: N802
        self.refused.emit(f"new window ({window_type.name.removeprefix('WebBrowser')})")
        return None

    def chooseFiles(self, mode: QWebEnginePage.FileSelectionMode, old: list[str], accepted: list[str]) -> list[str]:  # noqa: N802
        self.refused.emit("file chooser (the preview cannot read your files)")
        return []

    def javaScriptConsoleMessage(  # noqa: N802 (Qt override)
        self, level: QWebEnginePage.JavaScriptConsoleMessageLevel, message: str, line: int, source: str
    ) -> None:
        name = {
            QWebEnginePage.JavaScriptConsoleMessageLevel.ErrorMessageLevel: "error",
            QWebEnginePage.JavaScriptConsoleMessageLevel.WarningMessageLevel: "warning",
        }.get(level, "info")
        where = f" (line {line})" if line > 0 else ""
        self.consoleMessage.emit(name, f"{message.strip()}{where}")

    def on_permission_requested(self, permission: QWebEnginePermission) -> None:
        self.refused.emit(f"permission {permission.permissionType().name}")
        permission.deny()

    def on_file_system_access_requested(self, request: object) -> None:
        self.refused.emit("file system access")
        request.reject()  # type: ignore[attr-defined]

    def on_full_screen_requested(self, request: object) -> None:
        request.reject()  # type: ignore[attr-defined]

    def on_protocol_handler_requested(self, request: object) -> None:
        self.refused.emit("protocol handler registration")
        request.reject()  # type: ignore[attr-defined]

    def on_desktop_media_requested(self, request: object) -> None:
        self.refused.emit("screen capture")
        request.cancel()  # type: ignore[attr-defined]


def make_preview_profile(parent: QObject | None = None) -> tuple[QWebEngineProfile, PreviewSchemeHandler,
                                                                 PreviewRequestInterceptor]:
    """An off-the-record profile with the preview scheme handler, the interceptor and the guard script."""
    profile = QWebEngineProfile(parent)  # no storage name: off the record, all in memory
    if not profile.isOffTheRecord():
        raise RuntimeError("QtWebEngine gave a disk-backed profile for the preview")
    profile.setHttpCacheType(QWebEngineProfile.HttpCacheType.MemoryHttpCache)
    profile.setPersistentCookiesPolicy(QWebEngineProfile.PersistentCookiesPolicy.NoPersistentCookies)
    profile.setPersistentPermissionsPolicy(QWebEngineProfile.PersistentPermissionsPolicy.AskEveryTime)
    profile.setSpellCheckEnabled(False)
    handler = PreviewSchemeHandler(profile)
    profile.installUrlSchemeHandler(QByteArray(SCHEME_BYTES), handler)
    interceptor = PreviewRequestInterceptor(profile)
    profile.setUrlRequestInterceptor(interceptor)
    guard = QWebEngineScript()
    guard.setName("clover-preview-guard")
    guard.setSourceCode(_GUARD_SCRIPT)
    guard.setInjectionPoint(QWebEngineScript.InjectionPoint.DocumentCreation)
    guard.setWorldId(QWebEngineScript.ScriptWorldId.MainWorld)
    guard.setRunsOnSubFrames(True)
    profile.scripts().insert(guard)
    _lock_down(profile.settings())
    return profile, handler, interceptor


def _lock_down(settings: QWebEngineSettings) -> None:
    attr = QWebEngineSettings.WebAttribute
    for name, value in {
        attr.JavascriptEnabled: True,
        attr.LocalStorageEnabled: True,  # per origin, in memory (off the record)
        attr.JavascriptCanOpenWindows: False,  # Qt's default is True
        attr.JavascriptCanAccessClipboard: False,
        attr.JavascriptCanPaste: False,
        attr.LocalContentCanAccessFileUrls: False,
        attr.LocalContentCanAccessRemoteUrls: False,
        attr.AllowRunningInsecureContent: False,
        attr.AllowGeolocationOnInsecureOrigins: False,
        attr.AllowWindowActivationFromJavaScript: False,
        attr.PluginsEnabled: False,
        attr.PdfViewerEnabled: False,
        attr.DnsPrefetchEnabled: False,
        attr.HyperlinkAuditingEnabled: False,
        attr.ScreenCaptureEnabled: False,
        attr.NavigateOnDropEnabled: False,
        attr.WebRTCPublicInterfacesOnly: True,
        attr.FullScreenSupportEnabled: False,
        attr.ErrorPageEnabled: False,
        attr.AutoLoadIconsForPage: False,
        attr.TouchIconsEnabled: False,
    }.items():
        settings.setAttribute(name, value)


# ---------------------------------------------------------------------------------------------------------------
# The widget
# ---------------------------------------------------------------------------------------------------------------


class PreviewPane(QWidget):
    """Preview (or source) of one HTML document, with a strip of console messages and blocked attempts.

    ``set_html(text, document_id)`` may be called on every streamed delta: reloads are throttled to one per
    :data:`RELOAD_INTERVAL_MS`, and the last text always gets shown. ``flush()`` shows it at once.
    """

    # The view finished loading a document (True) or failed (False).
    loadFinished = Signal(bool)
    # A line was added to the strip (kind, text): "blocked" | "error" | "warning" | "info".
    stripEntryAdded = Signal(str, str)
    # The HTML was saved to this path.
    saved = Signal(str)

    def __init__(self, parent: QWidget | None = None, *, reload_interval_ms: int = RELOAD_INTERVAL_MS) -> None:
        super().__init__(parent)
        self._html = ""
        self._shown_html: str | None = None
        self._document_id = "untitled"
        self._revision = 0
        self._loading_url = QUrl()
        self.entries: list[StripEntry] = []

        # Profile ownership: the page owns the profile, so the page is gone before the profile is destroyed
        # (Qt warns and may crash the other way round).
        self.view = QWebEngineView(self)
        self.profile, self.scheme_handler, self.interceptor = make_preview_profile()
        self.page = PreviewPage(self.profile, self.view)
        self.profile.setParent(self.page)
        self.view.setPage(self.page)
        self.view.setContextMenuPolicy(Qt.ContextMenuPolicy.NoContextMenu)

        self.source = QPlainTextEdit(self)
        self.source.setReadOnly(True)
        self.source.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.stack = QStackedWidget(self)
        self.stack.addWidget(self.view)
        self.stack.addWidget(self.source)

        self.strip = QListWidget(self)
        self.strip.setObjectName("previewStrip")
        self.strip.setAlternatingRowColors(True)
        self.strip_label = QLabel(self)
        self.strip_label.setObjectName("muted")
        # Short labels, the whole story in the tooltips: the side panel can be as narrow as 400 px, and the four
        # buttons must fit there without eliding. The strip's counts and Clear sit over the strip they describe.
        self.source_button = self._tool_button("Source", "Show the HTML source instead of the rendered page")
        self.source_button.setCheckable(True)
        self.reload_button = self._tool_button("Reload", "Load the page again (a fresh start, same storage)")
        self.save_button = self._tool_button("Save…", "Save the page as an HTML file…")
        self.open_button = self._tool_button(
            "Browser…", "Open the page in your web browser, outside the sandbox (asks first)"
        )
        self.clear_button = self._tool_button("Clear", "Clear the list of console messages and blocked attempts")
        self.clear_button.setObjectName("ghost")

        toolbar = QHBoxLayout()
        toolbar.setContentsMargins(0, 0, 0, 0)
        toolbar.setSpacing(4)
        for button in (self.source_button, self.reload_button, self.save_button, self.open_button):
            toolbar.addWidget(button)
        toolbar.addStretch(1)
        strip_box = QWidget(self)
        strip_header = QHBoxLayout()
        strip_header.setContentsMargins(2, 2, 0, 0)
        strip_header.addWidget(self.strip_label, 1)
        strip_header.addWidget(self.clear_button)
        strip_layout = QVBoxLayout(strip_box)
        strip_layout.setContentsMargins(0, 0, 0, 0)
        strip_layout.setSpacing(2)
        strip_layout.addLayout(strip_header)
        strip_layout.addWidget(self.strip, 1)
        splitter = QSplitter(self)
        splitter.setOrientation(Qt.Orientation.Vertical)
        splitter.addWidget(self.stack)
        splitter.addWidget(strip_box)
        splitter.setStretchFactor(0, 5)
        splitter.setStretchFactor(1, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(toolbar)
        layout.addWidget(splitter, 1)

        # Coalesces set_html() calls into page loads (public for diagnostics and tests: its ``calls`` count loads).
        self.reload_throttle = Throttle(self._show_pending, reload_interval_ms, self)
        self._update_strip_label()
        self._update_buttons()
        self._connect_signals()

    def _tool_button(self, text: str, tip: str) -> QToolButton:
        button = QToolButton(self)
        button.setText(text)
        button.setToolTip(tip)
        return button

    def _connect_signals(self) -> None:
        self.interceptor.requestBlocked.connect(self.on_request_blocked)
        self.page.refused.connect(self.on_page_refused)
        self.page.consoleMessage.connect(self.on_console_message)
        self.page.loadingChanged.connect(self.on_loading_changed)
        self.page.renderProcessTerminated.connect(self.on_render_process_terminated)
        self.profile.downloadRequested.connect(self.on_download_requested)
        self.source_button.toggled.connect(self.on_source_toggled)
        self.reload_button.clicked.connect(self.on_reload_clicked)
        self.save_button.clicked.connect(self.on_save_clicked)
        self.open_button.clicked.connect(self.on_open_in_browser_clicked)
        self.clear_button.clicked.connect(self.on_clear_clicked)

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

    def url(self) -> QUrl:
        """The URL the current document is (or will be) served at."""
        return QUrl(f"{SCHEME}://{document_host(self._document_id)}{INDEX_PATH}?r={self._revision}")

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

    def clear_strip(self) -> None:
        self.entries.clear()
        self.strip.clear()
        self._update_strip_label()

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
        folder = Path(tempfile.gettempdir()) / "clover-desk-preview"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{document_host(self._document_id)}.html"
        atomic_write_text(path, self._html)
        return QDesktopServices.openUrl(QUrl.fromLocalFile(str(path)))

    # ---- slots ---------------------------------------------------------------------------------------------

    def on_request_blocked(self, url: str, kind: str) -> None:
        self._add_entry("blocked", f"blocked {kind} request to {url}")

    def on_page_refused(self, what: str) -> None:
        self._add_entry("blocked", f"blocked {what}")

    def on_console_message(self, level: str, text: str) -> None:
        # CSP refusals arrive here too ("Refused to connect to …"): they are blocked attempts, list them as such.
        text = text.strip()
        kind = "blocked" if "Refused to" in text or text.startswith("clover-preview: blocked") else level
        if kind == "info":
            return
        self._add_entry(kind, text)

    def on_loading_changed(self, info: QWebEngineLoadingInfo) -> None:
        # Only our own document counts: a refused navigation elsewhere also ends in a (stopped) load, which
        # must not read as "the page failed".
        if info.url() != self._loading_url:
            return
        status = info.status()
        if status == QWebEngineLoadingInfo.LoadStatus.LoadSucceededStatus:
            self.loadFinished.emit(True)
        elif status == QWebEngineLoadingInfo.LoadStatus.LoadFailedStatus:
            self._add_entry("error", f"the page failed to load: {info.errorString() or info.errorCode()}")
            self.loadFinished.emit(False)

    def on_render_process_terminated(self, status: QWebEnginePage.RenderProcessTerminationStatus, code: int) -> None:
        self._add_entry("error", f"the page's renderer stopped ({status.name}, code {code}); press Reload")

    def on_download_requested(self, download: QWebEngineDownloadRequest) -> None:
        self._add_entry("blocked", f"blocked download of {download.suggestedFileName()}")
        download.cancel()

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
        path, _ = QFileDialog.getSaveFileName(self, "Save page as", "page.html", "HTML files (*.html *.htm)")
        if path:
            try:
                self.save_to(path)
            except OSError as exc:
                QMessageBox.warning(self, "Could not save", f"Could not save {path}: {exc.strerror or exc}")

    def on_open_in_browser_clicked(self) -> None:
        self.open_in_browser(confirm=True)

    def on_clear_clicked(self) -> None:
        self.clear_strip()

    # ---- internals -----------------------------------------------------------------------------------------

    def _show_pending(self) -> None:
        if self._html == self._shown_html:
            return
        self._shown_html = self._html
        self._revision += 1
        host = document_host(self._document_id)
        self.scheme_handler.put(host, self._html)
        if self.stack.currentWidget() is self.source:
            self.source.setPlainText(self._html)
        url = self.url()
        self._loading_url = url
        self.page.expect_load(url)
        self.page.load(url)

    def _add_entry(self, kind: str, text: str) -> None:
        entry = StripEntry(kind, text)
        self.entries.append(entry)
        if len(self.entries) > MAX_STRIP_ENTRIES:
            del self.entries[0]
            self.strip.takeItem(0)
        item = QListWidgetItem(f"{_KIND_MARK[kind]} {text}")
        item.setData(Qt.ItemDataRole.UserRole, kind)
        item.setToolTip(text)
        self.strip.addItem(item)
        self.strip.scrollToBottom()
        self._update_strip_label()
        log.debug("preview %s: %s", kind, text)
        self.stripEntryAdded.emit(kind, text)

    def _update_strip_label(self) -> None:
        blocked = sum(1 for e in self.entries if e.kind == "blocked")
        errors = sum(1 for e in self.entries if e.kind == "error")
        warnings = sum(1 for e in self.entries if e.kind == "warning")
        self.strip_label.setText(
            f"{blocked} blocked · {_plural(errors, 'error')} · {_plural(warnings, 'warning')}"
        )

    def _update_buttons(self) -> None:
        has = bool(self._html)
        self.save_button.setEnabled(has)
        self.open_button.setEnabled(has)
        self.reload_button.setEnabled(has)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


_KIND_MARK = {"blocked": "[blocked]", "error": "[error]", "warning": "[warning]", "info": "[info]"}
