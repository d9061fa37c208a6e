"""A remote backend: any OpenAI-compatible chat endpoint (an SGLang server running Clover, another ``clover-desk
serve``, ...) streamed into the same text events the local engine sends.

    backend = RemoteBackend("http://127.0.0.1:8000/v1", api_key=None)
    for event in backend.chat([{"role": "user", "content": "hi"}], GenerationParams(), cancel=cancel):
        ...   # TextDelta (channel "thinking" or "answer") ..., then one RemoteFinished

Standard library only (``http.client``): no new dependency, no torch, no Qt, so the CLI and the window can both
use it. What a remote server does not report is ``None`` in :class:`RemoteFinished`, never made up: per-pass
denoising (``BlockStep``) never crosses an OpenAI API, so ``denoising_available`` is False; passes, tokens per pass
and the decoding mode are known only when the server sends Clover Desk's ``"clover"`` object; token counts only
when it sends ``usage``. Times measured here (first token, total) are labelled as client-side.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from clover_desk.engine.decode.events import GenerationParams, TextDelta
from clover_desk.engine.errors import CloverError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0  # a long answer from a slow server streams for minutes; a silent one is dropped after this
MAX_ERROR_BODY = 64 * 1024


class RemoteError(CloverError):
    """The remote server could not be reached, refused the request or sent something that is not an answer."""


@dataclass(frozen=True)
class RemoteFinished:
    """Last event of a remote answer. ``None``: the server did not report it (shown as "unavailable")."""

    text: str  # the answer (content), as streamed
    thinking: str  # reasoning_content, as streamed
    tool_calls: tuple[dict[str, Any], ...]  # OpenAI shape: {"id", "type": "function", "function": {name, arguments}}
    finish_reason: str | None  # "stop" | "length" | "tool_calls" | "cancelled" | None (the server sent none)
    model: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    passes: int | None  # model forwards (Clover Desk servers only)
    tokens_per_pass: float | None
    mode: str | None  # "diffusion" | "ar" (Clover Desk servers only)
    client_elapsed_s: float  # request sent -> stream ended, measured here
    client_first_token_s: float | None  # request sent -> first text, measured here
    clover: dict[str, Any] = field(default_factory=dict)  # the server's "clover" object as sent ({} when none)
    denoising_available: bool = False  # per-pass denoising steps never cross an OpenAI API

    def stats(self) -> dict[str, Any]:
        """The answer's figures as the window keeps them with the message (``backend`` "remote"): None wherever the
        server reported nothing (shown as unavailable); the times measured here are ``client_*``."""
        clover = self.clover

        def number(key: str) -> float | None:
            value = clover.get(key)
            return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

        stop = clover.get("stop_reason")
        if not isinstance(stop, str):
            stop = _STOP_OF_FINISH.get(self.finish_reason or "", self.finish_reason)
        return {
            "backend": "remote", "model": self.model, "mode": self.mode, "tokens": self.completion_tokens,
            "prompt_tokens": self.prompt_tokens, "passes": self.passes, "tokens_per_pass": self.tokens_per_pass,
            "tokens_per_s": number("tokens_per_s"), "time_to_first_token_s": number("time_to_first_token_s"),
            "client_first_token_s": self.client_first_token_s, "client_elapsed_s": round(self.client_elapsed_s, 4),
            "finish_reason": self.finish_reason, "stop_reason": stop, "denoising_available": self.denoising_available,
        }


# OpenAI's finish_reason as the engine's stop_reason, for servers that do not send Clover Desk's own
_STOP_OF_FINISH = {"length": "max_new_tokens", "stop": "eos", "cancelled": "cancelled", "tool_calls": "tool_calls"}


def request_body(
    messages: Sequence[dict[str, Any]],
    params: GenerationParams | None = None,
    *,
    model: str | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
    stream: bool = True,
) -> dict[str, Any]:
    """The ``/chat/completions`` body for ``params``: OpenAI fields, vLLM/SGLang's ``top_k`` /
    ``repetition_penalty`` / ``chat_template_kwargs``, and Clover Desk's ``clover`` object only when a Clover
    setting differs from the server's default (plain OpenAI servers may refuse fields they do not know)."""
    p = params or GenerationParams()
    body: dict[str, Any] = {"model": model or "default", "messages": list(messages), "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    for name, value in (("max_tokens", p.max_new_tokens), ("temperature", p.temperature), ("top_p", p.top_p),
                        ("top_k", p.top_k), ("seed", p.seed), ("presence_penalty", p.presence_penalty),
                        ("repetition_penalty", p.repetition_penalty)):
        if value is not None:
            body[name] = value
    if p.do_sample is False and p.temperature is None:
        body["temperature"] = 0
    if not p.enable_thinking:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    clover = {k: v for k, v in (("mode", None if p.mode == "diffusion" else p.mode), ("block_size", p.block_size),
                                ("threshold", p.threshold)) if v is not None}
    if clover:
        body["clover"] = clover
    if tools:
        body["tools"] = list(tools)
    return body


