"""Decoding policy as pure functions on tensors: penalties, soft biases, the commit rule, sampling, EOS cut.

Nothing here knows about a model, a cache or a tokenizer; every function takes tensors (and plain numbers) and
returns tensors, so each rule is unit-tested on scripted logits. None of them reads a device value back to the
host (no ``.item()``, ``bool(tensor)``, ``nonzero()`` or data-dependent shape): on a GPU the whole policy of a
denoising pass queues behind the forward, and the loop reads the outcome once (``tests/engine/test_compile.py`` traces it
as one graph).

Legend: T = slots (block positions, or 1 for an AR step), V = vocabulary, E = experts, K = experts per token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------------------------
# penalties and biases


def seen_mask(token_ids: Iterable[int], vocab_size: int, device: torch.device | str = "cpu") -> Tensor:
    """Bool vector [V]: True for every id in ``token_ids`` (ids outside the vocabulary are ignored)."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    ids = [i for i in token_ids if 0 <= i < vocab_size]
    if ids:
        mask[torch.tensor(ids, dtype=torch.long, device=device)] = True
    return mask


def seen_mask_of(token_ids: Tensor, vocab_size: int, skip_id: int | None = None) -> Tensor:
    """Bool vector [V]: True for every id in the device tensor ``token_ids`` [N], ``skip_id`` (the mask) excluded;
    no host read."""
    ids = token_ids.long()
    if skip_id is not None:
        ids = torch.where(ids == skip_id, vocab_size, ids)  # parked on an extra slot, dropped below
    ids = ids.clamp(0, vocab_size)
    mask = torch.zeros(vocab_size + 1, dtype=torch.bool, device=token_ids.device)
    return mask.index_fill(0, ids, True)[:vocab_size]


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL-style repetition penalty on the ids marked in ``seen`` [V] (prompt and output so far).

    logits [T, V]: a positive logit is divided by ``penalty``, a negative one multiplied, so both move toward
    "less likely". ``penalty`` 1 is a no-op.
    """
    if penalty == 1.0:
        return logits
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)  # [T, V]
    return torch.where(seen.unsqueeze(0), scaled, logits)


def apply_presence_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """Subtract ``penalty`` from the logits of every id already generated (``seen`` [V]); logits [T, V]."""
    if penalty == 0.0:
        return logits
    return logits - penalty * seen.to(logits.dtype).unsqueeze(0)


def ramp(n: int, start: int, window: int) -> float:
    """0 before ``start``, rising linearly to 1 over ``window`` tokens, 1 after (window 0: a step at start)."""
    if window <= 0:
        return 1.0 if n >= start else 0.0
    return min(max((n - start) / window, 0.0), 1.0)


def apply_length_penalty(
    logits: Tensor, masked: Tensor, eos_ids: Sequence[int], strength: float, n_generated: int, start: int, window: int,
    inplace: bool = False,
) -> Tensor:
    """dllm_length_penalty: add ``strength * ramp(n_generated)`` to the EOS logits at masked slots.

    logits [T, V], masked [T] bool. ``n_generated`` counts committed output tokens at block entry. The bias
    pushes a long answer toward ending; already-committed slots are untouched. ``inplace``: the caller owns
    ``logits`` and lets it be changed (no [T, V] copy).
    """
    bias = strength * ramp(n_generated, start, window)
    ids = sorted({i for i in eos_ids if 0 <= i < logits.shape[-1]})
    if bias == 0.0 or not ids:
        return logits
    out = logits if inplace else logits.clone()
    add = bias * masked.to(logits.dtype).unsqueeze(1)  # [T, 1]: the bias on masked rows, 0 elsewhere
    out[:, ids] = out[:, ids] + add
    return out


def apply_think_end_bias(
    logits: Tensor,
    masked: Tensor,
    think_end_id: int | None,
    strength: float,
    n_generated: int,
    start: int,
    window: int,
    thinking_open: bool | Tensor,
    inplace: bool = False,
) -> Tensor:
    """dllm_think_end_bias: add ``strength * ramp(n_generated)`` to ``</think>`` at the left-most masked slot only.

    Applied only while thinking is open (no ``</think>`` generated yet; a bool, or a 0-d bool tensor on the device).
    One slot only, so a block cannot commit ``</think>`` at several places at once. logits [T, V], masked [T] bool.
    ``inplace`` as in :func:`apply_length_penalty`.
    """
    bias = strength * ramp(n_generated, start, window)
    if bias == 0.0 or thinking_open is False or think_end_id is None:
        return logits
    if not 0 <= think_end_id < logits.shape[-1]:
        return logits
    first = masked.int().argmax()  # the left-most masked slot (argmax returns the first maximum); 0 if none is
    slot = torch.arange(masked.shape[0], device=masked.device) == first  # [T] one-hot
    gate = slot & masked & torch.as_tensor(thinking_open, device=masked.device)  # none if no slot is masked
    out = logits if inplace else logits.clone()
    out[:, think_end_id] = out[:, think_end_id] + bias * gate.to(logits.dtype)
    return out


def forbid_tokens(logits: Tensor, token_ids: Iterable[int], inplace: bool = False) -> Tensor:
    """Set the logits of ``token_ids`` to -inf (e.g. the mask id, which must never be proposed). logits [T, V].
    ``inplace`` as in :func:`apply_length_penalty`."""
    ids = [i for i in token_ids if i is not None and 0 <= i < logits.shape[-1]]
    if not ids:
        return logits
    out = logits if inplace else logits.clone()
    out[:, ids] = NEG_INF
    return out


def shift_logits(logits: Tensor, previous_row: Tensor | None) -> Tensor:
    """For models whose row i predicts token i+1: realign so that row i predicts slot i.

    logits [T, V] from a block forward; ``previous_row`` [V] is the last row of the forward before (it predicts
    slot 0). Without one, slot 0 reuses its own row (only reached when slot 0 is never masked).
    """
    first = logits[:1] if previous_row is None else previous_row.reshape(1, -1).to(logits.dtype)  # [1, V]
    return torch.cat([first, logits[:-1]], dim=0)  # [T, V]


# ---------------------------------------------------------------------------------------------------------------
# proposing tokens and committing them


def filter_top_k_top_p(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Keep the ``top_k`` best logits per row and the smallest set whose probability reaches ``top_p``.

    logits [T, V] fp32; filtered entries become -inf. top_k 0 and top_p 1 are no-ops.
    """
    out = logits
    if 0 < top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]  # [T, 1]
        out = out.masked_fill(out < kth, NEG_INF)
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)  # [T, V]
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the best token always stays)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p  # [T, V]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, NEG_INF)
    return out


