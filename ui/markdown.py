"""A small Markdown → HTML renderer for chat messages, aimed at Qt's rich-text subset (QTextBrowser).

Supports headings, paragraphs, emphasis (``**bold**``, ``*italic*``, ``~~strike~~``), inline code, links,
bullet / numbered / task lists, block quotes, horizontal rules, pipe tables and fenced code blocks (syntax
highlighted by ``ui.highlight`` once the fence closes: the fence's language, guessed only for a long block without
one). Every fenced block gets a header with its language and a ``copy:N`` link (and ``preview:N`` for HTML), which the message
widget turns into clipboard / preview actions. Raw HTML in the text is escaped, never rendered: model output is
untrusted and HTML apps are shown only in the sandboxed preview.

An unclosed fence (while a reply is still streaming) renders as a code block up to the end of the text.

Math (``ui.latex``): ``$$...$$`` and ``\\[...\\]`` on lines of their own (and ``\\begin{equation}`` / ``align`` /
``gather`` blocks) are display formulas; ``$...$`` and ``\\(...\\)`` inside text are inline. A ``$`` opens math only
when a non-space follows it, and closes it only after a non-space and when no digit follows, so "$5 and $10" stays
prices; ``\\$`` is a dollar sign. Code blocks and code spans are never read as math; a formula still open at the end
of a streaming reply shows as plain text until it closes.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from clover_desk.ui.highlight import highlight
from clover_desk.ui.latex import to_html as math_html
from clover_desk.ui.theme import COLORS

MONO = "'JetBrains Mono','Cascadia Code','DejaVu Sans Mono','Menlo','Consolas',monospace"


@dataclass(frozen=True)
class CodeBlock:
    lang: str
    code: str
    closed: bool = True  # False for a fence still open at the end of a streaming reply

    @property
    def is_html(self) -> bool:
        if self.lang.lower() in ("html", "htm", "xhtml", "svg"):
            return True
        head = self.code.lstrip()[:200].lower()
        return not self.lang and (head.startswith("<!doctype html") or head.startswith("<html"))


@dataclass
class RenderedMarkdown:
    html: str
    code_blocks: list[CodeBlock] = field(default_factory=list)


_FENCE = re.compile(r"^(\s{0,3})(`{3,}|~{3,})\s*([\w+#.-]*)[^\n]*$")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HR = re.compile(r"^\s{0,3}([-*_])(\s*\1){2,}\s*$")
_BULLET = re.compile(r"^(\s*)[-*+]\s+(.*)$")
_ORDERED = re.compile(r"^(\s*)(\d{1,9})[.)]\s+(.*)$")
_QUOTE = re.compile(r"^\s{0,3}>\s?(.*)$")
_TABLE_SEP = re.compile(r"^\s*\|?\s*:?-{2,}:?\s*(\|\s*:?-{2,}:?\s*)*\|?\s*$")
_MATH_ENV = re.compile(
    r"^\s{0,3}\\begin\{(equation|align|aligned|gather|gathered|multline|displaymath|split|cases|[pbvBV]?matrix)"
    r"(\*?)\}"
)
MAX_MATH_LINES = 200


def render(text: str, first_code_index: int = 0) -> RenderedMarkdown:
    """Render Markdown ``text`` to an HTML fragment plus the list of its fenced code blocks."""
    out = _Renderer(first_code_index)
    out.run(text.replace("\r\n", "\n").replace("\t", "    "))
    return RenderedMarkdown("".join(out.parts), out.code_blocks)


def to_html(text: str) -> str:
    return render(text).html


class _Renderer:
    def __init__(self, first_code_index: int = 0) -> None:
        self.first_code_index = first_code_index
        self.parts: list[str] = []
        self.code_blocks: list[CodeBlock] = []

    def run(self, text: str) -> None:
        lines = text.split("\n")
        i = 0
        para: list[str] = []

        def flush_para() -> None:
            if para:
                self.parts.append(f"<p>{inline(' '.join(s.strip() for s in para))}</p>")
                para.clear()

        while i < len(lines):
            line = lines[i]
            fence = _FENCE.match(line)
            if fence:
                flush_para()
                i = self._code_block(lines, i, fence)
                continue
            if not line.strip():
                flush_para()
                i += 1
                continue
            math = display_math(lines, i)
            if math is not None:
                flush_para()
                tex, i = math
                self.parts.append(math_html(tex, display=True, rule_color=COLORS["text"]))
                continue
            heading = _HEADING.match(line)
            if heading:
                flush_para()
                level = min(6, len(heading.group(1)) + 1)  # h1 is too large in a chat bubble
                self.parts.append(f"<h{level}>{inline(heading.group(2))}</h{level}>")
                i += 1
                continue
            if _HR.match(line):
                flush_para()
                self.parts.append("<hr/>")
                i += 1
                continue
            if _QUOTE.match(line):
                flush_para()
                quoted = []
                while i < len(lines) and _QUOTE.match(lines[i]):
                    quoted.append(_QUOTE.match(lines[i]).group(1))  # type: ignore[union-attr]
                    i += 1
                inner = render("\n".join(quoted), self.first_code_index + len(self.code_blocks))
                self.code_blocks.extend(inner.code_blocks)
                self.parts.append(
                    f'<table width="100%" cellspacing="0" cellpadding="0" style="margin: 4px 0;"><tr>'
                    f'<td width="3" bgcolor="{COLORS["border"]}"></td>'
                    f'<td style="padding-left: 10px; color: {COLORS["muted"]};">{inner.html}</td></tr></table>'
                )
                continue
            if _BULLET.match(line) or _ORDERED.match(line):
                flush_para()
                i = self._list(lines, i)
                continue
            if "|" in line and i + 1 < len(lines) and _TABLE_SEP.match(lines[i + 1]):
                flush_para()
                i = self._table(lines, i)
                continue
            para.append(line)
            i += 1
        flush_para()

    def _code_block(self, lines: list[str], i: int, fence: re.Match[str]) -> int:
        indent, marker, lang = len(fence.group(1)), fence.group(2), fence.group(3)
        body: list[str] = []
        i += 1
        closed = False
        while i < len(lines):
            stripped = lines[i].strip()
            if stripped.startswith(marker[0] * len(marker)) and not stripped.strip(marker[0]):
                closed = True
                i += 1
                break
            body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i])
            i += 1
        code = "\n".join(body)
        block = CodeBlock(lang, code, closed)
        index = self.first_code_index + len(self.code_blocks)
        self.code_blocks.append(block)
        links = f'<a href="copy:{index}" style="color:{COLORS["muted"]}; text-decoration:none;">Copy</a>'
        if block.is_html:
            links = (
                f'<a href="preview:{index}" style="color:{COLORS["accent"]}; text-decoration:none;">Preview</a>'
                f"&nbsp;&nbsp;&nbsp;{links}"
            )
        label = html.escape(lang or "code")
        self.parts.append(
            f'<table width="100%" cellspacing="0" cellpadding="0" border="0" '
            f'style="margin-top: 6px; margin-bottom: 8px; background-color: {COLORS["code_bg"]};">'
            f'<tr><td style="background-color: {COLORS["surface3"]}; padding: 4px 10px; font-size: small;'
            f' color: {COLORS["muted"]};">{label}</td>'
            f'<td align="right" style="background-color: {COLORS["surface3"]}; padding: 4px 10px;'
            f' font-size: small;">{links}</td></tr>'
            f'<tr><td colspan="2" style="padding: 8px 10px;">'
            f'<pre style="font-family: {MONO}; margin: 0; color: {COLORS["text"]}; white-space: pre-wrap;">'
            f"{code_html(block)}</pre>"
            f"</td></tr></table>"
        )
        return i

    def _list(self, lines: list[str], i: int) -> int:
        first = _BULLET.match(lines[i]) or _ORDERED.match(lines[i])
        assert first is not None
        base_indent = len(first.group(1))
        ordered = _BULLET.match(lines[i]) is None
        items: list[list[str]] = []
        start = int(first.group(2)) if ordered else 1
        while i < len(lines):
            line = lines[i]
            m = _BULLET.match(line) if not ordered else _ORDERED.match(line)
            if m and len(m.group(1)) <= base_indent + 1:
                items.append([m.group(m.lastindex or 2)])
                i += 1
                continue
            if line.strip() and items and (len(line) - len(line.lstrip())) > base_indent:
                items[-1].append(line[base_indent + 2 :] if ordered is False else line.strip())
                i += 1
                continue
            if not line.strip() and i + 1 < len(lines):
                nxt = lines[i + 1]
                same = (_ORDERED if ordered else _BULLET).match(nxt)
                if same and len(same.group(1)) <= base_indent + 1:
                    i += 1
                    continue
                if nxt.strip() and (len(nxt) - len(nxt.lstrip())) > base_indent and items:
                    items[-1].append("")
                    i += 1
                    continue
            break
        tag = "ol" if ordered else "ul"
        start_attr = f' start="{start}"' if ordered and start != 1 else ""
        self.parts.append(f'<{tag}{start_attr} style="margin-top: 2px; margin-bottom: 6px;">')
        for item in items:
            head, rest = item[0], item[1:]
            task = re.match(r"^\[([ xX])\]\s+(.*)$", head)
            if task:
                mark = "☑" if task.group(1).lower() == "x" else "☐"
                head = f"{mark} {task.group(2)}"
            if any(s.strip() for s in rest):
                nested_text = "\n".join(s if _BULLET.match(s) or _ORDERED.match(s) or _FENCE.match(s) else s.strip() for s in rest)
                nested = render(nested_text, self.first_code_index + len(self.code_blocks))
                self.code_blocks.extend(nested.code_blocks)
                self.parts.append(f"<li>{inline(head)}{nested.html}</li>")
            else:
                self.parts.append(f"<li>{inline(head)}</li>")
        self.parts.append(f"</{tag}>")
        return i

    def _table(self, lines: list[str], i: int) -> int:
        def cells(row: str) -> list[str]:
            row = row.strip()
            if row.startswith("|"):
                row = row[1:]
            if row.endswith("|"):
                row = row[:-1]
            return [c.strip() for c in row.split("|")]

        header = cells(lines[i])
        aligns = []
        for spec in cells(lines[i + 1]):
            aligns.append("center" if spec.startswith(":") and spec.endswith(":") else "right" if spec.endswith(":") else "left")
        i += 2
        rows = []
        while i < len(lines) and "|" in lines[i] and lines[i].strip():
            rows.append(cells(lines[i]))
            i += 1
        border = COLORS["border"]
        out = [f'<table cellspacing="0" cellpadding="5" border="1" style="border-color: {border}; border-style: solid; margin: 6px 0;">']
        out.append("<tr>")
        for j, h in enumerate(header):
            align = aligns[j] if j < len(aligns) else "left"
            out.append(f'<th align="{align}" style="background-color: {COLORS["surface3"]};">{inline(h)}</th>')
        out.append("</tr>")
        for row in rows:
            out.append("<tr>")
            for j in range(len(header)):
                value = row[j] if j < len(row) else ""
                align = aligns[j] if j < len(aligns) else "left"
                out.append(f'<td align="{align}">{inline(value)}</td>')
            out.append("</tr>")
        out.append("</table>")
        self.parts.append("".join(out))
        return i


def code_html(block: CodeBlock) -> str:
    """A code block's text as HTML for its ``<pre>``: highlighted (``ui.highlight``: escaped, coloured spans) once
    its fence is closed, else (still streaming, unknown language) plain escaped text."""
    coloured = highlight(block.code, block.lang) if block.closed else None
    return html.escape(block.code) if coloured is None else coloured


def display_math(lines: list[str], i: int) -> tuple[str, int] | None:
    """A display formula starting at line ``i`` (``$$``, ``\\[`` or a ``\\begin{equation}``-like block, closed on
    the same line or a later one, with nothing after the closing): ``(the TeX, the next line index)``, else None."""
    stripped = lines[i].strip()
    env = _MATH_ENV.match(lines[i])
    if env is not None:  # the environment is part of the formula
        opening, closing, keep = "", f"\\end{{{env.group(1)}{env.group(2)}}}", True
    elif stripped.startswith("$$"):
        opening, closing, keep = "$$", "$$", False
    elif stripped.startswith("\\["):
        opening, closing, keep = "\\[", "\\]", False
    else:
        return None
    collected: list[str] = []
    for j in range(i, min(len(lines), i + MAX_MATH_LINES)):
        text = stripped[len(opening):] if j == i else lines[j].strip()
        end = text.find(closing)
        if end >= 0:
            if text[end + len(closing):].strip():
                return None  # text goes on after the closing: inline math in a paragraph
            collected.append(text[: end + len(closing)] if keep else text[:end])
            tex = "\n".join(collected).strip()
            return (tex, j + 1) if tex else None
        collected.append(text)
    return None  # not closed (yet): plain text


def math_spans(text: str, keep: Callable[[str], str]) -> str:
    """Replace the inline formulas of ``text`` (raw, before escaping) with placeholders from ``keep``."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\" and text.startswith("\\$", i):
            out.append(keep("$"))
            i += 2
            continue
        for opening, closing in (("$$", "$$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if text.startswith(opening, i):
                end = text.find(closing, i + len(opening))
                if end > i + len(opening) and text[i + len(opening):end].strip():
                    out.append(keep(math_html(text[i + len(opening):end].strip())))
                    i = end + len(closing)
                    break
        else:
            if c == "$" and _opens_math(text, i):
                end = _closing_dollar(text, i)
                if end is not None:
                    out.append(keep(math_html(text[i + 1:end])))
                    i = end + 1
                    continue
            out.append(c)
            i += 1
    return "".join(out)


def _opens_math(text: str, i: int) -> bool:
    return i + 1 < len(text) and not text[i + 1].isspace() and text[i + 1] != "$"


def _closing_dollar(text: str, i: int) -> int | None:
    """The ``$`` closing the one at ``i``: the next unescaped ``$``, if a non-space precedes it and no digit follows
    (else ``i`` does not open math: "$5 and $10")."""
    j = i + 1
    while True:
        j = text.find("$", j)
        if j < 0:
            return None
        if text[j - 1] == "\\":
            j += 1
            continue
        ok = not text[j - 1].isspace() and not (j + 1 < len(text) and text[j + 1].isdigit())
        return j if ok else None


_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_LINK = re.compile(r"\[([^\]\n]+)\]\(\s*([^)\s]+)(?:\s+&quot;[^)]*&quot;)?\s*\)")
# Runs on escaped text, where "&" only starts an entity (&quot; &lt; &gt; &#x27; &amp;): a URL takes no entity but
# &amp; (a query's "&"), so a quote or "<" after it ends it instead of ending up in the link ("...a&quot;").
_URL = r"https?://(?:[^\s<&]|&amp;)*[^\s<&.,;:!?)\]]"
_AUTOLINK = re.compile(rf"&lt;({_URL})&gt;|(?<![\w/])({_URL})")
_BOLD = re.compile(r"(\*\*|__)(?=\S)(.+?)(?<=\S)\1")
_ITALIC = re.compile(r"(?<![\w*])\*(?=[^\s*])(.+?)(?<=[^\s*])\*(?!\*)|(?<![\w_])_(?=\S)(.+?)(?<=\S)_(?![\w_])")
_STRIKE = re.compile(r"~~(?=\S)(.+?)(?<=\S)~~")
_SAFE_SCHEMES = ("http://", "https://", "mailto:")


def inline(text: str) -> str:
    """Inline Markdown of one paragraph / cell to HTML (input is raw text; it is escaped here)."""
    spans: list[str] = []

    def keep(fragment: str) -> str:
        spans.append(fragment)
        return f"\x00{len(spans) - 1}\x00"

    def code(m: re.Match[str]) -> str:
        body = html.escape(m.group(2).strip() if m.group(2).strip() else m.group(2))
        return keep(
            f'<code style="font-family: {MONO}; background-color: {COLORS["surface3"]};'
            f' color: {COLORS["inline_code"]};">&nbsp;{body}&nbsp;</code>'
        )

    text = _CODE_SPAN.sub(code, text)
    if "$" in text or "\\(" in text or "\\[" in text:
        text = math_spans(text, keep)
    text = html.escape(text, quote=True)

    def link(m: re.Match[str]) -> str:
        label, url = m.group(1), html.unescape(m.group(2))
        if not url.lower().startswith(_SAFE_SCHEMES):
            return label
        return keep(f'<a href="{html.escape(url, quote=True)}" style="color: {COLORS["accent2"]};">{label}</a>')

    text = _LINK.sub(link, text)

    def autolink(m: re.Match[str]) -> str:
        shown = m.group(1) or m.group(2)  # escaped already
        href = html.escape(html.unescape(shown), quote=True)
        return keep(f'<a href="{href}" style="color: {COLORS["accent2"]};">{shown}</a>')

    text = _AUTOLINK.sub(autolink, text)
    text = _BOLD.sub(r"<b>\2</b>", text)
    text = _ITALIC.sub(lambda m: f"<i>{m.group(1) or m.group(2)}</i>", text)
    text = _STRIKE.sub(r"<s>\1</s>", text)
    while "\x00" in text:
        new = re.sub(r"\x00(\d+)\x00", lambda m: spans[int(m.group(1))], text)
        if new == text:
            break
        text = new
    return text
