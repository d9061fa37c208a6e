"""Generation settings as the window keeps them (per chat), the model's own defaults, and an answer's statistics.

Plain data, no Qt. The defaults a new chat starts with come from the model folder, never from constants here:
:func:`defaults_from_model` reads what the engine reports with its ``loaded`` answer (``config`` and
``generation_defaults``, i.e. ``engine.model.config.load_config`` / ``load_generation_defaults``) or what the composition
root reads from the folder before the model is loaded (the same two, torch-free).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from clover_desk.engine.decode.events import Finished, GenerationParams
from clover_desk.engine.decode.limits import GENERATION_LIMITS
from clover_desk.engine.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_THRESHOLD

log = logging.getLogger(__name__)

MAX_TOKENS_LIMIT = 32_768  # the drawer's range; a model default above it is shown as this


@dataclass(frozen=True)
class GenerationSettings:
    """What the settings drawer edits; stored per conversation (``Conversation.settings``).

    The field defaults are only a fallback for a model that says nothing (no config read yet)."""

    mode: str = "diffusion"  # "diffusion" | "ar" | "spec" (greedy: the temperature is not sent)
    temperature: float = 0.0
    block_size: int = DEFAULT_BLOCK_SIZE
    threshold: float = DEFAULT_THRESHOLD  # commit every masked slot whose confidence is strictly above this
    max_new_tokens: int = 1024
    enable_thinking: bool = True
    expand_thinking: bool = False  # display only: show the thinking section open by default
    top_p: float = 1.0  # sampling only (temperature > 0): the smallest set of tokens reaching this probability
    top_k: int = 0  # sampling only: the k likeliest tokens (0: off)
    presence_penalty: float = 0.0  # subtracted from the logit of every token the answer already holds
    repetition_penalty: float = 1.0  # divides (multiplies, if negative) the logits of tokens seen (prompt + answer)
    seed: int | None = None  # sampling only: the same seed, the same answer; None: a new one per answer
    context_length: int = 0  # the most tokens of this chat the model reads (0: the loaded model's context)

    def to_params(self) -> GenerationParams:
        sampling = self.mode != "spec" and self.temperature > 0  # spec mode is greedy
        return GenerationParams(
            mode=self.mode,
            max_new_tokens=self.max_new_tokens,
            temperature=0.0 if self.mode == "spec" else self.temperature,
            do_sample=sampling,
            block_size=self.block_size if self.mode in ("diffusion", "spec") else None,
            threshold=self.threshold if self.mode in ("diffusion", "spec") else None,
            enable_thinking=self.enable_thinking,
            top_p=self.top_p if sampling else None,
            top_k=self.top_k if sampling else None,
            seed=self.seed if sampling else None,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, defaults: GenerationSettings | None = None) -> GenerationSettings:
        """A chat's saved settings over ``defaults`` (the model's) for any key it lacks."""
        base = defaults or cls()
        known = {k: v for k, v in (data or {}).items() if k in asdict(base)}
        try:
            return replace(base, **known)
        except TypeError:
            log.warning("ignoring malformed conversation settings %r", data)
            return base


def defaults_from_model(config: Mapping[str, Any] | None, generation: Mapping[str, Any] | None) -> GenerationSettings:
    """The settings a new chat starts with for this model.

    ``config``: ``CloverConfig`` as a dict (``is_diffusion``, ``block_size``, ``threshold``); ``generation``:
    ``GenerationDefaults`` as a dict (``do_sample``, ``temperature``, ``max_new_tokens``). Missing keys keep the
    fallbacks of :class:`GenerationSettings`."""
    base = GenerationSettings()
    config = config or {}
    generation = generation or {}
    values: dict[str, Any] = {}
    if "is_diffusion" in config:
        values["mode"] = "diffusion" if config["is_diffusion"] else "ar"
    if isinstance(config.get("block_size"), int) and config["block_size"] > 0:
        values["block_size"] = int(config["block_size"])
    if isinstance(config.get("threshold"), (int, float)):
        values["threshold"] = float(config["threshold"])
    if "do_sample" in generation or "temperature" in generation:
        sampling = bool(generation.get("do_sample")) and float(generation.get("temperature") or 0) > 0
        values["temperature"] = round(float(generation.get("temperature") or 0), 2) if sampling else 0.0
    if isinstance(generation.get("max_new_tokens"), int) and generation["max_new_tokens"] > 0:
        values["max_new_tokens"] = min(int(generation["max_new_tokens"]), MAX_TOKENS_LIMIT)
    for key in ("top_p", "top_k", "presence_penalty", "repetition_penalty"):  # the model's own, when it has one
        value = generation.get(key)
        if GENERATION_LIMITS[key].accepts(value):
            values[key] = value if key == "top_k" else float(value)
    return replace(base, **values)


def finished_stats(event: Finished, mode: str) -> dict[str, Any]:
    """The per-message statistics kept with an answer (shown under it, exported with it)."""
    stats: dict[str, Any] = {
        "mode": mode,
        "tokens": event.tokens,
        "passes": event.passes,
        "tokens_per_pass": round(event.tokens_per_pass, 3),
        "tokens_per_s": round(event.tokens_per_s, 3),
        "time_to_first_token_s": event.time_to_first_token_s,
        "prompt_tokens": event.prompt_tokens,
        "cached_tokens": event.cached_tokens,
        "prefill_s": round(event.prefill_s, 4),
        "decode_s": round(event.decode_s, 4),
        "stop_reason": event.stop_reason,
    }
    if mode == "spec":
        stats.update(verify_passes=event.verify_passes, accepted_per_verify=round(event.accepted_per_verify, 3),
                     forwards_per_token=round(event.forwards_per_token, 3))
    rate = expert_hit_rate(event.accounting)
    if rate is not None:
        stats["expert_hit_rate"] = rate
    return stats


def expert_hit_rate(accounting: dict[str, Any] | None) -> float | None:
    """Expert slot-pool hit rate from ``Finished.accounting`` (engine.placement.offload_runtime: ``hit_rate``, ``slot_hits`` /
    ``slot_misses``), or None when nothing was streamed."""
    if not accounting:
        return None
    hits = accounting.get("slot_hits", accounting.get("hits"))
    misses = accounting.get("slot_misses", accounting.get("misses"))
    if isinstance(hits, (int, float)) and isinstance(misses, (int, float)) and hits + misses == 0:
        return None  # nothing was looked up in the slot pool (every expert resident): no rate to show
    for key in ("hit_rate", "expert_hit_rate", "cache_hit_rate"):
        if isinstance(accounting.get(key), (int, float)):
            return float(accounting[key])
    if isinstance(hits, (int, float)) and isinstance(misses, (int, float)) and hits + misses > 0:
        return float(hits) / float(hits + misses)
    return None


def export_file_name(title: str, fmt: str) -> str:
    """A file name for an exported chat: the title as lower-case words joined by hyphens, "hello-who-are-you.md"
    (letters and digits of any script kept; nothing a file system or a shell minds), "chat.md" for an empty one."""
    words, word = [], []
    for ch in title.lower():
        if ch.isalnum():
            word.append(ch)
        elif word:
            words.append("".join(word))
            word = []
    if word:
        words.append("".join(word))
    stem = ""
    for w in words:  # at most ~60 characters, cut at a word
        if stem and len(stem) + 1 + len(w) > 60:
            break
        stem = f"{stem}-{w}" if stem else w[:60]
    return f"{stem or 'chat'}{'.md' if fmt == 'markdown' else '.json'}"
