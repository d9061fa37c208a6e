"""The pieces the decoding loops (:mod:`engine.decode.ar`, :mod:`engine.decode.diffusion`,
:mod:`engine.decode.spec`) share: the model they drive (:class:`DecodingModel`), the placement hooks, the request
checks, the segmented prefill and the points it keeps for the prompt cache, the penalties, the clock and the
Finished event.

Policy (penalties, biases, the commit rule, sampling) comes from :mod:`engine.decode.decoding`; the model is anything
with ``new_cache(max_len)`` and ``forward(ids, start_pos, cache, block_size, write_cache, last_only)``.

A prompt longer than the model's longest pass (``segment_tokens``) is prefilled segment by segment (:func:`prefill`):
the loops yield :class:`~engine.decode.events.PrefillProgress` between segments and check the cancel flag there, so
a long pasted document shows progress and can be stopped before the first block.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from clover_desk.engine.decode import decoding, grammar
from clover_desk.engine.decode.events import Finished, PrefillProgress
from clover_desk.engine.decode.outputs import ChannelText, thinking_open_after
from clover_desk.engine.decode.prompt_cache import PromptCache, ScopedPromptCache
from clover_desk.engine.decode.settings import DecodeSettings
from clover_desk.engine.errors import PromptError
from clover_desk.engine.model.gdn import GDN_CHUNK
from clover_desk.engine.placement import offload_runtime


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
    """This model's placement hooks (:mod:`engine.placement.offload_runtime`): block boundaries and the streaming statistics
    (no-ops and {} for a model no plan was applied to)."""
    return LoopHooks(
        begin_block=lambda: offload_runtime.begin_block(model),
        end_block=lambda: offload_runtime.end_block(model),
        accounting=lambda: offload_runtime.accounting(model),
    )


# what spec and diffusion say when the model has no mask token
_NEEDS_MASK = {"diffusion": "diffusion mode needs a mask token",
               "spec": "spec mode drafts by diffusion and needs a mask token"}


@dataclass(frozen=True)
class Request:
    """One checked request, what each loop runs (:func:`check_request`; the inputs are
    :func:`engine.decode.generate.generate`'s)."""

    model: DecodingModel
    prompt: list[int]
    s: DecodeSettings
    tokenizer: TextDecoder | None
    cancel: threading.Event | None
    hooks: LoopHooks | None
    written: int  # the prompt's last ``written`` tokens are the model's own answer so far
    prompt_cache: PromptCache | ScopedPromptCache | None  # None where the model can use none
    max_new: int  # how many tokens may be output: max_new_tokens, or fewer where the context ends first
    limit_reason: str  # why the output stops at max_new: "max_new_tokens" or "context"
    constraint: grammar.Constraint | None  # structured output's grammar, None for free text
    drafter: Any = None  # spec mode: drafts from elsewhere than denoising passes (engine.decode.spec.Drafter)

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()


def check_request(model: DecodingModel, prompt_ids: Sequence[int], s: DecodeSettings, tokenizer: TextDecoder | None,
                  cancel: threading.Event | None, vocab_size: int | None, hooks: LoopHooks | None, written: int,
                  prompt_cache: PromptCache | ScopedPromptCache | None, drafter: Any = None) -> Request:
    """The request's checks, before any event (:class:`PromptError`): the prompt, what ``s.mode`` needs (diffusion
    and spec a mask token, spec greedy decoding), the room the context leaves, the grammar."""
    prompt = [int(i) for i in prompt_ids]
    _check_prompt(prompt, vocab_size, written)
    if s.mode in _NEEDS_MASK and s.mask_token_id is None:
        raise PromptError(f"{_NEEDS_MASK[s.mode]}: the model's config.json has no mask_token_id and the tokenizer "
                          "has no <|mask|> token (use --mode ar)")
    if s.mode == "spec" and s.do_sample:
        raise PromptError("mode 'spec' decodes greedily (its tokens are AR greedy's): sample with mode 'ar' or "
                          "'diffusion'")
    max_new = min(s.max_new_tokens, _room(prompt, s))
    return Request(model, prompt, s, tokenizer, cancel, hooks, written, PromptCache.for_model(prompt_cache, model),
                   max_new, "context" if max_new < s.max_new_tokens else "max_new_tokens",
                   _constraint_for(s, tokenizer, vocab_size, prompt), drafter)


def _room(prompt: list[int], s: DecodeSettings) -> int:
    """How many tokens the context leaves to generate: every position after the prompt (AR), or the slots that fit
    in whole blocks (diffusion, spec: a pass writes a whole block); PromptError when there is none."""
    P = len(prompt)
    if s.mode not in _NEEDS_MASK:
        if s.max_positions - P < 1:
            raise PromptError(
                f"prompt is {P} tokens; the context holds {s.max_positions} positions, leaving no room to generate")
        return s.max_positions - P
    B = s.block_size
    first_block_end = (P // B + 1) * B  # the block holding the prompt tail must fit whole
    if first_block_end > s.max_positions:
        raise PromptError(
            f"prompt is {P} tokens; with room to finish its last {B}-token block it needs {first_block_end} "
            f"positions, but the context holds {s.max_positions}"
        )
    return (s.max_positions // B) * B - P


def loop_start(r: Request) -> tuple[torch.device, _Clock, ChannelText]:
    """What every loop starts with: the model's device, the clock, the text channels (thinking open when the prompt
    leaves it so)."""
    thinking = thinking_open_after(r.prompt, r.s.think_start_id, r.s.think_end_id)
    return _device_of(r.model), _Clock(), ChannelText(r.tokenizer.decode if r.tokenizer else None, r.s, thinking)


def prefill_keep(r: Request, cache: Any, cached: int, keep_at: int,
                 block_size: int | None) -> tuple[list[int], Callable[[int, Tensor], None]] | None:
    """The ``keep`` of :func:`prefill` from ``cached`` (block mode with ``block_size``, causal without): where its
    forwards end for the prompt cache (:func:`_keep_points`, ``keep_at`` last) and the callback that keeps a copy
    there. None without a prompt cache or with nothing to keep."""
    pc = r.prompt_cache
    if pc is None or cached >= keep_at:
        return None

    def keep_here(end: int, out: Tensor) -> None:
        pc.keep(r.prompt[: cached + end], cache, out[-1], block_size)

    points = _keep_points(r.prompt, r.s, cached, keep_at, block_size or GDN_CHUNK, r.model.segment_tokens(block_size),
                          pc.checkpoints, _turn_checkpoints(r.model, r.s))
    return [p - cached for p in points], keep_here


def forward(model: DecodingModel, *args: Any, **kwargs: Any) -> Tensor:
    """One model forward without autograd. (No ``inference_mode`` around the loops: it would stay switched on in
    the caller's code while the generator is suspended at a ``yield``.)"""
    with torch.no_grad():
        return model.forward(*args, **kwargs)


def prefill(
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
        out = forward(  # [1, V]
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


def turn_start(prompt: Sequence[int], s: DecodeSettings) -> int:
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


def sampling_generator(s: DecodeSettings, device: torch.device) -> torch.Generator | None:
    if not s.do_sample:
        return None
    gen = torch.Generator(device=device)
    if s.seed is not None:
        gen.manual_seed(int(s.seed))
    else:
        gen.seed()
    return gen


def penalize(logits: Tensor, s: DecodeSettings, rep_seen: Tensor, out_seen: Tensor) -> Tensor:
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


def output_seen(prompt: list[int], written: int, vocab: int, device: torch.device) -> Tensor:
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


def token_pieces(tokenizer: TextDecoder | None) -> Callable[[int], str]:
    """Each token's own text for the denoising view, decoded once per token id ("" without a tokenizer)."""
    cache: dict[int, str] = {}

    def piece(tok: int) -> str:
        if tokenizer is None:
            return ""
        if tok not in cache:
            cache[tok] = tokenizer.decode([tok], skip_special_tokens=False)
        return cache[tok]

    return piece


def finished(
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
