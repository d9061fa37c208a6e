"""The block-diffusion loop, blocks aligned to absolute position 0.

The whole prompt blocks are prefilled in one block-mode pass that writes the cache; the first generated block holds
the prompt tail followed by masks; denoising passes read the cache (``write_cache=False``) and commit by the
threshold rule (:func:`denoise_policy`) until the block has no mask; then one commit pass writes the block into the
cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch import Tensor

from clover_desk.engine.decode import decoding, grammar, loop_parts
from clover_desk.engine.decode.events import BlockCommitted, BlockStep, Event, PromptInfo
from clover_desk.engine.decode.loop_parts import Request, loop_start, prefill_keep
from clover_desk.engine.decode.outputs import SlotLogprobs
from clover_desk.engine.decode.settings import DecodeSettings


def diffusion_loop(r: Request) -> Iterator[Event]:
    """Block diffusion, as the module says, for a checked request (:func:`engine.decode.loop_parts.check_request`)."""
    model, prompt, s, cancel, hooks, prompt_cache = r.model, r.prompt, r.s, r.cancel, r.hooks, r.prompt_cache
    max_new, written = r.max_new, r.written
    B, P, mask_id = s.block_size, len(prompt), int(s.mask_token_id)  # type: ignore[arg-type]
    n_full = (P // B) * B
    device, clock, channels = loop_start(r)
    piece = loop_parts.token_pieces(r.tokenizer)
    generated: list[int] = []
    passes = 0
    end = min(s.max_positions, -(-(P + max_new) // B) * B)  # last position any block can reach, block-aligned
    # the prompt's whole blocks before its last turn (the generation prompt) are kept for the next request that
    # starts with them (a chat's next turn: PromptCache)
    keep_at = min(n_full, loop_parts.turn_start(prompt, s) // B * B) if prompt_cache is not None else 0
    cache, cached, prev_row = (prompt_cache.take(model, prompt, n_full, end, B) if prompt_cache is not None
                               else (model.new_cache(end), 0, None))  # prev_row [V]: last logit row before a block
    clock.cached = cached
    yield PromptInfo(prompt_tokens=P, block_size=B, first_block=n_full // B, tail=P - n_full, cached_tokens=cached)
    if r.cancelled():
        yield loop_parts.finished(generated, channels, "cancelled", passes, P, clock, hooks)
        return

    eos = set(s.eos_token_ids)
    reason = r.limit_reason
    if cached < n_full:
        ids = torch.tensor(prompt[cached:n_full], dtype=torch.long, device=device)  # [n_full - cached]
        # prefill=True: the model may treat the prompt differently (the MoE coreset is off in prefill by default)
        keep = prefill_keep(r, cache, cached, keep_at, B)  # forwards end at the points kept for later turns
        out = yield from loop_parts.prefill(model, ids, cache, B, cancel, at=cached, keep=keep, prefill=True)  # [1, V]
        if out is None:  # cancelled between two prefill segments
            yield loop_parts.finished(generated, channels, "cancelled", passes, P, clock, hooks)
            return
        prev_row = out[-1]
    clock.prefill_done = clock.now()
    if s.prefill_only:
        yield loop_parts.finished(generated, channels, "prefilled", passes, P, clock, hooks)
        return
    vocab: int | None = None
    rep_seen = out_seen = None
    gen = loop_parts.sampling_generator(s, device)
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
        slot_lp = SlotLogprobs(B, s.logprobs, device) if s.logprobs is not None else None
        still = [t == mask_id for t in tail] + [True] * (B - start)  # the slots of x that are masks (on the host,
        # then from each pass's one read)
        raw: Tensor | None = None  # [B, V] the last pass's logits (rows of committed slots may be older)
        if hooks is not None and hooks.begin_block is not None:
            hooks.begin_block()
        while True:
            if r.cancelled():
                cancelled = True
                break
            raw = pass_logits(model, x, pos0, cache, still, s.shift_logits, raw)  # [B, V]
            passes += 1
            logits = decoding.shift_logits(raw, prev_row) if s.shift_logits else raw
            if vocab is None:
                vocab = logits.shape[-1]
                rep_seen = decoding.seen_mask(prompt, vocab, device)
                out_seen = loop_parts.output_seen(prompt, written, vocab, device)
            x, conf, shown, commit = denoise_policy(
                logits, x, conf, s, start=start, seen=(rep_seen, out_seen),  # type: ignore[arg-type]
                n_at_entry=n_at_entry, thinking_at_entry=thinking_at_entry, generator=gen, constraint=r.constraint,
                still=still,
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
            if r.cancelled():
                if hooks is not None and hooks.end_block is not None:
                    hooks.end_block()
                reason = "cancelled"
                break
            out = loop_parts.forward(model, x, pos0, cache, block_size=B, write_cache=True, last_only=True)  # [1, V]
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
            reason = "eos" if hit_eos else r.limit_reason
            break
        block_index += 1
        tail = []
    yield from channels.finish()
    yield loop_parts.finished(generated, channels, reason, passes, P, clock, hooks)


def head_rows(model: object, still: list[bool], shift: bool) -> list[int] | None:
    """The rows of a denoising pass whose logits propose a still-masked slot (``still`` [B]): slot j's own row, or
    row j - 1 when the model's row i predicts token i + 1 (``shift``; slot 0 then takes the row before the block),
    or None for every row (all are needed, or the model computes every row anyway). Committed slots need no
    proposal, and the LM head is a pass's largest product: a block's later passes compute it for fewer rows."""
    if not getattr(model, "computes_head_rows", False):
        return None
    rows = [j - 1 if shift else j for j, masked in enumerate(still) if masked and not (shift and j == 0)]
    return None if len(rows) == len(still) else rows


def pass_logits(model: loop_parts.DecodingModel, x: Tensor, pos0: int, cache: object, still: list[bool], shift: bool,
                raw: Tensor | None) -> Tensor:
    """A denoising pass's logits [B, V] in fp32: every row where :func:`head_rows` asks for all, else ``raw`` (the
    block's previous pass; zeros before the first) with the rows that propose a slot in ``still`` replaced."""
    block = len(still)
    rows = head_rows(model, still, shift)
    if rows is None:
        return loop_parts.forward(model, x, pos0, cache, block_size=block, write_cache=False).float()  # [B, V]
    index = torch.tensor(rows, dtype=torch.long)  # [R] on the host (the model moves it)
    part = loop_parts.forward(model, x, pos0, cache, block_size=block, write_cache=False,
                              head_rows=index).float()  # [R, V]
    if raw is None:
        raw = part.new_zeros(block, part.shape[-1])
    raw[index.to(raw.device)] = part
    return raw


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
    still: list[bool] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One denoising pass's policy, on the device with no host read: penalties (the prompt and output so far in
    ``seen`` = (repetition, presence) [V] masks, plus this block's committed slots), the length and think-end
    biases, the proposal and the commit rule. logits [B, V] (already shifted), x [B] slot tokens (masks where
    open), conf [B] the confidence each slot was committed with. Returns (x, conf, shown, commit): the block after
    this pass, the confidences, what the view shows (still-masked slots: this pass's confidence), the commits.

    ``still`` (the host's copy of which slots of x are masks, as the loops keep it): greedy proposals are then made
    for those rows only (each row's own penalties, biases, softmax and max, so the same bits; the committed rows'
    proposals were never used), a later pass's policy touching a fraction of the [B, V] logits.

    With a ``constraint`` (structured output) only a grammar-valid left prefix commits: :func:`_grammar_commit`."""
    if constraint is not None:
        return _grammar_commit(logits, x, conf, s, constraint, start=start, seen=seen, n_at_entry=n_at_entry,
                               thinking_at_entry=thinking_at_entry, generator=generator)
    greedy = not s.do_sample or s.temperature <= 0.0  # sampling draws per row: its rows stay as they are
    rows = [j for j, m in enumerate(still) if m] if still is not None and greedy else None
    proposal, p, useful = _proposals(logits, x, s, start=start, seen=seen, n_at_entry=n_at_entry,
                                     thinking_at_entry=thinking_at_entry, generator=generator,
                                     rows=rows if rows and len(rows) < x.shape[0] else None)
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
    thinking_at_entry: bool, generator: torch.Generator | None, rows: list[int] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """A denoising pass's proposals before the commit rule: (proposal [B], its probability [B], the slots that
    compete to commit [B] bool). ``rows`` (greedy; ascending masked slots, a host list): proposals for those rows
    only, the others keep their token with probability 0 (they do not compete)."""
    mask_id = int(s.mask_token_id)  # type: ignore[arg-type]
    rep_seen, out_seen = seen
    masked = x == mask_id  # [B]
    index = torch.tensor(rows, dtype=torch.long, device=x.device) if rows is not None else None
    if index is not None:
        logits = logits.index_select(0, index)  # [R, V]
    row_masked = masked if index is None else masked.index_select(0, index)  # [B] | [R]
    in_block = decoding.seen_mask_of(x[start:], logits.shape[-1], skip_id=mask_id)  # [V] committed in this block
    penalized = loop_parts.penalize(logits, s, rep_seen | in_block, out_seen | in_block)
    own = penalized is not logits or index is not None  # the biases below may then change it in place
    logits = decoding.apply_length_penalty(
        penalized, row_masked, s.eos_token_ids, s.length_penalty, n_at_entry, s.length_penalty_start,
        s.length_penalty_window, inplace=own,
    )
    committed = torch.where(masked[start:], -1, x[start:])  # [B - start]: masks read as no token
    logits = decoding.apply_think_end_bias(
        logits, row_masked, s.think_end_id, s.think_end_bias, n_at_entry, s.think_end_bias_start,
        s.think_end_bias_window,
        decoding.thinking_open_in(committed, thinking_at_entry, s.think_start_id, s.think_end_id), inplace=own,
    )
    proposal, p = decoding.propose(
        logits, do_sample=s.do_sample, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, generator=generator
    )  # [B] | [R]
    if index is not None:
        proposal = x.index_copy(0, index, proposal)
        p = torch.zeros(x.shape[0], dtype=p.dtype, device=x.device).index_copy(0, index, p)
    # Slots after an EOS already committed in this block do not compete (the single-slot fallback would waste
    # passes there). Slots past the max_new_tokens budget do: a shorter budget then commits the same tokens in the
    # same passes and only stops sooner, so its output is a prefix of a longer budget's ("max_tokens only cuts").
    slot_index = torch.arange(x.shape[0], device=x.device)
    useful = masked & (slot_index < decoding.output_limit(x, start, x.shape[0], s.eos_token_ids))  # [B]
    return proposal, p, useful
