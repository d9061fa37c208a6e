"""Structured output: which tokens may come next, by a grammar (llguidance's token masks).

A request's constraint is a JSON text (``GenerationParams.structured``, made by :func:`structured_spec`):

    {"json_schema": SCHEMA, "before": TEXT, "after": TEXT}

The answer is ``before``, then one JSON value that ``SCHEMA`` accepts, then ``after``, then an end-of-text token.
(The HTTP server's ``response_format`` has empty ``before`` / ``after``; a forced tool call wraps the call object in
``<tool_call>\\n`` ... ``\\n</tool_call>``.) When the prompt leaves a thinking section open (it ends inside
``<think>``), the grammar first lets the model think freely up to its ``</think>`` token and some whitespace: the
constraint is on the answer, not on the reasoning. JSON is written in one fixed layout (``", "`` between items,
``": "`` after keys, no other whitespace) so that a model cannot spend its budget on blanks.

The loops (:mod:`engine.decode.generate`) use one :class:`Constraint` per request: :meth:`Constraint.mask` on the
logits of the next position, :meth:`Constraint.accepts` to check a run of tokens without taking them,
:meth:`Constraint.advance` for the tokens output, :attr:`Constraint.finished` once only an end-of-text may follow.

llguidance builds its token tables from the tokenizer's own ``tokenizer.json`` (every vocabulary our
``tokenizers``-based :class:`~engine.decode.tokenizer.CloverTokenizer` reads, the tiny test ones included); they are
built once per tokenizer and vocabulary size and kept.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import llguidance
import numpy as np
import torch
from torch import Tensor

from clover_desk.engine.errors import PromptError

log = logging.getLogger(__name__)

SPEC_KEYS = ("json_schema", "before", "after")
# JSON in one layout: the separators json.dumps writes, no free whitespace (llguidance's JSON compile options)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_THINK_TEXT = r"/[^\x00]*/"  # free text (no special token: those are not text to llguidance)
_WHITESPACE = r"/[ \t\n]+/"


class GrammarTokenizer(Protocol):
    """What a grammar needs of a tokenizer: its ``tokenizer.json`` text and its added tokens (text -> id)."""

    def backend_json(self) -> str: ...

    def added_tokens(self) -> dict[str, int]: ...


def structured_spec(json_schema: Mapping[str, Any], before: str = "", after: str = "") -> str:
    """The ``GenerationParams.structured`` text for: ``before``, one JSON value ``json_schema`` accepts, ``after``."""
    return json.dumps({"json_schema": json_schema, "before": before, "after": after}, ensure_ascii=False)


def _parse_spec(text: str) -> tuple[dict[str, Any], str, str]:
    try:
        spec = json.loads(text)
    except (TypeError, json.JSONDecodeError) as exc:
        raise PromptError(f"structured output: not a JSON object ({exc})") from None
    if not isinstance(spec, dict) or any(key not in SPEC_KEYS for key in spec):
        raise PromptError(f"structured output must be an object with the keys {', '.join(SPEC_KEYS)}")
    schema = spec.get("json_schema")
    if not isinstance(schema, dict):
        raise PromptError("structured output: json_schema must be a JSON schema object")
    before, after = spec.get("before", ""), spec.get("after", "")
    if not isinstance(before, str) or not isinstance(after, str):
        raise PromptError("structured output: before and after must be strings")
    return schema, before, after


def _laid_out(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with the fixed JSON layout as its llguidance options (a copy; a boolean schema stays one)."""
    out = copy.deepcopy(schema)
    out["x-guidance"] = dict(JSON_LAYOUT)
    return out


def schema_problem(schema: Any) -> str | None:
    """Why llguidance cannot enforce this JSON schema (an unimplemented keyword, a bad pattern, a ``$ref`` that is
    not in the schema, an unsatisfiable one ...), or None when it can. Needs no tokenizer."""
    if not isinstance(schema, dict):
        return "a JSON schema must be an object"
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_laid_out(schema))
    except ValueError as exc:
        return str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    return "; ".join(messages) if is_error else None


def _literal(text: str, added: Mapping[str, int]) -> list[str]:
    """Lark items for ``text``: the tokenizer's added tokens in it as tokens (``<[id]>``: llguidance takes every
    added token as special, never as text), the rest as quoted strings."""
    items: list[str] = []
    rest = text
    names = sorted((n for n in added if n), key=len, reverse=True)
    while rest:
        found = [(rest.find(n), n) for n in names if n in rest]
        if not found:
            items.append(json.dumps(rest, ensure_ascii=True))
            break
        at, name = min(found, key=lambda f: (f[0], -len(f[1])))
        if at:
            items.append(json.dumps(rest[:at], ensure_ascii=True))
        items.append(f"<[{added[name]}]>")
        rest = rest[at + len(name):]
    return items


def lark_grammar(spec: str, added: Mapping[str, int], think_end_id: int | None) -> str:
    """The Lark grammar (llguidance's dialect) of a ``structured`` spec; ``think_end_id``: the prompt leaves a
    thinking section open, closed by that token."""
    schema, before, after = _parse_spec(spec)
    start = []
    if think_end_id is not None:
        start += ["think", f"<[{think_end_id}]>", "ws?"]
    start += _literal(before, added) + ["body"] + _literal(after, added)
    lines = [f"start: {' '.join(start)}", f"body: %json {json.dumps(_laid_out(schema), ensure_ascii=True)}"]
    if think_end_id is not None:
        lines += [f"think: {_THINK_TEXT}", f"ws: {_WHITESPACE}"]
    return "\n".join(lines) + "\n"


