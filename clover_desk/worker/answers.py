"""One generation's answer, made on a worker thread while the engine writes it, and handed to the connection's event
loop (:class:`Outlet`): one JSON answer, or a stream of server-sent events. The HTTP server
(:mod:`clover_desk.worker.server`) starts one such thread per request that generates; it holds the engine's turn
from its first event to its last."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from clover_desk.engine.decode.events import BlockCommitted, Finished, TextDelta, TokenLogprobs
from clover_desk.worker.logprobs import LogprobTrack
from clover_desk.worker.openai_schema import (
    AnswerParser,
    ApiError,
    ClientGone,
    RawText,
    StopScanner,
    _Trimmed,
    finish_reason,
    usage_of,
)
from clover_desk.worker.tool_stream import StreamingAnswerParser

log = logging.getLogger(__name__)

WRITE_TIMEOUT_S = 120.0  # a client that reads nothing of its answer for this long is taken for gone
_QUEUED = 64  # answer pieces waiting for the event loop at most (then the thread waits: the client reads slowly)
_CHECK_S = 0.05  # how often a plain answer's thread looks whether its client is still there


class CutShort(threading.Event):
    """A generation's cancel event, with why the server cut it short (None: its client, or a stop sequence)."""

    reason: str | None = None

    def cut(self, reason: str) -> None:
        self.reason = reason
        self.set()


class Outlet:
    """The worker thread's side of one answer: each piece goes to the event loop's ``queue`` in order (None: the
    end). ``gone`` is set when the client went away (the loop sees the connection close) or stopped reading."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any], gone: threading.Event,
                 write_timeout_s: float = WRITE_TIMEOUT_S) -> None:
        self._loop = loop
        self._queue = queue
        self.gone = gone
        self._room = threading.Semaphore(_QUEUED)
        self._write_timeout_s = write_timeout_s
        self.tokens: int | None = None  # what the engine wrote (the access log's count)
        self.started = False  # whether the answer's status line went out (an error then goes in the stream)

    def _put(self, item: tuple[Any, ...]) -> None:
        deadline = time.monotonic() + self._write_timeout_s
        while not self._room.acquire(timeout=0.1):
            if self.gone.is_set():
                raise ClientGone()
            if time.monotonic() > deadline:
                self.gone.set()
                raise ClientGone()
        if self.gone.is_set():
            self._room.release()
            raise ClientGone()
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def consumed(self) -> None:
        """The loop took a piece (called on the loop)."""
        self._room.release()

    def json(self, status: int, body: dict[str, Any], headers: tuple[tuple[str, str], ...] = ()) -> None:
        self.started = True
        self._put(("json", status, body, headers))

    def start_stream(self) -> None:
        self.started = True
        self._put(("stream",))

    def sse(self, payload: dict[str, Any]) -> None:
        self.data(b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")

    def data(self, raw: bytes) -> None:
        self._put(("data", raw))

    def close(self) -> None:
        """The end (always sent, without waiting for room)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, None)
        except RuntimeError:  # the loop is closed: the server stopped
            pass


