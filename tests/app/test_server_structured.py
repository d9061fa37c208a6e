"""Structured output through the HTTP server (``response_format``, ``tool_choice`` required / named) with the
official ``openai`` client, on the tiny random checkpoint: random weights write JSON only because every token is
masked by the grammar. ~20 s on the shared 2-core test machine (spec mode, marked slow, ~20-30 s more)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from fixtures_tiny import one_torch_thread, tiny_clover_dir  # noqa: F401
from server_fixtures import NO_THINKING, client, running_server

from clover_desk.worker.openai_schema import ApiError, parse_chat_request

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 99},
                                           "tag": {"enum": ["red", "blue"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
        "additionalProperties": False}
HOUR = {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
        "required": ["hour"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "set_alarm", "parameters": HOUR}}]
ASK = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def server(tiny_clover_dir, one_torch_thread) -> Iterator[Any]:  # noqa: ANN001, F811
    with running_server(tiny_clover_dir) as s:
        yield s


def _create(server: Any, mode: str, **kwargs: Any) -> Any:
    return client(server).chat.completions.create(
        model="x", temperature=0, max_tokens=64, extra_body={**NO_THINKING, "clover": {"mode": mode}}, **kwargs)


@pytest.mark.parametrize("mode", ["ar", "diffusion", pytest.param("spec", marks=pytest.mark.slow)])  # spec: ~20-30 s
def test_json_schema_answers_validate(server: Any, mode: str) -> None:
    answer = _create(server, mode, messages=ASK, response_format={
        "type": "json_schema", "json_schema": {"name": "result", "schema": SCHEMA, "strict": True}})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert answer.clover["mode"] == mode


def test_json_object_answer_is_an_object(server: Any) -> None:
    answer = _create(server, "ar", messages=[{"role": "user", "content": "Some JSON please (4)."}],
                     response_format={"type": "json_object"}, max_completion_tokens=160)
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_tool_choice_required_answers_with_a_valid_call(server: Any, mode: str) -> None:
    answer = _create(server, mode, messages=[{"role": "user", "content": "Weather or alarm?"}], tools=TOOLS,
                     tool_choice="required")
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])


def test_a_named_tool_choice_calls_that_tool_also_streamed(server: Any) -> None:
    choice = {"type": "function", "function": {"name": "set_alarm"}}
    answer = _create(server, "ar", messages=[{"role": "user", "content": "Wake me."}], tools=TOOLS,
                     tool_choice=choice)
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "set_alarm"
    jsonschema.validate(json.loads(call.function.arguments), HOUR)
    chunks = list(_create(server, "diffusion", messages=[{"role": "user", "content": "Wake me."}], tools=TOOLS,
                          tool_choice=choice, stream=True))
    calls = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
    # streamed as vLLM does: the name in the first delta, the arguments in pieces after it
    assert [c.function.name for c in calls if c.function.name] == ["set_alarm"]
    assert {c.index for c in calls} == {0}
    jsonschema.validate(json.loads("".join(c.function.arguments or "" for c in calls)), HOUR)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_schema_the_engine_cannot_enforce_is_a_400_naming_the_field(server: Any) -> None:
    c = client(server)
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model="x", messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "array", "uniqueItems": True}}})
    assert exc.value.code == "unsupported_schema" and exc.value.param == "response_format.json_schema.schema"
    assert "uniqueItems" in exc.value.message
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {"not": {"type": "object"}}}}]
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model="x", messages=ASK, tools=bad_tool, tool_choice="required")
    assert exc.value.param == "tools[0].function.parameters" and '"not"' in exc.value.message


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice.function.name"),
    ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
    ({"tool_choice": "required", "tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "continue_final_message": True,
      "messages": [*ASK, {"role": "assistant", "content": "{"}]}, "continue_final_message"),
])
def test_bad_structured_fields_name_the_field(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as exc:
        parse_chat_request({"messages": ASK, **extra})
    assert exc.value.status == 400 and exc.value.param == param, exc.value.message


def test_auto_none_and_text_keep_free_text() -> None:
    for extra in ({}, {"response_format": {"type": "text"}}, {"tools": TOOLS, "tool_choice": "auto"},
                  {"tools": TOOLS, "tool_choice": "none"}):
        assert parse_chat_request({"messages": ASK, **extra}).params.structured is None
    forced = json.loads(parse_chat_request({"messages": ASK, "tools": TOOLS, "tool_choice": "required"})
                        .params.structured)
    assert forced["before"] == "<tool_call>\n" and forced["after"] == "\n</tool_call>"
    assert [o["properties"]["name"] for o in forced["json_schema"]["anyOf"]] == [{"const": "get_weather"},
                                                                                 {"const": "set_alarm"}]
