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