class Answer:
    """Shapes the events of one prepared request (``service``: :class:`clover_desk.worker.server.ChatService`) as
    OpenAI's answer. ``count`` is called once when the generation is over (it releases the engine's turn):
    ``count(done, failed, stopped)``."""

    def __init__(self, service: Any, prepared: Any, cancel: CutShort, out: Outlet,
                 count: Callable[[Finished | None, bool, bool], None]) -> None:
        self.service = service
        self.prepared = prepared
        self.cancel = cancel
        self.out = out
        self._count = count
        self.counted = False

    def count(self, done: Finished | None, failed: bool = False, stopped: bool = False) -> None:
        if not self.counted:
            self.counted = True
            self.out.tokens = None if done is None else done.tokens
            self._count(done, failed, stopped)

    def drain(self, events: Iterator[Any]) -> Finished | None:
        """Cancel and run the generation to its end (it stops within a pass; hooks close their block)."""
        self.cancel.set()
        done = None
        try:
            for event in events:
                if isinstance(event, Finished):
                    done = event
        except Exception:  # the engine failed again while stopping; the error is reported already
            return None
        return done

    def _track(self) -> LogprobTrack | None:
        """Where the answer's log probabilities gather, when the request asked for them."""
        prepared = self.prepared
        if prepared.request.logprobs is None:
            return None
        return LogprobTrack(prepared.engine.tokenizer, prepared.request.completion)

    def _cut(self, done: Finished, stopped: str | None) -> str | None:
        """Why the generation was cut short by the server (shutdown, the model unloaded), or None."""
        if done.stop_reason != "cancelled" or stopped is not None:
            return None
        return self.cancel.reason

    # ---- one JSON answer ----
    def plain(self, events: Iterator[Any]) -> None:
        prepared, service = self.prepared, self.service
        done: Finished | None = None
        blocks = 0
        scanner = StopScanner(prepared.request.stop)
        answer: list[str] = []  # the answer channel up to a stop sequence (with stop sequences only)
        raw = RawText(*prepared.markers)  # a completion's text: both channels
        track = self._track()
        last_check = time.monotonic()
        try:
            for event in events:
                if isinstance(event, Finished):
                    done = event
                elif isinstance(event, TokenLogprobs) and track is not None:
                    track.add(event)
                elif isinstance(event, BlockCommitted):
                    blocks += 1
                elif isinstance(event, TextDelta) and prepared.request.completion:
                    answer.append(scanner.feed(raw.push(event.text, event.channel)))
                    if scanner.hit is not None:
                        self.cancel.set()
                elif isinstance(event, TextDelta) and event.channel != "thinking" and scanner.stops:
                    answer.append(scanner.feed(event.text))
                    if scanner.hit is not None:
                        self.cancel.set()  # the engine stops within a pass; the rest of its text is dropped
                now = time.monotonic()
                if now - last_check > _CHECK_S:
                    last_check = now
                    if self.out.gone.is_set():
                        self.count(self.drain(events))
                        raise ClientGone()
        except ClientGone:
            raise
        except Exception as exc:  # an engine bug or a device error: answer 500, keep serving
            self.count(None, failed=True)
            log.exception("generation failed")
            raise ApiError(500, f"generation failed: {exc}", type="server_error", code="generation_failed") from None
        assert done is not None
        stopped = scanner.hit
        self.count(done, stopped=stopped is not None)
        cut = self._cut(done, stopped)
        if cut is not None:
            raise ApiError(503, cut, type="server_error", code="generation_cut")
        extras = service.extras(prepared, done, blocks, stopped)
        entries = track.take(len("".join(answer)) if stopped is not None else None) if track is not None else []
        if prepared.request.completion:  # the text as written, thinking included (the <think> markers are not text)
            self.out.json(200, {
                "id": prepared.id, "object": "text_completion", "created": prepared.created,
                "model": service.model_id,
                "choices": [{"index": 0, "text": "".join(answer) + scanner.finish(),
                             "logprobs": track.legacy(entries) if track is not None else None,
                             "finish_reason": finish_reason(done, 0, stopped)}],
                "usage": usage_of(done), "clover": extras,
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
        self.out.json(200, {
            "id": prepared.id, "object": "chat.completion", "created": prepared.created, "model": service.model_id,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(done, len(calls), stopped),
                         "logprobs": track.chat(entries) if track is not None else None}],
            "usage": usage_of(done), "clover": extras,
        })

    # ---- server-sent events ----
    def _chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: dict[str, Any] | None = None,
               **extra: Any) -> dict[str, Any]:
        prepared = self.prepared
        completion = prepared.request.completion
        choice = ({"index": 0, "text": delta.get("text", ""), "logprobs": logprobs, "finish_reason": finish}
                  if completion else {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs})
        return {"id": prepared.id, "object": "text_completion" if completion else "chat.completion.chunk",
                "created": prepared.created, "model": self.service.model_id, "choices": [choice], **extra}

    def stream(self, events: Iterator[Any]) -> None:
        prepared, service, out = self.prepared, self.service, self.out
        out.start_stream()
        completion = prepared.request.completion
        raw = RawText(*prepared.markers)
        continued = prepared.request.continued
        parser = StreamingAnswerParser(prepared.request.parse_tool_calls, continued == "content")
        reasoning = _Trimmed(continued == "reasoning")
        scanner = StopScanner(prepared.request.stop)
        calls = 0
        blocks = 0
        done: Finished | None = None
        track = self._track()
        released = 0  # characters of the answer channel (a completion's text) let through the stop scanner

        def pending() -> dict[str, Any] | None:
            """The log probabilities not sent yet, for the chunk about to go (None: none asked, or none new)."""
            if track is None:
                return None
            entries = track.take(released if scanner.hit is not None else None)
            if not entries:
                return None
            return track.legacy(entries) if completion else track.chat(entries)

        def let_through(text: str) -> str:
            nonlocal released
            text = scanner.feed(text)
            released += len(text)
            return text

        def send_items(items: list[tuple[str, Any]]) -> None:
            nonlocal calls
            for kind, value in items:
                if kind == "content":
                    out.sse(self._chunk({"content": value}, logprobs=pending()))
                elif kind == "tool_call_arguments":  # a piece of the arguments of the call begun last
                    out.sse(self._chunk({"tool_calls": [{"index": calls - 1, "function": {"arguments": value}}]},
                                        logprobs=pending()))
                else:  # a call whole, or a call's first delta ("tool_call_begin")
                    out.sse(self._chunk({"tool_calls": [{"index": calls, **value}]}, logprobs=pending()))
                    calls += 1

        try:
            if not completion:
                out.sse(self._chunk({"role": "assistant", "content": ""}))
            for event in events:
                if isinstance(event, TokenLogprobs) and track is not None:
                    track.add(event)
                elif isinstance(event, TextDelta) and scanner.hit is None:
                    if completion:
                        text = let_through(raw.push(event.text, event.channel))
                        if text:
                            out.sse(self._chunk({"text": text}, logprobs=pending()))
                        if scanner.hit is not None:
                            self.cancel.set()
                    elif event.channel == "thinking":
                        text = reasoning.push(event.text)
                        if text:
                            out.sse(self._chunk({"reasoning_content": text}))
                    else:
                        send_items(parser.feed(let_through(event.text)))
                        if scanner.hit is not None:
                            self.cancel.set()  # the engine stops within a pass; the rest of its text is dropped
                elif isinstance(event, BlockCommitted):
                    blocks += 1
                elif isinstance(event, Finished):
                    done = event
                if done is None and out.gone.is_set():
                    raise ClientGone()
            assert done is not None
            stopped = scanner.hit
            self.count(done, stopped=stopped is not None)
            cut = self._cut(done, stopped)
            if cut is not None:  # not an answer that ended: say so, never finish_reason "stop"
                out.sse(ApiError(503, cut, type="server_error", code="generation_cut").body())
                out.data(b"data: [DONE]\n\n")
                return
            rest = scanner.finish()
            if completion:
                if rest:
                    out.sse(self._chunk({"text": rest}, logprobs=pending()))
            else:
                send_items(parser.feed(rest) + parser.finish())
            closed = 0 if parser.unfinished else calls  # a call cut short: the answer did not end on its calls
            out.sse(self._chunk({}, finish_reason(done, closed, stopped), logprobs=pending(),
                                clover=service.extras(prepared, done, blocks, stopped)))
            if prepared.request.include_usage:
                out.sse({"id": prepared.id, "object": "text_completion" if completion else "chat.completion.chunk",
                         "created": prepared.created, "model": service.model_id, "choices": [],
                         "usage": usage_of(done)})
            out.data(b"data: [DONE]\n\n")
        except ClientGone:
            if not self.counted:
                self.count(self.drain(events))
            raise
        except Exception as exc:  # an engine bug or a device error: say so in the stream, keep serving
            log.exception("generation failed")
            if not self.counted:
                self.drain(events)
                self.count(None, failed=True)
            error = ApiError(500, f"generation failed: {exc}", type="server_error", code="generation_failed")
            out.sse(error.body())
            out.data(b"data: [DONE]\n\n")
