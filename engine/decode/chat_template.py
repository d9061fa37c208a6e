"""Chat templates: Jinja2 code that comes with the model folder, run in a sandbox with limits on time and size.

Jinja2's :class:`~jinja2.sandbox.ImmutableSandboxedEnvironment` already refuses private attributes, unsafe
callables, mutation of lists and dicts and ranges of more than ``MAX_RANGE`` items. A hostile template can still
loop for hours (two nested ranges of 100,000 items) or ask for gigabytes in one operation (``'x' * 10**10``).
:class:`LimitedSandbox` adds what is missing:

* time: every render has a deadline (:data:`engine.decode.limits.TEMPLATE_TIMEOUT_S`). A trace function, set on the
  rendering thread only while it renders, checks it at each line the template's compiled code runs and at each
  Python call the render makes, so a loop with an empty body stops too; the sandbox's own hooks check it again.
* size: every operation that can multiply what it is given (``*``, ``+``, ``%``, ``~``, ``**`` on integers, the
  string methods and filters that pad, repeat, join or replace) first works out how big its result will be and
  charges it to the render's budget; so does every ``{{ }}`` output, and the rendered text has its own cap. The
  budget is :data:`engine.decode.limits.TEMPLATE_BASE_CHARS` plus :data:`engine.decode.limits.TEMPLATE_CHARS_PER_INPUT_CHAR` per
  character of the messages and tools, so a long conversation renders and ``{{ 'x' * 10**10 }}`` is refused before
  anything is allocated. Operations that grow text by a factor are charged their worst case: case changes
  (``upper``: one character can become three), HTML and URL escaping (``escape``, ``xmlattr``, ``urlencode``,
  ``urlize``), text of containers (``string``, ``pprint``, ``{{ }}``, ``tojson``: a control character is 4 to 10),
  ``split`` / ``list`` of a string (one string per character), ``translate`` and ``encode``. ``strftime_now``
  refuses widths and flags (``%1500Y`` pads inside one C call) and charges each directive.
* nothing is evaluated at compile time (no constant folding), so every expression runs under these limits.

A limit reached raises :class:`TemplateLimit` (a Jinja2 ``SecurityError``) naming the template file and the limit.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import re
import string
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from types import FrameType
from typing import Any

from jinja2 import TemplateError, pass_context
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.nodes import Concat
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from clover_desk.engine.decode import limits

_TEMPLATE_FILE = "<template>"  # co_filename of the code Jinja2 compiles from a string
_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z%]")
_SEQUENCES = (str, bytes, list, tuple)
_PASSED_ARGS = ("eval_ctx", "context", "environment")  # what Jinja2 passes a filter first (pass_eval_context, ...)
# a strftime directive: flags (glibc: - _ 0 ^ #), a width, an E/O modifier, the conversion
_STRFTIME_SPEC = re.compile(r"%([-_0^#]*)(\d*)[EO]?(.|$)", re.DOTALL)
STRFTIME_DIRECTIVE_CHARS = 64  # the most one directive without a width writes, with room (``%c``: 24)
CASE_GROWTH = 3  # str.upper() and kin: one character can become three ('\u0390'.upper())
ESCAPE_GROWTH = 5  # HTML escaping: '"' -> '&#34;'
URL_GROWTH = 12  # percent-encoding: one astral character is four UTF-8 bytes, '%F0%9F%98%80'
REPR_GROWTH = 10  # a character in a repr: '\U000e0001'
JSON_GROWTH = 6  # a character in JSON: '\u0001'
_JSON_ESCAPED = re.compile(r'[\x00-\x1f"\\]')
ENCODE_GROWTH = 10  # str.encode('unicode_escape') of '\U000e0001'


class TemplateLimit(SecurityError):
    """A render stopped at a limit of :class:`LimitedSandbox` (time, size, number size)."""


class _Render:
    """The limits of the render running on one thread."""

    def __init__(self, source: str, budget: int, timeout_s: float) -> None:
        self.source = source
        self.budget = budget
        self.left = budget
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s


def weight(value: Any, limit: int) -> int:
    """How much ``value`` holds: characters of strings, plus one per element of lists, tuples, sets and dicts
    (keys and values), counted through nesting (a list holding one string 1,000 times weighs 1,000 of it). Stops
    counting once past ``limit``."""
    total = 0
    stack = [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += len(item)
            stack.extend(item)
        elif isinstance(item, dict):
            total += len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        else:
            total += 1
    return total


def _repr_string_size(text: str) -> int:
    return REPR_GROWTH * len(text) + 2


def _json_string_size(text: str) -> int:
    """The characters of ``json.dumps(text, ensure_ascii=False)``: a control character is six (``\\u0001``)."""
    return len(text) + 2 + (JSON_GROWTH - 1) * len(_JSON_ESCAPED.findall(text))


def text_bound(value: Any, limit: int, string_size: Callable[[str], int] = _repr_string_size, indent: int = 0,
               top_str: bool = True) -> float:
    """At most how many characters ``str()`` / ``repr()`` (or, with :func:`_json_string_size`, JSON) of ``value``
    can take: a string at the top as itself (``top_str``), strings inside containers ``string_size``, each element
    its separator and, with ``indent``, its line's indentation (``pprint``, ``tojson(indent=)``). Stops counting
    once past ``limit``."""
    if isinstance(value, str) and top_str:
        return len(value)
    total = 0.0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack and total <= limit:
        item, depth = stack.pop()
        if isinstance(item, str):
            total += string_size(item)
        elif isinstance(item, bytes):
            total += 4 * len(item) + 3
        elif isinstance(item, (list, tuple, set, frozenset, dict)):
            total += 2 + len(item) * (4 + indent * (depth + 1))
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
        elif isinstance(item, Namespace):
            total += 16
            stack.append((dict(item.__dict__.get("_Namespace__attrs", {})), depth))
        elif isinstance(item, bool) or item is None:
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 2
        elif isinstance(item, float):
            total += 24
        else:
            total += 64 + string_size(str(getattr(item, "_undefined_name", None) or ""))
    return total


class _GuardedCodeGenerator(CodeGenerator):
    """Jinja2's code generator with ``~`` (string concatenation) routed through the environment, which checks the
    size of the result first (Jinja2 offers no hook for it)."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox plus a deadline and a size budget per render (see the module docstring); the
    environment Hugging Face chat templates expect (trimmed blocks, loop controls, ``tojson`` keeping non-ASCII
    text, ``raise_exception``, ``strftime_now``)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _GuardedCodeGenerator

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            keep_trailing_newline=True,
            extensions=["jinja2.ext.loopcontrols"],
            optimized=False,  # no constant folding: nothing a template says runs at compile time, outside the limits
            finalize=self._finalize,  # needs the context, so constant output is not evaluated at compile time either
        )
        self._local = threading.local()
        del self.globals["lipsum"]  # lipsum(10**9): a billion paragraphs in one call, and no template uses it
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = self._strftime_now
        self.filters["tojson"] = self._tojson
        for name, estimate in _FILTER_ESTIMATES.items():
            self.filters[name] = self._guarded_filter(name, self.filters[name], estimate)

    # ---- a render ----
    @contextmanager
    def limited(self, source: str, budget: int, timeout_s: float = limits.TEMPLATE_TIMEOUT_S) -> Iterator[_Render]:
        """Run the block (a render on this thread) under a deadline ``timeout_s`` from now and a size budget."""
        render = _Render(source, budget, timeout_s)
        outer = getattr(self._local, "render", None)
        self._local.render = render
        previous_trace = sys.gettrace()

        def on_line(frame: FrameType, event: str, arg: Any) -> Any:
            if time.monotonic() > render.deadline:
                raise self._timeout(render)
            return on_line

        def on_call(frame: FrameType, event: str, arg: Any) -> Any:
            if time.monotonic() > render.deadline:
                raise self._timeout(render)
            return on_line if frame.f_code.co_filename == _TEMPLATE_FILE else None

        sys.settrace(on_call)  # this thread only; a tracer that raised has been removed by Python, so always restore
        try:
            yield render
        finally:
            sys.settrace(previous_trace)
            self._local.render = outer

    def render(self, template: Any, context: dict[str, Any], source: str, input_chars: int) -> str:
        """Render ``template`` with ``context`` under the limits; the budget grows with ``input_chars`` (the
        characters of the messages and tools). Raises :class:`TemplateLimit` or what the template raises."""
        budget = limits.TEMPLATE_BASE_CHARS + limits.TEMPLATE_CHARS_PER_INPUT_CHAR * input_chars
        pieces: list[str] = []
        produced = 0
        with self.limited(source, budget) as render:
            for piece in template.generate(**context):
                produced += len(piece)
                if produced > budget:
                    raise self._too_big(render, "its output")
                pieces.append(piece)
        return "".join(pieces)

    # ---- checks ----
    def _current(self) -> _Render:
        render = getattr(self._local, "render", None)
        if render is None:  # outside a render (nothing runs at compile time): a fresh base budget, no deadline
            render = _Render(_TEMPLATE_FILE, limits.TEMPLATE_BASE_CHARS, math.inf)
        return render

    def _check_time(self) -> _Render:
        render = self._current()
        if time.monotonic() > render.deadline:
            raise self._timeout(render)
        return render

    def _spend(self, size: float, what: str) -> None:
        """Charge ``size`` characters (or elements) about to be built to the render's budget."""
        render = self._check_time()
        if size > render.left:
            raise self._too_big(render, what)
        render.left -= int(size)

    @staticmethod
    def _timeout(render: _Render) -> TemplateLimit:
        return TemplateLimit(
            f"{render.source}: the chat template was stopped: it ran longer than {render.timeout_s:g} s, the most a "
            f"chat template may take"
        )

    @staticmethod
    def _too_big(render: _Render, what: str) -> TemplateLimit:
        return TemplateLimit(
            f"{render.source}: the chat template was stopped: {what} would take it past {render.budget:,} "
            f"characters, the most it may build for this conversation ({limits.TEMPLATE_BASE_CHARS:,} plus "
            f"{limits.TEMPLATE_CHARS_PER_INPUT_CHAR} per character of the messages and tools)"
        )

    def _check_int(self, value: int | float, what: str) -> None:
        if value > limits.TEMPLATE_MAX_INT_BITS:
            render = self._current()
            raise TemplateLimit(
                f"{render.source}: the chat template was stopped: {what} would make a number of more than "
                f"{limits.TEMPLATE_MAX_INT_BITS:,} bits"
            )

    # ---- the sandbox's hooks ----
    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self._check_time()
        if operator == "*":
            if isinstance(left, _SEQUENCES) and _is_int(right):
                self._spend(weight(left, self._current().left) * max(right, 0), "'*'")
            elif isinstance(right, _SEQUENCES) and _is_int(left):
                self._spend(weight(right, self._current().left) * max(left, 0), "'*'")
            elif _is_int(left) and _is_int(right):
                self._check_int(left.bit_length() + right.bit_length(), "'*'")
        elif operator == "**":
            if _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
                self._check_int(right * math.log2(abs(left)), "'**'")
        elif operator == "+":
            if isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES):
                left_over = self._current().left
                self._spend(weight(left, left_over) + weight(right, left_over), "'+'")
        elif operator == "%" and isinstance(left, str):
            self._spend(len(left) + _printf_widths(left) + weight(right, self._current().left), "'%'")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja2's form
        __self._check_time()
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(owner, (str, bytes)) and name in _STR_GROWERS:
            if name == "join" and args:
                args = (list(args[0]), *args[1:])  # a generator is read once: materialize it to measure it
            size = _str_method_size(owner, name, args, kwargs, __self._current().left)
            __self._spend(size, f"str.{name}()")
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        template = str(value.__self__)

        @functools.wraps(wrapped)
        def checked(*args: Any, **kwargs: Any) -> str:
            size = len(template) + _format_widths(template) + weight([args, kwargs], self._current().left)
            self._spend(size, f"str.{value.__name__}()")
            return wrapped(*args, **kwargs)

        return checked

    def checked_concat(self, parts: tuple[Any, ...]) -> str:
        """``a ~ b ~ c``: each part as a string, their total charged before they are joined."""
        texts = []
        for part in parts:
            if not isinstance(part, str):
                self._check_weight(part, "'~'")
            texts.append(str(part))
        self._spend(sum(len(t) for t in texts), "'~'")
        return "".join(texts)

    def _check_weight(self, value: Any, what: str) -> None:
        """A container about to be turned into text must fit what is left, counted as its text can be at most
        (:func:`text_bound`: a control character in a list's repr is four)."""
        render = self._current()
        if weight(value, render.left) > render.left or text_bound(value, render.left) > render.left:
            raise self._too_big(render, what)

    @pass_context
    def _finalize(self, context: Any, value: Any) -> Any:
        """Every ``{{ }}``, into the output or into a buffer (macros, ``{% set %}`` blocks): charged."""
        if isinstance(value, str):
            self._spend(len(value), "'{{ }}'")
            return value
        self._check_weight(value, "'{{ }}'")
        text = str(value)
        self._spend(len(text), "'{{ }}'")
        return text

    def _tojson(self, value: Any, indent: int | str | None = None) -> str:
        """JSON that keeps non-ASCII text (what Hugging Face templates expect); charged first."""
        step = len(indent) if isinstance(indent, str) else max(indent, 0) if isinstance(indent, int) else 0
        if step > 16:
            raise TemplateLimit(
                f"{self._current().source}: the chat template was stopped: tojson(indent={indent!r}): an indent is at "
                f"most 16 characters"
            )
        self._spend(text_bound(value, self._current().left, _json_string_size, step, top_str=False), "tojson")
        return json.dumps(value, ensure_ascii=False, indent=indent)

    def _strftime_now(self, fmt: str) -> str:
        """The date now in ``fmt``. A width or flag (``%1500Y``, ``%_10d``) is refused: the C library pads inside one
        call the budget never sees; each directive is charged :data:`STRFTIME_DIRECTIVE_CHARS` (``%c`` is 24)."""
        if isinstance(fmt, str):
            directives = 0
            for match in _STRFTIME_SPEC.finditer(fmt):
                if match.group(1) or match.group(2):
                    raise TemplateLimit(
                        f"{self._current().source}: the chat template was stopped: strftime_now: the date format "
                        f"specifier {match.group(0)!r} has a width or flag, which a chat template may not use"
                    )
                directives += 1
            self._spend(len(fmt) + directives * STRFTIME_DIRECTIVE_CHARS, "strftime_now()")
        return datetime.now().strftime(fmt)

    def _guarded_filter(self, name: str, original: Callable[..., Any], estimate: Callable[..., Any]) -> Callable[..., Any]:
        """``original`` (a Jinja2 filter) with its result's size charged first; the filter keeps its signature and
        its context / environment argument (which an async-variant filter such as ``list`` takes without its
        signature saying so: ``lead`` arguments passed through unbound)."""
        signature = inspect.signature(original)
        first = next(iter(signature.parameters), "")
        lead = 1 if getattr(original, "jinja_pass_arg", None) is not None and first not in _PASSED_ARGS else 0

        @functools.wraps(original)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            self._check_time()
            try:
                bound = signature.bind(*args[lead:], **kwargs)
            except TypeError:
                return original(*args, **kwargs)  # the filter's own error for a wrong call
            bound.apply_defaults()
            size = estimate(bound.arguments, self._current().left)  # may materialize an iterable in place
            self._spend(size, f"the {name} filter")
            return original(*args[:lead], *bound.args, **bound.kwargs)

        return guarded


