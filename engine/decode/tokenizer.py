"""Tokenizer, chat template and streaming detokenizer (no torch).

* :class:`CloverTokenizer` wraps a ``tokenizers.Tokenizer`` read from ``tokenizer.json`` and finds the special
  tokens the decoder needs (EOS, ``<think>``, ``</think>``, the mask) by name.
* The chat template comes from ``chat_template.jinja`` or ``tokenizer_config.json``'s ``"chat_template"`` (UTF-8)
  and is rendered in a sandboxed Jinja2 environment with limits on time and size (:mod:`engine.decode.chat_template`).
* :class:`StreamDecoder` turns committed ids into text deltas that never end in half a UTF-8 character.
* :func:`train_tiny_tokenizer` trains a small byte-level BPE on the corpus shipped in ``engine/data``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from clover_desk.engine.decode.chat_template import LimitedSandbox, TemplateLimit
from clover_desk.engine.decode.limits import TEMPLATE_MAX_SOURCE_CHARS, check_text, decode_utf8
from clover_desk.engine.errors import ConfigError, PromptError
from clover_desk.engine.model.config import read_json

log = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
MASK = "<|mask|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"

# Names a mask token goes by in the checkpoints we know of; the first one present wins.
MASK_NAMES = (MASK, "<|MASK|>", "<mask>", "<|mask_token|>", "<|mdm_mask|>")
EOS_NAMES = (IM_END, ENDOFTEXT)

# Special (skipped when decoding text) and plain added tokens of the tiny tokenizer.
TINY_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, THINK_START, THINK_END, MASK)
TINY_ADDED_TOKENS = (TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END)
CORPUS_FILES = ("corpus_english.txt", "corpus_code.py.txt", "corpus_html.txt")
REPLACEMENT = "\ufffd"


def shipped_file(name: str) -> str:
    """Text of a file shipped in ``engine/data``."""
    return resources.files("clover_desk.engine").joinpath("data", name).read_text(encoding="utf-8")


class CloverTokenizer:
    """``tokenizers.Tokenizer`` plus the chat template and the special ids decoding needs."""

    def __init__(
        self, tokenizer: Any, chat_template: str | None, source: str = "tokenizer.json", template_source: str = ""
    ) -> None:
        self._tok = tokenizer
        self.source = source
        self.chat_template = chat_template
        self.template_source = template_source or source  # the file the chat template came from
        self._template: Any = None
        eos = (self.token_to_id(name) for name in EOS_NAMES)
        self.eos_token_ids: tuple[int, ...] = tuple(i for i in eos if i is not None)
        self.think_start_id = self.token_to_id(THINK_START)
        self.think_end_id = self.token_to_id(THINK_END)
        self.turn_start_id = self.token_to_id(IM_START)  # where a chat turn starts: the generation prompt's first
        self.mask_token_id = next((i for i in (self.token_to_id(n) for n in MASK_NAMES) if i is not None), None)

    # ---- construction ----
    @classmethod
    def from_file(
        cls, tokenizer_json: str | Path, chat_template: str | None = None, template_source: str = ""
    ) -> "CloverTokenizer":
        from tokenizers import Tokenizer

        path = Path(tokenizer_json)
        if not path.is_file():
            raise ConfigError(f"{path}: file not found (the model folder needs a tokenizer.json)")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for malformed files
            raise ConfigError(f"{path}: not a valid tokenizer.json ({exc})") from None
        return cls(tok, chat_template, source=str(path), template_source=template_source)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "CloverTokenizer":
        """Read ``tokenizer.json`` and the chat template (``chat_template.jinja`` first, else tokenizer_config)."""
        folder = Path(model_dir)
        template: str | None = None
        where = folder / "chat_template.jinja"
        if where.is_file():
            template = decode_utf8(_read_bytes(where), str(where), ConfigError)
        else:
            where = folder / "tokenizer_config.json"
            if where.is_file():
                template = _template_from_config(where)
        if template is not None:
            check_text(template, str(where), ConfigError)  # a JSON "\ud800" escape
            if len(template) > TEMPLATE_MAX_SOURCE_CHARS:
                raise ConfigError(
                    f"{where}: the chat template has {len(template):,} characters, more than the "
                    f"{TEMPLATE_MAX_SOURCE_CHARS:,} a chat template may have"
                )
        return cls.from_file(folder / "tokenizer.json", template, str(where))

    # ---- vocabulary ----
    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def backend_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what llguidance builds its token tables from:
        :mod:`engine.decode.grammar`)."""
        return str(self._tok.to_str())

    def added_tokens(self) -> dict[str, int]:
        """The added tokens (special or not) by their text: ``{"<|im_end|>": id, "<tool_call>": id, ...}``."""
        return {str(t.content): int(i) for i, t in self._tok.get_added_tokens_decoder().items()}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for: a byte-level piece may hold part of a UTF-8 character (its text alone
        then decodes to U+FFFD), so OpenAI's ``logprobs`` give the bytes too. An added token's are its text's."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        table = _byte_of_char()
        if token_id in self._tok.get_added_tokens_decoder() or not all(ch in table for ch in piece):
            return piece.encode("utf-8")
        return bytes(table[ch] for ch in piece)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as written (special tokens in the text are recognised, nothing is added); text that
        cannot be UTF-8 (a lone surrogate) is a PromptError."""
        check_text(text, "prompt")
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def stream(self, skip_special_tokens: bool = True) -> "StreamDecoder":
        return StreamDecoder(self.decode, skip_special_tokens=skip_special_tokens)

    # ---- chat ----
    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
    ) -> str:
        """Render the chat template. Raises :class:`PromptError` for bad messages, ConfigError without a template."""
        if not self.chat_template:
            raise ConfigError(f"{self.source}: the model has no chat template (use a raw prompt instead)")
        if not messages:
            raise PromptError("empty prompt: no messages given")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise PromptError(f"message {i} must be an object with a 'role' (got {m!r:.80})")
        input_chars = _input_chars(messages, tools)
        if self._template is None:
            self._template = _compile_template(self.chat_template, self.template_source)

        context = {
            "messages": list(messages),
            "tools": list(tools) if tools else None,
            "add_generation_prompt": add_generation_prompt,
            "enable_thinking": enable_thinking,
            "bos_token": "",
            "eos_token": IM_END,
        }
        try:
            return self._template.environment.render(self._template, context, self.template_source, input_chars)
        except TemplateLimit as exc:
            raise PromptError(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - the template is code from the model folder: any failure is one line
            detail = str(exc) if type(exc).__module__.startswith("jinja2") else f"{type(exc).__name__}: {exc}"
            raise PromptError(f"chat template failed: {detail}") from None

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
    ) -> list[int]:
        return self.encode(self.apply_chat_template(messages, tools, add_generation_prompt, enable_thinking))

    def continuation_prompt(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        enable_thinking: bool = True,
    ) -> str:
        """The prompt that continues the last message (:meth:`continuation_parts`, joined)."""
        return "".join(self.continuation_parts(messages, tools, enable_thinking))

    def continuation_parts(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        enable_thinking: bool = True,
    ) -> tuple[str, str]:
        """The prompt that has the model go on with the conversation's last message, an assistant answer cut short
        (by the token limit, or stopped), in two parts: the messages before it rendered with the generation prompt,
        then that answer as the model wrote it, its thinking included, and no end of turn.

        Rendering the whole conversation and cutting it after the last message's text (transformers'
        ``continue_final_message``) does not work for a reasoning model: templates drop or trim the thinking of
        answers and close the thinking section, so an answer cut off while thinking could not go on thinking. The
        answer's text is rebuilt from its two channels instead: ``<think>`` (unless the generation prompt opened
        it), the thinking, and ``</think>`` only when an answer followed, which is how the model wrote them
        (``engine.decode.generate.ChannelText`` drops only the two markers)."""
        if not messages:
            raise PromptError("empty prompt: no messages given")
        last = messages[-1]
        role = last.get("role") if isinstance(last, dict) else None
        if role != "assistant":
            raise PromptError(
                f"continue_final_message: the last message must be the assistant answer to continue, not {role!r}")
        if last.get("tool_calls"):
            raise PromptError("continue_final_message: the last message ended its turn with tool calls; nothing to "
                              "continue")
        answer = _message_text(last.get("content"), "content")
        thinking = _message_text(last.get("reasoning_content"), "reasoning_content")
        if not answer and not thinking:
            raise PromptError("continue_final_message: the last message is empty; nothing to continue")
        if len(messages) < 2:
            raise PromptError("continue_final_message: the answer to continue needs the messages it answers")
        head = self.apply_chat_template(messages[:-1], tools, True, enable_thinking)
        start = self.id_to_token(self.think_start_id) if self.think_start_id is not None else None
        end = self.id_to_token(self.think_end_id) if self.think_end_id is not None else None
        return head, continuation_text(head, thinking, answer, start, end)


def _message_text(content: Any, field: str) -> str:
    """A message field's text: a string, None, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise PromptError(f"continue_final_message: the last message's {field} must be text (got {content!r:.80})")


