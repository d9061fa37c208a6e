"""What one request decodes with: :class:`DecodeSettings`, the caller's
:class:`~engine.decode.events.GenerationParams` merged over the model's generation defaults and config
(:func:`resolve_settings`). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clover_desk.engine.decode.events import MODES, GenerationParams
from clover_desk.engine.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_THRESHOLD
from clover_desk.engine.errors import PromptError
from clover_desk.engine.model.config import CloverConfig, GenerationDefaults

# the length penalty's and the think-end bias's ramps: generation_config.json's dllm_<name> fields
# (GenerationDefaults), as they are
RAMPS = ("length_penalty", "length_penalty_start", "length_penalty_window",
         "think_end_bias", "think_end_bias_start", "think_end_bias_window")


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
        shift_logits=config.shift_logits,
        max_positions=config.max_position_embeddings,
        structured=params.structured,
        **{name: getattr(defaults, f"dllm_{name}") for name in RAMPS},
    )
