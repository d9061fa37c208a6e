"""Finding the HTML page in a model answer: one rule for the chat's Preview button and the preview pane.

Pure functions (no Qt), tested in tests/ui/test_html_extract.py. The rule: a fenced ```html block, the **longest** when
there are several (that is the page; the shorter ones are snippets an answer quotes before or after it), an
unfinished fence counting as what has arrived so far; otherwise a bare ``<!DOCTYPE html>`` / ``<html>`` page that
starts a line.
"""

from __future__ import annotations

import re

_FENCE_OPEN = re.compile(r"^[ \t]{0,3}(`{3,}|~{3,})[ \t]*(html|htm|xhtml)\b[^\n]*$", re.IGNORECASE | re.MULTILINE)
_DOC_START = re.compile(r"<!doctype\s+html|<html[\s>]", re.IGNORECASE)
_DOC_END = re.compile(r"</html\s*>", re.IGNORECASE)


def extract_html(markdown_text: str) -> str | None:
    """The HTML document in a model answer, or None.

    Looks first for a fenced ```html block (the longest one, when there are several: that is the page, the
    others are snippets); an unfinished fence (the answer is still streaming) yields what has arrived so far.
    Otherwise, a whole page that starts with ``<!DOCTYPE html>`` or ``<html>`` is taken up to ``</html>`` (or to
    the end while streaming). Text that is merely HTML-ish (a ``<div>`` in prose) is not a document.
    """
    blocks: list[str] = []
    for match in _FENCE_OPEN.finditer(markdown_text):
        fence = match.group(1)
        body_start = match.end() + 1
        close = re.compile(r"^[ \t]{0,3}" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}[ \t]*$", re.MULTILINE)
        end = close.search(markdown_text, body_start)
        body = markdown_text[body_start : end.start() if end else len(markdown_text)]
        blocks.append(body.rstrip("\n") if end else body)
    blocks = [b for b in blocks if b.strip()]
    if blocks:
        return max(blocks, key=len)
    start = _DOC_START.search(markdown_text)
    if start is None:
        return None
    # Only a page that begins a line counts (not "<html>" quoted inside a sentence).
    line_start = markdown_text.rfind("\n", 0, start.start()) + 1
    if markdown_text[line_start : start.start()].strip():
        return None
    end = _DOC_END.search(markdown_text, start.start())
    return markdown_text[start.start() : end.end() if end else len(markdown_text)]
