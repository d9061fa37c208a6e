"""An OpenAI-compatible HTTP server over one :class:`engine.api.Engine` (``clover-desk serve``).

    server = OpenAIServer(engine, host="127.0.0.1", port=0, api_key=None).start()
    print(server.url)          # http://127.0.0.1:PORT/v1
    ...
    server.close()

Endpoints: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions`` (streaming as server-sent
events, or one JSON answer), ``POST /v1/completions`` (the legacy text API: a raw prompt, text or token ids, no chat
template; the text comes back as the model wrote it, ``<think>`` markers included; ``max_tokens`` 16 unless given, as
OpenAI's; ``echo``, ``suffix`` and ``best_of`` > 1 are refused) and ``GET /health`` (no key needed: status, busy,
queue length, counters).

What a request may hold, and what the server does with it:

* messages: system / developer / user / assistant / tool, text content (a string or text parts). An assistant's
  ``tool_calls`` and ``reasoning_content`` and the ``tool`` messages go back through the model's chat template.
* tools (``type: function``) are written into the prompt in the Qwen format; a ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` the model writes comes back as OpenAI ``tool_calls`` (finish_reason
  ``tool_calls``). ``tool_choice``: ``auto`` (default) or ``none`` (tools left out of the prompt, nothing parsed).
* ``chat_template_kwargs.enable_thinking`` (default true) per request; the model's ``<think>...</think>`` comes
  back as ``reasoning_content``, apart from ``content``.
* ``continue_final_message: true`` (vLLM's field; ``add_generation_prompt`` false or left out): the last message is
  an assistant answer cut short, with its ``reasoning_content`` if it has one; the model goes on writing it (from
  inside the thinking when no content came yet) and the response holds only the new text.
* ``stop``: up to 4 sequences; the answer (not the reasoning) ends before the first one it writes, the engine is
  cancelled within a pass, finish_reason is ``stop`` and ``clover.stop_sequence`` names it. ``usage`` counts the
  tokens the engine wrote, which in diffusion mode may run a block past the stop.
* sampling: temperature (0 = greedy), top_p, top_k, seed, presence_penalty, repetition_penalty, max_tokens /
  max_completion_tokens; Clover's own settings under ``"clover": {"mode", "block_size", "threshold"}``.
* every answer carries ``usage`` (prompt, completion, total tokens, and ``prompt_tokens_details.cached_tokens``: the
  prompt's first tokens the engine had read already, a chat's earlier turns; streaming: with
  ``stream_options.include_usage`` as OpenAI does) and a ``"clover"`` object: mode, passes, tokens per pass, block
  size, timings, stop reason and ``ignored_fields``.

Decisions:

* Unknown top-level fields are ignored, never silently: they are listed in ``clover.ignored_fields`` of the answer
  (clients and SDKs add vendor fields freely, and refusing them would break them). Known OpenAI fields asking for
  something the engine cannot do (``n`` > 1, ``logprobs``, ``logit_bias``, a JSON ``response_format``,
  non-zero ``frequency_penalty``, ``tool_choice: required``, legacy ``functions``) are refused with 400, as is an
  unknown key inside ``clover`` (our own namespace: a typo there is an error). The ``model`` field may name
  anything: the server has one model, and answers with its id.
* Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed JSON and
  bad fields (``param`` names the field), ``context_length_exceeded`` for a prompt (plus ``max_tokens``) over the
  context, 401 for a missing or wrong key, 404 / 405 for other paths and methods, 411 without a Content-Length,
  413 for a body over ``max_body_bytes``, 503 while the model loads or when too many requests wait.
* One engine runs one generation at a time. Requests wait their turn in arrival order (at most ``max_waiting``);
  a client that goes away while waiting leaves the queue, and one that closes its stream (or connection) during
  generation cancels it within a denoising pass. Nothing a client sends stops the server.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import select
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from engine.errors import CloverError, PromptError
from engine.decode.events import BlockCommitted, Finished, GenerationParams, TextDelta
from engine.decode.limits import GENERATION_LIMITS

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # 8 MiB: a 128k-token conversation is ~0.5 MB of JSON
MAX_WAITING = 32
MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_STOP_CHARS = 256
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# OpenAI fields the server reads, and OpenAI fields with no effect here that are accepted without a note.
_READ_FIELDS = {
    "messages", "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "seed", "presence_penalty", "repetition_penalty", "frequency_penalty", "n", "logprobs", "top_logprobs",
    "logit_bias", "stop", "response_format", "tools", "tool_choice", "functions", "function_call",
    "chat_template_kwargs", "clover", "continue_final_message", "add_generation_prompt",
}
_COMPLETION_FIELDS = {
    "prompt", "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed",
    "presence_penalty", "repetition_penalty", "frequency_penalty", "n", "best_of", "logprobs", "echo", "suffix",
    "logit_bias", "stop", "clover",
}
_NO_EFFECT_FIELDS = {"user", "metadata", "store", "parallel_tool_calls", "service_tier", "prompt_cache_key",
                     "safety_identifier"}
_CLOVER_FIELDS = ("mode", "block_size", "threshold")


# ---------------------------------------------------------------------------------------------------------------
# errors


class ApiError(Exception):
    """An answer in OpenAI's error shape with its HTTP status."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(param: str, allowed: str, value: Any) -> ApiError:
    shown = json.dumps(value, ensure_ascii=True, default=str)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return ApiError(400, f"{param} must be {allowed}, got {shown}", param=param, code="invalid_value")


def _unsupported(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param=param, code="unsupported_parameter")


class _ClientGone(Exception):
    """The client closed its connection; nothing more can be sent."""


# ---------------------------------------------------------------------------------------------------------------
# the request


