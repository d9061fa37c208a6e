"""The two decoding loops, as generators of :mod:`engine.decode.events`.

* :func:`generate_ar`: prefill the prompt causally, then one token per forward through the cache.
* :func:`generate_diffusion`: block diffusion with blocks aligned to absolute position 0.
  The whole prompt blocks are prefilled in one block-mode pass that writes the cache; the first generated block
  holds the prompt tail followed by masks; denoising passes read the cache (``write_cache=False``) and commit by
  the threshold rule until the block has no mask; then one commit pass writes the block into the cache.

Policy (penalties, biases, the commit rule, sampling) comes from :mod:`engine.decode.decoding`; the model is anything
with ``new_cache(max_len)`` and ``forward(ids, start_pos, cache, block_size, write_cache, last_only)``.

A prompt longer than the model's longest pass (``segment_tokens``) is prefilled segment by segment: the loops yield
:class:`~engine.decode.events.PrefillProgress` between segments and check the cancel flag there, so a long pasted document
shows progress and can be stopped before the first block.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from clover_desk.engine.decode import decoding, grammar
from clover_desk.engine.decode.events import (
    MODES,
    BlockCommitted,
    BlockStep,
    Event,
    Finished,
    GenerationParams,
    PrefillProgress,
    PromptInfo,
    TextDelta,
    TokenLogprobs,
)
from clover_desk.engine.decode.prompt_cache import PromptCache, ScopedPromptCache
from clover_desk.engine.decode.tokenizer import StreamDecoder
from clover_desk.engine.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_THRESHOLD
from clover_desk.engine.errors import PromptError
from clover_desk.engine.kernels import fastpath
from clover_desk.engine.model.clover import GDN_CHUNK
from clover_desk.engine.model.config import CloverConfig, GenerationDefaults
from clover_desk.engine.placement import offload_runtime

log = logging.getLogger(__name__)


class DecodingModel(Protocol):
    def new_cache(self, max_len: int) -> Any: ...

    def forward(
        self, ids: Tensor, start_pos: int, cache: Any, block_size: int | None = None, write_cache: bool = True,
        last_only: bool = False,
    ) -> Tensor: ...


class TextDecoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class LoopHooks:
    """Optional calls into a placement runtime (expert offload): around each diffusion block, and the statistics
    that go into ``Finished.accounting``."""

    begin_block: Callable[[], None] | None = None
    end_block: Callable[[], None] | None = None
    accounting: Callable[[], dict[str, Any]] | None = None


def loop_hooks(model: torch.nn.Module) -> LoopHooks:
    """This model's placement hooks (:mod:`engine.placement.offload`): block boundaries and the streaming statistics
    (no-ops and {} for a model no plan was applied to)."""
    return LoopHooks(
        begin_block=lambda: offload_runtime.begin_block(model),
        end_block=lambda: offload_runtime.end_block(model),
        accounting=lambda: offload_runtime.accounting(model),
    )


@dataclass(frozen=True)
class DecodeSettings:
    """Everything one request decodes with: the caller's params merged over the model's defaults."""

    mode: str = "diffusion"
    max_new_tokens: int = 24_576
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    block_size: int = DEFAULT_BLOCK_SIZE
    threshold: float = DEFAULT_THRESHOLD
    mask_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    think_start_id: int | None = None
    think_end_id: int | None = None
    # a chat turn's first token (<|im_start|>): the prompt cache keeps nothing from the prompt's last one on, the
    # generation prompt, which a chat's next turn renders otherwise (the answer in place of "<think>\n")
    turn_start_id: int | None = None
    length_penalty: float = 0.0
    length_penalty_start: int = 8192
    length_penalty_window: int = 8192
    think_end_bias: float = 0.0
    think_end_bias_start: int = 4096
    think_end_bias_window: int = 4096
    shift_logits: bool = False
    max_positions: int = 131_072
    # read the prompt (into the prompt cache) and stop: Finished with stop_reason "prefilled" (Engine.read_chat)
    prefill_only: bool = False
    # the answer's grammar (GenerationParams.structured, engine.decode.grammar); None: free text
    structured: str | None = None
    # None: no log probabilities (nothing computed); N: a TokenLogprobs event per commit, with N alternatives a token
    logprobs: int | None = None


def resolve_settings(
    params: GenerationParams, defaults: GenerationDefaults, config: CloverConfig, tokenizer: Any | None = None
) -> DecodeSettings:
    """Merge request params over generation_config.json defaults and the model config; check the values."""

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    if params.mode not in MODES:
        raise PromptError(f"mode {params.mode!r} is not one of {', '.join(repr(m) for m in MODES)}")
    temperature = float(pick(params.temperature, defaults.temperature))
    if params.do_sample is not None:
        do_sample = bool(params.do_sample)
    elif params.temperature is not None:
        do_sample = params.temperature > 0
    else:
        do_sample = defaults.do_sample
    if params.mode == "spec":
        if params.do_sample or (params.do_sample is None and params.temperature):
            raise PromptError(
                "mode 'spec' decodes greedily (its tokens are AR greedy's): ask for temperature 0 (or do_sample "
                "false), or sample with mode 'ar' or 'diffusion'")
        do_sample = False  # whatever the model's defaults say: spec is greedy
    max_new = int(pick(params.max_new_tokens, defaults.max_new_tokens))
    block = int(pick(params.block_size, config.block_size))
    threshold = float(pick(params.threshold, config.threshold))
    top_p = float(pick(params.top_p, defaults.top_p))
    top_k = int(pick(params.top_k, defaults.top_k))
    for name, ok, value in (
        ("max_new_tokens", max_new >= 1, max_new),
        ("block_size", block >= 1, block),
        ("threshold", 0.0 <= threshold <= 1.0, threshold),
        ("temperature", temperature >= 0.0, temperature),
        ("top_p", 0.0 < top_p <= 1.0, top_p),
        ("top_k", top_k >= 0, top_k),
    ):
        if not ok:
            raise PromptError(f"generation parameter {name} has a bad value {value!r}")

    mask_id = config.mask_token_id
    think_start = think_end = turn_start = None
    if tokenizer is not None:
        mask_id = mask_id if mask_id is not None else tokenizer.mask_token_id
        think_start, think_end = tokenizer.think_start_id, tokenizer.think_end_id
        turn_start = getattr(tokenizer, "turn_start_id", None)
    if think_end is None and config.think_end_token_id is not None and config.think_end_token_id < config.vocab_size:
        think_end = config.think_end_token_id
    return DecodeSettings(
        mode=params.mode,
        max_new_tokens=max_new,
        do_sample=do_sample,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=params.seed,
        presence_penalty=float(pick(params.presence_penalty, defaults.presence_penalty)),
        repetition_penalty=float(pick(params.repetition_penalty, defaults.repetition_penalty)),
        block_size=block,
        threshold=threshold,
        mask_token_id=mask_id,
        eos_token_ids=tuple(defaults.eos_token_ids or config.eos_token_ids),
        think_start_id=think_start,
        think_end_id=think_end,
        turn_start_id=turn_start,
        length_penalty=defaults.dllm_length_penalty,
        length_penalty_start=defaults.dllm_length_penalty_start,
        length_penalty_window=defaults.dllm_length_penalty_window,
        think_end_bias=defaults.dllm_think_end_bias,
        think_end_bias_start=defaults.dllm_think_end_bias_start,
        think_end_bias_window=defaults.dllm_think_end_bias_window,
        shift_logits=config.shift_logits,
        max_positions=config.max_position_embeddings,
        structured=params.structured,
    )


# ---------------------------------------------------------------------------------------------------------------
# shared helpers


def thinking_open_after(ids: Sequence[int], think_start: int | None, think_end: int | None) -> bool:
    """Whether a ``<think>`` is open at the end of ``ids`` (the last think marker is ``<think>``)."""
    for tok in reversed(ids):
        if tok == think_end:
            return False
        if tok == think_start:
            return True
    return False


class ChannelText:
    """Routes committed ids to the "thinking" or "answer" text stream; markers and EOS are not text."""

    def __init__(self, decode: Callable[..., str] | None, s: DecodeSettings, thinking_open: bool) -> None:
        self._s = s
        self._eos = set(s.eos_token_ids)
        self.thinking_open = thinking_open
        self._streams = {name: StreamDecoder(decode) if decode else None for name in ("thinking", "answer")}

    def _push(self, channel: str, ids: list[int], out: list[TextDelta]) -> None:
        stream = self._streams[channel]
        if stream is None or not ids:
            return
        text = stream.push(ids)
        if text:
            if out and out[-1].channel == channel:
                out[-1] = TextDelta(out[-1].text + text, channel)
            else:
                out.append(TextDelta(text, channel))

    def _flush(self, channel: str, out: list[TextDelta]) -> None:
        stream = self._streams[channel]
        text = stream.flush() if stream is not None else ""
        if text:
            out.append(TextDelta(text, channel))

    def feed(self, ids: Sequence[int]) -> list[TextDelta]:
        out: list[TextDelta] = []
        run: list[int] = []
        for tok in ids:
            channel = "thinking" if self.thinking_open else "answer"
            if tok == self._s.think_start_id or tok == self._s.think_end_id:
                self._push(channel, run, out)
                run = []
                self._flush(channel, out)
                self.thinking_open = tok == self._s.think_start_id
            elif tok not in self._eos:
                run.append(tok)
        self._push("thinking" if self.thinking_open else "answer", run, out)
        return out

    def finish(self) -> list[TextDelta]:
        out: list[TextDelta] = []
        self._flush("thinking", out)
        self._flush("answer", out)
        return out

    def text(self, channel: str) -> str:
        stream = self._streams[channel]
        return stream.text if stream is not None else ""

    def kinds(self, ids: Sequence[int]) -> tuple[str, ...]:
        """Where :meth:`feed` will put each of ``ids`` (call it before): "thinking", "answer", "marker" or "eos"."""
        thinking, out = self.thinking_open, []
        for tok in ids:
            if tok == self._s.think_start_id or tok == self._s.think_end_id:
                out.append("marker")
                thinking = tok == self._s.think_start_id
            else:
                out.append("eos" if tok in self._eos else "thinking" if thinking else "answer")
        return tuple(out)


# ---------------------------------------------------------------------------------------------------------------
# log probabilities (only for a request that asks: DecodeSettings.logprobs)


def _top_of(lp: Tensor, top: int) -> tuple[Tensor, Tensor]:
    """The ``top`` best log probabilities of each row of ``lp`` [T, V] and their ids, best first: ([T, top] x2)."""
    if top <= 0:
        return lp.new_zeros(lp.shape[0], 0), torch.zeros(lp.shape[0], 0, dtype=torch.long, device=lp.device)
    values, ids = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
    return values, ids


def _logprob_event(picked: Tensor, top_lp: Tensor, top_ids: Tensor, ids: Sequence[int],
                   channels: tuple[str, ...]) -> TokenLogprobs:
    """One host read of what :func:`row_logprobs` or :class:`_SlotLogprobs` gathered for ``ids``."""
    host = torch.cat([picked.view(-1, 1).float(), top_lp.float(), top_ids.float()], dim=1).tolist()  # [T, 1 + 2k]
    top = top_lp.shape[1]
    return TokenLogprobs(
        token_ids=tuple(int(t) for t in ids), logprobs=tuple(row[0] for row in host), channels=channels, top=top,
        top_ids=tuple(int(v) for row in host for v in row[1 + top:]),
        top_logprobs=tuple(v for row in host for v in row[1:1 + top]),
    )


def row_logprobs(rows: Tensor, ids: Sequence[int], top: int, channels: tuple[str, ...]) -> TokenLogprobs:
    """The event for tokens ``ids`` [T] each chosen from its row of the raw logits ``rows`` [T, V] (AR, spec)."""
    lp = torch.log_softmax(rows.float(), dim=-1)  # [T, V]
    chosen = torch.tensor(list(ids), dtype=torch.long, device=rows.device).view(-1, 1)
    values, top_ids = _top_of(lp, top)
    return _logprob_event(lp.gather(-1, chosen).squeeze(-1), values, top_ids, ids, channels)


class _SlotLogprobs:
    """A diffusion block's log probabilities, slot by slot, as the passes commit them: kept on the device (no host
    read per pass), read once when the block's tokens go out."""

    def __init__(self, block_size: int, top: int, device: torch.device) -> None:
        self.top = top
        self.picked = torch.zeros(block_size, device=device)  # [B]
        self.top_lp = torch.zeros(block_size, top, device=device)  # [B, top]
        self.top_ids = torch.zeros(block_size, top, dtype=torch.long, device=device)  # [B, top]

    def update(self, logits: Tensor, x: Tensor, commit: Tensor) -> None:
        """A pass's (shifted) raw logits [B, V], the block after it x [B] and its commits [B]."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        self.picked = torch.where(commit, lp.gather(-1, x.view(-1, 1)).squeeze(-1), self.picked)
        values, ids = _top_of(lp, self.top)
        self.top_lp = torch.where(commit[:, None], values, self.top_lp)
        self.top_ids = torch.where(commit[:, None], ids, self.top_ids)

    def event(self, start: int, ids: Sequence[int], channels: tuple[str, ...]) -> TokenLogprobs:
        """The event for the block's output ``ids``, slots ``start`` on."""
        span = slice(start, start + len(ids))
        return _logprob_event(self.picked[span], self.top_lp[span], self.top_ids[span], ids, channels)