def _is_int(value: Any) -> bool:
    return isinstance(value, int)  # bools too: True * 'x' is 'x'


def _printf_widths(fmt: str) -> float:
    """The characters the widths and precisions of a printf-style format can add (a ``*`` width, chosen at run
    time, counts as unbounded)."""
    total = 0.0
    for match in _PRINTF_SPEC.finditer(fmt):
        for number in match.groups():
            if number == "*":
                return math.inf
            if number:
                total += int(number)
    return total


def _format_widths(fmt: str) -> float:
    """The characters the widths and precisions of a ``str.format`` template can add (a nested ``{}`` in a format
    spec, a width chosen at run time, counts as unbounded)."""
    total = 0.0
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return 0.0  # str.format raises its own error
    for _, _, spec, _ in fields:
        if spec and "{" in spec:
            return math.inf
        total += sum(int(n) for n in re.findall(r"\d+", spec or ""))
    return total


def _replace_size(s: str | bytes, old: Any, new: Any, count: Any) -> int:
    if not isinstance(old, (str, bytes)) or type(new) is not type(old) or type(s) is not type(old):
        return len(s)
    hits = len(s) + 1 if not old else s.count(old)
    if _is_int(count) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(len(new) - len(old), 0)


def _join_size(separator: str, items: list[Any] | tuple[Any, ...], limit: int) -> int:
    return weight(list(items), limit) + max(len(items) - 1, 0) * len(separator)