@dataclass(frozen=True)
class ChatRequest:
    """A checked ``/v1/chat/completions`` (or ``/v1/completions``) body, in the engine's terms."""

    messages: list[dict[str, Any]]  # chat-template form
    tools: list[dict[str, Any]] | None  # as the template renders them (None: no tools in the prompt)
    params: GenerationParams  # max_new_tokens is the caller's max_tokens (None: as much as fits)
    mode: str | None = None  # "diffusion" | "ar"; None: diffusion, or AR on a model without diffusion
    stream: bool = False
    include_usage: bool = False
    ignored_fields: tuple[str, ...] = ()
    continue_final: bool = False  # go on with the last message, an assistant answer (continue_final_message)
    stop: tuple[str, ...] = ()  # stop sequences: the answer ends before the first one it writes
    # /v1/completions: a raw prompt (no chat template) as text or token ids; messages and tools are then empty
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None

    @property
    def completion(self) -> bool:
        """A /v1/completions request (a raw prompt, text out), not a chat."""
        return self.prompt is not None or self.prompt_ids is not None

    @property
    def parse_tool_calls(self) -> bool:
        return bool(self.tools)

    @property
    def continued(self) -> str | None:
        """The channel a continued answer goes on writing ("content", or "reasoning" while no content came yet):
        its leading whitespace is the model's, not the space after a marker, and is kept."""
        if not self.continue_final:
            return None
        last = self.messages[-1]
        return "content" if last.get("content") else "reasoning"


def _is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _limited(body: dict[str, Any], name: str, limit: str, where: str | None = None) -> Any:
    """``body[name]`` checked against the engine's range for ``limit`` (:data:`engine.decode.limits.GENERATION_LIMITS`,
    the table the CLI flags and the worker use too); None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    rule = GENERATION_LIMITS[limit]
    if not rule.accepts(value):
        raise _bad(where or name, rule.allowed, value)
    return int(value) if rule.kind == "int" else float(value)


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, null, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise _bad(f"{where}[{i}]", "a content part object with a 'type'", part)
            if part["type"] != "text":
                raise _unsupported(f"{where}[{i}]", f"content parts of type {part['type']!r} are not supported: "
                                                    "the model reads text only")
            if not isinstance(part.get("text"), str):
                raise _bad(f"{where}[{i}].text", "a string", part.get("text"))
            out.append(part["text"])
        return "".join(out)
    raise _bad(where, "a string, a list of text parts or null", content)


def _tool_calls_in(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` in the template's form (``{"function": {"name", "arguments"}}``)."""
    if not isinstance(calls, list):
        raise _bad(where, "a list of tool calls", calls)
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"{where}[{i}]", 'a {"type": "function", "function": {"name", "arguments"}} object', call)
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                raise _bad(f"{where}[{i}].function.arguments", "a JSON object (as a string)", arguments) from None
        if not isinstance(arguments, dict):
            raise _bad(f"{where}[{i}].function.arguments", "a JSON object (as a string)", arguments)
        out.append({"type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _bad("messages", "a non-empty list of message objects", value)
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(where, "an object with 'role' and 'content'", message)
        role = message.get("role")
        if role in ("system", "developer", "user", "tool"):
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_of(message.get("content"), f"{where}.content")})
        elif role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": _text_of(message.get("content"), f"{where}.content")}
            if message.get("tool_calls") is not None:
                turn["tool_calls"] = _tool_calls_in(message["tool_calls"], f"{where}.tool_calls")
            reasoning = message.get("reasoning_content")
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise _bad(f"{where}.reasoning_content", "a string or null", reasoning)
                turn["reasoning_content"] = reasoning
            out.append(turn)
        elif role == "function":
            raise _unsupported(f"{where}.role", "'function' messages are the deprecated form: use 'tool'")
        else:
            raise _bad(f"{where}.role", "one of system, developer, user, assistant, tool", role)
    return out


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _bad("tools", "a list of tool objects or null", value)
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise _bad(f"tools[{i}]", 'a {"type": "function", "function": {...}} object', tool)
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools[{i}].function.name", "a non-empty string", fn.get("name"))
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"tools[{i}].function.parameters", "a JSON schema object", fn["parameters"])
    return value or None


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Known OpenAI fields whose value asks for something this server cannot do."""
    if body.get("n") not in (None, 1):
        raise _unsupported("n", "only one choice per request (n = 1) is supported")
    if body.get("logprobs") not in (None, False):
        raise _unsupported("logprobs", "log probabilities are not reported")
    if body.get("top_logprobs") not in (None, 0):
        raise _unsupported("top_logprobs", "log probabilities are not reported")
    if body.get("logit_bias") not in (None, {}):
        raise _unsupported("logit_bias", "logit bias is not supported")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _unsupported("response_format", 'only {"type": "text"} is supported')
    penalty = body.get("frequency_penalty")
    if penalty is not None and (not _is_number(penalty) or penalty != 0):
        raise _unsupported("frequency_penalty", "not supported: use presence_penalty or repetition_penalty")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise _unsupported("functions", "the deprecated functions API is not supported: use tools")


def _stop_sequences(value: Any) -> tuple[str, ...]:
    """OpenAI's ``stop``: null, a string or a list of at most :data:`MAX_STOP_SEQUENCES` non-empty strings ("" and []
    mean none, as OpenAI takes them)."""
    if value is None or value == "" or value == []:
        return ()
    items = [value] if isinstance(value, str) else value
    allowed = (f"a string or a list of up to {MAX_STOP_SEQUENCES} non-empty strings of at most "
               f"{MAX_STOP_CHARS} characters")
    if not isinstance(items, list) or len(items) > MAX_STOP_SEQUENCES or not all(
            isinstance(item, str) and 0 < len(item) <= MAX_STOP_CHARS for item in items):
        raise _bad("stop", allowed, value)
    return tuple(dict.fromkeys(items))


def parse_chat_request(body: Any) -> ChatRequest:
    """Check a decoded JSON body; raise :class:`ApiError` (400) naming the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    _refuse_unsupported(body)
    ignored = [name for name in body if name not in _READ_FIELDS and name not in _NO_EFFECT_FIELDS]
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise _bad("model", "a string", body["model"])
    stream, include_usage = _streaming(body)
    messages = _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        if choice == "required" or isinstance(choice, dict):
            raise _unsupported("tool_choice", "only 'auto' and 'none' are supported")
        raise _bad("tool_choice", '"auto" or "none"', choice)
    if choice == "none":
        tools = None

    max_tokens = _limited(body, "max_completion_tokens", "max_new_tokens")
    if max_tokens is None:
        max_tokens = _limited(body, "max_tokens", "max_new_tokens")
    sampling = _sampling(body)

    kwargs = body.get("chat_template_kwargs")
    enable_thinking = True
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise _bad("chat_template_kwargs", "an object or null", kwargs)
        if kwargs.get("enable_thinking") is not None:
            if not isinstance(kwargs["enable_thinking"], bool):
                raise _bad("chat_template_kwargs.enable_thinking", "true or false", kwargs["enable_thinking"])
            enable_thinking = kwargs["enable_thinking"]
        ignored += [f"chat_template_kwargs.{k}" for k in kwargs if k != "enable_thinking"]

    stop = _stop_sequences(body.get("stop"))
    continue_final = body.get("continue_final_message")
    if continue_final is not None and not isinstance(continue_final, bool):
        raise _bad("continue_final_message", "true, false or null", continue_final)
    add_prompt = body.get("add_generation_prompt")
    if add_prompt is not None and not isinstance(add_prompt, bool):
        raise _bad("add_generation_prompt", "true, false or null", add_prompt)
    if continue_final and add_prompt:
        raise _bad("add_generation_prompt", "false or left out with continue_final_message (vLLM's rule: a "
                   "continued answer gets no new generation prompt)", add_prompt)
    if add_prompt is False and not continue_final:
        raise _unsupported("add_generation_prompt", "false only with continue_final_message: true (a request "
                           "without either starts a new answer)")
    if continue_final and messages[-1]["role"] != "assistant":
        raise _bad(f"messages[{len(messages) - 1}].role", '"assistant" with continue_final_message (the answer it '
                   'continues)', messages[-1]["role"])

    mode, block_size, threshold = _clover(body)
    params = GenerationParams(max_new_tokens=max_tokens, block_size=block_size, threshold=threshold,
                              enable_thinking=enable_thinking, **sampling)
    return ChatRequest(
        messages=messages, tools=tools, params=params, mode=mode, stream=stream, include_usage=include_usage,
        ignored_fields=tuple(ignored), continue_final=bool(continue_final), stop=stop,
    )


