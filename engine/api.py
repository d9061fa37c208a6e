"""``Engine``: the one entry point the CLI and the worker process use.

    engine = Engine.load(model_dir, device="cpu", dtype="float32")
    for event in engine.generate(messages=[{"role": "user", "content": "hi"}], params=GenerationParams()):
        ...

``generate`` checks the request (prompt, parameters, context room) when it is called and raises
:class:`~engine.errors.PromptError` at once; it then returns an iterator of :mod:`engine.events`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.config import CloverConfig, GenerationDefaults, load_config, load_generation_defaults
from engine.errors import ConfigError, PromptError
from engine.events import Event, GenerationParams, LoadProgress
from engine.generate import LoopHooks, generate, resolve_settings
from engine.tokenizer import CloverTokenizer

log = logging.getLogger(__name__)

DEFAULT_PLAN_CTX = 16_384  # context a VRAM plan reserves KV cache for when the caller does not say

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


class Engine:
    """A loaded model with its tokenizer and generation defaults."""

    def __init__(
        self,
        model: Any,
        config: CloverConfig,
        generation_defaults: GenerationDefaults,
        tokenizer: CloverTokenizer | None,
        model_dir: Path | None = None,
        plan: Any = None,
        hooks: LoopHooks | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.generation_defaults = generation_defaults
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.plan = plan
        self._hooks = hooks

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: str | torch.dtype = "float32",
        vram_gb: float | None = None,
        progress: Callable[[LoadProgress], None] | None = None,
        cancel: threading.Event | None = None,
        ctx_tokens: int | None = None,
    ) -> "Engine":
        """Read a model folder (config, generation config, tokenizer, weights) onto ``device``.

        ``vram_gb``: place the model under a VRAM budget with :mod:`engine.offload` (expert streaming), planned for
        ``ctx_tokens`` of context (default 16,384); requests are then held to that context, since the KV cache and
        the prefill scratch were sized for it.
        """
        folder = Path(model_dir)
        if not folder.is_dir():
            raise ConfigError(f"{folder}: model folder not found")
        config = load_config(folder)
        defaults = load_generation_defaults(folder, config)
        tokenizer = CloverTokenizer.from_dir(folder)
        if tokenizer.vocab_size > config.vocab_size:
            raise ConfigError(
                f"{folder / 'tokenizer.json'}: {tokenizer.vocab_size} tokens, more than config.json's vocab_size "
                f"{config.vocab_size}"
            )
        torch_dtype = parse_dtype(dtype)
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} was asked for, but CUDA is not available here")
        from engine.checkpoint import load_model

        plan = None
        hooks = None
        if vram_gb is None:
            model = load_model(
                folder, dtype=torch_dtype, device=device, progress=progress, cancel=cancel, config=config
            )
        else:
            # Under a budget the model is quantized (through the on-disk cache) in host memory, then placed.
            import psutil

            from engine import offload, quant_cache

            model, report = quant_cache.load_quantized(folder, dtype=torch_dtype, progress=progress, cancel=cancel)
            log.info("quantized cache %s (%s)", report.path, "rebuilt" if report.rebuilt else "reused")
            ctx = int(ctx_tokens or DEFAULT_PLAN_CTX)
            plan = offload.plan_for_model(model, float(vram_gb), ctx_tokens=ctx, ram_bytes=psutil.virtual_memory().available)
            # The plan keeps the embedding table in system RAM (only the looked-up rows go to the device).
            offload.apply_plan(model, plan, device, host_embedding=True)
            if plan.prefill_chunk_tokens:
                model.max_pass_tokens = plan.prefill_chunk_tokens  # the planned attention scratch
            hooks = LoopHooks(
                begin_block=lambda: offload.begin_block(model),
                end_block=lambda: offload.end_block(model),
                accounting=lambda: offload.accounting(model),
            )
        log.info(
            "loaded %s (%s, %d layers) on %s as %s", folder, config.model_type, config.num_hidden_layers, device, dtype
        )
        return cls(model, config, defaults, tokenizer, folder, plan, hooks)

    # ---- prompts ----
    def prompt_ids(
        self,
        messages: Sequence[dict[str, Any]] | None = None,
        prompt: str | None = None,
        prompt_ids: Sequence[int] | None = None,
        raw: bool = False,
        tools: Sequence[dict[str, Any]] | None = None,
        enable_thinking: bool = True,
    ) -> list[int]:
        """The token ids a request decodes from. ``raw`` sends ``prompt`` as is (no chat template)."""
        sources = (("messages", messages), ("prompt", prompt), ("prompt_ids", prompt_ids))
        given = [name for name, value in sources if value is not None]
        if len(given) != 1:
            raise PromptError(f"give exactly one of messages, prompt, prompt_ids (got {', '.join(given) or 'none'})")
        if prompt_ids is not None:
            try:
                ids = [int(i) for i in prompt_ids]
            except (TypeError, ValueError):
                raise PromptError("prompt_ids must be a list of integers") from None
        else:
            if prompt is not None and not prompt.strip():
                raise PromptError("empty prompt: nothing to generate from")
            if self.tokenizer is None:
                raise PromptError("this engine has no tokenizer: give prompt_ids")
            if prompt is not None and raw:
                ids = self.tokenizer.encode(prompt)
            else:
                chat = [{"role": "user", "content": prompt}] if prompt is not None else list(messages or [])
                ids = self.tokenizer.encode_chat(chat, tools=tools, enable_thinking=enable_thinking)
        if not ids:
            raise PromptError("empty prompt: nothing to generate from")
        return ids

    # ---- generation ----
    def generate(
        self,
        messages: Sequence[dict[str, Any]] | None = None,
        prompt: str | None = None,
        prompt_ids: Sequence[int] | None = None,
        raw: bool = False,
        tools: Sequence[dict[str, Any]] | None = None,
        params: GenerationParams | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[Event]:
        """Check the request now (PromptError), then return the event iterator (PromptInfo ... Finished)."""
        params = params or GenerationParams()
        ids = self.prompt_ids(messages, prompt, prompt_ids, raw, tools, params.enable_thinking)
        settings = resolve_settings(params, self.generation_defaults, self.config, self.tokenizer)
        planned_ctx = getattr(self.plan, "ctx_tokens", 0)
        if planned_ctx:
            settings = dataclasses.replace(settings, max_positions=min(settings.max_positions, planned_ctx))
        return generate(
            self.model, ids, settings, self.tokenizer, cancel, vocab_size=self.config.vocab_size, hooks=self._hooks
        )
