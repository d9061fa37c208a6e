"""Tool calls streamed as the model writes them, as vLLM and llama.cpp stream them: once ``<tool_call>{"name":
"...", "arguments": `` is written, a first ``delta.tool_calls`` item goes out with the call's index, id, type and
name (and ``arguments: ""``), then the arguments in pieces as their text comes. The pieces add up to the
arguments JSON the plain answer gives (``json.dumps`` of the parsed object, ``ensure_ascii=False``): the text is
rewritten into that form as it comes (:class:`JsonRewriter`), and what is left at ``</tool_call>`` goes in a last
piece.

A call written otherwise (``arguments`` before ``name``, or not an object or a JSON string) is held and released
whole at ``</tool_call>``, as :class:`~clover_desk.worker.openai_schema.AnswerParser` does. Once a call's name went
out it stays a call: if its text then turns out not to be one (malformed JSON, never closed), the pieces sent stand
and the server logs a warning; the plain answer would hold that text as content instead. A stream cut short inside
such a call (``max_tokens``) ends with the finish_reason the plain answer has (``length``), not ``tool_calls``.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from clover_desk.worker.openai_schema import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    AnswerParser,
    _new_call_id,
    _partial_suffix,
    parse_tool_call,
)

log = logging.getLogger(__name__)

# the head of a call, up to the first character of its arguments (an object, or a JSON string of one)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=[{"])')
_HEAD_MAX_CHARS = 4096  # a head not found within this many characters is not looked for again: the call goes whole
_WHITESPACE = " \t\r\n"


class JsonRewriter:
    """JSON text rewritten as ``json.dumps(json.loads(text), ensure_ascii=False)`` writes it, as the text comes:
    whitespace between tokens dropped, ``", "`` and ``": "`` between items, strings with their escapes decoded and
    written again, numbers and literals as Python writes them again. ``push(text)`` returns what can go out now;
    ``done`` once the first value (an object or an array) is closed; ``broken`` when the text is not JSON (then
    nothing more comes out)."""

    def __init__(self) -> None:
        self.depth = 0
        self.done = False
        self.broken = False
        self._in_string = False
        self._escape = ""  # an escape sequence being read (from its backslash)
        self._scalar = ""  # a number or literal being read

    def push(self, text: str) -> str:
        out: list[str] = []
        for ch in text:
            if self.done or self.broken:
                break
            if self._in_string:
                out.append(self._string_char(ch))
                continue
            if self._scalar:
                if ch not in _WHITESPACE and ch not in ",:{}[]\"":
                    self._scalar += ch
                    continue
                out.append(self._end_scalar())
                if self.broken:
                    break
            self._structure(ch, out)
        return "".join(out)

    def _structure(self, ch: str, out: list[str]) -> None:
        if ch in _WHITESPACE:
            return
        if ch == '"':
            self._in_string = True
            out.append(ch)
        elif ch in "{[":
            self.depth += 1
            out.append(ch)
        elif ch in "}]":
            self.depth -= 1
            out.append(ch)
            self.done = self.depth <= 0
        elif ch == ",":
            out.append(", ")
        elif ch == ":":
            out.append(": ")
        elif self.depth > 0:
            self._scalar = ch
        else:
            self.broken = True

    def _end_scalar(self) -> str:
        text, self._scalar = self._scalar, ""
        try:
            return json.dumps(json.loads(text), ensure_ascii=False)
        except (json.JSONDecodeError, ValueError):
            self.broken = True
            return ""

    def _string_char(self, ch: str) -> str:
        if self._escape:
            self._escape += ch
            return self._escaped()
        if ch == "\\":
            self._escape = ch
            return ""
        if ch == '"':
            self._in_string = False
            return ch
        return json.dumps(ch, ensure_ascii=False)[1:-1]

    def _escaped(self) -> str:
        """The escape read so far, written again once it is whole ("" until then). A high surrogate waits for the
        escape after it, which ``json.loads`` pairs it with."""
        esc = self._escape
        if esc[1] != "u":
            return self._decode(esc)
        if len(esc) < 6:
            return ""
        if not 0xD800 <= _hex(esc[2:6]) <= 0xDBFF or len(esc) == 12:
            return self._decode(esc)
        if (len(esc) == 7 and esc[6] != "\\") or (len(esc) == 8 and esc[7] != "u"):  # a lone high surrogate
            out = self._decode(esc[:6])
            for ch in esc[6:]:
                out += self._string_char(ch)
            return out
        return ""

    def _decode(self, esc: str) -> str:
        self._escape = ""
        try:
            value = json.loads('"' + esc + '"')
        except (json.JSONDecodeError, ValueError):
            self.broken = True
            return ""
        if len(esc) == 12 and len(value) == 2:  # two escapes that are not a surrogate pair: each on its own
            return self._decode(esc[:6]) + self._decode(esc[6:])
        return json.dumps(value, ensure_ascii=False)[1:-1]


def _hex(text: str) -> int:
    try:
        return int(text, 16)
    except ValueError:
        return -1


class _CallStream:
    """One call's text as it comes (``push`` the whole inner text so far): its first delta once the head is
    read, then its arguments' pieces."""

    def __init__(self) -> None:
        self.seen = 0
        self.head = ""
        self.started = False
        self.gave_up = False
        self.whole = False  # the arguments are a JSON string: sent whole at the end
        self.sent = ""
        self.json = JsonRewriter()

    def push(self, inner: str) -> list[tuple[str, Any]]:
        new, self.seen = inner[self.seen:], len(inner)
        if self.started:
            return self._arguments(new)
        if self.gave_up:
            return []
        self.head += new
        match = _HEAD.match(self.head)
        if match is None:
            self.gave_up = len(self.head) > _HEAD_MAX_CHARS
            return []
        try:
            name = json.loads('"' + match.group(1) + '"')
        except json.JSONDecodeError:
            self.gave_up = True
            return []
        if not name:
            self.gave_up = True
            return []
        self.started = True
        rest = self.head[match.end():]
        self.whole = rest.startswith('"')
        first = ("tool_call_begin", {"id": _new_call_id(), "type": "function",
                                     "function": {"name": name, "arguments": ""}})
        return [first, *self._arguments(rest)]

    def _arguments(self, text: str) -> list[tuple[str, Any]]:
        if self.whole:
            return []
        piece = self.json.push(text)
        self.sent += piece
        return [("tool_call_arguments", piece)] if piece else []

    def close(self, inner: str) -> list[tuple[str, Any]]:
        """The items at ``</tool_call>`` of a started call: the rest of its arguments (its text as the plain
        answer parses it)."""
        out = self.push(inner)
        call = parse_tool_call(inner.strip())
        if call is None:
            log.warning("a streamed tool call turned out malformed; its pieces were sent as they came")
            return out
        final = call["function"]["arguments"]
        if not final.startswith(self.sent):
            log.warning("a streamed tool call's arguments differ from their parsed form; the pieces sent stand")
            return out
        rest = final[len(self.sent):]
        self.sent = final
        return [*out, ("tool_call_arguments", rest)] if rest else out


