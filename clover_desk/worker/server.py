"""An OpenAI-compatible HTTP server over one :class:`engine.api.Engine` (``clover-desk serve``).

    server = OpenAIServer(engine, host="127.0.0.1", port=0, api_key=None).start()   # api_key: a key, keys or None
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
  ``tool_calls``). ``tool_choice``: ``auto`` (default), ``none`` (tools left out of the prompt, nothing parsed),
  ``required`` or ``{"type": "function", "function": {"name"}}`` (the answer is one such call, its arguments held
  to the tool's ``parameters`` by the engine's grammar). Streamed, a call's name goes out as soon as it is written
  and its arguments in pieces after it (:mod:`clover_desk.worker.tool_stream`).
* ``response_format``: ``text``, ``json_object`` or ``json_schema`` (the answer is JSON the schema accepts: every
  token is masked by a grammar, engine/decode/grammar.py; a schema it cannot enforce is a 400 naming the field;
  docs/SERVER.md "Structured output").
* ``logprobs`` (chat: true, with ``top_logprobs`` 0-20; completions: 0-5): each token's log probability under the
  model's own distribution (raw logits) and its best alternatives, in OpenAI's shapes, streamed per chunk too
  (:mod:`clover_desk.worker.logprobs`; which row per mode: docs/SERVER.md).
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
  size, timings, stop reason and ``ignored_fields``; in spec mode also ``verify_passes``, ``accepted_per_verify``,
  ``forwards_per_token`` and ``spec`` (the engine's counts).

Decisions:

* Unknown top-level fields are ignored, never silently: they are listed in ``clover.ignored_fields`` of the answer
  (clients and SDKs add vendor fields freely, and refusing them would break them). Known OpenAI fields asking for
  something the engine cannot do (``n`` > 1, ``logit_bias``, a JSON schema it cannot enforce,
  non-zero ``frequency_penalty``, legacy ``functions``) are refused with 400, as is an
  unknown key inside ``clover`` (our own namespace: a typo there is an error). The ``model`` field may name
  anything: the server has one model, and answers with its id.
* Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed JSON and
  bad fields (``param`` names the field), ``context_length_exceeded`` for a prompt (plus ``max_tokens``) over the
  context, 401 for a missing or wrong key, 403 for a ``Host`` or ``Origin`` outside the policy
  (:mod:`clover_desk.worker.http_guards`), 404 / 405 for other paths and methods, 408 for a body that does not
  come in time, 411 without a Content-Length, 413 for a body over ``max_body_bytes`` (told by its Content-Length,
  before any of it is read), 415 for a POST body that is not ``application/json``, 503 while the model loads, when
  too many requests wait or are in progress, and for an answer cut short by the server's shutdown (a stream then
  ends with an error event, never a ``finish_reason``).
* One engine runs one generation at a time. Requests wait their turn in arrival order (at most ``max_waiting``);
  a client that goes away while waiting leaves the queue, and one that closes its stream (or connection) during
  generation cancels it within a denoising pass. Nothing a client sends stops the server.
* The prompt cache is kept per client: the scope of a request is its API key's hash (with no key configured, that
  of the bearer token it sends, or "http" without one) plus its ``cache_salt`` (vLLM's field), and a request never
  goes on from another scope's entries (:class:`engine.decode.prompt_cache.PromptCache`), so ``cached_tokens`` and
  the time to the first token reveal nothing of other clients' prompts.
* HTTP: uvicorn (h11) serves a Starlette app from a thread with its own event loop; each generating request runs
  on a worker thread of its own (:mod:`clover_desk.worker.answers`) that holds the engine's turn. Host, Origin,
  connection caps and deadlines: :mod:`clover_desk.worker.http_guards`. One line per request goes to the
  ``clover_desk.access`` log (client, method, path, status, tokens, seconds; never the prompt).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from clover_desk.engine.decode.events import Finished, GenerationParams
from clover_desk.engine.errors import CloverError, PromptError
from clover_desk.worker.answers import Answer, CutShort, Outlet
from clover_desk.worker.http_guards import (
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_IN_FLIGHT,
    ConnectionGuard,
    HangupLog,
    RequestPolicy,
    log_access,
)
from clover_desk.worker.openai_schema import (  # noqa: F401 - AnswerParser, StopScanner ...: this module's names too
    AnswerParser,
    ApiError,
    ChatRequest,
    ClientGone,
    StopScanner,
    _markers,
    cache_scope,
    decode_json,
    parse_chat_request,
    parse_completion_request,
    parse_tool_call,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # 8 MiB: a 128k-token conversation is ~0.5 MB of JSON
MAX_WAITING = 32
_ClientGone = ClientGone  # its earlier name
_ROUTES = {"/health": "GET", "/v1/models": "GET", "/v1/chat/completions": "POST", "/v1/completions": "POST"}
_METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")
_BUSY = ApiError(503, "the server is busy: too many requests are in progress; try again later", type="server_error",
                 code="server_busy")

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
        """Wait for the turn; ApiError 503 when the queue is full, ClientGone when ``abandoned()`` turns true."""
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
                        raise ClientGone()
                self._busy = True
            finally:
                self._queue.remove(me)
                self._cond.notify_all()
        if self._lock is not None:
            while not self._lock.acquire(timeout=poll_s):
                if abandoned():
                    self._release_turn()
                    raise ClientGone()

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
    scope: str = "http"  # the prompt cache scope (the client's identity and cache_salt: openai_schema.cache_scope)
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

    def prepare(self, request: ChatRequest, identity: str = "http") -> _Prepared:
        """Render and count the prompt, fit the answer in the context; ApiError 400 otherwise. ``identity``: the
        client's, for the prompt cache (with the request's cache_salt)."""
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
        return _Prepared(request, engine, ids, params, written, markers, cache_scope(identity, request.cache_salt),
                         id=("cmpl-" if request.completion else "chatcmpl-") + uuid.uuid4().hex)

    def cancel_all(self, reason: str | None = None) -> None:
        """Cancel every running generation (within a pass). With a ``reason`` (the server shuts down) their answers
        end with an error saying it; without (the model is unloaded) they end as cancelled answers do."""
        with self._active_lock:
            for cancel in self._active:
                if reason is not None and isinstance(cancel, CutShort):
                    cancel.cut(reason)
                else:
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
                asked = {} if prepared.request.logprobs is None else {"logprobs": prepared.request.logprobs}
                events = prepared.engine.generate(prompt_ids=prepared.prompt_ids, params=prepared.params,
                                                  cancel=cancel, written=prepared.written,
                                                  cache_scope=prepared.scope, **asked)
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
            **(spec_extras(done) if params.mode == "spec" else {}),
            "ignored_fields": list(prepared.request.ignored_fields),
        }




def spec_extras(done: Finished) -> dict[str, Any]:
    """What spec mode adds to the ``clover`` object: its causal verify passes, the drafted tokens each accepted on
    average (the verifier's own token, which every verify pass adds too, not counted), the model forwards per
    token written, and the engine's counts (``Finished.spec``)."""
    return {"verify_passes": done.verify_passes, "accepted_per_verify": round(done.accepted_per_verify, 4),
            "forwards_per_token": round(done.forwards_per_token, 4), "spec": dict(done.spec)}


# ---------------------------------------------------------------------------------------------------------------
# HTTP: a Starlette app behind the guards, served by uvicorn from a thread


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()[:16]


def _client(scope: dict[str, Any]) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


class _Http:
    """The ASGI app: the request policy and the in-flight cap in front, then the routes (one catch-all Starlette
    route, so that every refusal has OpenAI's error shape)."""

    def __init__(self, service: ChatService, keys: tuple[str, ...], policy: RequestPolicy, max_body_bytes: int,
                 body_timeout_s: float, max_in_flight: int) -> None:
        self.service = service
        self.keys = keys
        self.policy = policy
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.lock = threading.Lock()
        self.hangups = HangupLog()
        self.app = Starlette(routes=[Route("/{path:path}", self.endpoint, methods=_METHODS)])

    # ---- the guard ----
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        started = time.monotonic()
        state = scope.setdefault("state", {})
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        status = [0]
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        extra = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")] \
            if origin is not None and self.policy.origin_allowed(origin) else []

        async def send_logged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                if extra:
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        try:
            early = self._screen(method, path, headers, origin)
            if early is not None:
                await early(scope, receive, send_logged)
                return
            counted = path != "/health"
            if counted and self.in_flight >= self.max_in_flight:
                await self._error(_BUSY, close=method == "POST")(scope, receive, send_logged)
                return
            self.in_flight += counted
            try:
                await self.app(scope, receive, send_logged)
            finally:
                self.in_flight -= counted
        finally:
            log_access(_client(scope), method, path, status[0], state.get("tokens"), time.monotonic() - started)

    def _screen(self, method: str, path: str, headers: Headers, origin: str | None) -> Response | None:
        """The answer to a request refused (or a preflight answered) before any work, else None."""
        if not self.policy.host_allowed(headers.get("host")):
            return self._error(ApiError(403, f"Host {headers.get('host', '(none)')!r} is not allowed: this server "
                                             "answers requests addressed to this machine (--allowed-hosts adds names)",
                                        type="permission_error", code="host_not_allowed"), close=True)
        if origin is not None and not self.policy.origin_allowed(origin):
            return self._error(ApiError(403, f"requests from pages at {origin!r} are not allowed (--allowed-origins "
                                             "adds origins)", type="permission_error", code="origin_not_allowed"),
                               close=True)
        if method not in _METHODS:
            return self._error(ApiError(501, f"the method {method} is not supported", code="not_implemented"),
                               close=True)
        if method == "OPTIONS":
            allow = {"Allow": "GET, POST, OPTIONS"}
            if origin is not None:
                allow.update({"Access-Control-Allow-Methods": "GET, POST, OPTIONS", "Access-Control-Max-Age": "600",
                              "Access-Control-Allow-Headers": headers.get("access-control-request-headers",
                                                                          "authorization, content-type")})
            return Response(status_code=204, headers=allow)
        return None

    def _error(self, err: ApiError, close: bool = False) -> Response:
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else {}
        if close:
            headers["Connection"] = "close"  # a body nobody reads must not be taken for the next request
        if err.code not in ("generation_failed", "generation_cut"):  # those are counted as failed or cancelled
            with self.lock:
                self.service.counters.rejected += 1
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    def health(self) -> dict[str, Any]:
        service = self.service
        with self.lock:
            counters = service.counters.as_dict()
        return {"status": "ok" if service.ready else "loading", "model": service.model_id if service.ready else None,
                "busy": service.turns.busy, "waiting": service.turns.waiting, **counters}

    # ---- the routes ----
    async def endpoint(self, request: Request) -> Response:
        method, path = request.method, request.url.path.rstrip("/") or "/"
        body_read = method != "POST"
        try:
            expected = _ROUTES.get(path) or ("GET" if path.startswith("/v1/models/") else None)
            if expected is None:
                raise ApiError(404, f"no such endpoint: {method} {path} (this server has /v1/models, "
                                    "/v1/chat/completions, /v1/completions and /health)", code="not_found")
            if method != expected:
                raise ApiError(405, f"{method} {path} is not allowed; use {expected}", code="method_not_allowed")
            if path == "/health":
                return JSONResponse(self.health(), headers=self._closing(request))
            identity = self._identity(request)
            if not self.service.ready:
                raise ApiError(503, "the model is still loading", type="server_error", code="model_loading")
            if path.startswith("/v1/models"):
                return JSONResponse(self._models(path), headers=self._closing(request))
            body = await self._read_body(request)
            body_read = True
            return _GenerationResponse(self, body, path == "/v1/completions", identity)
        except ApiError as err:
            return self._error(err, close=not body_read)
        except ClientGone:
            self.hangups.note(_client(request.scope), method, path)
            return Response(status_code=499)  # nginx's "client closed request": for the access log only

    @staticmethod
    def _closing(request: Request) -> dict[str, str]:
        """A GET with a body: the body is not read, so the connection must not go on."""
        return {"Connection": "close"} if request.headers.get("content-length", "0").strip() not in ("", "0") else {}

    def _models(self, path: str) -> dict[str, Any]:
        card = self.service.model_card()
        if path == "/v1/models":
            return {"object": "list", "data": [card]}
        if path[len("/v1/models/"):] != card["id"]:
            raise ApiError(404, f"the model {path[len('/v1/models/'):]!r} does not exist; this server has "
                                f"{card['id']!r}", param="model", code="model_not_found")
        return card

    def _identity(self, request: Request) -> str:
        """Who the client is, for the prompt cache: its key's hash (ApiError 401 without a right one, when the server
        has keys), else its bearer token's hash, else "http"."""
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        if not self.keys:
            return f"http:{_digest(token)}" if token else "http"
        match = None
        for key in self.keys:  # every key compared, in constant time each
            if hmac.compare_digest(token.encode(), key.encode()):
                match = key
        if match is None:
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'" if given
                           else "this server needs an API key: send 'Authorization: Bearer KEY'", code="invalid_api_key")
        return f"key:{_digest(match)}"

    async def _read_body(self, request: Request) -> bytes:
        """The body of a POST, its size checked before any of it is read, within ``body_timeout_s``."""
        headers = request.headers
        if "chunked" in headers.get("transfer-encoding", "").lower():
            raise ApiError(411, "send the body with a Content-Length (chunked request bodies are not read)",
                           code="length_required")
        length_text = headers.get("content-length")
        if length_text is None:
            raise ApiError(411, "a Content-Length header is required", code="length_required")
        try:
            length = int(length_text)
            if length < 0:
                raise ValueError
        except ValueError:
            raise ApiError(400, f"Content-Length {length_text!r} is not a byte count", code="invalid_request") from None
        if length > self.max_body_bytes:
            raise ApiError(413, f"the request body is {length} bytes; this server takes at most {self.max_body_bytes}",
                           code="request_too_large")
        kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if kind != "application/json":
            raise ApiError(415, f"the request body must be application/json, not {kind or 'untyped'!r}",
                           code="unsupported_media_type")
        try:
            return await asyncio.wait_for(request.body(), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not come within {self.body_timeout_s:g} s",
                           code="request_timeout") from None
        except ClientDisconnect:
            raise ClientGone() from None

    # ---- a generation, on a thread of its own ----
    def job(self, body: bytes, completion: bool, identity: str, out: Outlet) -> None:
        """Parse, count, wait for the engine's turn, generate: what :class:`_GenerationResponse` runs off the loop."""
        try:
            try:
                request = (parse_completion_request if completion else parse_chat_request)(decode_json(body))
                prepared = self.service.prepare(request, identity)
                self.service.turns.acquire(out.gone.is_set)
            except ApiError as err:
                self._error(err)
                out.json(err.status, err.body())
                return
            self._generate(prepared, out)
        except ClientGone:
            pass
        except Exception:  # a bug here: answer 500 (unless the answer had begun) and keep serving
            log.exception("unexpected error while answering")
            if not out.started:
                err = ApiError(500, "internal server error (see the server's log)", type="server_error",
                               code="internal_error")
                self._error(err)
                out.json(500, err.body())
        finally:
            out.close()

    def _generate(self, prepared: _Prepared, out: Outlet) -> None:
        service = self.service
        held = [True]

        def release() -> None:
            if held[0]:
                held[0] = False
                service.turns.release()

        def count(done: Finished | None, failed: bool, stopped: bool) -> None:
            release()  # the next request starts before the last bytes of this answer are written
            with self.lock:
                if failed or done is None:
                    service.counters.failed += 1
                elif done.stop_reason == "cancelled" and not stopped:
                    service.counters.cancelled += 1
                else:
                    service.counters.completed += 1

        cancel = CutShort()
        answer = Answer(service, prepared, cancel, out, count)
        try:
            events = service.run(prepared, cancel)
            first = next(events)  # PromptError is raised here, before any byte of the answer is sent
            (answer.stream if prepared.request.stream else answer.plain)(_chain(first, events))
        except ApiError as err:
            self._error(err)
            if not out.started:
                out.json(err.status, err.body())
        finally:
            release()


