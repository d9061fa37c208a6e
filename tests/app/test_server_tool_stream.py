"""Streamed tool-call arguments (:mod:`clover_desk.worker.tool_stream`): the rewriter and the parser on their own,
and the real server through the official ``openai`` client, on a scripted model that writes its call in several
tokens (with non-canonical spacing and escapes), so that the arguments really come in pieces."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
from scripted_model import ScriptedModel, build_scripted_model
from server_fixtures import NO_THINKING, WEATHER_TOOL, assembled_tool_calls, client, running_server

from clover_desk.worker.openai_schema import AnswerParser
from clover_desk.worker.tool_stream import JsonRewriter, StreamingAnswerParser

# the call, in pieces the tokenizer gets as single tokens: spaced as json.dumps would not space it
PIECES = ['\n{"name": "get_weather", ', '"arguments": {"city" :', '"Paris",', '"days":3, ', '"note": "sunny \\u00e9"',
          "}}\n"]
CALL_TEXT = "".join(PIECES)
ARGUMENTS = json.dumps({"city": "Paris", "days": 3, "note": "sunny \u00e9"}, ensure_ascii=False)
SCRIPT = f"<tool_call>{CALL_TEXT}</tool_call><|im_end|>"
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]

JSON_TEXTS = [
    '{"city": "Paris"}',
    '{ "city" :"Pa\\"ris" ,"n":1.50, "e": 1e2, "neg": -0, "t":true,"f" : false , "z":null}',
    '{"a":[1, 2,[ ]],"b":{ } ,"s":"\\u00e9\\n\\t\\/\\\\ \\ud83d\\ude00 \\ud83d x \\u0041"}',
    "{}",
    '{"code": "def f(x):\\n    return x * 2\\n", "nested": {"k": [true, null, -3.25e-3]}}',
    '{"emoji":"\U0001f600\u00e9","ctl":"\\u001f"}',
    '{"lone":"\\ud83d\\u0041", "lone2": "\\ud83d\\n", "lone3":"\\ud83d"}',
]


@pytest.mark.parametrize("text", JSON_TEXTS)
def test_the_rewriter_writes_what_json_dumps_writes_however_the_text_is_cut(text: str) -> None:
    want = json.dumps(json.loads(text), ensure_ascii=False)
    rng = random.Random(text)
    for _ in range(40):
        rewriter, out, i = JsonRewriter(), "", 0
        while i < len(text):
            n = rng.randint(1, 6)
            out += rewriter.push(text[i:i + n])
            i += n
        assert out == want and rewriter.done and not rewriter.broken
    assert JsonRewriter().push(text + "}} trailing") == want  # nothing after the value comes out


def test_the_rewriter_stops_at_what_is_not_json() -> None:
    rewriter = JsonRewriter()
    assert rewriter.push('{"a": tru') == '{"a": '
    assert rewriter.push("x}") == "" and rewriter.broken


def _stream(parser: StreamingAnswerParser, text: str, cut: int) -> list[tuple[str, Any]]:
    items = []
    for i in range(0, len(text), cut):
        items += parser.feed(text[i:i + cut])
    return items + parser.finish()


def _assembled(items: list[tuple[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """(the content, the calls) of a parser's items, put together."""
    content, calls = "", []
    for kind, value in items:
        if kind == "content":
            content += value
        elif kind == "tool_call_arguments":
            calls[-1]["function"]["arguments"] += value
        else:
            calls.append(json.loads(json.dumps(value)))
    return content, calls


@pytest.mark.parametrize("text", [
    f"Sure.<tool_call>{CALL_TEXT}</tool_call>",
    f"<tool_call>{CALL_TEXT}</tool_call>\n<tool_call>" + '{"name": "b", "arguments": "{\\"x\\": [1,2]}"}</tool_call>',
    '<tool_call>{"arguments": {"x": 1}, "name": "first_args"}</tool_call> after',  # not streamable: whole
    "<tool_call>not json</tool_call> and <tool_call",  # not a call: content, as the plain parser has it
    "no calls at all <tool_ call>",
])
def test_the_streaming_parser_adds_up_to_the_plain_parser(text: str) -> None:
    plain = AnswerParser(True)
    content, calls = _assembled(plain.feed(text) + plain.finish())
    for cut in (1, 2, 3, 7, len(text)):
        streamed_content, streamed_calls = _assembled(_stream(StreamingAnswerParser(True), text, cut))
        assert streamed_content == content, cut
        assert [c["function"] for c in streamed_calls] == [c["function"] for c in calls], cut
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in streamed_calls)


