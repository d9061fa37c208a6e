"""Sandboxed preview of model-written HTML apps.

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

Each document gets a random host (so its own origin, never derived from its id) and its own page, so its own
renderer and a clean ``window.name``; revisions of the same document (a streaming answer) keep both. Before a
revision replaces a page, the page is pinged; one that does not answer within :data:`HANG_TIMEOUT_MS` is
stopped (its renderer goes with it) and the revision shown in a fresh page.

The strip under the view keeps separate, bounded lists: blocked attempts (host side only), page dialogs, console
messages and the pane's own notices; each keeps its last entries and counts the rest, long lines are cut, and the
list is repainted through one throttle. Bounded lists alone do not bound the app: the engine queues a page's
console messages for the window without limit when the page outruns it. So the guard drops ``console.*`` lines
past :data:`CONSOLE_LINES_PER_S` in the page itself (and says how many), and a page that still floods the strip
(engine errors, CSP refusals, dialogs) is stopped, with a notice.

The scheme must be registered before the QApplication exists: call :func:`register_schemes` first thing in the
entry point (and in the test session's ``pytest_configure``).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import secrets
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import shiboken6
from PySide6.QtCore import (
    QBuffer,
    QByteArray,
    QCoreApplication,
    QIODevice,
    QObject,
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

from ui.html_extract import extract_html  # noqa: F401 (the one rule; re-exported)
from ui.throttle import Throttle
from ui.widgets import documents_dir

log = logging.getLogger(__name__)

SCHEME = "clover-preview"
SCHEME_BYTES = SCHEME.encode("ascii")
INDEX_PATH = "/index.html"
CSP_REPORT_PATH = "/__csp-report"
RELOAD_INTERVAL_MS = 500  # at most one reload per half second while an answer streams
HANG_TIMEOUT_MS = 2000  # a page that does not answer a ping for this long before a new revision is stopped
STRIP_REPAINT_MS = 200  # the strip is redrawn at most this often, however fast entries arrive
MAX_LINE_CHARS = 500  # longer strip lines are cut (a page can log megabytes in one message)
# Each list keeps its last entries and counts the rest ("N more"): a page logging or alerting in a loop cannot
# push the blocked attempts out, nor grow the app's memory.
MAX_BLOCKED_ENTRIES = 200
MAX_CONSOLE_ENTRIES = 200
MAX_DIALOG_ENTRIES = 50
MAX_NOTICE_ENTRIES = 50
MAX_STRIP_ENTRIES = MAX_BLOCKED_ENTRIES + MAX_CONSOLE_ENTRIES + MAX_DIALOG_ENTRIES + MAX_NOTICE_ENTRIES
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
# The strip's model: bounded lists by source
# ---------------------------------------------------------------------------------------------------------------

_entry_sequence = itertools.count()


@dataclass(frozen=True)
class StripEntry:
    """One line in the strip under the view."""

    kind: str  # "blocked" | "dialog" | "error" | "warning" | "info"
    text: str
    source: str = "pane"  # "blocked" | "dialogs" | "console" | "pane": which bounded list holds it
    seq: int = 0  # arrival order across the lists


class BoundedLog:
    """The last ``limit`` entries of one source, and how many there were in all."""

    def __init__(self, limit: int) -> None:
        self.entries: deque[StripEntry] = deque(maxlen=limit)
        self.total = 0

    @property
    def dropped(self) -> int:
        return self.total - len(self.entries)

    def add(self, entry: StripEntry) -> None:
        self.entries.append(entry)
        self.total += 1

    def clear(self) -> None:
        self.entries.clear()
        self.total = 0


def clip_line(text: str, limit: int = MAX_LINE_CHARS) -> str:
    """One strip line: at most ``limit`` characters (cut before any other work on a possibly huge string)."""
    if len(text) > limit:
        extra = len(text) - limit
        text = f"{text[:limit]}… ({extra} more characters)"
    return text.strip()


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


# ---------------------------------------------------------------------------------------------------------------
# The widget
# ---------------------------------------------------------------------------------------------------------------


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
    stripEntryAdded = Signal(str, str)
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
        # Flood detection: entries from the page since the window started, and how many windows in a row were full.
        self._activity_start = time.monotonic()
        self._activity_count = 0
        self._flood_windows = 0

        # Bounded lists, one per source (see the module docstring), and the totals per kind.
        self.logs: dict[str, BoundedLog] = {
            "blocked": BoundedLog(MAX_BLOCKED_ENTRIES),
            "dialogs": BoundedLog(MAX_DIALOG_ENTRIES),
            "console": BoundedLog(MAX_CONSOLE_ENTRIES),
            "pane": BoundedLog(MAX_NOTICE_ENTRIES),
        }
        self.counts: Counter[str] = Counter()

        self.view = QWebEngineView(self)
        self.view.setObjectName("previewView")
        self.view.setAccessibleName("Page preview (sandboxed)")
        # The profile is given to the pane last of all (end of __init__): children are destroyed in order, and the
        # pages (children of the view) must go before their profile (Qt warns and may crash the other way round).
        self.profile, self.scheme_handler, self.interceptor = make_preview_profile()
        self.page = self._make_page()
        self.view.setPage(self.page)
        self.view.setContextMenuPolicy(Qt.ContextMenuPolicy.NoContextMenu)

        self.source = QPlainTextEdit(self)
        self.source.setReadOnly(True)
        self.source.setAccessibleName("Page source")
        self.source.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.stack = QStackedWidget(self)
        self.stack.addWidget(self.view)
        self.stack.addWidget(self.source)

        self.strip = QListWidget(self)
        self.strip.setObjectName("previewStrip")
        self.strip.setAccessibleName("What the page tried, and its console")
        self.strip.setAlternatingRowColors(True)
        # long lines wrap inside the panel (no line is cut at its edge; the full text is also the tooltip)
        self.strip.setWordWrap(True)
        self.strip.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.strip.setResizeMode(QListWidget.ResizeMode.Adjust)
        self.strip_label = QLabel(self)
        self.strip_label.setProperty("class", "muted")
        # Short labels, the whole story in the tooltips: the side panel can be as narrow as 400 px, and the four
        # buttons must fit there without eliding. The strip's counts and Clear sit over the strip they describe.
        self.source_button = self._tool_button("Source", "Show the HTML source instead of the rendered page")
        self.source_button.setCheckable(True)
        self.reload_button = self._tool_button("Reload", "Load the page again (a fresh start, same storage)")
        self.save_button = self._tool_button("Save…", "Save the page as an HTML file…")
        self.open_button = self._tool_button(
            "Browser…", "Open the page in your web browser, outside the sandbox (asks first)"
        )
        self.clear_button = self._tool_button("Clear", "Clear the list of blocked attempts, dialogs and console messages")
        self.clear_button.setProperty("class", "ghost")

        toolbar = QHBoxLayout()
        toolbar.setContentsMargins(6, 6, 6, 4)
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
        # The one place the strip is redrawn: however fast entries arrive, at most every STRIP_REPAINT_MS.
        self.strip_throttle = Throttle(self._repaint_strip, STRIP_REPAINT_MS, self)
        self._ping_timer = QTimer(self)
        self._ping_timer.setSingleShot(True)
        self._ping_timer.timeout.connect(self.on_ping_timeout)
        self._update_strip_label()
        self._update_buttons()
        self._connect_signals()
        self.profile.setParent(self)  # the pane's last child (see above)

    def _tool_button(self, text: str, tip: str) -> QToolButton:
        button = QToolButton(self)
        button.setText(text)
        button.setToolTip(tip)
        button.setAccessibleName(tip)
        return button

    def _connect_signals(self) -> None:
        self.interceptor.requestBlocked.connect(self.on_request_blocked)
        self.interceptor.cspViolation.connect(self.on_csp_violation)
        self.profile.downloadRequested.connect(self.on_download_requested)
        self.source_button.toggled.connect(self.on_source_toggled)
        self.reload_button.clicked.connect(self.on_reload_clicked)
        self.save_button.clicked.connect(self.on_save_clicked)
        self.open_button.clicked.connect(self.on_open_in_browser_clicked)
        self.clear_button.clicked.connect(self.on_clear_clicked)

    def _make_page(self) -> PreviewPage:
        page = PreviewPage(self.profile, self.view, report=self._add_entry)
        # Bound to the page: a replaced page's late signals are recognised and dropped.
        page.loadingChanged.connect(functools.partial(self.on_loading_changed, page))
        page.urlChanged.connect(functools.partial(self.on_url_changed, page))
        page.renderProcessTerminated.connect(functools.partial(self.on_render_process_terminated, page))
        return page

    # ---- public API ----------------------------------------------------------------------------------------

    @property
    def entries(self) -> list[StripEntry]:
        """Every entry the strip lists, oldest first (each source keeps its own last entries)."""
        merged = [e for log_ in self.logs.values() for e in log_.entries]
        merged.sort(key=lambda e: e.seq)
        return merged

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

    def clear_strip(self) -> None:
        for log_ in self.logs.values():
            log_.clear()
        self.counts.clear()
        self.strip_throttle.cancel()
        self._repaint_strip()

    def flush_strip(self) -> None:
        """Redraw the strip now (it is otherwise redrawn at most every :data:`STRIP_REPAINT_MS`)."""
        self.strip_throttle.cancel()
        self._repaint_strip()

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
        path = folder / f"{self.document_host()}.html"
        atomic_write_text(path, self._html)
        return QDesktopServices.openUrl(QUrl.fromLocalFile(str(path)))

    # ---- slots ---------------------------------------------------------------------------------------------

    def on_request_blocked(self, url: str, kind: str) -> None:
        self._add_entry("blocked", "blocked", f"blocked {kind} request to {clip_line(url)}")

    def on_csp_violation(self, host: str, text: str) -> None:
        if host == self._page_host:  # not a late report of a document no longer shown
            self._add_entry("blocked", "blocked", clip_line(text))

    def on_console_message(self, level: str, text: str) -> None:
        """A console line (the page's own words: never counted as a blocked attempt, whatever it says)."""
        if level in ("error", "warning"):
            self._add_entry("console", level, clip_line(text))

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
            self._add_entry("pane", "error", f"the page failed to load: {info.errorString() or info.errorCode()}")
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
        self._add_entry("pane", "error", f"the page's renderer stopped ({status.name}, code {code}); press Reload")
        self._on_sign_of_life()  # a pending revision loads at once (in a new renderer)

    def on_download_requested(self, download: QWebEngineDownloadRequest) -> None:
        self._add_entry("blocked", "blocked", f"blocked download of {clip_line(download.suggestedFileName())}")
        download.cancel()

    def on_ping_answer(self, generation: int) -> None:
        if generation == self._ping_generation:
            self._on_sign_of_life()

    def on_ping_timeout(self) -> None:
        if not self._ping_pending:
            return
        self._ping_pending = False
        seconds = self._hang_timeout_ms / 1000
        self._add_entry("pane", "error", f"the page stopped responding (no answer in {seconds:g} s): it was stopped "
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

    def on_clear_clicked(self) -> None:
        self.clear_strip()

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
        self._add_entry("blocked", "blocked", f"blocked navigation to {clip_line(url.toString())}")
        if self._escape_restores < MAX_ESCAPE_RESTORES:
            self._escape_restores += 1
            QTimer.singleShot(0, self._restore_document)
            return
        self._add_entry("pane", "error", "the page keeps navigating away to about:blank; press Reload to run it again")
        self._finish_load(False)

    def _restore_document(self) -> None:
        self._cancel_ping()
        self._navigate()

    def _add_entry(self, source: str, kind: str, text: str) -> None:
        # Called for every console line of a page that may log in a loop: O(1), and the strip only marked dirty.
        if source != "pane" and self._flooded():
            return
        entry = StripEntry(kind, text, source, next(_entry_sequence))
        self.logs[source].add(entry)
        self.counts[kind] += 1
        self.strip_throttle.request()
        self.stripEntryAdded.emit(kind, text)

    def _flooded(self) -> bool:
        """Count one entry from the page; True when it ends a flood (the page has then been stopped)."""
        self._activity_count += 1
        if self._activity_count < FLOOD_MESSAGES_PER_S * FLOOD_WINDOW_S:
            return False  # cheap: the clock is read only once a window's worth of entries has arrived
        now = time.monotonic()
        elapsed = now - self._activity_start
        flooding = elapsed <= FLOOD_WINDOW_S
        self._activity_start, self._activity_count = now, 0
        self._flood_windows = self._flood_windows + 1 if flooding else 0
        if self._flood_windows < FLOOD_WINDOWS:
            return False
        self._flood_windows = 0
        self._stop_page(f"the page flooded the strip (over {FLOOD_MESSAGES_PER_S:,} messages a second): it was "
                        "stopped; press Reload to run it again")
        return True

    def _stop_page(self, why: str) -> None:
        """Stop the page on show (its renderer goes with it) and leave a blank one; Reload or a new revision runs
        the document again."""
        self._add_entry("pane", "error", why)
        loading = self._expected_url is not None
        self._replace_page()
        self._expected_url = None
        if loading:
            self.loadFinished.emit(False)

    def _repaint_strip(self) -> None:
        entries = self.entries
        self.strip.setUpdatesEnabled(False)
        try:
            self.strip.clear()
            for entry in entries:
                item = QListWidgetItem(f"{_KIND_MARK.get(entry.kind, '[info]')} {entry.text}")
                item.setData(Qt.ItemDataRole.UserRole, entry.kind)
                item.setToolTip(entry.text)
                self.strip.addItem(item)
        finally:
            self.strip.setUpdatesEnabled(True)
        self.strip.scrollToBottom()
        self._update_strip_label()

    def _update_strip_label(self) -> None:
        c = self.counts
        parts = [f"{c['blocked']} blocked", _plural(c["error"], "error"), _plural(c["warning"], "warning")]
        if c["dialog"]:
            parts.append(_plural(c["dialog"], "dialog"))
        hidden = sum(log_.dropped for log_ in self.logs.values())
        if hidden:
            parts.append(f"{hidden} more not listed")
        self.strip_label.setText(" · ".join(parts))

    def _update_buttons(self) -> None:
        has = bool(self._html)
        self.save_button.setEnabled(has)
        self.open_button.setEnabled(has)
        self.reload_button.setEnabled(has)


def _ping_answered(pane: PreviewPane, generation: int, _result: object = None) -> None:
    # May be called while a page (or the pane) is being destroyed: only a live pane acts on it.
    if shiboken6.isValid(pane):
        pane.on_ping_answer(generation)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


_KIND_MARK = {"blocked": "[blocked]", "dialog": "[dialog]", "error": "[error]", "warning": "[warning]", "info": "[info]"}
