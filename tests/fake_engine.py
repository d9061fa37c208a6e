"""A scripted stand-in for ``engine.api.Engine`` (same ``load`` / ``generate`` signatures), for worker tests.

Selected only by the worker's explicit ``--engine-factory tests.fake_engine:make`` flag. It produces on demand the
failures a tiny real model cannot: an out-of-memory during loading or generation, an unexpected bug, a slow load.

``model_dir`` picks the load behaviour: ends with ``fail`` (CheckpointError), ``oom`` (OutOfMemoryError), ``slow``
(progress until cancelled), anything else loads at once. The last user message picks the generation behaviour:
``prompt-error``, ``oom``, ``bug``, ``endless`` (blocks until cancelled); anything else: two blocks then Finished.
``read_chat`` reads a chat in segments (``PASS_S`` each): 3, or until cancelled when its last message is ``endless``;
``prompt-error`` is refused, ``bug`` raises.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from clover_desk.engine.decode.events import (
    BlockCommitted,
    BlockStep,
    Event,
    Finished,
    GenerationParams,
    LoadProgress,
    PromptInfo,
    TextDelta,
)
from clover_desk.engine.errors import CancelledError, CheckpointError, PromptError

BLOCK = 4
PASS_S = 0.02


class OutOfMemoryError(RuntimeError):
    """Named like ``torch.cuda.OutOfMemoryError`` so the worker classifies it the same way."""


@dataclass(frozen=True)
class FakeConfig:
    model_type: str = "fake"
    vocab_size: int = 16
    block_size: int = BLOCK


def make(
    model_dir: str,
    *,
    device: str = "cpu",
    precision: str | None = None,
    placement: dict | None = None,
    dtype: str = "float32",
    progress: Callable[[LoadProgress], None] | None = None,
    cancel: threading.Event | None = None,
    compile: bool = False,
    ctx_tokens: int | None = None,  # the context a load without a plan holds requests to (the app sends it)
    gpu_paths: Any = None,  # the worker's engine.settings.GpuPaths (every load gets it)
) -> FakeEngine:
    total = 1000
    if model_dir.endswith("fail"):
        raise CheckpointError(f"{model_dir}/model.safetensors: tensor lm_head.weight is missing")
    if model_dir.endswith("oom"):
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    steps = 10**6 if model_dir.endswith("slow") else 4
    for i in range(steps):
        if cancel is not None and cancel.is_set():
            raise CancelledError("loading was cancelled")
        if progress is not None:
            progress(LoadProgress("reading", min(i * 10, total), total, current=f"shard-{i}"))
        time.sleep(PASS_S)
    if progress is not None:
        progress(LoadProgress("done", total, total))
    return FakeEngine(compile)


class FakeEngine:
    config = FakeConfig()
    generation_defaults = None

    def __init__(self, compiled: bool = False) -> None:
        self.compiled = compiled  # as asked (the real engine compiles and warms up its layers)

    def generate(
        self,
        messages: list[dict[str, Any]] | None = None,
        prompt: str | None = None,
        prompt_ids: list[int] | None = None,
        raw: bool = False,
        tools: list[dict[str, Any]] | None = None,
        params: GenerationParams = GenerationParams(),
        cancel: threading.Event | None = None,
    ) -> Iterator[Event]:
        text = (messages or [{"content": prompt or ""}])[-1]["content"]
        if text == "prompt-error":
            raise PromptError("the prompt is empty")
        return self._blocks(text, params, cancel)

    def _blocks(self, text: str, params: GenerationParams, cancel: threading.Event | None) -> Iterator[Event]:
        yield PromptInfo(prompt_tokens=3, block_size=BLOCK, first_block=0, tail=3)
        blocks = 10**6 if text == "endless" else 2
        answer: list[str] = []
        passes = 0
        for b in range(blocks):
            for p in range(BLOCK):
                if cancel is not None and cancel.is_set():
                    yield self._finished(answer, passes, "cancelled")
                    return
                time.sleep(PASS_S)
                passes += 1
                masked = tuple(i > p for i in range(BLOCK))
                yield BlockStep(b, p, tuple(range(BLOCK)), tuple("w" for _ in range(BLOCK)), masked,
                                tuple(0.5 for _ in range(BLOCK)), tuple(i == p for i in range(BLOCK)))
            if text == "oom" and b == 0:
                raise OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
            if text == "bug":
                raise ValueError("scripted bug")
            answer.append(f"b{b} ")
            yield TextDelta(f"b{b} ")
            yield BlockCommitted(b, BLOCK, tuple(range(BLOCK)))
        yield self._finished(answer, passes, "max_new_tokens")
        if text == "linger":
            time.sleep(0.5)  # past its final record, the generation still holds the engine a moment (a cache's tidy-up)

    def read_chat(self, messages: list[dict[str, Any]], params: GenerationParams = GenerationParams(),
                  tools: Any = None, cancel: threading.Event | None = None) -> Iterator[Event]:
        text = messages[-1]["content"]
        if text == "prompt-error":
            raise PromptError("prompt is 9000 tokens; the context holds 4096 positions")
        return self._read(text, cancel)

    def _read(self, text: str, cancel: threading.Event | None) -> Iterator[Event]:
        yield PromptInfo(prompt_tokens=12, block_size=BLOCK, first_block=3, tail=0)
        for _ in range(10**6 if text == "endless" else 3):
            if cancel is not None and cancel.is_set():
                yield self._finished([], 0, "cancelled")
                return
            if text == "bug":
                raise ValueError("scripted bug")
            time.sleep(PASS_S)
        yield self._finished([], 0, "prefilled")

    @staticmethod
    def _finished(answer: list[str], passes: int, reason: str) -> Finished:
        return Finished(
            token_ids=(), text="".join(answer), thinking="", stop_reason=reason, tokens=len(answer) * BLOCK,
            passes=passes, tokens_per_pass=1.0, tokens_per_s=1.0, time_to_first_token_s=None, prompt_tokens=3,
            prefill_s=0.0, decode_s=0.0,
        )
