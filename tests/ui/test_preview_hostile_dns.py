"""The preview resolves no name and sends nothing off the machine, whatever the page does: proved by watching.

The test re-runs this file as a child in a private network and mount namespace (``unshare``, as root):

* the namespace's only way out is a veth pair whose far end is watched with a packet socket: every IPv4/IPv6
  TCP or UDP frame that would leave the machine is counted (nothing can actually leave: the far end goes nowhere);
* ``/etc/resolv.conf`` is bind-mounted (privately) to point at ``127.0.0.1:53``, where a listener records every
  query, UDP or TCP, that Chromium's resolver (or glibc's) sends; mDNS (224.0.0.251:5353) is watched too;
* before the preview starts, a look-up, a multicast packet and a packet to the default route prove that each
  watcher would see a leak;
* then the real preview (the app's own ``register_schemes()``, profile and pane) shows pages that try WebRTC with
  TURN/TURNS/STUN servers named ``leak-<random>.example`` from the main frame, a script-made about:blank frame, a
  srcdoc frame and a parser-made frame, DNS prefetch/preconnect hints, a script in another JavaScript world, and,
  in a pane whose guard script was removed, the real RTCPeerConnection with those names and an address beyond the
  default route: only the engine's switches stand in the way there.

Where the machine cannot do this (not Linux, not root, no ``unshare``/``ip``, no veth), the test is skipped with
the reason; the API-absence and no-connection checks in test_preview_hostile.py / test_preview_security.py still run.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VETH_INSIDE, VETH_OUTSIDE = "cdprev0", "cdprev1"
INSIDE_ADDRESS, OUTSIDE_ADDRESS = "10.213.0.2", "10.213.0.1"
BEYOND = "192.0.2.1"  # TEST-NET-1: only reachable through the default route, i.e. off the machine
CHILD_TIMEOUT_S = 120


def _namespace_script(resolv_conf: Path) -> str:
    return " && ".join([
        "ip link set lo up",
        f"ip link add {VETH_INSIDE} type veth peer name {VETH_OUTSIDE}",
        f"ip addr add {INSIDE_ADDRESS}/24 dev {VETH_INSIDE}",
        f"ip link set {VETH_INSIDE} up",
        f"ip link set {VETH_OUTSIDE} up",
        f"ip route add default via {OUTSIDE_ADDRESS} dev {VETH_INSIDE}",
        # A fixed neighbour for the gateway: packets go out at once (no ARP) and the far end sees each one.
        f"ip neigh add {OUTSIDE_ADDRESS} lladdr 02:00:00:00:00:01 dev {VETH_INSIDE} nud permanent",
        f"mount --bind {resolv_conf} /etc/resolv.conf",
    ])


def _unshare(resolv_conf: Path, *command: str) -> list[str]:
    # --propagation private: the bind mount never reaches the host's /etc/resolv.conf.
    script = _namespace_script(resolv_conf) + ' && exec "$@"'
    return ["unshare", "--mount", "--net", "--propagation", "private", "sh", "-c", script, "sh", *command]


# ---------------------------------------------------------------------------------------------------------------
# The child: watchers and the real preview, inside the namespace
# ---------------------------------------------------------------------------------------------------------------


def _query_name(packet: bytes) -> str:
    """The first question's name in a DNS message."""
    labels, i = [], 12
    while i < len(packet) and packet[i]:
        n = packet[i]
        labels.append(packet[i + 1 : i + 1 + n].decode("ascii", "replace"))
        i += 1 + n
    return ".".join(labels)


