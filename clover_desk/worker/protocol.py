"""The worker protocol's command checks: every command line is parsed and checked here, before the worker acts.

A line that is not JSON, not an object, nested deeper than :data:`MAX_NESTING` levels or longer than
:data:`MAX_LINE_BYTES` is refused by :func:`parse_command` / :func:`read_lines`; ``load``, ``serve``, ``generate``
(and its ``params``), ``read_chat`` and ``plan`` are checked whole by ``check_*``, each refusal a
:class:`ProtocolError` whose message names the field and what is allowed. The commands and replies themselves are
described in :mod:`clover_desk.worker.process`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from clover_desk.engine.decode.events import MODES, GenerationParams
from clover_desk.engine.decode.limits import GENERATION_LIMITS, INT32_MAX
from clover_desk.engine.defaults import PRECISIONS

MAX_LINE_BYTES = 16 * 1024 * 1024  # a longer command line is refused (and skipped without being held in memory)
MAX_NESTING = 64  # JSON nesting a command may have (plans, messages and tool schemas need far less)
_SKIP_CHUNK = 1 << 20



class ProtocolError(ValueError):
    """A command refused as sent; the message names the field and what is allowed."""


DEVICES_TEXT = '"cpu", "cuda" or "cuda:N"'
DTYPES = ("float32", "bfloat16", "float16")
COMMANDS = ("load", "cancel_load", "generate", "cancel", "read_chat", "plan", "serve", "serve_stop", "shutdown")
GGUF_LAYOUTS = ("auto", "fork", "upstream")
_CUDA_INDEX = re.compile(r"cuda:[0-9]{1,3}")
MAX_BUDGET_BYTES = 1 << 46  # 64 TiB (the CLI's --vram-gb cap): a budget above is a mistake


def show_value(value: Any) -> str:
    """A bad value as a short JSON snippet for an error message."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def refused(where: str, allowed: str, value: Any) -> ProtocolError:
    """``<where> must be <allowed>, got <value>``: the one-line refusal every check raises."""
    return ProtocolError(f"{where} must be {allowed}, got {show_value(value)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


Check = Callable[[Any], bool]


def _nullable(check: Check) -> Check:
    return lambda v: v is None or check(v)


def _int_in(lo: int, hi: int) -> Check:
    return lambda v: _is_int(v) and lo <= v <= hi


def _number_in(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Check:
    def check(v: Any) -> bool:
        if not _is_finite_number(v):
            return False
        return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)

    return check


def _one_of(*choices: str) -> Check:
    return lambda v: isinstance(v, str) and v in choices


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_path(v: Any) -> bool:
    return isinstance(v, str) and bool(v.strip()) and "\x00" not in v


def _is_device(v: Any) -> bool:
    return isinstance(v, str) and (v in ("cpu", "cuda") or _CUDA_INDEX.fullmatch(v) is not None)


# field -> (check, what is allowed). Nullable fields take null for "the default".
LOAD_FIELDS: dict[str, tuple[Check, str]] = {
    "model_dir": (_is_path, "a non-empty folder path (string)"),
    "device": (_nullable(_is_device), f"{DEVICES_TEXT}, or null (cpu)"),
    "dtype": (_nullable(_one_of(*DTYPES)), '"float32", "bfloat16" or "float16", or null (float32)'),
    "vram_budget_bytes": (_nullable(_int_in(1, MAX_BUDGET_BYTES)),
                          f"a whole number of bytes from 1 to {MAX_BUDGET_BYTES}, or null"),
    "ctx_tokens": (_nullable(_int_in(1, INT32_MAX)), f"a whole number of tokens from 1 to {INT32_MAX}, or null"),
    "ctx": (_nullable(_int_in(1, INT32_MAX)), f"a whole number of tokens from 1 to {INT32_MAX}, or null"),
    "plan": (_nullable(lambda v: isinstance(v, dict)), "an object (Plan.to_dict()) or null"),
    "precision": (_nullable(_one_of(*PRECISIONS)), f"one of {', '.join(PRECISIONS)} (Engine.load), or null"),
    "gguf_layout": (_nullable(_one_of(*GGUF_LAYOUTS)), '"auto", "fork" or "upstream" (a .gguf file), or null (auto)'),
    "compile": (_nullable(_is_bool), "true (compile the decoder layers), false or null (not compiled)"),
}


def _is_host(v: Any) -> bool:
    """A host name or address to bind: no spaces or control characters (``"0.0.0.0"``, ``"::1"``, ``"localhost"``)."""
    return isinstance(v, str) and 0 < len(v) <= 253 and all(0x21 <= ord(c) <= 0x7E for c in v)


def _is_host_list(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= 64 and all(_is_host(item) for item in v)


def _is_api_key(v: Any) -> bool:
    """An API key travels in an HTTP header (``Authorization: Bearer KEY``): printable ASCII, no spaces."""
    return isinstance(v, str) and 0 < len(v) <= 4096 and all(0x21 <= ord(c) <= 0x7E for c in v)


SERVE_FIELDS: dict[str, tuple[Check, str]] = {
    "host": (_is_host, 'a host name or address to listen on, e.g. "127.0.0.1" or "0.0.0.0" (no spaces)'),
    "port": (_int_in(0, 65535), "a port number from 0 (any free port) to 65535"),
    "api_key": (_nullable(_is_api_key), "null (no key) or a key of printable ASCII characters without spaces"),
    "allowed_hosts": (_nullable(_is_host_list), "null or a list of host names or addresses (e.g. [\"llm.lan\"])"),
    "allowed_origins": (_nullable(_is_host_list), 'null or a list of origins (e.g. ["https://app.example.com"])'),
    "insecure_no_api_key": (_nullable(_is_bool), "true to listen on a non-loopback address without a key, else "
                                                 "false or null"),
}


def _limited(name: str) -> tuple[Check, str]:
    """A numeric generation parameter: its type and range from clover_desk.engine.decode.limits (the table the CLI's flags and
    generation_config.json's validation use too), or null for the model's default."""
    limit = GENERATION_LIMITS[name]
    return _nullable(limit.accepts), f"{limit.allowed}, or null"


def _param_field(f: dataclasses.Field) -> tuple[Check, str]:  # type: ignore[type-arg]
    """The wire check of one GenerationParams field: a numeric one's type and range from GENERATION_LIMITS (the
    threshold's 0 included: commit every slot in one pass), the mode from MODES, a flag true or false (or null when
    its default is None: the model's default)."""
    if f.name in GENERATION_LIMITS:
        return _limited(f.name)
    if f.name == "mode":
        return _one_of(*MODES), " or ".join(", ".join(f'"{m}"' for m in MODES).rsplit(", ", 1))
    if f.type in ("bool", "bool | None"):
        return (_nullable(_is_bool), "true, false or null") if f.default is None else (_is_bool, "true or false")
    if f.type == "str | None":  # the structured output spec (JSON text)
        return _nullable(lambda v: isinstance(v, str)), "a string or null"
    raise TypeError(f"GenerationParams.{f.name}: no wire check (add it to GENERATION_LIMITS or here)")


# GenerationParams' fields (engine/decode/events.py), each with the check of its type and range, made from the
# dataclass and the limits table: a new field gets its check there, not restated here.
PARAM_FIELDS: dict[str, tuple[Check, str]] = {f.name: _param_field(f) for f in dataclasses.fields(GenerationParams)}
GENERATE_FIELDS = ("cmd", "id", "messages", "prompt", "prompt_ids", "raw", "tools", "params")
PLAN_BUDGETS: dict[str, tuple[Check, str]] = {
    "id": (_nullable(lambda v: isinstance(v, str)), "a string or null"),
    "model_dir": (_is_path, "a non-empty folder path or shape name (string)"),
    "vram_budget_bytes": (_nullable(_int_in(0, MAX_BUDGET_BYTES)),
                          f"a whole number of bytes from 0 to {MAX_BUDGET_BYTES}, or null (what is free)"),
    "ram_gb": (_nullable(_number_in(0, math.inf, lo_open=True)), "a finite number of GiB > 0, or null (what is free)"),
    "ctx": LOAD_FIELDS["ctx"],
    "ctx_tokens": LOAD_FIELDS["ctx_tokens"],
}


def _check_fields(
    command: dict[str, Any], what: str, fields: dict[str, tuple[Check, str]], *, required: Sequence[str] = (),
    known: Sequence[str] | None = None,
) -> None:
    """Raise ProtocolError naming the first field of ``command`` that is missing, unknown or not allowed."""
    for name in required:
        if name not in command:
            raise ProtocolError(f"{what} needs field {name!r}: {fields[name][1]}")
    if known is not None:
        for name in command:
            if name not in known:
                raise ProtocolError(f"{what} has unknown field {show_value(name)}; its fields are: {', '.join(known)}")
    for name, (check, allowed) in fields.items():
        if name in command and not check(command[name]):
            raise refused(f"{what}: field {name!r}", allowed, command[name])


def check_load(command: dict[str, Any]) -> None:
    """Refuse a ``load`` whose fields are missing, unknown, of the wrong type or out of range."""
    _check_fields(command, "load", LOAD_FIELDS, required=("model_dir",), known=("cmd", *LOAD_FIELDS))


def check_serve(command: dict[str, Any]) -> None:
    """Refuse a ``serve`` whose fields are missing, unknown, of the wrong type or out of range."""
    _check_fields(command, "serve", SERVE_FIELDS, required=("host", "port"), known=("cmd", *SERVE_FIELDS))


def check_params(params: Any) -> GenerationParams:
    """``generate``'s ``params`` (null or an object of GenerationParams fields) as GenerationParams, else
    ProtocolError."""
    if params is None:
        return GenerationParams()
    if not isinstance(params, dict):
        raise refused("generate: field 'params'", "an object of generation parameters or null", params)
    _check_fields(params, "generate params", PARAM_FIELDS, known=tuple(PARAM_FIELDS))
    return GenerationParams(**params)


def check_generate(command: dict[str, Any], vocab_size: int | None = None) -> GenerationParams:
    """Refuse a ``generate`` with a field of the wrong type (the engine judges the prompt itself); returns the
    params. ``vocab_size`` bounds ``prompt_ids`` (an id past the vocabulary is a device-side assert on a GPU)."""
    unknown = [k for k in command if k not in GENERATE_FIELDS]
    if unknown:
        fields = ", ".join(GENERATE_FIELDS)
        raise ProtocolError(f"generate has unknown field {show_value(unknown[0])}; its fields are: {fields}")
    messages = command.get("messages")
    if messages is not None:
        if not isinstance(messages, list):
            raise refused("generate: field 'messages'", "a list of message objects or null", messages)
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise refused(f"generate: messages[{i}]", "an object with 'role' and 'content'", message)
            if not isinstance(message.get("role"), str) or not message["role"]:
                raise refused(f"generate: messages[{i}].role", "a non-empty string", message.get("role"))
            content = message.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise refused(f"generate: messages[{i}].content", "a string, a list of parts or null", content)
    prompt = command.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise refused("generate: field 'prompt'", "a string or null", prompt)
    check_prompt_ids(command.get("prompt_ids"), vocab_size)
    if "raw" in command and not isinstance(command["raw"], bool):
        raise refused("generate: field 'raw'", "true or false", command["raw"])
    tools = command.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise refused("generate: field 'tools'", "a list of tool objects or null", tools)
    return check_params(command.get("params"))


READ_CHAT_FIELDS = ("cmd", "id", "messages", "tools", "params")


def check_read_chat(command: dict[str, Any]) -> GenerationParams:
    """Refuse a ``read_chat`` with a missing, unknown or mistyped field; returns the params."""
    unknown = [k for k in command if k not in READ_CHAT_FIELDS]
    if unknown:
        raise ProtocolError(f"read_chat has unknown field {show_value(unknown[0])}; its fields are: "
                            f"{', '.join(READ_CHAT_FIELDS)}")
    if not isinstance(command.get("messages"), list) or not command["messages"]:
        raise refused("read_chat: field 'messages'", "a non-empty list of message objects", command.get("messages"))
    return check_generate(command)


def check_prompt_ids(prompt_ids: Any, vocab_size: int | None = None) -> None:
    """``prompt_ids``: null or a list of token ids below ``vocab_size`` (when known), else ProtocolError."""
    if prompt_ids is None:
        return
    if not isinstance(prompt_ids, list):
        raise refused("generate: field 'prompt_ids'", "a list of token ids or null", prompt_ids)
    top = (vocab_size if _is_int(vocab_size) and vocab_size > 0 else INT32_MAX + 1) - 1  # type: ignore[operator]
    for i, token in enumerate(prompt_ids):
        if not _is_int(token) or not 0 <= token <= top:
            raise refused(f"generate: prompt_ids[{i}]", f"a token id from 0 to {top}", token)


def check_plan_command(command: dict[str, Any]) -> None:
    """Refuse a ``plan`` whose budgets or context are of the wrong type or out of range (other keys: make_plan's
    options, checked against its signature when the plan is made)."""
    _check_fields(command, "plan", PLAN_BUDGETS, required=("model_dir",))


def _nesting_depth(value: Any, limit: int) -> int:
    """How deep ``value`` nests (iteratively; stops counting past ``limit``)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_command(line: bytes) -> dict[str, Any]:
    """One protocol line as a JSON object, or ProtocolError saying what is wrong with it (``cmd`` itself is
    checked by :meth:`Worker.handle`, which can then answer with the command's ``id``)."""
    try:
        command = json.loads(line)
    except RecursionError:
        raise ProtocolError(
            f"bad command line: nested too deeply to parse; a command nests at most {MAX_NESTING} levels"
        ) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer with too many digits
        raise ProtocolError(f"bad command line: not JSON ({exc}); send one JSON object per line") from None
    if not isinstance(command, dict):
        raise ProtocolError(f"bad command line: a command is a JSON object with a 'cmd' field, got {show_value(command)}")
    if _nesting_depth(command, MAX_NESTING) > MAX_NESTING:
        raise ProtocolError(f"bad command line: nested more than {MAX_NESTING} levels deep")
    return command


def read_lines(stream: IO[bytes], limit: int = MAX_LINE_BYTES) -> Iterator[bytes | None]:
    """The lines of ``stream`` without their line ends; ``None`` for a line longer than ``limit`` bytes, whose
    rest is read and dropped in chunks (never held in memory)."""
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(b"\n"):
            while True:
                rest = stream.readline(_SKIP_CHUNK)
                if not rest or rest.endswith(b"\n"):
                    break
            yield None
            continue
        yield line.rstrip(b"\r\n")


def request_id_of(command: dict[str, Any]) -> str | None:
    value = command.get("id")
    return value if isinstance(value, str) else None
