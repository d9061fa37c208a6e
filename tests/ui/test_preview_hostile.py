"""The preview against pages that attack the app rather than the network: WebRTC in fresh frames, console and dialog
floods, dialog traps, clipboard writes, state leaking between documents, pages that hang, and pages that navigate
themselves away. Real QtWebEngine, real clicks, a real loopback listener; each test waits on signals.

What must never happen is checked directly (no dialog ever becomes modal, the clipboard never changes, the app's
memory and event loop stay bounded); what must happen is checked in the strip, where the user sees it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("PySide6.QtWebEngineWidgets", exc_type=ImportError)

from clover_desk.qt_compat import guard_pyside_bool_refcounts  # noqa: E402
from clover_desk.ui.preview import PreviewPane
from clover_desk.ui.preview_sandbox import FLOOD_MESSAGES_PER_S, register_schemes
from clover_desk.ui.preview_strip import MAX_CONSOLE_ENTRIES, MAX_DIALOG_ENTRIES, MAX_LINE_CHARS, MAX_STRIP_ENTRIES
from tests.net_helpers import LoopbackListener

guard_pyside_bool_refcounts()
register_schemes()  # before pytest-qt creates the QApplication (conftest does it too; idempotent)

TIMEOUT_MS = 20_000
HANG_MS = 2000  # the test pane's unresponsive-page timeout: the app's (1 s is tight for a renderer on a loaded machine)
GRACE_MS = 500  # proving that something does *not* happen needs a window of time


@pytest.fixture(scope="module")
def listener() -> Iterator[LoopbackListener]:
    srv = LoopbackListener(backlog=16)
    yield srv
    srv.close()


def _delete_now(widget) -> None:  # noqa: ANN001
    from PySide6.QtCore import QCoreApplication, QEvent

    widget.close()
    widget.deleteLater()
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete.value)


@pytest.fixture(scope="module")
def pane(qapp) -> Iterator[PreviewPane]:
    widget = PreviewPane(reload_interval_ms=50, hang_timeout_ms=HANG_MS)
    widget.resize(700, 500)
    widget.show()
    yield widget
    _delete_now(widget)


@pytest.fixture
def modal_watch(qapp) -> Iterator[list[str]]:
    """Every modal dialog that appears (each is closed at once, so a regression fails instead of hanging)."""
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    seen: list[str] = []

    def check() -> None:
        modal = QApplication.activeModalWidget()
        if modal is not None:
            seen.append(f"{type(modal).__name__}: {modal.windowTitle()}")
            modal.close()

    timer = QTimer()
    timer.timeout.connect(check)
    timer.start(20)
    yield seen
    timer.stop()


def load(qtbot, pane: PreviewPane, html: str, document_id: str, *, clear: bool = True) -> None:
    """Show ``html`` as ``document_id`` and wait for *its* load (matched by the document's host)."""
    if clear:
        pane.strip.clear()
    host = pane.document_host(document_id)
    with qtbot.waitSignal(pane.loadFinished, timeout=TIMEOUT_MS,
                          check_params_cb=lambda ok: pane.page.url().host() == host) as blocker:
        pane.set_html(html, document_id)
        pane.flush()
    assert blocker.args == [True]


def start(qtbot, pane: PreviewPane, html: str, document_id: str, title: str) -> None:
    """Show a page whose load may never finish (it spins or floods): wait for the title it sets instead."""
    pane.strip.clear()
    pane.set_html(html, document_id)
    pane.flush()
    wait_title(qtbot, pane, title)


def js(qtbot, pane: PreviewPane, source: str):
    with qtbot.waitCallback(timeout=TIMEOUT_MS) as callback:
        pane.page.runJavaScript(source, 0, callback)
    return callback.args[0]


def wait_title(qtbot, pane: PreviewPane, title: str) -> None:
    qtbot.waitUntil(lambda: pane.page.title() == title, timeout=TIMEOUT_MS)


def texts(pane: PreviewPane, source: str) -> list[str]:
    return [e.text for e in pane.strip.logs[source].entries]


def wait_for(qtbot, condition, timeout_ms: int) -> bool:  # noqa: ANN001
    """Whether ``condition()`` came true within ``timeout_ms`` (waiting on the event loop)."""
    try:
        qtbot.waitUntil(condition, timeout=timeout_ms)
    except qtbot.TimeoutError:
        return False
    return True


def rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class LoopWatch:
    """The longest stretch the GUI thread went without running a 10 ms timer (the event loop's lag)."""

    def __init__(self) -> None:
        from PySide6.QtCore import QTimer

        self.worst_ms = 0.0
        self._last = time.monotonic()
        self._timer = QTimer()
        self._timer.timeout.connect(self._tick)
        self._timer.start(10)

    def _tick(self) -> None:
        now = time.monotonic()
        self.worst_ms = max(self.worst_ms, (now - self._last) * 1000 - 10)
        self._last = now

    def stop(self) -> None:
        self._timer.stop()


# ---- WebRTC: gone from every frame, however it was made -----------------------------------------------------

WEBRTC_PROBE = r"""<!DOCTYPE html><html><body><iframe id=parsed></iframe><script>
// Every way a page gets a fresh realm (each has WebRTC until the guard reaches it), and every RTC* interface.
const results = {};
const rtcNames = W => Object.getOwnPropertyNames(W).filter(n => /^(webkit)?RTC/.test(n));
function probe(tag, W) {
  const types = {};
  for (const n of ['RTCPeerConnection', 'webkitRTCPeerConnection', 'RTCDataChannel', 'RTCIceCandidate',
                   'RTCSessionDescription', 'RTCRtpTransceiver', 'RTCRtpSender', 'RTCCertificate']) types[n] = typeof W[n];
  for (const n of rtcNames(W)) types[n] = typeof W[n];
  let made;
  try {
    new W.RTCPeerConnection({iceServers: [{urls: ['turn:leak-' + tag + '.example:3478?transport=tcp',
                                                  'stun:leak-' + tag + '.example'], username: 'u', credential: 'c'}]});
    made = 'constructed';
  } catch (e) { made = 'threw ' + e.name; }
  results[tag] = {types: types, made: made, count: rtcNames(W).length};
}
function last() { return window[window.length - 1]; }
probe('main', window);
probe('parsed', frames[0]);
const appended = document.createElement('iframe'); document.body.appendChild(appended);
probe('appended', appended.contentWindow);
document.body.append(document.createElement('iframe')); probe('indexed', last());
const holder = document.createElement('div'); holder.innerHTML = '<iframe></iframe>'; document.body.appendChild(holder);
probe('innerHTML', last());
document.body.insertAdjacentHTML('beforeend', '<iframe></iframe>'); probe('adjacent', last());
document.write('<iframe></iframe>'); probe('written', last());
const inner = appended.contentDocument.createElement('iframe');
Node.prototype.appendChild.call(appended.contentDocument.body, inner); probe('nested', appended.contentWindow[0]);
const host = document.createElement('div'); document.body.appendChild(host);
host.attachShadow({mode: 'open'}).appendChild(document.createElement('iframe')); probe('shadow', last());
const srcdoc = document.createElement('iframe');
srcdoc.srcdoc = '<script>parent.probe("srcdoc", window); parent.done()<\/script>';
window.done = () => { window.rtcResults = JSON.stringify(results); document.title = 'probed'; };
document.body.appendChild(srcdoc);
</script></body></html>"""


@pytest.mark.webengine
def test_webrtc_is_gone_from_every_frame_and_each_lookup_is_listed(qtbot, pane) -> None:
    load(qtbot, pane, WEBRTC_PROBE, "webrtc-frames")
    wait_title(qtbot, pane, "probed")
    results = json.loads(js(qtbot, pane, "window.rtcResults"))
    assert set(results) == {"main", "parsed", "appended", "indexed", "innerHTML", "adjacent", "written", "nested",
                            "shadow", "srcdoc"}
    for tag, result in results.items():
        assert result["count"] >= 5, (tag, result)  # the names are still there (so feature tests see them) ...
        assert set(result["types"].values()) == {"undefined"}, (tag, result)  # ... but there is nothing behind them
        assert result["made"] == "threw TypeError", (tag, result)
    # Reported as blocked (through CSP, which the page cannot turn into anything but a blocked attempt).
    qtbot.waitUntil(lambda: any("blocked WebRTC (RTCPeerConnection)" in t for t in texts(pane, "blocked")),
                    timeout=TIMEOUT_MS)
    assert any("blocked WebRTC (webkitRTCPeerConnection)" in t for t in texts(pane, "blocked"))


# ---- the strip: bounded, and console text is never a "blocked" line ---------------------------------------------


@pytest.mark.webengine
def test_console_text_never_poses_as_blocked_and_cannot_push_blocked_out(qtbot, pane, listener) -> None:
    base = f"http://127.0.0.1:{listener.port}"
    html = f"""<!DOCTYPE html><html><body><script>
    new Image().src = '{base}/real-image';
    fetch('{base}/real-fetch').catch(() => 0);
    // Lines that look exactly like what the sandbox says, and lines that look like the engine's refusals.
    console.error("Refused to connect to 'http://fake.invalid/' because it violates the document's policy.");
    console.warn('blocked connection to http://fake.invalid/warned');
    console.error('clover-preview: blocked window.open(http://fake.invalid/)');
    console.error('x'.repeat(100000));
    for (let i = 0; i < 3; i++) {{
      console.assert(false, 'assert ' + i); console.log('log ' + i); console.info('info'); console.debug('debug');
      console.trace('trace ' + i); console.table([i]); console.dir({{i}});
    }}
    for (let i = 0; i < 600; i++) {{ console.warn('warn ' + i); console.error('error ' + i); }}
    document.title = 'logged';
    </script></body></html>"""
    load(qtbot, pane, html, "console-burst")
    wait_title(qtbot, pane, "logged")
    qtbot.waitUntil(lambda: sum(f"{base}/real-" in t for t in texts(pane, "blocked")) == 2, timeout=TIMEOUT_MS)
    # The page logged ~1,200 lines in one go: the guard let 500 through and then said how many it dropped.
    qtbot.waitUntil(lambda: any("console messages dropped" in t for t in texts(pane, "console")), timeout=TIMEOUT_MS)
    qtbot.wait(GRACE_MS)

    blocked = texts(pane, "blocked")
    assert sorted(blocked) == [f"blocked connection to {base}/real-fetch", f"blocked image from {base}/real-image"]
    assert pane.strip.counts["blocked"] == 2  # none of the page's own lines was counted as a blocked attempt
    assert all(e.source == "blocked" for e in pane.strip.entries if e.kind == "blocked")
    console = pane.strip.logs["console"]
    assert len(console.entries) == MAX_CONSOLE_ENTRIES and console.total > MAX_CONSOLE_ENTRIES
    assert console.total < 1000  # the flood stopped in the page, not in the app
    assert all(len(t) <= MAX_LINE_CHARS + 40 for t in texts(pane, "console"))
    assert {e.kind for e in console.entries} <= {"error", "warning"}  # log/info/debug are not listed
    pane.strip.flush()
    assert pane.strip.list.count() == len(pane.strip.entries) <= MAX_STRIP_ENTRIES
    assert "more not listed" in pane.strip.label.text() and pane.strip.label.text().startswith("2 blocked")
    assert listener.accepted == [] and listener.datagrams == []


@pytest.mark.webengine
def test_the_fake_lines_are_listed_as_the_pages_own(qtbot, pane) -> None:
    html = """<!DOCTYPE html><html><body><script>
    console.error("Refused to connect to 'http://fake.invalid/' because it violates the document's policy.");
    console.warn('clover-preview: blocked window.open(http://fake.invalid/)');
    document.title = 'faked';
    </script></body></html>"""
    load(qtbot, pane, html, "console-fake")
    wait_title(qtbot, pane, "faked")
    qtbot.waitUntil(lambda: len(texts(pane, "console")) == 2, timeout=TIMEOUT_MS)
    kinds = {e.kind for e in pane.strip.logs["console"].entries}
    assert kinds == {"error", "warning"}
    assert pane.strip.counts["blocked"] == 0 and texts(pane, "blocked") == []


FLOODS = {
    # console.* in a loop, from the page and from frames it made (the guard's budget holds in each)
    "console": """const frames_ = [];
      for (let k = 0; k < 3; k++) { const f = document.createElement('iframe'); document.body.appendChild(f);
                                    frames_.push(f.contentWindow); }
      setTimeout(() => { document.title = 'flooding'; let i = 0; for (;;) { for (const w of [window, ...frames_]) {
        w.console.error('Refused to connect to http://x/' + i + ' ' + 'y'.repeat(2000)); w.console.warn('w' + i);
        w.console.log(i); } i++; } }, 0);""",
    # lines the engine writes itself, which no script budget can stop: CSP refusals of ever-new URLs
    "engine": """setTimeout(() => {
        document.title = 'flooding'; let i = 0; for (;;) fetch('http://127.0.0.1:9/' + (i++)).catch(() => 0); }, 0);""",
}


@pytest.mark.webengine
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the app's memory from /proc")
@pytest.mark.parametrize("flood", sorted(FLOODS))
def test_a_flooding_page_cannot_grow_the_app_or_freeze_it(qtbot, pane, flood: str) -> None:
    start(qtbot, pane, f"<!DOCTYPE html><html><body><script>{FLOODS[flood]}</script></body></html>", f"flood-{flood}",
          "flooding")
    before = rss_mb()
    watch = LoopWatch()
    qtbot.wait(2500)
    watch.stop()
    grown = rss_mb() - before
    # Before the fix: ~65 MB a second (the engine queues what the window has not read yet), 100-660 ms lags.
    assert grown < 120, f"the app grew by {grown:.0f} MB in 2.5 s of flood"
    assert watch.worst_ms < 300, f"the event loop stalled for {watch.worst_ms:.0f} ms"
    assert len(pane.strip.logs["console"].entries) <= MAX_CONSOLE_ENTRIES
    pane.strip.flush()
    assert pane.strip.list.count() == len(pane.strip.entries) <= MAX_STRIP_ENTRIES
    if flood == "console":
        assert pane.strip.logs["console"].total > 0
        assert pane.strip.counts["blocked"] == 0  # "Refused to connect ..." from console.error is the page's own text
        assert all(len(t) <= MAX_LINE_CHARS + 40 for t in texts(pane, "console"))  # long lines cut
    else:
        # A page past FLOOD_MESSAGES_PER_S is stopped and the strip says why. How fast the engine writes refusals
        # depends on the machine: on a loaded one it can stay under the threshold (no flood, nothing owed), so
        # the test waits, and if the page still runs, measures its rate and requires it to be under the threshold.
        stopped = lambda: any("flooded" in t for t in texts(pane, "pane"))  # noqa: E731
        if not wait_for(qtbot, stopped, 8000):
            sent = lambda: sum(log_.total for name, log_ in pane.strip.logs.items() if name != "pane")  # noqa: E731
            before_n, t0 = sent(), time.monotonic()
            qtbot.wait(1000)
            rate = (sent() - before_n) / (time.monotonic() - t0)
            assert not stopped() and rate < FLOOD_MESSAGES_PER_S, f"{rate:.0f} messages/s and not stopped"
    # Another document can be shown at once.
    started = time.monotonic()
    load(qtbot, pane, "<!DOCTYPE html><html><body><p id=p>calm</p></body></html>", f"after-flood-{flood}")
    assert time.monotonic() - started < 5
    assert js(qtbot, pane, "document.getElementById('p').textContent") == "calm"


# ---- dialogs: answered in the app, never shown -----------------------------------------------------------------


@pytest.mark.webengine
def test_dialogs_are_answered_and_never_shown(qtbot, pane, modal_watch) -> None:
    html = """<!DOCTYPE html><html><body><script>
    window.answers = [];
    alert('hello from the page');
    answers.push(confirm('Delete everything?'));
    answers.push(prompt('Your bank password?', 'hunter2'));
    for (let i = 0; i < 300; i++) alert('loop ' + i);
    window.print();
    document.title = 'asked';
    </script></body></html>"""
    load(qtbot, pane, html, "dialogs")
    wait_title(qtbot, pane, "asked")
    assert json.loads(js(qtbot, pane, "JSON.stringify(window.answers)")) == [False, None]  # Cancel, and null
    qtbot.waitUntil(lambda: any("print()" in t for t in texts(pane, "dialogs")), timeout=TIMEOUT_MS)
    dialogs = pane.strip.logs["dialogs"]
    assert dialogs.total == 1 + 1 + 1 + 300 + 1 and len(dialogs.entries) == MAX_DIALOG_ENTRIES
    assert {e.kind for e in dialogs.entries} == {"dialog"}
    assert pane.strip.counts["dialog"] == dialogs.total and pane.strip.counts["blocked"] == 0
    pane.strip.clear()
    # The first ones fell out of the bounded list; a new document lists them again, each kind once.
    html2 = """<!DOCTYPE html><html><body><script>alert('a'); confirm('c'); prompt('p'); document.title = 'again';
    </script></body></html>"""
    load(qtbot, pane, html2, "dialogs-2")
    wait_title(qtbot, pane, "again")
    assert texts(pane, "dialogs") == ["alert() not shown: a", "confirm() answered Cancel: c",
                                      "prompt() answered Cancel (null): p"]
    assert modal_watch == []


@pytest.mark.webengine
def test_an_endless_alert_loop_does_not_trap_the_app(qtbot, pane, modal_watch) -> None:
    html = """<!DOCTYPE html><html><body><script>
    setTimeout(() => { document.title = 'trapping'; let i = 0; for (;;) alert('trapped ' + (i++)); }, 0);
    </script></body></html>"""
    start(qtbot, pane, html, "alert-loop", "trapping")
    watch = LoopWatch()
    qtbot.wait(1000)
    watch.stop()
    assert watch.worst_ms < 300
    assert len(pane.strip.logs["dialogs"].entries) <= MAX_DIALOG_ENTRIES
    load(qtbot, pane, "<!DOCTYPE html><html><body><p id=p>free</p></body></html>", "after-alert-loop")
    assert js(qtbot, pane, "document.getElementById('p').textContent") == "free"
    assert modal_watch == []


BEFOREUNLOAD = """<!DOCTYPE html><html><body style="margin:0;height:100vh"><p id=p>{text}</p><script>
window.addEventListener('beforeunload', e => {{ e.preventDefault(); e.returnValue = 'stay'; return 'stay'; }});
window.onbeforeunload = () => 'stay with me';
document.body.addEventListener('click', () => {{ document.title = 'clicked'; }});
document.title = 'armed';
</script></body></html>"""


@pytest.mark.webengine
def test_beforeunload_never_holds_a_page(qtbot, pane, modal_watch) -> None:
    from PySide6.QtCore import QPoint, Qt
    from PySide6.QtTest import QTest

    load(qtbot, pane, BEFOREUNLOAD.format(text="first"), "beforeunload")
    wait_title(qtbot, pane, "armed")
    # A real click: Chromium only asks beforeunload of a page the user has interacted with.
    QTest.mouseClick(pane.view.focusProxy(), Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, QPoint(60, 60))
    wait_title(qtbot, pane, "clicked")
    load(qtbot, pane, BEFOREUNLOAD.format(text="second"), "beforeunload", clear=False)  # the next revision
    assert js(qtbot, pane, "document.getElementById('p').textContent") == "second"
    assert any("beforeunload ignored" in t for t in texts(pane, "dialogs"))
    # Reload too (after another click).
    wait_title(qtbot, pane, "armed")
    QTest.mouseClick(pane.view.focusProxy(), Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, QPoint(60, 60))
    wait_title(qtbot, pane, "clicked")
    with qtbot.waitSignal(pane.loadFinished, timeout=TIMEOUT_MS) as blocker:
        pane.reload_button.click()
    assert blocker.args == [True]
    wait_title(qtbot, pane, "armed")
    assert sum("beforeunload ignored" in t for t in texts(pane, "dialogs")) == 2
    assert modal_watch == []


# ---- the clipboard -------------------------------------------------------------------------------------------


@pytest.mark.webengine
def test_a_click_cannot_make_the_page_write_the_clipboard(qtbot, pane) -> None:
    from PySide6.QtCore import QPoint, Qt
    from PySide6.QtGui import QGuiApplication
    from PySide6.QtTest import QTest

    clipboard = QGuiApplication.clipboard()
    clipboard.setText("the user's own text")
    changes: list[str] = []
    clipboard.dataChanged.connect(lambda: changes.append(clipboard.text()))
    html = """<!DOCTYPE html><html><body style="margin:0;height:100vh">
    <textarea id=t>https://evil.example/paste-me</textarea><iframe id=f></iframe><script>
    window.results = {};
    document.body.addEventListener('click', async () => {
      const t = document.getElementById('t');
      t.focus(); t.select();
      results.copy = document.execCommand('copy');
      results.upper = document.execCommand('COPY');
      t.select(); results.cut = document.execCommand('cut');
      let n = 0;  // says 'bold' when checked and 'copy' when used
      results.tricky = document.execCommand({toString() { return n++ ? 'copy' : 'bold'; }});
      // another realm's execCommand on this (activated) document
      try { results.realm = frames[0].Document.prototype.execCommand.call(document, 'copy'); }
      catch (e) { results.realm = 'threw ' + e.name; }
      document.addEventListener('copy', e => { e.clipboardData.setData('text/plain', 'hijacked'); e.preventDefault(); });
      results.hijack = document.execCommand('copy');
      try { await navigator.clipboard.writeText('pwned'); results.async = 'written'; }
      catch (e) { results.async = e.name; }
      document.title = 'clicked';
    });
    document.title = 'ready';
    </script></body></html>"""
    load(qtbot, pane, html, "clipboard")
    wait_title(qtbot, pane, "ready")
    QTest.mouseClick(pane.view.focusProxy(), Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier,
                     QPoint(300, 300))
    wait_title(qtbot, pane, "clicked")
    qtbot.wait(GRACE_MS)
    results = json.loads(js(qtbot, pane, "JSON.stringify(window.results)"))
    assert results["copy"] is False and results["upper"] is False and results["cut"] is False
    assert results["hijack"] is False and results["realm"] is False
    assert results["async"] == "NotAllowedError"
    assert clipboard.text() == "the user's own text"
    assert changes == []
    assert any("clipboard write: document.execCommand(copy)" in t for t in texts(pane, "blocked"))
    assert any("ClipboardReadWrite" in t for t in texts(pane, "blocked"))  # the async API asked and was denied


# ---- documents never share anything --------------------------------------------------------------------------


@pytest.mark.webengine
def test_documents_share_no_origin_storage_or_window_name(qtbot, pane) -> None:
    writer = """<!DOCTYPE html><html><body><script>
    localStorage.setItem('k', 'secret-of-a'); sessionStorage.setItem('s', 'session-of-a');
    window.name = 'name-of-a'; document.title = 'written';
    </script></body></html>"""
    reader = """<!DOCTYPE html><html><body><script>
    window.seen = JSON.stringify([localStorage.getItem('k'), sessionStorage.getItem('s'), window.name, location.host]);
    </script></body></html>"""
    load(qtbot, pane, writer, "message-5")
    wait_title(qtbot, pane, "written")
    page_a, pid_a = pane.page, pane.page.renderProcessPid()
    load(qtbot, pane, reader, "message-6")
    storage, session, name, host = json.loads(js(qtbot, pane, "window.seen"))
    assert (storage, session, name) == (None, None, "")
    assert host == pane.document_host("message-6") != pane.document_host("message-5")
    assert pane.page is not page_a and pane.page.renderProcessPid() != pid_a  # a new page, a new renderer
    # The host is random, not derived from the id: another pane gives the same id another origin.
    other = PreviewPane()
    try:
        assert other.document_host("message-5") != pane.document_host("message-5")
    finally:
        _delete_now(other)
    # A revision of the same document (a streaming answer) keeps its origin and so its storage.
    load(qtbot, pane, reader, "message-5")
    assert json.loads(js(qtbot, pane, "window.seen"))[0] == "secret-of-a"


# ---- pages that never answer ---------------------------------------------------------------------------------


@pytest.mark.webengine
@pytest.mark.parametrize("when", ["after-load", "while-loading"])
def test_a_busy_page_is_stopped_and_the_next_revision_shown(qtbot, pane, when: str) -> None:
    if when == "after-load":
        busy = """<!DOCTYPE html><html><body>busy<script>
        window.onload = () => setTimeout(() => { document.title = 'spinning'; for (;;) {} }, 0);</script></body></html>"""
        load(qtbot, pane, busy, f"busy-{when}")
        wait_title(qtbot, pane, "spinning")
    else:  # the page never finishes loading
        start(qtbot, pane, "<!DOCTYPE html><html><body>busy<script>document.title = 'spinning'; for (;;) {}</script>",
              f"busy-{when}", "spinning")
    old_page, pid = pane.page, pane.page.renderProcessPid()
    replaced = pane.pages_replaced
    started = time.monotonic()
    load(qtbot, pane, "<!DOCTYPE html><html><body><p id=p>revision 2</p></body></html>", f"busy-{when}", clear=False)
    assert time.monotonic() - started < HANG_MS / 1000 + 4
    assert js(qtbot, pane, "document.getElementById('p').textContent") == "revision 2"
    assert pane.page is not old_page and pane.pages_replaced == replaced + 1
    assert any("stopped as unresponsive" in t for t in texts(pane, "pane"))
    qtbot.waitUntil(lambda: not pid_alive(pid), timeout=TIMEOUT_MS)  # the spinning renderer is gone


@pytest.mark.webengine
def test_reload_brings_back_a_page_that_stopped_answering(qtbot, pane) -> None:
    busy = """<!DOCTYPE html><html><body><p id=p>again</p><script>
    window.onload = () => setTimeout(() => { document.title = 'spinning'; for (;;) {} }, 0);</script></body></html>"""
    load(qtbot, pane, busy, "busy-reload")
    wait_title(qtbot, pane, "spinning")
    pid = pane.page.renderProcessPid()
    with qtbot.waitSignal(pane.loadFinished, timeout=TIMEOUT_MS) as blocker:
        pane.reload_button.click()
    assert blocker.args == [True]
    assert pane.page.renderProcessPid() != pid
    assert any("stopped as unresponsive" in t for t in texts(pane, "pane"))


@pytest.mark.webengine
def test_a_healthy_page_is_never_stopped(qtbot, pane) -> None:
    load(qtbot, pane, "<!DOCTYPE html><html><body><p id=p>1</p></body></html>", "healthy")
    page = pane.page
    for i in range(2, 6):  # revisions of a streaming answer
        load(qtbot, pane, f"<!DOCTYPE html><html><body><p id=p>{i}</p></body></html>", "healthy", clear=False)
    assert js(qtbot, pane, "document.getElementById('p').textContent") == "5"
    assert pane.page is page and texts(pane, "pane") == []


# ---- navigation: about:blank, and pages that rewrite their own URL -------------------------------------------

ESCAPES = {
    "assign": "location = 'about:blank'",
    "replace": "location.replace('about:blank#gone')",
    "link": "const a = document.createElement('a'); a.href = 'about:blank'; document.body.appendChild(a); a.click()",
    "meta": ("const m = document.createElement('meta'); m.httpEquiv = 'refresh'; m.content = '0;url=about:blank';"
             " document.head.appendChild(m)"),
}


@pytest.mark.webengine
@pytest.mark.parametrize("when", ["after-load", "while-loading"])
@pytest.mark.parametrize("how", sorted(ESCAPES))
def test_a_jump_to_about_blank_is_listed_and_undone(qtbot, pane, how: str, when: str) -> None:
    # The page escapes once (window.name survives a same-origin navigation, so it knows when it is back). While
    # it loads, the jump is not even a load of its own for Qt: only the URL changes.
    escape = ESCAPES[how] if when == "while-loading" else f"setTimeout(() => {{ {ESCAPES[how]}; }}, 30)"
    html = f"""<!DOCTYPE html><html><head></head><body><p id=p>home</p><script>
    if (window.name !== 'escaped') {{ window.name = 'escaped'; {escape}; }}
    else document.title = 'back';
    </script></body></html>"""
    load(qtbot, pane, html, f"escape-{how}-{when}")  # the document's load is reported once it is back
    wait_title(qtbot, pane, "back")
    # the restored document's URL can be reported a moment after its script ran (seen once under a loaded CI box)
    qtbot.waitUntil(lambda: pane.page.url().scheme() == "clover-preview", timeout=TIMEOUT_MS)
    assert js(qtbot, pane, "document.getElementById('p').textContent") == "home"
    assert any(t.startswith("blocked navigation to about:blank") for t in texts(pane, "blocked"))


@pytest.mark.webengine
def test_a_page_that_keeps_leaving_is_left_with_a_notice(qtbot, pane) -> None:
    html = """<!DOCTYPE html><html><body><script>setTimeout(() => { location = 'about:blank'; }, 30)</script>
    </body></html>"""
    load(qtbot, pane, html, "escape-always")
    qtbot.waitUntil(lambda: any("keeps navigating away" in t for t in texts(pane, "pane")), timeout=TIMEOUT_MS)
    assert sum(t.startswith("blocked navigation to about:blank") for t in texts(pane, "blocked")) == 2


@pytest.mark.webengine
def test_a_page_that_rewrites_its_url_while_loading_still_loads(qtbot, pane) -> None:
    html = """<!DOCTYPE html><html><body><div id=app>loading</div><script>
    location.hash = '#/home';
    history.replaceState({}, '', '/app/home?tab=1#top');
    history.pushState({}, '', '/app/next');
    document.getElementById('app').textContent = 'routed';
    </script></body></html>"""
    load(qtbot, pane, html, "spa")  # waits for loadFinished(True): it used to never come
    assert pane.page.url().path() == "/app/next"
    assert js(qtbot, pane, "document.getElementById('app').textContent") == "routed"
    assert texts(pane, "blocked") == [] and texts(pane, "pane") == []
