"""The HTML preview (finding HTML in answers: test_html_extract.py): throttled reloads, big pages, the strip, save/open, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtGui import QImage

pytest.importorskip("PySide6.QtWebEngineWidgets", exc_type=ImportError)

from clover_desk.qt_compat import guard_pyside_bool_refcounts  # noqa: E402
from clover_desk.ui.preview import PreviewPane
from clover_desk.ui.preview_sandbox import (
    OFFLINE_CHROMIUM_FLAGS,
    PREVIEW_CSP,
    new_document_host,
    register_schemes,
    split_chromium_flags,
    with_offline_flags,
)

# Both must happen before pytest-qt creates the QApplication (test modules are imported at collection, before any
# test runs). The lead's conftest should do this in pytest_configure; doing it here too is harmless (idempotent).
guard_pyside_bool_refcounts()
register_schemes()

REPO = Path(__file__).resolve().parents[2]
LOAD_TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def pane(qapp):  # one QtWebEngine view for the whole module: starting Chromium is the slow part
    widget = PreviewPane(reload_interval_ms=200)
    widget.resize(900, 600)
    widget.show()
    yield widget
    delete_now(widget)


def delete_now(widget) -> None:
    """Destroy a pane while the QApplication is alive (a page outliving its profile makes Qt warn)."""
    from PySide6.QtCore import QCoreApplication, QEvent

    widget.close()
    widget.deleteLater()
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete.value)


def show(qtbot, pane: PreviewPane, html: str, document_id: str) -> None:
    with qtbot.waitSignal(pane.loadFinished, timeout=LOAD_TIMEOUT_MS) as blocker:
        pane.set_html(html, document_id)
        pane.flush()
    assert blocker.args == [True]


def js(qtbot, pane: PreviewPane, source: str):
    with qtbot.waitCallback(timeout=LOAD_TIMEOUT_MS) as callback:
        pane.page.runJavaScript(source, 0, callback)
    return callback.args[0]


def test_document_hosts_are_random_and_dns_safe() -> None:
    hosts = {new_document_host() for _ in range(200)}
    assert len(hosts) == 200  # never the same twice, never derived from anything
    assert all(h.isalnum() and h.islower() and h.startswith("d") and len(h) == 33 for h in hosts)


def test_offline_flags_are_merged_quoted_and_forced() -> None:
    user = '--disable-gpu "--host-resolver-rules=MAP * 127.0.0.1" --proxy-server=http://corp:3128 --lang=fr'
    merged = with_offline_flags(user)
    args = split_chromium_flags(merged)
    # The user's unrelated switches stay; ours replace any other value of the same switch.
    assert args[:2] == ["--disable-gpu", "--lang=fr"]
    assert args[2:] == list(OFFLINE_CHROMIUM_FLAGS)
    assert "--host-resolver-rules=MAP * ~NOTFOUND" in args and "--proxy-server=http://corp:3128" not in args
    assert '"--host-resolver-rules=MAP * ~NOTFOUND"' in merged  # quoted: QtWebEngine splits on spaces otherwise
    assert with_offline_flags(merged) == merged  # idempotent
    assert split_chromium_flags(with_offline_flags("")) == list(OFFLINE_CHROMIUM_FLAGS)


def test_the_engine_of_this_session_runs_offline() -> None:
    # conftest (like every entry point) calls register_schemes() before the QApplication: the switches are in force.
    args = split_chromium_flags(os.environ.get("QTWEBENGINE_CHROMIUM_FLAGS", ""))
    assert set(OFFLINE_CHROMIUM_FLAGS) <= set(args)


# ---- the widget (real QtWebEngine) -----------------------------------------------------------------------------


@pytest.mark.webengine
def test_renders_and_runs_script(qtbot, pane: PreviewPane) -> None:
    show(qtbot, pane, "<!DOCTYPE html><html><body><p id=p>x</p><script>p.textContent = 6 * 7</script></body></html>",
         "render")
    assert js(qtbot, pane, "document.getElementById('p').textContent") == "42"
    assert pane.page.url().scheme() == "clover-preview"
    assert pane.page.url().host() == pane.document_host("render")


@pytest.mark.webengine
def test_three_megabyte_page_renders(qtbot, pane: PreviewPane) -> None:
    # setHtml() would fail above 2 MB; the scheme handler has no such cap.
    rows = "".join(f"<tr><td>{i}</td><td>{'x' * 40}</td></tr>" for i in range(60_000))
    html = ("<!DOCTYPE html><html><body><table id=t>" + rows + "</table>"
            "<script>document.title = 'rows=' + document.querySelectorAll('#t tr').length</script></body></html>")
    assert len(html.encode()) > 3_000_000
    show(qtbot, pane, html, "big")
    assert js(qtbot, pane, "document.title") == "rows=60000"


@pytest.mark.webengine
def test_console_errors_reach_the_strip(qtbot, pane: PreviewPane) -> None:
    pane.strip.clear()
    html = ("<!DOCTYPE html><html><body><script>console.error('custom failure 17');"
            "console.warn('careful 23'); console.log('quiet');"
            "setTimeout(() => { undefinedFunctionCall(); }, 0);</script></body></html>")
    with qtbot.waitSignal(pane.stripEntryAdded, timeout=LOAD_TIMEOUT_MS,
                          check_params_cb=lambda kind, text: "undefinedFunctionCall" in text):
        pane.set_html(html, "console")
        pane.flush()
    kinds = {e.text.split(" (line")[0]: e.kind for e in pane.strip.entries}
    assert kinds["custom failure 17"] == "error"
    assert kinds["careful 23"] == "warning"
    assert not any("quiet" in e.text for e in pane.strip.entries)  # console.log is not an error, not shown
    assert any(e.kind == "error" and "undefinedFunctionCall is not defined" in e.text for e in pane.strip.entries)
    qtbot.waitUntil(lambda: pane.strip.list.count() == len(pane.strip.entries), timeout=2000)  # repainted through its throttle
    assert "errors" in pane.strip.label.text() and pane.strip.label.text() != "0 blocked · 0 errors · 0 warnings"


@pytest.mark.webengine
def test_streaming_updates_are_throttled_and_the_last_one_shown(qtbot, pane: PreviewPane) -> None:
    show(qtbot, pane, "<html><body>start</body></html>", "stream")
    before = pane.scheme_handler.served_count
    for i in range(40):  # 40 deltas arrive within a few ms
        pane.set_html(f"<html><body><p id=n>{i}</p></body></html>", "stream")
    with qtbot.waitSignal(pane.loadFinished, timeout=LOAD_TIMEOUT_MS):
        pane.flush()
    qtbot.waitUntil(lambda: js(qtbot, pane, "document.getElementById('n') && document.getElementById('n').textContent")
                    == "39", timeout=LOAD_TIMEOUT_MS)
    loads = pane.scheme_handler.served_count - before
    assert 1 <= loads <= 3, loads  # not 40 reloads


@pytest.mark.webengine
def test_source_toggle(qtbot, pane: PreviewPane) -> None:
    show(qtbot, pane, "<html><body><b>source me</b></body></html>", "source")
    pane.show_source(True)
    assert pane.stack.currentWidget() is pane.source
    assert pane.source.toPlainText() == "<html><body><b>source me</b></body></html>"
    assert pane.source_button.text() == "Preview"
    pane.show_source(False)
    assert pane.stack.currentWidget() is pane.view


@pytest.mark.webengine
def test_toolbar_fits_a_narrow_side_panel(qtbot) -> None:
    from PySide6.QtCore import QPoint, QRect

    narrow = PreviewPane()
    try:
        narrow.on_console_message("warning", "careful")
        buttons = (narrow.source_button, narrow.reload_button, narrow.save_button, narrow.open_button,
                   narrow.strip.clear_button)
        for width in (420, 700):  # the side panel's usual width, and a wide one
            narrow.setFixedSize(width, 320)
            narrow.show()
            narrow.layout().activate()
            for widget in (*buttons, narrow.strip.label):
                # never squeezed below its size hint (that is when Qt elides "Save as…" to "S……")
                assert widget.isVisible() and widget.width() >= widget.sizeHint().width(), (width, widget.text())
                assert narrow.rect().contains(QRect(widget.mapTo(narrow, QPoint(0, 0)), widget.size()))
        assert narrow.strip.label.text() == "0 blocked · 0 errors · 1 warning"
        assert all(b.toolTip() for b in buttons)  # the short labels are explained
        assert "browser" in narrow.open_button.toolTip() and "asks first" in narrow.open_button.toolTip()
    finally:
        delete_now(narrow)


@pytest.mark.webengine
def test_save_as_html(qtbot, pane: PreviewPane, tmp_path: Path) -> None:
    show(qtbot, pane, "<html><body>saved</body></html>", "save")
    with qtbot.waitSignal(pane.saved) as blocker:
        target = pane.save_to(tmp_path / "app")
    assert target == tmp_path / "app.html"
    assert blocker.args == [str(target)]
    assert target.read_text(encoding="utf-8") == "<html><body>saved</body></html>"


@pytest.mark.webengine
def test_open_in_browser_asks_first(qtbot, pane: PreviewPane, monkeypatch, tmp_path: Path) -> None:
    from PySide6.QtWidgets import QMessageBox

    opened: list[str] = []
    monkeypatch.setattr("clover_desk.ui.preview.QDesktopServices.openUrl", lambda url: opened.append(url.toLocalFile()) or True)
    monkeypatch.setattr("clover_desk.ui.preview.tempfile.gettempdir", lambda: str(tmp_path))
    show(qtbot, pane, "<html><body>outside</body></html>", "browser")

    monkeypatch.setattr("clover_desk.ui.preview.QMessageBox.question", lambda *a, **k: QMessageBox.StandardButton.Cancel)
    assert pane.open_in_browser() is False
    assert opened == []

    monkeypatch.setattr("clover_desk.ui.preview.QMessageBox.question", lambda *a, **k: QMessageBox.StandardButton.Open)
    assert pane.open_in_browser() is True
    assert len(opened) == 1
    assert Path(opened[0]).read_text(encoding="utf-8") == "<html><body>outside</body></html>"


def test_csp_is_offline() -> None:
    directives = dict(d.strip().split(" ", 1) for d in PREVIEW_CSP.split(";"))
    assert directives["default-src"] == "'none'"
    assert directives["connect-src"] == "'none'"
    assert directives["frame-src"] == "'none'"
    assert directives["form-action"] == "'none'"
    assert "http" not in PREVIEW_CSP and "*" not in PREVIEW_CSP


# ---- clover-desk preview ---------------------------------------------------------------------------------------

CALCULATOR = """<!DOCTYPE html><html><head><meta charset="utf-8"><title>Calculator</title><style>
body{margin:0;height:100vh;display:flex;align-items:center;justify-content:center;background:#1e2230;font-family:sans-serif}
.c{background:#2b3042;padding:16px;border-radius:12px}#d{background:#11141d;color:#7cffb2;font-size:30px;
text-align:right;padding:8px;border-radius:6px;margin-bottom:10px;width:240px}.g{display:grid;
grid-template-columns:repeat(4,56px);gap:8px}button{height:52px;font-size:20px;border:0;border-radius:8px;
background:#3c4360;color:#fff}.op{background:#ff9f43}</style></head><body><div class="c"><div id="d">0</div>
<div class="g" id="g"></div></div><script>
let e = ""; const d = document.getElementById("d");
for (const k of "789/456*123-0.C+=") { const b = document.createElement("button"); b.textContent = k;
  if ("+-*/=".includes(k)) b.className = "op";
  b.onclick = () => { e = k === "C" ? "" : k === "=" ? String(Function("return (" + e + ")")()) : e + k;
                      d.textContent = e || "0"; };
  document.getElementById("g").appendChild(b); }
d.textContent = "12*7 = " + Function("return (12*7)")();
</script></body></html>"""


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    return subprocess.run([sys.executable, "-m", "clover_desk.cli.main", "preview", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def _screenshot(tmp_path: Path, html: str, wait_ms: int, size: str) -> tuple[subprocess.CompletedProcess, QImage]:
    """``clover-desk preview PAGE --screenshot`` of ``html``: the finished command and the picture it saved."""
    page = tmp_path / "page.html"
    page.write_text(html, encoding="utf-8")
    out = tmp_path / "page.png"
    result = _run_cli(str(page), "--screenshot", str(out), "--wait-ms", str(wait_ms), "--size", size)
    assert result.returncode == 0, result.stderr
    return result, QImage(str(out))


@pytest.mark.webengine
def test_cli_screenshot(tmp_path: Path) -> None:
    _, image = _screenshot(tmp_path, CALCULATOR, 200, "800x600")
    assert (image.width(), image.height()) == (800, 600)
    # The page background (#1e2230) fills the middle-left of the view: the page really rendered.
    assert image.pixelColor(40, 300).name() == "#1e2230"
    colours = {image.pixelColor(x, y).name() for x in range(0, 800, 20) for y in range(40, 560, 20)}
    assert len(colours) > 5  # buttons, display, text: not a blank grab


SPA = """<!DOCTYPE html><html><head><style>body{margin:0;background:#204060}</style></head><body>
<div id=app style="color:#fff;font-size:40px">loading</div><script>
// What routers do while the page loads: a hash route, then the history API (path, query and fragment change).
location.hash = '#/home';
history.replaceState({route: 'home'}, '', '/app/home?tab=1#top');
history.pushState({route: 'next'}, '', '/app/next');
document.getElementById('app').textContent = 'routed';
</script></body></html>"""


@pytest.mark.webengine
def test_cli_screenshot_of_a_single_page_app(tmp_path: Path) -> None:
    """A page that changes its own URL while it loads is still "loaded" (it used to time out after 60 s)."""
    result, image = _screenshot(tmp_path, SPA, 300, "400x300")
    assert "did not finish loading" not in result.stderr
    assert image.pixelColor(200, 120).name() == "#204060"  # the page's own background: it rendered


@pytest.mark.webengine
def test_cli_lists_a_jump_to_about_blank_and_shows_the_page(tmp_path: Path) -> None:
    result, image = _screenshot(tmp_path, """<!DOCTYPE html><html><body style="background:#604020"><script>
    if (window.name !== 'left') { window.name = 'left'; location = 'about:blank'; }
    </script></body></html>""", 300, "400x300")
    assert "blocked navigation to about:blank" in result.stderr  # listed (as a warning), not silent
    assert image.pixelColor(200, 120).name() == "#604020"  # and the document was put back


def test_cli_missing_file_is_exit_2(tmp_path: Path) -> None:
    result = _run_cli(str(tmp_path / "absent.html"))
    assert result.returncode == 2
    assert "cannot read" in result.stderr and "absent.html" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.webengine
def test_a_crashed_renderer_is_reported_and_reload_brings_the_page_back(qtbot, pane: PreviewPane) -> None:
    """Killing the page's renderer process never takes the app down: the strip says so and Reload recovers."""
    import signal

    show(qtbot, pane, "<!DOCTYPE html><html><body><p id=p>alive</p></body></html>", "crash")
    pid = pane.page.renderProcessPid()
    assert pid > 0
    with qtbot.waitSignal(pane.page.renderProcessTerminated, timeout=20_000):
        os.kill(pid, signal.SIGKILL)
    qtbot.waitUntil(lambda: any("renderer stopped" in e.text for e in pane.strip.entries if e.kind == "error"), timeout=5000)
    with qtbot.waitSignal(pane.loadFinished, timeout=20_000):
        pane.reload_button.click()
    assert js(qtbot, pane, "document.getElementById('p').textContent") == "alive"
    assert pane.page.renderProcessPid() not in (0, pid)


def test_save_page_starts_in_documents_then_in_the_last_folder(qtbot, pane, tmp_path, monkeypatch) -> None:
    """Before: "Save page as" opened in the working directory (wherever the app was started from)."""
    import clover_desk.ui.preview as preview_module

    starts: list[str] = []
    answers = [str(tmp_path / "elsewhere" / "app.html")]

    def fake_dialog(_parent, start: str) -> str:  # noqa: ANN001
        starts.append(start)
        return answers.pop(0) if answers else ""

    monkeypatch.setattr(preview_module, "ask_page_path", fake_dialog)
    monkeypatch.setattr(preview_module, "documents_dir", lambda: tmp_path / "Documents")
    (tmp_path / "elsewhere").mkdir()
    pane.save_dir = None
    show(qtbot, pane, "<html><body><p>saved</p></body></html>", "save-doc")
    pane.save_button.click()
    assert starts == [str(tmp_path / "Documents" / "page.html")]
    assert "saved" in (tmp_path / "elsewhere" / "app.html").read_text(encoding="utf-8")
    pane.save_button.click()  # cancelled this time: the folder stays
    assert starts[1] == str(tmp_path / "elsewhere" / "page.html") and pane.save_dir == tmp_path / "elsewhere"
