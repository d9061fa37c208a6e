"""Help ▸ Check this machine's GPU (``ui/gpu_check.py``): the real ``clover-desk doctor --json`` in a child process,
shown in the dialog; a check that prints something else, fails to start, or hangs, said as such; the menu entry."""

from __future__ import annotations

import pytest

from clover_desk.qt_compat import guard_pyside_bool_refcounts
from clover_desk.ui.gpu_check import GpuCheckDialog, summarize

guard_pyside_bool_refcounts()


def run_check(qtbot, dialog: GpuCheckDialog, timeout_ms: int = 120_000) -> bool:
    with qtbot.waitSignal(dialog.checked, timeout=timeout_ms) as blocker:
        dialog.start()
    return bool(blocker.args[0])


def test_the_dialog_shows_what_the_doctor_finds(qtbot) -> None:
    dialog = GpuCheckDialog()
    qtbot.addWidget(dialog)
    ok = run_check(qtbot, dialog)
    report = dialog.report.toPlainText()
    assert report.startswith("torch ") and "bitsandbytes" in report and "opt-in paths" in report
    findings = dialog.findings.toPlainText()
    if ok:  # this machine: no GPU, so an INFO line saying the engine runs on the CPU
        assert "INFO" in findings or "OK" in findings
        assert dialog.headline.text().startswith("No problem")
    else:
        assert "ERROR" in findings and "to fix" in dialog.headline.text()
    assert dialog.again_button.isEnabled() and not dialog.is_running()


def test_the_opt_in_switches_reach_the_dialog(qtbot, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOVER_DESK_ZERO_COPY", "1")
    monkeypatch.setenv("CLOVER_DESK_DEVICE_POOL", "1")
    dialog = GpuCheckDialog()
    qtbot.addWidget(dialog)
    assert run_check(qtbot, dialog) is False
    assert "exclude each other" in dialog.findings.toPlainText() and "#c62828" in dialog.findings.toHtml()
    assert dialog.headline.text().startswith("1 problem to fix")
    assert "refused: CLOVER_DESK_ZERO_COPY and CLOVER_DESK_DEVICE_POOL exclude each other" in dialog.report.toPlainText()


@pytest.mark.parametrize("script,said", [
    ("print('not json')", "its output is not JSON"),
    ("print('{\"facts\": {}}')", "the check printed no findings"),
    ("import sys; sys.stderr.write('Traceback: boom\\n'); sys.exit(3)", "its output is not JSON"),
])
def test_a_check_that_does_not_report_is_said_to(qtbot, script: str, said: str) -> None:
    dialog = GpuCheckDialog(args=["-c", script])
    qtbot.addWidget(dialog)
    assert run_check(qtbot, dialog, 30_000) is False
    assert said in dialog.headline.text()
    if "boom" in script:
        assert "boom" in dialog.report.toPlainText()  # what the child said last


def test_a_check_that_cannot_start_or_hangs_is_stopped(qtbot, tmp_path) -> None:
    missing = GpuCheckDialog(python=str(tmp_path / "no-such-python"))
    qtbot.addWidget(missing)
    assert run_check(qtbot, missing, 30_000) is False
    assert missing.headline.text().startswith("Could not start")
    hung = GpuCheckDialog(args=["-c", "import time; time.sleep(60)"], timeout_s=1.0)
    qtbot.addWidget(hung)
    assert run_check(qtbot, hung, 30_000) is False
    assert hung.headline.text() == "The check did not answer within 1 s and was stopped" and not hung.is_running()


def test_closing_while_checking_stops_the_child(qtbot) -> None:
    dialog = GpuCheckDialog(args=["-c", "import time; time.sleep(60)"])
    qtbot.addWidget(dialog)
    dialog.start()
    assert dialog.is_running()
    dialog.reject()
    assert not dialog.is_running()


def test_summarize_counts_errors_and_warnings() -> None:
    data = {"findings": [{"level": "warning", "key": "opt-in", "message": "x"},
                         {"level": "ok", "key": "torch", "message": "y"}], "report": ["torch  1", ""]}
    assert summarize(data) == ("No problem that stops the engine; 1 warning (below)", ["torch  1"],
                               [("warning", "opt-in: x"), ("ok", "torch: y")])
    with pytest.raises(ValueError, match="without level"):
        summarize({"findings": [{"level": "error"}]})


def test_the_help_menu_opens_the_check(qtbot, tmp_path) -> None:
    from fakes_ui import FakeEngineClient

    from clover_desk.storage.recorder import StreamRecorder
    from clover_desk.storage.store import ChatStore
    from clover_desk.ui.main_window import MainWindow

    store = ChatStore(tmp_path / "chats.sqlite3")
    try:
        client = FakeEngineClient()
        client.set_env({"CLOVER_DESK_FUSED_MOE": "1", "CLOVER_DESK_FLA_GDN": "0"})  # the GPU paths chosen
        window = MainWindow(client, store, StreamRecorder, model_dir="/models/tiny")
        qtbot.addWidget(window)
        window.show()
        assert window.menus.gpu_check_action in window.menus.by_name["Help"].actions()
        window.menus.gpu_check_action.trigger()
        dialog = window.menus.gpu_check_dialog
        assert dialog is not None and dialog.isVisible()
        with qtbot.waitSignal(dialog.checked, timeout=120_000):
            pass
        assert dialog.report.toPlainText().startswith("torch ")
        assert "opt-in paths   CLOVER_DESK_FUSED_MOE (of" in dialog.report.toPlainText()  # the engine's switches
        window.menus.gpu_check_action.trigger()  # reopened: the same dialog, its last result kept
        assert window.menus.gpu_check_dialog is dialog and dialog.report.toPlainText().startswith("torch ")
        dialog.close()
    finally:
        store.close()
