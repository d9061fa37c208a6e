"""Events the engine emits while generating or loading.

Frozen stdlib dataclasses only (no torch): the UI, the CLI's ``--json`` output and the engine worker process all
speak these. ``to_dict`` / ``from_dict`` give a JSON-safe round trip, tagged by ``"event"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The decoding modes (GenerationParams.mode): block diffusion, autoregressive, and self-speculative (diffusion
# drafts, one causal pass verifies: AR greedy's tokens).
MODES = ("diffusion", "ar", "spec")


@dataclass(frozen=True)
class GenerationParams:
    """What the caller asks for. ``None`` means: take the model's generation_config.json default."""

    mode: str = "diffusion"  # "diffusion" | "ar" | "spec" (self-speculative: AR greedy's tokens, drafted by diffusion)
    max_new_tokens: int | None = None
    temperature: float | None = None  # 0 or None with do_sample False = greedy
    top_p: float | None = None
    top_k: int | None = None
    do_sample: bool | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    block_size: int | None = None
    threshold: float | None = None
    enable_thinking: bool = True
    seed: int | None = None
    # Go on with the last message (an assistant answer cut short) instead of starting a new answer; only with
    # ``messages`` (engine.decode.tokenizer.CloverTokenizer.continuation_prompt). vLLM's request field of the same name.
    continue_final_message: bool = False
    # Structured output: the answer must follow a grammar (a JSON text made by
    # engine.decode.grammar.structured_spec: before, one JSON value a schema accepts, after). None: free text.
    structured: str | None = None


# The stages of a compiled load after its weights are read (``Engine.load(compile=True)``): one short generation per
# decoding mode, which compiles that mode's passes (``current`` says what runs), or a notice that compiling cannot
# work on this machine (``current`` says why: engine.kernels.fastpath.unavailable). ``total_bytes`` is 0 in these: their
# length is not known beforehand.
COMPILE_STAGES = ("compiling-ar", "compiling-diffusion", "compile-skipped")


@dataclass(frozen=True)
class LoadProgress:
    """Loading / quantizing progress. ``total_bytes`` 0 means unknown."""

    stage: str  # "reading" | "quantizing" | "writing-cache" | "placing" | "done" | one of COMPILE_STAGES
    done_bytes: int
    total_bytes: int
    current: str = ""  # current file or tensor name
    eta_s: float | None = None


@dataclass(frozen=True)
class PromptInfo:
    """Sent once before decoding: how the prompt was laid out."""

    prompt_tokens: int
    block_size: int
    first_block: int  # index of the first block that holds generated slots (blocks are aligned to position 0)
    tail: int  # prompt tokens that sit inside that first block
    cached_tokens: int = 0  # the prompt's first tokens the last request had read already (engine.decode.prompt_cache.PromptCache)


@dataclass(frozen=True)
class PrefillProgress:
    """How far a long prompt's prefill has got. A prompt longer than the model's longest single pass is read in
    segments (``CloverModel.max_pass_tokens``); one event goes out before the first and after each segment, and the
    cancel flag is checked between segments. ``done`` and ``total`` count prompt tokens written to the cache."""

    done: int
    total: int


@dataclass(frozen=True)
class BlockStep:
    """One denoising pass over the current block (diffusion and spec modes).

    ``tokens`` are the slot token ids (mask id where still masked), ``texts`` their decoded pieces,
    ``masked`` which slots are still masked after this pass, ``confidence`` the model's confidence for each slot
    (for committed-earlier slots the confidence they were committed with), ``committed_now`` the slots committed
    by this pass. Prompt-tail slots count as committed earlier with confidence 1.

    Spec mode (self-speculative) sends these for its drafting passes, and one for each verify pass with
    ``verdict`` set, one entry per slot: "accepted" (a drafted token AR greedy writes there too), "verifier" (the
    verify pass's own token: where the first draft was wrong, or the next block's first slot, not in this block),
    "rejected" (drafted after the first wrong one: drafted again), "" (committed before this verify). ``tokens``
    are then the drafted ones with the verifier's token in its slot, and ``committed_now`` the accepted slots and
    the verifier's.
    """

    block_index: int
    pass_index: int  # 0-based within the block
    tokens: tuple[int, ...]
    texts: tuple[str, ...]
    masked: tuple[bool, ...]
    confidence: tuple[float, ...]
    committed_now: tuple[bool, ...]
    prompt_slots: int = 0  # leading slots that belong to the prompt tail
    verdict: tuple[str, ...] = ()  # spec mode's verify pass (see above); () for a denoising / drafting pass


@dataclass(frozen=True)
class BlockCommitted:
    """A block is final (its commit pass ran): what it added to the output."""

    block_index: int
    passes: int
    token_ids: tuple[int, ...]  # generated ids this block added (prompt tail excluded, truncated at EOS)


@dataclass(frozen=True)
class TextDelta:
    """Committed text, never retracted. ``channel`` is "thinking" or "answer"."""

    text: str
    channel: str = "answer"


