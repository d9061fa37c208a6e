"""Chat rendering: the Markdown renderer, message widgets (thinking, copy, preview, edit, regenerate), streaming."""

from __future__ import annotations

import re

from PySide6.QtCore import QUrl
from PySide6.QtGui import QGuiApplication

from clover_desk.qt_compat import guard_pyside_bool_refcounts  # noqa: E402
from clover_desk.ui.chat_view import (
    ChatView,
    HtmlWatch,
    MessageData,
    PreviewRequest,
    StreamingReply,
    preview_document_id,
    stats_details,
    stats_line,
)
from clover_desk.ui.html_extract import extract_html
from clover_desk.ui.markdown import inline, render

# PySide6 6.12 on CPython < 3.12 drops a reference to None/True on every void call or emit (see there);
# without this the process aborts after some thousands of paints. Must run before the first widget exists.
guard_pyside_bool_refcounts()

HTML_ANSWER = "Here is a page:\n\n```html\n<!DOCTYPE html>\n<html><body><h1>Hi</h1></body></html>\n```\n"


# ------------------------------------------------------------------------------------------- markdown


def test_markdown_blocks_and_inline() -> None:
    r = render("# Title\n\nSome **bold**, *it*, ~~old~~ and `x<y`.\n\n- a\n- b\n\n1. one\n2. two\n\n---\n\n> quoted")
    assert "<h2>Title</h2>" in r.html
    assert "<b>bold</b>" in r.html and "<i>it</i>" in r.html and "<s>old</s>" in r.html
    assert "x&lt;y</code>" in r.html.replace("&nbsp;", "")
    assert r.html.count("<li>") == 4 and "<ol" in r.html and "<ul" in r.html
    assert "<hr/>" in r.html and "quoted" in r.html


def test_markdown_escapes_raw_html_and_unsafe_links() -> None:
    r = render("<script>alert(1)</script> [ok](https://example.org) [bad](javascript:alert(1))")
    assert "<script>" not in r.html and "&lt;script&gt;" in r.html
    assert 'href="https://example.org"' in r.html
    assert "javascript:" not in r.html.split("bad")[0] and 'href="javascript' not in r.html


def test_fenced_code_gets_copy_and_preview_links() -> None:
    r = render("```python\nprint('<b>')\n```\n\ntext\n\n" + HTML_ANSWER.split("\n\n", 1)[1])
    assert [b.lang for b in r.code_blocks] == ["python", "html"]
    assert r.code_blocks[0].code == "print('<b>')"
    assert 'href="copy:0"' in r.html and 'href="copy:1"' in r.html
    assert 'href="preview:1"' in r.html and 'href="preview:0"' not in r.html
    uncoloured = re.sub(r'<span style="color: #[0-9a-f]{6};">|</span>', "", r.html)  # ui.highlight's spans
    assert "print(&#x27;&lt;b&gt;&#x27;)" in uncoloured


def test_unclosed_fence_while_streaming() -> None:
    r = render("Start\n```js\nlet a = 1;")
    assert len(r.code_blocks) == 1 and not r.code_blocks[0].closed
    assert "let a = 1;" in r.html


def test_table_and_autolink() -> None:
    r = render("| a | b |\n|---|--:|\n| 1 | 2 |\n\nsee https://example.org.")
    assert "<table" in r.html and '<td align="right">2</td>' in r.html
    assert 'href="https://example.org"' in inline("see https://example.org.")


# ------------------------------------------------------------------------------------------- plain state


def test_streaming_reply_tracks_channels_and_thinking_time() -> None:
    now = [99.0]
    reply = StreamingReply(clock=lambda: now[0])  # the request starts at 99.0
    now[0] = 100.0
    reply.add("let me think", "thinking")  # first thinking block committed a second later: thinking began at 99.0
    now[0] = 101.5
    reply.add("Answer", "answer")
    reply.add(" more", "answer")
    assert reply.thinking_seconds() == 2.5 and not reply.is_thinking
    reply.add("!", "answer")
    assert (reply.answer, reply.thinking) == ("Answer more!", "let me think")


def test_stats_line() -> None:
    line = stats_line({"tokens": 64, "tokens_per_s": 40.0, "tokens_per_pass": 4.0, "stop_reason": "cancelled"})
    assert line == "64 tokens · 40.0 tok/s · 4.0 tok/pass · stopped"


