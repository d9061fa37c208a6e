"""The worker's HTTP server (``serve`` / ``serve_stop``): the OpenAI-compatible server runs inside the worker process,
over the model the worker loaded, and the worker's own generations and the HTTP answers take turns on it.

Everything is real: the worker process over pipes, the engine on scripted tiny models (tests/scripted_model.py),
the official ``openai`` client over 127.0.0.1.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from server_fixtures import chat_model, endless_model, port_is_free, tools_model  # noqa: F401 (session fixtures)
from worker_proc import FAKE, WorkerProc

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
USER = [{"role": "user", "content": "hello"}]


def _openai(url: str, api_key: str = "unused") -> Any:
    import openai

    return openai.OpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=60)


def _health(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture
def worker() -> WorkerProc:
    w = WorkerProc()  # the real engine
    w.expect_event("ready")
    yield w
    w.close()


def test_serve_before_load_then_answers_the_loaded_model_and_follows_a_reload(
    worker: WorkerProc, chat_model, tools_model  # noqa: F811
) -> None:
    import openai

    w = worker
    w.send(cmd="serve", host="127.0.0.1", port=0, api_key="s3cret")
    serving = w.expect_event("serving")
    url, port = serving["url"], serving["port"]
    assert url == f"http://127.0.0.1:{port}/v1" and serving["auth"] is True
    assert _health(url)["status"] == "loading"  # no model yet: requests get 503, not a crash
    with pytest.raises(openai.InternalServerError, match="loading"):
        _openai(url, "s3cret").models.list()

    w.send(cmd="load", model_dir=str(chat_model.path))
    w.expect_event("loaded")
    client = _openai(url, "s3cret")
    assert [m.id for m in client.models.list().data] == [chat_model.path.name]
    answer = client.chat.completions.create(model="any", messages=USER)
    assert answer.choices[0].message.content == "Sure thing."
    with pytest.raises(openai.AuthenticationError):
        _openai(url, "wrong").chat.completions.create(model="any", messages=USER)

    # a reload: the server follows the worker's model
    w.send(cmd="load", model_dir=str(tools_model.path))
    w.expect_event("loaded")
    assert [m.id for m in client.models.list().data] == [tools_model.path.name]
    answer = client.chat.completions.create(model="any", messages=USER, extra_body=NO_THINKING)
    assert "get_weather" in (answer.choices[0].message.content or "")  # no tools sent: the call comes back as text

    w.send(cmd="serve_stop")
    w.expect_event("serve_stopped")
    assert port_is_free(port)
    with pytest.raises(openai.APIConnectionError):
        client.models.list()
    # the worker itself still answers
    w.send(cmd="generate", id="after", messages=USER, params={"max_new_tokens": 8, "enable_thinking": False})
    assert w.expect(lambda r: r.get("id") == "after" and r["event"] in ("finished", "error"))["event"] == "finished"


def test_a_port_in_use_is_one_error_naming_it_and_the_worker_keeps_serving() -> None:
    w = WorkerProc(*FAKE)  # nothing here needs a model
    try:
        w.expect_event("ready")
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            w.send(cmd="serve", host="127.0.0.1", port=port, api_key=None)
            error = w.expect_event("error", op="serve")
            assert error["kind"] == "ServeError" and error["fatal"] is False
            assert str(port) in error["message"] and "127.0.0.1" in error["message"]
            assert "\n" not in error["message"]
        # issue 31: beyond this machine only with a key (or said explicitly); the same Host / Origin policy
        w.send(cmd="serve", host="0.0.0.0", port=0, api_key=None)
        error = w.expect_event("error", op="serve")
        assert error["kind"] == "ServeError" and "API key" in error["message"] and "0.0.0.0" in error["message"]
        w.send(cmd="serve", host="127.0.0.1", port=0, allowed_origins=["app.example.com"])
        error = w.expect_event("error", op="serve")
        assert error["kind"] == "ServeError" and "app.example.com" in error["message"]
        w.send(cmd="serve", host="127.0.0.1", port=0, allowed_hosts=["llm.lan"])
        first = w.expect_event("serving")
        assert "llm.lan" in first["policy"] and "pages on this machine" in first["policy"]
        request = urllib.request.Request(first["url"].removesuffix("/v1") + "/health",
                                         headers={"Host": "rebind.attacker.example"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 403
        w.send(cmd="serve", host="127.0.0.1", port=0)  # one server at a time
        again = w.expect_event("error", op="serve")
        assert again["kind"] == "AlreadyServing" and first["url"] in again["message"]
        w.send(cmd="shutdown")  # shutting down stops the server first, then says goodbye
        w.expect_event("serve_stopped")
        w.expect_event("bye")
        assert w.proc.wait(10) == 0
        assert port_is_free(first["port"])
    finally:
        w.close()


def _serving_and_streaming(w: WorkerProc, model_dir: Path, max_tokens: int) -> tuple[str, threading.Thread,
                                                                                     dict[str, Any]]:
    """Load ``model_dir``, serve it, and have one HTTP answer streaming (its first chunk arrived) on a thread:
    ``(url, thread, its results)``."""
    w.send(cmd="load", model_dir=str(model_dir))
    w.expect_event("loaded")
    w.send(cmd="serve", host="127.0.0.1", port=0)
    url = w.expect_event("serving")["url"]
    thread, http = _stream_in_thread(url, max_tokens=max_tokens)
    assert http["first"].wait(60) and http["error"] is None
    return url, thread, http


def _stream_in_thread(url: str, max_tokens: int, **extra: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Stream one answer on a thread; ``out["times"]`` gets the arrival time of each content chunk."""
    out: dict[str, Any] = {"times": [], "text": [], "error": None, "first": threading.Event()}

    def run() -> None:
        try:
            stream = _openai(url).chat.completions.create(
                model="any", messages=USER, max_tokens=max_tokens, stream=True,
                extra_body={**NO_THINKING, "clover": {"mode": "ar"}}, **extra)
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    out["times"].append(time.monotonic())
                    out["text"].append(chunk.choices[0].delta.content)
                    out["first"].set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    out["finish_reason"] = chunk.choices[0].finish_reason
                    out["clover"] = getattr(chunk, "clover", None)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            out["error"] = exc
        finally:
            out["first"].set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_window_and_http_generations_take_turns(worker: WorkerProc, endless_model) -> None:  # noqa: F811
    """A worker generate sent while an HTTP answer streams waits for it: its first record comes after the HTTP
    answer's text, and neither answer has anything of the other's."""
    w = worker
    _, thread, http = _serving_and_streaming(w, endless_model.path, max_tokens=80)
    w.send(cmd="generate", id="win", messages=USER,
           params={"max_new_tokens": 6, "enable_thinking": False, "mode": "ar"})
    w.expect(lambda r: r.get("id") == "win" and r["event"] == "prompt")
    chunks_when_window_started = len(http["times"])
    finished = w.expect_event("finished", id="win")
    thread.join(60)
    assert http["error"] is None
    total = len(http["times"])
    print(f"\nHTTP answer: {total} chunks; the window's generation started after {chunks_when_window_started}")
    assert total > 30
    # The window's generation began once the HTTP answer had finished (a few chunks' slack for delivery order).
    assert chunks_when_window_started >= total - 3
    assert "".join(http["text"]).startswith("tick tock tick tock")
    assert finished["text"].startswith("tick tock") and finished["stop_reason"] == "max_new_tokens"


