"""The small widget helpers every panel builds with (ui.widgets): buttons made and wired in one place, one slot for
several signals, a row spread to both ends."""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QFormLayout, QHBoxLayout, QLabel, QLineEdit, QVBoxLayout, QWidget

from clover_desk.qt_compat import guard_pyside_bool_refcounts
from clover_desk.ui.widgets import WrapLabel, connect_each, hbox, push_button, spread_row, tool_button, vbox

guard_pyside_bool_refcounts()


class Edits(QObject):
    first = Signal(str)
    second = Signal(str)


def test_push_button_is_named_styled_and_set_before_it_is_wired(qtbot) -> None:  # noqa: ANN001
    clicks: list[str] = []
    toggles: list[bool] = []
    button = push_button("Think", "thinkToggle", style="chip", checked=True, tip="Think first", name="Think",
                         clicked=lambda: clicks.append("click"), toggled=lambda on: toggles.append(on))
    qtbot.addWidget(button)
    assert (button.objectName(), button.property("class"), button.toolTip(), button.accessibleName()) == (
        "thinkToggle", "chip", "Think first", "Think")
    assert button.isCheckable() and button.isChecked()
    assert toggles == []  # the initial state called nothing
    button.click()
    assert clicks == ["click"] and toggles == [False]


def test_a_plain_push_button_is_not_checkable(qtbot) -> None:  # noqa: ANN001
    button = push_button("Close")
    qtbot.addWidget(button)
    assert not button.isCheckable() and button.objectName() == "" and button.property("class") is None


def test_tool_button_is_checkable_when_it_toggles(qtbot) -> None:  # noqa: ANN001
    parent = QWidget()
    qtbot.addWidget(parent)
    shown: list[bool] = []
    reloads: list[str] = []
    source = tool_button(parent, "Source", "Show the source", toggled=lambda on: shown.append(on))
    reload = tool_button(parent, "Reload", "Load again", clicked=lambda: reloads.append("reload"))
    assert source.isCheckable() and not reload.isCheckable()
    assert (source.toolTip(), source.accessibleName()) == ("Show the source", "Show the source")
    source.click()
    reload.click()
    assert shown == [True] and reloads == ["reload"]


def test_connect_each_sends_every_signal_to_the_one_slot() -> None:
    edits = Edits()
    seen: list[str] = []
    connect_each(seen.append, edits.first, edits.second)
    edits.first.emit("a")
    edits.second.emit("b")
    assert seen == ["a", "b"]


def test_spread_row_puts_a_stretch_between_its_two_ends(qtbot) -> None:  # noqa: ANN001
    left, right = QLabel("left"), QLabel("right")
    row = spread_row(left, right)
    assert [row.itemAt(i).widget() for i in range(row.count())] == [left, None, right]
    assert row.stretch(1) == 1


def test_boxes_hold_their_items_in_order_with_stretch_margins_and_spacing(qtbot) -> None:  # noqa: ANN001
    host = QWidget()
    qtbot.addWidget(host)
    a, b, c = QLabel("a"), QLabel("b"), QLabel("c")
    row = hbox((a, 2), b, margins=(1, 2, 3, 4), spacing=5)
    column = vbox(row, (c, 1), spacing=7, parent=host)
    assert isinstance(row, QHBoxLayout) and isinstance(column, QVBoxLayout)
    assert host.layout() is column  # set on the parent
    assert [row.itemAt(i).widget() for i in range(row.count())] == [a, b]
    assert (row.stretch(0), row.stretch(1)) == (2, 0)
    m = row.contentsMargins()
    assert (m.left(), m.top(), m.right(), m.bottom(), row.spacing()) == (1, 2, 3, 4, 5)
    assert column.itemAt(0).layout() is row and column.itemAt(1).widget() is c and column.stretch(1) == 1
    m = column.contentsMargins()
    assert (m.left(), m.top(), m.right(), m.bottom(), column.spacing()) == (0, 0, 0, 0, 7)
    assert hbox().parent() is None


def test_a_wrapped_label_in_a_form_row_is_as_tall_as_its_lines(qtbot) -> None:  # noqa: ANN001
    """Two lines' worth of text in a form row 800 px wide: the label is as tall as those lines at that width, not
    the height of its narrow preferred width (a plain wrapped QLabel's several empty lines under the text)."""
    text = ("Partial offload: 25 of 40 expert layers on the card, 15 streamed from 7.34 GiB of RAM; 15.87 GiB of the "
            "15.88 GiB budget (the planner, the 35B shape at Q4_0's 4.5 bits a weight)<br>Disk: needs 19.6 GB, "
            "37.3 GB free there: fits.")
    form_widget = QWidget()
    qtbot.addWidget(form_widget)
    form = QFormLayout(form_widget)
    form.addRow("What", QLineEdit())
    label = WrapLabel(text)
    form.addRow("", label)
    form_widget.resize(800, 600)
    form_widget.show()
    qtbot.waitUntil(lambda: label.width() > 600, timeout=2000)
    qtbot.waitUntil(lambda: label.height() == label.heightForWidth(label.width()), timeout=2000)
    lines = label.height() / label.fontMetrics().lineSpacing()
    assert 2.5 <= lines <= 3.5  # three lines at this width (two of text, one after the break)
    label.setText("One short line.")
    qtbot.waitUntil(lambda: label.height() <= label.fontMetrics().lineSpacing() + 4, timeout=2000)