class _Url:
    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RemoteError(f"remote URL {base_url!r} must look like http://HOST:PORT/v1")
        self.scheme = parts.scheme
        self.host = parts.hostname
        try:
            self.port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise RemoteError(f"remote URL {base_url!r} has a bad port") from None
        self.path = parts.path.rstrip("/") or "/v1"  # http://host:port means the usual /v1
        self.base = f"{parts.scheme}://{parts.netloc}{self.path}"

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout)


class RemoteBackend:
    """One OpenAI-compatible server. Thread-safe: each call opens its own connection."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._url = _Url(base_url)
        self.api_key = api_key or None
        self.model = model
        self.timeout_s = timeout_s

    @property
    def base_url(self) -> str:
        return self._url.base

    # ---- plumbing ----
    def _headers(self, body: bool) -> dict[str, str]:
        headers = {"Accept": "application/json, text/event-stream", "User-Agent": "clover-desk"}
        if body:
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _open(self, method: str, path: str, body: dict[str, Any] | None
              ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self._url.connect(self.timeout_s)
        where = f"{self._url.base}{path}"
        try:
            data = None if body is None else json.dumps(body, ensure_ascii=False).encode("utf-8")
            conn.request(method, self._url.path + path, body=data, headers=self._headers(data is not None))
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise RemoteError(f"cannot reach {where}: {_reason(exc)}") from None
        if response.status != 200:
            detail = _error_message(response.read(MAX_ERROR_BODY))
            conn.close()
            raise RemoteError(f"{where}: HTTP {response.status} {response.reason}" + (f": {detail}" if detail else ""))
        return conn, response

    def _get_json(self, path: str) -> Any:
        conn, response = self._open("GET", path, None)
        try:
            return json.loads(response.read())
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise RemoteError(f"{self._url.base}{path}: not a JSON answer ({_reason(exc)})") from None
        finally:
            conn.close()

    # ---- API ----
    def models(self) -> list[str]:
        """The model ids the server lists (``GET /models``): the window's "Test connection"."""
        data = self._get_json("/models")
        items = data.get("data") if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise RemoteError(f"{self._url.base}/models: not a model list")
        return [str(m["id"]) for m in items if isinstance(m, dict) and "id" in m]

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        params: GenerationParams | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[TextDelta | RemoteFinished]:
        """Stream one answer: TextDelta events, then one RemoteFinished (``finish_reason`` "cancelled" when
        ``cancel`` was set: the connection is closed at once, which makes a Clover Desk server stop generating).
        RemoteError when the server cannot be reached or refuses (its error message is included)."""
        model = self.model or self._first_model()
        body = request_body(messages, params, model=model, tools=tools, stream=True)
        started = time.perf_counter()
        conn, response = self._open("POST", "/chat/completions", body)
        return self._events(conn, response, model, started, cancel or threading.Event())

    def _first_model(self) -> str:
        models = self.models()
        if not models:
            raise RemoteError(f"{self._url.base}/models lists no model")
        return models[0]

    def _events(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse, model: str,
                started: float, cancel: threading.Event) -> Iterator[TextDelta | RemoteFinished]:
        ended = threading.Event()
        watcher = threading.Thread(target=_close_on_cancel, args=(conn, cancel, ended), daemon=True)
        watcher.start()
        state = _StreamState(model)
        try:
            for payload in _sse_payloads(response):
                if cancel.is_set():
                    break
                yield from state.take(payload, time.perf_counter() - started)
                if state.done:
                    break
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if not cancel.is_set():
                raise RemoteError(f"{self._url.base}/chat/completions: the stream broke ({_reason(exc)})") from None
        finally:
            ended.set()
            conn.close()
        if cancel.is_set() and not state.done:
            yield state.finished("cancelled", time.perf_counter() - started)
        elif not state.done:
            raise RemoteError(f"{self._url.base}/chat/completions: the stream ended without [DONE]")
        else:
            yield state.finished(state.finish_reason, time.perf_counter() - started)


