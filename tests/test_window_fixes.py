"""The window's bugs of issue 32 (part A), each through the real widgets with pytest-qt: links in message text,
the mouse wheel over unfocused choosers, and the small ones (labels, shortcuts, dialogs, elided status texts)."""

from __future__ import annotations

from ui.chat_view import ChatView, MessageData


def _anchors(browser) -> list[tuple[str, str]]:  # noqa: ANN001
    """(text, href) of each link in a QTextBrowser's document."""
    found: list[tuple[str, str]] = []
    block = browser.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fragment = it.fragment()
            if fragment.charFormat().isAnchor():
                found.append((fragment.text(), fragment.charFormat().anchorHref()))
            it += 1
        block = block.next()
    return found


def test_links_in_user_and_model_text_keep_the_text_around_them(qtbot) -> None:
    """Before: `link "http://example.com/a" then x` showed `"http://example.com/a&quot; then x` with `&quot` in the
    link target, and a URL before `</html>` showed a literal `&gt;`."""
    view = ChatView()
    qtbot.addWidget(view)
    text = 'link "http://example.com/a" then x; page at http://example.com/p</html> and http://x.org/?a=1&b=2.'
    user = view.add_message(MessageData(role="user", content=text))
    model = view.add_message(MessageData(role="assistant", content=text))
    for widget in (user, model):
        shown = widget.body.toPlainText()
        assert shown == text, shown
        assert _anchors(widget.body) == [("http://example.com/a", "http://example.com/a"),
                                         ("http://example.com/p", "http://example.com/p"),
                                         ("http://x.org/?a=1&b=2", "http://x.org/?a=1&b=2")]


def _wheel(widget, steps: int = -1) -> None:  # noqa: ANN001
    """One real wheel notch over ``widget``'s centre, delivered as Qt delivers it (through the application)."""
    from PySide6.QtCore import QPoint, QPointF, Qt
    from PySide6.QtGui import QWheelEvent
    from PySide6.QtWidgets import QApplication

    centre = QPointF(widget.rect().center())
    event = QWheelEvent(centre, QPointF(widget.mapToGlobal(centre.toPoint())), QPoint(0, 0), QPoint(0, 120 * steps),
                        Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase, False)
    QApplication.sendEvent(widget, event)


def test_the_wheel_leaves_unfocused_choosers_alone_on_the_models_page(qtbot, tmp_path) -> None:
    """Before: scrolling the models page changed the download choice when the pointer passed over "What"."""
    from PySide6.QtWidgets import QDoubleSpinBox

    from clover_desk.app import AppSettings, CloverDeskApp
    from fakes_ui import FakeEngineClient

    desk = CloverDeskApp(tmp_path, client=FakeEngineClient(), settings=AppSettings(), with_preview=False)
    qtbot.addWidget(desk.window)
    desk.window.resize(1000, 500)
    desk.window.show()
    desk.window.show_models_page()
    combo = desk.model_manager.download_choice
    assert combo.count() > 1
    combo.setCurrentIndex(0)
    page = desk.window.pages.currentWidget()
    page.verticalScrollBar().setValue(0)
    desk.window.sidebar.setFocus()
    _wheel(combo)
    assert combo.currentIndex() == 0  # the choice stays
    assert page.verticalScrollBar().value() > 0  # the page scrolled instead
    combo.setFocus()
    qtbot.waitUntil(combo.hasFocus)
    _wheel(combo)
    assert combo.currentIndex() == 1  # focused on purpose: the wheel picks
    spin = QDoubleSpinBox(desk.window.drawer)  # any spin box in the app
    spin.setValue(1.0)
    _wheel(spin, steps=1)
    assert spin.value() == 1.0
    desk.shutdown()
