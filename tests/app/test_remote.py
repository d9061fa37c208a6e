"""The remote backend (clover_desk/worker/remote.py) and ``clover-desk generate --remote``, against ``clover-desk serve``'s
server on scripted tiny models, and against a plain OpenAI-style server that reports no Clover figures."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from server_fixtures import (  # noqa: F401 - fixtures
    WEATHER_TOOL,
    chat_model,
    chat_server,
    endless_model,
    endless_server,
    running_server,
    tools_model,
    tools_server,
    wait_idle,
)

from clover_desk.engine.decode.events import GenerationParams, TextDelta
from clover_desk.worker.remote import RemoteBackend, RemoteError, RemoteFinished, request_body

HI = [{"role": "user", "content": "Hello there"}]


def _split(events: list[Any]) -> tuple[str, str, RemoteFinished]:
    *deltas, done = events
    assert isinstance(done, RemoteFinished) and all(isinstance(d, TextDelta) for d in deltas)
    thinking = "".join(d.text for d in deltas if d.channel == "thinking")
    answer = "".join(d.text for d in deltas if d.channel == "answer")
    return thinking, answer, done


def test_streams_reasoning_and_answer_with_the_servers_figures(chat_server, chat_model) -> None:  # noqa: ANN001
    from clover_desk.engine.api import Engine

    backend = RemoteBackend(chat_server.url)
    assert backend.models() == [chat_model.path.name]
    thinking, answer, done = _split(list(backend.chat(HI)))
    assert (thinking, answer) == ("Let me think", "Sure thing.")
    assert (done.thinking, done.text, done.finish_reason, done.model) == (thinking, answer, "stop", chat_model.path.name)
    prompt = Engine.load(chat_model.path).prompt_ids(messages=HI)
    assert (done.prompt_tokens, done.completion_tokens) == (len(prompt), 13)
    assert done.mode == "diffusion" and done.passes >= 13
    assert done.tokens_per_pass == pytest.approx(13 / done.passes, abs=1e-3)
    assert done.denoising_available is False and done.clover["block_size"] == 32
    assert done.client_first_token_s is not None and done.client_elapsed_s >= done.client_first_token_s


def test_parameters_reach_the_server(chat_server) -> None:  # noqa: ANN001
    params = GenerationParams(mode="ar", enable_thinking=False, max_new_tokens=3)
    thinking, answer, done = _split(list(RemoteBackend(chat_server.url, model="whatever").chat(HI, params)))
    assert thinking == "" and "Plain answer!".startswith(answer) and answer
    assert (done.finish_reason, done.completion_tokens, done.mode, done.passes) == ("length", 3, "ar", 3)


def test_request_body_maps_generation_params() -> None:
    body = request_body(HI, GenerationParams(), model="m")
    assert body == {"model": "m", "messages": HI, "stream": True, "stream_options": {"include_usage": True}}
    body = request_body(HI, GenerationParams(mode="ar", max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=20,
                                             seed=3, presence_penalty=0.5, repetition_penalty=1.1, block_size=16,
                                             threshold=0.8, enable_thinking=False), tools=[WEATHER_TOOL])
    assert body["clover"] == {"mode": "ar", "block_size": 16, "threshold": 0.8}
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and body["tools"] == [WEATHER_TOOL]
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["top_k"], body["seed"]) == (5, 0.7, 0.9, 20, 3)
    assert (body["presence_penalty"], body["repetition_penalty"]) == (0.5, 1.1)
    assert request_body(HI, GenerationParams(do_sample=False))["temperature"] == 0


def test_tool_calls_come_back(tools_server) -> None:  # noqa: ANN001
    params = GenerationParams(enable_thinking=False)
    _, answer, done = _split(list(RemoteBackend(tools_server.url).chat(HI, params, tools=[WEATHER_TOOL])))
    assert answer == "" and done.finish_reason == "tool_calls"
    (call,) = done.tool_calls
    assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_cancel_closes_the_stream_and_the_server_stops(endless_server) -> None:  # noqa: ANN001
    before = wait_idle(endless_server)
    cancel = threading.Event()
    events = RemoteBackend(endless_server.url).chat(HI, GenerationParams(enable_thinking=False), cancel=cancel)
    first = next(events)
    assert isinstance(first, TextDelta) and first.text.startswith("tick")
    threading.Timer(0.2, cancel.set).start()  # from another thread, while the loop below reads
    started = time.monotonic()
    rest = list(events)
    assert time.monotonic() - started < 3
    done = rest[-1]
    assert isinstance(done, RemoteFinished) and done.finish_reason == "cancelled"
    assert done.passes is None and done.completion_tokens is None  # the server never said: not made up
    assert wait_idle(endless_server)["cancelled"] == before["cancelled"] + 1


def test_cancel_while_nothing_streams(endless_server) -> None:  # noqa: ANN001
    """The server holds back an unfinished tool call, so no byte comes: cancel must not wait for one."""
    before = wait_idle(endless_server)
    cancel = threading.Event()
    events = RemoteBackend(endless_server.url).chat(HI, tools=[WEATHER_TOOL], cancel=cancel)
    threading.Timer(0.3, cancel.set).start()
    started = time.monotonic()
    (done,) = list(events)
    assert time.monotonic() - started < 3
    assert isinstance(done, RemoteFinished) and done.finish_reason == "cancelled" and done.text == ""
    assert wait_idle(endless_server)["cancelled"] == before["cancelled"] + 1


# ---------------------------------------------------------------------------------------------------------------
# a plain OpenAI-style server (as SGLang or vLLM answer): no "clover" object


class _PlainHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    chunks: list[dict[str, Any]] = []

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def do_GET(self) -> None:  # noqa: N802
        self._json({"object": "list", "data": [{"id": "clover-sglang", "object": "model"}]})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for chunk in self.chunks:
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    def _json(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _delta(**delta: Any) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion.chunk", "model": "clover-sglang",
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


PLAIN_STREAM = [
    _delta(role="assistant", content=""),
    _delta(reasoning_content="Weighing it"),
    _delta(content="Forty"),
    _delta(content="-two."),
    {**_delta(), "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    {"id": "c", "object": "chat.completion.chunk", "model": "clover-sglang", "choices": [],
     "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}},
]


@pytest.fixture()
def plain_server() -> Iterator[tuple[str, type[_PlainHandler]]]:
    handler = type("Handler", (_PlainHandler,), {"chunks": list(PLAIN_STREAM)})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", handler
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_plain_server_leaves_clover_figures_unavailable(plain_server) -> None:  # noqa: ANN001
    url, _ = plain_server
    thinking, answer, done = _split(list(RemoteBackend(url).chat(HI)))
    assert (thinking, answer, done.finish_reason, done.model) == ("Weighing it", "Forty-two.", "stop", "clover-sglang")
    assert (done.prompt_tokens, done.completion_tokens) == (9, 5)
    assert (done.passes, done.tokens_per_pass, done.mode, done.clover) == (None, None, None, {})


def test_an_error_in_the_stream_is_raised(plain_server) -> None:  # noqa: ANN001
    url, handler = plain_server
    handler.chunks = [_delta(content="Hal"), {"error": {"message": "device lost", "type": "server_error"}}]
    events = RemoteBackend(url).chat(HI)
    assert next(events) == TextDelta("Hal", "answer")
    with pytest.raises(RemoteError, match="device lost"):
        next(events)
    handler.chunks = [_delta(content="cut short")]  # [DONE] only: no finish_reason, no usage
    *_, done = RemoteBackend(url).chat(HI)
    assert done.finish_reason is None and done.completion_tokens is None


def test_unreachable_refused_and_bad_urls(chat_model) -> None:  # noqa: ANN001
    with running_server(chat_model.path, api_key="sekrit") as server:
        with pytest.raises(RemoteError, match="HTTP 401.*API key"):
            RemoteBackend(server.url, api_key="wrong").chat(HI)
        with pytest.raises(RemoteError, match="HTTP 400.*temperature"):
            RemoteBackend(server.url, api_key="sekrit").chat(HI, GenerationParams(temperature=-1.0))
        port = server.port
    with pytest.raises(RemoteError, match="cannot reach"):
        RemoteBackend(f"http://127.0.0.1:{port}/v1", model="m").chat(HI)
    for url in ("ftp://host/v1", "127.0.0.1:8000", "http://host:99999/v1"):
        with pytest.raises(RemoteError, match="URL"):
            RemoteBackend(url)


# ---------------------------------------------------------------------------------------------------------------
# clover-desk generate --remote


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from clover_desk.cli.main import main

    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_remote(capsys: pytest.CaptureFixture[str], chat_server) -> None:  # noqa: ANN001
    code, out, err = _cli(capsys, "generate", "--remote", chat_server.url, "--prompt", "Hello there")
    assert code == 0 and out == "[thinking] Let me think\n[answer] Sure thing.\n"
    assert "[stop]" in err and "13 tokens" in err and "mode diffusion" in err
    assert "denoising steps unavailable" in err and "passes unavailable" not in err
    code, out, _ = _cli(capsys, "generate", "--remote", chat_server.url, "--prompt", "Hello there", "--no-think",
                        "--json", "--mode", "ar")
    *deltas, last = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and "".join(d["text"] for d in deltas) == "Plain answer!" and len(deltas) > 1  # AR: per token
    assert last["event"] == "remote_finished" and last["mode"] == "ar" and last["passes"] == last["completion_tokens"]


def test_generate_remote_on_a_plain_server(capsys: pytest.CaptureFixture[str], plain_server) -> None:  # noqa: ANN001
    url, _ = plain_server
    code, out, err = _cli(capsys, "generate", "--remote", url, "--prompt", "What is the answer?")
    assert code == 0 and "Forty-two." in out
    assert "passes unavailable" in err and "tokens/pass unavailable" in err and "mode unavailable" in err
    assert "5 tokens" in err and "clover-sglang" in err


@pytest.mark.parametrize("extra", [["--vram-gb", "8"], ["--raw"], ["--ctx", "100"], ["--device", "cuda"],
                                   ["--dtype", "bfloat16"]])
def test_generate_remote_refuses_local_flags(capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    code, _, err = _cli(capsys, "generate", "--remote", "http://127.0.0.1:9/v1", "--prompt", "hi", *extra)
    assert code == 2 and extra[0] in err and "--remote" in err and err.count("\n") == 1, err
    code, _, err = _cli(capsys, "generate", "--remote", "http://127.0.0.1:9/v1", "--prompt-ids", "1,2")
    assert code == 2 and "--prompt-ids" in err and err.count("\n") == 1


def test_generate_needs_a_model_or_a_remote(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(capsys, "generate", "--prompt", "hi")
    assert code == 2 and "--model" in err and "--remote" in err and err.count("\n") == 1
    code, _, err = _cli(capsys, "generate", "--remote", "http://127.0.0.1:9/v1", "--prompt", "hi")
    assert code == 2 and "cannot reach" in err and err.count("\n") == 1