class _StreamState:
    """What the chunks said so far."""

    def __init__(self, model: str) -> None:
        self.model: str | None = model
        self.text: list[str] = []
        self.thinking: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] = {}
        self.clover: dict[str, Any] = {}
        self.first_token_s: float | None = None
        self.done = False

    def take(self, payload: str, elapsed: float) -> list[TextDelta]:
        if payload.strip() == "[DONE]":
            self.done = True
            return []
        chunk = json.loads(payload)
        if not isinstance(chunk, dict):
            raise ValueError("a chunk that is not a JSON object")
        if isinstance(chunk.get("error"), dict):
            raise RemoteError(f"the server stopped with an error: {chunk['error'].get('message', chunk['error'])}")
        self.model = chunk.get("model") or self.model
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("clover"), dict):
            self.clover = chunk["clover"]
        out: list[TextDelta] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            # "reasoning_content" (DeepSeek, SGLang, vLLM, Clover Desk) or "reasoning" (newer vLLM)
            for key, channel, sink in (("reasoning_content", "thinking", self.thinking),
                                       ("reasoning", "thinking", self.thinking), ("content", "answer", self.text)):
                piece = delta.get(key)
                if isinstance(piece, str) and piece:
                    sink.append(piece)
                    out.append(TextDelta(piece, channel))
            for call in delta.get("tool_calls") or []:
                self._merge_call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if out and self.first_token_s is None:
            self.first_token_s = elapsed
        return out

    def _merge_call(self, call: dict[str, Any]) -> None:
        """OpenAI streams a call as pieces by index: id and name first, the arguments string in parts."""
        slot = self.calls.setdefault(int(call.get("index", len(self.calls))),
                                     {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        if call.get("id"):
            slot["id"] = call["id"]
        fn = call.get("function") or {}
        if fn.get("name"):
            slot["function"]["name"] += fn["name"]
        if fn.get("arguments"):
            slot["function"]["arguments"] += fn["arguments"]

    def finished(self, reason: str | None, elapsed: float) -> RemoteFinished:
        def number(value: Any, kind: type) -> Any:
            return kind(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

        return RemoteFinished(
            text="".join(self.text), thinking="".join(self.thinking),
            tool_calls=tuple(self.calls[i] for i in sorted(self.calls)), finish_reason=reason, model=self.model,
            prompt_tokens=number(self.usage.get("prompt_tokens"), int),
            completion_tokens=number(self.usage.get("completion_tokens"), int),
            passes=number(self.clover.get("passes"), int),
            tokens_per_pass=number(self.clover.get("tokens_per_pass"), float),
            mode=self.clover.get("mode") if isinstance(self.clover.get("mode"), str) else None,
            client_elapsed_s=elapsed, client_first_token_s=self.first_token_s, clover=dict(self.clover),
        )


def _sse_payloads(response: http.client.HTTPResponse) -> Iterator[str]:
    """The ``data:`` payloads of a server-sent event stream (multi-line data joined; comments skipped)."""
    data: list[str] = []
    while True:
        line = response.readline()
        if not line:
            if data:
                yield "\n".join(data)
            return
        text = line.decode("utf-8").rstrip("\r\n")
        if not text:
            if data:
                yield "\n".join(data)
                data = []
        elif text.startswith("data:"):
            data.append(text[5:].lstrip(" "))


def _close_on_cancel(conn: http.client.HTTPConnection, cancel: threading.Event, ended: threading.Event) -> None:
    """Close the connection as soon as ``cancel`` is set (a blocked read then returns at once)."""
    while not ended.is_set():
        if cancel.wait(0.05):
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            return


def _error_message(raw: bytes) -> str:
    """The message of an OpenAI-style error body, else the start of the body."""
    try:
        data = json.loads(raw)
        error = data.get("error") if isinstance(data, dict) else None
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    except ValueError:
        pass
    return raw.decode("utf-8", "replace").strip()[:300]


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


__all__ = ["RemoteBackend", "RemoteError", "RemoteFinished", "request_body"]