def _streaming(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage) of a request; ``stream_options`` without ``stream: true`` is a 400,
    as OpenAI's."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", "true, false or null", stream)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or
                                not isinstance(options.get("include_usage", False), bool)):
        raise _bad("stream_options", 'null or {"include_usage": true | false}', options)
    if options is not None and stream is not True:  # as OpenAI answers: the options are for a stream only
        raise _bad("stream_options", 'null unless "stream" is true', options)
    return bool(stream), bool(options and options.get("include_usage"))


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields of a request as GenerationParams keywords (None: the model's default)."""
    top_k = body.get("top_k")
    return {
        "temperature": _limited(body, "temperature", "temperature"),
        "top_p": _limited(body, "top_p", "top_p"),
        "top_k": 0 if top_k == -1 and not isinstance(top_k, bool) else _limited(body, "top_k", "top_k"),  # -1: off
        "seed": _limited(body, "seed", "seed"),
        "presence_penalty": _limited(body, "presence_penalty", "presence_penalty"),
        "repetition_penalty": _limited(body, "repetition_penalty", "repetition_penalty"),
    }


def _clover(body: dict[str, Any]) -> tuple[str | None, int | None, float | None]:
    """(mode, block_size, threshold) from the request's ``clover`` object (our namespace: an unknown key is an
    error)."""
    clover = body.get("clover")
    mode, block_size, threshold = None, None, None
    if clover is not None:
        if not isinstance(clover, dict):
            raise _bad("clover", "an object or null", clover)
        unknown = [k for k in clover if k not in _CLOVER_FIELDS]
        if unknown:
            raise ApiError(400, f"clover.{unknown[0]} is not a Clover setting; they are: {', '.join(_CLOVER_FIELDS)}",
                           param=f"clover.{unknown[0]}", code="unknown_parameter")
        if clover.get("mode") is not None:
            if clover["mode"] not in ("diffusion", "ar", "spec"):
                raise _bad("clover.mode", '"diffusion", "ar" or "spec"', clover["mode"])
            mode = clover["mode"]
        block_size = _limited(clover, "block_size", "block_size", "clover.block_size")
        threshold = _limited(clover, "threshold", "threshold", "clover.threshold")
    return mode, block_size, threshold


def _raw_prompt(value: Any) -> tuple[str | None, tuple[int, ...] | None]:
    """/v1/completions' ``prompt``: a non-empty string or a list of token ids, either alone in a list too (one
    prompt per request)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str) and value:
        return value, None
    if isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return None, tuple(value)
    raise _bad("prompt", "a non-empty string or a list of token ids (one prompt per request)", value)


def parse_completion_request(body: Any) -> ChatRequest:
    """Check a decoded ``/v1/completions`` body (the legacy text API: a raw prompt, no chat template); raise
    :class:`ApiError` (400) naming the first bad field. ``max_tokens`` defaults to 16, as OpenAI's does."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    _refuse_unsupported(body)
    if body.get("best_of") not in (None, 1):
        raise _unsupported("best_of", "only one completion per request (best_of = 1) is supported")
    if body.get("echo") not in (None, False):
        raise _unsupported("echo", "the prompt is not echoed back")
    if body.get("suffix") not in (None, ""):
        raise _unsupported("suffix", "fill-in-the-middle (a suffix) is not supported")
    ignored = [name for name in body if name not in _COMPLETION_FIELDS and name not in _NO_EFFECT_FIELDS]
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise _bad("model", "a string", body["model"])
    stream, include_usage = _streaming(body)
    prompt, prompt_ids = _raw_prompt(body.get("prompt"))
    max_tokens = _limited(body, "max_tokens", "max_new_tokens")
    mode, block_size, threshold = _clover(body)
    params = GenerationParams(max_new_tokens=16 if max_tokens is None else max_tokens, block_size=block_size,
                              threshold=threshold, **_sampling(body))
    return ChatRequest(
        messages=[], tools=None, params=params, mode=mode, stream=stream, include_usage=include_usage,
        ignored_fields=tuple(ignored), stop=_stop_sequences(body.get("stop")), prompt=prompt, prompt_ids=prompt_ids,
    )


# ---------------------------------------------------------------------------------------------------------------
# the answer: reasoning and content apart, tool calls out of the content


def _new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_call(inner: str) -> dict[str, Any] | None:
    """The OpenAI tool call for the text between ``<tool_call>`` and ``</tool_call>``, or None when it is not a
    ``{"name": str, "arguments": object}`` JSON object (then the text stays content: nothing is made up)."""
    try:
        data = json.loads(inner)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": _new_call_id(), "type": "function",
            "function": {"name": data["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


class _Trimmed:
    """Text released in order with its outer whitespace dropped: leading whitespace never comes out (unless
    ``keep_leading``: the channel of a continued answer, whose text goes on from the client's), and a
    whitespace-only run waits until more text follows (so trailing whitespace never comes out either)."""

    def __init__(self, keep_leading: bool = False) -> None:
        self._started = keep_leading
        self._held = ""

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        return body


class AnswerParser:
    """Splits the answer channel into content and tool calls as it streams.

    ``feed(text)`` and ``finish()`` return ``("content", str)`` and ``("tool_call", dict)`` items. Text that might
    be the start of ``<tool_call>`` is held until it is known; a call is released whole at ``</tool_call>``; an
    unterminated or malformed call is released as the content it is."""

    def __init__(self, parse_tools: bool, keep_leading: bool = False) -> None:
        self.parse_tools = parse_tools
        self._buf = ""
        self._in_call = False
        self._content = _Trimmed(keep_leading)
        self.calls = 0

    def _text(self, text: str, out: list[tuple[str, Any]]) -> None:
        released = self._content.push(text)
        if released:
            out.append(("content", released))

    def feed(self, text: str) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if not self.parse_tools:
            self._text(text, out)
            return out
        self._buf += text
        while True:
            if self._in_call:
                end = self._buf.find(TOOL_CALL_END)
                if end < 0:
                    return out
                inner, self._buf = self._buf[:end], self._buf[end + len(TOOL_CALL_END):]
                self._in_call = False
                call = parse_tool_call(inner.strip())
                if call is None:
                    self._text(TOOL_CALL_START + inner + TOOL_CALL_END, out)
                else:
                    self.calls += 1
                    out.append(("tool_call", call))
                continue
            start = self._buf.find(TOOL_CALL_START)
            if start >= 0:
                self._text(self._buf[:start], out)
                self._buf = self._buf[start + len(TOOL_CALL_START):]
                self._in_call = True
                continue
            keep = _partial_suffix(self._buf, TOOL_CALL_START)
            self._text(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def finish(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        rest = (TOOL_CALL_START if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        if rest:
            self._text(rest, out)
        return out


def _markers(tokenizer: Any, ids: Sequence[int]) -> tuple[str | None, str | None, bool]:
    """(``<think>``, ``</think>``, whether the prompt ``ids`` end inside a thinking section) for :class:`RawText`."""
    start_id = getattr(tokenizer, "think_start_id", None)
    end_id = getattr(tokenizer, "think_end_id", None)
    if start_id is None or end_id is None:
        return None, None, False
    last = next((i for i in reversed(ids) if i in (start_id, end_id)), None)
    return tokenizer.id_to_token(start_id), tokenizer.id_to_token(end_id), last == start_id


class RawText:
    """A completion's text as the model wrote it: the engine's two channels joined in order, with the thinking
    markers put back where the channel changes (the engine's deltas leave them out). Its end-of-text tokens stay
    out, as other OpenAI-compatible servers leave special tokens out."""

    def __init__(self, start: str | None, end: str | None, thinking: bool) -> None:
        self.start, self.end, self.thinking = start, end, thinking

    def push(self, text: str, channel: str) -> str:
        thinking = channel == "thinking"
        marker = ""
        if thinking != self.thinking and self.start is not None and self.end is not None:
            marker = self.start if thinking else self.end
        self.thinking = thinking
        return marker + text


class StopScanner:
    """Ends the answer channel before the first stop sequence it holds, as it streams.

    ``feed(text)`` returns the text that can go out: everything before a stop sequence, holding back an end that
    may still become one (``" to"`` while ``" tock"`` is a stop). Once a stop sequence is found, ``hit`` names it and
    nothing more comes out; ``finish()`` releases what was held when none came."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.hit: str | None = None
        self._held = ""

    def feed(self, text: str) -> str:
        if self.hit is not None or not self.stops:
            return "" if self.hit is not None else text
        buf = self._held + text
        found = [(buf.find(stop), stop) for stop in self.stops if stop in buf]
        if found:
            at, self.hit = min(found)
            self._held = ""
            return buf[:at]
        keep = max(_partial_suffix(buf, stop) for stop in self.stops)
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep]

    def finish(self) -> str:
        rest, self._held = self._held, ""
        return "" if self.hit is not None else rest


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# ---------------------------------------------------------------------------------------------------------------
# one generation at a time


class Turns:
    """A first-come, first-served turn at the engine, for at most ``max_waiting`` waiters.

    ``lock`` (optional) is a lock other users of the same engine hold while they generate (the window's worker):
    a turn also takes it, so HTTP and window requests never run at once."""

    def __init__(self, max_waiting: int = MAX_WAITING, lock: Any = None) -> None:
        self.max_waiting = max_waiting
        self._lock = lock
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()
        self._busy = False

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return self._busy

    def acquire(self, abandoned: Callable[[], bool], poll_s: float = 0.2) -> None:
        """Wait for the turn; ApiError 503 when the queue is full, _ClientGone when ``abandoned()`` turns true."""
        me = object()
        with self._cond:
            if len(self._queue) >= self.max_waiting:
                raise ApiError(503, f"the server is busy: {len(self._queue)} requests are waiting; try again later",
                               type="server_error", code="server_busy")
            self._queue.append(me)
            try:
                while self._busy or self._queue[0] is not me:
                    self._cond.wait(poll_s)
                    if abandoned():
                        raise _ClientGone()
                self._busy = True
            finally:
                self._queue.remove(me)
                self._cond.notify_all()
        if self._lock is not None:
            while not self._lock.acquire(timeout=poll_s):
                if abandoned():
                    self._release_turn()
                    raise _ClientGone()

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
        self._release_turn()

    def _release_turn(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()


@dataclass
class Counters:
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0  # requests refused with an error (bad request, no key, busy ...) before generating

    def as_dict(self) -> dict[str, int]:
        return {"completed": self.completed, "cancelled": self.cancelled, "failed": self.failed,
                "rejected": self.rejected}


# ---------------------------------------------------------------------------------------------------------------
# the service: requests in, engine events out, answers in OpenAI's shape


@dataclass
class _Prepared:
    request: ChatRequest
    engine: Any  # the engine the prompt was counted for (the same one generates, even if another is attached)
    prompt_ids: list[int]
    params: GenerationParams  # max_new_tokens resolved
    written: int = 0  # the prompt's last ids that are the model's own answer (continue_final_message)
    markers: tuple[str | None, str | None, bool] = (None, None, False)  # a completion's: RawText's arguments
    id: str = field(default_factory=lambda: "chatcmpl-" + uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


class ChatService:
    """The protocol-free part of the server: checks a request against the engine and runs it."""

    def __init__(self, engine: Any, model_id: str, ctx_tokens: int | None = None, lock: Any = None,
                 max_waiting: int = MAX_WAITING) -> None:
        self.engine = engine
        self.model_id = model_id
        self._ctx_tokens = ctx_tokens
        self.turns = Turns(max_waiting, lock)
        self.counters = Counters()
        self._active: set[threading.Event] = set()
        self._active_lock = threading.Lock()
        self.created = int(time.time())

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @property
    def ctx_tokens(self) -> int:
        """The context a request (prompt + answer) must fit: --ctx, else the plan's, else the model's."""
        return self._ctx_of(self.engine)

    def _ctx_of(self, engine: Any) -> int:
        limits = [self._ctx_tokens, getattr(getattr(engine, "plan", None), "ctx_tokens", None),
                  engine.config.max_position_embeddings]
        return min(int(n) for n in limits if n)

    def model_card(self) -> dict[str, Any]:
        engine = self.engine
        if engine is None:
            raise ApiError(503, "the model is still loading", type="server_error", code="model_loading")
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "clover-desk",
                "max_model_len": self._ctx_of(engine)}

    def prepare(self, request: ChatRequest) -> _Prepared:
        """Render and count the prompt, fit the answer in the context; ApiError 400 otherwise."""
        engine = self.engine
        if engine is None:
            raise ApiError(503, "the model is still loading", type="server_error", code="model_loading")
        where = "prompt" if request.completion else "messages"
        try:
            if request.completion:
                ids, written = engine.encode_request(
                    prompt=request.prompt, raw=True,
                    prompt_ids=None if request.prompt_ids is None else list(request.prompt_ids))
                if max(ids) >= engine.config.vocab_size or min(ids) < 0:
                    bad = next(i for i in ids if not 0 <= i < engine.config.vocab_size)
                    raise ApiError(400, f"prompt token id {bad} is outside the vocabulary "
                                        f"(0..{engine.config.vocab_size - 1})", param="prompt", code="invalid_value")
            else:
                ids, written = engine.encode_request(messages=request.messages, tools=request.tools,
                                                     enable_thinking=request.params.enable_thinking,
                                                     continue_final=request.continue_final)
        except CloverError as exc:
            raise ApiError(400, str(exc), param=where) from None
        ctx, prompt = self._ctx_of(engine), len(ids)
        room = ctx - prompt
        asked = request.params.max_new_tokens
        if room < 1 or (asked is not None and asked > room):
            wanted = f"{prompt} in the {where}" + (f", {asked} in the completion" if asked is not None else "")
            raise ApiError(
                400, f"this model's maximum context length is {ctx} tokens; the request needs "
                f"{prompt + (asked or 1)} ({wanted})", param=where, code="context_length_exceeded")
        default = engine.generation_defaults.max_new_tokens
        mode = request.mode or ("ar" if getattr(engine, "ar_only", None) else "diffusion")
        params = replace(request.params, mode=mode,
                         max_new_tokens=asked if asked is not None else min(default, room))
        markers = _markers(engine.tokenizer, ids) if request.completion else (None, None, False)
        return _Prepared(request, engine, ids, params, written, markers,
                         id=("cmpl-" if request.completion else "chatcmpl-") + uuid.uuid4().hex)

    def cancel_all(self) -> None:
        with self._active_lock:
            for cancel in self._active:
                cancel.set()

    def run(self, prepared: _Prepared, cancel: threading.Event) -> Iterator[Any]:
        """The engine's events for a prepared request (the caller holds the turn). PromptError -> ApiError 400;
        ApiError 503 when the model was detached or replaced while the request waited for its turn."""
        with self._active_lock:
            self._active.add(cancel)
        try:
            if prepared.engine is not self.engine:
                raise ApiError(503, "the model was unloaded while the request waited; try again once it has loaded",
                               type="server_error", code="model_loading")
            try:
                events = prepared.engine.generate(prompt_ids=prepared.prompt_ids, params=prepared.params,
                                                  cancel=cancel, written=prepared.written)
            except PromptError as exc:
                raise ApiError(400, str(exc), param="messages") from None
            yield from events
        finally:
            with self._active_lock:
                self._active.discard(cancel)

    def extras(self, prepared: _Prepared, done: Finished, blocks: int, stopped: str | None = None) -> dict[str, Any]:
        """The ``clover`` object of an answer: what the diffusion decoder did (``stopped``: the stop sequence that
        ended it)."""
        params = prepared.params
        diffusion = params.mode == "diffusion"
        config = prepared.engine.config
        block = params.block_size or getattr(config, "block_size", None)
        return {
            "mode": params.mode,
            "passes": done.passes,
            "tokens_per_pass": round(done.tokens_per_pass, 4),
            "block_size": block if diffusion else None,
            "threshold": (params.threshold if params.threshold is not None
                          else getattr(config, "threshold", None)) if diffusion else None,
            "blocks": blocks if diffusion else None,
            "tokens_per_s": round(done.tokens_per_s, 3),
            "prefill_s": round(done.prefill_s, 4),
            "decode_s": round(done.decode_s, 4),
            "time_to_first_token_s": None if done.time_to_first_token_s is None else round(done.time_to_first_token_s, 4),
            "stop_reason": "stop_sequence" if stopped is not None else done.stop_reason,
            **({"stop_sequence": stopped} if stopped is not None else {}),
            "ignored_fields": list(prepared.request.ignored_fields),
        }


def usage_of(done: Finished) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: the prompt's first tokens the engine's
    prompt cache held already (a chat's next turn, engine.decode.prompt_cache.PromptCache)."""
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.tokens,
            "total_tokens": done.prompt_tokens + done.tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


def finish_reason(done: Finished, tool_calls: int, stopped: str | None = None) -> str:
    if tool_calls:
        return "tool_calls"
    if stopped is not None:
        return "stop"
    return "length" if done.stop_reason in ("max_new_tokens", "context") else "stop"


# ---------------------------------------------------------------------------------------------------------------
# HTTP


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "clover-desk"
    timeout = 120  # seconds a socket read or write may block (a client that stops reading is dropped)
    server: "_HTTPServer"

    # ---- plumbing ----
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's signature
        log.debug("%s %s", self.address_string(), format % args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The base class's own refusals (bad request line, headers too long ...) in OpenAI's error shape."""
        self.close_connection = True
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "error"
        self._send_json(code, ApiError(code, message or phrase).body())

    def _send_json(self, status: int, body: dict[str, Any], headers: Sequence[tuple[str, str]] = ()) -> None:
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        self._answer_started = True
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.wfile.flush()

    def _error(self, err: ApiError) -> None:
        headers = [("WWW-Authenticate", "Bearer")] if err.status == 401 else []
        if err.code != "generation_failed":  # those are counted as failed
            with self.server.lock:
                self.server.service.counters.rejected += 1
        self._send_json(err.status, err.body(), headers)

    def _client_gone(self) -> bool:
        """Whether the client closed its side (checked without blocking: readable and nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # ---- routing ----
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:  # noqa: N802
        self._dispatch("PATCH")

    def _dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        self._body_read = False
        self._answer_started = False
        try:
            if method != "POST" and self.headers.get("Content-Length", "0").strip() not in ("", "0"):
                self.close_connection = True  # a body nobody reads must not be taken for the next request
            if path == "/health":
                if method != "GET":
                    raise ApiError(405, f"{method} {path} is not allowed; use GET", code="method_not_allowed")
                self._send_json(200, self.server.health())
                return
            routes = {"/v1/models": "GET", "/v1/chat/completions": "POST", "/v1/completions": "POST"}
            expected = routes.get(path) or ("GET" if path.startswith("/v1/models/") else None)
            if expected is None:
                raise ApiError(404, f"no such endpoint: {method} {path} (this server has /v1/models, "
                                    "/v1/chat/completions, /v1/completions and /health)", code="not_found")
            if method != expected:
                raise ApiError(405, f"{method} {path} is not allowed; use {expected}", code="method_not_allowed")
            self._authorize()
            if not self.server.service.ready:
                raise ApiError(503, "the model is still loading", type="server_error", code="model_loading")
            if path == "/v1/models":
                self._send_json(200, {"object": "list", "data": [self.server.service.model_card()]})
            elif path.startswith("/v1/models/"):
                card = self.server.service.model_card()
                if path[len("/v1/models/"):] != card["id"]:
                    raise ApiError(404, f"the model {path[len('/v1/models/'):]!r} does not exist; this server has "
                                        f"{card['id']!r}", param="model", code="model_not_found")
                self._send_json(200, card)
            else:
                self._chat(completion=path == "/v1/completions")
        except ApiError as err:
            if method == "POST" and not self._body_read:
                self.close_connection = True
            self._error(err)
        except _ClientGone:
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True
        except Exception:  # a bug here: answer 500 (unless the answer had begun) and keep serving
            log.exception("unexpected error in %s %s", method, path)
            self.close_connection = True
            if not self._answer_started:
                self._error(ApiError(500, "internal server error (see the server's log)", type="server_error",
                                     code="internal_error"))

    def _authorize(self) -> None:
        key = self.server.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'" if given
                           else "this server needs an API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    def _read_json(self) -> Any:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise ApiError(411, "send the body with a Content-Length (chunked request bodies are not read)",
                           code="length_required")
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            raise ApiError(411, "a Content-Length header is required", code="length_required")
        try:
            length = int(length_text)
            if length < 0:
                raise ValueError
        except ValueError:
            raise ApiError(400, f"Content-Length {length_text!r} is not a byte count", code="invalid_request") from None
        limit = self.server.max_body_bytes
        if length > limit:
            raise ApiError(413, f"the request body is {length} bytes; this server takes at most {limit}",
                           code="request_too_large")
        raw = self.rfile.read(length)
        self._body_read = True
        if len(raw) != length:
            raise _ClientGone()
        try:
            return json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
        except (UnicodeDecodeError, json.JSONDecodeError, ValueError, RecursionError) as exc:
            detail = f"{exc.msg} at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) \
                else str(exc) or type(exc).__name__
            raise ApiError(400, f"the request body is not valid JSON ({detail})", code="invalid_json") from None

    # ---- chat ----
    def _chat(self, completion: bool = False) -> None:
        service = self.server.service
        body = self._read_json()
        request = parse_completion_request(body) if completion else parse_chat_request(body)
        prepared = service.prepare(request)
        service.turns.acquire(self._client_gone)
        self._turn_held = True
        cancel = threading.Event()
        try:
            events = service.run(prepared, cancel)
            first = next(events)  # PromptError is raised here, before any byte of the answer is sent
            if request.stream:
                self._stream(prepared, _chain(first, events), cancel)
            else:
                self._answer(prepared, _chain(first, events), cancel)
        finally:
            self._release_turn()

    def _release_turn(self) -> None:
        if getattr(self, "_turn_held", False):
            self._turn_held = False
            self.server.service.turns.release()

    def _count(self, done: Finished | None, failed: bool = False, stopped: bool = False) -> None:
        """The generation is over: count how it ended and hand the engine to the next request (before the last
        bytes of this answer are written). ``stopped``: a stop sequence ended it (the engine was cancelled, the
        answer is complete)."""
        self._release_turn()
        with self.server.lock:
            counters = self.server.service.counters
            if failed or done is None:
                counters.failed += 1
            elif done.stop_reason == "cancelled" and not stopped:
                counters.cancelled += 1
            else:
                counters.completed += 1

    def _drain(self, events: Iterator[Any], cancel: threading.Event) -> Finished | None:
        """Cancel and run the generation to its end (it stops within a pass; hooks close their block)."""
        cancel.set()
        done = None
        for event in events:
            if isinstance(event, Finished):
                done = event
        return done

    def _answer(self, prepared: _Prepared, events: Iterator[Any], cancel: threading.Event) -> None:
        service = self.server.service
        done: Finished | None = None
        blocks = 0
        scanner = StopScanner(prepared.request.stop)
        answer: list[str] = []  # the answer channel up to a stop sequence (with stop sequences only)
        raw = RawText(*prepared.markers)  # a completion's text: both channels
        last_check = time.monotonic()
        try:
            for event in events:
                if isinstance(event, Finished):
                    done = event
                elif isinstance(event, BlockCommitted):
                    blocks += 1
                elif isinstance(event, TextDelta) and prepared.request.completion:
                    answer.append(scanner.feed(raw.push(event.text, event.channel)))
                    if scanner.hit is not None:
                        cancel.set()
                elif isinstance(event, TextDelta) and event.channel != "thinking" and scanner.stops:
                    answer.append(scanner.feed(event.text))
                    if scanner.hit is not None:
                        cancel.set()  # the engine stops within a pass; the rest of its text is dropped
                now = time.monotonic()
                if now - last_check > 0.05:
                    last_check = now
                    if self._client_gone():
                        done = self._drain(events, cancel)
                        self._count(done)
                        raise _ClientGone()
        except _ClientGone:
            raise
        except Exception as exc:  # an engine bug or a device error: answer 500, keep serving
            self._count(None, failed=True)
            log.exception("generation failed")
            raise ApiError(500, f"generation failed: {exc}", type="server_error", code="generation_failed") from None
        assert done is not None
        stopped = scanner.hit
        self._count(done, stopped=stopped is not None)
        if prepared.request.completion:  # the text as written, thinking included (the <think> markers are not text)
            self._send_json(200, {
                "id": prepared.id, "object": "text_completion", "created": prepared.created,
                "model": service.model_id,
                "choices": [{"index": 0, "text": "".join(answer) + scanner.finish(), "logprobs": None,
                             "finish_reason": finish_reason(done, 0, stopped)}],
                "usage": usage_of(done),
                "clover": service.extras(prepared, done, blocks, stopped),
            })
            return
        continued = prepared.request.continued
        parser = AnswerParser(prepared.request.parse_tool_calls, continued == "content")
        text = "".join(answer) + scanner.finish() if scanner.stops else done.text
        items = parser.feed(text) + parser.finish()
        content = "".join(text for kind, text in items if kind == "content")
        calls = [call for kind, call in items if kind == "tool_call"]
        reasoning = _Trimmed(continued == "reasoning").push(done.thinking)
        message: dict[str, Any] = {"role": "assistant", "content": content or None,
                                   "reasoning_content": reasoning or None}
        if calls:
            message["tool_calls"] = calls
        self._send_json(200, {
            "id": prepared.id, "object": "chat.completion", "created": prepared.created, "model": service.model_id,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(done, len(calls), stopped),
                         "logprobs": None}],
            "usage": usage_of(done),
            "clover": service.extras(prepared, done, blocks, stopped),
        })

    def _stream(self, prepared: _Prepared, events: Iterator[Any], cancel: threading.Event) -> None:
        service = self.server.service
        self._answer_started = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Accel-Buffering", "no")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        completion = prepared.request.completion
        kind = "text_completion" if completion else "chat.completion.chunk"
        raw = RawText(*prepared.markers)

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
            choice = ({"index": 0, "text": delta.get("text", ""), "logprobs": None, "finish_reason": finish}
                      if completion else {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None})
            return {"id": prepared.id, "object": kind, "created": prepared.created, "model": service.model_id,
                    "choices": [choice], **extra}

        continued = prepared.request.continued
        parser = AnswerParser(prepared.request.parse_tool_calls, continued == "content")
        reasoning = _Trimmed(continued == "reasoning")
        scanner = StopScanner(prepared.request.stop)
        calls = 0
        blocks = 0
        done: Finished | None = None

        def send_items(items: list[tuple[str, Any]]) -> None:
            nonlocal calls
            for kind, value in items:
                if kind == "content":
                    self._sse(chunk({"content": value}))
                else:
                    self._sse(chunk({"tool_calls": [{"index": calls, **value}]}))
                    calls += 1

        last_check = time.monotonic()
        counted = False
        try:
            if not completion:
                self._sse(chunk({"role": "assistant", "content": ""}))
            for event in events:
                if isinstance(event, TextDelta) and scanner.hit is None:
                    if completion:
                        text = scanner.feed(raw.push(event.text, event.channel))
                        if text:
                            self._sse(chunk({"text": text}))
                        if scanner.hit is not None:
                            cancel.set()
                    elif event.channel == "thinking":
                        text = reasoning.push(event.text)
                        if text:
                            self._sse(chunk({"reasoning_content": text}))
                    else:
                        send_items(parser.feed(scanner.feed(event.text)))
                        if scanner.hit is not None:
                            cancel.set()  # the engine stops within a pass; the rest of its text is dropped
                elif isinstance(event, BlockCommitted):
                    blocks += 1
                elif isinstance(event, Finished):
                    done = event
                now = time.monotonic()
                if done is None and now - last_check > 0.05:
                    last_check = now
                    if self._client_gone():
                        raise _ClientGone()
            assert done is not None
            stopped = scanner.hit
            self._count(done, stopped=stopped is not None)
            counted = True
            rest = scanner.finish()
            if completion:
                if rest:
                    self._sse(chunk({"text": rest}))
            else:
                send_items(parser.feed(rest) + parser.finish())
            self._sse(chunk({}, finish_reason(done, calls, stopped),
                            clover=service.extras(prepared, done, blocks, stopped)))
            if prepared.request.include_usage:
                self._sse({"id": prepared.id, "object": kind, "created": prepared.created,
                           "model": service.model_id, "choices": [], "usage": usage_of(done)})
            self._write_chunk(b"data: [DONE]\n\n")
            self._write_chunk(b"")
        except (_ClientGone, BrokenPipeError, ConnectionResetError, socket.timeout):
            if not counted:
                self._count(self._drain(events, cancel))
            self.close_connection = True
        except Exception as exc:  # an engine bug or a device error: say so in the stream, keep serving
            log.exception("generation failed")
            if not counted:
                self._drain_quietly(events, cancel)
                self._count(None, failed=True)
            self.close_connection = True
            try:
                error = ApiError(500, f"generation failed: {exc}", type="server_error", code="generation_failed")
                self._sse(error.body())
                self._write_chunk(b"data: [DONE]\n\n")
                self._write_chunk(b"")
            except OSError:
                pass

    def _drain_quietly(self, events: Iterator[Any], cancel: threading.Event) -> Finished | None:
        try:
            return self._drain(events, cancel)
        except Exception:  # the engine failed again while stopping; the error was reported already
            return None

    def _sse(self, payload: dict[str, Any]) -> None:
        self._write_chunk(b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], service: ChatService, api_key: str | None,
                 max_body_bytes: int) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)
        self.service = service
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.lock = threading.Lock()
        self._connections: dict[Any, threading.Thread] = {}  # open client sockets and the threads serving them

    def process_request(self, request: Any, client_address: Any) -> None:
        """One thread per connection, remembered so that :meth:`close_connections` can end them."""
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                  name="clover-openai-connection", daemon=True)
        with self.lock:
            self._connections[request] = thread
        thread.start()

    def shutdown_request(self, request: Any) -> None:
        with self.lock:
            self._connections.pop(request, None)
        super().shutdown_request(request)

    def close_connections(self, timeout_s: float = 5.0) -> None:
        """End every open connection (a keep-alive client must not be served after the server stopped) and wait
        for the threads serving them."""
        with self.lock:
            open_now = list(self._connections.items())
        for sock, _ in open_now:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for _, thread in open_now:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def health(self) -> dict[str, Any]:
        service = self.service
        with self.lock:
            counters = service.counters.as_dict()
        return {"status": "ok" if service.ready else "loading", "model": service.model_id if service.ready else None,
                "busy": service.turns.busy, "waiting": service.turns.waiting, **counters}

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.exception("unexpected error while serving %s", client_address)


def _model_id(engine: Any) -> str:
    folder = getattr(engine, "model_dir", None)
    return getattr(folder, "name", None) or "clover"


class OpenAIServer:
    """The HTTP server. ``engine`` may be None at first (requests get 503 "loading" and ``/health`` says so) and
    set later with :meth:`attach`; ``lock`` is shared with any other user of the same engine."""

    def __init__(
        self,
        engine: Any = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        model_id: str | None = None,
        ctx_tokens: int | None = None,
        lock: Any = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_waiting: int = MAX_WAITING,
    ) -> None:
        self.service = ChatService(None, model_id or "clover", ctx_tokens, lock, max_waiting)
        self._model_id_given = model_id is not None
        self._httpd = _HTTPServer((host, port), self.service, api_key or None, max_body_bytes)
        self._thread: threading.Thread | None = None
        if engine is not None:
            self.attach(engine)

    def attach(self, engine: Any) -> None:
        """Serve ``engine`` from now on (the model id is its folder's name unless one was given). ``None``: no model
        for now (while another loads): requests get 503 "loading"; a generation already running finishes."""
        if engine is not None and not self._model_id_given:
            self.service.model_id = _model_id(engine)
        self.service.engine = engine

    @property
    def host(self) -> str:
        return str(self._httpd.server_address[0])

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """The base URL clients use (``.../v1``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def health(self) -> dict[str, Any]:
        return self._httpd.health()

    def serve_forever(self) -> None:
        self._httpd.serve_forever(poll_interval=0.2)

    def start(self) -> "OpenAIServer":
        """Serve in a background thread; returns self."""
        self._thread = threading.Thread(target=self.serve_forever, name="clover-openai-server", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting, cancel the generation in progress, end the open connections, release the port."""
        self.service.cancel_all()
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.server_close()
        self._httpd.close_connections()

    def __enter__(self) -> "OpenAIServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["ApiError", "AnswerParser", "ChatRequest", "ChatService", "OpenAIServer", "Turns", "parse_chat_request",
           "parse_tool_call"]