class StreamingAnswerParser(AnswerParser):
    """:class:`AnswerParser` for a stream: besides ``("content", str)`` and ``("tool_call", dict)`` (a call
    released whole), ``("tool_call_begin", {"id", "type", "function": {"name", "arguments": ""}})`` and
    ``("tool_call_arguments", str)`` items for the call begun last."""

    def __init__(self, parse_tools: bool, keep_leading: bool = False) -> None:
        super().__init__(parse_tools, keep_leading)
        self._call: _CallStream | None = None
        self.unfinished = False  # a call began going out and never closed (the answer was cut short in it)

    def feed(self, text: str) -> list[tuple[str, Any]]:
        if not self.parse_tools:
            return super().feed(text)
        out: list[tuple[str, Any]] = []
        self._buf += text
        while True:
            if not self._in_call:
                start = self._buf.find(TOOL_CALL_START)
                if start < 0:
                    keep = _partial_suffix(self._buf, TOOL_CALL_START)
                    self._text(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._text(self._buf[:start], out)
                self._buf = self._buf[start + len(TOOL_CALL_START):]
                self._in_call, self._call = True, _CallStream()
                continue
            assert self._call is not None
            end = self._buf.find(TOOL_CALL_END)
            if end < 0:
                keep = _partial_suffix(self._buf, TOOL_CALL_END)
                out += self._counted(self._call.push(self._buf[: len(self._buf) - keep]))
                return out
            inner, self._buf = self._buf[:end], self._buf[end + len(TOOL_CALL_END):]
            call, self._in_call, self._call = self._call, False, None
            if not call.started:
                out += self._counted(call.push(inner))
            if call.started:
                out += self._counted(call.close(inner))
                continue
            whole = parse_tool_call(inner.strip())
            if whole is None:
                self._text(TOOL_CALL_START + inner + TOOL_CALL_END, out)
            else:
                self.calls += 1
                out.append(("tool_call", whole))

    def _counted(self, items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        self.calls += sum(1 for kind, _ in items if kind == "tool_call_begin")
        return items

    def finish(self) -> list[tuple[str, Any]]:
        if self._in_call and self._call is not None and self._call.started:
            log.warning("a streamed tool call never closed; its pieces were sent as they came")
            self._buf, self._in_call, self._call, self.unfinished = "", False, None, True
            return []
        self._call = None
        return super().finish()
