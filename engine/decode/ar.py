"""The autoregressive loop: prefill the prompt causally, then one token per forward through the cache."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from clover_desk.engine.decode import decoding, grammar, loop_parts
from clover_desk.engine.decode.events import Event, PromptInfo
from clover_desk.engine.decode.loop_parts import Request, loop_start, prefill_keep
from clover_desk.engine.decode.outputs import row_logprobs
from clover_desk.engine.decode.settings import DecodeSettings
from clover_desk.engine.kernels import fastpath
from clover_desk.engine.model.gdn import GDN_CHUNK


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
    row = loop_parts.penalize(logits[-1:].float(), s, rep_seen, out_seen)  # [1, V]
    if constraint is not None:  # structured output: only what the grammar takes next
        row = constraint.mask(row)
    token, _ = decoding.propose(
        row, do_sample=s.do_sample, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, generator=gen
    )
    return token


def ar_loop(r: Request) -> Iterator[Event]:
    """Causal decoding: one prefill forward, then one cached forward per token."""
    model, prompt, s, cancel, hooks, prompt_cache = r.model, r.prompt, r.s, r.cancel, r.hooks, r.prompt_cache
    max_new, constraint = r.max_new, r.constraint
    P = len(prompt)
    device, clock, channels = loop_start(r)
    generated: list[int] = []
    eos = set(s.eos_token_ids)
    # A chat's next turn starts with this prompt's tokens up to its last turn (the generation prompt, which the next
    # turn renders otherwise): keep the last whole GDN chunk before that for it (PromptCache)
    usable = (P - 1) // GDN_CHUNK * GDN_CHUNK  # (at least the last token is read: its logits start the answer)
    keep_at = min(usable, loop_parts.turn_start(prompt, s) // GDN_CHUNK * GDN_CHUNK) if prompt_cache is not None else 0
    cache, cached, _ = (prompt_cache.take(model, prompt, usable, P + max_new, None) if prompt_cache is not None
                        else (model.new_cache(P + max_new), 0, None))
    clock.cached = cached
    yield PromptInfo(prompt_tokens=P, block_size=1, first_block=P, tail=0, cached_tokens=cached)
    if r.cancelled():
        yield loop_parts.finished(generated, channels, "cancelled", 0, P, clock, hooks)
        return

    ids = torch.tensor(prompt, dtype=torch.long, device=device)  # [P]
    keep = prefill_keep(r, cache, cached, keep_at, None)  # forwards end at the points kept for later turns
    logits = yield from loop_parts.prefill(model, ids[cached:], cache, None, cancel, at=cached, keep=keep)  # [1, V]
    if logits is None:  # cancelled between two prefill segments
        yield loop_parts.finished(generated, channels, "cancelled", 0, P, clock, hooks)
        return
    vocab = logits.shape[-1]
    clock.prefill_done = clock.now()
    if s.prefill_only:
        yield loop_parts.finished(generated, channels, "prefilled", 0, P, clock, hooks)
        return
    rep_seen = decoding.seen_mask(prompt, vocab, device)  # [V]
    out_seen = loop_parts.output_seen(prompt, r.written, vocab, device)  # [V]
    gen = loop_parts.sampling_generator(s, device)
    reason = r.limit_reason
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
        if r.cancelled():
            reason = "cancelled"
            break
        step = token.view(1)  # [1], already on the device (no host-to-device copy of the id just read)
        # from the third step on, a compiled model skips the guards that cannot fail (engine.kernels.fastpath.steady_state)
        with fastpath.steady_state(model) if len(generated) > 2 else contextlib.nullcontext():
            logits = loop_parts.forward(model, step, P + len(generated) - 1, cache, block_size=None, write_cache=True,
                              last_only=True)
    yield from channels.finish()
    yield loop_parts.finished(generated, channels, reason, len(generated), P, clock, hooks)
