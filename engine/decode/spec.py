"""Self-speculative decoding (spec mode): diffusion drafts a block, one causal pass verifies it, the output is
AR greedy's tokens (:func:`spec_loop`, run by :func:`engine.decode.generate.generate_spec`).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any, Protocol

import torch
from torch import Tensor

from clover_desk.engine.decode import decoding, loop_parts
from clover_desk.engine.decode.diffusion import denoise_policy, pass_logits
from clover_desk.engine.decode.events import BlockCommitted, BlockStep, Event, Finished, PromptInfo, TokenLogprobs
from clover_desk.engine.decode.loop_parts import Request, loop_start, prefill_keep
from clover_desk.engine.decode.outputs import row_logprobs
from clover_desk.engine.decode.settings import DecodeSettings
from clover_desk.engine.model.gdn import GDN_CHUNK


class Drafter(Protocol):
    """A draft source in place of the denoising passes (tests: drafts that agree with AR greedy where asked, which
    random weights never give). ``block`` [B]: the committed slots [0, ``start``) and masks after; returns the
    block's B tokens, slots past ``needed`` (the output budget) free to stay masks. Runs no forward."""

    def __call__(self, pos0: int, block: list[int], start: int, needed: int) -> list[int]: ...


SPEC_COUNTS = ("draft_passes", "verify_passes", "drafted", "accepted", "full_accepts", "partial_accepts",
               "rejections", "rollbacks", "catch_ups")


def spec_loop(r: Request) -> Iterator[Event]:
    """Self-speculative decoding: the tokens of AR greedy, drafted a block at a time by diffusion. For a checked
    request (:func:`engine.decode.loop_parts.check_request`).

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
    return _SpecLoop(r).run()


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
    """The state of one spec-mode generation (see :func:`spec_loop`); :meth:`run` yields its events."""

    def __init__(self, r: Request) -> None:
        self.request = r
        self.model, self.prompt, self.s, self.cancel = r.model, r.prompt, r.s, r.cancel
        self.constraint = r.constraint  # structured output: AR greedy under the grammar (drafts stay free)
        self.max_new, self.limit_reason, self.hooks, self.written = r.max_new, r.limit_reason, r.hooks, r.written
        self.prompt_cache = r.prompt_cache
        self.drafter: Drafter | None = r.drafter
        s = r.s
        self.B, self.mask_id = s.block_size, int(s.mask_token_id)  # type: ignore[arg-type]
        self.device, self.clock, self.channels = loop_start(r)
        self.piece = loop_parts.token_pieces(r.tokenizer)
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
        return self.request.cancelled()

    def _finish(self, reason: str) -> Finished:
        return loop_parts.finished(self.generated, self.channels, reason, self.passes, len(self.prompt), self.clock,
                         self.hooks, self.counts)

    def _seen(self, vocab: int) -> tuple[Tensor, Tensor]:
        if self.rep_seen is None or self.out_seen is None:
            self.rep_seen = decoding.seen_mask(self.prompt + self.generated, vocab, self.device)
            self.out_seen = loop_parts.output_seen(self.prompt, self.written, vocab, self.device)
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
        turn = loop_parts.turn_start(prompt, s)
        keep_at = min(self._limit(n_full), turn) // GDN_CHUNK * GDN_CHUNK if pc is not None else 0
        keep = prefill_keep(self.request, cache, cached, keep_at, None)
        ids = torch.tensor(prompt[cached:n_full], dtype=torch.long, device=self.device)
        out = yield from loop_parts.prefill(self.model, ids, cache, None, self.cancel, at=cached, keep=keep)  # [1, V]
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
                ids = torch.tensor(block, dtype=torch.long, device=self.device)
                row = loop_parts.forward(self.model, ids, pos0, cache, block_size=None, write_cache=True,
                                         last_only=True)[-1]  # [V]
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
        still = [t == self.mask_id for t in block] + [True] * (B - a)  # the slots of x that are masks
        raw: Tensor | None = None  # [B, V] the last pass's logits (engine.decode.diffusion.pass_logits)
        if hooks is not None and hooks.begin_block is not None:
            hooks.begin_block()
        try:
            while True:
                if self._cancelled():
                    return None
                raw = pass_logits(self.model, x, pos0, cache, still, self.s.shift_logits, raw)  # [B, V]
                self.passes += 1
                self.counts["draft_passes"] += 1
                n += 1
                logits = decoding.shift_logits(raw, self.prev_row) if self.s.shift_logits else raw
                seen = self._seen(logits.shape[-1])
                x, conf, shown, commit = denoise_policy(
                    logits, x, conf, self.s, start=a, seen=seen, n_at_entry=n_at_entry,
                    thinking_at_entry=thinking_at_entry, still=still,
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
        rows = loop_parts.forward(self.model, ids, pos0, cache, block_size=None, write_cache=True)  # [B, V]
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
