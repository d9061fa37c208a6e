"""Syntax highlighting of fenced code blocks for the chat's Markdown (``ui.markdown``), with Pygments.

Only Pygments' lexers are used, never its HTML formatter: each token's text goes through :func:`html.escape` and
is wrapped in a ``<span style="color: …">`` whose colour comes from the theme's palette (``syn_*`` in
:data:`ui.theme.COLORS`), so a block follows the light and dark themes and no text of the answer can become
markup. The language comes from the fence (```` ```python ````); only a fence without one is guessed, and only when
the block is long enough for a guess to mean something; an unknown language stays plain (escaped) text.

Cost: the result is cached by (code, language, palette), so a long streaming answer re-rendered on every delta
highlights each finished block once; ``ui.markdown`` never highlights a block whose fence is still open.
"""

from __future__ import annotations

import html
import logging
from functools import lru_cache

from pygments.lexer import Lexer
from pygments.lexers import get_lexer_by_name, guess_lexer
from pygments.token import (
    Comment,
    Error,
    Generic,
    Keyword,
    Literal,
    Name,
    Number,
    Operator,
    String,
    Token,
    _TokenType,
)
from pygments.util import ClassNotFound

from clover_desk.ui.theme import COLORS

log = logging.getLogger(__name__)

GUESS_MIN_CHARS = 120  # a fence without a language is guessed only from this much code (and GUESS_MIN_LINES)
GUESS_MIN_LINES = 3
GUESS_SAMPLE_CHARS = 1500  # a guess reads the start only: every lexer's analyser runs over the sample
MAX_HIGHLIGHT_CHARS = 200_000  # a bigger block stays plain: lexing it would hold the GUI thread too long
CACHE_BLOCKS = 256

# token type -> palette key; a token takes the colour of its closest listed ancestor (Token.Text: none)
TOKEN_COLORS: tuple[tuple[_TokenType, str], ...] = (
    (Comment, "syn_comment"),
    (Keyword.Constant, "syn_constant"),
    (Keyword, "syn_keyword"),
    (String, "syn_string"),
    (Number, "syn_number"),
    (Literal, "syn_number"),
    (Name.Builtin, "syn_builtin"),
    (Name.Function, "syn_function"),
    (Name.Class, "syn_type"),
    (Name.Decorator, "syn_builtin"),
    (Name.Tag, "syn_keyword"),
    (Name.Attribute, "syn_function"),
    (Operator.Word, "syn_keyword"),
    (Generic.Deleted, "syn_deleted"),
    (Generic.Inserted, "syn_inserted"),
    (Generic.Heading, "syn_keyword"),
    (Error, "syn_deleted"),
)


def lexer_for(lang: str, code: str) -> Lexer | None:
    """The lexer for a fence's language (Pygments' names and aliases: "python", "py", "js", "c++", ...); a fence
    without one is guessed when the code is long enough. None: plain text (unknown language, or no good guess)."""
    name = lang.strip().lower()
    if name:
        try:
            return get_lexer_by_name(name, stripnl=False, ensurenl=False)
        except ClassNotFound:
            return None
    if len(code) < GUESS_MIN_CHARS or code.count("\n") + 1 < GUESS_MIN_LINES:
        return None
    try:
        lexer = guess_lexer(code[:GUESS_SAMPLE_CHARS], stripnl=False, ensurenl=False)
    except ClassNotFound:
        return None
    return None if lexer.name == "Text only" else lexer


def _palette_key(token: _TokenType) -> str | None:
    for kind, key in TOKEN_COLORS:
        if token in kind:
            return key
    return None


def highlight(code: str, lang: str) -> str | None:
    """``code`` as escaped HTML with coloured spans for the current palette, or None when it stays plain (no
    lexer for ``lang``, or too long). The caller puts it inside its ``<pre>``."""
    if len(code) > MAX_HIGHLIGHT_CHARS:
        return None
    palette = tuple(sorted((k, v) for k, v in COLORS.items() if k.startswith("syn_")))
    return _highlight_cached(code, lang, palette)


@lru_cache(maxsize=CACHE_BLOCKS)
def _highlight_cached(code: str, lang: str, palette: tuple[tuple[str, str], ...]) -> str | None:
    lexer = lexer_for(lang, code)
    if lexer is None:
        return None
    colors = dict(palette)
    runs: list[tuple[str | None, list[str]]] = []  # neighbouring tokens of one colour share a span
    for token, text in lexer.get_tokens(code):
        if not text:
            continue
        key = _palette_key(token) if token is not Token.Text else None
        color = colors.get(key) if key else None
        if runs and (runs[-1][0] == color or not text.strip()):
            runs[-1][1].append(text)
        else:
            runs.append((color, [text]))
    out = []
    for color, texts in runs:
        escaped = html.escape("".join(texts), quote=True)
        out.append(f'<span style="color: {color};">{escaped}</span>' if color else escaped)
    return "".join(out)