class Constraint:
    """One request's grammar state over the token ids it outputs (see the module docstring).

    Masks are [V] bool tensors (True: allowed), computed on the host once per state and copied to the logits'
    device when asked for there."""

    def __init__(self, matcher: Any, vocab: int, eos_ids: Sequence[int]) -> None:
        self._m = matcher
        self.vocab = vocab
        self.eos = frozenset(int(i) for i in eos_ids)
        self._allowed: dict[torch.device, Tensor] = {}
        self.output = 0  # tokens taken so far

    # ---- state ----
    @property
    def finished(self) -> bool:
        """Only an end-of-text token may follow (the grammar is complete and can take nothing more)."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        """The output so far is a whole answer (an end-of-text token may follow)."""
        return bool(self._m.is_accepting())

    def _host_mask(self) -> Tensor:
        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: self.vocab].astype(np.bool_))
        if self._m.is_error() or not bool(allowed.any()):  # nothing can follow: let the answer end there
            log.warning("structured output: the grammar allows no token (%s); ending the answer",
                        self._m.get_error() or "no token fits")
            allowed = torch.zeros(self.vocab, dtype=torch.bool)
            allowed[[i for i in self.eos if i < self.vocab]] = True
        return allowed

    def allowed(self, device: torch.device | str = "cpu") -> Tensor:
        """[V] bool: the tokens the grammar takes next."""
        device = torch.device(device)
        if device not in self._allowed:
            host = self._allowed.get(torch.device("cpu"))
            if host is None:
                host = self._allowed[torch.device("cpu")] = self._host_mask()
            self._allowed[device] = host.to(device)
        return self._allowed[device]

    def mask(self, logits: Tensor) -> Tensor:
        """``logits`` [..., V] with the tokens the grammar refuses next at -inf (a new tensor)."""
        return logits.masked_fill(~self.allowed(logits.device), float("-inf"))

    # ---- tokens ----
    def accepts(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, in order from here, the grammar takes (an end-of-text token counts when the
        tokens before it make a whole answer). Takes none of them."""
        tokens = [int(t) for t in tokens]
        n = int(self._m.validate_tokens(tokens)) if tokens else 0
        if n < len(tokens) and tokens[n] in self.eos:
            if n == 0:
                return 1 if self.accepting else 0
            self._m.consume_tokens(tokens[:n])
            whole = self.accepting
            self._m.rollback(n)
            return n + 1 if whole else n
        return n

    def advance(self, tokens: Sequence[int]) -> None:
        """Take ``tokens`` (ones :meth:`accepts` or the mask allowed). An end-of-text token ends the output: it and
        anything after it are not given to the grammar (which took it already by being complete)."""
        tokens = [int(t) for t in tokens]
        ends = next((i for i, t in enumerate(tokens) if t in self.eos), None)
        self.output += len(tokens)
        tokens = tokens if ends is None else tokens[:ends]
        if not tokens:
            return
        if not self._m.consume_tokens(tokens):
            raise RuntimeError(f"structured output: the grammar refused tokens {tokens} ({self._m.get_error()})")
        self._allowed.clear()

    def masks_along(self, tokens: Sequence[int], device: torch.device | str = "cpu") -> list[Tensor]:
        """The masks at each position of a run: before ``tokens[0]``, after ``tokens[:1]``, ... up to and including
        the first token the grammar refuses (after it nothing is masked: those positions cannot be reached). The
        state is left as it was."""
        tokens = [int(t) for t in tokens]
        n = self.accepts(tokens)
        masks = [self.allowed(device)]
        taken = 0
        for tok in tokens[:n]:
            if tok in self.eos:
                break
            self._m.consume_token(tok)
            self._allowed.clear()
            taken += 1
            masks.append(self.allowed(device))
        if taken:
            self._m.rollback(taken)
            self._allowed.clear()
        return masks


class GrammarCompiler:
    """llguidance's token tables per tokenizer and vocabulary size (built once: ~1 s for a 250k vocabulary)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tables: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], Any]] = \
            weakref.WeakKeyDictionary()

    def table(self, tokenizer: GrammarTokenizer, vocab: int, eos_ids: Sequence[int]) -> Any:
        key = (vocab, tuple(int(i) for i in eos_ids))
        with self._lock:
            tables = self._tables.setdefault(tokenizer, {})
            if key not in tables:
                tables[key] = llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=vocab,
                                                     eos_token=list(key[1]) or None)
            return tables[key]

    def constraint(self, spec: str, tokenizer: Any, vocab: int, eos_ids: Sequence[int],
                   think_end_id: int | None = None) -> Constraint:
        """The constraint of a ``structured`` spec for a request; PromptError when it cannot be enforced.
        ``think_end_id``: the prompt leaves a thinking section open (the answer comes after this token)."""
        if tokenizer is None or not callable(getattr(tokenizer, "backend_json", None)):
            raise PromptError("structured output needs the model's tokenizer (tokenizer.json)")
        if not eos_ids:
            raise PromptError("structured output needs an end-of-text token: the model has none")
        schema, _, _ = _parse_spec(spec)
        problem = schema_problem(schema)
        if problem is not None:
            raise PromptError(f"structured output: the JSON schema cannot be enforced: {problem}")
        lark = lark_grammar(spec, tokenizer.added_tokens(), think_end_id)
        table = self.table(tokenizer, vocab, eos_ids)
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, table)
        if is_error:
            raise PromptError(f"structured output: {'; '.join(messages)}")
        matcher = llguidance.LLMatcher(table, grammar, log_level=0)
        if matcher.is_error():
            raise PromptError(f"structured output: {matcher.get_error()}")
        return Constraint(matcher, vocab, eos_ids)


COMPILER = GrammarCompiler()