_STR_GROWERS = ("center", "ljust", "rjust", "zfill", "expandtabs", "replace", "join", "upper", "lower", "title",
                "capitalize", "swapcase", "casefold", "split", "rsplit", "splitlines", "translate", "encode", "hex")


def _str_method_size(s: str | bytes, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], limit: int) -> float:
    """The size of ``s.<name>(*args, **kwargs)`` for the str methods that can build much more than they are given
    (a wrong argument type counts as nothing: the method raises its own error)."""

    def arg(index: int, key: str, default: Any) -> Any:
        return args[index] if len(args) > index else kwargs.get(key, default)

    if name in ("center", "ljust", "rjust", "zfill"):
        width = arg(0, "width", 0)
        return max(width, len(s)) if _is_int(width) else len(s)
    if name == "expandtabs":
        tabsize = arg(0, "tabsize", 8)
        tab = "\t" if isinstance(s, str) else b"\t"
        return len(s) + s.count(tab) * max(tabsize, 0) if _is_int(tabsize) else len(s)
    if name == "replace":
        return _replace_size(s, arg(0, "old", ""), arg(1, "new", ""), arg(2, "count", -1))
    if name in ("upper", "lower", "title", "capitalize", "swapcase", "casefold"):
        return CASE_GROWTH * len(s)
    if name in ("split", "rsplit", "splitlines"):
        return 2 * len(s) + 1  # its characters again, and at most one string per character
    if name == "translate":
        return len(s) * max([1] + [len(v) for v in _table_values(arg(0, "table", None))])
    if name == "encode":
        return ENCODE_GROWTH * len(s) + 16
    if name == "hex":
        separator = arg(0, "sep", "")
        return len(s) * (2 + (len(separator) if isinstance(separator, (str, bytes)) else 0))
    items = arg(0, "iterable", ())
    return _join_size(s, items, limit) if isinstance(items, (list, tuple)) else len(s)