def propose(
    logits: Tensor,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """One candidate token per row and its confidence.

    logits [T, V] (already penalized) -> (tokens [T] long, confidence [T] fp32). Greedy: argmax, confidence =
    fp32 softmax probability of the argmax. Sampling: temperature, then top-k / top-p, then a draw with
    ``generator``; confidence = the drawn token's probability under that filtered distribution.
    """
    x = logits.float()  # [T, V]
    if not do_sample or temperature <= 0.0:
        probs = torch.softmax(x, dim=-1)
        conf, tokens = probs.max(dim=-1)  # [T], [T]
        return tokens, conf
    x = filter_top_k_top_p(x / temperature, top_k, top_p)
    probs = torch.softmax(x, dim=-1)  # [T, V]
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # [T]
    conf = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [T]
    return tokens, conf


def threshold_commit(confidence: Tensor, masked: Tensor, threshold: float) -> Tensor:
    """The LowConfidence commit rule: which masked slots to commit this pass.

    confidence [T] fp32, masked [T] bool -> commit [T] bool. Every masked slot with confidence strictly above
    ``threshold``; if none, the single most confident masked slot (so every pass commits at least one).
    """
    conf = torch.where(masked, confidence.float(), torch.full_like(confidence, NEG_INF, dtype=torch.float32))
    commit = conf > threshold  # -inf never passes
    best = torch.arange(masked.shape[0], device=masked.device) == conf.argmax()  # [T] one-hot
    fallback = best & masked & ~commit.any()  # nothing passed: the single most confident masked slot
    return commit | fallback


def thinking_open_in(slot_tokens: Tensor, at_entry: bool, think_start_id: int | None, think_end_id: int | None) -> Tensor:
    """Thinking state (0-d bool tensor) after the committed ``slot_tokens`` [N] read left to right: the last
    ``<think>`` or ``</think>`` among them decides, none keeps ``at_entry``."""
    device = slot_tokens.device
    entry = torch.tensor(at_entry, device=device)
    if slot_tokens.shape[0] == 0:
        return entry
    no = torch.zeros_like(slot_tokens, dtype=torch.bool)
    opens = slot_tokens == think_start_id if think_start_id is not None else no
    closes = slot_tokens == think_end_id if think_end_id is not None else no
    index = torch.arange(slot_tokens.shape[0], device=device)
    last = torch.where(opens | closes, index, -1).amax()  # -1: neither occurs
    return torch.where(last < 0, entry, opens.gather(0, last.clamp(min=0).view(1))[0])


def output_limit(tokens: Tensor, start: int, needed: int, eos_ids: Sequence[int]) -> Tensor:
    """End of the slots that can still be output (0-d long tensor): ``needed``, or the first committed EOS in
    ``tokens[start:needed]`` if one comes earlier."""
    index = torch.arange(tokens.shape[0], device=tokens.device)
    is_eos = torch.zeros_like(tokens, dtype=torch.bool)
    for e in sorted(set(eos_ids)):
        is_eos |= tokens == e
    in_range = (index >= start) & (index < needed)
    return torch.where(is_eos & in_range, index, needed).amin()


# ---------------------------------------------------------------------------------------------------------------
# stopping


def truncate_at_eos(token_ids: Sequence[int], eos_ids: Iterable[int]) -> tuple[list[int], bool]:
    """Cut ``token_ids`` after the first EOS (the EOS itself is kept). Returns (ids, whether an EOS was found)."""
    eos = set(eos_ids)
    for i, tok in enumerate(token_ids):
        if tok in eos:
            return list(token_ids[: i + 1]), True
    return list(token_ids), False


def eos_resolved(tokens: Sequence[int], masked: Sequence[bool], first: int, eos_ids: Iterable[int]) -> bool:
    """True when some slot >= ``first`` holds a committed EOS and every slot from ``first`` up to it is committed.

    Then the block's output is final: whatever fills the masks after that EOS is cut anyway.
    """
    eos = set(eos_ids)
    for i in range(first, len(tokens)):
        if masked[i]:
            return False
        if tokens[i] in eos:
            return True
    return False
