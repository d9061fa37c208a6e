"""The autoregressive loop: prefill the prompt causally, then one token per forward through the cache.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from clover_desk.engine.decode import decoding, grammar
from clover_desk.engine.decode.events import Event, PromptInfo
from clover_desk.engine.decode.loop_parts import (
    DecodingModel,
    LoopHooks,
    TextDecoder,
    _check_prompt,
    _Clock,
    _constraint_for,
    _device_of,
    _finished,
    _forward,
    _generator,
    _keep_points,
    _output_seen,
    _penalize,
    _prefill,
    _turn_checkpoints,
    _turn_start,
)
from clover_desk.engine.decode.outputs import ChannelText, row_logprobs, thinking_open_after
from clover_desk.engine.decode.prompt_cache import PromptCache, ScopedPromptCache
from clover_desk.engine.decode.settings import DecodeSettings
from clover_desk.engine.errors import PromptError
from clover_desk.engine.kernels import fastpath
from clover_desk.engine.model.gdn import GDN_CHUNK


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
