"""Help ▸ Check this machine's GPU: what ``clover-desk doctor`` finds, in the window.

The check imports torch, so it runs in a child process (``QProcess``: the UI never imports torch), as
``python -m clover_desk.cli.main doctor --json``; the packaged app's launcher runs ``-m`` the same way. Its JSON carries
the facts (torch and its CUDA build, the GPU, the driver, bitsandbytes, the opt-in GPU switches) as the CLI prints
them (``report``) and the findings, one line each, errors first: what is wrong and what to install. The dialog
shows both, says whether anything is wrong, and offers to run the check again. A check that does not answer within
``timeout_s`` is stopped and said to be; an output that is not the expected JSON is shown as what it is.
"""

from __future__ import annotations

import html
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from PySide6.QtCore import QProcess, QProcessEnvironment, Qt, QTimer, Signal
from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

DOCTOR_ARGS = ("-m", "clover_desk.cli.main", "doctor", "--json")
TIMEOUT_S = 120  # importing torch and probing CUDA takes seconds; a first import after install can take a minute
LEVEL_COLORS = {"error": "#c62828", "warning": "#b26a00", "info": "", "ok": "#2e7d32"}


def summarize(data: Any) -> tuple[str, list[str], list[tuple[str, str]]]:
    """(headline, report lines, [(level, line)]) from ``doctor --json`` output, or raise ValueError saying what is
    missing from it."""
    if not isinstance(data, dict) or not isinstance(data.get("findings"), list):
        raise ValueError("the check printed no findings")
    report = [str(line) for line in data.get("report", []) if str(line).strip()]
    findings: list[tuple[str, str]] = []
    for f in data["findings"]:
        if not isinstance(f, dict) or not {"level", "key", "message"} <= set(f):
            raise ValueError(f"the check printed a finding without level, key and message: {f!r}"[:200])
        findings.append((str(f["level"]), f"{f['key']}: {f['message']}"))
    errors = sum(level == "error" for level, _ in findings)
    warnings = sum(level == "warning" for level, _ in findings)
    if errors:
        headline = f"{errors} problem{'s' if errors > 1 else ''} to fix before the engine can use the GPU (below)"
    elif warnings:
        headline = f"No problem that stops the engine; {warnings} warning{'s' if warnings > 1 else ''} (below)"
    else:
        headline = "No problem found"
    return headline, report, findings