def _forward(model: DecodingModel, *args: Any, **kwargs: Any) -> Tensor:
    """One model forward without autograd. (No ``inference_mode`` around the loops: it would stay switched on in
    the caller's code while the generator is suspended at a ``yield``.)"""
    with torch.no_grad():
        return model.forward(*args, **kwargs)


def _prefill(
    model: DecodingModel,
    ids: Tensor,
    cache: Any,
    block_size: int | None,
    cancel: threading.Event | None,
    at: int = 0,
    keep: tuple[Sequence[int], Callable[[int, Tensor], None]] | None = None,
    **kwargs: Any,
) -> Generator[PrefillProgress, None, Tensor | None]:
    """Write the prompt ``ids`` [P] into the empty cache and return the last position's logits [1, V], or None when
    ``cancel`` was set between two segments (use with ``yield from``).

    A prompt longer than the model's longest pass is run here one segment at a time (``segment_tokens``: whole
    blocks, or whole GDN chunks), which is exactly how the model would split it itself; in between, the caller
    hears how far it got (a :class:`PrefillProgress` before the first segment and after each) and a cancel takes
    effect. A shorter prompt, or a model without ``segment_tokens``, is one forward and no progress event.

    ``at``: where ``ids`` start (a cache that holds the first ``at`` positions already: :class:`PromptCache`).
    ``keep``: (points, callback): a forward also ends after the first k ids for each k in ``points`` (ascending,
    boundaries the model splits at too), and the callback gets (k, its logits [1, V]) then, with the cache holding
    them (what the prompt cache keeps). A prefill cancelled before the last one hands the callback what it read so
    far instead (whole segments), so that a request that starts the same way goes on from there."""
    total = ids.shape[0]
    segment_tokens = getattr(model, "segment_tokens", None)
    seg = int(segment_tokens(block_size)) if callable(segment_tokens) else total
    points = [k for k in keep[0] if 0 < k <= total] if keep is not None else []
    cuts = sorted({*range(seg, total, seg), total, *points})
    progress = total > seg
    if progress:
        yield PrefillProgress(done=0, total=total)
    out: Tensor | None = None
    start = kept = 0
    for end in cuts:
        if start and cancel is not None and cancel.is_set():
            if keep is not None and points and kept < start < points[-1] and out is not None:
                keep[1](start, out)  # what was read is kept: the request that stopped this one goes on from it
            return None
        out = _forward(  # [1, V]
            model, ids[start:end], at + start, cache, block_size=block_size, write_cache=True, last_only=True,
            **kwargs,
        )
        if keep is not None and end in points:
            keep[1](end, out)
            kept = end
        if progress and (end % seg == 0 or end == total):
            yield PrefillProgress(done=end, total=total)
        start = end
    return out


def _turn_start(prompt: Sequence[int], s: DecodeSettings) -> int:
    """Where the prompt's last chat turn starts (``s.turn_start_id``), or its length when it has none (a raw
    prompt): what a chat's next turn renders the same."""
    if s.turn_start_id is not None:
        with contextlib.suppress(ValueError):
            return len(prompt) - 1 - list(prompt)[::-1].index(s.turn_start_id)
    return len(prompt)


