"""TeX math to Qt rich text: the subset answers use, rendered offline with no dependency.

Qt's rich text (QTextBrowser) has no math layout, but it has what a small typesetter needs: italics, ``<sub>`` /
``<sup>``, an overline, and nested tables whose cells can carry a bottom border. :func:`to_html` parses a formula
(commands, groups, scripts, environments) into a small tree and writes it out:

* inline (``$x^2$``, ``\\(...\\)``): one line of text: letters in italics, Greek and symbols as Unicode, scripts as
  ``<sub>`` / ``<sup>``, ``\\sqrt`` as √ over a line, fractions as a small ``ⁿ⁄ₘ`` (or ``(a)/(b)`` when long);
* display (``$$...$$``, ``\\[...\\]``, a line of its own): a centred row of table cells, where fractions stack over a
  rule, sums and products carry their limits above and below, and matrices, ``cases`` and ``aligned`` lay out in
  rows and columns.

Anything outside the subset is shown as written (``\\unknown`` stays ``\\unknown``): a formula is never dropped, and
model output is never trusted as HTML: every piece of text is escaped here.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

MATH_FONT = "'STIX Two Math','Cambria Math','Latin Modern Math','DejaVu Serif',serif"
MAX_SOURCE = 4000  # a longer formula is shown as written
MAX_DEPTH = 40
NOWRAP = "white-space: pre;"  # a formula never breaks inside, and its spaces stay (a cell would trim them)

THIN, MED, EM = "\u2009", "\u2005", "\u2003"

GREEK = {
    "alpha": "α", "beta": "β", "gamma": "γ", "delta": "δ", "epsilon": "ϵ", "varepsilon": "ε", "zeta": "ζ",
    "eta": "η", "theta": "θ", "vartheta": "ϑ", "iota": "ι", "kappa": "κ", "lambda": "λ", "mu": "μ", "nu": "ν",
    "xi": "ξ", "pi": "π", "varpi": "ϖ", "rho": "ρ", "varrho": "ϱ", "sigma": "σ", "varsigma": "ς", "tau": "τ",
    "upsilon": "υ", "phi": "ϕ", "varphi": "φ", "chi": "χ", "psi": "ψ", "omega": "ω",
    "Gamma": "Γ", "Delta": "Δ", "Theta": "Θ", "Lambda": "Λ", "Xi": "Ξ", "Pi": "Π", "Sigma": "Σ", "Upsilon": "Υ",
    "Phi": "Φ", "Psi": "Ψ", "Omega": "Ω",
}
BINARY = {
    "pm": "±", "mp": "∓", "times": "×", "div": "÷", "cdot": "⋅", "ast": "∗", "star": "⋆", "circ": "∘",
    "bullet": "∙", "cap": "∩", "cup": "∪", "wedge": "∧", "land": "∧", "vee": "∨", "lor": "∨", "oplus": "⊕",
    "ominus": "⊖", "otimes": "⊗", "odot": "⊙", "setminus": "∖", "bmod": "mod",
}
RELATION = {
    "leq": "≤", "le": "≤", "geq": "≥", "ge": "≥", "neq": "≠", "ne": "≠", "approx": "≈", "equiv": "≡", "sim": "∼",
    "simeq": "≃", "cong": "≅", "propto": "∝", "in": "∈", "notin": "∉", "ni": "∋", "subset": "⊂", "subseteq": "⊆",
    "supset": "⊃", "supseteq": "⊇", "to": "→", "rightarrow": "→", "leftarrow": "←", "gets": "←",
    "Rightarrow": "⇒", "Leftarrow": "⇐", "Leftrightarrow": "⇔", "leftrightarrow": "↔", "implies": "⟹",
    "iff": "⟺", "mapsto": "↦", "longrightarrow": "⟶", "longmapsto": "⟼", "ll": "≪", "gg": "≫", "perp": "⊥",
    "mid": "∣", "parallel": "∥", "models": "⊨", "vdash": "⊢", "coloneqq": "≔", "prec": "≺", "succ": "≻",
    "preceq": "⪯", "succeq": "⪰", "leqslant": "⩽", "geqslant": "⩾", "nleq": "≰", "ngeq": "≱", "asymp": "≍",
    "doteq": "≐", "uparrow": "↑", "downarrow": "↓",
}
ORDINARY = {
    "infty": "∞", "partial": "∂", "nabla": "∇", "forall": "∀", "exists": "∃", "nexists": "∄", "emptyset": "∅",
    "varnothing": "∅", "neg": "¬", "lnot": "¬", "angle": "∠", "triangle": "△", "hbar": "ℏ", "ell": "ℓ",
    "Re": "ℜ", "Im": "ℑ", "aleph": "ℵ", "prime": "′", "ldots": "…", "cdots": "⋯", "vdots": "⋮", "ddots": "⋱",
    "dots": "…", "dotsc": "…", "dotsb": "⋯", "degree": "°", "checkmark": "✓", "dagger": "†", "langle": "⟨",
    "rangle": "⟩", "lfloor": "⌊", "rfloor": "⌋", "lceil": "⌈", "rceil": "⌉", "lvert": "|", "rvert": "|",
    "lVert": "‖", "rVert": "‖", "vert": "|", "Vert": "‖", "|": "‖", "{": "{", "}": "}", "%": "%", "$": "$",
    "&": "&", "#": "#", "_": "_", "backslash": "∖", "square": "□", "Box": "□", "top": "⊤", "bot": "⊥",
    "therefore": "∴", "because": "∵", "clubsuit": "♣", "star": "⋆",
}
BIG = {"sum": "∑", "prod": "∏", "coprod": "∐", "int": "∫", "iint": "∬", "iiint": "∭", "oint": "∮",
       "bigcup": "⋃", "bigcap": "⋂", "bigoplus": "⨁", "bigotimes": "⨂", "bigvee": "⋁", "bigwedge": "⋀"}
INTEGRALS = {"int", "iint", "iiint", "oint"}  # limits beside the sign, not above and below
FUNCTIONS = {
    "sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "coth", "log",
    "ln", "lg", "exp", "dim", "ker", "gcd", "deg", "arg", "Pr", "hom", "mod", "det", "lim", "max", "min", "sup",
    "inf", "limsup", "liminf", "argmax", "argmin", "tr", "rank", "sgn",
}
LIMIT_FUNCTIONS = {"lim", "max", "min", "sup", "inf", "limsup", "liminf", "det", "argmax", "argmin", "Pr"}
SPACES = {",": THIN, ":": MED, ">": MED, ";": "\u2004", " ": " ", "quad": EM, "qquad": EM + EM, "!": "",
          "enspace": "\u2002", "thinspace": THIN}
IGNORED = {"left", "right", "big", "Big", "bigg", "Bigg", "bigl", "bigr", "Bigl", "Bigr", "biggl", "biggr",
           "Biggl", "Biggr", "middle", "displaystyle", "textstyle", "scriptstyle", "limits", "nolimits", "nonumber",
           "notag", "label", "tag"}  # sizing and numbering: the delimiter or the argument is what shows
ACCENTS = {"hat": "\u0302", "widehat": "\u0302", "tilde": "\u0303", "widetilde": "\u0303", "vec": "\u20d7",
           "overrightarrow": "\u20d7", "dot": "\u0307", "ddot": "\u0308", "acute": "\u0301", "grave": "\u0300",
           "breve": "\u0306", "check": "\u030c"}
TEXT_COMMANDS = {"text", "textrm", "textup", "textnormal", "mbox", "textit", "textbf", "texttt", "textsf"}
FONTS = {"mathrm": "upright", "operatorname": "upright", "mathsf": "upright", "mathtt": "upright",
         "mathbf": "bold", "boldsymbol": "bold", "bm": "bold", "mathit": "italic", "mathbb": "double",
         "mathcal": "script", "mathscr": "script", "mathfrak": "upright"}
DOUBLE_STRUCK = {"C": "ℂ", "H": "ℍ", "N": "ℕ", "P": "ℙ", "Q": "ℚ", "R": "ℝ", "Z": "ℤ"}
SCRIPT = {"B": "ℬ", "E": "ℰ", "F": "ℱ", "H": "ℋ", "I": "ℐ", "L": "ℒ", "M": "ℳ", "R": "ℛ", "e": "ℯ", "g": "ℊ",
          "o": "ℴ"}
MATRIX_DELIMS = {"matrix": ("", ""), "pmatrix": ("(", ")"), "bmatrix": ("[", "]"), "Bmatrix": ("{", "}"),
                 "vmatrix": ("|", "|"), "Vmatrix": ("‖", "‖"), "smallmatrix": ("", ""), "array": ("", ""),
                 "cases": ("{", ""), "dcases": ("{", ""), "aligned": ("", ""), "align": ("", ""),
                 "align*": ("", ""), "gathered": ("", ""), "gather": ("", ""), "gather*": ("", ""),
                 "split": ("", ""), "equation": ("", ""), "equation*": ("", ""), "alignat": ("", "")}
BINARY_CHARS = {"+": "+", "-": "−", "*": "∗"}
RELATION_CHARS = {"=": "=", "<": "&lt;", ">": "&gt;", ":": ":"}
OPEN = set("([{") | {"⟨", "⌊", "⌈"}


class MathError(ValueError):
    """The formula is outside the subset (or too big): it is shown as written."""


# --------------------------------------------------------------------------------------------- the tree


@dataclass
class Sym:
    text: str  # already HTML-escaped
    kind: str = "ord"  # var | num | ord | op | rel | open | close | punct | func | text


@dataclass
class Group:
    items: list = field(default_factory=list)


@dataclass
class Scripts:
    base: object
    sub: object = None
    sup: object = None


@dataclass
class Frac:
    num: object
    den: object
    rule: bool = True  # False: \binom (in parentheses, no rule)


@dataclass
class Sqrt:
    body: object
    index: object = None


@dataclass
class BigOp:
    glyph: str
    limits: bool  # above / below in display


@dataclass
class Styled:
    style: str  # bold | italic | upright | double | script | overline | underline | accent
    body: object
    mark: str = ""  # the combining accent


@dataclass
class Table:
    rows: list  # list[list[Group]]
    left: str = ""
    right: str = ""
    align: str = "center"  # center | pairs (right, left, right, left: aligned) | left (cases)


# --------------------------------------------------------------------------------------------- parsing

_TOKEN = re.compile(r"\\([A-Za-z]+\*?|.)|([{}^_&~])|(\s+)|(.)", re.S)


def _tokens(src: str) -> list[tuple[str, str]]:
    out = []
    for m in _TOKEN.finditer(src):
        if m.group(1) is not None:
            out.append(("cmd", m.group(1)))
        elif m.group(2) is not None:
            out.append(("sym", m.group(2)))
        elif m.group(3) is not None:
            out.append(("space", m.group(3)))
        else:
            out.append(("char", m.group(4)))
    return out


class _Parser:
    def __init__(self, src: str) -> None:
        self.toks = _tokens(src)
        self.i = 0
        self.depth = 0

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> tuple[str, str]:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def skip_space(self) -> None:
        while self.peek() is not None and self.peek()[0] == "space":  # type: ignore[index]
            self.i += 1

    def expr(self, stop: tuple[tuple[str, str], ...] = ()) -> Group:
        """Items up to a stop token (not consumed) or a closing brace / the end."""
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise MathError("nested too deeply")
        items: list = []
        while True:
            tok = self.peek()
            if tok is None or tok == ("sym", "}") or tok in stop or (tok[0] == "cmd" and tok[1] == "end"):
                break
            kind, value = self.take()
            if kind == "space":
                continue
            if kind == "sym" and value in "^_":
                base = items.pop() if items else Sym("")
                if not isinstance(base, Scripts):
                    base = Scripts(base)
                arg = self.argument()
                if value == "^":
                    base.sup = arg if base.sup is None else Group([base.sup, arg])
                else:
                    base.sub = arg if base.sub is None else Group([base.sub, arg])
                items.append(base)
                continue
            if kind == "char" and value == "'":
                base = items.pop() if items else Sym("")
                if not isinstance(base, Scripts):
                    base = Scripts(base)
                base.sup = Group([base.sup, Sym("′")]) if base.sup is not None else Sym("′")
                items.append(base)
                continue
            node = self.atom(kind, value)
            if node is not None:
                items.append(node)
        self.depth -= 1
        return Group(items)

    def argument(self) -> object:
        """One argument: a braced group, one command, or one character."""
        self.skip_space()
        tok = self.peek()
        if tok is None:
            return Sym("")
        if tok == ("sym", "{"):
            self.take()
            group = self.expr()
            self._close()
            return group
        kind, value = self.take()
        node = self.atom(kind, value)
        return node if node is not None else Sym("")

    def optional(self) -> object | None:
        """``[...]`` after a command (\\sqrt[3]{x})."""
        self.skip_space()
        if self.peek() != ("char", "["):
            return None
        self.take()
        group = self.expr(stop=(("char", "]"),))
        if self.peek() == ("char", "]"):
            self.take()
        return group

    def raw_braced(self) -> str:
        """The text of a braced argument as written (\\text{...}), nested braces kept."""
        self.skip_space()
        if self.peek() != ("sym", "{"):
            return self.take()[1] if self.peek() is not None else ""
        self.take()
        depth, parts = 1, []
        while self.peek() is not None:
            kind, value = self.take()
            if (kind, value) == ("sym", "{"):
                depth += 1
            elif (kind, value) == ("sym", "}"):
                depth -= 1
                if depth == 0:
                    break
            if kind == "space":
                parts.append(" ")  # (a newline would break the line: formulas are laid out with white-space: pre)
            elif kind != "cmd":
                parts.append(value)
            elif value in "{}$%&#_ ":
                parts.append(value)  # an escaped character stands for itself
            else:
                parts.append("\\" + value)
        return "".join(parts)

    def _close(self) -> None:
        if self.peek() == ("sym", "}"):
            self.take()

    def atom(self, kind: str, value: str) -> object | None:
        if kind == "sym":
            if value == "{":
                group = self.expr()
                self._close()
                return group
            if value == "~":
                return Sym("\u00a0")
            if value == "&":
                return Sym("&amp;")
            return None  # a stray "}"
        if kind == "char":
            if value.isalpha():
                return Sym(html.escape(value), "var")
            if value.isdigit() or value == ".":
                return Sym(value, "num")
            if value in BINARY_CHARS:
                return Sym(BINARY_CHARS[value], "op")
            if value in RELATION_CHARS:
                return Sym(RELATION_CHARS[value], "rel")
            if value in "([":
                return Sym(value, "open")
            if value in ")]":
                return Sym(value, "close")
            if value in ",;":
                return Sym(value, "punct")
            if value == "|":
                return Sym("|")
            return Sym(html.escape(value))
        return self.command(value)

    def command(self, name: str) -> object | None:
        if name in GREEK:
            return Sym(GREEK[name], "var" if name[0].islower() else "ord")
        if name in BINARY:
            return Sym(BINARY[name], "op")
        if name in RELATION:
            return Sym(RELATION[name], "rel")
        if name in ORDINARY:
            kind = "open" if name in ("langle", "lfloor", "lceil", "{") else "close" if name in (
                "rangle", "rfloor", "rceil", "}") else "ord"
            return Sym(html.escape(ORDINARY[name]), kind)
        if name in BIG:
            return BigOp(BIG[name], name not in INTEGRALS)
        if name in FUNCTIONS:
            return BigOp(name, True) if name in LIMIT_FUNCTIONS else Sym(name, "func")
        if name in SPACES:
            return Sym(SPACES[name], "space")
        if name in IGNORED:
            if name in ("label", "tag"):
                self.raw_braced()
            if name in ("left", "right", "middle") or name.startswith(("big", "Big")):
                self.skip_space()
                if self.peek() == ("char", "."):
                    self.take()  # \left. : no delimiter
            return None
        if name == "\\":
            return Sym(" ", "space")  # a line break outside a table
        if name in ("frac", "dfrac", "tfrac", "cfrac"):
            return Frac(self.argument(), self.argument())
        if name == "binom":
            return Frac(self.argument(), self.argument(), rule=False)
        if name == "sqrt":
            index = self.optional()
            return Sqrt(self.argument(), index)
        if name in TEXT_COMMANDS:
            text = html.escape(self.raw_braced())
            if name == "textit":
                text = f"<i>{text}</i>"
            elif name == "textbf":
                text = f"<b>{text}</b>"
            return Sym(text, "text")
        if name in FONTS:
            return Styled(FONTS[name], self.argument())
        if name in ACCENTS:
            return Styled("accent", self.argument(), ACCENTS[name])
        if name in ("bar", "overline"):
            return Styled("overline", self.argument())
        if name == "underline":
            return Styled("underline", self.argument())
        if name in ("overset", "stackrel"):
            over = self.argument()
            return Scripts(self.argument(), sup=over)
        if name == "underset":
            under = self.argument()
            return Scripts(self.argument(), sub=under)
        if name in ("boxed", "mathbin", "mathrel", "mathop", "phantom", "hphantom", "vphantom"):
            body = self.argument()
            return None if "phantom" in name else body
        if name == "not":
            nxt = self.argument()
            if isinstance(nxt, Sym) and nxt.text == "=":
                return Sym("≠", "rel")
            if isinstance(nxt, Sym):
                return Sym(nxt.text + "\u0338", nxt.kind)
            return nxt
        if name == "pmod":
            return Group([Sym(MED + "(mod" + MED, "ord"), self.argument(), Sym(")", "close")])
        if name == "begin":
            return self.environment()
        return Sym(html.escape("\\" + name), "text")  # outside the subset: shown as written

    def environment(self) -> Table:
        env = self.raw_braced()
        if env in ("array", "alignat"):
            self.raw_braced()  # the column spec / count
        rows: list[list[Group]] = [[]]
        while True:
            cell = self.expr(stop=(("sym", "&"), ("cmd", "\\")))
            rows[-1].append(cell)
            tok = self.peek()
            if tok is None:
                break
            if tok == ("sym", "&"):
                self.take()
            elif tok == ("cmd", "\\"):
                self.take()
                self.optional()  # \\[2pt]
                rows.append([])
            elif tok == ("cmd", "end"):
                self.take()
                self.raw_braced()
                break
            else:  # a stray "}" inside the environment
                self.take()
        if rows and all(not c.items for c in rows[-1]):
            rows.pop()  # a trailing \\
        left, right = MATRIX_DELIMS.get(env, ("", ""))
        align = "pairs" if env.rstrip("*") in ("aligned", "align", "split", "alignat") else (
            "left" if env in ("cases", "dcases") else "center")
        return Table(rows, left, right, align)


def parse(src: str) -> Group:
    if len(src) > MAX_SOURCE:
        raise MathError("too long")
    parser = _Parser(src)
    group = parser.expr()
    # a stray closing brace or \end at the top: skip it (and the environment's name) and keep going
    while parser.peek() is not None:
        if parser.take() == ("cmd", "end"):
            parser.raw_braced()
        group.items.extend(parser.expr().items)
    return group


# --------------------------------------------------------------------------------------------- inline HTML


def _plain_length(html_text: str) -> int:
    return len(html.unescape(re.sub(r"<[^>]+>", "", html_text)))


def _is_atomic(node: object) -> bool:
    if isinstance(node, Group):
        return len(node.items) == 1 and _is_atomic(node.items[0])
    return isinstance(node, (Sym, Scripts, Sqrt)) or (isinstance(node, Styled))


def _inline(node: object, upright: bool = False) -> str:
    if node is None:
        return ""
    if isinstance(node, Group):
        return _inline_items(node.items, upright)
    if isinstance(node, Sym):
        return _sym(node, upright)
    if isinstance(node, Scripts):
        out = _inline(node.base, upright)
        if node.sub is not None:
            out += f"<sub>{_inline(node.sub, upright)}</sub>"
        if node.sup is not None:
            out += f"<sup>{_inline(node.sup, upright)}</sup>"
        return out
    if isinstance(node, Frac):
        num, den = _inline(node.num, upright), _inline(node.den, upright)
        if not node.rule:
            return f"(<sup>{num}</sup><sub>{den}</sub>)"
        if _plain_length(num) <= 4 and _plain_length(den) <= 4:
            return f"<sup>{num}</sup>⁄<sub>{den}</sub>"
        num = num if _is_atomic(node.num) else f"({num})"
        den = den if _is_atomic(node.den) else f"({den})"
        return f"{num}/{den}"
    if isinstance(node, Sqrt):
        root = "√" if node.index is None else f"<sup>{_inline(node.index, upright)}</sup>√"
        return f'{root}<span style="text-decoration: overline;">{_inline(node.body, upright)}</span>'
    if isinstance(node, BigOp):
        return node.glyph if len(node.glyph) == 1 else node.glyph + THIN
    if isinstance(node, Styled):
        return _styled_inline(node, upright)
    if isinstance(node, Table):
        rows = "; ".join(", ".join(_inline(c, upright) for c in row) for row in node.rows)
        return f"{node.left}{rows}{node.right}"
    return ""


def _styled_inline(node: Styled, upright: bool) -> str:
    if node.style == "bold":
        return f"<b>{_inline(node.body, True)}</b>"
    if node.style == "italic":
        return f"<i>{_inline(node.body, True)}</i>"
    if node.style == "upright":
        return _inline(node.body, True)
    if node.style in ("double", "script"):
        table = DOUBLE_STRUCK if node.style == "double" else SCRIPT
        return "".join(_letter(c, table, node.style) for c in html.unescape(_text_of(node.body)))
    if node.style == "overline":
        return f'<span style="text-decoration: overline;">{_inline(node.body, upright)}</span>'
    if node.style == "underline":
        return f'<span style="text-decoration: underline;">{_inline(node.body, upright)}</span>'
    body = node.body.items[0] if isinstance(node.body, Group) and len(node.body.items) == 1 else node.body
    if isinstance(body, Sym) and len(html.unescape(body.text)) == 1:  # one letter: the combining accent
        return _sym(Sym(body.text + node.mark, body.kind), upright)
    return f'<span style="text-decoration: overline;">{_inline(node.body, upright)}</span>'


def _letter(c: str, table: dict[str, str], style: str) -> str:
    if c in table:
        return table[c]
    if "A" <= c <= "Z":
        base = 0x1D538 if style == "double" else 0x1D49C  # Mathematical double-struck / script capitals
        return chr(base + ord(c) - ord("A"))
    return html.escape(c)


def _text_of(node: object) -> str:
    if isinstance(node, Group):
        return "".join(_text_of(i) for i in node.items)
    if isinstance(node, Sym):
        return node.text
    return ""


def _sym(node: Sym, upright: bool) -> str:
    if node.kind == "var" and not upright:
        return f"<i>{node.text}</i>"
    return node.text


def _inline_items(items: list, upright: bool) -> str:
    out: list[str] = []
    prev: object = None
    for node in items:
        text = _inline(node, upright)
        kind = node.kind if isinstance(node, Sym) else "ord"
        unary = prev is None or (isinstance(prev, Sym) and prev.kind in ("op", "rel", "open", "punct"))
        if kind == "op" and not unary:
            text = f"{MED}{text}{MED}"
        elif kind == "rel":
            text = f"{MED}{text}{MED}"
        elif kind == "punct":
            text = f"{text}{THIN}"
        elif kind == "func" and out:
            text = f"{THIN}{text}{THIN}"
        elif kind == "func":
            text = f"{text}{THIN}"
        out.append(text)
        prev = node
    return "".join(out)


# --------------------------------------------------------------------------------------------- display HTML


def _stacks(node: object) -> bool:
    """Does this node need more than one line in display?"""
    if isinstance(node, (Frac, Table)):
        return True
    if isinstance(node, BigOp):
        return node.limits or len(node.glyph) == 1  # a big sign, its limits above and below or beside it
    if isinstance(node, Scripts):
        return _stacks(node.base)
    if isinstance(node, Group):
        return any(_stacks(i) for i in node.items)
    if isinstance(node, Sqrt):
        return _stacks(node.body)
    return False


def _row(cells: list[str]) -> str:
    tds = "".join(f'<td valign="middle" style="{NOWRAP} padding: 0 1px;">{c}</td>' for c in cells)
    return f'<table cellspacing="0" cellpadding="0"><tr>{tds}</tr></table>'


def _display(node: object, rule_color: str) -> str:
    """A node as display HTML: a table when it stacks, else inline HTML."""
    if not _stacks(node):
        return _inline(node)
    if isinstance(node, Group):
        return _row(_display_cells(node.items, rule_color))
    return _row(_display_cells([node], rule_color))


def _display_cells(items: list, rule_color: str) -> list[str]:
    cells: list[str] = []
    run: list = []

    def flush() -> None:
        if run:
            cells.append(_inline_items(run, False))
            run.clear()

    for node in items:
        if _stacks(node):
            flush()
            cells.append(_stacked(node, rule_color))
        else:
            run.append(node)
    flush()
    return cells


def _stacked(node: object, rule_color: str) -> str:
    small = f'style="font-size: small; {NOWRAP}"'
    if isinstance(node, Frac):
        num, den = _display(node.num, rule_color), _display(node.den, rule_color)
        border = f"border-bottom: 1px solid {rule_color};" if node.rule else ""
        table = (f'<table cellspacing="0" cellpadding="0"><tr><td align="center" style="{border} padding: 0 3px; '
                 f'{NOWRAP}">{num}</td></tr><tr><td align="center" style="padding: 0 3px; {NOWRAP}">{den}</td></tr>'
                 f'</table>')
        if not node.rule:
            return _row([_big("("), table, _big(")")])
        return f"{THIN}{table}{THIN}"
    op = node.base if isinstance(node, Scripts) else node
    if isinstance(op, BigOp) and op.limits:  # sums, products, lim: limits above and below
        sub = _display(node.sub, rule_color) if isinstance(node, Scripts) and node.sub is not None else ""
        sup = _display(node.sup, rule_color) if isinstance(node, Scripts) and node.sup is not None else ""
        glyph = _big(op.glyph) if len(op.glyph) == 1 else op.glyph  # (lim, max: a word)
        return (f'<table cellspacing="0" cellpadding="0"><tr><td align="center" {small}>{sup}</td></tr>'
                f'<tr><td align="center" style="{NOWRAP}">{glyph}</td></tr>'
                f'<tr><td align="center" {small}>{sub}</td></tr></table>')
    if isinstance(op, BigOp):  # an integral: its limits beside the sign
        sub = _inline(node.sub) if isinstance(node, Scripts) and node.sub is not None else ""
        sup = _inline(node.sup) if isinstance(node, Scripts) and node.sup is not None else ""
        limits = (f'<table cellspacing="0" cellpadding="0"><tr><td {small}>{sup}</td></tr>'
                  f'<tr><td>&nbsp;</td></tr><tr><td {small}>{sub}</td></tr></table>')
        return _row([_big(op.glyph), limits] if sub or sup else [_big(op.glyph)])
    if isinstance(node, Scripts):
        base = _display(node.base, rule_color)
        scripts = ""
        if node.sub is not None:
            scripts += f"<sub>{_inline(node.sub)}</sub>"
        if node.sup is not None:
            scripts += f"<sup>{_inline(node.sup)}</sup>"
        return _row([base, scripts])
    if isinstance(node, Table):
        return _table(node, rule_color)
    if isinstance(node, Sqrt):
        return _row([_big("√"), f'<table cellspacing="0" cellpadding="0"><tr><td style="border-top: 1px solid '
                                 f'{rule_color};">{_display(node.body, rule_color)}</td></tr></table>'])
    if isinstance(node, Group):
        return _row(_display_cells(node.items, rule_color))
    return _inline(node)


def _big(glyph: str) -> str:
    return f'<span style="font-size: xx-large;">{html.escape(glyph, quote=False)}</span>'


def _table(node: Table, rule_color: str) -> str:
    width = max((len(r) for r in node.rows), default=0)
    rows = []
    for row in node.rows:
        tds = []
        for j in range(width):
            cell = _display(row[j], rule_color) if j < len(row) else ""
            if node.align == "pairs":
                align = "right" if j % 2 == 0 else "left"
            elif node.align == "left":
                align = "left"
            else:
                align = "center"
            pad = ("padding: 2px 8px;" if node.align != "pairs" else "padding: 2px 0;") + NOWRAP
            tds.append(f'<td align="{align}" valign="middle" style="{pad}">{cell}</td>')
        rows.append(f"<tr>{''.join(tds)}</tr>")
    grid = f'<table cellspacing="0" cellpadding="0">{"".join(rows)}</table>'
    cells = [grid]
    if node.left:
        cells.insert(0, _big(node.left))
    if node.right:
        cells.append(_big(node.right))
    return _row(cells) if len(cells) > 1 else grid


# --------------------------------------------------------------------------------------------- entry points


def to_html(tex: str, display: bool = False, rule_color: str = "#888888") -> str:
    """``tex`` (the formula without its delimiters) as Qt rich text. Display math is a centred block (a table);
    inline math a span. A formula outside the subset is shown as written, in the math font."""
    try:
        tree = parse(tex)
        if display:
            if "\\\\" in tex and "\\begin" not in tex:
                tree = parse(f"\\begin{{gathered}}{tex}\\end{{gathered}}")  # several lines: one row each
            body = _display(tree, rule_color)
        else:
            body = _inline(tree)
    except (MathError, RecursionError, IndexError):
        body = html.escape(tex)
    font = f'font-family: {MATH_FONT};'
    if display:
        return (f'<table align="center" cellspacing="0" cellpadding="0" style="margin-top: 4px; margin-bottom: 8px;">'
                f'<tr><td style="{font} font-size: large; {NOWRAP}">{body}</td></tr></table>')
    return f'<span style="{font} {NOWRAP}">{body}</span>'
