"""OpenAI's request and answer shapes for the HTTP server (:mod:`clover_desk.worker.server`): a request body checked
into a :class:`ChatRequest` (or an :class:`ApiError` naming the first bad field), and the pieces an answer is made
of (reasoning and content apart, tool calls out of the content, stop sequences, a completion's raw text, usage).
Nothing here knows about HTTP connections or the engine's lock."""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from clover_desk.engine.decode.events import Finished, GenerationParams
from clover_desk.engine.decode.grammar import schema_problem, structured_spec
from clover_desk.engine.decode.limits import GENERATION_LIMITS

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_STOP_CHARS = 256
MAX_CACHE_SALT_CHARS = 256
MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit (the engine's too: engine.api.MAX_TOP_LOGPROBS)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's legacy limit
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# OpenAI fields the server reads, and OpenAI fields with no effect here that are accepted without a note.
_READ_FIELDS = {
    "messages", "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "seed", "presence_penalty", "repetition_penalty", "frequency_penalty", "n", "logprobs", "top_logprobs",
    "logit_bias", "stop", "response_format", "tools", "tool_choice", "functions", "function_call",
    "chat_template_kwargs", "clover", "continue_final_message", "add_generation_prompt", "cache_salt",
}
_COMPLETION_FIELDS = {
    "prompt", "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed",
    "presence_penalty", "repetition_penalty", "frequency_penalty", "n", "best_of", "logprobs", "echo", "suffix",
    "logit_bias", "stop", "clover", "cache_salt",
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


class ClientGone(Exception):
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
    cache_salt: str | None = None  # vLLM's field: prompt cache entries are shared only by requests with the same one
    logprobs: int | None = None  # None: no log probabilities; N: each token's, with N alternatives (logprobs.py)

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
    if body.get("logit_bias") not in (None, {}):
        raise _unsupported("logit_bias", "logit bias is not supported")
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
    structured = structured_output(body.get("response_format"), choice, tools)
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
    if continue_final and structured is not None:
        raise _unsupported("continue_final_message", "a continued answer cannot be held to a response_format "
                           "schema or a forced tool_choice (the grammar would start again mid-answer)")
    if continue_final and messages[-1]["role"] != "assistant":
        raise _bad(f"messages[{len(messages) - 1}].role", '"assistant" with continue_final_message (the answer it '
                   'continues)', messages[-1]["role"])

    mode, block_size, threshold = _clover(body)
    params = GenerationParams(max_new_tokens=max_tokens, block_size=block_size, threshold=threshold,
                              enable_thinking=enable_thinking, structured=structured, **sampling)
    return ChatRequest(
        messages=messages, tools=tools, params=params, mode=mode, stream=stream, include_usage=include_usage,
        ignored_fields=tuple(ignored), continue_final=bool(continue_final), stop=stop,
        cache_salt=_cache_salt(body.get("cache_salt")), logprobs=chat_logprobs(body),
    )


# ---------------------------------------------------------------------------------------------------------------
# structured output: response_format and a forced tool call, as the engine's grammar (engine.decode.grammar)


def _enforceable(schema: Any, param: str) -> dict[str, Any]:
    """``schema`` when the engine can enforce it, else a 400 naming ``param`` and what it cannot do."""
    if not isinstance(schema, dict):
        raise _bad(param, "a JSON schema object", schema)
    problem = schema_problem(schema)
    if problem is not None:
        raise ApiError(400, f"{param}: this JSON schema cannot be enforced: {problem}", param=param,
                       code="unsupported_schema")
    return schema


def _response_schema(fmt: Any) -> dict[str, Any] | None:
    """The JSON schema a ``response_format`` asks for (``json_object``: any object), or None for free text."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise _bad("response_format", '{"type": "text" | "json_object" | "json_schema", ...}', fmt)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise _bad("response_format.json_schema", 'an object with a "name" and a "schema"', spec)
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise _bad("response_format.json_schema.strict", "true, false or null", spec["strict"])
    # strict or not, the answer follows the schema: the engine masks every token by it
    return _enforceable(spec.get("schema", {}), "response_format.json_schema.schema")


def _call_schema(tools: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """The schema of one ``{"name": ..., "arguments": ...}`` call of one of the tools named ``names``."""
    options = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if fn["name"] not in names:
            continue
        arguments = fn.get("parameters") or {"type": "object"}
        _enforceable(arguments, f"tools[{i}].function.parameters")
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": arguments},
                        "required": ["name", "arguments"], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


def structured_output(fmt: Any, choice: Any, tools: list[dict[str, Any]] | None) -> str | None:
    """The engine's grammar (``GenerationParams.structured``) for a chat request's ``response_format`` and
    ``tool_choice``, or None for free text. ``tool_choice`` "required" or ``{"type": "function", "function":
    {"name"}}``: the answer is one tool call (of any of the tools, or of that one) whose arguments follow the
    tool's ``parameters``, in the model's ``<tool_call>`` form; "auto" and "none" change nothing here."""
    schema = _response_schema(fmt)
    if choice in (None, "auto", "none"):
        return None if schema is None else structured_spec(schema)
    if choice == "required":
        names = [t["function"]["name"] for t in tools or []]
    elif isinstance(choice, dict) and choice.get("type", "function") == "function" and isinstance(
            choice.get("function"), dict) and isinstance(choice["function"].get("name"), str):
        names = [choice["function"]["name"]]
    else:
        raise _bad("tool_choice", '"auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
                   choice)
    if not tools:
        raise _bad("tool_choice", "auto or none when the request has no tools", choice)
    known = [t["function"]["name"] for t in tools]
    if names[0] not in known:
        raise _bad("tool_choice.function.name", f"the name of one of the request's tools ({', '.join(known)})",
                   names[0])
    if schema is not None:
        raise _unsupported("response_format", "a JSON response_format cannot go with tool_choice "
                           f"{json.dumps(choice)}: the answer is then a tool call")
    return structured_spec(_call_schema(tools, names), before=TOOL_CALL_START + "\n", after="\n" + TOOL_CALL_END)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chat_logprobs(body: dict[str, Any]) -> int | None:
    """The alternatives per token a chat request asks for (``logprobs``, ``top_logprobs``), or None for none."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise _bad("logprobs", "true, false or null", asked)
    if top is not None and not (_whole(top) and 0 <= top <= MAX_TOP_LOGPROBS):
        raise _bad("top_logprobs", f"a whole number from 0 to {MAX_TOP_LOGPROBS}, or null", top)
    if top and not asked:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    return (top or 0) if asked else None


def completion_logprobs(body: dict[str, Any]) -> int | None:
    """A ``/v1/completions`` request's ``logprobs`` (alternatives per token, 0 to 5), or None for none."""
    value = body.get("logprobs")
    if value is None:
        return None
    if not (_whole(value) and 0 <= value <= MAX_COMPLETION_LOGPROBS):
        raise _bad("logprobs", f"a whole number from 0 to {MAX_COMPLETION_LOGPROBS}, or null", value)
    return int(value)


def _cache_salt(value: Any) -> str | None:
    """vLLM's ``cache_salt``: null or a non-empty string of at most :data:`MAX_CACHE_SALT_CHARS` characters."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_CACHE_SALT_CHARS:
        raise _bad("cache_salt", f"null or a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters", value)
    return value


def cache_scope(identity: str, salt: str | None) -> str:
    """The prompt cache scope of a request: its client's identity, and its ``cache_salt`` (hashed) if it has one."""
    if salt is None:
        return identity
    return f"{identity}|salt:{hashlib.sha256(salt.encode()).hexdigest()[:16]}"


def decode_json(raw: bytes) -> Any:
    """A request body as JSON; ApiError 400 ``invalid_json`` when it is not (NaN and Infinity are not numbers)."""
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError, RecursionError) as exc:
        detail = f"{exc.msg} at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) \
            else str(exc) or type(exc).__name__
        raise ApiError(400, f"the request body is not valid JSON ({detail})", code="invalid_json") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


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
    if body.get("response_format") not in (None, {"type": "text"}):
        raise _unsupported("response_format", "structured output is for /v1/chat/completions")
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
        cache_salt=_cache_salt(body.get("cache_salt")), logprobs=completion_logprobs(body),
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

