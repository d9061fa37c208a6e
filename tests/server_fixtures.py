"""Scripted tiny models and running ``OpenAIServer`` instances for the server and remote-backend tests.

Use with ``from server_fixtures import chat_server, ...  # noqa: F401``. Models are written once per session
(:mod:`scripted_model`); each server runs in a thread of the test process on 127.0.0.1, port 0.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from scripted_model import ScriptedModel, build_scripted_model

TOOL_JSON = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CHAT_THINKING = "Let me think</think>Sure thing.<|im_end|>"  # reasoning "Let me think", answer "Sure thing."
CHAT_PLAIN = "Plain answer!<|im_end|>"
TOOLS_THINKING = f"Need the weather</think><tool_call>{TOOL_JSON}</tool_call><|im_end|>"
TOOLS_PLAIN = f"<tool_call>{TOOL_JSON}</tool_call><|im_end|>"
ENDLESS = "tick tock "  # written over and over (thinking off)
ENDLESS_CALL = "</think><tool_call>round"  # thinking on: a tool call that never closes (nothing to stream, ever)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city today.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> ScriptedModel:
    """Thinking on: reasoning "Let me think", answer "Sure thing."; off: "Plain answer!"."""
    return build_scripted_model(tmp_path_factory.mktemp("chat_model"), thinking=CHAT_THINKING, no_thinking=CHAT_PLAIN)


@pytest.fixture(scope="session")
def tools_model(tmp_path_factory: pytest.TempPathFactory) -> ScriptedModel:
    """Calls get_weather(city="Paris"); with thinking on, after the reasoning "Need the weather"."""
    return build_scripted_model(tmp_path_factory.mktemp("tools_model"), thinking=TOOLS_THINKING,
                                no_thinking=TOOLS_PLAIN, extra_tokens=[TOOL_JSON])


@pytest.fixture(scope="session")
def endless_model(tmp_path_factory: pytest.TempPathFactory) -> ScriptedModel:
    """Writes forever (for cancelling and queueing): with thinking off "tick tock tick tock ...", with it on an
    unterminated "<tool_call>round<tool_call>round..." (with tools, a server streams nothing of it)."""
    return build_scripted_model(tmp_path_factory.mktemp("endless_model"), thinking=ENDLESS_CALL, no_thinking=ENDLESS,
                                loop=["thinking", "no_thinking"])


@contextlib.contextmanager
def running_server(model_dir: Path, **kwargs: Any) -> Iterator[Any]:
    """An OpenAIServer over the model in ``model_dir``, serving from a thread until the block ends."""
    from clover_desk.engine.api import Engine
    from clover_desk.worker.server import OpenAIServer

    engine = kwargs.pop("engine", None) or Engine.load(model_dir)
    server = OpenAIServer(engine, host="127.0.0.1", port=0, **kwargs).start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def chat_server(chat_model: ScriptedModel) -> Iterator[Any]:
    with running_server(chat_model.path) as server:
        yield server


@pytest.fixture(scope="session")
def tools_server(tools_model: ScriptedModel) -> Iterator[Any]:
    with running_server(tools_model.path) as server:
        yield server


@pytest.fixture(scope="session")
def endless_server(endless_model: ScriptedModel) -> Iterator[Any]:
    with running_server(endless_model.path) as server:
        yield server


def client(server: Any, api_key: str = "unused", **kwargs: Any) -> Any:
    """The official openai client for ``server`` (no retries: every answer is the first one)."""
    import openai

    return openai.OpenAI(base_url=server.url, api_key=api_key, max_retries=0, timeout=60, **kwargs)


def wait_idle(server: Any, timeout_s: float = 5.0) -> dict[str, Any]:
    """Poll the server's health until no generation runs and none waits; returns the last health record."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = server.health()
        if not health["busy"] and not health["waiting"]:
            return health
        if time.monotonic() > deadline:
            raise AssertionError(f"the server is still busy after {timeout_s} s: {health}")
        time.sleep(0.02)


def serve_process(*args: str, preexec_fn: Callable[[], None] | None = None) -> subprocess.Popen[str]:
    """``clover-desk serve`` with ``args`` as a child process (stdout and stderr piped, as text)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "clover_desk.cli.main", "serve", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)


@contextlib.contextmanager
def served(*args: str, preexec_fn: Callable[[], None] | None = None) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``clover-desk serve`` with ``args`` until the block ends (killed if it still runs): the process and the line
    it printed first ("listening on URL")."""
    proc = serve_process(*args, preexec_fn=preexec_fn)
    try:
        yield proc, proc.stdout.readline()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def assembled_tool_calls(chunks: list[Any]) -> list[dict[str, Any]]:
    """The tool calls of a streamed chat answer (the openai client's chunks), put together as a client does: by
    index, the first delta's id, type and name, the arguments' pieces joined; ``pieces`` counts each call's deltas
    that carried arguments text."""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(delta.index, {"index": delta.index, "id": None, "type": None, "name": None,
                                                  "arguments": "", "pieces": 0})
            for key in ("id", "type"):
                if getattr(delta, key):
                    assert call[key] is None, f"a second {key} for call {delta.index}"
                    call[key] = getattr(delta, key)
            if delta.function is not None:
                if delta.function.name:
                    assert call["name"] is None, f"a second name for call {delta.index}"
                    call["name"] = delta.function.name
                if delta.function.arguments:
                    call["arguments"] += delta.function.arguments
                    call["pieces"] += 1
    return [calls[i] for i in sorted(calls)]


def port_is_free(port: int) -> bool:
    """Whether a server could listen on ``port`` now (SO_REUSEADDR, as servers set it: the closed connections'
    TIME_WAIT entries do not count, a socket still listening does)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True