def _table_values(table: Any) -> list[Any]:
    """The strings a ``str.translate`` table maps to (a dict, or a sequence indexed by code point)."""
    if isinstance(table, dict):
        values = table.values()
    elif isinstance(table, (list, tuple)):
        values = table
    else:
        return []
    return [v for v in values if isinstance(v, (str, bytes))]


def _text_size(value: Any, limit: int) -> int:
    return len(value) if isinstance(value, str) else weight(value, limit) + 16


def _estimate_center(a: dict[str, Any], limit: int) -> int:
    width = a.get("width", 80)
    return max(width if _is_int(width) else 0, _text_size(a["value"], limit))


def _estimate_indent(a: dict[str, Any], limit: int) -> int:
    width, text = a.get("width", 4), a["s"] if isinstance(a["s"], str) else ""
    step = len(width) if isinstance(width, str) else max(width, 0) if _is_int(width) else 0
    return len(text) + (text.count("\n") + 1) * step


def _estimate_format(a: dict[str, Any], limit: int) -> float:
    fmt = a["value"] if isinstance(a["value"], str) else ""
    return len(fmt) + _printf_widths(fmt) + weight([a.get("args"), a.get("kwargs")], limit)


def _estimate_replace(a: dict[str, Any], limit: int) -> float:
    parts = [a["s"], a["old"], a["new"]]  # the filter replaces in str() of each
    if weight(parts, limit) > limit:
        return math.inf
    count = a.get("count")
    return _replace_size(*(str(p) for p in parts), -1 if count is None else count)


