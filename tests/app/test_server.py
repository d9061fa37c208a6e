"""``clover-desk serve``'s OpenAI-compatible server, through the official ``openai`` client (and raw HTTP where a
client would never send such bytes), on scripted tiny models that write known text (tests/scripted_model.py)."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from server_fixtures import (  # noqa: F401 - fixtures
    NO_THINKING,
    TOOL_JSON,
    WEATHER_TOOL,
    assembled_tool_calls,
    chat_model,
    chat_server,
    client,
    endless_model,
    endless_server,
    running_server,
    tools_model,
    tools_server,
    wait_idle,
)
from server_fixtures import (
    serve_process as _serve,
)
from server_fixtures import (
    served as _served,
)

from clover_desk.worker.server import AnswerParser, parse_chat_request, parse_completion_request

HI = [{"role": "user", "content": "Hello there"}]


def _raw(server: Any, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, Any, bytes]:
    """(status, headers (names in any case, as HTTP has them), body)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def _error_of(raw: bytes) -> dict[str, Any]:
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _joined(chunks: list[Any], key: str) -> str:
    """The text of one delta field over a stream (extra fields such as reasoning_content are absent when unsent)."""
    return "".join(getattr(c.choices[0].delta, key, None) or "" for c in chunks if c.choices)


def _still_answers(server: Any) -> None:
    answer = client(server).chat.completions.create(model="any", messages=HI, max_tokens=3, extra_body=NO_THINKING)
    assert answer.choices[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------------------------------------------------------
# chat


def test_models_and_health(chat_server, chat_model) -> None:  # noqa: ANN001
    c = client(chat_server)
    assert [m.id for m in c.models.list()] == [chat_model.path.name]
    assert c.models.retrieve(chat_model.path.name).id == chat_model.path.name
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")
    status, _, raw = _raw(chat_server, "GET", "/health")
    health = json.loads(raw)
    assert status == 200 and health["status"] == "ok" and health["model"] == chat_model.path.name


def test_non_streaming_answer_with_reasoning_usage_and_clover_extras(chat_server, chat_model) -> None:  # noqa: ANN001
    from clover_desk.engine.api import Engine

    answer = client(chat_server).chat.completions.create(model="clover", messages=HI)
    choice = answer.choices[0]
    assert (choice.message.content, choice.message.reasoning_content) == ("Sure thing.", "Let me think")
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    engine = Engine.load(chat_model.path)
    prompt = engine.prompt_ids(messages=HI, enable_thinking=True)
    written = chat_model.chains[prompt[-1]]
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == len(written)
    assert answer.usage.total_tokens == len(prompt) + len(written)
    extras = answer.clover
    assert extras["mode"] == "diffusion" and extras["block_size"] == 32 and extras["threshold"] == 0.95
    assert extras["passes"] >= len(written) and extras["tokens_per_pass"] == pytest.approx(
        len(written) / extras["passes"], abs=1e-3)
    assert extras["stop_reason"] == "eos" and extras["ignored_fields"] == [] and extras["blocks"] >= 1
    assert answer.model == chat_model.path.name and answer.id.startswith("chatcmpl-")


def test_streaming_answer(chat_server) -> None:  # noqa: ANN001
    chunks = list(client(chat_server).chat.completions.create(
        model="clover", messages=HI, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (_joined(chunks, "reasoning_content"), _joined(chunks, "content")) == ("Let me think", "Sure thing.")
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    assert finals[0].clover["mode"] == "diffusion" and finals[0].clover["passes"] >= 13
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 13
    assert len({c.id for c in chunks}) == 1
    plain = list(client(chat_server).chat.completions.create(model="clover", messages=HI, stream=True))
    assert all(c.usage is None for c in plain)  # usage only when asked for, as OpenAI does


def test_stream_is_server_sent_events(chat_server) -> None:  # noqa: ANN001
    body = json.dumps({"model": "x", "messages": HI, "stream": True}).encode()
    status, headers, raw = _raw(chat_server, "POST", "/v1/chat/completions", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = raw.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"


def test_thinking_off_and_ar_mode(chat_server) -> None:  # noqa: ANN001
    c = client(chat_server)
    answer = c.chat.completions.create(model="clover", messages=HI, extra_body=NO_THINKING)
    assert (answer.choices[0].message.content, answer.choices[0].message.reasoning_content) == ("Plain answer!", None)
    chunks = list(c.chat.completions.create(model="clover", messages=HI, stream=True, extra_body=NO_THINKING))
    assert (_joined(chunks, "reasoning_content"), _joined(chunks, "content")) == ("", "Plain answer!")
    ar = c.chat.completions.create(model="clover", messages=HI, extra_body={"clover": {"mode": "ar"}})
    assert (ar.choices[0].message.content, ar.choices[0].message.reasoning_content) == ("Sure thing.", "Let me think")
    assert ar.clover["mode"] == "ar" and ar.clover["passes"] == ar.usage.completion_tokens
    assert ar.clover["block_size"] is None
    short = c.chat.completions.create(model="clover", messages=HI, max_tokens=3, extra_body=NO_THINKING)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


# ---------------------------------------------------------------------------------------------------------------
# stop sequences


def test_usage_counts_the_prompt_tokens_a_chats_next_turn_had_cached(chat_server, chat_model) -> None:  # noqa: ANN001
    """OpenAI's ``usage.prompt_tokens_details.cached_tokens``: what the engine's prompt cache held of the prompt
    (the last turn's whole 32-token blocks before its generation prompt), 0 for a prompt it has not seen."""
    from clover_desk.engine.api import Engine

    c = client(chat_server)
    question = [{"role": "user", "content": " ".join(f"point {i} of the plan" for i in range(40))}]
    first = c.chat.completions.create(model="clover", messages=question)
    assert first.usage.prompt_tokens_details.cached_tokens == 0 and first.usage.prompt_tokens > 64
    turn = [*question, {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And then?"}]
    chunks = list(c.chat.completions.create(model="clover", messages=turn, stream=True,
                                            stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    cached = usage.prompt_tokens_details.cached_tokens
    ids = Engine.load(chat_model.path).prompt_ids(messages=question, enable_thinking=True)
    im_start = ids[::-1].index(ids[0])  # (the chat's first token starts each turn) tokens from the last one to the end
    assert cached == (len(ids) - 1 - im_start) // 32 * 32 > 0
    assert _joined(chunks, "content") == first.choices[0].message.content  # the scripted answer, as without it


def test_a_stop_sequence_ends_the_answer_before_it(chat_server) -> None:  # noqa: ANN001
    c = client(chat_server)
    before = wait_idle(chat_server)
    answer = c.chat.completions.create(model="clover", messages=HI, stop=["thing", "never"])
    message = answer.choices[0].message
    assert (message.reasoning_content, message.content) == ("Let me think", "Sure")  # not in the reasoning
    assert answer.choices[0].finish_reason == "stop"
    assert (answer.clover["stop_reason"], answer.clover["stop_sequence"]) == ("stop_sequence", "thing")
    chunks = list(c.chat.completions.create(model="clover", messages=HI, stop="ing.", stream=True,
                                            extra_body={"clover": {"mode": "ar"}}))
    assert (_joined(chunks, "reasoning_content"), _joined(chunks, "content")) == ("Let me think", "Sure th")
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert final.choices[0].finish_reason == "stop" and final.clover["stop_sequence"] == "ing."
    after = wait_idle(chat_server)
    assert after["completed"] == before["completed"] + 2 and after["cancelled"] == before["cancelled"]
    # one that never comes changes nothing
    whole = c.chat.completions.create(model="clover", messages=HI, stop=["zebra"])
    assert whole.choices[0].message.content == "Sure thing." and "stop_sequence" not in whole.clover


def test_a_stop_sequence_cancels_an_endless_answer(endless_server) -> None:  # noqa: ANN001
    """Thinking off, the endless model writes "tick tock tick tock ..." until max_tokens: a stop sequence ends it
    within a pass, streamed or not."""
    c = client(endless_server)
    for stream in (False, True):
        kwargs = {"model": "clover", "messages": HI, "max_tokens": 3000, "stop": [" tock tick"],
                  "extra_body": {**NO_THINKING, "clover": {"mode": "ar"}}}
        if stream:
            chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
            content, usage = _joined(chunks, "content"), chunks[-1].usage
        else:
            answer = c.chat.completions.create(**kwargs)
            content, usage = answer.choices[0].message.content, answer.usage
        assert content == "tick", stream
        assert usage.completion_tokens < 10, usage  # cancelled at once in AR mode, not 3,000 tokens later
    _still_answers(endless_server)


@pytest.mark.parametrize("cut", range(1, 12))
def test_stop_scanner_finds_a_sequence_split_anywhere(cut: int) -> None:
    from clover_desk.worker.server import StopScanner

    text = "tick tock tick tock"
    scanner = StopScanner([" tock t", "zzz"])
    out = scanner.feed(text[:cut]) + scanner.feed(text[cut:]) + scanner.finish()
    assert (out, scanner.hit) == ("tick", " tock t")
    plain = StopScanner(["tock!"])
    released = plain.feed(text[:cut]) + plain.feed(text[cut:])
    assert released == "tick tock tick "  # the last "tock" is held: it may still become "tock!"
    assert plain.finish() == "tock" and plain.hit is None


# ---------------------------------------------------------------------------------------------------------------
# /v1/completions: a raw prompt, the text as written


def _template(model_dir: Any, enable_thinking: bool = True) -> str:
    from clover_desk.engine.decode.tokenizer import CloverTokenizer

    return CloverTokenizer.from_dir(model_dir).apply_chat_template(HI, enable_thinking=enable_thinking)


def test_a_raw_completion_returns_the_text_as_written(chat_server, chat_model) -> None:  # noqa: ANN001
    c = client(chat_server)
    prompt = _template(chat_model.path)  # ends with the generation prompt, "<think>\n": the script follows
    answer = c.completions.create(model="clover", prompt=prompt, max_tokens=50)
    choice = answer.choices[0]
    assert choice.text == "Let me think</think>Sure thing." and choice.finish_reason == "stop"  # markers kept
    assert answer.object == "text_completion" and answer.id.startswith("cmpl-")
    from clover_desk.engine.decode.tokenizer import CloverTokenizer

    ids = CloverTokenizer.from_dir(chat_model.path).encode(prompt)
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(ids), 13)
    assert answer.clover["mode"] == "diffusion" and answer.clover["stop_reason"] == "eos"
    chunks = list(c.completions.create(model="clover", prompt=ids, max_tokens=50, stream=True,
                                       stream_options={"include_usage": True}))  # token ids work too
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "Let me think</think>Sure thing."
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == 13 and {ch.object for ch in chunks} == {"text_completion"}
    stopped = c.completions.create(model="clover", prompt=prompt, max_tokens=50, stop=["</think>"])
    assert (stopped.choices[0].text, stopped.clover["stop_sequence"]) == ("Let me think", "</think>")


def test_a_completion_writes_16_tokens_unless_told(endless_server, endless_model) -> None:  # noqa: ANN001
    prompt = _template(endless_model.path, enable_thinking=False)  # "tick tock ..." for ever after this
    answer = client(endless_server).completions.create(model="clover", prompt=prompt,
                                                       extra_body={"clover": {"mode": "ar"}})
    assert answer.usage.completion_tokens == 16 and answer.choices[0].finish_reason == "length"  # as OpenAI's
    assert answer.choices[0].text.startswith("tick tock tick")


@pytest.mark.parametrize(("extra", "param", "code"), [
    ({}, "prompt", "invalid_value"),
    ({"prompt": ""}, "prompt", "invalid_value"),
    ({"prompt": ["a", "b"]}, "prompt", "invalid_value"),
    ({"prompt": [1, 10 ** 9]}, "prompt", "invalid_value"),
    ({"prompt": "hi", "echo": True}, "echo", "unsupported_parameter"),
    ({"prompt": "hi", "suffix": "end"}, "suffix", "unsupported_parameter"),
    ({"prompt": "hi", "best_of": 2}, "best_of", "unsupported_parameter"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "invalid_value"),
])
def test_a_bad_completion_request_is_a_400_naming_the_field(chat_server, extra: dict[str, Any], param: str,
                                                             code: str) -> None:  # noqa: ANN001
    status, _, raw = _raw(chat_server, "POST", "/v1/completions", json.dumps({"model": "x", **extra}).encode())
    error = _error_of(raw)
    assert (status, error["param"], error["code"]) == (400, param, code), error


# ---------------------------------------------------------------------------------------------------------------
# tools


def test_tool_call_round_trip(tools_server, tools_model) -> None:  # noqa: ANN001
    from clover_desk.engine.api import Engine

    c = client(tools_server)
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = c.chat.completions.create(model="clover", messages=question, tools=[WEATHER_TOOL], extra_body=NO_THINKING)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    # the answer goes back as the assistant turn, the result as a tool message: both through the chat template
    followup = [*question, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    second = c.chat.completions.create(model="clover", messages=followup, tools=[WEATHER_TOOL], extra_body=NO_THINKING)
    assert second.choices[0].finish_reason == "tool_calls"  # the scripted model always calls the tool
    engine = Engine.load(tools_model.path)
    rendered = [*question,
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "sunny, 24 C"}]
    expected = engine.prompt_ids(messages=rendered, tools=[WEATHER_TOOL], enable_thinking=False)
    assert second.usage.prompt_tokens == len(expected)
    text = engine.tokenizer.decode(expected, skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in text


def test_tool_call_streamed_and_with_reasoning(tools_server) -> None:  # noqa: ANN001
    c = client(tools_server)
    chunks = list(c.chat.completions.create(model="clover", messages=HI, tools=[WEATHER_TOOL], stream=True,
                                            extra_body=NO_THINKING))
    calls = assembled_tool_calls(chunks)
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]

    thought = c.chat.completions.create(model="clover", messages=HI, tools=[WEATHER_TOOL])
    message = thought.choices[0].message
    assert message.reasoning_content == "Need the weather" and message.content is None
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_without_tools_a_tool_call_stays_text(tools_server) -> None:  # noqa: ANN001
    c = client(tools_server)
    for extra in ({}, {"tool_choice": "none", "tools": [WEATHER_TOOL]}):
        answer = c.chat.completions.create(model="clover", messages=HI, extra_body={**NO_THINKING, **extra})
        assert answer.choices[0].message.content == f"<tool_call>{TOOL_JSON}</tool_call>"
        assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "stop"


def _merged(items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Consecutive content pieces as one (the parser releases content as soon as it knows it is content)."""
    out: list[tuple[str, Any]] = []
    for kind, value in items:
        if kind == "content" and out and out[-1][0] == "content":
            out[-1] = ("content", out[-1][1] + value)
        else:
            out.append((kind, value))
    return out


def test_answer_parser_streams_calls_split_anywhere() -> None:
    text = f'Let me check.\n<tool_call>\n{TOOL_JSON}\n</tool_call>\n<tool_call>{{"name": "f", "arguments": {{}}}}</tool_call>\n'
    whole = AnswerParser(True)
    expected = whole.feed(text) + whole.finish()
    assert [kind for kind, _ in expected] == ["content", "tool_call", "tool_call"]
    assert expected[0][1] == "Let me check."
    assert [json.loads(v["function"]["arguments"]) for k, v in expected if k == "tool_call"] == [{"city": "Paris"}, {}]
    for cut in range(1, len(text)):  # any two pieces give the same items (call ids aside)
        parser = AnswerParser(True)
        items = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()
        merged = "".join(v for k, v in items if k == "content")
        assert merged == "Let me check.", cut
        assert [v["function"] for k, v in items if k == "tool_call"] == [v["function"] for k, v in expected
                                                                         if k == "tool_call"], cut
    parser = AnswerParser(True)
    char_by_char = _merged([item for ch in text for item in parser.feed(ch)] + parser.finish())
    assert [k for k, _ in char_by_char] == ["content", "tool_call", "tool_call"]
    assert char_by_char[0] == ("content", "Let me check.")


@pytest.mark.parametrize("text", ["<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                                  '<tool_call>{"name": "f", "arguments": {', "a <tool_ca"])
def test_answer_parser_keeps_what_is_not_a_call_as_text(text: str) -> None:
    parser = AnswerParser(True)
    assert _merged(parser.feed(text) + parser.finish()) == [("content", text)]
    plain = AnswerParser(False)
    assert plain.feed(f"<tool_call>{TOOL_JSON}</tool_call>") + plain.finish() == [
        ("content", f"<tool_call>{TOOL_JSON}</tool_call>")]


@pytest.mark.parametrize("parse", [parse_chat_request, parse_completion_request])
@pytest.mark.parametrize("stream", [None, False])
def test_stream_options_without_stream_is_a_400(parse, stream: bool | None) -> None:  # noqa: ANN001
    from clover_desk.worker.server import ApiError

    body = {"model": "m", "messages": HI, "prompt": "hi", "stream_options": {"include_usage": True}}
    if stream is not None:
        body["stream"] = stream
    with pytest.raises(ApiError) as exc:
        parse(body)
    assert (exc.value.status, exc.value.param) == (400, "stream_options") and "stream" in str(exc.value)
    assert parse({**body, "stream": True}).include_usage  # with a stream they are read
    assert not parse({**body, "stream_options": None}).stream  # null is no options


def test_request_messages_in_template_form() -> None:
    request = parse_chat_request({
        "model": "m",
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
            {"role": "user", "content": "hi", "name": "ann"},
            {"role": "assistant", "content": None, "reasoning_content": "hm",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
        ],
        "tools": [WEATHER_TOOL], "tool_choice": "auto", "temperature": 0.5, "top_k": -1, "seed": 7,
        "chat_template_kwargs": {"enable_thinking": False, "other": 1}, "user": "u1",
    })
    assert request.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "reasoning_content": "hm",
         "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "2"},
    ]
    p = request.params
    assert (p.temperature, p.top_k, p.seed, p.enable_thinking) == (0.5, 0, 7, False)
    assert request.tools == [WEATHER_TOOL] and request.ignored_fields == ("chat_template_kwargs.other",)


# ---------------------------------------------------------------------------------------------------------------
# cancelling, queueing, concurrency


def test_closing_the_stream_cancels_the_generation(endless_server) -> None:  # noqa: ANN001
    before = wait_idle(endless_server)
    stream = client(endless_server).chat.completions.create(model="clover", messages=HI, stream=True,
                                                            extra_body=NO_THINKING)
    seen = ""
    for chunk in stream:
        seen += chunk.choices[0].delta.content or "" if chunk.choices else ""
        if "tock" in seen:
            break
    stream.close()
    after = wait_idle(endless_server, timeout_s=5)  # the endless answer would run for ~4000 tokens
    assert after["cancelled"] == before["cancelled"] + 1 and after["completed"] == before["completed"]
    _still_answers(endless_server)


def test_closing_a_silent_stream_cancels_it(endless_server) -> None:  # noqa: ANN001
    """A stream with nothing to send (an unfinished tool call is held back) is cancelled all the same: the server
    watches the connection, not only its own writes."""
    before = wait_idle(endless_server)
    stream = client(endless_server).chat.completions.create(model="clover", messages=HI, stream=True,
                                                            tools=[WEATHER_TOOL])
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    time.sleep(0.3)
    assert endless_server.health()["busy"]
    stream.close()
    after = wait_idle(endless_server, timeout_s=5)
    assert after["cancelled"] == before["cancelled"] + 1
    _still_answers(endless_server)


def test_a_client_that_hangs_up_on_a_plain_request_cancels_it(endless_server) -> None:  # noqa: ANN001
    before = wait_idle(endless_server)
    body = json.dumps({"model": "x", "messages": HI, **NO_THINKING}).encode()
    sock = socket.create_connection((endless_server.host, endless_server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 5
    while not endless_server.health()["busy"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    sock.close()
    after = wait_idle(endless_server, timeout_s=5)
    assert after["cancelled"] == before["cancelled"] + 1
    _still_answers(endless_server)


def test_requests_wait_their_turn(endless_server) -> None:  # noqa: ANN001
    wait_idle(endless_server)
    c = client(endless_server)
    endless = c.chat.completions.create(model="clover", messages=HI, stream=True, extra_body=NO_THINKING)
    next(iter(endless))  # generating now
    result: dict[str, Any] = {}

    def second() -> None:
        result["answer"] = c.chat.completions.create(model="x", messages=HI, max_tokens=4, extra_body=NO_THINKING)

    waiter = threading.Thread(target=second)
    waiter.start()
    deadline = time.monotonic() + 5
    while endless_server.health()["waiting"] != 1:
        assert time.monotonic() < deadline, endless_server.health()
        time.sleep(0.02)
    time.sleep(0.3)
    assert "answer" not in result  # still queued behind the endless answer
    endless.close()
    waiter.join(timeout=10)
    assert result["answer"].choices[0].message.content.startswith("tick")
    assert result["answer"].choices[0].finish_reason == "length"


class _CountingEngine:
    """The real engine, counting how many generations run at the same moment."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self.active = 0
        self.most = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, **kwargs: Any) -> Iterator[Any]:
        events = self._engine.generate(**kwargs)

        def counted() -> Iterator[Any]:
            with self._lock:
                self.active += 1
                self.most = max(self.most, self.active)
            try:
                for event in events:
                    time.sleep(0.001)  # widen the window in which a second generation could overlap
                    yield event
            finally:
                with self._lock:
                    self.active -= 1

        return counted()


def test_concurrent_clients_are_served_one_at_a_time_without_mixing(chat_model) -> None:  # noqa: ANN001
    from clover_desk.engine.api import Engine

    engine = _CountingEngine(Engine.load(chat_model.path))
    with running_server(chat_model.path, engine=engine) as server:
        c = client(server)
        start = threading.Barrier(6)
        answers: dict[int, tuple[str | None, str | None]] = {}

        def ask(i: int) -> None:
            thinking = i % 2 == 0
            extra = {} if thinking else NO_THINKING
            start.wait()
            if i % 3 == 0:
                chunks = list(c.chat.completions.create(model="x", messages=HI, stream=True, extra_body=extra))
                answers[i] = (_joined(chunks, "content"), _joined(chunks, "reasoning_content") or None)
            else:
                message = c.chat.completions.create(model="x", messages=HI, extra_body=extra).choices[0].message
                answers[i] = (message.content, message.reasoning_content)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert answers == {i: ("Sure thing.", "Let me think") if i % 2 == 0 else ("Plain answer!", None)
                           for i in range(6)}
        assert engine.most == 1
        assert wait_idle(server)["completed"] == 6


class _FailingEngine(_CountingEngine):
    """The real engine, failing with an engine bug once the prompt is in (what a CUDA error would look like)."""

    def generate(self, **kwargs: Any) -> Iterator[Any]:
        events = self._engine.generate(**kwargs)

        def failing() -> Iterator[Any]:
            yield next(events)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        return failing()


def test_an_engine_failure_is_a_500_and_the_server_keeps_serving(chat_model) -> None:  # noqa: ANN001
    from clover_desk.engine.api import Engine

    engine = _FailingEngine(Engine.load(chat_model.path))
    with running_server(chat_model.path, engine=engine) as server:
        c = client(server)
        with pytest.raises(openai.InternalServerError) as exc:
            c.chat.completions.create(model="x", messages=HI)
        assert exc.value.code == "generation_failed" and "illegal memory access" in exc.value.message
        with pytest.raises(openai.APIError, match="illegal memory access"):
            list(c.chat.completions.create(model="x", messages=HI, stream=True))
        health = wait_idle(server)
        assert (health["failed"], health["completed"], health["rejected"]) == (2, 0, 0)
        engine.generate = engine._engine.generate  # the device recovers
        _still_answers(server)


# ---------------------------------------------------------------------------------------------------------------
# bad requests


@pytest.fixture(scope="module")
def strict_server(chat_model) -> Iterator[Any]:  # noqa: ANN001
    """A small body limit (64 KiB) and context (96 tokens) so that both are easy to pass."""
    with running_server(chat_model.path, max_body_bytes=64 * 1024, ctx_tokens=96) as server:
        yield server


def test_malformed_json_is_a_400(strict_server) -> None:  # noqa: ANN001
    hi = json.dumps(HI).encode()
    for body in (b'{"model": "x", "messages": [', b"\xff\xfe", b'{"messages": %s, "temperature": NaN}' % hi,
                 b'{"messages": %s, "top_p": Infinity}' % hi, b"[1, 2]", b"", b"[" * 30_000 + b"]" * 30_000):
        status, _, raw = _raw(strict_server, "POST", "/v1/chat/completions", body)
        error = _error_of(raw)
        assert status == 400 and error["type"] == "invalid_request_error", (body[:20], error)
        assert error["code"] == "invalid_json" and error["param"] is None, (body[:20], error)
    _still_answers(strict_server)


def test_oversized_body_is_a_413(strict_server) -> None:  # noqa: ANN001
    body = json.dumps({"model": "x", "messages": [{"role": "user", "content": "a" * 100_000}]}).encode()
    status, headers, raw = _raw(strict_server, "POST", "/v1/chat/completions", body)
    assert status == 413 and _error_of(raw)["code"] == "request_too_large"
    assert headers.get("Connection") == "close"
    sock = socket.create_connection((strict_server.host, strict_server.port))  # no Content-Length at all
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    reply = b""
    while chunk := sock.recv(65536):  # the server closes the connection after refusing
        reply += chunk
    sock.close()
    reply = reply.decode()
    assert reply.startswith("HTTP/1.1 411") and '"length_required"' in reply
    _still_answers(strict_server)


def test_unknown_fields_are_ignored_and_listed(strict_server) -> None:  # noqa: ANN001
    answer = client(strict_server).chat.completions.create(
        model="x", messages=HI, user="someone", extra_body={**NO_THINKING, "frobnicate": True, "best_of": 3})
    assert answer.choices[0].message.content == "Plain answer!"
    assert answer.clover["ignored_fields"] == ["frobnicate", "best_of"]


_UNSUPPORTED = {"n", "response_format", "frequency_penalty", "messages[0].content[0]"}


@pytest.mark.parametrize(("extra", "param"), [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": 1e-5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_completion_tokens": 2.5}, "max_completion_tokens"),
    ({"seed": -1}, "seed"),
    ({"top_k": -2}, "top_k"),
    ({"presence_penalty": 1e300 * 10}, "presence_penalty"),
    ({"stream": "yes"}, "stream"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"function": {}}]}]},
     "messages[1].tool_calls[0]"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"clover": {"mode": "fast"}}, "clover.mode"),
    ({"clover": {"blocksize": 4}}, "clover.blocksize"),
    ({"clover": {"threshold": 2}}, "clover.threshold"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
    ({"n": 2}, "n"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": ["x" * 257]}, "stop"),
    ({"response_format": {"type": "json_object"}, "tools": [WEATHER_TOOL], "tool_choice": "required"},
     "response_format"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
])
def test_bad_fields_are_a_400_naming_the_field(strict_server, extra: dict[str, Any], param: str) -> None:  # noqa: ANN001
    body = {"model": "x", "messages": HI, **extra}
    status, _, raw = _raw(strict_server, "POST", "/v1/chat/completions", json.dumps(body).encode())
    error = _error_of(raw)
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error", error
    assert param.split(".")[0].split("[")[0] in error["message"]
    code = ("unsupported_parameter" if param in _UNSUPPORTED else
            "unknown_parameter" if param == "clover.blocksize" else "invalid_value")
    assert error["code"] == code, error


def test_prompt_over_the_context_is_refused(strict_server) -> None:  # noqa: ANN001
    c = client(strict_server)
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model="x", messages=[{"role": "user", "content": "harbour town " * 60}])
    assert exc.value.code == "context_length_exceeded" and "96" in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:  # the prompt fits, the asked-for answer does not
        c.chat.completions.create(model="x", messages=HI, max_tokens=90)
    assert exc.value.code == "context_length_exceeded"
    fits = c.chat.completions.create(model="x", messages=HI, extra_body=NO_THINKING)  # the default answer is capped
    assert fits.choices[0].message.content == "Plain answer!"


def test_unknown_paths_and_methods(strict_server) -> None:  # noqa: ANN001
    status, _, raw = _raw(strict_server, "GET", "/v1/embeddings")
    assert status == 404 and _error_of(raw)["code"] == "not_found"
    assert "/v1/completions" in _error_of(raw)["message"]  # what this server has
    status, _, raw = _raw(strict_server, "GET", "/v1/completions")
    assert status == 405 and _error_of(raw)["code"] == "method_not_allowed"
    status, _, raw = _raw(strict_server, "GET", "/v1/chat/completions")
    assert status == 405 and _error_of(raw)["code"] == "method_not_allowed"
    status, _, raw = _raw(strict_server, "DELETE", "/v1/models")
    assert status == 405
    status, _, raw = _raw(strict_server, "BREW", "/v1/models")
    assert status == 501 and _error_of(raw)["type"] == "invalid_request_error"
    _still_answers(strict_server)


def test_api_key(chat_model) -> None:  # noqa: ANN001
    with running_server(chat_model.path, api_key="sekrit") as server:
        with pytest.raises(openai.AuthenticationError) as exc:
            client(server, api_key="wrong").chat.completions.create(model="x", messages=HI)
        assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"
        for headers in ({}, {"Authorization": "Basic c2Vrcml0"}, {"Authorization": "Bearer sekri"}):
            status, got, raw = _raw(server, "GET", "/v1/models", headers=headers)
            assert status == 401 and got["WWW-Authenticate"] == "Bearer" and _error_of(raw)["code"] == "invalid_api_key"
        assert _raw(server, "GET", "/health")[0] == 200  # health needs no key
        answer = client(server, api_key="sekrit").chat.completions.create(model="x", messages=HI, max_tokens=2)
        assert answer.usage.completion_tokens == 2


def test_a_stopped_server_answers_no_one(chat_model) -> None:  # noqa: ANN001
    with running_server(chat_model.path) as server:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().read() and conn.sock is not None  # a kept-alive connection
        server.close()
        with pytest.raises((http.client.HTTPException, OSError)):
            conn.request("GET", "/health")
            conn.getresponse()
        conn.close()


def test_no_model_answers_503_until_one_is_attached(chat_server) -> None:  # noqa: ANN001
    from clover_desk.worker.server import OpenAIServer

    with OpenAIServer(None, port=0).start() as server:
        status, _, raw = _raw(server, "GET", "/v1/models")
        assert status == 503 and _error_of(raw)["code"] == "model_loading"
        body = json.dumps({"model": "x", "messages": HI}).encode()
        assert _raw(server, "POST", "/v1/chat/completions", body)[0] == 503
        assert json.loads(_raw(server, "GET", "/health")[2])["status"] == "loading"
        engine = chat_server.service.engine
        server.attach(engine)  # loaded: serve it
        _still_answers(server)
        server.attach(None)  # the window reloads the model: "loading" again, then the new engine
        assert _raw(server, "GET", "/v1/models")[0] == 503
        server.attach(engine)
        assert [m.id for m in client(server).models.list()] == [engine.model_dir.name]


def test_turns_are_first_come_first_served_and_bounded() -> None:
    from clover_desk.worker.server import ApiError, Turns, _ClientGone

    turns = Turns(max_waiting=2)
    turns.acquire(lambda: False)  # the running generation
    order: list[str] = []
    gone = threading.Event()

    def wait(name: str, abandoned: Any = lambda: False) -> None:
        try:
            turns.acquire(abandoned, poll_s=0.01)
        except _ClientGone:
            order.append(f"{name} left")
            return
        order.append(name)
        turns.release()

    first = threading.Thread(target=wait, args=("first", gone.is_set))
    first.start()
    while turns.waiting < 1:
        time.sleep(0.005)
    second = threading.Thread(target=wait, args=("second",))
    second.start()
    while turns.waiting < 2:
        time.sleep(0.005)
    with pytest.raises(ApiError) as exc:  # a third would wait past max_waiting
        turns.acquire(lambda: False)
    assert exc.value.status == 503 and exc.value.code == "server_busy"
    gone.set()  # the first waiter's client hangs up: it leaves the queue
    first.join(timeout=5)
    assert order == ["first left"] and turns.waiting == 1 and turns.busy
    turns.release()
    second.join(timeout=5)
    assert order == ["first left", "second"] and not turns.busy and turns.waiting == 0


# ---------------------------------------------------------------------------------------------------------------
# the real command


def test_serve_command(chat_model) -> None:  # noqa: ANN001
    with _served("--model", str(chat_model.path), "--port", "0") as (proc, line):
        assert line.startswith("listening on http://127.0.0.1:") and line.rstrip().endswith("/v1"), line
        url = line.split()[-1]
        answer = openai.OpenAI(base_url=url, api_key="x", max_retries=0).chat.completions.create(
            model="x", messages=HI, extra_body=NO_THINKING)
        assert answer.choices[0].message.content == "Plain answer!"
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        busy = _serve("--model", str(chat_model.path), "--port", str(port))
        _, err = busy.communicate(timeout=60)
        assert busy.returncode == 2 and err.strip().count("\n") == 0 and "cannot listen" in err, err
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


@pytest.mark.parametrize("cache_ram", [None, "0"])
def test_serve_cache_ram_keeps_other_chats_states_or_not(chat_model, cache_ram: str | None) -> None:  # noqa: ANN001
    """Two clients' chats taking turns: with the default --cache-ram, going back to the first chat reads only its
    new turn (the cached_tokens OpenAI reports); with --cache-ram 0 only the last chat's state is kept."""
    flags = ("--cache-ram", cache_ram) if cache_ram else ()
    with _served("--model", str(chat_model.path), "--port", "0", *flags) as (proc, line):
        client = openai.OpenAI(base_url=line.split()[-1], api_key="x", max_retries=0)
        a = [{"role": "user", "content": "Tell me about the lighthouse keepers of the northern islands. " * 3}]
        b = [{"role": "user", "content": "Explain how a block diffusion model fills its masked slots. " * 3}]

        def ask(messages: list) -> int:  # the prompt's tokens the server had read already
            usage = client.chat.completions.create(model="x", messages=messages, extra_body=NO_THINKING).usage
            return usage.prompt_tokens_details.cached_tokens

        assert ask(a) == 0 and ask(b) == 0
        again = ask([*a, {"role": "assistant", "content": "Plain answer!"}, {"role": "user", "content": "More?"}])
        assert again == 0 if cache_ram == "0" else again > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


@pytest.mark.parametrize(("flag", "value", "allowed"), [("--port", "70000", "0 (any free port) to 65535"),
                                                         ("--ctx", "0", "from 1"), ("--vram-gb", "nan", "> 0"),
                                                         ("--cache-ram", "-1", "MiB from 0")])
def test_serve_refuses_bad_flags(capsys: pytest.CaptureFixture[str], flag: str, value: str, allowed: str) -> None:
    from clover_desk.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", "m", flag, value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and flag in err and allowed in err and err.count("\n") == 1, err


def test_serve_reports_a_bad_model_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from clover_desk.cli.main import main

    assert main(["serve", "--model", str(tmp_path / "nowhere"), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("clover-desk serve: error:") and "nowhere" in err[-1] and "not found" in err[-1], err
