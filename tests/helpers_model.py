"""Tiny configs and models for the model / checkpoint / parity tests (no files unless a test writes them)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch

from clover_desk.engine.model.clover import CloverModel
from clover_desk.engine.model.config import CloverConfig, parse_config
from clover_desk.engine.weights.checkpoint import model_from_state_dict, random_state_dict

BLOCK = 8  # block size used by the block-mode tests (small so several blocks fit in a short sequence)


def tiny_text_dict(**overrides: Any) -> dict[str, Any]:
    """Fields of a tiny Qwen3.5-MoE text config: 4 layers (GDN, full, GDN, full), GVA 2, 16 experts top-4."""
    text: dict[str, Any] = {
        "vocab_size": 257,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
    }
    text.update(overrides)
    return text


def tiny_config(model_type: str = "clover_moe", **overrides: Any) -> CloverConfig:
    """A parsed tiny config. Overrides that are CloverConfig switches (bd_*, coreset_*, moe_*) go in as such."""
    switches = {k: overrides.pop(k) for k in list(overrides) if k.startswith(("bd_", "coreset_", "moe_block_"))}
    if model_type == "qwen3_5_moe":
        data = {"model_type": model_type, "text_config": {"model_type": "qwen3_5_moe_text", **tiny_text_dict(**overrides)}}
    else:
        data = {"model_type": model_type, **tiny_text_dict(**overrides)}
    if model_type == "clover_moe":
        data["block_size"] = BLOCK
    cfg = parse_config(data)
    return cfg.with_overrides(**switches) if switches else cfg


def tiny_model(
    config: CloverConfig, seed: int = 0, clover_extras: bool | str = True, dtype: torch.dtype = torch.float32
) -> CloverModel:
    return model_from_state_dict(config, random_state_dict(config, seed=seed, clover_extras=clover_extras), dtype)


def greedy(model: CloverModel, prompt: torch.Tensor, steps: int) -> list[int]:
    """Prefill then single-token causal steps through the cache."""
    cache = model.new_cache(prompt.numel() + steps + 1)
    logits = model(prompt, 0, cache, last_only=True)
    out: list[int] = []
    for _ in range(steps):
        nxt = int(logits[-1].argmax())
        out.append(nxt)
        logits = model(torch.tensor([nxt]), cache.length, cache)
    return out


def one_thread() -> Iterator[None]:
    """Module fixture body: these tiny models run fastest on one intra-op thread (the CI box is shared)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class CountingBackend:
    """A torch.compile backend that counts the graphs it is handed and runs each as traced."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs += 1
        return gm.forward


class CancelAfter:
    """A progress callback for long work: it keeps every event in ``seen`` and sets ``cancel`` on the ``n``-th."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen: list[Any] = []
        self.cancel = threading.Event()

    def __call__(self, event: Any) -> None:
        self.seen.append(event)
        if len(self.seen) == self.n:
            self.cancel.set()
