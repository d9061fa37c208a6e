"""The tiny quantized Clover model the expert-streaming tests share (``test_offload``, ``test_device_pool``,
``test_cpu_experts``): its shape, an all-resident reference copy, the decode settings, the greedy tokens with the
engine's block hooks, and two checks: AR steps that read nothing on the host, an AR step that traces as one graph."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from clover_desk.engine.decode.events import Finished
from clover_desk.engine.decode.generate import generate
from clover_desk.engine.decode.loop_parts import LoopHooks
from clover_desk.engine.decode.settings import DecodeSettings
from clover_desk.engine.model.clover import CloverModel
from clover_desk.engine.model.config import CloverConfig, parse_config
from clover_desk.engine.placement import offload_runtime
from clover_desk.engine.weights.checkpoint import random_state_dict
from clover_desk.engine.weights.quant import make_policy, quantize_model_
from clover_desk.engine.weights.tiny import config_dict_for, tiny_text_config

# the accounting's counters of fetching on the host: a forward that reads its experts another way leaves them as they were
FETCH_COUNTERS = ("host_reads", "h2d_bytes", "slot_hits", "slot_misses", "prefetched")
MASK = 3
SPECIAL = {"<|endoftext|>": 1, "<|im_end|>": 2, "<|mask|>": MASK, "</think>": 4}
LAYERS, EXPERTS, TOPK = 4, 16, 4
PROMPT = [5, 17, 33, 9, 60, 61, 2, 40]


def tiny_config() -> CloverConfig:
    text = tiny_text_config(vocab_size=128, layers=LAYERS, hidden=64, experts=EXPERTS, experts_per_tok=TOPK)
    return parse_config(config_dict_for("clover_moe", text, SPECIAL))


def quantized_model() -> CloverModel:
    """All-resident quantized reference model (experts NF4, projections INT8)."""
    cfg = tiny_config()
    model = CloverModel(cfg, dtype=torch.float32, device="cpu")
    model.load_state_dict(random_state_dict(cfg, seed=7), strict=True)
    quantize_model_(model, make_policy())
    model.eval()
    return model


def settings(mode: str, n: int) -> DecodeSettings:
    # threshold 0.08: this random model's confidences are low, so blocks take ~10 passes (reuse is exercised)
    return DecodeSettings(mode=mode, max_new_tokens=n, mask_token_id=MASK, eos_token_ids=(), block_size=32,
                          threshold=0.08, max_positions=256)


def tokens(model: CloverModel, mode: str, n: int) -> tuple[int, ...]:
    """Greedy tokens, with the block hooks the engine passes (offload sees block boundaries only through them)."""
    hooks = LoopHooks(begin_block=lambda: offload_runtime.begin_block(model),
                      end_block=lambda: offload_runtime.end_block(model))
    fin = list(generate(model, PROMPT, settings(mode, n), hooks=hooks))[-1]
    assert isinstance(fin, Finished)
    return fin.token_ids


def ar_steps_counting_host_reads(model: CloverModel, cache: Any, positions: range,
                                 monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """One AR step (one token) at each of ``positions``, with every ``Tensor.cpu`` call counted from the first step
    on: the shapes read back to the host, in a list that keeps filling for the rest of the test."""
    reads: list[tuple[int, ...]] = []
    plain = torch.Tensor.cpu

    def counted(t: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        reads.append(tuple(t.shape))
        return plain(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counted)
    for pos in positions:
        model(torch.tensor([pos]), pos, cache)
    return reads


def assert_fetched_nothing(before: dict[str, Any], after: dict[str, Any]) -> None:
    """Between two accountings no forward fetched on the host: no host read, no copy, no slot look-up, no prefetch."""
    for key in FETCH_COUNTERS:
        assert after[key] == before[key], key


def assert_one_graph(step: Callable[[torch.Tensor], torch.Tensor], tok: torch.Tensor) -> None:
    """The compiler's proof that ``step`` reads nothing on the host: traced, it is one graph with no break, and
    compiled whole it gives the eager numbers (another summation order: 1e-5)."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(tok)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [
        str(b.reason)[:200] for b in explained.break_reasons
    ]
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    assert (compiled(tok) - step(tok)).abs().max() < 1e-5
