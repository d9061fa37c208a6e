"""``clover-desk generate`` without ``--json``: the model's text reaches the terminal, its control bytes never do."""

from __future__ import annotations

import io

from clover_desk.cli.generate import _Printer, visible_text


def test_control_bytes_are_shown_escaped() -> None:
    # an ESC sequence that would recolour / retitle the terminal, a bell, a carriage return, DEL, a C1 CSI
    text = "ok\x1b[2J\x1b]0;owned\x07\rline\x7f\x9b31m"
    assert visible_text(text) == "ok\\x1b[2J\\x1b]0;owned\\x07\\x0dline\\x7f\\x9b31m"
    assert visible_text("tab\tnewline\nUnicode: é, 漢字, 😀") == "tab\tnewline\nUnicode: é, 漢字, 😀"


def test_the_printer_writes_escaped_text() -> None:
    out = io.StringIO()  # not a terminal: channels are prefixed, and the answer is escaped
    printer = _Printer(out)
    printer.delta("think\x1b[31m", "thinking")
    printer.delta("answer\x07", "answer")
    printer.end()
    written = out.getvalue()
    assert "\x1b" not in written and "\x07" not in written
    assert "think\\x1b[31m" in written and "answer\\x07" in written
