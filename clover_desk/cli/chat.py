"""``clover-desk chat``: a conversation with a model in the terminal, as ``ollama run`` and ``llama-cli -cnv`` have
(or, with ``--remote URL``, with an OpenAI-compatible server).

Each line read is a user message (a line ending in ``\\`` goes on to the next); the answer streams as ``generate``
prints it, with its figures on stderr (how many of the prompt's tokens the engine's prompt cache had read already:
a turn reads only what is new). Commands: ``/bye`` (or end of input) ends it, ``/reset`` starts over, ``/think on|off``,
``/mode diffusion|ar``, ``/help``. Ctrl-C stops the answer being written (what it wrote stays in the chat) and, at
the prompt, drops the line being typed. A message the context cannot hold is one line and the chat goes on without
it; a chat past the context leaves its oldest turns out, as the window does (``ui.context_window.fit_messages``). On
a terminal, while the next message is typed, the engine reads the chat ahead, the answer just given included,
so sending reads only the new message (``Engine.read_chat``). Works on piped input too (no prompt is printed then).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import sys
import threading
from typing import Any, TextIO

from clover_desk.cli import generate as cmd_generate
from clover_desk.engine.decode.events import MODES

log = logging.getLogger(__name__)

HELP = """commands: /bye (or Ctrl-D) ends the chat, /reset starts a new one, /think on|off, /mode diffusion|ar|spec, /help;
a line ending in \\ goes on to the next; Ctrl-C stops an answer"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cmd_generate.add_model_arguments(parser, "chat with")
    parser.add_argument("--system", metavar="TEXT", default=None, help="a system prompt")
    cmd_generate.add_local_arguments(parser)
    cmd_generate.add_cache_ram_argument(parser)
    cmd_generate.add_decoding_arguments(parser)


# with --remote, also the load's own flags are refused
_CHAT_LOCAL_ONLY = (*cmd_generate.LOCAL_ONLY, ("compile", "--compile", False), ("gguf_layout", "--gguf-layout", "auto"),
                    ("cache_ram", "--cache-ram", None))


def run(args: argparse.Namespace) -> int:
    from clover_desk.engine.errors import CloverError, ConfigError

    try:
        system = _system(args.system)
        params = cmd_generate.params_from(args)
        if args.remote is not None:
            backend: Any = cmd_generate.remote_backend(args, _CHAT_LOCAL_ONLY)
        elif args.model is None:
            raise ConfigError("--model DIR is required (or --remote URL)")
        else:
            args.model = cmd_generate.resolve_model(args.model)
            cmd_generate.check_ctx(args)
            backend = cmd_generate.apply_cache_ram(cmd_generate.load_engine(args, "chat"), args)
    except CloverError as exc:
        print(f"clover-desk chat: error: {exc}", file=sys.stderr)
        return 2
    return Chat(backend, params, system).run(sys.stdin, sys.stdout, sys.stderr)


def _system(text: str | None) -> str | None:
    from clover_desk.engine.decode.limits import check_text

    if text is None or not text.strip():
        return None
    return check_text(text, "--system")