def test_stats_details_say_how_the_prompt_was_read() -> None:
    stats = {"mode": "diffusion", "tokens": 262, "passes": 53, "decode_s": 6.8, "prompt_tokens": 2050,
             "cached_tokens": 1984, "prefill_s": 0.16, "expert_hit_rate": 0.874}
    assert stats_details(stats) == ("prompt: 2,050 tokens, 1,984 of them already read (the prompt cache); the rest "
                                    "read in 0.16 s\nanswer: 262 tokens in 53 passes, 6.80 s\nexperts found on the "
                                    "GPU: 87%")
    fresh = {**stats, "cached_tokens": 0, "mode": "ar", "expert_hit_rate": None}
    assert stats_details(fresh) == "prompt: 2,050 tokens; read in 0.16 s\nanswer: 262 tokens in 53 steps, 6.80 s"
    assert stats_details({"backend": "remote", "tokens": 3}) == "" and stats_details({}) == ""


# ------------------------------------------------------------------------------------------- widgets


def shown(widget) -> bool:
    """Visible once its window is shown (widgets added to a shown window are shown on the next event-loop turn)."""
    return widget.isVisibleTo(widget.window())


def make_view(qtbot) -> ChatView:
    view = ChatView()
    qtbot.addWidget(view)
    view.resize(700, 600)
    view.show()
    return view


def test_thinking_is_collapsible_with_duration(qtbot) -> None:
    view = make_view(qtbot)
    w = view.add_message(MessageData("assistant", "The answer.", "step one\nstep two", 3.25,
                                     stats={"tokens": 10}))
    assert shown(w.thinking_toggle) and w.thinking_toggle.text() == "Thought for 3.2 s"
    assert not shown(w.thinking_body)
    w.thinking_toggle.click()
    assert shown(w.thinking_body) and "step two" in w.thinking_body.toPlainText()
    w.thinking_toggle.click()
    assert not shown(w.thinking_body)
    plain = view.add_message(MessageData("assistant", "No thoughts."))
    assert not shown(plain.thinking_toggle)
    view.set_expand_thinking(True)  # the "show thinking expanded" preference
    assert shown(w.thinking_body)
    later = view.add_message(MessageData("assistant", "Again.", "more thoughts", 1.0))
    assert shown(later.thinking_body) and "more thoughts" in later.thinking_body.toPlainText()


def test_an_answer_that_ended_while_thinking_says_why_it_is_empty(qtbot) -> None:
    """An empty answer after thinking (a small token limit spent on the thinking alone) shows why and what to
    change, by stop reason; never under an answer, while streaming, or after an error."""
    view = make_view(qtbot)
    limit = view.add_message(MessageData("assistant", "", "so many steps", 20.0,
                                         stats={"tokens": 256, "stop_reason": "max_new_tokens"}))
    assert shown(limit.note) and shown(limit.thinking_toggle) and not shown(limit.body)
    assert "token limit ran out while Clover was still thinking" in limit.note.text()
    assert "Max tokens" in limit.note.text() and "Think off" in limit.note.text()
    full = view.add_message(MessageData("assistant", " \n", "steps", 1.0, stats={"stop_reason": "context"}))
    assert shown(full.note) and "context filled up" in full.note.text()
    stopped = view.add_message(MessageData("assistant", "", "steps", 1.0, status="stopped",
                                           stats={"stop_reason": "cancelled"}))
    assert shown(stopped.note) and stopped.note.text().startswith("Stopped while Clover was still thinking")
    ended = view.add_message(MessageData("assistant", "", "steps", 1.0, stats={"stop_reason": "eos"}))
    assert shown(ended.note) and "without an answer" in ended.note.text()

    answered = view.add_message(MessageData("assistant", "The answer.", "steps", 1.0,
                                            stats={"stop_reason": "max_new_tokens"}))
    nothing = view.add_message(MessageData("assistant", "", "", None, stats={"stop_reason": "eos"}))
    streaming = view.add_message(MessageData("assistant", "", "steps so far", 1.0, status="streaming"))
    failed = view.add_message(MessageData("assistant", "", "steps", 1.0, status="error",
                                          stats={"error": "worker died", "stop_reason": "error"}))
    for w in (answered, nothing, streaming, failed):
        assert not shown(w.note), w.data
    streaming.data.status, streaming.data.stats = "complete", {"stop_reason": "max_new_tokens"}
    streaming.refresh()  # the same reply once it finished
    assert shown(streaming.note) and "token limit" in streaming.note.text()