class Watchers:
    """DNS on 127.0.0.1:53 (UDP and TCP), mDNS on 224.0.0.251:5353, and every frame leaving by the veth."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.mdns: list[bytes] = []
        self.frames: list[str] = []
        self._lock = threading.Lock()
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind(("127.0.0.1", 53))
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind(("127.0.0.1", 53))
        tcp.listen(16)
        mdns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        mdns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        mdns.bind(("0.0.0.0", 5353))
        mdns.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                        socket.inet_aton("224.0.0.251") + socket.inet_aton(INSIDE_ADDRESS))
        raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
        raw.bind((VETH_OUTSIDE, 0))
        for target, sock in ((self._udp, udp), (self._tcp, tcp), (self._mdns, mdns), (self._raw, raw)):
            threading.Thread(target=self._forever, args=(target, sock), daemon=True).start()

    @staticmethod
    def _forever(step, sock) -> None:  # noqa: ANN001
        while True:
            try:
                step(sock)
            except OSError:
                return

    def _udp(self, sock: socket.socket) -> None:
        data, _ = sock.recvfrom(4096)
        with self._lock:
            self.names.append(_query_name(data))

    def _tcp(self, sock: socket.socket) -> None:
        conn, _ = sock.accept()
        conn.settimeout(2)
        try:
            data = conn.recv(4096)
        finally:
            conn.close()
        with self._lock:
            self.names.append(_query_name(data[2:]))

    def _mdns(self, sock: socket.socket) -> None:
        data, _ = sock.recvfrom(9000)
        with self._lock:
            self.mdns.append(data)

    def _raw(self, sock: socket.socket) -> None:
        frame = sock.recv(65535)
        ethertype = int.from_bytes(frame[12:14], "big")
        if ethertype == 0x0800 and frame[23] in (6, 17):  # IPv4 TCP/UDP
            what = f"{'tcp' if frame[23] == 6 else 'udp'} {socket.inet_ntoa(frame[30:34])}"
        elif ethertype == 0x86DD and frame[20] in (6, 17):  # IPv6 TCP/UDP (not the kernel's own ICMPv6)
            what = f"{'tcp' if frame[20] == 6 else 'udp'} {socket.inet_ntop(socket.AF_INET6, frame[38:54])}"
        else:
            return
        with self._lock:
            self.frames.append(what)

    def snapshot_and_clear(self) -> dict[str, list]:
        with self._lock:
            seen = {"names": list(self.names), "mdns": len(self.mdns), "frames": list(self.frames)}
            self.names.clear(), self.mdns.clear(), self.frames.clear()
        return seen


def _prove_watchers(watchers: Watchers, token: str) -> dict[str, bool]:
    """Each watcher sees what it should: a look-up through the system resolver, an mDNS packet, a packet out."""
    name = f"sanity-{token}.example"
    try:
        socket.getaddrinfo(name, 80)
    except socket.gaierror:
        pass  # the listener does not answer: the look-up fails, after reaching it
    multicast = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    multicast.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(INSIDE_ADDRESS))
    multicast.sendto(b"\0" * 12, ("224.0.0.251", 5353))
    out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    out.sendto(b"x", (BEYOND, 9))
    deadline = time.monotonic() + 5
    seen: dict[str, bool] = {}
    while time.monotonic() < deadline:
        with watchers._lock:
            seen = {"dns": name in watchers.names, "mdns": bool(watchers.mdns),
                    "out": f"udp {BEYOND}" in watchers.frames}
        if all(seen.values()):
            break
        time.sleep(0.05)
    multicast.close()
    out.close()
    return seen


GUARDED_PAGE = r"""<!DOCTYPE html><html><head>
<link rel="dns-prefetch" href="//leak-prefetch-TOKEN.example">
<link rel="preconnect" href="https://leak-preconnect-TOKEN.example">
</head><body><iframe id=parsed></iframe><img src="http://leak-img-TOKEN.example/x.png"><script>
const results = {};
function attempt(tag, W) {
  const PC = W.RTCPeerConnection || W.webkitRTCPeerConnection;
  results[tag] = typeof PC;
  if (!PC) return;
  const pc = new PC({iceServers: [{urls: ['turn:leak-' + tag + '-turn-TOKEN.example:3478?transport=udp',
                                         'turns:leak-' + tag + '-turns-TOKEN.example:5349',
                                         'stun:leak-' + tag + '-stun-TOKEN.example'], username: 'u', credential: 'c'}]});
  pc.createDataChannel('x'); pc.createOffer().then(o => pc.setLocalDescription(o));
}
attempt('main', window);
attempt('parsed', frames[0]);
const blank = document.createElement('iframe'); document.body.appendChild(blank); attempt('blank', blank.contentWindow);
const s = document.createElement('iframe');
s.srcdoc = '<script>parent.attempt("srcdoc", window); parent.done()<\/script>';
window.done = () => { window.results = JSON.stringify(results); document.title = 'tried'; };
document.body.appendChild(s);
</script></body></html>"""

UNGUARDED_PAGE = r"""<!DOCTYPE html><html><body><script>
window.candidates = [];
const pc = new RTCPeerConnection({iceServers: [{urls: ['turn:leak-raw-turn-TOKEN.example:3478?transport=udp',
  'turn:leak-raw-turntcp-TOKEN.example:3478?transport=tcp', 'turns:leak-raw-turns-TOKEN.example:5349',
  'stun:leak-raw-stun-TOKEN.example', 'stun:BEYOND:3478', 'turn:BEYOND:3478?transport=tcp'],
  username: 'u', credential: 'c'}]});