async def _watch(receive: Any, gone: threading.Event, done: asyncio.Event) -> None:
    """Set ``gone`` when the client disconnects (uvicorn says so as soon as the connection closes)."""
    while not done.is_set():
        message = await receive()
        if message["type"] == "http.disconnect":
            break
    if not done.is_set():
        gone.set()


class _GenerationResponse(Response):
    """The answer of a generating request: the worker thread's pieces (:class:`Outlet`) written as they come."""

    def __init__(self, http: _Http, body: bytes, completion: bool, identity: str) -> None:
        self.http, self.body_bytes, self.completion, self.identity = http, body, completion, identity
        self.status_code = 200
        self.background = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        gone, finished = threading.Event(), asyncio.Event()
        out = Outlet(loop, queue, gone)
        watcher = asyncio.create_task(_watch(receive, gone, finished))
        threading.Thread(target=self.http.job, args=(self.body_bytes, self.completion, self.identity, out),
                         name="clover-openai-request", daemon=True).start()
        try:
            while (item := await queue.get()) is not None:
                out.consumed()
                if gone.is_set():
                    continue  # the thread sees it and ends; what it sent meanwhile goes nowhere
                await self._send(item, send, finished)
        except BaseException:
            gone.set()  # the server shuts down: the thread cancels its generation
            raise
        finally:
            watcher.cancel()
            scope.setdefault("state", {})["tokens"] = out.tokens
        if gone.is_set() and not finished.is_set():
            self.http.hangups.note(_client(scope), scope["method"], scope["path"])
        elif out.started and not finished.is_set():
            finished.set()
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _send(item: tuple[Any, ...], send: Any, finished: asyncio.Event) -> None:
        kind = item[0]
        if kind == "json":
            response = JSONResponse(item[2], status_code=item[1], headers=dict(item[3]))
            finished.set()
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": response.raw_headers})
            await send({"type": "http.response.body", "body": response.body, "more_body": False})
        elif kind == "stream":
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]})
        else:
            await send({"type": "http.response.body", "body": item[1], "more_body": True})


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (OSError when it cannot be had: in use, not this machine's)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _model_id(engine: Any) -> str:
    folder = getattr(engine, "model_dir", None)
    return getattr(folder, "name", None) or "clover"


class OpenAIServer:
    """The HTTP server. ``engine`` may be None at first (requests get 503 "loading" and ``/health`` says so) and
    set later with :meth:`attach`; ``lock`` is shared with any other user of the same engine. ``api_key``: a key,
    several (each client its own: their prompt caches are apart) or None. ``allowed_hosts`` / ``allowed_origins``:
    :class:`~clover_desk.worker.http_guards.RequestPolicy` (ValueError naming a bad entry)."""

    def __init__(
        self,
        engine: Any = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | Sequence[str] | None = None,
        model_id: str | None = None,
        ctx_tokens: int | None = None,
        lock: Any = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_waiting: int = MAX_WAITING,
        allowed_hosts: Sequence[str] = (),
        allowed_origins: Sequence[str] = (),
        max_connections: int = MAX_CONNECTIONS,
        max_in_flight: int = MAX_IN_FLIGHT,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ) -> None:
        keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
        self.policy = RequestPolicy.make(host, allowed_hosts, allowed_origins)
        self.service = ChatService(None, model_id or "clover", ctx_tokens, lock, max_waiting)
        self._model_id_given = model_id is not None
        self._sock = _listen(host, port)
        self._address = self._sock.getsockname()  # (host, port, ...): kept for after close
        self.guard = ConnectionGuard(max_connections, header_timeout_s)
        self._http = _Http(self.service, tuple(k for k in keys if k), self.policy, max_body_bytes, body_timeout_s,
                           max_in_flight)
        config = uvicorn.Config(self._http, http=self.guard.protocol(), ws="none", lifespan="off", loop="asyncio",
                                log_config=None, access_log=False, proxy_headers=False, server_header=False,
                                timeout_keep_alive=5, timeout_graceful_shutdown=5)
        self._uvicorn = uvicorn.Server(config)
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
        return str(self._address[0])

    @property
    def port(self) -> int:
        return int(self._address[1])

    @property
    def url(self) -> str:
        """The base URL clients use (``.../v1``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def health(self) -> dict[str, Any]:
        return self._http.health()

    def start(self) -> OpenAIServer:
        """Serve from a background thread (its own event loop); returns self once it accepts connections."""
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self._sock]},
                                        name="clover-openai-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._uvicorn.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        return self

    def close(self, reason: str = "the server is shutting down; the answer was cut short") -> None:
        """Stop accepting, cut the generations in progress short (their answers end with an error saying
        ``reason``), end the open connections, release the port."""
        self.service.cancel_all(reason)
        if self._thread is not None:
            self._uvicorn.should_exit = True
            self._thread.join(timeout=10)
            self._thread = None
        self._sock.close()

    def __enter__(self) -> OpenAIServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["ApiError", "AnswerParser", "ChatRequest", "ChatService", "OpenAIServer", "Turns", "parse_chat_request",
           "parse_tool_call"]
