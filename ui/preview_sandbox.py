"""The preview's sandbox: the offline engine, its profile, the CSP, the guard script, the scheme handler and
the request interceptor (the page policy: :mod:`ui.preview_page`; the pane: :mod:`ui.preview`).

The model writes whole pages ("a desktop in one HTML file"); the user looks at them here. The page is untrusted:
it may try to phone home, open windows or dialogs, navigate away, read files, write the clipboard, flood its
console or spin forever. The defences, each enough on its own for what it covers, are layered:

* the engine itself is offline (:data:`OFFLINE_CHROMIUM_FLAGS`, set by :func:`register_schemes` before the
  QApplication exists, in the one place the GUI, ``clover-desk preview`` and the tests all go through): no host
  name is ever resolved (``--host-resolver-rules=MAP * ~NOTFOUND`` closes DNS for every channel at once, WebRTC's
  TURN/STUN look-ups included), no UDP that is not proxied (so no WebRTC host candidates and no mDNS), and every
  proxied connection, loopback included, goes to a dead proxy;
* a dedicated off-the-record :class:`QWebEngineProfile` (nothing written to disk, no shared cookies or storage);
* the document is served from memory through the custom scheme ``clover-preview://<token>/index.html`` by
  :class:`PreviewSchemeHandler` (never ``setHtml``: that percent-encodes into a ``data:`` URL capped at 2 MB),
  with a Content-Security-Policy response header (:data:`PREVIEW_CSP`): inline script/style only, images from
  ``data:``/``blob:``, no connect/frame/form targets. Its violations are reported (``report-uri``) to the
  request interceptor, which reads them: that is how CSP refusals reach the strip, never through console text
  (a dedicated worker's refusals are still refused, but the engine reports them only on the console);
* :class:`PreviewRequestInterceptor` blocks every request whose scheme is not internal (the CSP stops most of
  them earlier; the interceptor is the backstop for whatever CSP does not cover) and records it;
* :class:`PreviewPage` refuses new windows, every permission, file choosers, and every navigation other than
  the load the pane asked for (a jump to ``about:blank``, which Qt never submits for approval, is listed and the
  document put back); it answers ``alert``/``confirm``/``prompt`` itself without ever showing a dialog, and never
  lets ``beforeunload`` hold a page;
* a guard script runs first in every frame (and is pushed into script-made ``about:blank`` frames as they are
  inserted): WebRTC's constructors are gone, ``window.open`` returns null, ``execCommand('copy'|'cut')`` does
  nothing. The guard runs in the page's own world, so it reports through the one channel the page cannot fake
  into something else: a CSP-refused fetch to ``https://clover-preview-guard.invalid/...``.

The scheme must be registered before the QApplication exists: call :func:`register_schemes` first thing in the
entry point (and in the test session's ``pytest_configure``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Iterable
from urllib.parse import unquote, urlsplit

from PySide6.QtCore import (
    QBuffer,
    QByteArray,
    QCoreApplication,
    QIODevice,
    QObject,
    Signal,
)
from PySide6.QtWebEngineCore import (
    QWebEngineProfile,
    QWebEngineScript,
    QWebEngineSettings,
    QWebEngineUrlRequestInfo,
    QWebEngineUrlRequestInterceptor,
    QWebEngineUrlRequestJob,
    QWebEngineUrlScheme,
    QWebEngineUrlSchemeHandler,
)

log = logging.getLogger(__name__)

SCHEME = "clover-preview"
SCHEME_BYTES = SCHEME.encode("ascii")
INDEX_PATH = "/index.html"
CSP_REPORT_PATH = "/__csp-report"
RELOAD_INTERVAL_MS = 500  # at most one reload per half second while an answer streams
HANG_TIMEOUT_MS = 2000  # a page that does not answer a ping for this long before a new revision is stopped
MAX_CSP_REPORT_BYTES = 64 * 1024
MAX_ESCAPE_RESTORES = 1  # a revision that keeps navigating itself to about:blank is put back this many times
# The engine queues a page's console messages for the window without bound when the page outruns it (a logging
# loop grew the app by ~65 MB/s even with bounded lists). So the guard drops console.* lines past this many a
# second in the page itself (and says how many), and a page that still sends more than FLOOD_MESSAGES_PER_S
# strip entries a second (engine errors, CSP refusals, dialogs, many frames) for FLOOD_WINDOWS half-second
# windows in a row is stopped. No real app logs thousands of lines a second for a second on end.
CONSOLE_LINES_PER_S = 500
FLOOD_MESSAGES_PER_S = 5000
FLOOD_WINDOW_S = 0.5
FLOOD_WINDOWS = 2

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
    b"X-Content-Type-Options": b"nosniff",
    b"X-DNS-Prefetch-Control": b"off",
    b"Referrer-Policy": b"no-referrer",
    b"Cache-Control": b"no-store",
}
# Schemes the engine may load inside the page without a network round trip (inline images, blobs, about:blank).
_INTERNAL_SCHEMES = frozenset({SCHEME, "data", "blob", "about"})

# The guard script reports through CSP: a fetch to this (never resolvable) origin is refused by connect-src and the
# violation report reaches the interceptor. The page can send the same report itself, but only by making a blocked
# connection attempt, which is what the report says.
GUARD_REPORT_ORIGIN = "https://clover-preview-guard.invalid"


def csp_for(host: str) -> str:
    """The policy a document on ``host`` is served with: :data:`PREVIEW_CSP` plus where its violations go."""
    return f"{PREVIEW_CSP}; report-uri {SCHEME}://{host}{CSP_REPORT_PATH}"


# Runs before any page script, in the main world of every frame. It also installs itself into each same-origin
# child frame the moment one appears (a script-made about:blank frame has a fresh realm with every API and no
# user script yet): after each DOM insertion call, on a frame's contentWindow, and from a MutationObserver (which
# fires before the next parser-inserted script runs).
_GUARD_SCRIPT = r"""
(function () {
  'use strict';
  const MARK = Symbol.for('clover-preview-guard');
  // Captured before any page script: the guard also runs later (into new frames), after the page may have
  // replaced prototype methods, so it never looks one up again (no for-of, no regexps, no method calls on data).
  const apply = Reflect.apply, defineProperty = Object.defineProperty, getOwnPropertyNames = Object.getOwnPropertyNames;
  const getDescriptor = Object.getOwnPropertyDescriptor, encode = encodeURIComponent, StringOf = String;
  const toLower = String.prototype.toLowerCase, startsWith = String.prototype.startsWith;
  const slice = String.prototype.slice, then = Promise.prototype.then;
  const home = window, realFetch = window.fetch, ignore = function () {};
  const DateCtor = Date, now = Date.now, setTimer = window.setTimeout;
  const reportBase = REPORT_BASE, consolePerSecond = CONSOLE_PER_S;
  // Console budget (per frame that runs this script): past it, lines are dropped here, in the page, and counted
  // in one summary line. A logging loop would otherwise queue messages for the window faster than it reads them.
  let windowStart = 0, used = 0, dropped = 0, summaryDue = false;
  function consoleBudget(con, warn) {
    const t = apply(now, DateCtor, []);
    if (t - windowStart >= 1000) { windowStart = t; used = 0; }
    if (used < consolePerSecond) { used++; return true; }
    dropped++;
    if (!summaryDue) {
      summaryDue = true;
      try {
        apply(setTimer, home, [function () {
          summaryDue = false;
          const n = dropped;
          dropped = 0;
          apply(warn, con, ['clover-preview: ' + n + ' console messages dropped (the page logs more than ' +
                            consolePerSecond + ' a second)']);
        }, 1000]);
      } catch (e) { summaryDue = false; }
    }
    return false;
  }
  function report(what, detail) {
    try {
      const p = apply(realFetch, home, [reportBase + '/' + what + '?' + encode(apply(slice, StringOf(detail), [0, 300]))]);
      apply(then, p, [undefined, ignore]);
    } catch (e) {}
  }
  function sweep() {
    let top;
    try { top = home.top; } catch (e) { top = home; }
    walk(top, 0);
  }
  function walk(win, depth) {
    if (depth > 8) return;
    install(win);
    let n = 0;
    try { n = win.length; } catch (e) { return; }
    for (let i = 0; i < n; i++) {
      let child;
      try { child = win[i]; } catch (e) { continue; }
      if (child) walk(child, depth + 1);
    }
  }
  // Wrapped methods stay writable (an app may wrap them again: it can only ever reach ours, no realm still has the
  // original) but cannot be deleted or redefined.
  function lock(obj, name, value, writable) {
    try { defineProperty(obj, name, {value: value, writable: !!writable, configurable: false}); } catch (e) {}
  }
  function wrapAfter(proto, name) {
    if (!proto) return;
    const original = proto[name];
    if (typeof original !== 'function') return;
    lock(proto, name, function () { const result = apply(original, this, arguments); sweep(); return result; }, true);
  }
  function wrapSetter(proto, name) {
    if (!proto) return;
    const d = getDescriptor(proto, name);
    if (!d || !d.set) return;
    const set = d.set, get = d.get;
    try {
      defineProperty(proto, name, {configurable: false, enumerable: d.enumerable, get: get,
                                   set: function (v) { apply(set, this, [v]); sweep(); }});
    } catch (e) {}
  }
  function wrapFrameGetter(proto, name) {
    if (!proto) return;
    const d = getDescriptor(proto, name);
    if (!d || !d.get) return;
    const get = d.get;
    try {
      defineProperty(proto, name, {configurable: false, enumerable: d.enumerable,
                                   get: function () { sweep(); return apply(get, this, []); }});
    } catch (e) {}
  }
  function install(win) {
    try {
      if (win[MARK]) return;
      defineProperty(win, MARK, {value: true, writable: false, configurable: false, enumerable: false});
    } catch (e) { return; }  // cross-origin (it has its own guard) or gone
    // WebRTC opens sockets past CSP and the interceptor: every RTC* interface disappears (a getter that reports
    // the look-up and yields undefined, so feature tests see no WebRTC).
    const names = getOwnPropertyNames(win);
    for (let i = 0; i < names.length; i++) {
      const name = names[i];
      if (!apply(startsWith, name, ['RTC']) && !apply(startsWith, name, ['webkitRTC'])) continue;
      try { delete win[name]; } catch (e) {}
      try {
        defineProperty(win, name, {configurable: false, enumerable: false,
                                   get: function () { report('webrtc', name); return undefined; },
                                   set: function () {}});
      } catch (e) {}
    }
    const con = win.console;
    if (con) {
      const methods = ['log', 'info', 'debug', 'warn', 'error', 'trace', 'dir', 'dirxml', 'table', 'assert', 'count',
                       'countReset', 'group', 'groupCollapsed', 'groupEnd', 'time', 'timeLog', 'timeEnd'];
      const warn = con.warn;
      for (let i = 0; i < methods.length; i++) {
        const original = con[methods[i]];
        if (typeof original !== 'function') continue;
        // Not locked: apps often wrap console.log themselves (to show a log panel); theirs then calls ours.
        con[methods[i]] = function () { if (consoleBudget(con, warn)) return apply(original, this, arguments); };
      }
    }
    lock(win, 'open', function open(url) { report('window-open', url === undefined ? '' : url); return null; });
    const D = win.Document && win.Document.prototype;
    if (D && typeof D.execCommand === 'function') {
      const execCommand = D.execCommand;
      lock(D, 'execCommand', function execCommand_(command, showUI, value) {
        const c = apply(toLower, StringOf(command), []);  // converted once: no toString() that changes its answer
        if (c === 'copy' || c === 'cut' || c === 'paste') { report('clipboard', 'execCommand(' + c + ')'); return false; }
        const result = apply(execCommand, this, [c, showUI, value]);
        sweep();
        return result;
      }, true);
    }
    const N = win.Node && win.Node.prototype, E = win.Element && win.Element.prototype;
    const nodeMethods = ['appendChild', 'insertBefore', 'replaceChild'];
    for (let i = 0; i < nodeMethods.length; i++) wrapAfter(N, nodeMethods[i]);
    const treeMethods = ['append', 'prepend', 'before', 'after', 'replaceWith', 'replaceChildren', 'insertAdjacentElement',
                         'insertAdjacentHTML', 'setHTMLUnsafe', 'moveBefore', 'write', 'writeln'];
    const owners = [E, win.CharacterData, win.DocumentType, win.Document, win.DocumentFragment];
    for (let j = 0; j < owners.length; j++) {
      const proto = j === 0 ? owners[0] : owners[j] && owners[j].prototype;
      if (!proto) continue;
      for (let i = 0; i < treeMethods.length; i++) {
        if (getDescriptor(proto, treeMethods[i])) wrapAfter(proto, treeMethods[i]);
      }
    }
    if (win.Range) { wrapAfter(win.Range.prototype, 'insertNode'); wrapAfter(win.Range.prototype, 'surroundContents'); }
    wrapSetter(E, 'innerHTML'); wrapSetter(E, 'outerHTML');
    if (win.ShadowRoot) wrapSetter(win.ShadowRoot.prototype, 'innerHTML');
    const frameOwners = ['HTMLIFrameElement', 'HTMLFrameElement', 'HTMLObjectElement'];
    for (let i = 0; i < frameOwners.length; i++) {
      const proto = win[frameOwners[i]] && win[frameOwners[i]].prototype;
      wrapFrameGetter(proto, 'contentWindow'); wrapFrameGetter(proto, 'contentDocument');
    }
    try {
      new win.MutationObserver(sweep).observe(win.document, {childList: true, subtree: true});
    } catch (e) {}
  }
  install(home);
  sweep();
})();
"""


# Process-wide Chromium switches for an engine that must never reach the network by itself. WebRTC opens its
# own sockets (STUN/TURN, UDP or TCP) and resolves its servers' names, past CSP and the request interceptor, and a
# script-made about:blank frame has WebRTC before any injected script runs there. So: nothing is ever resolved
# (the custom scheme needs no DNS; this stops TURN/STUN names, prefetches and anything else at once), no UDP that
# is not proxied (no host candidates, so no mDNS announcements either), and every proxied connection, loopback
# included, goes to a dead proxy. The app's QtWebEngine views only ever show local content, so nothing is lost.
OFFLINE_CHROMIUM_FLAGS = (
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
    "--webrtc-ip-handling-policy=disable_non_proxied_udp",
    "--proxy-server=127.0.0.1:1",
    "--proxy-bypass-list=<-loopback>",
    "--dns-prefetch-disable",
)
CHROMIUM_FLAGS_ENV = "QTWEBENGINE_CHROMIUM_FLAGS"


def split_chromium_flags(text: str) -> list[str]:
    """Split ``QTWEBENGINE_CHROMIUM_FLAGS`` the way QtWebEngine does: on spaces, double quotes group."""
    args: list[str] = []
    arg: list[str] = []
    quoted = started = False
    for ch in text:
        if ch == '"':
            quoted = not quoted
            started = True
        elif ch == " " and not quoted:
            if started:
                args.append("".join(arg))
            arg, started = [], False
        else:
            arg.append(ch)
            started = True
    if started:
        args.append("".join(arg))
    return args


def join_chromium_flags(args: Iterable[str]) -> str:
    """The inverse of :func:`split_chromium_flags` (an argument with spaces is quoted)."""
    return " ".join(f'"{a}"' if " " in a else a for a in args)


def with_offline_flags(text: str) -> str:
    """``text`` (a flags string) with :data:`OFFLINE_CHROMIUM_FLAGS` in force: any other value given for one of
    those switches is dropped, so nothing set from outside can turn the network back on. Idempotent."""
    ours = {f.split("=", 1)[0] for f in OFFLINE_CHROMIUM_FLAGS}
    kept = [a for a in split_chromium_flags(text) if a.split("=", 1)[0] not in ours]
    return join_chromium_flags([*kept, *OFFLINE_CHROMIUM_FLAGS])


def register_schemes(offline_engine: bool = True) -> bool:
    """Register ``clover-preview://`` with QtWebEngine and make the engine offline. Call it before the
    QApplication is created: it is the one place where the engine's switches are set (the GUI, ``clover-desk
    preview``, the screenshot script and the test session all call it).

    With ``offline_engine`` (the default) it puts :data:`OFFLINE_CHROMIUM_FLAGS` into ``QTWEBENGINE_CHROMIUM_FLAGS``,
    which QtWebEngine reads when it starts (at the first profile or view). Idempotent. Returns False (and logs an
    error) when called too late.
    """
    if offline_engine:
        os.environ[CHROMIUM_FLAGS_ENV] = with_offline_flags(os.environ.get(CHROMIUM_FLAGS_ENV, ""))
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
# Documents (finding the HTML in an answer: ui.html_extract)
# ---------------------------------------------------------------------------------------------------------------
def new_document_host() -> str:
    """A fresh, unguessable, DNS-safe host: one origin per document, never derived from the document's id (ids can
    come back, e.g. a database row id after a delete), so one page's storage is never another's."""
    return "d" + secrets.token_hex(16)



# Violated CSP directive -> what was refused (for the strip).
_CSP_WHAT = {
    "connect-src": "connection to",
    "img-src": "image from",
    "style-src": "stylesheet from",
    "style-src-elem": "stylesheet from",
    "script-src": "script from",
    "script-src-elem": "script from",
    "font-src": "font from",
    "media-src": "media from",
    "frame-src": "frame of",
    "child-src": "frame or worker from",
    "worker-src": "worker from",
    "object-src": "plugin content from",
    "manifest-src": "manifest from",
    "form-action": "form submission to",
    "base-uri": "base URL",
    "prefetch-src": "prefetch of",
    "default-src": "load of",
}
_GUARD_WHAT = {
    "webrtc": "WebRTC ({}): the preview has no WebRTC",
    "window-open": "new window: window.open({})",
    "clipboard": "clipboard write: document.{}",
}


def describe_csp_report(body: bytes) -> str | None:
    """The strip line for a CSP violation report (the JSON Chromium posts to ``report-uri``), or None if unreadable."""
    try:
        report = json.loads(body.decode("utf-8", errors="replace"))["csp-report"]
        directive = str(report.get("effective-directive") or report.get("violated-directive") or "").split(" ")[0]
        blocked = str(report.get("blocked-uri") or "")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if blocked.startswith(GUARD_REPORT_ORIGIN + "/"):
        parts = urlsplit(blocked)
        what = _GUARD_WHAT.get(parts.path.strip("/"))
        if what is not None:
            return "blocked " + what.format(unquote(parts.query))
    what = _CSP_WHAT.get(directive)
    if what is None:
        return f"blocked by the page's policy ({directive or 'unknown'}): {blocked}"
    return f"blocked {what} {blocked}" if blocked else f"blocked {what.rsplit(' ', 1)[0]}"



# ---------------------------------------------------------------------------------------------------------------
# Engine-side pieces
# ---------------------------------------------------------------------------------------------------------------


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
        headers = {b"Content-Security-Policy": csp_for(url.host()).encode("ascii"), **RESPONSE_HEADERS}
        # The binding maps QMultiMap to {key: [values]} (a bare QByteArray value would be split into characters).
        job.setAdditionalResponseHeaders({QByteArray(k): [QByteArray(v)] for k, v in headers.items()})
        job.reply(QByteArray(b"text/html; charset=utf-8"), buffer)


class PreviewRequestInterceptor(QWebEngineUrlRequestInterceptor):
    """Blocks every request that does not stay inside the preview, and reports it; reads CSP violation reports."""

    # (url, resource type name) of a refused request. Emitted on the GUI thread (Qt 6 calls interceptors there).
    requestBlocked = Signal(str, str)
    # (document host, strip line) for a CSP violation the engine reported.
    cspViolation = Signal(str, str)

    def interceptRequest(self, info: QWebEngineUrlRequestInfo) -> None:  # noqa: N802 (Qt override)
        url = info.requestUrl()
        if info.resourceType() == QWebEngineUrlRequestInfo.ResourceType.ResourceTypeCspReport:
            # Only the engine makes these (a page's own POST there is refused by connect-src, and that refusal
            # is itself reported): the one channel for refusals that page text cannot imitate.
            info.block(True)
            text = describe_csp_report(_read_body(info))
            if text is not None:
                self.cspViolation.emit(url.host(), text)
            return
        if url.scheme().lower() in _INTERNAL_SCHEMES:
            return
        info.block(True)
        kind = info.resourceType().name.removeprefix("ResourceType")
        self.requestBlocked.emit(url.toString(), kind)


def _read_body(info: QWebEngineUrlRequestInfo) -> bytes:
    body = info.requestBody()
    if body is None:
        return b""
    if not body.isOpen() and not body.open(QIODevice.OpenModeFlag.ReadOnly):
        return b""
    return bytes(body.read(MAX_CSP_REPORT_BYTES).data())



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
    profile.scripts().insert(guard_script())
    _lock_down(profile.settings())
    return profile, handler, interceptor


def guard_script() -> QWebEngineScript:
    """The guard (see :data:`_GUARD_SCRIPT`): main world, every frame, before any page script."""
    guard = QWebEngineScript()
    guard.setName("clover-preview-guard")
    source = _GUARD_SCRIPT.replace("REPORT_BASE", json.dumps(GUARD_REPORT_ORIGIN))
    guard.setSourceCode(source.replace("CONSOLE_PER_S", str(CONSOLE_LINES_PER_S)))
    guard.setInjectionPoint(QWebEngineScript.InjectionPoint.DocumentCreation)
    guard.setWorldId(QWebEngineScript.ScriptWorldId.MainWorld)
    guard.setRunsOnSubFrames(True)
    return guard


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