def test_copy_message_and_code_block(qtbot) -> None:
    view = make_view(qtbot)
    w = view.add_message(MessageData("assistant", "Run:\n\n```sh\nmake test\n```"))
    with qtbot.waitSignal(view.copied, timeout=1000) as blocker:
        w.body.on_anchor_clicked(QUrl("copy:0"))
    assert blocker.args == ["code"]
    assert QGuiApplication.clipboard().text() == "make test"
    with qtbot.waitSignal(view.copied, timeout=1000) as blocker:
        w.copy_button.click()
    assert blocker.args == ["message"]
    assert QGuiApplication.clipboard().text().startswith("Run:")


def test_preview_button_only_for_html_answers(qtbot) -> None:
    view = make_view(qtbot)
    plain = view.add_message(MessageData("assistant", "just text"))
    page = view.add_message(MessageData("assistant", HTML_ANSWER))
    assert not shown(plain.preview_button)
    assert shown(page.preview_button)
    with qtbot.waitSignal(view.previewRequested, timeout=1000) as blocker:
        page.preview_button.click()
    request = blocker.args[0]
    assert request.html.startswith("<!DOCTYPE html>") and request.message is page.data and request.block is None
    with qtbot.waitSignal(view.previewRequested, timeout=1000) as blocker:
        page.body.on_anchor_clicked(QUrl("preview:0"))  # the code block's own link
    assert blocker.args[0].block == 0 and blocker.args[0].html.startswith("<!DOCTYPE html>")
    assert extract_html(HTML_ANSWER).strip().endswith("</html>")


def app_extractor():
    """The app's extractor: the one rule (ui.html_extract), which ui.preview re-exports."""
    return extract_html


STREAMED_PAGE = ["Sure, ", "here is a page ", "with a list:\n\n``", "`ht", "ml\n", "<!DOCTYPE html>\n",
                 "<html><body><ul>", "<li>one</li>", "<li>two</li>", "</ul></body></html>\n```\n", "Enjoy."]


def test_html_watch_extracts_only_after_a_hint_and_never_once_found() -> None:
    calls: list[str] = []

    def extractor(text: str) -> str | None:
        calls.append(text)
        return extract_html(text)

    watch = HtmlWatch(extractor)
    text, found = "", []
    for piece in STREAMED_PAGE:
        text += piece
        found.append(watch.check(text))
    # no hint in the prose; "ht" + "ml" split across deltas is still seen; an empty fence is not a document yet
    assert found == [False] * 5 + [True] * 6
    assert len(calls) == 2 and watch.extractions == 2
    assert calls[0].endswith("```html\n") and calls[1].endswith("<!DOCTYPE html>\n")
    assert HtmlWatch(extractor).check("") is False


def test_html_watch_gives_up_on_a_hint_in_prose() -> None:
    watch = HtmlWatch(app_extractor())
    text = "An HTML form sends its fields to the server when the user presses its submit button, "
    assert watch.check(text) is False and watch.extractions == 1  # a hint: looked once
    for words in ("encoded as key=value pairs, separated by ampersands ", "(unless it uploads files).",
                  "\n\nThe server", " answers with a new page", " or a redirect."):
        text += words
        assert watch.check(text) is False
    assert watch.extractions == 2  # once more while little had followed the hint, then no more
    text += "\n\n```html\n"
    assert watch.check(text) is False  # a new hint: a fence, no body yet
    text += "\n"
    assert watch.check(text) is False  # still only blank space after the fence line: look again
    text += "<form>"
    assert watch.check(text) is True and watch.extractions == 5


def test_html_watch_sees_a_document_start_split_after_the_hint() -> None:
    extractor = app_extractor()
    for pieces in (["Page:\n<htm", "l>", "<body>"], ["Page:\n```htm", "l\n", "<p>x</p>"],
                   ["<!DOCTYPE htm", "l>\n"]):
        watch, text = HtmlWatch(extractor), ""
        for piece in pieces:
            text += piece
            watch.check(text)
        assert watch.found, pieces