@dataclass(frozen=True)
class TokenLogprobs:
    """The log probabilities of tokens just committed, sent right before their :class:`TextDelta` (and before
    :class:`Finished` for tokens that are not text), only when the request asked for them
    (``Engine.generate(logprobs=N)``; without it the loops compute nothing of this).

    Each token's value is the natural log of its probability under the distribution it was committed from: the
    model's own (the raw logits, fp32 ``log_softmax``: before the penalties, the biases, the temperature and the
    top-k / top-p filters). AR: the causal row before the token; spec mode: the verify pass's causal row (the same
    row AR greedy reads); diffusion: the token's slot at the pass that committed it. ``channels`` says where each
    token went: "thinking", "answer", "marker" (``<think>`` / ``</think>``) or "eos". ``top`` alternatives per token
    (best first) are flattened into ``top_ids`` / ``top_logprobs`` (``top`` entries per token), so the
    event stays a flat JSON object."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    channels: tuple[str, ...]
    top: int = 0
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def alternatives(self, i: int) -> list[tuple[int, float]]:
        """Token ``i``'s ``top`` alternatives as (id, log probability), best first."""
        span = slice(i * self.top, (i + 1) * self.top)
        return list(zip(self.top_ids[span], self.top_logprobs[span]))


@dataclass(frozen=True)
class Finished:
    """Last event of a generation."""

    token_ids: tuple[int, ...]
    text: str  # the answer (thinking excluded)
    thinking: str
    stop_reason: str  # "eos" | "max_new_tokens" | "context" | "cancelled"
    tokens: int
    passes: int  # model forwards spent decoding (denoise + commit passes, AR steps, or drafting + verify passes)
    tokens_per_pass: float
    tokens_per_s: float
    time_to_first_token_s: float | None
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    accounting: dict[str, Any] = field(default_factory=dict)  # expert streaming statistics, when offloading
    cached_tokens: int = 0  # of prompt_tokens, those read from the prompt cache instead of prefilled
    forwards_per_token: float = 0.0  # passes / tokens (AR: about 1)
    # spec mode: causal verify passes, and drafted tokens each accepted on average (the verifier's own next token,
    # which every verify pass adds as well, not counted)
    verify_passes: int = 0
    accepted_per_verify: float = 0.0
    # spec mode's counts: draft_passes, verify_passes, drafted, accepted, full_accepts (every drafted slot right),
    # partial_accepts (a wrong draft: the states rolled back), catch_ups (a block completed by the verifier's own
    # token in its last slot: one causal pass writes it)
    spec: dict[str, int] = field(default_factory=dict)


def continued_stats(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """The statistics of an answer that was continued (``GenerationParams.continue_final_message``): ``before`` are
    the answer's stored figures, ``after`` those of the generation that went on with it. Counts and times add up
    and the rates follow from the sums; the first token's time and the prompt stay the first generation's; the stop
    reason, the mode and the streaming figures are the latest; ``continued`` counts the continuations."""
    merged = {**before, **after}

    def total(key: str) -> float:
        return float(before.get(key) or 0) + float(after.get(key) or 0)

    tokens, passes, decode_s = int(total("tokens")), int(total("passes")), total("decode_s")
    merged.update(tokens=tokens, passes=passes, decode_s=round(decode_s, 4), prefill_s=round(total("prefill_s"), 4),
                  tokens_per_pass=round(tokens / passes, 3) if passes else 0.0,
                  tokens_per_s=round(tokens / decode_s, 3) if decode_s > 0 else 0.0,
                  continued=int(before.get("continued") or 0) + 1)
    for key in ("time_to_first_token_s", "prompt_tokens"):
        if before.get(key) is not None:
            merged[key] = before[key]
    return merged


@dataclass(frozen=True)
class EngineError:
    """The engine could not continue (sent by the worker process; the CLI raises instead)."""

    kind: str  # class name of the error, e.g. "PromptError", "OutOfMemory"
    message: str


EVENT_TYPES: dict[str, type] = {
    "load_progress": LoadProgress,
    "prompt": PromptInfo,
    "prefill": PrefillProgress,
    "block_step": BlockStep,
    "block_committed": BlockCommitted,
    "delta": TextDelta,
    "logprobs": TokenLogprobs,
    "finished": Finished,
    "error": EngineError,
}
_NAME_OF = {cls: name for name, cls in EVENT_TYPES.items()}

Event = (LoadProgress | PromptInfo | PrefillProgress | BlockStep | BlockCommitted | TextDelta | TokenLogprobs | Finished
         | EngineError)


def to_dict(event: Event) -> dict[str, Any]:
    """A JSON-safe dict with an ``"event"`` tag (tuples become lists)."""
    out: dict[str, Any] = {"event": _NAME_OF[type(event)]}
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def from_dict(data: dict[str, Any]) -> Event:
    """Inverse of :func:`to_dict`. Raises ``ValueError`` naming an unknown event tag."""
    tag = data.get("event")
    cls = EVENT_TYPES.get(tag)  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown event type {tag!r}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            value = data[f.name]
            kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)