def test_the_name_goes_out_first_then_the_arguments_in_pieces() -> None:
    parser = StreamingAnswerParser(True)
    items = []
    for piece in ["<tool_call>", *PIECES, "</tool_call>"]:
        items.append(parser.feed(piece))
    begun = [i for i, batch in enumerate(items) if any(kind == "tool_call_begin" for kind, _ in batch)]
    assert begun == [2]  # once '"arguments": {' is written
    (first,) = [v for kind, v in items[2] if kind == "tool_call_begin"]
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    pieces = [v for batch in items for kind, v in batch if kind == "tool_call_arguments"]
    assert len(pieces) >= 4 and "".join(pieces) == ARGUMENTS
    assert parser.calls == 1


@pytest.fixture(scope="module")
def pieces_model(tmp_path_factory: pytest.TempPathFactory) -> ScriptedModel:
    return build_scripted_model(tmp_path_factory.mktemp("pieces_model"), thinking=f"Need it</think>{SCRIPT}",
                                no_thinking=SCRIPT, extra_tokens=PIECES)


@pytest.fixture(scope="module")
def pieces_server(pieces_model: ScriptedModel) -> Iterator[Any]:
    with running_server(pieces_model.path) as server:
        yield server


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_streamed_arguments_add_up_to_the_plain_answer_s(pieces_server, mode: str) -> None:  # noqa: ANN001
    c = client(pieces_server)
    body = {"model": "x", "messages": QUESTION, "tools": [WEATHER_TOOL],
            "extra_body": {**NO_THINKING, "clover": {"mode": mode}}}
    plain = c.chat.completions.create(**body)
    (call,) = plain.choices[0].message.tool_calls
    assert call.function.arguments == ARGUMENTS  # the plain answer as before: json.dumps of the parsed arguments
    assert plain.choices[0].finish_reason == "tool_calls" and plain.choices[0].message.content is None

    chunks = list(c.chat.completions.create(stream=True, **body))
    (streamed,) = assembled_tool_calls(chunks)
    assert streamed["arguments"] == call.function.arguments
    assert (streamed["index"], streamed["type"], streamed["name"]) == (0, "function", "get_weather")
    assert streamed["id"].startswith("call_")
    deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    if mode == "ar":  # one token at a time: the arguments come as they are written
        assert streamed["pieces"] >= 4
    assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["tool_calls"]


def test_streamed_call_after_reasoning(pieces_server) -> None:  # noqa: ANN001
    chunks = list(client(pieces_server).chat.completions.create(
        model="x", messages=QUESTION, tools=[WEATHER_TOOL], stream=True, extra_body={"clover": {"mode": "ar"}}))
    assert "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks if ch.choices) == "Need it"
    (streamed,) = assembled_tool_calls(chunks)
    assert streamed["arguments"] == ARGUMENTS and streamed["pieces"] >= 4


def test_a_stream_cut_short_inside_a_call_ends_with_length(pieces_server) -> None:  # noqa: ANN001
    """max_tokens ends the answer inside the call: the plain answer gives its text as content, the stream has sent
    the call's first pieces; both say "length", not "tool_calls"."""
    c = client(pieces_server)
    body = {"model": "x", "messages": QUESTION, "tools": [WEATHER_TOOL], "max_tokens": 4,
            "extra_body": {**NO_THINKING, "clover": {"mode": "ar"}}}  # <tool_call> and 3 pieces
    plain = c.chat.completions.create(**body)
    assert plain.choices[0].finish_reason == "length" and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content == "<tool_call>" + "".join(PIECES[:3]).rstrip()
    chunks = list(c.chat.completions.create(stream=True, **body))
    (streamed,) = assembled_tool_calls(chunks)
    assert streamed["name"] == "get_weather" and ARGUMENTS.startswith(streamed["arguments"])
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
