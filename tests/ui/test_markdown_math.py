"""Answers render TeX math (issue 10): ``$...$`` / ``\\(...\\)`` inline, ``$$...$$`` / ``\\[...\\]`` and
``\\begin{aligned}``-like blocks as display formulas, through ui.markdown and ui.latex, and in the real chat view;
prices stay prices, code stays code, and nothing in a formula is ever taken as HTML."""

from __future__ import annotations

import pytest
from PySide6.QtGui import QTextTable

from clover_desk.ui.chat_view import MessageData, MessageWidget
from clover_desk.ui.html_extract import extract_html
from clover_desk.ui.latex import MATH_FONT, to_html
from clover_desk.ui.markdown import render

MATH = f"font-family: {MATH_FONT}"


def html_of(text: str) -> str:
    return render(text).html


# ---- what opens math, and what does not ---------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "It costs $5 and $10.",
    "Tickets are $20-$30 each",
    "I have $20, you have $30.",
    "Between $5 and $ 10",
    "A lone $ sign",
    "Pay \\$7 now",
])
def test_dollar_amounts_are_not_math(text: str) -> None:
    out = html_of(text)
    assert MATH not in out
    assert "$" in out and "\\$" not in out


def test_inline_math_with_dollars_and_parentheses() -> None:
    out = html_of("Energy $E = mc^2$ and \\(\\alpha_i \\leq \\beta\\) hold.")
    assert out.count(MATH) == 2
    assert "<i>E</i>" in out and "<i>c</i><sup>2</sup>" in out
    assert "<i>α</i><sub><i>i</i></sub>" in out and "≤" in out and "\\alpha" not in out
    assert "Energy " in out and " hold." in out


def test_a_price_next_to_a_formula() -> None:
    out = html_of("For $5 you get $x^2$ twice.")
    assert out.count(MATH) == 1 and "For $5 you get" in out and "<i>x</i><sup>2</sup>" in out


@pytest.mark.parametrize("block", [
    "$$\\frac{a+b}{2}$$",
    "\\[ \\frac{a+b}{2} \\]",
    "$$\n\\frac{a+b}{2}\n$$",
    "\\[\n\\frac{a+b}\n{2}\n\\]",
])
def test_display_formulas_are_centred_blocks_with_a_fraction_rule(block: str) -> None:
    out = html_of(f"Before.\n\n{block}\n\nAfter.")
    assert '<table align="center"' in out and "border-bottom: 1px solid" in out
    assert "<p>Before.</p>" in out and "<p>After.</p>" in out and "frac" not in out


def test_environments_lay_out_in_rows_and_columns() -> None:
    out = html_of("\\begin{aligned}\na &= b + c \\\\\nd &= e\n\\end{aligned}")
    assert '<table align="center"' in out and out.count("<tr>") >= 3 and "aligned" not in out
    cases = to_html("f(x) = \\begin{cases} x & x > 0 \\\\ 0 & \\text{otherwise} \\end{cases}", display=True)
    assert "{" in cases and "otherwise" in cases and "cases" not in cases
    matrix = to_html("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", display=True)
    assert matrix.count("<tr>") >= 2 and "(" in matrix and ")" in matrix


def test_code_is_never_math() -> None:
    out = html_of("Run `echo $HOME$x$` then:\n\n```bash\nprice=\"$5\"; echo $x$ $$y$$\n```\n\n$$ still math $$")
    code = out[out.index("<pre"): out.index("</pre>")]
    assert "$x$" in code and "$$y$$" in code and MATH not in code
    assert "echo $HOME$x$" in out  # the code span, as written
    assert out.count(MATH) == 1  # only the display formula after the code block


def test_an_unclosed_formula_while_streaming_is_plain_text_until_it_closes() -> None:
    partial = html_of("The integral:\n\n$$\n\\int_0^1 x\\,dx")
    assert MATH not in partial and "\\int_0^1" in partial
    done = html_of("The integral:\n\n$$\n\\int_0^1 x\\,dx\n$$")
    assert MATH in done and "∫" in done


def test_formulas_are_escaped_never_html() -> None:
    out = html_of("$<img src=x onerror=alert(1)>$ and $$\\text{<b>bold</b>}$$")
    assert "<img" not in out and "<b>bold</b>" not in out and out.count("&lt;") == 3 and "&lt;b&gt;bold" in out


def test_the_subset() -> None:
    assert "ℝ" in to_html("\\mathbb{R}") and "∑" in to_html("\\sum_{i=1}^n i", display=True)
    assert "√" in to_html("\\sqrt{x+1}") and "overline" in to_html("\\sqrt{x+1}")
    assert "<sup>3</sup>√" in to_html("\\sqrt[3]{x}")
    assert "sin" in to_html("\\sin x") and "<i>s</i>" not in to_html("\\sin x")  # functions are upright
    assert "<sup>1</sup>⁄<sub>2</sub>" in to_html("\\frac12") or "<sup>1</sup>⁄<sub>2</sub>" in to_html("\\frac{1}{2}")
    assert "(<i>a</i>" in to_html("\\frac{a+b}{c}")  # a long inline fraction: (a + b)/c
    assert "\\unknowncmd" in to_html("\\unknowncmd{x}")  # outside the subset: shown as written
    assert "x\u0302" in to_html("\\hat{x}")
    deep = "{" * 100 + "x" + "}" * 100
    assert "x" in to_html(deep)  # too deep: as written, never an exception


def test_the_chat_view_shows_the_formulas(qtbot) -> None:  # noqa: ANN001
    text = "Area $\\pi r^2$, not $5 and $10:\n\n$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$\n\n```\n$x$\n```"
    widget = MessageWidget(MessageData("assistant", text), extract_html)
    qtbot.addWidget(widget)
    widget.show()
    doc = widget.body.document()
    plain = doc.toPlainText()
    assert "π" in plain and "$5 and $10" in plain and "∫" in plain and "$x$" in plain
    assert "\\int" not in plain and "\\frac" not in plain and "\\pi" not in plain
    tables = [f for f in doc.rootFrame().childFrames() if isinstance(f, QTextTable)]
    assert len(tables) == 2  # the display formula and the code block