class Chat:
    """One terminal conversation with ``engine``, an Engine or a RemoteBackend (the history, the settings the
    commands change)."""

    def __init__(self, engine: Any, params: Any, system: str | None) -> None:
        self.engine = engine
        self.remote = not hasattr(engine, "generate")
        self.params = params
        self.system = system
        self.messages: list[dict[str, str]] = []
        self._left_out = 0  # the oldest messages a send leaves out (the chat past the context), as the window does
        self._reading: tuple[threading.Thread, threading.Event] | None = None  # the chat read ahead, while typing

    def run(self, stdin: TextIO, out: TextIO, err: TextIO) -> int:
        try:
            return self._loop(stdin, out, err)
        finally:
            self._stop_reading()

    def _loop(self, stdin: TextIO, out: TextIO, err: TextIO) -> int:
        tty = stdin.isatty() and out.isatty()
        if tty:
            where = getattr(self.engine, "base_url", None) or getattr(self.engine, "model_dir", "the model")
            print(f"Chatting with {where}; /help for commands.", file=err)
        while True:
            try:
                line = self._read(stdin, out, tty)
            except KeyboardInterrupt:
                out.write("\n")  # the line being typed is dropped
                continue
            if line is None:
                if tty:
                    out.write("\n")
                return 0
            if not line.strip():
                continue
            if line.startswith("/"):
                self._stop_reading()  # (a reset or another mode: what it reads would not be used)
                if self.command(line.strip(), err) == "bye":
                    return 0
                continue
            self._stop_reading()
            self.send(line, out, err)
            if tty:  # (piped input has its next message already: nothing to read while waiting)
                self._read_ahead()

    @staticmethod
    def _read(stdin: TextIO, out: TextIO, tty: bool) -> str | None:
        """One message, or None at the end of input. On a terminal, through ``input`` with line editing and
        history (the ``readline`` module, where Python has it)."""
        parts: list[str] = []
        if tty:
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401 - input() edits lines and keeps their history once it is loaded
        while True:
            if tty:
                try:
                    line = input(">>> " if not parts else "... ") + "\n"
                except EOFError:
                    line = ""
            else:
                line = stdin.readline()
            if not line:
                return "\n".join(parts) if parts else None
            line = line.rstrip("\r\n")
            if line.endswith("\\"):
                parts.append(line[:-1])
                continue
            parts.append(line)
            return "\n".join(parts)

    def command(self, line: str, err: TextIO) -> str | None:
        """Run a /command; "bye" when the chat ends."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/bye", "/exit", "/quit"):
            return "bye"
        if name == "/help":
            print(HELP, file=err)
        elif name == "/reset":
            self.messages.clear()
            self._left_out = 0
            print("(a new chat)", file=err)
        elif name == "/think" and arg in ("on", "off"):
            self.params = dataclasses.replace(self.params, enable_thinking=arg == "on")
            print(f"(thinking {arg})", file=err)
        elif name == "/mode" and arg in MODES:
            self.params = dataclasses.replace(self.params, mode=arg)
            print(f"(mode {arg})", file=err)
        elif name in ("/think", "/mode"):
            allowed = "on, off" if name == "/think" else "diffusion, ar, spec"
            print(f"clover-desk chat: {name} takes one of {allowed} (got {arg or 'nothing'!r})", file=err)
        else:
            print(f"clover-desk chat: unknown command {name} (/help lists them)", file=err)
        return None

    def _read_ahead(self) -> None:
        """While the next message is typed, the engine reads the chat so far, the answer just given included, into
        its prompt cache (``Engine.read_chat``): sending then reads only the new message. Sending stops it first;
        what it read by then is kept."""
        if self.remote or not self.messages:
            return
        sent = self._with_system(self.messages[self._left_out:])  # as the next send starts
        cancel = threading.Event()

        def read() -> None:
            try:
                for _ in self.engine.read_chat(sent, self.params, cancel=cancel):
                    pass
            except Exception as exc:  # noqa: BLE001 - best effort: the send says what is wrong, if anything
                log.info("reading the chat ahead failed: %s", exc)

        thread = threading.Thread(target=read, name="clover-chat-read", daemon=True)
        thread.start()
        self._reading = (thread, cancel)

    def _with_system(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + messages

    def _context(self) -> int | None:
        """The context the engine holds a request to: its plan's, capped by the model's own (None: remote)."""
        if self.remote:
            return None
        limits = [n for n in (self.engine.config.max_position_embeddings, getattr(self.engine.plan, "ctx_tokens", 0))
                  if n]
        return min(limits) if limits else None

    def _fit(self, turn: list[dict[str, str]], err: TextIO) -> list[dict[str, str]]:
        """What a send with ``turn`` (the chat and the new message) sends: past the context, without its oldest
        turns (the system prompt stays), starting where the last send started while that fits and otherwise moving
        on until a quarter of the room is free, so that successive sends start alike and the prompt cache reads only
        what is new (``ui.context_window.fit_messages``, as in the window). A message that does not fit even alone
        is sent whole: the engine refuses it with its one line."""
        from clover_desk.ui.context_window import answer_reserve, fit_messages, shift_slack

        limit = self._context()
        if limit is None:
            return self._with_system(turn)
        params = self.params

        def count(messages: list[dict[str, str]]) -> int:
            return len(self.engine.prompt_ids(messages=messages, enable_thinking=params.enable_thinking))

        reserve = answer_reserve(limit, params.max_new_tokens or self.engine.generation_defaults.max_new_tokens)
        fitted = fit_messages(self._with_system(turn), count, limit, reserve, keep=self._left_out,
                              slack=shift_slack(limit, reserve))
        if fitted is None:
            return self._with_system(turn)
        sent, left_out = fitted
        if left_out != self._left_out:
            print(f"(the context holds {limit:,} tokens: the oldest {left_out} messages are left out from here on)",
                  file=err)
            self._left_out = left_out
        return sent

    def _stop_reading(self) -> None:
        if self._reading is not None:
            thread, cancel = self._reading
            cancel.set()
            thread.join()
            self._reading = None

    def send(self, text: str, out: TextIO, err: TextIO) -> None:
        """Ask with ``text`` as the next user message and stream the answer; the answer joins the chat (what it
        wrote of it when stopped), a request the engine refuses leaves the chat as it was."""
        from clover_desk.engine.decode.events import Finished, TextDelta
        from clover_desk.engine.errors import CloverError
        from clover_desk.worker.remote import RemoteFinished

        turn = [*self.messages, {"role": "user", "content": text}]
        cancel = threading.Event()
        printer = cmd_generate._Printer(out)
        answer: list[str] = []
        events = None
        limited = stopped = False
        try:
            sent = self._fit(turn, err)  # (counting renders the chat: a template that fails says so here)
            if self.remote:
                events = self.engine.chat(sent, self.params, cancel=cancel)
            else:
                events = self.engine.generate(messages=sent, params=self.params, cancel=cancel)
            for event in events:
                if isinstance(event, TextDelta):
                    printer.delta(event.text, event.channel)
                    if event.channel == "answer":
                        answer.append(event.text)
                elif isinstance(event, (Finished, RemoteFinished)):
                    printer.end()
                    local = isinstance(event, Finished)
                    print(cmd_generate.summary_line(event) if local else cmd_generate.remote_summary(event),
                          file=err)
                    answer = [event.text]
                    limited = getattr(event, "stop_reason", None) in ("max_new_tokens", "context") or getattr(
                        event, "finish_reason", None) == "length"
        except CloverError as exc:
            print(f"clover-desk chat: {exc}", file=err)
            return
        except KeyboardInterrupt:
            cancel.set()
            if events is not None:
                events.close()  # the engine's turn ends here (its lock and cache go back)
            printer.end()
            print("(stopped)", file=err)
            stopped = True
        written = "".join(answer).strip()
        if written:
            self.messages = [*turn, {"role": "assistant", "content": written}]
        else:  # an answer stopped before it wrote any, or all thinking: the question is to be asked again
            why = ("it was still thinking at the token limit (raise --max-new-tokens, or /think off)" if limited
                   else "it was stopped before it wrote one" if stopped else "it wrote none")
            print(f"(no answer: {why}; this question is left out of the chat)", file=err)
