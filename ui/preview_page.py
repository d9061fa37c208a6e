"""The preview's page: :class:`PreviewPage` refuses new windows, permissions, file choosers and every
navigation but the one the pane asked for, and answers the page's dialogs itself (see :mod:`ui.preview_sandbox`)."""


from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import (
    QCoreApplication,
    QObject,
    QUrl,
)
from PySide6.QtWebEngineCore import (
    QWebEnginePage,
    QWebEnginePermission,
    QWebEngineProfile,
)

from clover_desk.ui.preview_sandbox import GUARD_REPORT_ORIGIN, SCHEME
from clover_desk.ui.preview_strip import clip_line

# The text QtWebEngine passes to javaScriptConfirm() for a beforeunload dialog (qwebenginepage.cpp).
_LEAVE_PAGE_TEXT = "Are you sure you want to leave this page? Changes that you made may not be saved."

# (source, kind, text) -> None: where a page reports what it refused or answered.
Reporter = Callable[[str, str, str], None]


class PreviewPage(QWebEnginePage):
    """A page that may only show the document the pane loads into it, and never opens a dialog.

    Everything it refuses or answers goes to ``report(source, kind, text)`` (the pane's strip). A page the pane has
    replaced is ``retired``: what it still says is dropped.
    """

    def __init__(self, profile: QWebEngineProfile, parent: QObject | None = None,
                 report: Reporter | None = None) -> None:
        super().__init__(profile, parent)
        self._report: Reporter = report or (lambda source, kind, text: None)
        self.retired = False
        self._allowed_url: QUrl | None = None  # the one load the pane asked for, until it is taken
        self._current_url = QUrl()
        self._leave_text = QCoreApplication.translate("QWebEnginePage", _LEAVE_PAGE_TEXT)
        self._connect_signals()

    def _connect_signals(self) -> None:
        self.permissionRequested.connect(self.on_permission_requested)
        self.fileSystemAccessRequested.connect(self.on_file_system_access_requested)
        self.fullScreenRequested.connect(self.on_full_screen_requested)
        self.registerProtocolHandlerRequested.connect(self.on_protocol_handler_requested)
        self.desktopMediaRequested.connect(self.on_desktop_media_requested)
        self.webAuthUxRequested.connect(self.on_web_auth_requested)
        self.printRequested.connect(self.on_print_requested)
        if hasattr(self, "printRequestedByFrame"):
            self.printRequestedByFrame.connect(self.on_print_requested)

    def report(self, source: str, kind: str, text: str) -> None:
        if not self.retired:
            self._report(source, kind, text)

    def refuse(self, what: str) -> None:
        self.report("blocked", "blocked", f"blocked {what}")

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
            self.refuse(f"sub-frame navigation to {clip_line(url.toString())}")
            return False
        if self._allowed_url is not None and url == self._allowed_url:
            self._allowed_url = None
            self._current_url = QUrl(url)
            return True
        if url.scheme() == SCHEME and self._same_document(url):
            # An in-page anchor (#section) or location.reload() of the same document: harmless.
            return True
        kind = navigation_type.name.removeprefix("NavigationType")
        self.refuse(f"navigation to {clip_line(url.toString())} ({kind})")
        return False

    def _same_document(self, url: QUrl) -> bool:
        strip = QUrl.UrlFormattingOption.RemoveFragment
        return not self._current_url.isEmpty() and url.adjusted(strip) == self._current_url.adjusted(strip)

    def createWindow(self, window_type: QWebEnginePage.WebWindowType) -> QWebEnginePage | None:  # noqa: N802
        self.refuse(f"new window ({window_type.name.removeprefix('WebBrowser')})")
        return None

    def chooseFiles(self, mode: QWebEnginePage.FileSelectionMode, old: list[str], accepted: list[str]) -> list[str]:  # noqa: N802
        self.refuse("file chooser (the preview cannot read your files)")
        return []

    # ---- dialogs: answered here, never shown -----------------------------------------------------------------

    def javaScriptAlert(self, security_origin: QUrl, message: str) -> None:  # noqa: N802 (Qt override)
        self.report("dialogs", "dialog", f"alert() not shown: {clip_line(message)}")

    def javaScriptConfirm(self, security_origin: QUrl, message: str) -> bool:  # noqa: N802 (Qt override)
        if message == self._leave_text:
            # Qt asks beforeunload through here: the pane's own loads always leave the old page.
            self.report("dialogs", "dialog", "beforeunload ignored: the page asked to stay and was left anyway")
            return True
        self.report("dialogs", "dialog", f"confirm() answered Cancel: {clip_line(message)}")
        return False

    def javaScriptPrompt(  # noqa: N802 (Qt override)
        self, security_origin: QUrl, message: str, default: str
    ) -> tuple[bool, str]:
        self.report("dialogs", "dialog", f"prompt() answered Cancel (null): {clip_line(message)}")
        return False, ""

    def javaScriptConsoleMessage(  # noqa: N802 (Qt override)
        self, level: QWebEnginePage.JavaScriptConsoleMessageLevel, message: str, line: int, source: str
    ) -> None:
        # Called once per message, possibly hundreds of thousands of times a second: cheap, and nothing kept here.
        if level == QWebEnginePage.JavaScriptConsoleMessageLevel.InfoMessageLevel or self.retired:
            return
        text = clip_line(message)
        if GUARD_REPORT_ORIGIN in text:
            return  # the engine's own line about a guard report (the report itself is listed as blocked)
        kind = "error" if level == QWebEnginePage.JavaScriptConsoleMessageLevel.ErrorMessageLevel else "warning"
        self._report("console", kind, f"{text} (line {line})" if line > 0 else text)

    # ---- requests the page makes of the host -----------------------------------------------------------------

    def on_permission_requested(self, permission: QWebEnginePermission) -> None:
        self.refuse(f"permission {permission.permissionType().name}")
        permission.deny()

    def on_file_system_access_requested(self, request: object) -> None:
        self.refuse("file system access")
        request.reject()  # type: ignore[attr-defined]

    def on_full_screen_requested(self, request: object) -> None:
        request.reject()  # type: ignore[attr-defined]

    def on_protocol_handler_requested(self, request: object) -> None:
        self.refuse("protocol handler registration")
        request.reject()  # type: ignore[attr-defined]

    def on_desktop_media_requested(self, request: object) -> None:
        self.refuse("screen capture")
        request.cancel()  # type: ignore[attr-defined]

    def on_web_auth_requested(self, request: object) -> None:
        self.refuse("security key / passkey request")
        request.cancel()  # type: ignore[attr-defined]

    def on_print_requested(self, *args: object) -> None:
        self.report("dialogs", "dialog", "print() not shown")