def _estimate_join(a: dict[str, Any], limit: int) -> int:
    if not isinstance(a["value"], (list, tuple)):
        a["value"] = list(a["value"])  # read once: the filter gets the list that was measured
    separator = a.get("d", "")
    return _join_size(separator if isinstance(separator, str) else "", a["value"], limit)


def _estimate_wordwrap(a: dict[str, Any], limit: int) -> int:
    text = a["s"] if isinstance(a["s"], str) else ""
    width, wrap = a.get("width", 79), a.get("wrapstring") or "\n"
    lines = len(text) // max(width, 1) + 1 if _is_int(width) else 1
    return len(text) + lines * (len(wrap) if isinstance(wrap, str) else 1)


def _estimate_batch(a: dict[str, Any], limit: int) -> int:
    count = a.get("linecount")
    return max(count, 0) if a.get("fill_with") is not None and _is_int(count) else 0


def _estimate_sum(a: dict[str, Any], limit: int) -> int:
    start = a.get("start", 0)
    if not isinstance(start, _SEQUENCES):
        return 0  # numbers
    if not isinstance(a["iterable"], (list, tuple)):
        a["iterable"] = list(a["iterable"])
    items = a["iterable"]
    # sum() of sequences copies the running total at every step: about n / 2 times the final size
    return weight([start, items], limit) * max(len(items) // 2, 1)


def _first(a: dict[str, Any]) -> Any:
    """The filter's value (its first argument that is not the context)."""
    return next(v for k, v in a.items() if k not in ("eval_ctx", "context", "environment"))


def _grows(factor: int) -> Callable[[dict[str, Any], int], float]:
    """A filter that works on ``str()`` of its value, each character becoming at most ``factor``."""

    def estimate(a: dict[str, Any], limit: int) -> float:
        return factor * text_bound(_first(a), limit)

    return estimate


def _estimate_xmlattr(a: dict[str, Any], limit: int) -> float:
    d = a["d"]
    if not isinstance(d, dict):
        return 0  # the filter raises its own error
    return 1 + sum(ESCAPE_GROWTH * (text_bound(k, limit) + text_bound(v, limit)) + 4 for k, v in d.items())


def _estimate_urlencode(a: dict[str, Any], limit: int) -> float:
    return URL_GROWTH * text_bound(_first(a), limit) + 2 * weight(_first(a), limit)


def _estimate_urlize(a: dict[str, Any], limit: int) -> float:
    """Each word may become ``<a href="https://WORD" rel=".." target="..">WORD</a>``, the text escaped."""
    text = text_bound(a["value"], limit)
    words = text if not isinstance(a["value"], str) else sum(a["value"].count(c) for c in " \t\r\n") + 1
    extra = sum(len(str(a.get(k) or "")) for k in ("target", "rel")) + 64
    return 2 * ESCAPE_GROWTH * text + words * extra


def _estimate_pprint(a: dict[str, Any], limit: int) -> float:
    value = a["value"]
    return _repr_string_size(value) if isinstance(value, str) else text_bound(value, limit, indent=1)


def _estimate_list(a: dict[str, Any], limit: int) -> int:
    value = a["value"]
    return 2 * len(value) if isinstance(value, str) else 0  # a string: one string per character


# filters that can build much more than they are given: (bound arguments, budget left) -> size of the result
_FILTER_ESTIMATES: dict[str, Callable[[dict[str, Any], int], float]] = {
    "upper": _grows(CASE_GROWTH),
    "lower": _grows(CASE_GROWTH),
    "title": _grows(CASE_GROWTH),
    "capitalize": _grows(CASE_GROWTH),
    "escape": _grows(ESCAPE_GROWTH),
    "e": _grows(ESCAPE_GROWTH),
    "forceescape": _grows(ESCAPE_GROWTH),
    "xmlattr": _estimate_xmlattr,
    "urlencode": _estimate_urlencode,
    "urlize": _estimate_urlize,
    "string": _grows(1),
    "pprint": _estimate_pprint,
    "list": _estimate_list,
    "center": _estimate_center,
    "indent": _estimate_indent,
    "format": _estimate_format,
    "replace": _estimate_replace,
    "join": _estimate_join,
    "wordwrap": _estimate_wordwrap,
    "batch": _estimate_batch,
    "sum": _estimate_sum,
}


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


__all__ = ["LimitedSandbox", "TemplateLimit", "weight"]
