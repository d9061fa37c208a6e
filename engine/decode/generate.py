"""The decoding loops' one entry: :func:`generate` runs a request's loop by its mode, yielding
:mod:`engine.decode.events`.

* :mod:`engine.decode.ar`: prefill the prompt causally, then one token per forward through the cache.
* :mod:`engine.decode.diffusion`: block diffusion with blocks aligned to absolute position 0.
  The whole prompt blocks are prefilled in one block-mode pass that writes the cache; the first generated block
  holds the prompt tail followed by masks; denoising passes read the cache (``write_cache=False``) and commit by
  the threshold rule until the block has no mask; then one commit pass writes the block into the cache.
* :mod:`engine.decode.spec`: self-speculative decoding, diffusion drafts verified by one causal pass.

What a request decodes with is :class:`engine.decode.settings.DecodeSettings`; the pieces the loops share (the
segmented prefill, the penalties, the clock, the Finished event) are in :mod:`engine.decode.loop_parts`, the
text and log probabilities they emit in :mod:`engine.decode.outputs`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from clover_desk.engine.decode.ar import ar_loop
from clover_desk.engine.decode.diffusion import diffusion_loop
from clover_desk.engine.decode.events import Event
from clover_desk.engine.decode.loop_parts import DecodingModel, LoopHooks, Request, TextDecoder, check_request
from clover_desk.engine.decode.prompt_cache import PromptCache, ScopedPromptCache
from clover_desk.engine.decode.settings import DecodeSettings
from clover_desk.engine.decode.spec import Drafter, spec_loop

log = logging.getLogger(__name__)

LOOPS: dict[str, Callable[[Request], Iterator[Event]]] = {"ar": ar_loop, "diffusion": diffusion_loop, "spec": spec_loop}


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
    drafter: Drafter | None = None,
) -> Iterator[Event]:
    """Dispatch on ``s.mode``; request errors (:class:`PromptError`) are raised here, before any event.

    ``written``: the prompt's last ``written`` tokens are the model's own answer so far (an answer being continued,
    ``GenerationParams.continue_final_message``): they count as output for the presence penalty and the length
    and think-end ramps, as they did when it wrote them. ``prompt_cache``: start from what the last request's
    prefill left when this prompt begins with the same tokens, and keep this one's for the next
    (:class:`PromptCache`). ``drafter``: spec mode's drafts from elsewhere than its denoising passes (tests)."""
    request = check_request(model, prompt_ids, s, tokenizer, cancel, vocab_size, hooks, written, prompt_cache, drafter)
    return LOOPS.get(s.mode, ar_loop)(request)


def _in_mode(mode: str) -> Callable[..., Iterator[Event]]:
    def run(model: DecodingModel, prompt_ids: Sequence[int], s: DecodeSettings, *args: Any,
            **kwargs: Any) -> Iterator[Event]:
        return generate(model, prompt_ids, dataclasses.replace(s, mode=mode), *args, **kwargs)

    run.__name__ = run.__qualname__ = f"generate_{mode}"
    run.__doc__ = f":func:`generate` in {mode} mode, whatever ``s.mode`` says."
    return run


generate_ar = _in_mode("ar")
generate_diffusion = _in_mode("diffusion")
generate_spec = _in_mode("spec")