pc.onicecandidate = e => { if (e.candidate && e.candidate.candidate) window.candidates.push(e.candidate.candidate); };
pc.onicegatheringstatechange = () => { if (pc.iceGatheringState === 'complete') document.title = 'gathered'; };
pc.createDataChannel('x'); pc.createOffer().then(o => pc.setLocalDescription(o));
document.title = 'started';
</script></body></html>"""


def child_main(out_path: str) -> int:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    os.environ.setdefault("QTWEBENGINE_DISABLE_SANDBOX", "1")
    sys.path.insert(0, str(ROOT))
    token = secrets.token_hex(6)
    watchers = Watchers()
    result: dict[str, object] = {"token": token, "sanity": _prove_watchers(watchers, token)}
    result["before_preview"] = watchers.snapshot_and_clear()

    from clover_desk.qt_compat import guard_pyside_bool_refcounts

    guard_pyside_bool_refcounts()
    from clover_desk.ui.preview_sandbox import GUARD_REPORT_ORIGIN, register_schemes

    register_schemes()  # the app's one place for the engine's switches
    from PySide6.QtCore import QCoreApplication, QEvent, QEventLoop, QTimer
    from PySide6.QtWebEngineCore import QWebEngineScript
    from PySide6.QtWidgets import QApplication

    from clover_desk.ui.preview import PreviewPane

    app = QApplication([sys.argv[0]])

    def wait_for(condition, timeout_s: float) -> bool:  # noqa: ANN001
        deadline = time.monotonic() + timeout_s
        loop = QEventLoop()
        while not condition() and time.monotonic() < deadline:
            QTimer.singleShot(20, loop.quit)
            loop.exec()
        return bool(condition())

    def run_js(pane: PreviewPane, source: str, world: int = 0):  # noqa: ANN202
        box: list[object] = []
        pane.page.runJavaScript(source, world, box.append)
        wait_for(lambda: bool(box), 10)
        return box[0] if box else None

    guarded = PreviewPane()
    unguarded = PreviewPane()
    for script in unguarded.profile.scripts().find("clover-preview-guard"):
        unguarded.profile.scripts().remove(script)
    for pane in (guarded, unguarded):
        pane.resize(500, 400)
        pane.show()

    guarded.set_html(GUARDED_PAGE.replace("TOKEN", token), "guarded")
    guarded.flush()
    result["guarded_tried"] = wait_for(lambda: guarded.page.title() == "tried", 20)
    result["guarded_types"] = json.loads(run_js(guarded, "window.results") or "{}")
    world = QWebEngineScript.ScriptWorldId.ApplicationWorld.value  # not bound by the page's CSP
    run_js(guarded, f"fetch('http://leak-isolated-{token}.example/').catch(() => 0); 0", world)

    unguarded.set_html(UNGUARDED_PAGE.replace("TOKEN", token).replace("BEYOND", BEYOND), "unguarded")
    unguarded.flush()
    result["unguarded_started"] = wait_for(lambda: unguarded.page.title() in ("started", "gathered"), 20)
    result["unguarded_gathered"] = wait_for(lambda: unguarded.page.title() == "gathered", 30)
    result["candidates"] = json.loads(run_js(unguarded, "JSON.stringify(window.candidates)") or "null")
    result["unguarded_type"] = run_js(unguarded, "typeof RTCPeerConnection")
    wait_for(lambda: False, 1.5)  # late attempts (a retry, a second TURN allocation) would land here
    guarded.strip.flush()
    result["blocked"] = [e.text for e in guarded.strip.entries if e.kind == "blocked"]
    result["guard_origin"] = GUARD_REPORT_ORIGIN
    result["during_preview"] = watchers.snapshot_and_clear()
    for pane in (guarded, unguarded):
        pane.close()
        pane.deleteLater()
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete.value)
    del app
    Path(out_path).write_text(json.dumps(result), encoding="utf-8")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# The test (parent side)
# ---------------------------------------------------------------------------------------------------------------

pytest.importorskip("PySide6.QtWebEngineWidgets", exc_type=ImportError)

def _namespace_unavailable(tmp: Path) -> str | None:
    if not sys.platform.startswith("linux"):
        return "needs Linux network and mount namespaces"
    if os.geteuid() != 0:
        return "needs root (unshare --net/--mount, a veth pair, a bind mount over /etc/resolv.conf)"
    for tool in ("unshare", "ip", "mount"):
        if shutil.which(tool) is None:
            return f"needs the {tool} command"
    probe = subprocess.run(_unshare(tmp / "resolv.conf", "true"), capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"this machine cannot make the namespace: {probe.stderr.strip() or probe.returncode}"
    return None

@pytest.fixture(scope="module")
def watched_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("dns-namespace")
    resolv = tmp / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.1\noptions attempts:1 timeout:1\n", encoding="ascii")
    reason = _namespace_unavailable(tmp)
    if reason:
        pytest.skip(reason)
    out = tmp / "result.json"
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", QTWEBENGINE_DISABLE_SANDBOX="1")
    env.pop("QTWEBENGINE_CHROMIUM_FLAGS", None)  # the child sets the app's own switches, nothing inherited
    child = subprocess.run(_unshare(resolv, sys.executable, str(Path(__file__).resolve()), "--child", str(out)),
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0 and out.exists(), child.stderr[-4000:]
    result = json.loads(out.read_text(encoding="utf-8"))
    if not result["sanity"]["dns"]:
        # glibc went elsewhere (an nsswitch module such as systemd-resolved over D-Bus): look-ups cannot be watched
        # here, and a silent listener would prove nothing.
        pytest.skip("the system resolver here does not use /etc/resolv.conf: look-ups cannot be watched")
    return result

@pytest.mark.webengine
def test_the_watchers_see_a_leak_when_there_is_one(watched_run: dict) -> None:
    # Without this, "nothing seen" below would prove nothing.
    assert watched_run["sanity"] == {"dns": True, "mdns": True, "out": True}
    before = watched_run["before_preview"]
    assert f"sanity-{watched_run['token']}.example" in before["names"]
    assert before["mdns"] >= 1 and f"udp {BEYOND}" in before["frames"]

@pytest.mark.webengine
def test_no_name_is_resolved_and_nothing_leaves(watched_run: dict) -> None:
    during = watched_run["during_preview"]
    assert during["names"] == [], f"names sent to the resolver: {during['names']}"
    assert during["mdns"] == 0, "the engine announced itself over mDNS"
    assert during["frames"] == [], f"packets that would have left the machine: {during['frames']}"

@pytest.mark.webengine
def test_webrtc_is_absent_in_every_frame_and_listed(watched_run: dict) -> None:
    assert watched_run["guarded_tried"]
    assert watched_run["guarded_types"] == {"main": "undefined", "parsed": "undefined", "blank": "undefined",
                                            "srcdoc": "undefined"}
    assert any("blocked WebRTC (RTCPeerConnection)" in t for t in watched_run["blocked"])

@pytest.mark.webengine
def test_the_engine_switches_alone_stop_real_webrtc(watched_run: dict) -> None:
    assert watched_run["unguarded_type"] == "function"  # the guard really was gone
    assert watched_run["unguarded_started"] and watched_run["unguarded_gathered"]
    assert watched_run["candidates"] == []  # no host candidate (so no mDNS name), no srflx, no relay


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2]))
    sys.exit("usage: test_preview_hostile_dns.py --child OUT.json (run by the test, inside the namespace)")