def test_preview_button_appears_while_streaming(qtbot) -> None:
    view = make_view(qtbot)
    data = MessageData("assistant", status="streaming", message_id=7)
    w = view.add_message(data)
    for piece in STREAMED_PAGE[:5]:
        data.content += piece
        view.stream_changed()
    view.stream_throttle.flush()
    w.refresh()
    assert not shown(w.preview_button)  # an empty ```html fence is not a page yet
    data.content += STREAMED_PAGE[5] + STREAMED_PAGE[6]
    view.stream_changed()
    qtbot.waitUntil(lambda: shown(w.preview_button), timeout=2000)
    assert data.status == "streaming"
    with qtbot.waitSignal(view.previewRequested, timeout=1000) as blocker:
        w.preview_button.click()
    request: PreviewRequest = blocker.args[0]
    assert request.message is data and request.html == "<!DOCTYPE html>\n<html><body><ul>"
    assert request.document_id == preview_document_id(data) == "message-7"
    # found once: later deltas do not run the extractor for the button again
    extractions = w.html_watch.extractions
    for piece in STREAMED_PAGE[7:]:
        data.content += piece
        view.stream_changed()
        w.refresh()
    assert w.html_watch.extractions == extractions and shown(w.preview_button)
    data.status = "complete"
    view.end_stream()
    assert shown(w.preview_button)


def test_edit_and_regenerate_signals(qtbot) -> None:
    view = make_view(qtbot)
    user = view.add_message(MessageData("user", "question", message_id=1))
    first = view.add_message(MessageData("assistant", "old answer", message_id=2))
    view.add_message(MessageData("user", "follow-up", message_id=3))
    last = view.add_message(MessageData("assistant", "answer", message_id=4))
    assert shown(last.regen_button) and not shown(first.regen_button)  # only the last answer
    assert shown(user.edit_button) and not shown(last.edit_button)
    with qtbot.waitSignal(view.editRequested, timeout=1000) as blocker:
        user.edit_button.click()
    assert blocker.args[0].message_id == 1
    with qtbot.waitSignal(view.regenerateRequested, timeout=1000) as blocker:
        last.regen_button.click()
    assert blocker.args[0].message_id == 4
    view.remove_from(2)
    assert [m.message_id for m in view.messages()] == [1, 2]
    assert shown(first.regen_button)


def test_streaming_updates_are_throttled(qtbot) -> None:
    view = make_view(qtbot)
    data = MessageData("assistant", status="streaming")
    w = view.add_message(data)
    assert w.meta_label.text() == "generating…"
    for i in range(200):
        data.content += f"word{i} "
        view.stream_changed()
    qtbot.waitUntil(lambda: "word199" in w.body.toPlainText(), timeout=2000)
    assert view.stream_throttle.calls <= 5  # 200 deltas, a handful of re-renders
    data.status = "complete"
    data.stats = {"tokens": 200, "tokens_per_s": 12.5}
    view.end_stream()
    assert w.meta_label.text() == "200 tokens · 12.5 tok/s" and w.meta_label.toolTip() == "answer: 200 tokens"
    assert shown(w.regen_button)


def test_a_page_the_user_pasted_gets_the_preview_button_too(qtbot) -> None:
    """Before: only answers had it (a page pasted into a question could only be previewed by hand)."""
    view = make_view(qtbot)
    pasted = view.add_message(MessageData("user", "Why is the title not red?\n\n<!DOCTYPE html>\n<html><head><style>"
                                                  "h1 {color: red}</style></head><body><h1>Hi</h1></body></html>"))
    fenced = view.add_message(MessageData("user", "Fix this:\n" + HTML_ANSWER))
    question = view.add_message(MessageData("user", "what is an <html> element?"))
    assert shown(pasted.preview_button) and shown(fenced.preview_button)
    assert not shown(question.preview_button)
    with qtbot.waitSignal(view.previewRequested, timeout=1000) as blocker:
        pasted.preview_button.click()
    request = blocker.args[0]
    assert request.message is pasted.data and request.block is None and request.html.startswith("<!DOCTYPE html>")