class GpuCheckDialog(QDialog):
    """Runs the check when shown (and on "Check again"); ``checked`` says how it ended: True when it ran and found no
    error, False otherwise (an error found, or the check itself failed)."""

    checked = Signal(bool)

    def __init__(self, parent: QWidget | None = None, *, python: str = sys.executable,
                 args: Sequence[str] = DOCTOR_ARGS, timeout_s: float = TIMEOUT_S,
                 env: Callable[[], Mapping[str, str]] | None = None) -> None:
        """``env``: the extra environment of each check (the engine's: the GPU paths chosen in the window), asked
        for when the check starts."""
        super().__init__(parent)
        self._env = env
        self.setObjectName("gpuCheckDialog")
        self.setWindowTitle("Check this machine's GPU")
        self._python, self._args, self._timeout_ms = python, list(args), int(timeout_s * 1000)
        self._process: QProcess | None = None
        self._out = b""
        self.headline = QLabel("")
        self.headline.setObjectName("gpuCheckHeadline")
        self.headline.setWordWrap(True)
        self.headline.setTextFormat(Qt.TextFormat.PlainText)
        self.report = QPlainTextEdit()
        self.report.setObjectName("gpuCheckReport")
        self.report.setReadOnly(True)
        self.report.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.report.setMinimumWidth(720)
        self.report.setFixedHeight(self.report.fontMetrics().lineSpacing() * 8)  # the facts: five or six lines
        self.report.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.findings = QTextBrowser()  # what to act on, errors first
        self.findings.setObjectName("gpuCheckFindings")
        self.findings.setOpenLinks(False)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        self.again_button = QPushButton("Check &again")
        buttons.addButton(self.again_button, QDialogButtonBox.ButtonRole.ActionRole)
        buttons.rejected.connect(self.reject)
        self.again_button.clicked.connect(self.start)
        layout = QVBoxLayout(self)
        layout.addWidget(self.headline)
        layout.addWidget(self.findings, 1)
        layout.addWidget(QLabel("What was found:"))
        layout.addWidget(self.report)
        layout.addWidget(buttons)
        self.resize(760, 440)
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self._on_timeout)

    def start(self) -> None:
        """Run the check (nothing if one is running)."""
        if self._process is not None:
            return
        self._out = b""
        self.headline.setText("Checking… (the check imports torch and asks the driver: a few seconds)")
        self.report.setPlainText("")
        self.findings.setHtml("")
        self.again_button.setEnabled(False)
        process = QProcess(self)
        if self._env is not None:
            environment = QProcessEnvironment.systemEnvironment()
            for key, value in self._env().items():
                environment.insert(key, value)
            process.setProcessEnvironment(environment)
        process.setProgram(self._python)
        process.setArguments(self._args)
        process.readyReadStandardOutput.connect(self._on_output)
        process.finished.connect(self._on_finished)
        process.errorOccurred.connect(self._on_error)
        self._process = process
        self._timer.start(self._timeout_ms)
        process.start()

    def showEvent(self, event: Any) -> None:  # noqa: N802
        super().showEvent(event)
        if self._process is None and not self.report.toPlainText():
            self.start()

    def is_running(self) -> bool:
        return self._process is not None

    def _on_output(self) -> None:
        if self._process is not None:
            self._out += bytes(self._process.readAllStandardOutput().data())

    def _end(self, headline: str, report: str, findings: list[tuple[str, str]], ok: bool) -> None:
        self._timer.stop()
        process, self._process = self._process, None
        if process is not None:
            process.deleteLater()
        self.headline.setText(headline)
        self.report.setPlainText(report)
        rows = []
        for level, line in findings:
            color = LEVEL_COLORS.get(level, "")
            style = f' style="color:{color}"' if color else ""
            rows.append(f"<p{style}><b>{html.escape(level.upper())}</b> {html.escape(line)}</p>")
        self.findings.setHtml("".join(rows))
        self.again_button.setEnabled(True)
        self.checked.emit(ok)

    def _on_finished(self, exit_code: int, exit_status: QProcess.ExitStatus) -> None:
        if self._process is None:
            return
        self._on_output()
        err = bytes(self._process.readAllStandardError().data()).decode(errors="replace").strip()
        text = self._out.decode(errors="replace").strip()
        if exit_status != QProcess.ExitStatus.NormalExit:
            self._end("The check stopped before it finished", err[-2000:], [], False)
            return
        try:
            headline, report, findings = summarize(json.loads(text.splitlines()[-1] if text else ""))
        except ValueError as exc:  # (json.JSONDecodeError is a ValueError)
            last = (err or text).splitlines()[-1] if (err or text) else f"exit code {exit_code}"
            self._end(f"The check did not report: {exc if 'check' in str(exc) else 'its output is not JSON'}",
                      f"{last}", [], False)
            return
        self._end(headline, "\n".join(report), findings, not any(level == "error" for level, _ in findings))

    def _on_error(self, error: QProcess.ProcessError) -> None:
        if error == QProcess.ProcessError.FailedToStart and self._process is not None:
            self._end(f"Could not start {self._python}: {error.name}", "", [], False)

    def _kill(self) -> None:
        """Stop the running child without reporting its end."""
        if self._process is not None:
            self._process.finished.disconnect(self._on_finished)
            self._process.kill()
            self._process.waitForFinished(2000)

    def _on_timeout(self) -> None:
        if self._process is None:
            return
        self._kill()
        self._end(f"The check did not answer within {self._timeout_ms / 1000:g} s and was stopped", "", [], False)

    def done(self, result: int) -> None:  # closing while a check runs stops it
        if self._process is not None:
            self._timer.stop()
            self._kill()
            self._process = None
        super().done(result)