def _keep_points(prompt: Sequence[int], s: DecodeSettings, cached: int, keep_at: int, unit: int, seg: int,
                 most: int, turns: bool) -> list[int]:
    """Where a prefill that starts at ``cached`` hands the prompt cache a point (absolute positions, ascending):
    ``keep_at`` last, and before it up to ``most`` checkpoints (the last ones): where the prefill's forwards end
    anyway (every ``seg`` tokens), and with ``turns`` the chat's turn starts too, each taken down to whole
    ``unit``s (one more forward each). [] when ``keep_at`` is not past ``cached``."""
    if keep_at <= cached:
        return []
    points = set(range(cached + seg, keep_at, seg))
    if turns and s.turn_start_id is not None:
        points |= {i // unit * unit for i, t in enumerate(prompt[:keep_at]) if t == s.turn_start_id}
    earlier = sorted(p for p in points if cached < p < keep_at) if most > 0 else []
    return [*earlier[max(0, len(earlier) - most):], keep_at]


def _turn_checkpoints(model: Any, s: DecodeSettings) -> bool:
    """Whether a prefill also ends a forward at each chat turn start for a checkpoint there: only a read-ahead
    (``s.prefill_only``: the engine is otherwise idle, nobody waits for it) on a model that streams no experts.
    With streamed experts every forward streams its layers' experts again: at the 35B shape on a 16 GB card
    (17 layers, 7.2 GiB) about 0.3 s a forward, where the plan's forwards end every 864 tokens anyway."""
    return s.prefill_only and not any(getattr(moe.experts, "needs_prepare", False) for moe in model.moe_layers())


def _device_of(model: Any) -> torch.device:
    device = getattr(model, "device", None)
    if device is not None:
        return torch.device(device)
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def _generator(s: DecodeSettings, device: torch.device) -> torch.Generator | None:
    if not s.do_sample:
        return None
    gen = torch.Generator(device=device)
    if s.seed is not None:
        gen.manual_seed(int(s.seed))
    else:
        gen.seed()
    return gen


def _penalize(logits: Tensor, s: DecodeSettings, rep_seen: Tensor, out_seen: Tensor) -> Tensor:
    """The penalties and the forbidden mask id: a new tensor, ``logits`` untouched (a penalty's output is changed
    in place, not copied again)."""
    out = decoding.apply_repetition_penalty(logits, rep_seen, s.repetition_penalty)
    out = decoding.apply_presence_penalty(out, out_seen, s.presence_penalty)
    if s.mask_token_id is not None:  # the mask is never a proposal
        out = decoding.forbid_tokens(out, [s.mask_token_id], inplace=out is not logits)
    return out


def _check_prompt(prompt_ids: Sequence[int], vocab_size: int | None, written: int = 0) -> None:
    if len(prompt_ids) == 0:
        raise PromptError("empty prompt: nothing to generate from")
    if not 0 <= written < len(prompt_ids):
        raise PromptError(f"written must be 0 to {len(prompt_ids) - 1} (the prompt's own part comes first), got "
                          f"{written}")
    if vocab_size is not None:
        bad = [i for i in prompt_ids if not 0 <= int(i) < vocab_size]
        if bad:
            raise PromptError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")


def _constraint_for(s: DecodeSettings, tokenizer: Any, vocab_size: int | None,
                    prompt: Sequence[int]) -> grammar.Constraint | None:
    """The request's grammar (``s.structured``), or None for free text; PromptError when it cannot be enforced.
    A prompt that leaves a thinking section open gets free thinking before the constrained answer."""
    if s.structured is None:
        return None
    vocab = vocab_size if vocab_size is not None else getattr(tokenizer, "vocab_size", None)
    if vocab is None:
        raise PromptError("structured output needs the vocabulary size")
    thinking = thinking_open_after(prompt, s.think_start_id, s.think_end_id)
    return grammar.COMPILER.constraint(s.structured, tokenizer, int(vocab), [i for i in s.eos_token_ids if i < vocab],
                                       s.think_end_id if thinking else None)


def _output_seen(prompt: list[int], written: int, vocab: int, device: torch.device) -> Tensor:
    """[V] the tokens already output: the prompt's last ``written`` (a continued answer's), for the presence
    penalty."""
    return decoding.seen_mask(prompt[len(prompt) - written:], vocab, device)


class _Clock:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.prefill_done: float | None = None
        self.first_token: float | None = None
        self.cached = 0  # the prompt's first tokens read from the prompt cache

    def now(self) -> float:
        return time.perf_counter()

    def mark_first_token(self) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()


def _pieces(tokenizer: TextDecoder | None) -> Callable[[int], str]:
    """Each token's own text for the denoising view, decoded once per token id ("" without a tokenizer)."""
    cache: dict[int, str] = {}

    def piece(tok: int) -> str:
        if tokenizer is None:
            return ""
        if tok not in cache:
            cache[tok] = tokenizer.decode([tok], skip_special_tokens=False)
        return cache[tok]

    return piece


def _finished(
    generated: list[int],
    channels: ChannelText,
    reason: str,
    passes: int,
    prompt_tokens: int,
    clock: _Clock,
    hooks: LoopHooks | None = None,
    spec: dict[str, int] | None = None,
) -> Finished:
    end = clock.now()
    prefill_end = clock.prefill_done if clock.prefill_done is not None else end
    decode_s = max(end - prefill_end, 0.0)
    tokens = len(generated)
    return Finished(
        token_ids=tuple(generated),
        text=channels.text("answer"),
        thinking=channels.text("thinking"),
        stop_reason=reason,
        tokens=tokens,
        passes=passes,
        tokens_per_pass=tokens / passes if passes else 0.0,
        tokens_per_s=tokens / decode_s if decode_s > 0 else 0.0,
        time_to_first_token_s=None if clock.first_token is None else clock.first_token - clock.t0,
        prompt_tokens=prompt_tokens,
        prefill_s=prefill_end - clock.t0,
        decode_s=decode_s,
        accounting=dict(hooks.accounting()) if hooks is not None and hooks.accounting is not None else {},
        cached_tokens=clock.cached,
        forwards_per_token=passes / tokens if tokens else 0.0,
        verify_passes=(spec or {}).get("verify_passes", 0),
        accepted_per_verify=(spec["accepted"] / spec["verify_passes"] if spec and spec["verify_passes"] else 0.0),
        spec=dict(spec or {}),
    )


# ---------------------------------------------------------------------------------------------------------------
# autoregressive


def generate_ar(
    model: DecodingModel,
    prompt_ids: Sequence[int],
    s: DecodeSettings,
    tokenizer: TextDecoder | None = None,
    cancel: threading.Event | None = None,
    vocab_size: int | None = None,
    hooks: LoopHooks | None = None,
    written: int = 0,
    prompt_cache: PromptCache | ScopedPromptCache | None = None,
) -> Iterator[Event]:
    """Causal decoding: one prefill forward, then one cached forward per token."""
    prompt = [int(i) for i in prompt_ids]
    _check_prompt(prompt, vocab_size, written)
    P = len(prompt)
    room = s.max_positions - P
    if room < 1:
        raise PromptError(
            f"prompt is {P} tokens; the context holds {s.max_positions} positions, leaving no room to generate"
        )
    max_new = min(s.max_new_tokens, room)
    limit_reason = "context" if max_new < s.max_new_tokens else "max_new_tokens"
    constraint = _constraint_for(s, tokenizer, vocab_size, prompt)
    return _ar_loop(model, prompt, s, tokenizer, cancel, max_new, limit_reason, hooks, written, prompt_cache,
                    constraint)


def _ar_next(logits: Tensor, s: DecodeSettings, rep_seen: Tensor, out_seen: Tensor,
             constraint: grammar.Constraint | None, gen: torch.Generator | None) -> Tensor:
    """The next AR token [1] from the last row of ``logits`` [*, V]. Greedy without a grammar: the argmax of the
    penalized row, with no softmax nor mask-forbidding copy of the 248k logits (the argmax of the logits
    is the argmax of their softmax; the mask id is forbidden only in the rare step it wins, by the full path).
    Otherwise the full policy (penalties, the forbidden mask, the grammar, :func:`decoding.propose`)."""
    if (not s.do_sample or s.temperature <= 0.0) and constraint is None:
        row = decoding.apply_repetition_penalty(logits[-1:].float(), rep_seen, s.repetition_penalty)
        token = decoding.apply_presence_penalty(row, out_seen, s.presence_penalty).argmax(-1)  # [1]
        if s.mask_token_id is None or int(token[0]) != s.mask_token_id:
            return token
    row = _penalize(logits[-1:].float(), s, rep_seen, out_seen)  # [1, V]
    if constraint is not None:  # structured output: only what the grammar takes next
        row = constraint.mask(row)
    token, _ = decoding.propose(
        row, do_sample=s.do_sample, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, generator=gen
    )
    return token


def _ar_loop(
    model: DecodingModel,
    prompt: list[int],
    s: DecodeSettings,
    tokenizer: TextDecoder | None,
    cancel: threading.Event | None,
    max_new: int,
    limit_reason: str,
    hooks: LoopHooks | None = None,
    written: int = 0,
    prompt_cache: PromptCache | ScopedPromptCache | None = None,
    constraint: grammar.Constraint | None = None,
) -> Iterator[Event]:
    P = len(prompt)
    device = _device_of(model)
    clock = _Clock()
    thinking = thinking_open_after(prompt, s.think_start_id, s.think_end_id)
    channels = ChannelText(tokenizer.decode if tokenizer else None, s, thinking)
    generated: list[int] = []
    eos = set(s.eos_token_ids)
    # A chat's next turn starts with this prompt's tokens up to its last turn (the generation prompt, which the next
    # turn renders otherwise): keep the last whole GDN chunk before that for it (PromptCache)
    prompt_cache = PromptCache.for_model(prompt_cache, model)
    usable = (P - 1) // GDN_CHUNK * GDN_CHUNK  # (at least the last token is read: its logits start the answer)
    keep_at = min(usable, _turn_start(prompt, s) // GDN_CHUNK * GDN_CHUNK) if prompt_cache is not None else 0
    cache, cached, _ = (prompt_cache.take(model, prompt, usable, P + max_new, None) if prompt_cache is not None
                        else (model.new_cache(P + max_new), 0, None))
    clock.cached = cached
    yield PromptInfo(prompt_tokens=P, block_size=1, first_block=P, tail=0, cached_tokens=cached)
    if cancel is not None and cancel.is_set():
        yield _finished(generated, channels, "cancelled", 0, P, clock, hooks)
        return

    ids = torch.tensor(prompt, dtype=torch.long, device=device)  # [P]
    keep = None
    if prompt_cache is not None and cached < keep_at:  # forwards end at the points kept for later turns
        def keep_here(end: int, out: Tensor) -> None:
            prompt_cache.keep(prompt[: cached + end], cache, out[-1], None)

        points = _keep_points(prompt, s, cached, keep_at, GDN_CHUNK, model.segment_tokens(None),
                              prompt_cache.checkpoints, _turn_checkpoints(model, s))
        keep = ([p - cached for p in points], keep_here)
    logits = yield from _prefill(model, ids[cached:], cache, None, cancel, at=cached, keep=keep)  # [1, V]
    if logits is None:  # cancelled between two prefill segments
        yield _finished(generated, channels, "cancelled", 0, P, clock, hooks)
        return
    vocab = logits.shape[-1]
    clock.prefill_done = clock.now()
    if s.prefill_only:
        yield _finished(generated, channels, "prefilled", 0, P, clock, hooks)
        return
    rep_seen = decoding.seen_mask(prompt, vocab, device)  # [V]
    out_seen = _output_seen(prompt, written, vocab, device)  # [V]
    gen = _generator(s, device)
    reason = limit_reason
    while True:
        token = _ar_next(logits, s, rep_seen, out_seen, constraint, gen)  # [1] on the device
        tok = int(token[0])
        if s.logprobs is not None:
            yield row_logprobs(logits[-1:], [tok], s.logprobs, channels.kinds([tok]))
        if constraint is not None:
            constraint.advance([tok])
        generated.append(tok)
        rep_seen[tok] = True
        out_seen[tok] = True
        clock.mark_first_token()
        yield from channels.feed([tok])
        if tok in eos:
            reason = "eos"
            break
        if len(generated) >= max_new:
            break
        if cancel is not None and cancel.is_set():
            reason = "cancelled"
            break
        step = token.view(1)  # [1], already on the device (no host-to-device copy of the id just read)
        # from the third step on, a compiled model skips the guards that cannot fail (engine.kernels.fastpath.steady_state)
        with fastpath.steady_state(model) if len(generated) > 2 else contextlib.nullcontext():
            logits = _forward(model, step, P + len(generated) - 1, cache, block_size=None, write_cache=True,
                              last_only=True)
    yield from channels.finish()
    yield _finished(generated, channels, reason, len(generated), P, clock, hooks)


# ---------------------------------------------------------------------------------------------------------------
# block diffusion


def generate_diffusion(
    model: DecodingModel,
    prompt_ids: Sequence[int],
    s: DecodeSettings,
    tokenizer: TextDecoder | None = None,
    cancel: threading.Event | None = None,
    vocab_size: int | None = None,
    hooks: LoopHooks | None = None,
    written: int = 0,
    prompt_cache: PromptCache | ScopedPromptCache | None = None,
) -> Iterator[Event]:
    """Block diffusion. Checks the request before returning the event iterator."""
    prompt = [int(i) for i in prompt_ids]
    _check_prompt(prompt, vocab_size, written)
    if s.mask_token_id is None:
        raise PromptError(
            "diffusion mode needs a mask token: the model's config.json has no mask_token_id and the tokenizer has "
            "no <|mask|> token (use --mode ar)"
        )
    B = s.block_size
    P = len(prompt)
    first_block_end = (P // B + 1) * B  # the block holding the prompt tail must fit whole
    if first_block_end > s.max_positions:
        raise PromptError(
            f"prompt is {P} tokens; with room to finish its last {B}-token block it needs {first_block_end} "
            f"positions, but the context holds {s.max_positions}"
        )
    room = (s.max_positions // B) * B - P  # generated slots that fit in whole blocks
    max_new = min(s.max_new_tokens, room)
    limit_reason = "context" if max_new < s.max_new_tokens else "max_new_tokens"
    constraint = _constraint_for(s, tokenizer, vocab_size, prompt)
    return _diffusion_loop(model, prompt, s, tokenizer, cancel, max_new, limit_reason, hooks, written, prompt_cache,
                           constraint)


def _diffusion_loop(
    model: DecodingModel,
    prompt: list[int],
    s: DecodeSettings,
    tokenizer: TextDecoder | None,
    cancel: threading.Event | None,
    max_new: int,
    limit_reason: str,
    hooks: LoopHooks | None = None,
    written: int = 0,
    prompt_cache: PromptCache | ScopedPromptCache | None = None,
    constraint: grammar.Constraint | None = None,
) -> Iterator[Event]:
    B, P, mask_id = s.block_size, len(prompt), int(s.mask_token_id)  # type: ignore[arg-type]
    n_full = (P // B) * B
    device = _device_of(model)
    clock = _Clock()
    thinking = thinking_open_after(prompt, s.think_start_id, s.think_end_id)
    channels = ChannelText(tokenizer.decode if tokenizer else None, s, thinking)
    piece = _pieces(tokenizer)
    generated: list[int] = []
    passes = 0
    end = min(s.max_positions, -(-(P + max_new) // B) * B)  # last position any block can reach, block-aligned
    # the prompt's whole blocks before its last turn (the generation prompt) are kept for the next request that
    # starts with them (a chat's next turn: PromptCache)
    prompt_cache = PromptCache.for_model(prompt_cache, model)
    keep_at = min(n_full, _turn_start(prompt, s) // B * B) if prompt_cache is not None else 0
    cache, cached, prev_row = (prompt_cache.take(model, prompt, n_full, end, B) if prompt_cache is not None
                               else (model.new_cache(end), 0, None))  # prev_row [V]: last logit row before a block
    clock.cached = cached
    yield PromptInfo(prompt_tokens=P, block_size=B, first_block=n_full // B, tail=P - n_full, cached_tokens=cached)
    if cancel is not None and cancel.is_set():
        yield _finished(generated, channels, "cancelled", passes, P, clock, hooks)
        return

    eos = set(s.eos_token_ids)
    reason = limit_reason
    if cached < n_full:
        ids = torch.tensor(prompt[cached:n_full], dtype=torch.long, device=device)  # [n_full - cached]
        # prefill=True: the model may treat the prompt differently (the MoE coreset is off in prefill by default)
        keep = None
        if prompt_cache is not None and cached < keep_at:  # forwards end at the points kept for later turns
            def keep_here(end: int, out: Tensor) -> None:
                prompt_cache.keep(prompt[: cached + end], cache, out[-1], B)

            points = _keep_points(prompt, s, cached, keep_at, B, model.segment_tokens(B), prompt_cache.checkpoints,
                                  _turn_checkpoints(model, s))
            keep = ([p - cached for p in points], keep_here)
        out = yield from _prefill(model, ids, cache, B, cancel, at=cached, keep=keep, prefill=True)  # [1, V]
        if out is None:  # cancelled between two prefill segments
            yield _finished(generated, channels, "cancelled", passes, P, clock, hooks)
            return
        prev_row = out[-1]
    clock.prefill_done = clock.now()
    if s.prefill_only:
        yield _finished(generated, channels, "prefilled", passes, P, clock, hooks)
        return
    vocab: int | None = None
    rep_seen = out_seen = None
    gen = _generator(s, device)
    block_index = n_full // B
    tail = prompt[n_full:]
    while True:
        pos0 = block_index * B
        start = len(tail)
        needed = min(B, start + max_new - len(generated))  # slots [start, needed) can still be output
        x = torch.tensor(tail + [mask_id] * (B - start), dtype=torch.long, device=device)  # [B]
        conf = torch.zeros(B, dtype=torch.float32, device=device)  # [B] confidence each slot was committed with
        conf[:start] = 1.0
        n_at_entry = written + len(generated)  # the ramps count the answer's tokens, a continued one's from its start
        thinking_at_entry = channels.thinking_open
        pass_index = 0
        cancelled = False
        slot_lp = _SlotLogprobs(B, s.logprobs, device) if s.logprobs is not None else None
        if hooks is not None and hooks.begin_block is not None:
            hooks.begin_block()
        while True:
            if cancel is not None and cancel.is_set():
                cancelled = True
                break
            logits = _forward(model, x, pos0, cache, block_size=B, write_cache=False).float()  # [B, V]
            passes += 1
            if s.shift_logits:
                logits = decoding.shift_logits(logits, prev_row)
            if vocab is None:
                vocab = logits.shape[-1]
                rep_seen = decoding.seen_mask(prompt, vocab, device)
                out_seen = _output_seen(prompt, written, vocab, device)
            x, conf, shown, commit = denoise_policy(
                logits, x, conf, s, start=start, seen=(rep_seen, out_seen),  # type: ignore[arg-type]
                n_at_entry=n_at_entry, thinking_at_entry=thinking_at_entry, generator=gen, constraint=constraint,
            )
            if slot_lp is not None:
                slot_lp.update(logits, x, commit)
            # The one device-to-host read of the pass: tokens, confidences and commits in one copy (ids are exact
            # in float32 up to 2**24, far past any vocabulary)
            host = torch.stack([x.float(), shown.float(), commit.float()]).tolist()
            tokens = [int(t) for t in host[0]]
            still = [t == mask_id for t in tokens]
            yield BlockStep(
                block_index=block_index,
                pass_index=pass_index,
                tokens=tuple(tokens),
                texts=tuple("" if m else piece(t) for t, m in zip(tokens, still)),
                masked=tuple(still),
                confidence=tuple(host[1]),
                committed_now=tuple(c > 0.5 for c in host[2]),
                prompt_slots=start,
            )
            pass_index += 1
            if not any(still[start:needed]) or decoding.eos_resolved(tokens, still, start, eos):
                break
        if cancelled:
            if hooks is not None and hooks.end_block is not None:
                hooks.end_block()
            reason = "cancelled"
            if pass_index:  # Stop inside a block keeps what its passes committed from the block's start on (the
                # text up to the first slot still masked): the answer so far, which Continue goes on from
                kept = list(itertools.takewhile(lambda t: t != mask_id, tokens[start:needed]))
                block_ids, _ = decoding.truncate_at_eos(kept, eos)
                if block_ids:
                    if slot_lp is not None:
                        yield slot_lp.event(start, block_ids, channels.kinds(block_ids))
                    generated.extend(block_ids)
                    clock.mark_first_token()
                    yield from channels.feed(block_ids)
                    yield BlockCommitted(block_index=block_index, passes=pass_index, token_ids=tuple(block_ids))
            break
        block_ids, hit_eos = decoding.truncate_at_eos(tokens[start:needed], eos)
        final = hit_eos or len(generated) + len(block_ids) >= max_new
        if not final:
            # The commit pass: the finished block becomes causal prefix. Skipped for the last block, whose
            # cache entries nothing would read.
            if cancel is not None and cancel.is_set():
                if hooks is not None and hooks.end_block is not None:
                    hooks.end_block()
                reason = "cancelled"
                break
            out = _forward(model, x, pos0, cache, block_size=B, write_cache=True, last_only=True)  # [1, V]
            prev_row = out[-1]
            passes += 1
            pass_index += 1
        if hooks is not None and hooks.end_block is not None:
            hooks.end_block()
        generated.extend(block_ids)
        out_seen[torch.tensor(block_ids, dtype=torch.long, device=device)] = True  # type: ignore[index]
        rep_seen |= out_seen  # type: ignore[operator]
        if block_ids:
            clock.mark_first_token()
            if slot_lp is not None:
                yield slot_lp.event(start, block_ids, channels.kinds(block_ids))
        yield from channels.feed(block_ids)
        yield BlockCommitted(block_index=block_index, passes=pass_index, token_ids=tuple(block_ids))
        if final:
            reason = "eos" if hit_eos else limit_reason
            break
        block_index += 1
        tail = []
    yield from channels.finish()
    yield _finished(generated, channels, reason, passes, P, clock, hooks)


def denoise_policy(
    logits: Tensor,
    x: Tensor,
    conf: Tensor,
    s: DecodeSettings,
    *,
    start: int,
    seen: tuple[Tensor, Tensor],
    n_at_entry: int,
    thinking_at_entry: bool,
    generator: torch.Generator | None = None,
    constraint: grammar.Constraint | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One denoising pass's policy, on the device with no host read: penalties (the prompt and output so far in
    ``seen`` = (repetition, presence) [V] masks, plus this block's committed slots), the length and think-end
    biases, the proposal and the commit rule. logits [B, V] (already shifted), x [B] slot tokens (masks where
    open), conf [B] the confidence each slot was committed with. Returns (x, conf, shown, commit): the block after
    this pass, the confidences, what the view shows (still-masked slots: this pass's confidence), the commits.

    With a ``constraint`` (structured output) only a grammar-valid left prefix commits: :func:`_grammar_commit`."""
    if constraint is not None:
        return _grammar_commit(logits, x, conf, s, constraint, start=start, seen=seen, n_at_entry=n_at_entry,
                               thinking_at_entry=thinking_at_entry, generator=generator)
    proposal, p, useful = _proposals(logits, x, s, start=start, seen=seen, n_at_entry=n_at_entry,
                                     thinking_at_entry=thinking_at_entry, generator=generator)
    masked = x == int(s.mask_token_id)  # type: ignore[arg-type]
    commit = decoding.threshold_commit(p, useful, s.threshold)  # [B]
    x = torch.where(commit, proposal, x)
    conf = torch.where(commit, p, conf)
    shown = torch.where(masked & ~commit, p, conf)
    return x, conf, shown, commit


def _grammar_commit(
    logits: Tensor, x: Tensor, conf: Tensor, s: DecodeSettings, constraint: grammar.Constraint, *, start: int,
    seen: tuple[Tensor, Tensor], n_at_entry: int, thinking_at_entry: bool, generator: torch.Generator | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`denoise_policy` under a grammar. The committed slots of a block are always a left prefix (the
    grammar state is the output so far plus that prefix). The leftmost open slot's logits are masked by the
    grammar and it commits every pass (so each pass commits at least one token); after it, the slots the threshold
    rule would commit commit too while they follow one another without a gap and the grammar takes each after the
    ones to its left; the first that does not, and every slot right of it, stay open. Reads the proposals to the
    host (the grammar runs there)."""
    mask_id = int(s.mask_token_id)  # type: ignore[arg-type]
    open_slots = (x == mask_id).tolist()
    first = next((i for i in range(start, len(open_slots)) if open_slots[i]), None)
    if first is None:  # nothing open: nothing commits
        none = torch.zeros_like(x, dtype=torch.bool)
        return x, conf, conf, none
    logits = logits.clone()
    logits[first] = constraint.mask(logits[first])
    proposal, p, useful = _proposals(logits, x, s, start=start, seen=seen, n_at_entry=n_at_entry,
                                     thinking_at_entry=thinking_at_entry, generator=generator)
    wanted = decoding.threshold_commit(p, useful, s.threshold).tolist()
    tokens = proposal.tolist()
    run = [tokens[first]]
    for i in range(first + 1, len(tokens)):
        if not (open_slots[i] and wanted[i]):
            break
        run.append(tokens[i])
    n = max(1, constraint.accepts(run))  # the first slot's token is the grammar's by its mask
    constraint.advance(run[:n])
    commit = torch.zeros_like(x, dtype=torch.bool)
    commit[first:first + n] = True
    masked = x == mask_id
    x = torch.where(commit, proposal, x)
    conf = torch.where(commit, p, conf)
    shown = torch.where(masked & ~commit, p, conf)
    return x, conf, shown, commit


def _proposals(
    logits: Tensor, x: Tensor, s: DecodeSettings, *, start: int, seen: tuple[Tensor, Tensor], n_at_entry: int,
    thinking_at_entry: bool, generator: torch.Generator | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """A denoising pass's proposals before the commit rule: (proposal [B], its probability [B], the slots that
    compete to commit [B] bool)."""
    mask_id = int(s.mask_token_id)  # type: ignore[arg-type]
    rep_seen, out_seen = seen
    masked = x == mask_id  # [B]
    in_block = decoding.seen_mask_of(x[start:], logits.shape[-1], skip_id=mask_id)  # [V] committed in this block
    penalized = _penalize(logits, s, rep_seen | in_block, out_seen | in_block)
    own = penalized is not logits  # the biases below may then change it in place (one [B, V] copy less each)
    logits = decoding.apply_length_penalty(
        penalized, masked, s.eos_token_ids, s.length_penalty, n_at_entry, s.length_penalty_start,
        s.length_penalty_window, inplace=own,
    )
    committed = torch.where(masked[start:], -1, x[start:])  # [B - start]: masks read as no token
    logits = decoding.apply_think_end_bias(
        logits, masked, s.think_end_id, s.think_end_bias, n_at_entry, s.think_end_bias_start, s.think_end_bias_window,
        decoding.thinking_open_in(committed, thinking_at_entry, s.think_start_id, s.think_end_id), inplace=own,
    )
    proposal, p = decoding.propose(
        logits, do_sample=s.do_sample, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, generator=generator
    )  # [B], [B]
    # Slots after an EOS already committed in this block do not compete (the single-slot fallback would waste
    # passes there). Slots past the max_new_tokens budget do: a shorter budget then commits the same tokens in the
    # same passes and only stops sooner, so its output is a prefix of a longer budget's ("max_tokens only cuts").
    slot_index = torch.arange(x.shape[0], device=x.device)
    useful = masked & (slot_index < decoding.output_limit(x, start, x.shape[0], s.eos_token_ids))  # [B]
    return proposal, p, useful


# ---------------------------------------------------------------------------------------------------------------
# self-speculative (spec mode): diffusion drafts, one causal verify pass, AR greedy's tokens


class Drafter(Protocol):
    """A draft source in place of the denoising passes (tests: drafts that agree with AR greedy where asked, which
    random weights never give). ``block`` [B]: the committed slots [0, ``start``) and masks after; returns the
    block's B tokens, slots past ``needed`` (the output budget) free to stay masks. Runs no forward."""

    def __call__(self, pos0: int, block: list[int], start: int, needed: int) -> list[int]: ...


SPEC_COUNTS = ("draft_passes", "verify_passes", "drafted", "accepted", "full_accepts", "partial_accepts",
               "rejections", "rollbacks", "catch_ups")


def generate_spec(
    model: DecodingModel,
    prompt_ids: Sequence[int],
    s: DecodeSettings,
    tokenizer: TextDecoder | None = None,
    cancel: threading.Event | None = None,
    vocab_size: int | None = None,
    hooks: LoopHooks | None = None,
    written: int = 0,
    prompt_cache: PromptCache | None = None,
    drafter: Drafter | None = None,
) -> Iterator[Event]:
    """Self-speculative decoding: the tokens of AR greedy, drafted a block at a time by diffusion. Checks the
    request before returning the event iterator.

    The cache holds the causal prefix (as AR's) up to the open block's start, a block boundary. The block's open
    slots are drafted by denoising passes over it (block mode, read-only, the diffusion loop's policy), then ONE
    causal pass over the whole block (its committed slots and the drafts) verifies them: the drafts AR greedy
    writes too are accepted, left to right, up to the first it does not, where the verify pass's own token goes
    instead; the rest is drafted again. All right, the block is written (the verify pass wrote it) and the
    verify pass's last row gives the next block's first token. Rollback: the Gated DeltaNet conv and recurrent
    states are copied before the verify pass and put back after a wrong draft (``ModelCache.gdn_snapshot`` /
    ``roll_back``); the key and value rows past the block start are scratch again. Snapshot, not recompute: a copy
    of the states costs no forward, and the accepted slots need no forward of their own either, since the next
    verify pass runs over the whole block again (a block-aligned pass costs the same with them in it, and the
    drafter's passes must start at a block boundary anyway, as Clover's blocks are aligned to position 0).
    Greedy only: accepting sampled drafts needs each drafted token's left-to-right probability, which a
    denoising pass does not give."""
    prompt = [int(i) for i in prompt_ids]
    _check_prompt(prompt, vocab_size, written)
    if s.mask_token_id is None:
        raise PromptError(
            "spec mode drafts by diffusion and needs a mask token: the model's config.json has no mask_token_id and "
            "the tokenizer has no <|mask|> token (use --mode ar)"
        )
    if s.do_sample:
        raise PromptError("mode 'spec' decodes greedily (its tokens are AR greedy's): sample with mode 'ar' or "
                          "'diffusion'")
    B, P = s.block_size, len(prompt)
    first_block_end = (P // B + 1) * B
    if first_block_end > s.max_positions:
        raise PromptError(
            f"prompt is {P} tokens; with room to finish its last {B}-token block it needs {first_block_end} "
            f"positions, but the context holds {s.max_positions}"
        )
    room = (s.max_positions // B) * B - P  # a verify pass writes a whole block
    max_new = min(s.max_new_tokens, room)
    limit_reason = "context" if max_new < s.max_new_tokens else "max_new_tokens"
    constraint = _constraint_for(s, tokenizer, vocab_size, prompt)
    return _SpecLoop(model, prompt, s, tokenizer, cancel, max_new, limit_reason, hooks, written, prompt_cache,
                     drafter, constraint).run()


def greedy_rows(rows: Tensor, drafted: Tensor, s: DecodeSettings, rep_seen: Tensor, out_seen: Tensor) -> Tensor:
    """AR greedy's token at each of T consecutive positions: rows [T, V] the causal logits there, drafted [T - 1]
    the tokens placed between them (row i comes after ``drafted[:i]``). Row i gets the penalties the AR loop
    applies at its position: the prompt and output so far (``rep_seen``, ``out_seen`` [V]) and ``drafted[:i]``,
    as the AR loop would have output them; then the same proposal (:func:`decoding.propose`, greedy). -> [T]."""
    t, v = rows.shape
    x = rows.float()
    if s.repetition_penalty != 1.0 or s.presence_penalty != 0.0:
        before = torch.zeros(t, v, dtype=torch.bool, device=x.device)  # [T, V] drafted before each row
        if t > 1:
            hits = torch.zeros(t - 1, v, dtype=torch.int32, device=x.device)
            hits.scatter_(1, drafted.long().clamp(0, v - 1).view(-1, 1), 1)
            before[1:] = hits.cumsum(0) > 0
        if s.repetition_penalty != 1.0:  # elementwise as decoding.apply_repetition_penalty
            scaled = torch.where(x > 0, x / s.repetition_penalty, x * s.repetition_penalty)
            x = torch.where(rep_seen[None, :] | before, scaled, x)
        if s.presence_penalty != 0.0:  # as decoding.apply_presence_penalty
            x = x - s.presence_penalty * (out_seen[None, :] | before).to(x.dtype)
    if s.mask_token_id is not None:
        x = decoding.forbid_tokens(x, [s.mask_token_id], inplace=x is not rows)
    tokens, _ = decoding.propose(x, do_sample=False)
    return tokens


class _SpecLoop:
    """The state of one spec-mode generation (see :func:`generate_spec`); :meth:`run` yields its events."""

    def __init__(
        self, model: DecodingModel, prompt: list[int], s: DecodeSettings, tokenizer: TextDecoder | None,
        cancel: threading.Event | None, max_new: int, limit_reason: str, hooks: LoopHooks | None, written: int,
        prompt_cache: PromptCache | None, drafter: Drafter | None, constraint: grammar.Constraint | None = None,
    ) -> None:
        self.model, self.prompt, self.s, self.cancel = model, prompt, s, cancel
        self.constraint = constraint  # structured output: AR greedy under the grammar (drafts stay free)
        self.max_new, self.limit_reason, self.hooks, self.written = max_new, limit_reason, hooks, written
        self.prompt_cache = PromptCache.for_model(prompt_cache, model)
        self.drafter = drafter
        self.B, self.mask_id = s.block_size, int(s.mask_token_id)  # type: ignore[arg-type]
        self.device = _device_of(model)
        self.clock = _Clock()
        thinking = thinking_open_after(prompt, s.think_start_id, s.think_end_id)
        self.channels = ChannelText(tokenizer.decode if tokenizer else None, s, thinking)
        self.piece = _pieces(tokenizer)
        self.eos = set(s.eos_token_ids)
        self.generated: list[int] = []
        self.passes = 0
        self.counts = dict.fromkeys(SPEC_COUNTS, 0)
        self.rep_seen: Tensor | None = None  # [V]
        self.out_seen: Tensor | None = None  # [V]
        self.prev_row: Tensor | None = None  # [V] the causal row that predicts the open block's first slot
        # with logprobs asked: the causal rows [T, V] the next tokens to commit were chosen from, and their event
        self.lp_rows: Tensor | None = None
        self.lp_event: TokenLogprobs | None = None

    def _cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def _finish(self, reason: str) -> Finished:
        return _finished(self.generated, self.channels, reason, self.passes, len(self.prompt), self.clock,
                         self.hooks, self.counts)

    def _seen(self, vocab: int) -> tuple[Tensor, Tensor]:
        if self.rep_seen is None or self.out_seen is None:
            self.rep_seen = decoding.seen_mask(self.prompt + self.generated, vocab, self.device)
            self.out_seen = _output_seen(self.prompt, self.written, vocab, self.device)
            self.out_seen |= decoding.seen_mask(self.generated, vocab, self.device)
        return self.rep_seen, self.out_seen

    def _greedy(self, row: Tensor) -> int:
        """AR greedy's token after everything committed, from its causal row [V]."""
        rep, out = self._seen(row.shape[-1])
        if self.s.logprobs is not None:
            self.lp_rows = row.view(1, -1)
        if self.constraint is not None:
            row = self.constraint.mask(row)
        return int(greedy_rows(row.view(1, -1), row.new_zeros(0, dtype=torch.long), self.s, rep, out)[0])

    def _commit(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """Output ``tokens`` up to an EOS or the budget: (those output, the stop reason or None)."""
        out: list[int] = []
        reason = None
        for tok in tokens:
            out.append(tok)
            if tok in self.eos:
                reason = "eos"
                break
            if len(self.generated) + len(out) >= self.max_new:
                reason = self.limit_reason
                break
        if out and self.s.logprobs is not None and self.lp_rows is not None:
            self.lp_event = row_logprobs(self.lp_rows[: len(out)], out, self.s.logprobs, self.channels.kinds(out))
        self.generated.extend(out)
        if self.constraint is not None:
            self.constraint.advance(out)
        if out and self.rep_seen is not None and self.out_seen is not None:
            ids = torch.tensor(out, dtype=torch.long, device=self.device)
            self.rep_seen[ids] = True
            self.out_seen[ids] = True
        if out:
            self.clock.mark_first_token()
        return out, reason

    def _emit(self, out: list[int]) -> Iterator[Event]:
        """The events of tokens just output (:meth:`_commit`): their log probabilities when asked, their text."""
        if self.lp_event is not None:
            yield self.lp_event
            self.lp_event = None
        yield from self.channels.feed(out)

    def _prefill(self, cache: Any, cached: int, n_full: int) -> Generator[Event, None, bool]:
        """The prompt's whole blocks, causally (AR's prefill: the prompt cache's causal entries serve both);
        False when cancelled."""
        prompt, s = self.prompt, self.s
        pc = self.prompt_cache
        keep = None
        keep_at = min(self._limit(n_full), _turn_start(prompt, s)) // GDN_CHUNK * GDN_CHUNK if pc is not None else 0
        if pc is not None and cached < keep_at:
            def keep_here(end: int, out: Tensor) -> None:
                pc.keep(prompt[: cached + end], cache, out[-1], None)

            points = _keep_points(prompt, s, cached, keep_at, GDN_CHUNK, self.model.segment_tokens(None),
                                  pc.checkpoints, _turn_checkpoints(self.model, s))
            keep = ([p - cached for p in points], keep_here)
        ids = torch.tensor(prompt[cached:n_full], dtype=torch.long, device=self.device)
        out = yield from _prefill(self.model, ids, cache, None, self.cancel, at=cached, keep=keep)  # [1, V]
        if out is None:
            return False
        self.prev_row = out[-1]
        return True

    def _limit(self, n_full: int) -> int:
        """How much of the prompt the prompt cache may give: its whole blocks, less the last token when the prompt
        ends on a block boundary (its row gives the first output token)."""
        return n_full if n_full < len(self.prompt) else n_full - 1

    def run(self) -> Iterator[Event]:
        B, P, s = self.B, len(self.prompt), self.s
        n_full = (P // B) * B
        end = min(s.max_positions, -(-(P + self.max_new) // B) * B)
        pc = self.prompt_cache
        cache, cached, _ = (pc.take(self.model, self.prompt, self._limit(n_full), end, None) if pc is not None
                            else (self.model.new_cache(end), 0, None))
        self.clock.cached = cached
        yield PromptInfo(prompt_tokens=P, block_size=B, first_block=n_full // B, tail=P - n_full,
                         cached_tokens=cached)
        if self._cancelled():
            yield self._finish("cancelled")
            return
        if cached < n_full and not (yield from self._prefill(cache, cached, n_full)):
            yield self._finish("cancelled")
            return
        self.clock.prefill_done = self.clock.now()
        if s.prefill_only:
            yield self._finish("prefilled")
            return
        block, start = list(self.prompt[n_full:]), P - n_full
        reason: str | None = None
        if not block:  # the prompt ends on a block boundary: its last row gives the first token, as in AR
            assert self.prev_row is not None
            out, reason = self._commit([self._greedy(self.prev_row)])
            block = out
            yield from self._emit(out)
        pos0, block_index, block_passes = n_full, n_full // B, 0
        block_out: list[int] = list(block[start:])  # this block's output so far
        while reason is None:
            needed = min(B, len(block) + self.max_new - len(self.generated))
            drafted = yield from self._draft(cache, pos0, block_index, block, start, needed, block_passes)
            if drafted is None:
                reason = "cancelled"
                break
            tokens, conf, n_passes = drafted
            block_passes += n_passes
            if self._cancelled():
                reason = "cancelled"
                break
            verified = self._verify(cache, pos0, block, tokens)
            block_passes += 1
            accepted, verifier, k = verified
            out, reason = self._commit(accepted + [verifier])
            block_out += out[: B - len(block)]
            yield self._verify_step(block_index, block_passes - 1, block, tokens, conf, k, verifier, start)
            yield from self._emit(out)
            if k == B:  # every draft right: the verify pass wrote the block; its last row gave the next block's first
                yield BlockCommitted(block_index=block_index, passes=block_passes, token_ids=tuple(block_out))
                block_out = out[B - len(block):]  # the verifier's token, unless the output ended before it
                pos0, block_index, block, start, block_passes = pos0 + B, block_index + 1, [verifier], 0, 0
                continue  # (or the output ended: the loop's condition)
            if reason is not None:
                break
            block = tokens[:k] + [verifier]
            if len(block) == B:  # the verifier's token filled the block: one causal pass writes it (checks nothing)
                row = _forward(self.model, torch.tensor(block, dtype=torch.long, device=self.device), pos0, cache,
                               block_size=None, write_cache=True, last_only=True)[-1]  # [V]
                self.passes += 1
                self.counts["catch_ups"] += 1
                block_passes += 1
                self.prev_row = row
                yield BlockCommitted(block_index=block_index, passes=block_passes, token_ids=tuple(block_out))
                out, reason = self._commit([self._greedy(row)])
                yield from self._emit(out)
                pos0, block_index, block, start, block_out, block_passes = pos0 + B, block_index + 1, out, 0, list(out), 0
        if block_out or block_passes:
            yield BlockCommitted(block_index=block_index, passes=block_passes, token_ids=tuple(block_out))
        yield from self.channels.finish()
        yield self._finish(reason or self.limit_reason)

    def _draft(
        self, cache: Any, pos0: int, block_index: int, block: list[int], prompt_slots: int, needed: int,
        pass0: int,
    ) -> Generator[Event, None, tuple[list[int], list[float], int] | None]:
        """Draft the open slots [len(block), B): (the block's tokens, their confidences, passes spent), or None
        when cancelled. By the injected drafter, or by denoising passes (one BlockStep each) until the slots that
        can be output are drafted (or an EOS drafted with every slot before it)."""
        B, a = self.B, len(block)
        hooks = self.hooks
        if a >= needed:  # nothing open to draft (a block of 1): the verify pass alone gives the next token
            return block + [self.mask_id] * (B - a), [1.0] * B, 0
        if self.drafter is not None:
            tokens = [int(t) for t in self.drafter(pos0, block + [self.mask_id] * (B - a), a, needed)]
            if len(tokens) != B or tokens[:a] != block:
                raise ValueError(f"a drafter must return the block's {B} tokens with its first {a} as given")
            return tokens, [1.0] * B, 0
        x = torch.tensor(block + [self.mask_id] * (B - a), dtype=torch.long, device=self.device)  # [B]
        conf = torch.zeros(B, dtype=torch.float32, device=self.device)
        conf[:a] = 1.0
        n_at_entry = self.written + len(self.generated)
        thinking_at_entry = self.channels.thinking_open
        n = 0
        if hooks is not None and hooks.begin_block is not None:
            hooks.begin_block()
        try:
            while True:
                if self._cancelled():
                    return None
                logits = _forward(self.model, x, pos0, cache, block_size=B, write_cache=False).float()  # [B, V]
                self.passes += 1
                self.counts["draft_passes"] += 1
                n += 1
                if self.s.shift_logits:
                    logits = decoding.shift_logits(logits, self.prev_row)
                seen = self._seen(logits.shape[-1])
                x, conf, shown, commit = denoise_policy(
                    logits, x, conf, self.s, start=a, seen=seen, n_at_entry=n_at_entry,
                    thinking_at_entry=thinking_at_entry,
                )
                host = torch.stack([x.float(), shown.float(), commit.float()]).tolist()
                tokens = [int(t) for t in host[0]]
                still = [t == self.mask_id for t in tokens]
                yield BlockStep(
                    block_index=block_index, pass_index=pass0 + n - 1, tokens=tuple(tokens),
                    texts=tuple("" if m else self.piece(t) for t, m in zip(tokens, still)), masked=tuple(still),
                    confidence=tuple(host[1]), committed_now=tuple(c > 0.5 for c in host[2]),
                    prompt_slots=prompt_slots,
                )
                if not any(still[a:needed]) or decoding.eos_resolved(tokens, still, a, self.eos):
                    return tokens, host[1], n
        finally:
            if hooks is not None and hooks.end_block is not None:
                hooks.end_block()

    def _verify(self, cache: Any, pos0: int, block: list[int], tokens: list[int]) -> tuple[list[int], int, int]:
        """One causal pass over the block (its committed slots and the drafts), writing the cache: (the drafts AR
        greedy writes too, the verify pass's own token after them, the slot of that token: B when every draft was
        right, the token being the next block's first). After a wrong draft the cache is back at ``pos0``."""
        B, a = self.B, len(block)
        assert a >= 1, "a verified block holds at least one committed slot (its first token is always known)"
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)  # [B]
        snapshot = cache.gdn_snapshot()
        rows = _forward(self.model, ids, pos0, cache, block_size=None, write_cache=True)  # [B, V]
        if self.s.logprobs is not None:
            self.lp_rows = rows[a - 1:]  # row a - 1 + i chose the i-th token output from here
        self.passes += 1
        counts = self.counts
        counts["verify_passes"] += 1
        rep, out = self._seen(rows.shape[-1])
        checked = rows[a - 1:]  # [B - a + 1, V]: the rows that give slots a..B
        if self.constraint is not None:  # each row masked by the grammar after the drafts before it
            masks = self.constraint.masks_along(tokens[a:], checked.device)
            checked = checked.clone()
            checked[: len(masks)] = checked[: len(masks)].masked_fill(~torch.stack(masks), float("-inf"))
        target = greedy_rows(checked, ids[a:], self.s, rep, out).tolist()  # [B - a + 1]: slots a..B
        k = a
        ended = False  # an accepted EOS: the output ends there, nothing after it is verified or rolled back
        while k < B and tokens[k] == target[k - a] and not ended:
            ended = tokens[k] in self.eos
            k += 1
        counts["drafted"] += sum(1 for t in tokens[a:] if t != self.mask_id)
        counts["accepted"] += k - a
        if ended:
            return tokens[a:k], target[k - a] if k < B else -1, k
        if k == B:
            counts["full_accepts"] += 1
            self.prev_row = rows[-1]
        else:
            counts["partial_accepts" if k > a else "rejections"] += 1
            counts["rollbacks"] += 1
            cache.roll_back(snapshot, pos0)
        return tokens[a:k], target[k - a], k

    def _verify_step(self, block_index: int, pass_index: int, block: list[int], tokens: list[int],
                     conf: list[float], k: int, verifier: int, prompt_slots: int) -> BlockStep:
        """What the denoising view shows of a verify pass (BlockStep.verdict)."""
        B, a = self.B, len(block)
        shown = list(tokens)
        verdict = [""] * a + ["accepted"] * (k - a) + ["rejected"] * (B - k)
        if k < B:
            shown[k] = verifier
            verdict[k] = "verifier"
        still = [t == self.mask_id for t in shown]
        return BlockStep(
            block_index=block_index, pass_index=pass_index, tokens=tuple(shown),
            texts=tuple("" if m else self.piece(t) for t, m in zip(shown, still)), masked=tuple(still),
            confidence=tuple(1.0 if v == "verifier" else c for v, c in zip(verdict, conf)),
            committed_now=tuple(v in ("accepted", "verifier") for v in verdict),
            prompt_slots=prompt_slots, verdict=tuple(verdict),
        )


def generate(
    model: DecodingModel,
    prompt_ids: Sequence[int],
    s: DecodeSettings,
    tokenizer: TextDecoder | None = None,
    cancel: threading.Event | None = None,
    vocab_size: int | None = None,
    hooks: LoopHooks | None = None,
    written: int = 0,
    prompt_cache: PromptCache | ScopedPromptCache | None = None,
) -> Iterator[Event]:
    """Dispatch on ``s.mode``; request errors (:class:`PromptError`) are raised here, before any event.

    ``written``: the prompt's last ``written`` tokens are the model's own answer so far (an answer being continued,
    ``GenerationParams.continue_final_message``): they count as output for the presence penalty and the length
    and think-end ramps, as they did when it wrote them. ``prompt_cache``: start from what the last request's
    prefill left when this prompt begins with the same tokens, and keep this one's for the next
    (:class:`PromptCache`)."""
    loop = {"diffusion": generate_diffusion, "spec": generate_spec}.get(s.mode, generate_ar)
    return loop(model, prompt_ids, s, tokenizer, cancel, vocab_size, hooks, written, prompt_cache)