class TimedWorkerProc(WorkerProc):
    """The worker, with the arrival time of every record kept (``arrivals``: (monotonic time, record))."""

    def __init__(self, *args: str) -> None:
        self.arrivals: list[tuple[float, dict[str, Any]]] = []
        super().__init__(*args)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            record = json.loads(line)
            self.arrivals.append((time.monotonic(), record))
            self.records.put(record)
        self.records.put(None)


def test_an_http_request_waits_for_the_window_generation(endless_model) -> None:  # noqa: F811
    """The other way round: an HTTP request sent while the worker generates gets its first text only after the
    worker's generation has ended (the worker holds the engine for its whole answer)."""
    w = TimedWorkerProc()
    try:
        w.expect_event("ready")
        w.send(cmd="serve", host="127.0.0.1", port=0)
        url = w.expect_event("serving")["url"]
        w.send(cmd="load", model_dir=str(endless_model.path))
        w.expect_event("loaded")
        w.send(cmd="generate", id="win", messages=USER,
               params={"max_new_tokens": 600, "enable_thinking": False, "mode": "ar"})
        w.expect_event("delta", id="win")
        thread, http = _stream_in_thread(url, max_tokens=6)
        w.expect_event("finished", id="win")
        thread.join(60)
        assert http["error"] is None and http["times"], http
        deltas = [t for t, r in list(w.arrivals) if r.get("id") == "win" and r["event"] == "delta"]
        after_http_began = [t for t in deltas if t > http["times"][0]]
        print(f"\nwindow answer: {len(deltas)} deltas in {deltas[-1] - deltas[0]:.2f} s, {len(after_http_began)} after "
              "the HTTP answer's first text")
        assert len(deltas) > 30
        assert len(after_http_began) <= 3  # delivery-order slack only
        assert "".join(http["text"]).startswith("tick")
    finally:
        w.close()


def test_a_window_generate_waiting_for_the_http_answer_can_be_cancelled(
    worker: WorkerProc, endless_model  # noqa: F811
) -> None:
    w = worker
    url, thread, http = _serving_and_streaming(w, endless_model.path, max_tokens=2000)
    w.send(cmd="generate", id="waits", messages=USER, params={"max_new_tokens": 6, "enable_thinking": False})
    w.send(cmd="cancel", id="waits")
    finished = w.expect_event("finished", id="waits")
    assert finished["stop_reason"] == "cancelled" and finished["tokens"] == 0
    assert thread.is_alive()  # the HTTP answer goes on, untouched
    # a reload cancels the HTTP answer (its model goes away) and the server answers the new one afterwards
    w.send(cmd="load", model_dir=str(endless_model.path))
    w.expect_event("loaded")
    thread.join(60)
    assert not thread.is_alive() and http["error"] is None
    assert http["clover"]["stop_reason"] == "cancelled"  # not the 2000 tokens it asked for
    assert _health(url)["status"] == "ok"
    again = _openai(url).chat.completions.create(model="any", messages=USER, max_tokens=4, extra_body=NO_THINKING)
    assert again.choices[0].message.content.startswith("tick")


def test_closing_stdin_stops_the_server(worker: WorkerProc) -> None:
    """stdin closing (the window went away) stops the server too: the port is freed with the process."""
    w = worker
    w.send(cmd="serve", host="127.0.0.1", port=0)
    port = w.expect_event("serving")["port"]
    assert w.proc.stdin is not None
    w.proc.stdin.close()
    assert w.proc.wait(20) == 0
    assert port_is_free(port)
    with pytest.raises(urllib.error.URLError):
        _health(f"http://127.0.0.1:{port}/v1")