def continuation_text(head: str, thinking: str, answer: str, start: str | None, end: str | None) -> str:
    """What the model wrote after the prompt ``head`` when its thinking channel says ``thinking`` and its answer
    channel ``answer``: the thinking between ``start`` and ``end`` markers (``start`` left out when ``head`` ends
    with the thinking open, ``end`` left out while no answer followed), then the answer. Without markers (a
    tokenizer with no ``<think>``) the two are joined."""
    if start is None or end is None:
        return thinking + answer
    open_at_head = head.rfind(start) > head.rfind(end)
    text = ""
    if thinking:
        text += ("" if open_at_head else start) + thinking
        if answer:
            text += end
    elif answer and open_at_head:
        text += end  # the model closed its thinking at once
    return text + answer


_BYTE_OF_CHAR: dict[str, int] = {}


def _byte_of_char() -> dict[str, int]:
    """The byte-level BPE alphabet read backwards: a vocabulary piece's character -> the byte it stands for. Bytes
    that print as themselves (``!`` to ``~``, ``\u00a1`` to ``\u00ac``, ``\u00ae`` to ``\u00ff``) keep their code point;
    the others (controls, space, ...) are written as U+0100 on, in byte order."""
    if not _BYTE_OF_CHAR:
        kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
        moved = [b for b in range(256) if b not in kept]
        _BYTE_OF_CHAR.update({chr(b): b for b in kept})
        _BYTE_OF_CHAR.update({chr(0x100 + n): b for n, b in enumerate(moved)})
    return _BYTE_OF_CHAR


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _input_chars(messages: Sequence[Any], tools: Sequence[Any] | None) -> int:
    """The characters of every string in the messages and tools (what a chat template's size budget grows with);
    a string that cannot be UTF-8 (a lone surrogate from JSON or argv) is a PromptError naming where it is."""
    total = 0
    stack: list[tuple[Any, tuple[Any, ...]]] = [(list(messages), ("messages",)), (list(tools or []), ("tools",))]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            total += len(value)
            if not value.isascii():
                check_text(value, path[0] + "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in path[1:]))
        elif isinstance(value, dict):
            for key, item in value.items():
                total += len(key) if isinstance(key, str) else 1
                stack.append((item, (*path, key)))
        elif isinstance(value, (list, tuple)):
            stack.extend((item, (*path, i)) for i, item in enumerate(value))
        else:
            total += 1
    return total


def _template_from_config(path: Path) -> str | None:
    data = read_json(path)
    template = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is not None and not isinstance(template, str):
        raise ConfigError(f"{path}: field 'chat_template' must be a string, got {type(template).__name__}")
    return template


def _compile_template(source_text: str, source: str) -> Any:
    """The template compiled in a :class:`engine.decode.chat_template.LimitedSandbox` (its ``environment`` renders it)."""
    from jinja2 import TemplateError


    try:
        return LimitedSandbox().from_string(source_text)
    except TemplateError as exc:
        raise ConfigError(f"{source}: chat template does not compile ({exc})") from None
    except (RecursionError, MemoryError, ValueError) as exc:  # the parser, on a pathological source
        raise ConfigError(f"{source}: chat template does not compile ({type(exc).__name__}: {exc})") from None


class StreamDecoder:
    """Incremental detokenizer: ``push(ids)`` returns only the text that is complete so far.

    Byte-level BPE can split one UTF-8 character over several tokens; decoding such a prefix ends in U+FFFD. The
    decoder keeps a small window of ids, and releases text only when its decoding no longer ends in U+FFFD (the
    held-back bytes come out with the token that completes them, or with :meth:`flush`).
    """

    def __init__(self, decode: Any, skip_special_tokens: bool = True) -> None:
        self._decode = decode
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the window that is re-decoded for context
        self._read = 0  # ids up to here have been released as text
        self.text = ""

    def push(self, ids: Iterable[int]) -> str:
        self._ids.extend(int(i) for i in ids)
        if len(self._ids) == self._read:
            return ""
        window = self._ids[self._prefix :]
        done = self._decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        full = self._decode(window, skip_special_tokens=self._skip)
        if full.endswith(REPLACEMENT) or not full.startswith(done):
            return ""  # an unfinished character: wait for the next token
        delta = full[len(done) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Release whatever is held back (a stream that really ends in an invalid byte shows U+FFFD)."""
        if len(self._ids) == self._read:
            return ""
        done = self._decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        full = self._decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        delta = full[len(done) :] if full.startswith(done) else full
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta


def train_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 1024) -> CloverTokenizer:
    """Train a byte-level BPE on the shipped corpus; write tokenizer.json, tokenizer_config.json, chat_template.jinja.

    Special tokens come first (ids 0..5: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ``<think>``,
    ``</think>``, ``<|mask|>``), then the tool-call tokens, then the 256 byte symbols and the merges.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 300:
        raise ConfigError(f"vocab_size {vocab_size} is too small for a byte-level BPE (need at least 300)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS]
        + [AddedToken(t, special=False, normalized=False) for t in TINY_ADDED_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [shipped_file(name) for name in CORPUS_FILES]
    tok.train_from_iterator(corpus, trainer=trainer)
    # The trainer registers all listed tokens as special; re-add the tool tokens as plain so they decode as text.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TINY_ADDED_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    template = shipped_file("chat_template.jinja")
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "mask_token": MASK,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
    log.debug("trained a %d-token byte-level BPE into %s", tok.get_vocab_size(), out)
    return CloverTokenizer(tok, template, source=str(out / "tokenizer.json"))
